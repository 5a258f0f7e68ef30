"""Rule-based math rewards (0/1) that a policy cannot hang, crash or fool with a sloppy answer.

Two variants (recipe field `rollout.rm_type`):

* ``math`` (DAPO-style): the final ``\\boxed{X}`` (or, failing that, a last line ``Answer: X``),
  compared with the label by normalized string or exact numeric value (``\\frac{1}{2}`` = ``0.5``).
  No symbolic engine: cheap and deterministic, enough for integer labels (DAPO-Math-17k, AIME).
* ``deepscaler``: the final ``\\boxed{X}`` only; same fast checks, then symbolic equality with
  math-verify (sympy) in worker processes under a hard time limit.

Where the answer is read (the seeds' deepscaler semantics by default):

1. The answer region: the text after the last ``</think>``. With ``deepscaler`` and no ``</think>``, the
   text after ``###Response`` (as upstream deepscaler splits). A ``thinking=True`` response with neither
   gets 0 (it never answered); ``thinking=False`` grades the whole response.
2. Only the last ``MAX_TAIL_CHARS`` characters of the region are searched (megabytes of text cost nothing).
3. Default (``strict=False``, the seeds' behaviour): the last ``\\boxed{…}`` of the region by brace
   matching, whatever follows it (``… \\boxed{5}. I hope this helps!`` scores). ``math`` falls back to a
   last line ``Answer: X`` when there is no box. ``strict=True`` (recipe ``rollout.reward_strict``) is an
   explicit, stricter option: the region must END with the boxed answer — after it only whitespace,
   end-of-turn special tokens (``<|im_end|>``, ``[EOS]``, ``</s>``), closing math delimiters
   (``$``, ``\\]``, ``\\)``) and at most ``MAX_TRAILER_CHARS`` of ``.,;!*``; braces are matched backwards
   from the end, so ``\\boxed{9}}}}`` earns 0 (a policy can learn to spam braces under a loose parser).
4. A boxed answer longer than ``MAX_ANSWER_CHARS`` earns 0 without being parsed.

Why processes, not signals: sympy can spin inside C (big-integer powers, factorials) where
``signal.alarm`` never fires. Each symbolic comparison runs in a small worker process
(``python -m kimi_pipeline.rl.reward --worker``) with a memory cap and a CPU-time safety net; one
that misses its deadline is SIGKILLed and replaced, and the grade is 0, counted in ``stats.timeouts``.
Hand-written because ``concurrent.futures``/``multiprocessing.Pool`` cannot kill one stuck worker.
"""

from __future__ import annotations

import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import asdict, dataclass, fields
from fractions import Fraction
from pathlib import Path
from typing import Literal, Sequence

from kimi_pipeline.errors import PermanentError

log = logging.getLogger(__name__)

RmType = Literal["math", "deepscaler"]
RM_TYPES: tuple[str, ...] = ("math", "deepscaler")
THINK_CLOSE = "</think>"
RESPONSE_MARK = "###Response"  # upstream deepscaler's split when there is no </think>
MAX_TAIL_CHARS = 4096
MAX_ANSWER_CHARS = 256
MAX_LABEL_CHARS = 1024
MAX_TRAILER_CHARS = 8
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MEMORY_MB = 2048


class RewardError(PermanentError):
    """Bad reward configuration, or the grading workers cannot start in this environment."""


# ----------------------------------------------------------------------------------------------
# Extraction
# ----------------------------------------------------------------------------------------------

_END_TOKEN = re.compile(r"(?:<\|[A-Za-z0-9_]{1,32}\|>|\[EOS\]|\[PAD\]|</s>)\Z")
_BOX_COMMANDS = ("\\boxed", "\\fbox")
_ANSWER_LINE = re.compile(r"\s*(?:\*\*)?answer\s*(?:\*\*)?\s*:\s*(?:\*\*)?\s*(.+?)\s*", re.IGNORECASE)


