"""One run per run directory: an exclusive lock on `<run_dir>/.run.lock`, held for a run's whole life.

Two runs sharing a directory delete each other's temp directories, reuse and then tear down each other's Ray
cluster and interleave their summaries, so the second one must fail at once, naming the first.

Why `flock`: the kernel drops the lock when the holder's process dies (kill -9 included), so a dead run never
leaves a stale lock behind, and no pid liveness guess is needed. (On NFSv4, Linux takes it as a byte-range lock
the server holds under a lease, so it also excludes a run on another host that shares the directory.) The lock
file also says who holds it (host, pid, flow run id, start time): a holder clears that text when it lets go, so
text found by a run that gets the lock is a dead holder's, and it is named in a warning when taken over.

A holder in this process may take the lock again (Prefect runs a flow run's retries in the same process), as long
as it is the same flow run: the lock counts how often it is held and is released when the last holder lets go.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kimi_pipeline.errors import PermanentError

log = logging.getLogger(__name__)

LOCK_FILE = ".run.lock"


class RunDirBusy(PermanentError):
    """Another live run holds the run directory."""


@dataclass
class _Held:
    fd: int
    owner: str | None
    depth: int


_HELD: dict[Path, _Held] = {}
_GUARD = threading.Lock()


def _describe(holder: dict) -> str:
    parts = [f"host {holder.get('host', '?')}", f"pid {holder.get('pid', '?')}"]
    if holder.get("flow_run_id"):
        parts.append(f"flow run {holder['flow_run_id']}")
    if holder.get("started"):
        parts.append(f"since {holder['started']}")
    if holder.get("command"):
        parts.append(f"command `{holder['command']}`")
    return ", ".join(parts)


def _read_holder(fd: int) -> dict:
    text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    if not text:
        return {}
    try:
        holder = json.loads(text)
    except ValueError:
        return {"host": "?", "pid": "?", "command": text[:120]}
    return holder if isinstance(holder, dict) else {}


def _busy(run_dir: Path, holder: dict) -> RunDirBusy:
    who = _describe(holder) if holder else "a run that is still starting (no holder written yet)"
    return RunDirBusy(f"run directory {run_dir} is in use by another run ({who}): wait for it to end or stop it, "
                      f"or give this run another --run-dir (a run directory holds one run at a time)")


def take(run_dir: str | Path, owner: str | None = None) -> None:
    """Take the run directory's lock for `owner` (a flow run id; None for a CLI command) or raise RunDirBusy naming
    the live holder. Taking a lock this process already holds for the same owner only counts it once more."""
    path = Path(run_dir).resolve()
    with _GUARD:
        held = _HELD.get(path)
        if held is not None:
            if held.owner != owner:
                raise _busy(path, _read_holder(held.fd))
            held.depth += 1
            return
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise _busy(path, holder) from None
        previous = _read_holder(fd)
        if previous:
            log.warning("run directory %s: its last holder (%s) died without letting go; taking it over", path,
                        _describe(previous))
        me = {"host": socket.gethostname(), "pid": os.getpid(), "flow_run_id": owner,
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join(sys.argv)[:200]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        _HELD[path] = _Held(fd, owner, 1)


def _drop(path: Path) -> None:
    """Let go of the lock on `path` whatever its count (the caller holds _GUARD)."""
    held = _HELD.pop(path)
    try:
        os.ftruncate(held.fd, 0)  # a cleared file tells the next holder this run let go cleanly
    finally:
        os.close(held.fd)


def release(run_dir: str | Path) -> None:
    """Let go of one hold; the last one clears the holder text and drops the lock. A no-op when not held here."""
    path = Path(run_dir).resolve()
    with _GUARD:
        held = _HELD.get(path)
        if held is None:
            return
        held.depth -= 1
        if held.depth == 0:
            _drop(path)


def release_owner(owner: str) -> None:
    """Drop every hold of `owner` (a flow run's final-state hook: its retries are over)."""
    with _GUARD:
        for path in [p for p, h in _HELD.items() if h.owner == owner]:
            _drop(path)


def held_elsewhere(run_dir: str | Path) -> bool:
    """Whether another process holds the run directory now (a hook deciding where it may write)."""
    path = Path(run_dir).resolve()
    with _GUARD:
        if path in _HELD:
            return False
    try:
        fd = os.open(path / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the probe's shared lock
    return False
