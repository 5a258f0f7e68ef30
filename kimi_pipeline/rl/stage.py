"""Stage `train`: GRPO from the converted checkpoint on the run's Ray cluster; resumes when re-run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kimi_pipeline.errors import PermanentError
from kimi_pipeline.hub.download import model_root
from kimi_pipeline.recipes import Recipe
from kimi_pipeline.report.summary import RunSummary

def initial_weights(recipe: Recipe, run_dir: Path) -> Path:
    """The converted torch_dist checkpoint, or (bridge mode, K2.5) the downloaded HF directory itself."""
    if recipe.convert.mode == "bridge":
        return model_root(run_dir)
    from kimi_pipeline.convert.stage import checkpoint_dir, completed

    if completed(run_dir) is None:  # tracker and the stage's completion marker, both written last
        raise PermanentError(f"{checkpoint_dir(run_dir)}: no complete converted checkpoint; "
                             f"run the convert stage first (`kimi run --until convert`)")
    return checkpoint_dir(run_dir)


def cluster_address(run_dir: Path) -> str | None:
    data = RunSummary(run_dir).read()
    return (data.get("cluster") or {}).get("address")


def stage_train(
    recipe: Recipe,
    run_dir: Path,
    *,
    ray_address: str | None = None,
    evaluate: Callable[[int, list[str]], dict[str, Any]] | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    stop_after: int | None = None,
) -> dict[str, Any]:
    """Train and record `train` in summary.json; `evaluate` defaults to the in-process eval at each interval."""
    from kimi_pipeline.eval.stage import run_eval_step
    from kimi_pipeline.rl.loop import run_training

    summary = RunSummary(run_dir, recipe.name)
    with summary.stage("train"):
        hf_dir = model_root(run_dir)
        if evaluate is None:
            evaluate = lambda step, urls: run_eval_step(recipe, run_dir, step, urls, hf_dir)  # noqa: E731
        section = run_training(
            recipe, Path(run_dir), init_checkpoint=initial_weights(recipe, run_dir), model_dir=hf_dir,
            ray_address=ray_address or cluster_address(run_dir), evaluate=evaluate, on_step=on_step,
            stop_after=stop_after,
        )
        summary.set_section("train", section)
    return section
