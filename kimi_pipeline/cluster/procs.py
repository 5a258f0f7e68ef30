"""Finding and stopping exactly the Ray processes a run started (never another user's or run's Ray).

`ray stop` kills every Ray process of the user on the host, including other runs' clusters, so we
track our own: each `ray start` runs in a new session (its daemons keep that session id) and with a
marker variable in its environment (inherited by every descendant). Processes that rename themselves
(setproctitle clobbers /proc/PID/environ) are still caught by the session id and by descent.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable

import psutil

MARKER_VAR = "KIMI_RAY_CLUSTER_ID"
STOP_ROUNDS = 3  # passes of a stop: a pass can only miss what the one before it made start


def gone(p: psutil.Process) -> bool:
    """Exited, or a zombie (it holds nothing; hosts whose init does not reap keep them): never raises, as a process
    may exit while it is looked at."""
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _looks_like_ray(p: psutil.Process) -> bool:
    """Guard for session-id matches (a reused pid could start an unrelated session with that id)."""
    try:
        text = p.name() + " " + " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    return "ray" in text or "gcs_server" in text or "kimi_pipeline.cluster" in text


def ray_process(p: psutil.Process) -> bool:
    """A Ray daemon or worker, known by what it runs (unlike `_looks_like_ray`, no loose text match): a worker's title
    (`ray::…`) can overwrite part of its /proc environ and hide the cluster's marker. An unreadable process counts as
    Ray: callers use this to leave processes alone."""
    try:
        cmd = p.cmdline()
        name = p.name()
    except psutil.Error:
        return True
    return name in ("raylet", "gcs_server") or (bool(cmd) and cmd[0].startswith("ray::")) \
        or any("/site-packages/ray/" in part or part.endswith("/bin/ray") for part in cmd)


def _protected() -> set[int]:
    """This process and its ancestors: a teardown must never kill its caller."""
    me = psutil.Process()
    return {me.pid, *(a.pid for a in me.parents())}


def _user_processes(match: Callable[[psutil.Process], bool]) -> dict[int, psutil.Process]:
    """Live processes of this user, not this one or its ancestors, for which `match` holds (a process that exits
    or hides its environment while it is read is skipped)."""
    uid = os.getuid()
    protected = _protected()
    found: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["pid", "uids"]):
        try:
            if p.info["uids"] is None or p.info["uids"].real != uid or p.pid in protected or gone(p):
                continue
            if match(p):
                found[p.pid] = p
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, ProcessLookupError):
            continue
    return found


def marked_processes(var: str, value: str) -> dict[int, psutil.Process]:
    """Live processes of this user whose environment holds `var=value`: every process a marked one started, even
    after its parent was stopped and it was re-parented away from the tree it came from."""
    return _user_processes(lambda p: p.environ().get(var) == value)


def cluster_processes(marker: str | None, sids: Iterable[int] = ()) -> list[psutil.Process]:
    """Live processes of this user that carry `marker` (None: match by session only) or belong to one of `sids`,
    plus descendants."""
    sids = set(sids)

    def ours(p: psutil.Process) -> bool:
        if sids and os.getsid(p.pid) in sids and _looks_like_ray(p):
            return True
        return marker is not None and p.environ().get(MARKER_VAR) == marker

    found = _user_processes(ours)
    protected = _protected()
    for p in list(found.values()):
        try:
            for c in p.children(recursive=True):
                if c.pid not in protected and not gone(c):
                    found.setdefault(c.pid, c)
        except psutil.NoSuchProcess:
            continue
    return list(found.values())


def _terminate_and_wait(procs: list[psutil.Process], grace_s: float) -> None:
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and not all(gone(p) for p in procs):
        time.sleep(0.05)


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return ""


def stop_processes(procs: list[psutil.Process], grace_s: float = 5.0) -> dict[str, int]:
    """Raylets first (they stop their workers and agents and deregister in ~0.1 s while the GCS is up;
    with the GCS already gone a raylet waits ~10 s), then the rest; SIGKILL what outlives `grace_s`
    (the autoscaler monitor ignores SIGTERM).

    Zombies count as stopped: on hosts whose init does not reap, they linger but hold nothing.
    """
    raylets = [p for p in procs if _name(p) == "raylet"]
    _terminate_and_wait(raylets, grace_s)
    _terminate_and_wait([p for p in procs if not gone(p)], min(grace_s, 2.0))
    stubborn = [p for p in procs if not gone(p)]
    for p in stubborn:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and not all(gone(p) for p in stubborn):
        time.sleep(0.05)
    left = [p for p in procs if not gone(p)]
    return {"terminated": len(procs) - len(stubborn), "killed": len(stubborn) - len(left), "left": len(left)}


def stop_until_gone(find: Callable[[], list[psutil.Process]], grace_s: float = 5.0,
                    rounds: int = STOP_ROUNDS) -> dict[str, int]:
    """Stop what `find` lists, then look again, up to `rounds` passes: a process can start a child between the
    listing and its own SIGTERM (seen in CI: Ray's dashboard spawning its MetricsHead module and a multiprocessing
    helper while `kimi cluster down` stopped it), and that child outlives its parent. `processes` counts the
    distinct processes stopped over all passes; `left` is what is still there after the last pass."""
    total = {"processes": 0, "terminated": 0, "killed": 0, "left": 0}
    stopped: set[int] = set()
    for _ in range(rounds):
        procs = find()
        if not procs:
            return total
        counts = stop_processes(procs, grace_s=grace_s)
        stopped.update(p.pid for p in procs)
        total["processes"] = len(stopped)
        total["terminated"] += counts["terminated"]
        total["killed"] += counts["killed"]
    total["left"] = len(find())
    return total


def stop_cluster_processes(marker: str | None, sids: Iterable[int] = (), grace_s: float = 5.0,
                           rounds: int = STOP_ROUNDS) -> dict[str, int]:
    """Stop every process of one cluster (`stop_until_gone` over `cluster_processes`)."""
    sids = list(sids)
    return stop_until_gone(lambda: cluster_processes(marker, sids), grace_s, rounds)


def ray_processes_alive(pids: Iterable[int]) -> list[int]:
    """Which of `pids` are still running (not zombies): used by tests and the teardown report."""
    out = []
    for pid in pids:
        try:
            if not gone(psutil.Process(pid)):
                out.append(pid)
        except psutil.NoSuchProcess:
            continue
    return out
