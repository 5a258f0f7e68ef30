"""`python -m kimi_pipeline.cluster.run_guard --owner-pid PID --run-dir DIR`: nothing a run started outlives it.

A flow process killed with SIGKILL (or OOM-killed) runs no `finally`, no `atexit`: its temporary Prefect API
server, its weight-job agents and anything else it started would be orphaned, and summary.json would say a stage
is still running. This guard, a detached process started when the run takes its directory, watches the owner:

- while the owner lives it remembers the owner's descendants every `--poll` seconds (after the owner dies they
  are reparented and can no longer be told apart by descent);
- when the owner dies, it stops those still alive (SIGTERM, then SIGKILL after a grace period; a pid is matched
  with its start time, so a reused pid is never hit), and marks every stage summary.json has as running as failed,
  `interrupted`, saying how to resume.

Every process the run starts after the guard inherits `KIMI_RUN_ID` (`RUN_MARKER_VAR`, set in the owner's
environment by `RunGuard`), so a stop looks again after each pass and finds by it what descent no longer shows: a
child started while its parent was being stopped, re-parented once the parent is gone (the same race that left a
dashboard child behind a cluster's teardown; both stop with `procs.stop_until_gone`).

The embedded Ray cluster is not its business: the cluster's own watchdog (`cluster/watchdog.py`) tears it down,
and keeps it when the recipe says `cluster.keep`, so processes carrying the cluster's marker are left to it.
The owner ends the guard on a normal exit by writing `done` to its stdin; EOF without `done` means it died.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil

from kimi_pipeline.cluster.procs import MARKER_VAR, gone, marked_processes, ray_process, stop_until_gone
from kimi_pipeline.report.summary import RunSummary
from kimi_pipeline.util.secret_env import without_secrets

DONE = b"done\n"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
PREFECT_SERVER_APP = "prefect.server.api.server:create_app"  # the temporary API server's uvicorn factory
RUN_MARKER_VAR = "KIMI_RUN_ID"  # inherited by every process a run starts after its guard: found after re-parenting


class RunStopped(KeyboardInterrupt):
    """SIGTERM / SIGHUP of the run's process, raised where it waits, so that the run unwinds as on Ctrl-C: the
    flow's `finally` stops its cluster, then `stop_children` and atexit stop what else it started."""


def stop_on_signals() -> None:
    """SIGTERM and SIGHUP stop this process as SIGINT does (Python's default for them exits without unwinding:
    no `finally`, no atexit, so the temporary Prefect server and the cluster were left running)."""

    def stop(signum: int, frame) -> None:
        raise RunStopped(f"stopped by {signal.Signals(signum).name}: re-run with the same --run-dir to resume")

    for sig in STOP_SIGNALS:
        signal.signal(sig, stop)


def _prefect_server(p: psutil.Process) -> bool:
    try:
        return PREFECT_SERVER_APP in " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def stop_children(grace_s: float = 5.0) -> int:
    """Stop every process this one started that is still alive (not the Ray cluster's: its watchdog owns them; not
    the temporary Prefect server: Prefect stops it at exit, after its log handler has sent the last lines);
    returns how many. Called by a run unwinding from a signal or a failure, after its flow has ended."""
    me, marker = psutil.Process(), os.environ.get(RUN_MARKER_VAR)
    counts = stop_until_gone(lambda: [p for p in run_processes(me, marker).values() if not _prefect_server(p)],
                             grace_s)
    return counts["processes"]


def run_processes(owner: psutil.Process | None, marker: str | None) -> dict[int, psutil.Process]:
    """What the run started that is alive now: `owner`'s descendants, and the processes carrying the run's marker
    (re-parented ones too); never this process, its ancestors or the Ray cluster's processes."""
    found = _descendants(owner) if owner is not None else {}
    for pid, p in (marked_processes(RUN_MARKER_VAR, marker) if marker else {}).items():
        if pid not in found and not _cluster_process(p) and not ray_process(p):
            found[pid] = p
    return found


