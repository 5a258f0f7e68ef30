"""Task `export`: cache key = the training checkpoint's identity from its metadata (save id, megatron
metadata, file names and sizes: hashing ~14 TB of K2 weights + Adam state is not an option) + the base
model's config/tokenizer hashes (download manifest) + the recipe's model/quant/convert sections (convert:
the export's rank layout); retries a crashed rank or child, never a failed verification; report as a
markdown artifact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact

from kimi_pipeline.quant.stage import SECTION_FILE, checkpoint_content_hash, stage_export
from kimi_pipeline.recipes import Recipe
from kimi_pipeline.report.stage_reports import export_report
from tasks.common import RETRIES, RETRY_DELAYS, cache_key, read_json, retry_unless_permanent

# What must still exist for a cached result to be usable (the flow runs it with `cached(...)`).
EXPORT_OUTPUTS = (f"export/{SECTION_FILE}", "export/int4/config.json")


def export_key(context, params) -> str:
    r: Recipe = params["recipe"]
    manifest = read_json(Path(params["run_dir"]) / "download" / "manifest.json") or {}
    files = (manifest.get("model") or {}).get("files") or {}
    base = {k: v.get("sha256") or v.get("size") for k, v in files.items() if not k.endswith(".safetensors")}
    ckpt = checkpoint_content_hash(params["checkpoint_dir"], params.get("step"))
    return cache_key("export", ckpt, base, r.section_dump("model", "quant", "convert"), str(params["run_dir"]))


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
    try:
        section = stage_export(recipe, Path(run_dir), checkpoint_dir, step=step)
    except Exception as e:
        partial = getattr(e, "section", None)
        if partial:
            create_markdown_artifact(export_report(partial), key="int4-export", description="INT4 export failed")
        raise
    create_markdown_artifact(export_report(section), key="int4-export", description="INT4 export + parity")
    return section