def _answer_region(response: str, thinking: bool, rm_type: str = "math") -> str | None:
    """The part of a response that may hold the final answer (None: a thinking model never answered)."""
    cut, mark = response.rfind(THINK_CLOSE), THINK_CLOSE
    if cut < 0 and rm_type == "deepscaler":
        cut, mark = response.rfind(RESPONSE_MARK), RESPONSE_MARK
    if cut < 0:
        return None if thinking else response[-MAX_TAIL_CHARS:]
    return response[cut + len(mark) :][-MAX_TAIL_CHARS:]


def _strip_end_tokens(s: str) -> str:
    while True:
        t = s.rstrip()
        m = _END_TOKEN.search(t[-40:])
        if m:
            t = t[: len(t) - len(m.group())]
        if t == s:
            return s
        s = t


def _strip_trailer(s: str) -> str | None:
    """Drop what may legitimately follow a final answer; None if too much punctuation follows."""
    s = s.rstrip()
    end, budget = len(s), MAX_TRAILER_CHARS
    while end > 0:
        c = s[end - 1]
        if c.isspace():
            end -= 1
            continue
        if c in ".,;!*$":
            step = 1
        elif c in "])" and end >= 2 and s[end - 2] == "\\":
            step = 2
        else:
            break
        budget -= 1
        if budget < 0:
            return None
        end -= step
    return s[:end]


def _escaped(s: str, i: int) -> bool:
    return i > 0 and s[i - 1] == "\\"


def _final_boxed(s: str) -> str | None:
    """Content of the ``\\boxed{…}`` that ends ``s``, by backward brace matching (strict)."""
    if not s.endswith("}") or _escaped(s, len(s) - 1):
        return None
    depth, i, lo = 0, len(s) - 1, max(0, len(s) - MAX_ANSWER_CHARS - 2)
    while i >= lo:
        c = s[i]
        if c in "{}" and not _escaped(s, i):
            depth += 1 if c == "}" else -1
            if depth == 0:
                break
        i -= 1
    else:
        return None  # unbalanced, or the answer is longer than MAX_ANSWER_CHARS
    before = s[max(0, i - 16) : i].rstrip()
    if not before.endswith(_BOX_COMMANDS):
        return None
    return s[i + 1 : len(s) - 1]


def _braced_after(s: str, j: int) -> tuple[str, int] | None:
    """(content, end index) of the ``{…}`` group opening at ``s[j]`` (after spaces), bounded in length."""
    while j < len(s) and s[j] == " ":
        j += 1
    if j >= len(s) or s[j] != "{":
        return None
    depth, k = 0, j
    stop = min(len(s), j + MAX_ANSWER_CHARS + 2)
    while k < stop:
        c = s[k]
        if c in "{}" and not _escaped(s, k):
            depth += 1 if c == "{" else -1
            if depth == 0:
                return s[j + 1 : k], k
        k += 1
    return None


