"""One stage run as its Prefect task and its CLI command run it, for the tests that drive stages one by one: the
runner (`stage_run`: summary.json, timing, errors) around a call of the stage's `run`, named by the test."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kimi_pipeline.recipes import Recipe
from kimi_pipeline.stages import Stage, stage_run


def run_stage(stage: Stage, work: Callable[..., dict[str, Any]], recipe: Recipe, run_dir: str | Path, *,
              record_as: str | None = None, **inputs: Any) -> dict[str, Any]:
    """`work(recipe, run_dir, **inputs)` (`stages.<name>.run`) run as `stage`, recorded as `record_as` (default: the
    stage's name; the train stage's debugging modes are recorded as `replay` / `rollout_only`)."""
    with stage_run(stage, recipe, run_dir, record_as=record_as) as record:
        return record(work(recipe, Path(run_dir), **inputs))
