"""Where a Megatron checkpoint directory keeps its iterations: `iter_NNNNNNN/` dirs and the tracker file
Megatron's --load reads first. File names only (no torch, no megatron), so stages that merely look at a
checkpoint (convert's completeness check, eval, export's cache key) need not import the trainer."""

from __future__ import annotations

import shutil
from pathlib import Path

from kimi_pipeline.errors import PermanentError

TRACKER = "latest_checkpointed_iteration.txt"


class CheckpointError(PermanentError):
    """No usable checkpoint at the given place (missing tracker, iteration dir or wrong layout)."""


def iteration_dir(ckpt_dir: str | Path, step: int) -> Path:
    return Path(ckpt_dir) / f"iter_{step:07d}"


def latest_step(ckpt_dir: str | Path) -> int | None:
    """The step the tracker points at, or None when there is no complete checkpoint."""
    tracker = Path(ckpt_dir) / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if text == "release":
        return 0
    try:
        return int(text)
    except ValueError as exc:
        raise CheckpointError(f"{tracker}: expected an iteration number, got {text!r}") from exc


def saved_steps(ckpt_dir: str | Path) -> list[int]:
    """The steps of the complete iterations, oldest first (none past the tracker's: a later one is a torn save)."""
    latest = latest_step(ckpt_dir)
    return sorted(int(p.name[5:]) for p in Path(ckpt_dir).glob("iter_*")
                  if p.is_dir() and p.name[5:].isdigit() and (latest is None or int(p.name[5:]) <= latest))


def prune_checkpoints(ckpt_dir: str | Path, keep_last: int | None) -> list[Path]:
    """Delete all but the newest `keep_last` complete iterations (never the tracker's); returns what went.

    Unfinished temp dirs of a crashed save are left to the next save's cleanup, not touched here."""
    if not keep_last:
        return []
    latest = latest_step(ckpt_dir)
    done = [(step, iteration_dir(ckpt_dir, step)) for step in saved_steps(ckpt_dir)]
    gone = [p for step, p in done[:-keep_last] if step != latest]
    for p in gone:
        shutil.rmtree(p)
    return gone
