"""Tasks `train` and `eval`.

`train` is not cached: its state lives in its checkpoints, and a retry (or a re-run of the flow on
the same run dir) resumes from the latest one — a killed trainer costs the steps since the last save.
Each periodic evaluation is its own `eval` task run (visible in the UI, with a table artifact),
retried on its own without restarting training. Progress is a Prefect progress artifact; the health rules'
verdicts (`rl.health_rules`) a markdown artifact, published when a rule stops the run too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE

from kimi_pipeline.engine.client import EnginesDown
from kimi_pipeline.eval.record import EvalSections, run_eval_step
from kimi_pipeline.hub.fetch import model_root
from kimi_pipeline.recipes import Recipe
from kimi_pipeline.rl.actor_layout import ActorLayout, layout_markdown
from kimi_pipeline.rl.health_rules import HealthStop, health_markdown
from kimi_pipeline.stages import TRAIN, train
from tasks.common import RETRY_DELAYS, markdown_artifact, retry_unless_permanent, stage_task


def _retry_eval(task, task_run, state) -> bool:
    """Retry a transient eval failure, except every engine down: the training loop restarts them, syncs them to
    the policy and runs the eval again (`rl.loop.LiveRollouts.evaluate`); a retry here would ask the dead ones."""
    try:
        state.result()
    except EnginesDown:
        return False
    except BaseException:  # noqa: BLE001 - the general rule classifies it
        return retry_unless_permanent(task, task_run, state)
    return True


@task(
    name="eval",
    task_run_name="eval-step-{step}",
    retries=2,
    retry_delay_seconds=2,
    retry_condition_fn=_retry_eval,
    cache_policy=NO_CACHE,
    persist_result=False,
)
def eval_task(recipe: Recipe, run_dir: str, step: int, engine_urls: list[str], model_dir: str) -> dict[str, Any]:
    result = run_eval_step(EvalSections.of(recipe), Path(run_dir), step, engine_urls, Path(model_dir))
    markdown_artifact(result.pop("markdown"), "eval", f"AIME-style eval at step {step}")
    return result


@task(
    name="train",
    retries=2,
    retry_delay_seconds=RETRY_DELAYS,
    retry_condition_fn=retry_unless_permanent,
    cache_policy=NO_CACHE,
    persist_result=False,
)
def train_task(recipe: Recipe, run_dir: str, cluster: dict[str, Any] | None = None) -> dict[str, Any]:
    """`cluster`: the cluster task's section (its Ray address); None = the address in the run's summary.json."""
    total = recipe.rollout.num_rollout
    progress_id = create_progress_artifact(progress=0.0, key="train-progress", description=f"GRPO rollouts of {total}")
    hf_dir = str(model_root(run_dir))

    def on_step(row: dict[str, Any]) -> None:
        update_progress_artifact(progress_id, progress=100.0 * row["step"] / total)

    def evaluate(step: int, urls: list[str]) -> dict[str, Any]:
        return eval_task(recipe, run_dir, step, urls, hf_dir)

    def show_layout(layout: ActorLayout) -> None:  # shown before the stage refuses a layout with problems
        markdown_artifact(layout_markdown(layout), "launch-plan", "trainer ranks and engines → nodes/GPUs")

    try:
        with stage_task(TRAIN, recipe, run_dir) as record:
            section = record(train.run(recipe, Path(run_dir), ray_address=(cluster or {}).get("address"),
                                       evaluate=evaluate, on_step=on_step, on_layout=show_layout))
    except HealthStop as stop:
        markdown_artifact(health_markdown(stop.section["health"]), "health",
                          f"stopped by health rule {stop.rule} at step {stop.step}")
        raise
    markdown_artifact(health_markdown(section["health"]), "health", "health rules over every step")
    update_progress_artifact(progress_id, progress=100.0)
    return section
