"""The pipeline's stages as plain functions: `stage_<name>(recipe, run_dir, ...) -> summary section`.

Each records its status and duration in DIR/summary.json and its key figures as a section of the
same name. Prefect tasks (tasks/) and the CLI call exactly these; nothing here imports Prefect.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kimi_pipeline.data.validate import DataValidationError, run_validate
from kimi_pipeline.hub.download import dataset_path, read_manifest, run_download
from kimi_pipeline.model.tokenizer import load_tokenizer
from kimi_pipeline.recipes import Recipe, recipe_to_yaml
from kimi_pipeline.report.summary import RunSummary
from kimi_pipeline.util.files import atomic_write_text
from kimi_pipeline.util.paths import new_run_dir, resolve_path

STAGES = ("download", "validate", "convert", "cluster", "train", "export")


def prepare_run(recipe: Recipe, run_dir: str | Path | None = None) -> Path:
    """Create the run directory, write the resolved recipe and start summary.json."""
    path = resolve_path(run_dir, recipe.paths.base_dir) if run_dir else new_run_dir(recipe.paths.base_dir, recipe.name)
    path.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path / "recipe.yaml", recipe_to_yaml(recipe))
    RunSummary(path, recipe.name)
    return path


def stage_download(recipe: Recipe, run_dir: Path, token: str | None = None) -> dict[str, Any]:
    summary = RunSummary(run_dir, recipe.name)
    with summary.stage("download"):
        section = run_download(recipe, run_dir, token)
        summary.set_section("download", section)
    return section


def stage_validate(recipe: Recipe, run_dir: Path) -> dict[str, Any]:
    summary = RunSummary(run_dir, recipe.name)
    with summary.stage("validate"):
        manifest = read_manifest(run_dir)
        tokenizer = load_tokenizer(manifest["model"]["root"], recipe.hub.trust_remote_code)
        try:
            section = run_validate(
                recipe, run_dir, dataset_path(manifest, "train"), dataset_path(manifest, "eval"), tokenizer
            )
        except DataValidationError as e:
            summary.set_section("validate", e.section)
            raise
        summary.set_section("validate", section)
    return section


def mark_skipped(run_dir: Path, stages: list[str]) -> None:
    summary = RunSummary(run_dir)
    for s in stages:
        summary.set_stage(s, "skipped", 0.0)
