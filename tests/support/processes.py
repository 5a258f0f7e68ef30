"""Processes in tests: reading ones a test cannot hold still (any may exit between a listing and a read), and a
process that starts a child while it is being stopped (the race a teardown must survive)."""

from __future__ import annotations

import psutil


def cmdline(p: psutil.Process) -> list[str]:
    """`p`'s command line, or [] where it exited since it was listed (or is not ours to read). Whether it still runs:
    `kimi_pipeline.cluster.procs.gone`."""
    try:
        return p.cmdline()
    except psutil.Error:
        return []


# `python -c SPAWNS_ON_TERM`: prints "ready"; on SIGTERM starts a sleeping child (inheriting the environment), prints
# its pid and exits, so the child is re-parented away from the tree a teardown listed.
SPAWNS_ON_TERM = """
import signal, subprocess, sys, time
def on_term(*_):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print(child.pid, flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
time.sleep(60)
"""