def _cluster_process(p: psutil.Process) -> bool:
    try:
        return MARKER_VAR in p.environ()
    except psutil.Error:  # exited, or not ours to read: nothing to stop
        return True


def _descendants(owner: psutil.Process) -> dict[int, psutil.Process]:
    """The owner's descendants now, without the guard itself and the Ray cluster's processes."""
    try:
        children = owner.children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    return {p.pid: p for p in children if p.pid != os.getpid() and not _cluster_process(p)}


def mark_interrupted(run_dir: Path, owner_pid: int) -> list[str]:
    """Every stage summary.json has as running becomes failed + interrupted; returns their names."""
    summary = RunSummary(run_dir)
    running = [name for name, s in summary.read().get("stages", {}).items() if s.get("status") == "running"]
    for name in running:
        summary.set_stage(name, "failed", None, interrupted=True,
                          error=f"the run's process (pid {owner_pid} on {socket.gethostname()}) died while this stage "
                                f"ran (killed or out of memory); nothing it started is left: re-run with the same "
                                f"run directory to resume (training from its last checkpoint)")
    return running


def watch(owner_pid: int, run_dir: Path, poll_s: float, stop_fd: int | None) -> int:
    try:
        owner: psutil.Process | None = psutil.Process(owner_pid)
    except psutil.NoSuchProcess:  # died while this guard was still importing: what it started is found by the marker
        owner = None
    seen: dict[int, psutil.Process] = {}
    marker = os.environ.get(RUN_MARKER_VAR)  # the owner's, inherited
    while owner is not None and not gone(owner):
        seen = {pid: p for pid, p in seen.items() if not gone(p)} | _descendants(owner)
        if stop_fd is not None:
            ready, _, _ = select.select([stop_fd], [], [], poll_s)
            if ready:
                data = os.read(stop_fd, 64)
                if data.startswith(DONE.strip()):
                    return 0  # the owner ended normally and has cleaned up
                if not data:
                    stop_fd = None  # EOF: the owner is dying; confirm by its pid on the next turn
        else:
            time.sleep(poll_s)
    counts = stop_until_gone(lambda: list(({pid: p for pid, p in seen.items() if not gone(p)}
                                           | run_processes(None, marker)).values()))
    stages = mark_interrupted(run_dir, owner_pid) if (run_dir / "summary.json").is_file() else []
    print(f"owner {owner_pid} died: stopped {counts['processes']} process(es) it started ({counts['left']} left); "
          f"stages marked interrupted: {stages or 'none'}", flush=True)
    return 0


class RunGuard:
    """The owner's handle on its guard: `start` when the run takes its directory, `done` when it ends cleanly."""

    def __init__(self, run_dir: Path, poll_s: float = 0.5):
        # a fresh marker for this run, kept in this process's environment after `done` (a run's unwinding, in
        # `stop_children`, still reads it); the guard and everything started from here on inherit it
        self.marker = os.environ[RUN_MARKER_VAR] = f"{os.getpid()}-{uuid.uuid4().hex}"
        log_path = Path(run_dir) / "run-guard.log"
        with open(log_path, "a") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kimi_pipeline.cluster.run_guard", "--owner-pid", str(os.getpid()),
                 "--run-dir", str(run_dir), "--poll", str(poll_s)],
                stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, env=without_secrets(),
                start_new_session=True,  # a terminal's Ctrl-C (its process group) must not stop the guard too
            )

    def done(self) -> None:
        """The run ended in this process (normally, or unwinding an error or a signal): the guard has nothing to do."""
        if self.proc.stdin is None or self.proc.stdin.closed:
            return
        try:
            self.proc.stdin.write(DONE)
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--owner-pid", type=int, required=True)
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--poll", type=float, default=0.5)
    args = ap.parse_args(argv)
    return watch(args.owner_pid, args.run_dir, args.poll, sys.stdin.fileno())


if __name__ == "__main__":
    raise SystemExit(main())
