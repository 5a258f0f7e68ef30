"""Flow `kimi`: download → validate → convert → cluster → train (+ periodic eval) → export."""

from __future__ import annotations

import contextlib

from prefect import flow
from prefect.runtime import flow_run

from flows.limits import cluster_slot
from flows.notify import clear_failure, notify_failure, remember_run_dir
from kimi_pipeline.cluster.lifecycle import stop_cluster
from kimi_pipeline.cluster.run_guard import RunGuard
from kimi_pipeline.recipes import load_recipe
from kimi_pipeline.report.markdown import write_summary_markdown
from kimi_pipeline.stages import CONVERT, DOWNLOAD, EXPORT, STAGES, VALIDATE, mark_skipped, prepare_run
from kimi_pipeline.util.redact import install_log_redaction
from kimi_pipeline.util.run_lock import release_owner
from tasks.cluster import cluster_task
from tasks.common import cached, markdown_artifact
from tasks.convert import convert_task
from tasks.download import download_task
from tasks.export import export_task
from tasks.train import train_task
from tasks.validate import validate_task


def let_go_of_run_dir(flow, run, state) -> None:
    """Final-state hook: the flow run's retries are over, so its run directory's lock goes (a dead process's goes
    with it, by the kernel)."""
    release_owner(str(run.id))


@flow(name="kimi", log_prints=True, on_failure=[notify_failure, let_go_of_run_dir],
      on_crashed=[notify_failure, let_go_of_run_dir], on_completion=[clear_failure, let_go_of_run_dir],
      on_cancellation=[let_go_of_run_dir])
def kimi(
    recipe: str = "tiny",
    overrides: list[str] | None = None,
    run_dir: str | None = None,
    until: str | None = None,
) -> dict:
    """Run the pipeline for a recipe (preset name or YAML path) up to and including stage `until`."""
    install_log_redaction()  # a served run's own process: its log records reach the Prefect API redacted
    run_recipe = load_recipe(recipe, overrides or [])
    path = prepare_run(run_recipe, run_dir, owner=str(flow_run.id))  # held across this flow run's retries: hooks let go
    remember_run_dir(path)  # for the failure hook: DIR/FAILED.md
    run = str(path)
    print(f"run directory: {path}")
    selected = STAGES[: STAGES.index(until) + 1] if until else STAGES
    guard = RunGuard(path)  # if this process is killed -9, what it started is stopped and the summary says so
    slot = contextlib.ExitStack()  # one run per Ray cluster: held from the cluster stage to its teardown
    try:
        downloaded = cached(download_task, DOWNLOAD, path)(run_recipe, run)
        if "validate" in selected:
            cached(validate_task, VALIDATE, path)(run_recipe, run, wait_for=[downloaded])
        converted = (
            cached(convert_task, CONVERT, path)(run_recipe, run, wait_for=[downloaded]) if "convert" in selected else None
        )
        if "cluster" in selected:
            slot.enter_context(cluster_slot(run_recipe))
        cluster = cluster_task(run_recipe, run) if "cluster" in selected else None
        trained = train_task(run_recipe, run, cluster, wait_for=[converted]) if "train" in selected else None
        if "export" in selected and trained is not None:
            cached(export_task, EXPORT, path)(run_recipe, run, trained["checkpoint_dir"], wait_for=[trained])
        mark_skipped(path, [name for name in STAGES if name not in selected])
    finally:
        try:
            stop_cluster(path)  # the run's embedded Ray cluster, also on failure (kept only with cluster.keep)
        finally:
            slot.close()
        try:
            md = write_summary_markdown(path)
            markdown_artifact(md.read_text(), "run-summary", f"{run_recipe.name}: {path}")
        finally:
            guard.done()
    return {"run_dir": run, "summary": str(path / "summary.json")}
