"""Task `validate`: cache key = content hashes of the data files and tokenizer (from the download
manifest) + the recipe fields the checks read; report as a markdown artifact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact

from kimi_pipeline.recipes import Recipe
from kimi_pipeline.stages import stage_validate
from tasks.common import RETRIES, RETRY_DELAYS, cache_key, read_json, retry_unless_permanent


def validate_key(context, params) -> str:
    r: Recipe = params["recipe"]
    manifest = read_json(Path(params["run_dir"]) / "download" / "manifest.json") or {}
    content = {k: {"files": v.get("files")} for k, v in manifest.items() if k in ("train", "eval", "model")}
    fields = {"data": r.section_dump("data")["data"], "max_prompt_len": r.rollout.max_prompt_len,
              "trust_remote_code": r.hub.trust_remote_code}
    return cache_key("validate", content, fields, str(params["run_dir"]))


def report_markdown(section: dict[str, Any]) -> str:
    lines = ["# Data validation", "", "| split | rows | bad rows | bad % | reasons |", "|---|---|---|---|---|"]
    for split in ("train", "eval"):
        s = section.get(split) or {}
        lines.append(f"| {split} | {s.get('rows', 0)} | {s.get('bad_rows', 0)} | {100 * s.get('bad_fraction', 0):.2f} | "
                     f"{', '.join(f'{k}: {v}' for k, v in (s.get('reasons') or {}).items()) or '—'} |")
    c = section.get("contamination") or {}
    lines += ["", f"**Contamination**: {c.get('overlap', 0)}/{c.get('eval_rows', 0)} eval prompts also in train.", ""]
    examples = [(split, e) for split in ("train", "eval") for e in (section.get(split) or {}).get("examples", [])]
    if examples:
        lines += ["## Example bad rows", "", "| split | line | reasons | raw |", "|---|---|---|---|"]
        for split, e in examples[:10]:
            raw = e["raw"][:120].replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {split} | {e['line']} | {'; '.join(e['reasons'])} | `{raw}` |")
    return "\n".join(lines)


@task(
    name="validate",
    retries=RETRIES,
    retry_delay_seconds=RETRY_DELAYS,
    retry_condition_fn=retry_unless_permanent,
    cache_key_fn=validate_key,
    persist_result=True,
    result_serializer="json",
)
def validate_task(recipe: Recipe, run_dir: str, download: dict[str, Any]) -> dict[str, Any]:
    try:
        section = stage_validate(recipe, Path(run_dir))
    except Exception as e:
        partial = getattr(e, "section", None)
        if partial:
            create_markdown_artifact(report_markdown(partial), key="data-validation", description="validation failed")
        raise
    create_markdown_artifact(report_markdown(section), key="data-validation", description="rows, bad rows, contamination")
    return section
