"""Symbolic comparisons (math-verify/sympy) in worker processes, each under a hard wall-clock limit.

Why processes, not signals: sympy can spin inside C (big-integer powers, factorials) where
``signal.alarm`` never fires. Each comparison runs in a small worker process
(``python -m kimi_pipeline.reward --worker``) with a memory cap and a CPU-time safety net; one
that misses its deadline is SIGKILLed and replaced, and its outcome is "timeout".
Hand-written because ``concurrent.futures``/``multiprocessing.Pool`` cannot kill one stuck worker.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import resource
import select
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from pathlib import Path
from typing import Literal, Sequence

import kimi_pipeline
from kimi_pipeline.reward.reward_errors import RewardError
from kimi_pipeline.util.secret_env import without_secrets

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MEMORY_MB = 2048
WORKER_MODULE = "kimi_pipeline.reward"  # its __main__ runs main() below

Outcome = Literal["equal", "different", "timeout", "error"]


class _Worker:
    def __init__(self, memory_mb: int):
        env = without_secrets()  # a grader parses model output: it gets no secret to leak
        root = str(Path(kimi_pipeline.__file__).resolve().parents[1])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env[var] = "1"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", WORKER_MODULE, "--worker", "--memory-mb", str(memory_mb)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            bufsize=0,
            close_fds=True,
        )
        self.fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        self.buf = b""
        self.ready = False
        self.started = time.monotonic()

    def send(self, gold: str, pred: str, timeout_s: float) -> None:
        msg = json.dumps({"gold": gold, "pred": pred, "timeout_s": timeout_s}) + "\n"
        self.proc.stdin.write(msg.encode())  # type: ignore[union-attr]

    def read_lines(self) -> list[str] | None:
        """Complete lines available now; None on EOF (the worker died)."""
        chunk = os.read(self.fd, 65536)
        if not chunk:
            return None
        self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n")
        return [ln.decode() for ln in lines]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()  # type: ignore[union-attr]
            except OSError:
                pass
        self.proc.wait()


def _poll(fds: list[int], timeout_s: float) -> list[int]:
    """Readable fds (poll, not select: a trainer process may hold fds above FD_SETSIZE)."""
    if not fds:
        time.sleep(timeout_s)
        return []
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    return [fd for fd, _ in poller.poll(max(0, int(timeout_s * 1000) + 1))]


def _kill_all(workers: list[_Worker]) -> None:
    for w in workers:
        w.kill()
    workers.clear()


class SymbolicPool:
    """math-verify comparisons in worker processes, each under a hard wall-clock limit."""

    def __init__(self, workers: int = 2, memory_mb: int = DEFAULT_MEMORY_MB, start_timeout_s: float = 60.0):
        if workers < 1:
            raise RewardError(f"reward workers must be >= 1, got {workers}")
        self.size, self.memory_mb, self.start_timeout_s = workers, memory_mb, start_timeout_s
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self.restarts = 0
        self._finalizer = weakref.finalize(self, _kill_all, self._workers)

    def close(self) -> None:
        with self._lock:
            _kill_all(self._workers)

    def pids(self) -> list[int]:
        """Process ids of the workers the pool holds now (empty before the first comparison and after close).
        Observable state rather than timing: a caller sees that a stuck worker was replaced (its pid gone)."""
        with self._lock:
            return [w.proc.pid for w in self._workers]

    def _spawn(self) -> _Worker:
        w = _Worker(self.memory_mb)
        self._workers.append(w)
        return w

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self._workers.remove(w)
        self.restarts += 1
        self._spawn()

    def compare(self, pairs: Sequence[tuple[str, str]], timeout_s: float) -> list[Outcome]:
        """For each (gold, pred): "equal", "different", "timeout" or "error"."""
        with self._lock:
            while len(self._workers) < min(self.size, max(1, len(pairs))):
                self._spawn()
            return self._run(pairs, timeout_s)

    def _run(self, pairs: Sequence[tuple[str, str]], timeout_s: float) -> list[Outcome]:
        results: list[Outcome | None] = [None] * len(pairs)
        todo = deque(range(len(pairs)))
        busy: dict[_Worker, tuple[int, float]] = {}
        while todo or busy:
            now = time.monotonic()
            for w in list(self._workers):
                if w.ready and w not in busy and todo:
                    i = todo.popleft()
                    try:
                        w.send(*pairs[i], timeout_s)
                        busy[w] = (i, now + timeout_s)
                    except OSError:  # died while idle (e.g. killed from outside): replace and retry
                        todo.appendleft(i)
                        self._replace(w)
            deadlines = [d for _, d in busy.values()]
            deadlines += [w.started + self.start_timeout_s for w in self._workers if not w.ready]
            wait = max(0.0, min(deadlines) - time.monotonic()) if deadlines else 0.0
            by_fd = {w.fd: w for w in self._workers if not w.ready or w in busy}
            readable = _poll(list(by_fd), wait)
            for fd in readable:
                w = by_fd[fd]
                lines = w.read_lines()
                if lines is None:
                    if not w.ready:
                        self._kill_all_and_raise(
                            "a reward worker exited during start-up; run "
                            f"`{sys.executable} -m {WORKER_MODULE} --worker` to see why"
                        )
                    i, _ = busy.pop(w)
                    results[i] = "error"
                    self._replace(w)
                    continue
                for line in lines:
                    if line == "ready":
                        w.ready = True
                    elif w in busy:
                        i, _ = busy.pop(w)
                        reply = json.loads(line)
                        results[i] = "error" if "error" in reply else ("equal" if reply["eq"] else "different")
            now = time.monotonic()
            for w, (i, deadline) in list(busy.items()):
                if now >= deadline:
                    busy.pop(w)
                    results[i] = "timeout"
                    self._replace(w)
            for w in self._workers:
                if not w.ready and now >= w.started + self.start_timeout_s:
                    self._kill_all_and_raise(f"a reward worker did not start within {self.start_timeout_s:.0f} s")
        return [r or "error" for r in results]

    def _kill_all_and_raise(self, msg: str):
        _kill_all(self._workers)
        raise RewardError(msg)


# ----------------------------------------------------------------------------------------------
# Worker side
# ----------------------------------------------------------------------------------------------


def _symbolic_equal(gold: str, pred: str) -> bool:
    from math_verify import parse, verify

    g = parse(f"${gold}$", parsing_timeout=None)
    p = parse(f"${pred}$", parsing_timeout=None)
    if not g or not p:
        return False
    return bool(verify(g, p, timeout_seconds=None))


def _worker_main(memory_mb: int) -> None:
    """Serve JSON-line requests on stdin. The parent enforces the wall-clock limit by SIGKILL; the
    address-space cap turns a giant allocation into a MemoryError, and a per-request CPU-time limit
    (SIGXCPU) ends a spinning worker even if its parent is already gone."""

    if memory_mb > 0:
        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    logging.disable(logging.WARNING)  # math-verify warns that its own (signal) timeouts are off
    _symbolic_equal("1", "1")  # warm up (imports sympy) before "ready": start-up is not charged to a request

    out = sys.stdout
    out.write("ready\n")
    out.flush()
    _, cpu_hard = resource.getrlimit(resource.RLIMIT_CPU)
    for line in sys.stdin:
        req = json.loads(line)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        soft = math.ceil(usage.ru_utime + usage.ru_stime + 2 * float(req.get("timeout_s", DEFAULT_TIMEOUT_S)) + 2)
        if cpu_hard == resource.RLIM_INFINITY or soft < cpu_hard:
            resource.setrlimit(resource.RLIMIT_CPU, (soft, cpu_hard))
        try:
            reply: dict = {"eq": _symbolic_equal(req["gold"], req["pred"])}
        except MemoryError:
            reply = {"error": "MemoryError"}
        except Exception as e:  # noqa: BLE001 - any parser failure is a wrong answer, reported as such
            reply = {"error": f"{type(e).__name__}: {e}"[:200]}
        out.write(json.dumps(reply) + "\n")
        out.flush()


def main(argv: Sequence[str] | None = None) -> None:
    """The worker's command line: ``python -m kimi_pipeline.reward --worker [--memory-mb N]``."""
    ap = argparse.ArgumentParser(
        prog=f"python -m {WORKER_MODULE}", description="kimi-pipeline reward worker (speaks JSON lines on stdin/stdout)"
    )
    ap.add_argument("--worker", action="store_true", required=True)
    ap.add_argument("--memory-mb", type=int, default=DEFAULT_MEMORY_MB)
    _worker_main(ap.parse_args(argv).memory_mb)
