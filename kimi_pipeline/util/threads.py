"""One OpenMP team per process on CPU: work that torch runs on helper threads gets one intra-op thread.

On CPU, torch's intra-op parallelism is an OpenMP team owned by the thread that starts a parallel op. A
helper thread (torch_dist checkpoint I/O, gloo's work threads, a web server's request threads) that runs a
large enough op starts a second team; once a process holds more OpenMP threads than cores, libgomp stops
spinning between parallel regions and every later op pays a futex wake-up. Measured on 2 cores: the trainer's
64-sample forward went 61 -> 115 ms after one checkpoint load, and a whole GRPO step 0.88 -> 1.56 s.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import torch

_lock = threading.RLock()  # re-entrant: a guarded function may call another


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask (`taskset`, a container's or Slurm's cpuset), not the
    host's count (`os.cpu_count`), which over-counts in all of those and so oversubscribes the cores it has."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity API on this platform
        return os.cpu_count() or 1


def cpu_threads(processes: int, cpus: int | None = None) -> int:
    """Torch intra-op threads for each of `processes` CPU processes sharing one node: `OMP_NUM_THREADS` when set
    (the operator's cap, as OpenMP itself reads it), else `cpus` (a recipe's `cluster.cpus_per_node`) or the
    usable CPUs, shared out. More OpenMP threads than cores is the costliest mistake on CPU: a team whose threads
    wait for a descheduled peer spins through its time slice. Measured on 2 cores, two tiny `kimi run`s side by
    side: 18-20 s per GRPO step at 2 threads each, 4 s at 1 (as fast as one run alone at 2)."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        return int(os.environ["OMP_NUM_THREADS"])
    return max(1, (cpus or usable_cpus()) // max(1, processes))


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
