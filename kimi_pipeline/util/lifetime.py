"""Child processes never outlive the process that started them (Linux; a no-op elsewhere).

A SIGKILLed launcher cannot clean up, so each level arms itself instead: `die_with_parent` asks the
kernel for a signal when the parent dies (PR_SET_PDEATHSIG, kept across exec, cleared by fork, hence
`pass_to_forks` re-arms every forked child: megatron's checkpoint writer forks its file writers, which
otherwise keep writing into a directory the re-run has already cleaned). The kernel fires the signal
when the parent *thread* exits, so a child spawned by a short-lived thread (megatron spawns its result
queue's manager from the thread that first saves) uses `watch_parent`, which polls the parent pid.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1
BIND_VAR = "KIMI_DIE_WITH_PARENT"  # a launcher's request to a child of ours: `bind_to_parent` with this signal
_forks_armed = False
if sys.platform.startswith("linux"):  # loaded now: a preexec_fn must not import between fork and exec
    import ctypes

    _prctl = ctypes.CDLL(None, use_errno=True).prctl
else:
    _prctl = None


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent (thread) dies; False where unsupported.

    Safe between fork and exec (`Popen(preexec_fn=die_with_parent)`): one syscall, nothing imported.
    """
    if _prctl is None:
        return False
    return _prctl(_PR_SET_PDEATHSIG, int(sig)) == 0


def pass_to_forks(sig: int = signal.SIGKILL) -> None:
    """Every process forked from this one from now on dies with it too (idempotent)."""
    global _forks_armed
    if _forks_armed or not hasattr(os, "register_at_fork"):
        return
    os.register_at_fork(after_in_child=lambda: die_with_parent(sig))
    _forks_armed = True


def bind_to_parent(sig: int = signal.SIGKILL) -> None:
    """This process and every process it forks die with its parent; exits now if the parent is already gone.

    Call first thing in a process that a launcher started (a rank, a server): the parent may have died
    between our fork and this call, which the kernel would never report.
    """
    parent = os.getppid()
    die_with_parent(sig)
    pass_to_forks(sig)
    if os.getppid() != parent:
        os._exit(1)


def bound_env(env: dict[str, str], sig: int = signal.SIGKILL) -> dict[str, str]:
    """`env` for a child of ours (a module that calls `bind_to_parent_if_asked` first) that must die with the process
    starting it.

    Why not `Popen(preexec_fn=die_with_parent)`: with a preexec_fn CPython runs the at-fork callbacks in the parent
    after the fork (`_posixsubprocess.fork_exec` calls PyOS_AfterFork_Parent; logging releases its lock there), and an
    exception a signal handler raises inside one is printed as "ignored" and dropped: a Ctrl-C that arrived while
    `kimi run` started its conversion's agents vanished and the run converted on. Without a preexec_fn no Python runs
    in the parent around the fork. A manual launch (a user's shell runs the agent) does not ask: closing the shell
    must not kill the job."""
    return {**env, BIND_VAR: str(int(sig))}


def bind_to_parent_if_asked() -> None:
    """`bind_to_parent` with the launcher's signal when it asked (`bound_env`); the request is not passed on to this
    process's own children (each level decides for its own)."""
    sig = os.environ.pop(BIND_VAR, None)
    if sig is not None:
        bind_to_parent(int(sig))


def watch_parent(interval_s: float = 0.5) -> threading.Thread:
    """A daemon thread that exits this process once it is orphaned (its parent pid changes)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(interval_s)

    t = threading.Thread(target=watch, name="watch-parent", daemon=True)
    t.start()
    return t
