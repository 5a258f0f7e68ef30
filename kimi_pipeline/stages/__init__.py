"""The pipeline's DAG: one module per stage, each with one `run(recipe, run_dir, ...)` function (the stage's work)
and its `Stage` declaration (name, the recipe sections it reads, the earlier stages it needs, its outputs, its
report). Every stage runs inside `runner.stage_run`, which owns the run summary, timing, errors and reports, while
its caller calls `<stage module>.run` by name: Prefect tasks (tasks/) and the CLI call exactly these; nothing here
imports Prefect."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kimi_pipeline.recipes import Recipe, recipe_to_yaml
from kimi_pipeline.report.summary import RunSummary
from kimi_pipeline.stages.cluster import CLUSTER
from kimi_pipeline.stages.convert import CONVERT
from kimi_pipeline.stages.download import DOWNLOAD
from kimi_pipeline.stages.export import EXPORT
from kimi_pipeline.stages.runner import Record, Skipped, Stage, StageReport, stage_run
from kimi_pipeline.stages.train import TRAIN
from kimi_pipeline.stages.validate import VALIDATE
from kimi_pipeline.util import run_lock
from kimi_pipeline.util.files import atomic_write_text
from kimi_pipeline.util.paths import new_run_dir, resolve_path

DAG: tuple[Stage, ...] = (DOWNLOAD, VALIDATE, CONVERT, CLUSTER, TRAIN, EXPORT)
STAGES = tuple(s.name for s in DAG)


def prepare_run(recipe: Recipe, run_dir: str | Path | None = None, owner: str | None = None) -> Path:
    """Create the run directory (a default one always fresh), take its lock for `owner` (`util.run_lock`: one run per
    directory; the caller lets go with `release_run`), write the resolved recipe and start summary.json."""
    path = resolve_path(run_dir, recipe.paths.base_dir) if run_dir else new_run_dir(recipe.paths.base_dir, recipe.name)
    run_lock.take(path, owner)
    atomic_write_text(path / "recipe.yaml", recipe_to_yaml(recipe))
    RunSummary(path, recipe.name)
    return path


def release_run(run_dir: str | Path) -> None:
    """Let go of the lock `prepare_run` took."""
    run_lock.release(run_dir)


@contextmanager
def prepared_run(recipe: Recipe, run_dir: str | Path | None = None) -> Iterator[Path]:
    """`prepare_run` for a `with` block (a CLI stage command): the run directory is this command's until it ends."""
    path = prepare_run(recipe, run_dir)
    try:
        yield path
    finally:
        release_run(path)


def mark_skipped(run_dir: Path, names: list[str]) -> None:
    """Record the stages a run leaves out (`kimi run --until`) as skipped."""
    summary = RunSummary(run_dir)
    for name in names:
        summary.set_stage(name, "skipped", 0.0)


__all__ = ["CLUSTER", "CONVERT", "DAG", "DOWNLOAD", "EXPORT", "STAGES", "Record", "Skipped", "Stage", "StageReport",
           "TRAIN", "VALIDATE", "mark_skipped", "prepare_run", "prepared_run", "release_run", "stage_run"]
