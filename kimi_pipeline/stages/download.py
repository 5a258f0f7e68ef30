"""Stage `download`: the model and data sets of the recipe's `hub` / `data` sources into DIR/download, with a
manifest of every file's hash (the later stages' cache keys and checks read it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kimi_pipeline.hub.fetch import run_download
from kimi_pipeline.recipes import Recipe
from kimi_pipeline.report.stage_reports import download_report
from kimi_pipeline.stages.runner import Stage, StageReport


def run(recipe: Recipe, run_dir: Path, token: str | None = None) -> dict[str, Any]:
    """`token`: the Hugging Face token (from HF_TOKEN or a Prefect Secret block), never logged."""
    return run_download(recipe.hub, recipe.data, recipe.model, recipe.paths.base_dir, run_dir, token)


DOWNLOAD = Stage(
    name="download",
    reads=("hub", "data", "model", "paths"),
    needs=(),
    outputs=("download/manifest.json",),
    report=StageReport(key="download-sources", render=download_report,
                       title="Sources of {recipe} and where they landed", table=True),
)
