"""Health rules a run checks at every step (the recipe's `health` section), so a long run stops itself on the
failures that otherwise burn a week: train/rollout mismatch that stays high, reward collapse, non-finite values.

The driver feeds each step's row to `HealthRules.judge` after the trainer has stepped and before the step's
checkpoint is written, so a stop keeps the checkpoint directory free of the step that broke a rule. Non-finite
gradients are caught earlier, in the trainer between the gradient norm and the optimizer step
(`model.megatron_train.optimizer_step`), and reach the driver as `NonFiniteError`; non-finite weights are refused
at save time (`model.megatron_train.require_finite_params`). Each row records every rule's verdict as
`health_<rule>` (0 ok, 1 warn, 2 stop). The rules' memory (streaks, the reward's moving mean and its best) is
rebuilt from the metrics rows kept on resume, so a resumed run judges as an uninterrupted one would.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kimi_pipeline.errors import SectionError
from kimi_pipeline.model.checkpoint_dirs import TRACKER, iteration_dir, saved_steps
from kimi_pipeline.recipes.models import HealthSpec

log = logging.getLogger(__name__)

OK, WARN, STOP = 0.0, 1.0, 2.0
RULES = ("nonfinite", "mismatch", "collapse", "truncation")


# the trainer's values in a step's row: a non-finite one means the update itself is broken
TRAINER_VALUES = ("loss", "pg_loss", "grad_norm", "entropy", "ppo_kl", "kl_loss")


class HealthStop(SectionError):
    """A health rule stopped the run: names the rule, the step, the values and the checkpoint to resume from. The
    driver attaches the train section (`section`), so summary.json records the stop beside the steps done."""

    def __init__(self, rule: str, step: int, values: dict[str, float], resume: Path | None, why: str):
        self.rule, self.step, self.values, self.resume, self.why = rule, step, values, resume, why
        shown = ", ".join(f"{k}={_fmt(v)}" for k, v in values.items())
        shown = f" ({shown})" if shown else ""
        where = (f"resume from {resume} (the newest checkpoint before it: set {resume.parent / TRACKER} to "
                 f"{int(resume.name[5:])} and move later iter_* directories aside)" if resume is not None
                 else "no checkpoint precedes it: the run restarts from its initial checkpoint")
        super().__init__(f"health rule `{rule}` stopped training at step {step}: {why}{shown}; {where}. "
                         f"Turn the rule off with `--set health.{rule}=off`")

    def __reduce__(self):  # pickles (Prefect, Ray) with its own arguments and the section the driver attached
        return _rebuild_stop, ((self.rule, self.step, self.values, self.resume, self.why), self.section)

    def summary(self) -> dict[str, Any]:
        """summary.json's `train.health.stop`."""
        return {"rule": self.rule, "step": self.step, "values": self.values,
                "resume": None if self.resume is None else str(self.resume)}


def _rebuild_stop(args: tuple, section: dict[str, Any]) -> HealthStop:
    stop = HealthStop(*args)
    stop.section = section
    return stop


def _fmt(v: float) -> str:
    return f"{v:.4g}" if math.isfinite(v) else str(v)


