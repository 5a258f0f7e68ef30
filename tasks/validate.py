"""Task `validate`: cache key = content hashes of the data files and tokenizer (from the download
manifest) + the recipe fields the checks read; report as a markdown artifact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact

from kimi_pipeline.recipes import Recipe
from kimi_pipeline.report.stage_reports import validate_report
from kimi_pipeline.stages import stage_validate
from tasks.common import RETRIES, RETRY_DELAYS, cache_key, read_json, retry_unless_permanent

# What must still exist for a cached result to be usable (the flow runs it with `cached(...)`).
VALIDATE_OUTPUTS = ("validate/train.jsonl", "validate/eval.jsonl")


def validate_key(context, params) -> str:
    r: Recipe = params["recipe"]
    manifest = read_json(Path(params["run_dir"]) / "download" / "manifest.json") or {}
    content = {k: {"files": v.get("files")} for k, v in manifest.items() if k in ("train", "eval", "model")}
    fields = {"data": r.section_dump("data")["data"], "max_prompt_len": r.rollout.max_prompt_len,
              "trust_remote_code": r.hub.trust_remote_code}
    return cache_key("validate", content, fields, str(params["run_dir"]))


@task(
    name="validate",
    retries=RETRIES,
    retry_delay_seconds=RETRY_DELAYS,
    retry_condition_fn=retry_unless_permanent,
    cache_key_fn=validate_key,
    persist_result=True,
    result_serializer="json",
)
def validate_task(recipe: Recipe, run_dir: str) -> dict[str, Any]:
    try:
        section = stage_validate(recipe, Path(run_dir))
    except Exception as e:
        partial = getattr(e, "section", None)
        if partial:
            create_markdown_artifact(validate_report(partial), key="data-validation", description="validation failed")
        raise
    create_markdown_artifact(validate_report(section), key="data-validation", description="rows, bad rows, contamination")
    return section
