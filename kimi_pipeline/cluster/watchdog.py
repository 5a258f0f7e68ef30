"""`python -m kimi_pipeline.cluster.watchdog --owner-pid PID --run-dir DIR`

Tears a run's embedded Ray cluster down when the process that owns it dies without doing so (killed
with SIGKILL, OOM, a crashed worker). The normal path (the flow's `finally`) stops the watchdog along
with the cluster, since it carries the cluster's marker.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import psutil

from kimi_pipeline.cluster.local import LocalCluster


def owner_alive(pid: int, create_time: float | None) -> bool:
    try:
        p = psutil.Process(pid)
        if create_time is not None and abs(p.create_time() - create_time) > 1.0:
            return False  # the pid was reused
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--owner-pid", type=int, required=True)
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--poll", type=float, default=1.0)
    args = ap.parse_args(argv)
    try:
        created: float | None = psutil.Process(args.owner_pid).create_time()
    except psutil.NoSuchProcess:
        created = None
    while owner_alive(args.owner_pid, created):
        cluster = LocalCluster.load(args.run_dir)
        if cluster is None or cluster.stopped or cluster.state.get("keep"):
            return 0
        time.sleep(args.poll)
    cluster = LocalCluster.load(args.run_dir)
    if cluster is not None and not cluster.stopped and not cluster.state.get("keep"):
        print(f"owner {args.owner_pid} is gone; stopping the embedded Ray cluster of {args.run_dir}", flush=True)
        print(cluster.stop(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