def _last_boxed_anywhere(s: str) -> str | None:
    """Content of the last ``\\boxed{…}`` wherever it is (upstream deepscaler behaviour)."""
    start = max(s.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    group = _braced_after(s, start + (len("\\boxed") if s.startswith("\\boxed", start) else len("\\fbox")))
    return group[0] if group else None


def extract_answer(
    response: str, rm_type: RmType = "math", thinking: bool = False, strict: bool = False
) -> str | None:
    """The final answer a response commits to (raw LaTeX), or None if it gives none we accept."""
    _check_rm_type(rm_type)
    region = _answer_region(response, thinking, rm_type)
    if region is None:
        return None
    body = _strip_end_tokens(region)
    if not strict:
        answer = _last_boxed_anywhere(body)
    else:
        body = _strip_trailer(body)
        if body is None:
            return None
        answer = _final_boxed(body)
    if answer is None and rm_type == "math":  # DAPO's plain "Answer: X" last line
        body = body.rstrip()
        last_line = body[body.rfind("\n") + 1 :]
        m = _ANSWER_LINE.fullmatch(last_line[-(MAX_ANSWER_CHARS + 32) :])
        answer = m.group(1).strip().strip("$").strip().rstrip(".").strip("$").strip() if m else None
    if answer is None or len(answer) > MAX_ANSWER_CHARS or not answer.strip():
        return None
    return answer


# ----------------------------------------------------------------------------------------------
# Normalization and the in-process checks
# ----------------------------------------------------------------------------------------------

_SIMPLE_REPLACEMENTS = (
    ("\\dfrac", "\\frac"),
    ("\\tfrac", "\\frac"),
    ("\\left", ""),
    ("\\right", ""),
    ("\\displaystyle", ""),
    ("^{\\circ}", ""),
    ("^\\circ", ""),
    ("\\%", ""),
    ("%", ""),
    ("\\$", ""),
    ("$", ""),
    ("\\!", ""),
    ("\\,", " "),
    ("\\;", " "),
    ("\\:", " "),
    ("\\ ", " "),
    ("~", " "),
    ("{,}", ""),
    ("\n", " "),
)
_UNIT_SUFFIX = re.compile(r"(.+?)\s*\\(?:text|mbox)\{(?:\s+[A-Za-z]|\s*[A-Za-z]{2,})[A-Za-z\s]*\}")  # 5\text{ cm}
_TEXT_CMD = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_CMD_SPACE = re.compile(r"(\\[A-Za-z]+)\s+(?=[A-Za-z])")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_DECIMAL = re.compile(r"[+-]?(?:\d{1,40}(?:\.\d{0,40})?|\.\d{1,40})")
_LATEX_FRAC = re.compile(r"([+-]?)\\frac\{([+-]?\d{1,40})\}\{([+-]?\d{1,40})\}")
_SLASH_FRAC = re.compile(r"([+-]?\d{1,40})/([+-]?\d{1,40})")
_CHOICE = re.compile(r"\(([A-Za-z])\)")


def _unwrap_box(s: str) -> str:
    """``\\boxed{\\boxed{7}}`` -> ``7`` (only when the box spans the whole string)."""
    for _ in range(8):
        s = s.strip()
        cmd = next((c for c in _BOX_COMMANDS if s.startswith(c)), None)
        group = _braced_after(s, len(cmd)) if cmd else None
        if group is None or group[1] != len(s) - 1:
            return s
        s = group[0]
    return s


def normalize_answer(s: str) -> str:
    """Canonical string for comparison (Hendrycks/DAPO-style), careful not to merge ``\\pi r`` into ``\\pir``."""
    s = _unwrap_box(str(s)[:MAX_LABEL_CHARS])
    for a, b in _SIMPLE_REPLACEMENTS:
        s = s.replace(a, b)
    s = s.strip()
    m = _UNIT_SUFFIX.fullmatch(s)
    if m:
        s = m.group(1)
    for _ in range(4):
        t = _TEXT_CMD.sub(r"\1", s)
        if t == s:
            break
        s = t
    s = _CMD_SPACE.sub("\\1\x00", s)
    s = re.sub(r"\s+", "", s).replace("\x00", " ")
    parts = s.split("=")
    if len(parts) == 2 and 0 < len(parts[0]) <= 2:
        s = parts[1]  # "x=5" -> "5"
    s = s.rstrip(".")
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\sqrt(\d)", r"\\sqrt{\1}", s)
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    m = _CHOICE.fullmatch(s)
    if m:
        s = m.group(1)
    if s.startswith("+"):
        s = s[1:]
    return s


def as_number(s: str) -> Fraction | None:
    """Exact value of a normalized plain number (int, decimal, a/b, \\frac{a}{b}); None otherwise.

    Bounded digit counts: no exponent notation, so ``1e999999999`` can never be expanded."""
    if _DECIMAL.fullmatch(s):
        return Fraction(s)
    m = _LATEX_FRAC.fullmatch(s) or _SLASH_FRAC.fullmatch(s)
    if m:
        sign, num, den = (m.group(1), m.group(2), m.group(3)) if m.re is _LATEX_FRAC else ("", m.group(1), m.group(2))
        if int(den) == 0:
            return None
        value = Fraction(int(num), int(den))
        return -value if sign == "-" else value
    return None


def answer_key(answer: str | None) -> str | None:
    """A key under which equal answers collide (for majority voting): the exact value if numeric."""
    if answer is None:
        return None
    s = normalize_answer(answer)
    if not s:
        return None
    value = as_number(s)
    return f"#{value}" if value is not None else s


_EXPLOSIVE = re.compile(
    r"\^\s*\{[^{}]*[\^!]"  # power tower / factorial in an exponent: 9^{9^{9}}
    r"|\^\s*\{?\s*\d{6,}"  # six-digit exponent: 3^{123456789}
    r"|(?:\d{6,}|[)}\]])\s*!"  # factorial of a six-digit number or of an expression
    r"|\\uparrow"
)


def _too_risky(pred: str) -> bool:
    """Forms that only ever explode in sympy: 0 without trying (the time limit would catch them
    too, but each costs a full timeout and a worker restart)."""
    return bool(_EXPLOSIVE.search(pred))


# ----------------------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------------------


@dataclass
class RewardStats:
    """How a batch was graded; `timeouts` and `errors` should stay near 0 (log them)."""

    n: int = 0
    correct: int = 0
    no_answer: int = 0  # nothing acceptable to grade (no boxed answer, unclosed thinking, too long)
    fast: int = 0  # decided by normalized string match
    numeric: int = 0  # decided by exact numeric value
    rejected: int = 0  # symbolic check refused (power tower, huge factorial)
    symbolic: int = 0  # sent to a worker
    timeouts: int = 0
    errors: int = 0

    def add(self, other: "RewardStats") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def _check_rm_type(rm_type: str) -> None:
    if rm_type not in RM_TYPES:
        raise RewardError(
            f"unknown rm_type {rm_type!r}: choose one of {', '.join(RM_TYPES)} (recipe field rollout.rm_type)"
        )


def _decide(response: str, label: str, rm_type: str, thinking: bool, strict: bool, stats: RewardStats):
    """1.0 / 0.0 when decidable in-process, else the normalized (gold, pred) pair for a worker."""
    stats.n += 1
    pred = extract_answer(response, rm_type, thinking, strict)  # type: ignore[arg-type]
    if pred is None:
        stats.no_answer += 1
        return 0.0
    p, g = normalize_answer(pred), normalize_answer(str(label))
    if not p or not g:
        stats.no_answer += 1
        return 0.0
    if p == g:
        stats.fast += 1
        return 1.0
    pv, gv = as_number(p), as_number(g)
    if pv is not None and gv is not None:
        stats.numeric += 1
        return 1.0 if pv == gv else 0.0
    if rm_type == "math":
        stats.fast += 1
        return 0.0
    if _too_risky(p):
        stats.rejected += 1
        return 0.0
    stats.symbolic += 1
    return (g, p)


# ----------------------------------------------------------------------------------------------
# Worker processes
# ----------------------------------------------------------------------------------------------


class _Worker:
    def __init__(self, memory_mb: int):
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env[var] = "1"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kimi_pipeline.rl.reward", "--worker", "--memory-mb", str(memory_mb)],
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

    def _spawn(self) -> _Worker:
        w = _Worker(self.memory_mb)
        self._workers.append(w)
        return w

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self._workers.remove(w)
        self.restarts += 1
        self._spawn()

    def compare(self, pairs: Sequence[tuple[str, str]], timeout_s: float) -> list[str]:
        """For each (gold, pred): "equal", "different", "timeout" or "error"."""
        with self._lock:
            while len(self._workers) < min(self.size, max(1, len(pairs))):
                self._spawn()
            return self._run(pairs, timeout_s)

    def _run(self, pairs: Sequence[tuple[str, str]], timeout_s: float) -> list[str]:
        results: list[str | None] = [None] * len(pairs)
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
                            f"`{sys.executable} -m kimi_pipeline.rl.reward --worker` to see why"
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
# Public API
# ----------------------------------------------------------------------------------------------


class RewardModel:
    """Batch grader: ``RewardModel("deepscaler", thinking=True).score(responses, labels)``.

    The worker pool starts lazily on the first answer that needs symbolic checking, so a run whose
    answers are all plain numbers never starts a process. Close it (or use ``with``) when done.
    """

    def __init__(
        self,
        rm_type: RmType = "math",
        thinking: bool = False,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        workers: int = 2,
        strict: bool = False,
        memory_mb: int = DEFAULT_MEMORY_MB,
    ):
        _check_rm_type(rm_type)
        if timeout_s <= 0:
            raise RewardError(f"reward timeout_s must be > 0, got {timeout_s}")
        self.rm_type, self.thinking, self.strict = rm_type, thinking, strict
        self.timeout_s, self.workers, self.memory_mb = timeout_s, workers, memory_mb
        self._pool: SymbolicPool | None = None
        self.last_stats = RewardStats()
        self.totals = RewardStats()

    def score(self, responses: Sequence[str], labels: Sequence[str]) -> list[float]:
        if len(responses) != len(labels):
            raise ValueError(f"{len(responses)} responses but {len(labels)} labels")
        stats = RewardStats()
        rewards: list[float] = []
        pending: list[tuple[int, tuple[str, str]]] = []
        for i, (resp, label) in enumerate(zip(responses, labels)):
            d = _decide(resp, label, self.rm_type, self.thinking, self.strict, stats)
            if isinstance(d, tuple):
                pending.append((i, d))
                rewards.append(0.0)
            else:
                rewards.append(d)
        if pending:
            if self._pool is None:
                self._pool = SymbolicPool(self.workers, self.memory_mb)
            for (i, _), outcome in zip(pending, self._pool.compare([p for _, p in pending], self.timeout_s)):
                rewards[i] = 1.0 if outcome == "equal" else 0.0
                stats.timeouts += outcome == "timeout"
                stats.errors += outcome == "error"
        stats.correct = int(sum(rewards))
        if stats.timeouts or stats.errors:
            log.warning(
                "reward: %d symbolic timeouts, %d errors in a batch of %d", stats.timeouts, stats.errors, stats.n
            )
        self.last_stats = stats
        self.totals.add(stats)
        return rewards

    def answers(self, responses: Sequence[str]) -> list[str | None]:
        """The extracted final answers (for majority voting in eval)."""
        return [extract_answer(r, self.rm_type, self.thinking, self.strict) for r in responses]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> "RewardModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_shared: dict[tuple, RewardModel] = {}
_shared_lock = threading.Lock()


def grade(
    response: str,
    label: str,
    rm_type: RmType = "math",
    thinking: bool = False,
    *,
    strict: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> float:
    """Grade one response (1.0 / 0.0). Symbolic checks use a shared one-worker pool, under the same limit."""
    key = (rm_type, thinking, strict, timeout_s)
    with _shared_lock:
        model = _shared.get(key)
        if model is None:
            model = _shared[key] = RewardModel(rm_type, thinking, timeout_s=timeout_s, workers=1, strict=strict)
        return model.score([response], [label])[0]


# ----------------------------------------------------------------------------------------------
# Worker entry point
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
    import math
    import resource

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


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="kimi-pipeline reward worker (speaks JSON lines on stdin/stdout)")
    ap.add_argument("--worker", action="store_true", required=True)
    ap.add_argument("--memory-mb", type=int, default=DEFAULT_MEMORY_MB)
    _worker_main(ap.parse_args().memory_mb)
