"""Per-step metrics: one JSON line per step in the run dir, mirrored to TensorBoard (default) and W&B.

metrics.jsonl is the source of truth (plots, summary and resume read it); loggers are views of it
with the same metric names. A resumed run truncates lines past its checkpoint step so the file
reads exactly like an uninterrupted run.

W&B is a mirror on someone else's servers: when it is down (wandb.init or a log call raising), training goes on
and metrics.jsonl is still written; each kind of failure is warned about once, with its error (redacted).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from kimi_pipeline.util.files import atomic_write_text
from kimi_pipeline.util.redact import redact
from kimi_pipeline.util.secret_env import WANDB_KEY_ENV

log = logging.getLogger(__name__)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file. A line that is not JSON (torn by a kill mid-write, or a later row appended to
    such a fragment) is dropped with a warning naming it; the rows after it stay."""
    p = Path(path)
    if not p.is_file():
        return []
    out = []
    for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                log.warning("%s:%d: not a JSON row (torn by a kill mid-write?), dropped: %s", p, n, e)
    return out


class MetricsLog:
    """Append-only step metrics (`step` key required) + optional TensorBoard / W&B mirrors."""

    def __init__(self, path: str | Path, *, tensorboard_dir: str | Path | None = None, wandb_run: Any = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tb = None
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(tensorboard_dir))
        self._wandb = wandb_run
        self._wandb_failures: set[tuple[str, str]] = set()  # (call, error type) already warned about

    def truncate_after(self, step: int) -> None:
        """Drop rows with step > `step` (work after the checkpoint a run resumes from; every row when a run starts
        afresh) and lines torn by a kill, so the next row starts a line of its own."""
        rows = [r for r in read_jsonl(self.path) if r.get("step", 0) <= step]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in rows))

    def log(self, row: dict[str, Any], prefix: str = "") -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        step = int(row["step"])
        scalars = {f"{prefix}{k}": v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            try:
                self._wandb.log(scalars, step=step)
            except Exception as e:  # noqa: BLE001 - a W&B outage must not stop training: the row is in the file
                self._wandb_failed("log", e, f"step {step} is in {self.path} but not in W&B")

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            try:
                self._wandb.finish()
            except Exception as e:  # noqa: BLE001 - the run's metrics are in metrics.jsonl whatever W&B says
                self._wandb_failed("finish", e, f"the W&B run may be incomplete; {self.path} has every row")

    def _wandb_failed(self, call: str, error: Exception, consequence: str) -> None:
        """Warn once per (call, error type): an outage over a long run is one line, not one per step."""
        kind = (call, type(error).__name__)
        if kind in self._wandb_failures:
            return
        self._wandb_failures.add(kind)
        log.warning("W&B %s failed (%s); training goes on: %s (later failures like this one are not logged)",
                    call, redact(f"{type(error).__name__}: {error}"), consequence)


def first_last_mean(rows: list[dict[str, Any]], key: str, fraction: float = 0.1) -> tuple[float | None, float | None]:
    """Mean of `key` over the first and last `fraction` of rows (at least one row each)."""
    vals = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    if not vals:
        return None, None
    k = max(1, int(round(len(vals) * fraction)))
    return sum(vals[:k]) / k, sum(vals[-k:]) / k


def open_wandb(project: str | None, run_name: str, config: dict[str, Any]):
    """A W&B run when WANDB_API_KEY is set, wandb is installed and W&B answers; None otherwise, with a warning
    when the key says W&B was wanted (never logs the key)."""
    if not os.environ.get(WANDB_KEY_ENV):
        return None
    try:
        import wandb  # optional (`pip install -e .[wandb]`): imported only when a key asks for it
    except ImportError:
        log.warning("%s is set but wandb is not installed (pip install -e .[wandb]): no W&B mirror; metrics go to "
                    "metrics.jsonl and TensorBoard", WANDB_KEY_ENV)
        return None
    try:
        return wandb.init(project=project or "kimi-pipeline", name=run_name, config=config, reinit=True)
    except Exception as e:  # noqa: BLE001 - W&B down, key refused, init timed out: train without the mirror
        log.warning("W&B unavailable (%s): training goes on without the W&B mirror; metrics go to metrics.jsonl "
                    "and TensorBoard", redact(f"{type(e).__name__}: {e}"))
        return None
