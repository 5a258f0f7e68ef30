"""Task `validate`: cache key = content hashes of the data files and tokenizer (from the download
manifest) + the recipe fields the checks read; report as a markdown artifact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task

from kimi_pipeline.recipes import Recipe
from kimi_pipeline.stages import VALIDATE, validate
from tasks.common import RETRIES, RETRY_DELAYS, cache_key, read_json, retry_unless_permanent, stage_task


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
    with stage_task(VALIDATE, recipe, run_dir) as record:
        return record(validate.run(recipe, Path(run_dir)))
