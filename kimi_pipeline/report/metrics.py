"""Per-step metrics: one JSON line per step in the run dir, mirrored to TensorBoard (default) and W&B.

metrics.jsonl is the source of truth (plots, summary and resume read it); loggers are views of it
with the same metric names. A resumed run truncates lines past its checkpoint step so the file
reads exactly like an uninterrupted run.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from kimi_pipeline.util.files import atomic_write_text

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
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def first_last_mean(rows: list[dict[str, Any]], key: str, fraction: float = 0.1) -> tuple[float | None, float | None]:
    """Mean of `key` over the first and last `fraction` of rows (at least one row each)."""
    vals = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    if not vals:
        return None, None
    k = max(1, int(round(len(vals) * fraction)))
    return sum(vals[:k]) / k, sum(vals[-k:]) / k


def open_wandb(project: str | None, run_name: str, config: dict[str, Any]):
    """A W&B run when WANDB_API_KEY is set and wandb is installed; None otherwise (never logs the key)."""
    if not os.environ.get("WANDB_API_KEY"):
        return None
    try:
        import wandb
    except ImportError:
        return None
    return wandb.init(project=project or "kimi-pipeline", name=run_name, config=config, reinit=True)
