"""Task `convert`: cache key = the download manifest's model file sha256s + the recipe's
model/parallel/convert sections (+ the run dir, where the checkpoint lives); retries transient job
failures (a lost rank), never a corrupt shard or a failed verification; report as a markdown artifact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact

from kimi_pipeline.convert.stage import CKPT_NAME, MARKER, stage_convert
from kimi_pipeline.model.checkpoint_dirs import TRACKER
from kimi_pipeline.recipes import Recipe
from tasks.common import RETRIES, RETRY_DELAYS, cache_key, read_json, retry_unless_permanent

# What must still exist for a cached result to be usable (flow: refresh_cache=not outputs_present(...)).
CONVERT_OUTPUTS = (f"convert/{CKPT_NAME}/{TRACKER}", f"convert/{MARKER}")


def convert_key(context, params) -> str:
    r: Recipe = params["recipe"]
    manifest = read_json(Path(params["run_dir"]) / "download" / "manifest.json") or {}
    files = {k: v.get("sha256") or v.get("size") for k, v in ((manifest.get("model") or {}).get("files") or {}).items()}
    return cache_key("convert", files, r.section_dump("model", "parallel", "convert"), str(params["run_dir"]))


def _fmt(v: Any, spec: str = "") -> str:
    if v is None:
        return "—"
    return format(v, spec) if spec else str(v)


def report_markdown(s: dict[str, Any]) -> str:
    rss = s.get("peak_rss_mb_per_rank") or []
    lay, vlay = s.get("layout") or {}, s.get("verify_layout") or {}
    lines = [
        "# HF → Megatron torch_dist conversion",
        "",
        "| figure | value |",
        "|---|---|",
        f"| nodes × ranks | {s.get('nodes')} × {s.get('ranks_per_node')} (tp {lay.get('tp')}, pp {lay.get('pp')}, ep {lay.get('ep')}) |",
        f"| source format | {s.get('source_format')} |",
        f"| source bytes | {s.get('bytes', 0) / 2**20:.1f} MiB → {s.get('output_bytes', 0) / 2**20:.1f} MiB torch_dist |",
        f"| conversion time | {_fmt(s.get('seconds'))} s ({(s.get('bytes_per_second') or 0) / 2**20:.1f} MiB/s) |",
        f"| peak RSS per rank | {', '.join(f'{x:.0f}' for x in rss)} MiB |",
        f"| verified | **{s.get('verified')}**" + (f" (skipped: {s['verify_skipped']})" if s.get("verify_skipped") else "") + " |",
        f"| verify layout | world {vlay.get('world_size', '—')}, tp {vlay.get('tp', '—')}, pp {vlay.get('pp', '—')}, ep {vlay.get('ep', '—')} |",
        f"| tensors compared / max abs diff | {_fmt(s.get('tensors_compared'))} / {_fmt(s.get('max_abs_diff'))} |",
        f"| HF → Megatron → HF round trip | {_fmt(s.get('roundtrip_tensors'))} tensors, exact: {_fmt(s.get('roundtrip_exact'))} |",
        f"| logits max diff (tolerance) | {_fmt(s.get('logits_max_diff'), '.3g') if s.get('logits_max_diff') is not None else '—'}"
        f" ({_fmt(s.get('logits_tolerance'))}) |",
        f"| checkpoint | `{s.get('path')}` |",
        "",
        "On a cluster, the same job runs on every node as:",
        "",
        f"```\n{s.get('command', '')}\n```",
    ]
    return "\n".join(lines)


@task(
    name="convert",
    retries=RETRIES,
    retry_delay_seconds=RETRY_DELAYS,
    retry_condition_fn=retry_unless_permanent,
    cache_key_fn=convert_key,
    persist_result=True,
    result_serializer="json",
)
def convert_task(recipe: Recipe, run_dir: str, download: dict[str, Any] | None = None) -> dict[str, Any]:
    section = stage_convert(recipe, Path(run_dir))
    create_markdown_artifact(report_markdown(section), key="convert", description="HF → torch_dist conversion")
    return section
