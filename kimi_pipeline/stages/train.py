"""Stage `train`: GRPO from the converted checkpoint (or, in bridge mode, the downloaded HF directory) on the
run's Ray cluster, resuming when re-run, with the periodic evaluation. The stage wires `rl` and `eval` (eval
scores the trainer's engines; eval itself uses rl's parts), so it lives above both.

The debugging modes keep their own records beside training's: `replay` (train on the rollouts saved in that
directory, no engines) as `replay`, `rollout_only` (generate and score, no trainer) as `rollout_only`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kimi_pipeline.errors import PermanentError
from kimi_pipeline.eval.record import EvalSections, run_eval_step
from kimi_pipeline.hf.reader import HFCheckpoint, reference_mismatch
from kimi_pipeline.hub.fetch import model_root, read_manifest
from kimi_pipeline.recipes import Recipe
from kimi_pipeline.report.stage_reports import train_report
from kimi_pipeline.report.summary import RunSummary
from kimi_pipeline.rl.actor_layout import ActorLayout
from kimi_pipeline.rl.loop import run_training
from kimi_pipeline.stages.runner import Stage, StageReport
from kimi_pipeline.weightjobs.conversion import checkpoint_dir, completed


class ReferenceMismatchError(PermanentError):
    """The KL reference checkpoint (`hub.ref_model`) is not the actor's model."""


def initial_weights(recipe: Recipe, run_dir: Path) -> Path:
    """The converted torch_dist checkpoint, or (bridge mode, K2.5) the downloaded HF directory itself."""
    if recipe.convert.mode == "bridge":
        return model_root(run_dir)
    if completed(run_dir) is None:  # tracker and the stage's completion marker, both written last
        raise PermanentError(f"{checkpoint_dir(run_dir)}: no complete converted checkpoint; "
                             f"run the convert stage first (`kimi run --until convert`)")
    return checkpoint_dir(run_dir)


def reference_weights(recipe: Recipe, run_dir: Path) -> Path | None:
    """The KL reference's weights when the recipe names its own (`hub.ref_model`: the K2.5 recipe's BF16 copy of
    its INT4 actor), checked now, before any trainer starts, to hold the actor's tensors under the actor's logical
    names and shapes; None: the reference starts from the actor's weights."""
    if recipe.hub.ref_model is None or not (recipe.grpo.use_kl_loss and recipe.grpo.kl_loss_coef > 0):
        return None
    fetched = read_manifest(run_dir).get("ref_model")
    if fetched is None:
        raise ReferenceMismatchError(f"{run_dir}/download/manifest.json has no ref_model: the recipe's hub.ref_model "
                                     "was set after the download stage ran; run the download stage again")
    ref = Path(fetched["root"])
    reference = HFCheckpoint(ref, text_config_key=recipe.hub.text_config_key)
    actor = HFCheckpoint(model_root(run_dir), text_config_key=recipe.hub.text_config_key)
    try:
        mismatch = reference_mismatch(reference, actor)
    finally:
        reference.close()
        actor.close()
    if mismatch:
        raise ReferenceMismatchError(
            f"hub.ref_model {ref} is not a copy of the actor {actor.root}: {mismatch}; point hub.ref_model at the "
            "BF16 copy of this checkpoint (same revision)")
    return ref


def cluster_address(run_dir: Path) -> str | None:
    """The address the run's cluster stage recorded in summary.json."""
    data = RunSummary(run_dir).read()
    return (data.get("cluster") or {}).get("address")


def run(recipe: Recipe, run_dir: Path, *, ray_address: str | None = None,
        evaluate: Callable[[int, list[str]], dict[str, Any]] | None = None,
        on_step: Callable[[dict[str, Any]], None] | None = None, on_layout: Callable[[ActorLayout], None] | None = None,
        stop_after: int | None = None, replay: Path | None = None, rollout_only: bool = False) -> dict[str, Any]:
    """`evaluate` defaults to the in-process eval at each interval; `ray_address` to the cluster stage's."""
    hf_dir = model_root(run_dir)
    if evaluate is None:
        evaluate = lambda step, urls: run_eval_step(EvalSections.of(recipe), run_dir, step, urls, hf_dir)  # noqa: E731
    return run_training(
        recipe, run_dir, init_checkpoint=initial_weights(recipe, run_dir), model_dir=hf_dir,
        ref_checkpoint=reference_weights(recipe, run_dir),
        ray_address=ray_address or cluster_address(run_dir), evaluate=evaluate, on_step=on_step,
        on_layout=on_layout, stop_after=stop_after, replay=replay, rollout_only=rollout_only,
    )


def record_name(replay: Path | None = None, rollout_only: bool = False) -> str:
    """Where a run with these arguments of `run` is recorded in summary.json (`stage_run(..., record_as=...)`):
    training, or one of its debugging modes, whose records must not overwrite training's."""
    return "replay" if replay is not None else "rollout_only" if rollout_only else "train"


TRAIN = Stage(
    name="train",
    reads=("model", "hub", "data", "convert", "parallel", "cluster", "rollout", "sglang", "grpo", "eval", "optimizer",
           "quant", "checkpoint", "health", "paths"),
    needs=("convert", "cluster"),
    outputs=(),
    report=StageReport(key="train", render=train_report, title="GRPO training summary"),
)
