"""Flow `kimi`: download → validate → convert → cluster → train (+ periodic eval) → export."""

from __future__ import annotations

import contextlib

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from kimi_pipeline.cluster import stop_cluster
from kimi_pipeline.recipes import load_recipe
from kimi_pipeline.report.markdown import write_summary_markdown
from kimi_pipeline.stages import STAGES, mark_skipped, prepare_run
from flows.limits import cluster_slot
from flows.notify import clear_failure, notify_failure, remember_run_dir
from tasks.cluster import cluster_task
from tasks.common import cached
from tasks.convert import CONVERT_OUTPUTS, convert_task
from tasks.download import DOWNLOAD_OUTPUTS, download_task
from tasks.export import EXPORT_OUTPUTS, export_task
from tasks.train import train_task
from tasks.validate import VALIDATE_OUTPUTS, validate_task


@flow(name="kimi", log_prints=True, on_failure=[notify_failure], on_crashed=[notify_failure],
      on_completion=[clear_failure])
def kimi(
    recipe: str = "tiny",
    overrides: list[str] | None = None,
    run_dir: str | None = None,
    until: str | None = None,
) -> dict:
    """Run the pipeline for a recipe (preset name or YAML path) up to and including stage `until`."""
    r = load_recipe(recipe, overrides or [])
    path = prepare_run(r, run_dir)
    remember_run_dir(path)  # for the failure hook: DIR/FAILED.md
    run = str(path)
    print(f"run directory: {path}")
    selected = STAGES[: STAGES.index(until) + 1] if until else STAGES
    slot = contextlib.ExitStack()  # one run per Ray cluster: held from the cluster stage to its teardown
    try:
        dl = cached(download_task, DOWNLOAD_OUTPUTS, path)(r, run)
        if "validate" in selected:
            cached(validate_task, VALIDATE_OUTPUTS, path)(r, run, wait_for=[dl])
        cv = cached(convert_task, CONVERT_OUTPUTS, path)(r, run, wait_for=[dl]) if "convert" in selected else None
        if "cluster" in selected:
            slot.enter_context(cluster_slot(r))
        cl = cluster_task(r, run) if "cluster" in selected else None
        tr = train_task(r, run, cl, wait_for=[cv]) if "train" in selected else None
        if "export" in selected and tr is not None:
            cached(export_task, EXPORT_OUTPUTS, path)(r, run, tr["checkpoint_dir"], wait_for=[tr])
        mark_skipped(path, [s for s in STAGES if s not in selected])
    finally:
        try:
            stop_cluster(path)  # the run's embedded Ray cluster, also on failure (kept only with cluster.keep)
        finally:
            slot.close()
        md = write_summary_markdown(path)
        create_markdown_artifact(md.read_text(), key="run-summary", description=f"{r.name}: {path}")
    return {"run_dir": run, "summary": str(path / "summary.json")}
