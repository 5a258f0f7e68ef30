"""Stage `validate`: the downloaded data sets' rows checked against their schemas (DAPO-Math-17k, AIME-2024),
tokenized lengths against `rollout.max_prompt_len`, train/eval contamination; clean rows to DIR/validate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kimi_pipeline.data.validation import run_validate
from kimi_pipeline.hub.fetch import dataset_path, read_manifest
from kimi_pipeline.model.tokenizer import load_tokenizer
from kimi_pipeline.recipes import Recipe
from kimi_pipeline.report.stage_reports import validate_report
from kimi_pipeline.stages.runner import Stage, StageReport


def run(recipe: Recipe, run_dir: Path) -> dict[str, Any]:
    manifest = read_manifest(run_dir)
    tokenizer = load_tokenizer(manifest["model"]["root"], recipe.hub.trust_remote_code)
    return run_validate(recipe.data, recipe.rollout.max_prompt_len, run_dir, dataset_path(manifest, "train"),
                        dataset_path(manifest, "eval"), tokenizer)


VALIDATE = Stage(
    name="validate",
    reads=("data", "rollout", "hub"),
    needs=("download",),
    outputs=("validate/train.jsonl", "validate/eval.jsonl"),
    report=StageReport(key="data-validation", render=validate_report, title="rows, bad rows, contamination",
                       failed_title="validation failed"),
)
