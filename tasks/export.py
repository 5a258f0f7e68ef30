"""Task `export`: cache key = the training checkpoint's identity from its metadata (save id, megatron
metadata, file names and sizes: hashing ~14 TB of K2 weights + Adam state is not an option) + the base
model's config/tokenizer hashes (download manifest) + the recipe's model/quant/convert sections (convert:
the export's rank layout) + what its served scores depend on (the validated eval set's hash, the eval, rollout
and export sections); retries a crashed rank or child, never a failed verification or eval drop; report as a
markdown artifact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task

from kimi_pipeline.recipes import Recipe
from kimi_pipeline.stages import EXPORT, export
from kimi_pipeline.util.files import sha256_file
from kimi_pipeline.weightjobs.int4_export import checkpoint_content_hash
from tasks.common import RETRIES, RETRY_DELAYS, cache_key, read_json, retry_unless_permanent, stage_task


def export_key(context, params) -> str:
    r: Recipe = params["recipe"]
    manifest = read_json(Path(params["run_dir"]) / "download" / "manifest.json") or {}
    files = (manifest.get("model") or {}).get("files") or {}
    base = {k: v.get("sha256") or v.get("size") for k, v in files.items() if not k.endswith(".safetensors")}
    ckpt = checkpoint_content_hash(params["checkpoint_dir"], params.get("step"))
    eval_set = Path(params["run_dir"]) / "validate" / "eval.jsonl"
    scored_on = sha256_file(eval_set) if eval_set.is_file() else None
    return cache_key("export", ckpt, base, r.section_dump("model", "quant", "convert", "eval", "rollout", "export"),
                     scored_on, str(params["run_dir"]))


@task(
    name="export",
    retries=RETRIES,
    retry_delay_seconds=RETRY_DELAYS,
    retry_condition_fn=retry_unless_permanent,
    cache_key_fn=export_key,
    persist_result=True,
    result_serializer="json",
)
def export_task(recipe: Recipe, run_dir: str, checkpoint_dir: str, step: int | None = None) -> dict[str, Any]:
    with stage_task(EXPORT, recipe, run_dir) as record:
        return record(export.run(recipe, Path(run_dir), checkpoint_dir, step=step))
