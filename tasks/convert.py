"""Task `convert`: cache key = the download manifest's model file sha256s + the recipe's
model/parallel/convert sections (+ the run dir, where the checkpoint lives); retries transient job
failures (a lost rank), never a corrupt shard or a failed verification; report as a markdown artifact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task

from kimi_pipeline.recipes import Recipe
from kimi_pipeline.stages import CONVERT, convert
from kimi_pipeline.weightjobs.conversion import ConvertSections
from tasks.common import RETRIES, RETRY_DELAYS, cache_key, read_json, retry_unless_permanent, stage_task


def convert_key(context, params) -> str:
    r: Recipe = params["recipe"]
    manifest = read_json(Path(params["run_dir"]) / "download" / "manifest.json") or {}
    files = {k: v.get("sha256") or v.get("size") for k, v in ((manifest.get("model") or {}).get("files") or {}).items()}
    return cache_key("convert", files, ConvertSections.of(r).key, str(params["run_dir"]))


@task(
    name="convert",
    retries=RETRIES,
    retry_delay_seconds=RETRY_DELAYS,
    retry_condition_fn=retry_unless_permanent,
    cache_key_fn=convert_key,
    persist_result=True,
    result_serializer="json",
)
def convert_task(recipe: Recipe, run_dir: str) -> dict[str, Any]:
    with stage_task(CONVERT, recipe, run_dir) as record:
        return record(convert.run(recipe, Path(run_dir)))
