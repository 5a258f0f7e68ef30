"""The run guard stops what a run started even when a process starts a child while it is being stopped: that child,
re-parented once its parent exits, is no longer anyone's descendant and is found by the run's marker.

Each case runs an owner process of its own (`OWNER`: it takes a run guard, as the flow does, and starts a child that
spawns on SIGTERM), so the stops act only on what the test started."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import psutil
from support.common import ROOT
from support.processes import SPAWNS_ON_TERM

from kimi_pipeline.cluster.procs import MARKER_VAR, gone, marked_processes
from kimi_pipeline.cluster.run_guard import RUN_MARKER_VAR, run_processes

# argv: mode (once | unwind | die), run dir. Prints "<marker> <guard pid> <child pid>", then per mode:
# once: one listing of its descendants stopped, as before the marker (the cause); unwind: `stop_children` as `kimi
# run` calls it after its flow unwound; die: waits for the test's SIGKILL (the guard's own stop).
OWNER = """
import subprocess, sys, time
import psutil
from pathlib import Path
from kimi_pipeline.cluster import run_guard
from kimi_pipeline.cluster.procs import stop_processes
mode, run_dir = sys.argv[1], Path(sys.argv[2])
guard = run_guard.RunGuard(run_dir, poll_s=0.1)
child = subprocess.Popen([sys.executable, "-c", sys.argv[3]], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "ready"
print(guard.marker, guard.proc.pid, child.pid, flush=True)
if mode == "die":
    time.sleep(600)
guard.done()
if mode == "once":
    stop_processes(psutil.Process().children(recursive=True))
    print(0, flush=True)
else:
    print(run_guard.stop_children(grace_s=5.0), flush=True)
print(child.stdout.readline().strip(), flush=True)  # the pid of the child it started when stopped
"""


def _owner(mode: str, tmp_path) -> tuple[subprocess.Popen, str, int, int]:
    proc = subprocess.Popen([sys.executable, "-c", OWNER, mode, str(tmp_path), SPAWNS_ON_TERM], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    marker, guard, child = proc.stdout.readline().split()
    return proc, marker, int(guard), int(child)


def _left(marker: str, timeout_s: float = 10.0) -> list[int]:
    """The marker's live processes once what was stopped has had `timeout_s` to go."""
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in marked_processes(RUN_MARKER_VAR, marker).values() if not gone(p)]) and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    return sorted(p.pid for p in left)


def _kill_marked(marker: str) -> None:
    for p in marked_processes(RUN_MARKER_VAR, marker).values():
        p.kill()


def test_one_listing_of_descendants_leaves_the_child_started_during_the_stop(tmp_path):
    """The cause: the child's SIGTERM handler starts a grandchild; after one listing is stopped the grandchild runs
    on, re-parented, found only by the run's marker."""
    proc, marker, _, _ = _owner("once", tmp_path)
    try:
        assert proc.stdout.readline().strip() == "0"
        grandchild = int(proc.stdout.readline())
        assert proc.wait(timeout=30) == 0
        assert _left(marker, timeout_s=1.0) == [grandchild]
    finally:
        _kill_marked(marker)


def test_a_run_unwinding_stops_what_it_started_and_what_that_started_while_stopping(tmp_path):
    proc, marker, _, child = _owner("unwind", tmp_path)
    try:
        stopped = int(proc.stdout.readline())
        grandchild = int(proc.stdout.readline())
        assert proc.wait(timeout=30) == 0
        assert stopped == 2, (stopped, child, grandchild)  # the child, then its grandchild by the marker
        assert _left(marker) == []
    finally:
        _kill_marked(marker)


def test_the_guard_of_a_killed_owner_stops_what_it_started_and_what_that_started_while_stopping(tmp_path):
    """Killed at once, the owner usually dies while its guard is still importing (1-2 s): the guard then never saw
    it, and before the marker it returned having stopped nothing. A guard that watched the owner die takes the same
    way out (the reliability tests kill `kimi run` mid-conversion and mid-training)."""
    proc, marker, guard_pid, child = _owner("die", tmp_path)
    try:
        guard = psutil.Process(guard_pid)
        proc.kill()
        assert proc.wait(timeout=30) < 0
        guard.wait(timeout=60)
        assert _left(marker) == []
        log = (tmp_path / "run-guard.log").read_text()
        assert "stopped 2 process(es) it started (0 left)" in log, log
    finally:
        _kill_marked(marker)


def test_the_marker_never_reaches_the_ray_clusters_processes():
    """A cluster's process carries the run's marker too (it inherits the run's environment): one with the cluster's
    own marker, and a Ray worker by its title (its title can hide the cluster's marker), are left to the cluster."""
    marker = f"guard-{uuid.uuid4().hex}"
    env = {**os.environ, RUN_MARKER_VAR: marker}
    sleeping = "exec -a {} sleep 60"
    procs = {what: subprocess.Popen(["bash", "-c", sleeping.format(title)], env={**env, **extra})
             for what, title, extra in [("ours", "sleep", {}), ("cluster", "sleep", {MARKER_VAR: "c1"}),
                                        ("ray worker", "ray::PolicyWorker", {})]}
    try:
        deadline = time.monotonic() + 10
        while not all(psutil.Process(p.pid).cmdline()[:1] in (["sleep"], ["ray::PolicyWorker"])
                      for p in procs.values()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert set(run_processes(None, marker)) == {procs["ours"].pid}
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
