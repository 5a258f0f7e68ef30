"""Task `download`: cache key = recipe sources + content hashes of local sources (hub: pinned revision)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task

from kimi_pipeline.hub.manifest import build_manifest, list_files
from kimi_pipeline.recipes import Recipe
from kimi_pipeline.stages import DOWNLOAD, download
from kimi_pipeline.util.paths import resolve_path
from tasks.common import RETRIES, RETRY_DELAYS, cache_key, retry_unless_permanent, stage_task
from tasks.secrets import hf_token


def _source_fingerprint(recipe: Recipe) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, src in (("model", recipe.hub.model), ("ref_model", recipe.hub.ref_model),
                      ("train", recipe.data.train), ("eval", recipe.data.eval)):
        if src is None:
            continue
        if src.kind == "hub":
            out[name] = src.describe()
            continue
        p = resolve_path(src.path or "", recipe.paths.base_dir)
        if p.is_file():
            out[name] = build_manifest(p.parent, [Path(p.name)])
        elif p.is_dir():
            out[name] = build_manifest(p, list_files(p, src.allow_patterns))
        else:
            out[name] = f"missing:{p}"
    return out


def download_key(context, params) -> str:
    r: Recipe = params["recipe"]
    return cache_key("download", r.section_dump("hub", "data", "model", "paths"), _source_fingerprint(r), str(params["run_dir"]))


@task(
    name="download",
    retries=RETRIES,
    retry_delay_seconds=RETRY_DELAYS,
    retry_jitter_factor=0.2,
    retry_condition_fn=retry_unless_permanent,
    cache_key_fn=download_key,
    persist_result=True,
    result_serializer="json",
)
def download_task(recipe: Recipe, run_dir: str) -> dict[str, Any]:
    with stage_task(DOWNLOAD, recipe, run_dir) as record:
        return record(download.run(recipe, Path(run_dir), token=hf_token()))