class HealthRules:
    """The rules of one run. `judge(row)` gives the row's verdict columns and the stop, if a rule stops. `saved`
    lists the checkpoint steps written so far, read only when a stop names the one to resume from (not on every
    step: a directory listing of shared storage)."""

    def __init__(self, rules: HealthSpec, checkpoints: Path, saved: Callable[[], list[int]] | None = None):
        self.rules, self.checkpoints = rules, checkpoints
        self.saved = saved or (lambda: saved_steps(checkpoints))
        self.mismatch_streak = 0
        window = rules.collapse.window if rules.collapse != "off" else 1
        self.rewards: deque[float] = deque(maxlen=window)
        self.best = -math.inf
        self.collapse_streak = 0
        self.collapse_start: int | None = None  # the step the current collapse streak began at

    def replay(self, rows: Iterable[dict[str, Any]]) -> None:
        """Rebuild the rules' memory from the rows of the steps already done (resume); nothing is raised."""
        for row in rows:
            self._observe(row)

    def judge(self, row: dict[str, Any]) -> tuple[dict[str, float], HealthStop | None]:
        verdicts = self._observe(row)
        return verdicts, self._stop(int(row["step"]), row, verdicts)

    def _stop(self, step: int, row: dict[str, Any], verdicts: dict[str, float]) -> HealthStop | None:
        if verdicts["health_nonfinite"] == STOP:
            bad = {k: float(row[k]) for k in TRAINER_VALUES if k in row and not math.isfinite(float(row[k]))}
            return HealthStop("nonfinite", step, bad, self._before(step),
                              "the trainer reported non-finite values")
        if verdicts["health_truncation"] == WARN:
            log.warning("step %d: %.0f %% of responses hit rollout.max_response_len (health.truncation warns above "
                        "%.0f %%)", step, 100 * row["truncated_fraction"], 100 * self.rules.truncation.max_fraction)
        if verdicts["health_mismatch"] == STOP:
            rule = self.rules.mismatch
            return HealthStop("mismatch", step, {rule.metric: float(row[rule.metric]), "max": rule.max,
                                                "steps": float(rule.steps)},
                             self._before(step),
                             f"the engines' log-probs of their own samples differ from the trainer's by more than "
                             f"the bound for {rule.steps} consecutive steps (stale or broken weight sync, or an "
                             f"engine whose kernels disagree with the trainer's)")
        if verdicts["health_collapse"] == STOP:
            rule = self.rules.collapse
            assert self.collapse_start is not None
            return HealthStop("collapse", step, {"reward_moving_mean": self._moving_mean(), "best": self.best,
                                                "fraction": rule.fraction, "since_step": float(self.collapse_start)},
                             self._before(self.collapse_start),
                             f"the reward's {rule.window}-step moving mean stayed below {rule.fraction:g} of its "
                             f"best for {rule.steps} steps")
        return None

    def nonfinite_stop(self, step: int, error: BaseException) -> HealthStop:
        """The stop for a `NonFiniteError` the trainer raised at `step` (before its optimizer step)."""
        return HealthStop("nonfinite", step, {}, self._before(step), str(error))

    # ------------------------------------------------------------------ the rules' memory

    def _observe(self, row: dict[str, Any]) -> dict[str, float]:
        rules = self.rules
        broken = any(not math.isfinite(float(row[k])) for k in TRAINER_VALUES if k in row)
        verdicts = {"health_nonfinite": STOP if broken and rules.nonfinite == "stop" else OK}
        mismatch = OK
        if rules.mismatch != "off" and rules.mismatch.metric in row:
            above = float(row[rules.mismatch.metric]) > rules.mismatch.max
            self.mismatch_streak = self.mismatch_streak + 1 if above else 0
            mismatch = STOP if self.mismatch_streak >= rules.mismatch.steps else WARN if above else OK
        verdicts["health_mismatch"] = mismatch
        collapse = OK
        if rules.collapse != "off" and "reward_mean" in row:
            self.rewards.append(float(row["reward_mean"]))
            mean = self._moving_mean()
            if len(self.rewards) == self.rewards.maxlen:  # a full window: the mean is comparable to the best
                down = self.best > 0 and mean < rules.collapse.fraction * self.best
                self.best = max(self.best, mean)
                if down:
                    self.collapse_streak += 1
                    if self.collapse_streak == 1:
                        self.collapse_start = int(row["step"])
                else:
                    self.collapse_streak, self.collapse_start = 0, None
                collapse = STOP if self.collapse_streak >= rules.collapse.steps else WARN if down else OK
        verdicts["health_collapse"] = collapse
        truncation = OK
        if rules.truncation != "off" and "truncated_fraction" in row:
            truncation = WARN if float(row["truncated_fraction"]) > rules.truncation.max_fraction else OK
        verdicts["health_truncation"] = truncation
        return verdicts

    def _moving_mean(self) -> float:
        return sum(self.rewards) / len(self.rewards)

    def _before(self, step: int) -> Path | None:
        """The newest checkpoint written before `step` (its weights never saw the step's update)."""
        earlier = [s for s in self.saved() if s < step]
        return iteration_dir(self.checkpoints, max(earlier)) if earlier else None


def health_section(rows: list[dict[str, Any]], rules: HealthSpec) -> dict[str, Any]:
    """summary.json's `train.health`: each rule's setting and the steps it warned or stopped at."""
    out: dict[str, Any] = {}
    for rule in RULES:
        setting = getattr(rules, rule)
        col = f"health_{rule}"
        out[rule] = {"setting": setting if isinstance(setting, str) else setting.model_dump(),
                     "warn_steps": [int(r["step"]) for r in rows if r.get(col) == WARN],
                     "stop_step": next((int(r["step"]) for r in rows if r.get(col) == STOP), None)}
    return out


def health_markdown(section: dict[str, Any]) -> str:
    """The health artifact: one line per rule (its setting, the steps it warned at, where it stopped the run)."""
    lines = ["| rule | setting | warned at steps | stopped at step |", "|---|---|---|---|"]
    for rule, r in section.items():
        if rule == "stop":
            continue
        setting = r["setting"]
        if not isinstance(setting, str):
            setting = ", ".join(f"{k}={v}" for k, v in setting.items())
        warns = r["warn_steps"]
        shown = ", ".join(map(str, warns[:20])) + (f" … ({len(warns)})" if len(warns) > 20 else "") or "—"
        lines.append(f"| {rule} | {setting} | {shown} | {r['stop_step'] if r['stop_step'] is not None else '—'} |")
    stop = section.get("stop")
    if stop:
        lines += ["", f"**Stopped by `{stop['rule']}` at step {stop['step']}**; resume from "
                      f"`{stop['resume'] or 'the initial checkpoint'}`."]
    return "\n".join(lines)
