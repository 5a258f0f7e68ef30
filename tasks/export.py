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
from tasks.common import RETRIES, RETRY_DELAYS, cache_key, read_json, retry_unless_permanent

# What must still exist for a cached result to be usable (flow: refresh_cache=not outputs_present(...)).
EXPORT_OUTPUTS = (f"export/{SECTION_FILE}", "export/int4/config.json")


def export_key(context, params) -> str:
    r: Recipe = params["recipe"]
    manifest = read_json(Path(params["run_dir"]) / "download" / "manifest.json") or {}
    files = (manifest.get("model") or {}).get("files") or {}
    base = {k: v.get("sha256") or v.get("size") for k, v in files.items() if not k.endswith(".safetensors")}
    ckpt = checkpoint_content_hash(params["checkpoint_dir"], params.get("step"))
    return cache_key("export", ckpt, base, r.section_dump("model", "quant", "convert"), str(params["run_dir"]))


def _fmt(v: Any, spec: str = ".3g") -> str:
    return "—" if v is None else (format(v, spec) if isinstance(v, float) else str(v))


def report_markdown(s: dict[str, Any]) -> str:
    if "skipped" in s:
        return f"# INT4 export\n\nSkipped: {s['skipped']}"
    mib = 2**20
    lines = [
        "# INT4 export (compressed-tensors pack-quantized, Kimi-K2-Thinking format)",
        "",
        "| figure | value |",
        "|---|---|",
        f"| checkpoint | `{s.get('checkpoint')}` |",
        f"| export | `{s.get('path')}` ({s.get('shards')} shards) |",
        f"| size | {s.get('int4_bytes', 0) / mib:.2f} MiB INT4 vs {s.get('bf16_bytes', 0) / mib:.2f} MiB bf16 "
        f"(×{s.get('compression')}) |",
        f"| written by | {s.get('ranks', 1)} rank(s), peak RSS per rank "
        f"{', '.join(f'{mb:.0f}' for mb in s.get('peak_rss_mb_per_rank') or []) or '—'} MB |",
        f"| routed-expert Linears packed | {s.get('num_quantized')} of {s.get('num_tensors')} tensors, "
        f"group {s.get('group_size')} |",
        f"| dequantized == fake-quant (exact) | **{s.get('dequant_exact')}** "
        f"(reloaded model: {s.get('experts_equal')}) |",
        f"| logits max diff vs {s.get('logits_reference', 'trainer')} (tolerance) | {_fmt(s.get('logits_max_diff'))} "
        f"({_fmt(s.get('logits_tolerance'))}) |",
        f"| … of which: decode / bf16 storage / HF↔trainer | {_fmt(s.get('logits_max_diff_exact'))} / "
        f"{_fmt(s.get('logits_max_diff_storage'))} / {_fmt(s.get('logits_max_diff_parity'))} |",
        f"| top-1 agreement with the trainer | {_fmt(s.get('top1_agreement'))} |",
        f"| reloaded model generates | {s.get('generated_tokens')} tokens: `{s.get('generated_text')}` |",
    ]
    if s.get("model_check"):
        lines.append(f"| model check | {s['model_check']} |")
    if s.get("note"):
        lines += ["", s["note"]]
    if s.get("problems"):
        lines += ["", "## Problems", *[f"- {p}" for p in s["problems"]]]
    return "\n".join(lines)


@task(
    name="export",
    retries=RETRIES,
    retry_delay_seconds=RETRY_DELAYS,
    retry_condition_fn=retry_unless_permanent,
    cache_key_fn=export_key,
    persist_result=True,
    result_serializer="json",
)
def export_task(recipe: Recipe, run_dir: str, checkpoint_dir: str, step: int | None = None,
                train: dict[str, Any] | None = None) -> dict[str, Any]:
    """`train` is only the upstream result (ordering in the flow)."""
    try:
        section = stage_export(recipe, Path(run_dir), checkpoint_dir, step=step)
    except Exception as e:
        partial = getattr(e, "section", None)
        if partial:
            create_markdown_artifact(report_markdown(partial), key="int4-export", description="INT4 export failed")
        raise
    create_markdown_artifact(report_markdown(section), key="int4-export", description="INT4 export + parity")
    return section
