"""One OpenMP team per process on CPU: work that torch runs on helper threads gets one intra-op thread.

On CPU, torch's intra-op parallelism is an OpenMP team owned by the thread that starts a parallel op. A
helper thread (torch_dist checkpoint I/O, gloo's work threads, a web server's request threads) that runs a
large enough op starts a second team; once a process holds more OpenMP threads than cores, libgomp stops
spinning between parallel regions and every later op pays a futex wake-up. Measured on 2 cores: the trainer's
64-sample forward went 61 -> 115 ms after one checkpoint load, and a whole GRPO step 0.88 -> 1.56 s.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_lock = threading.RLock()  # re-entrant: a guarded function may call another


@contextlib.contextmanager
def one_intraop_thread_for_helpers() -> Iterator[None]:
    """Run the enclosed work with one intra-op thread, on every device (one program for CPU and GPU; on a GPU the
    guarded phases' host work is mostly copies, its cost there not measured yet).

    The setting is process-wide, so this is for phases in which nothing else computes (checkpoint I/O,
    a paused engine's weight update)."""
    with _lock:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)
