"""Turns at the engines: one pipeline stage's source rank at a time talks to the engines' weight-update groups.

Each pipeline stage's source rank has its own weight-update group with every engine rank (non-colocated sync).
An engine serves one group's call at a time (SGLang runs them on its scheduler loop), and a broadcast completes
only when every engine has entered it, so two sources broadcasting at once can deadlock: engine A inside stage 0's
broadcast, engine B inside stage 1's, each waiting for the other. The recipes' framework takes a lock around every
group call for that reason (radixark/miles `update_weight_from_distributed/broadcast.py`,
`_update_weight_implementation`: "Lock prevents NCCL deadlock"; it holds a Ray actor lock). Here the lock is a
ticket lock on the trainers' own rendezvous store (the store `init_process_group` made, shared by every trainer
rank): first come, first served, no extra process, and it works wherever the trainers' process group works.
"""

from __future__ import annotations

import time
from types import TracebackType

import torch.distributed as dist

POLL_S = 0.005


class EngineTurns:
    """A fair lock over `store` (a `torch.distributed.Store`) under `name`: `with turns:` waits for this
    process's ticket to be served. Every holder must release (the `with` block does, also on error)."""

    def __init__(self, name: str, store: dist.Store | None = None, timeout_s: float = 1800.0) -> None:
        # torch keeps the default group's store private; its one accessor is `_get_default_store`
        # (torch/distributed/distributed_c10d.py), what torch's own elastic and DDP helpers use
        self.store = store if store is not None else dist.distributed_c10d._get_default_store()
        self.name, self.timeout_s = name, timeout_s
        self.next_key, self.served_key = f"{name}/next", f"{name}/served"

    def __enter__(self) -> EngineTurns:
        ticket = self.store.add(self.next_key, 1)  # 1, 2, 3, ... across all holders
        deadline = time.monotonic() + self.timeout_s
        while (served := self.store.add(self.served_key, 0)) + 1 != ticket:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: ticket {ticket} not served in {self.timeout_s:.0f} s (turn {served + 1} "
                                   "is held: a source rank died or hangs while talking to the engines)")
            time.sleep(POLL_S)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.store.add(self.served_key, 1)
