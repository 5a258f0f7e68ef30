"""The fault gates a test's Ray workers install (Ray's `worker_process_setup_hook` takes one callable)."""

from __future__ import annotations

from support import engine_gate, save_gate


def install() -> None:
    save_gate.install()
    engine_gate.install()
