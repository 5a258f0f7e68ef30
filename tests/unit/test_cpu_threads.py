"""Intra-op threads on CPU (`util/threads.py:cpu_threads`): the cores a process may use, shared out, and an operator's
`OMP_NUM_THREADS` obeyed; never the host's core count when an affinity mask (taskset, a cpuset) says fewer."""

from __future__ import annotations

import os

from kimi_pipeline.util.threads import cpu_threads, usable_cpus


def test_threads_share_out_the_usable_cpus_unless_omp_num_threads_says(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert usable_cpus() == len(os.sched_getaffinity(0))
    assert cpu_threads(1) == usable_cpus() and cpu_threads(usable_cpus() * 4) == 1
    assert cpu_threads(2, cpus=16) == 8  # a recipe's cluster.cpus_per_node
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads(1) == 3 and cpu_threads(2, cpus=16) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "")  # set but empty: as unset
    assert cpu_threads(1, cpus=4) == 4


def test_a_process_pinned_to_one_core_gets_one_thread(monkeypatch):
    """As under `taskset -c 0` on a many-core host: the affinity mask, not os.cpu_count(), decides."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert usable_cpus() == 1 and cpu_threads(1) == 1
