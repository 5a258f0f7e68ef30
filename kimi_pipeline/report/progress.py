"""Live training progress for people watching a terminal: one line per rollout and one per eval.

Lines go to the `kimi_pipeline.progress` logger (INFO). Inside a Prefect run that logger is one of
Prefect's extra loggers, so the lines reach the terminal of `kimi run` and the run's logs in the UI;
`kimi train` attaches a plain stderr handler. `--quiet` raises the logger to WARNING.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

LOGGER_NAME = "kimi_pipeline.progress"
log = logging.getLogger(LOGGER_NAME)
if log.level == logging.NOTSET:
    log.setLevel(logging.INFO)


def set_quiet(quiet: bool) -> None:
    log.setLevel(logging.WARNING if quiet else logging.INFO)


def echo_to_stderr() -> None:
    """Print progress lines on stderr outside Prefect (idempotent)."""
    if not any(getattr(h, "kimi_progress", False) for h in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.kimi_progress = True  # type: ignore[attr-defined]
        log.addHandler(handler)
        log.propagate = False


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class TrainProgress:
    """Formats rollout and eval lines; the ETA is the wall time per rollout so far (evals included) times
    the rollouts left, so it does not promise what the evals will take away."""

    def __init__(self, total: int, start: int = 0, clock: Callable[[], float] = time.monotonic):
        self.total, self.start, self.clock = total, start, clock
        self.t0 = clock()

    def start_clock(self) -> None:
        """(Re)start the ETA clock: call when the first rollout starts (after the step-0 eval)."""
        self.t0 = self.clock()

    def eta_seconds(self, done: int) -> float | None:
        steps = done - self.start
        if steps <= 0:
            return None
        return (self.clock() - self.t0) / steps * (self.total - done)

    def step_line(self, row: dict[str, Any]) -> str:
        done = int(row["step"])
        eta = self.eta_seconds(done)
        width = len(str(self.total))
        return (f"step {done:>{width}}/{self.total}  reward {row.get('reward_mean', 0.0):.3f}  "
                f"solved groups {row.get('solved_group_fraction', 0.0):.2f}  "
                f"response {row.get('response_len_mean', 0.0):.1f} tok  {row.get('step_seconds', 0.0):.2f} s/step  "
                f"ETA {_duration(eta) if eta is not None else '?'}")

    @staticmethod
    def eval_line(step: int, result: dict[str, Any]) -> str:
        n = result.get("n", "n")
        problems = result.get("problems")
        where = f" on {problems} problems" if problems else ""
        nan = float("nan")
        return (f"eval at step {step}: avg@{n} {result.get('avg_at_n', nan):.3f}  "
                f"pass@1 {result.get('pass_at_1', nan):.3f}  pass@{n} {result.get('pass_at_n', nan):.3f}"
                f"  maj@{n} {result.get('maj_at_n', nan):.3f}{where}")

    def log_step(self, row: dict[str, Any]) -> None:
        log.info(self.step_line(row))

    def log_eval(self, step: int, result: dict[str, Any] | None) -> None:
        if isinstance(result, dict) and "avg_at_n" in result:
            log.info(self.eval_line(step, result))
