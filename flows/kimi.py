"""Flow `kimi`: download → validate (→ convert → cluster → train → eval → export as they land)."""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from kimi_pipeline.recipes import load_recipe
from kimi_pipeline.report.markdown import write_summary_markdown
from kimi_pipeline.stages import STAGES, mark_skipped, prepare_run
from tasks.common import outputs_present
from tasks.download import download_task
from tasks.validate import validate_task


@flow(name="kimi", log_prints=True)
def kimi(
    recipe: str = "tiny",
    overrides: list[str] | None = None,
    run_dir: str | None = None,
    until: str | None = None,
) -> dict:
    """Run the pipeline for a recipe (preset name or YAML path) up to and including stage `until`."""
    r = load_recipe(recipe, overrides or [])
    path = prepare_run(r, run_dir)
    print(f"run directory: {path}")
    selected = STAGES[: STAGES.index(until) + 1] if until else STAGES
    try:
        dl = download_task.with_options(refresh_cache=not outputs_present(path, "download/manifest.json"))(r, str(path))
        if "validate" in selected:
            validate_task.with_options(
                refresh_cache=not outputs_present(path, "validate/train.jsonl", "validate/eval.jsonl")
            )(r, str(path), dl)
        mark_skipped(path, [s for s in STAGES if s not in selected])
    finally:
        md = write_summary_markdown(path)
        create_markdown_artifact(md.read_text(), key="run-summary", description=f"{r.name}: {path}")
    return {"run_dir": str(path), "summary": str(path / "summary.json")}
