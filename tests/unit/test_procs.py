"""Stopping a cluster's processes when one of them starts a child while it is being stopped (CI saw Ray's dashboard
spawn its MetricsHead module during `kimi cluster down`; the child outlived the listing and its parent)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

from support.processes import SPAWNS_ON_TERM

from kimi_pipeline.cluster.procs import (
    MARKER_VAR,
    cluster_processes,
    ray_processes_alive,
    stop_cluster_processes,
    stop_processes,
)


def _start(marker: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", SPAWNS_ON_TERM], env={**os.environ, MARKER_VAR: marker},
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _kill_marked(marker: str) -> None:
    for p in cluster_processes(marker):
        p.kill()


def test_one_pass_leaves_a_child_started_during_the_stop():
    """The cause: one listing, one stop; the child started in the SIGTERM handler is not in the listing."""
    marker = f"procs-{uuid.uuid4().hex}"
    proc = _start(marker)
    try:
        counts = stop_processes(cluster_processes(marker), grace_s=5.0)
        assert counts["left"] == 0  # what was listed is gone
        child = int(proc.stdout.readline())
        proc.wait(timeout=10)
        assert [p.pid for p in cluster_processes(marker)] == [child]
    finally:
        _kill_marked(marker)


def test_stopping_a_cluster_looks_again_until_nothing_is_left():
    marker = f"procs-{uuid.uuid4().hex}"
    proc = _start(marker)
    try:
        counts = stop_cluster_processes(marker, grace_s=5.0)
        child = int(proc.stdout.readline())
        proc.wait(timeout=10)
        assert counts["left"] == 0 and counts["processes"] == 2, counts
        deadline = time.monotonic() + 5
        while ray_processes_alive([child]):
            assert time.monotonic() < deadline, f"child {child} still runs"
            time.sleep(0.05)
        assert cluster_processes(marker) == []
    finally:
        _kill_marked(marker)
