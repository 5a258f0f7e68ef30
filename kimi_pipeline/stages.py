"""The pipeline's stages as plain functions: `stage_<name>(recipe, run_dir, ...) -> summary section`.

Each records its status and duration in DIR/summary.json and its key figures as a section of the
same name. Prefect tasks (tasks/) and the CLI call exactly these; nothing here imports Prefect.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kimi_pipeline.convert.hf_reader import HFCheckpoint, reference_mismatch
from kimi_pipeline.data.validate import DataValidationError, run_validate
from kimi_pipeline.errors import PermanentError
from kimi_pipeline.hub.download import dataset_path, model_root, read_manifest, run_download
from kimi_pipeline.model.tokenizer import load_tokenizer
from kimi_pipeline.recipes import Recipe, recipe_to_yaml
from kimi_pipeline.report.summary import RunSummary
from kimi_pipeline.util.files import atomic_write_text
from kimi_pipeline.util.paths import new_run_dir, resolve_path

if TYPE_CHECKING:
    from kimi_pipeline.rl.launch import LaunchPlan

STAGES = ("download", "validate", "convert", "cluster", "train", "export")


def prepare_run(recipe: Recipe, run_dir: str | Path | None = None) -> Path:
    """Create the run directory, write the resolved recipe and start summary.json."""
    path = resolve_path(run_dir, recipe.paths.base_dir) if run_dir else new_run_dir(recipe.paths.base_dir, recipe.name)
    path.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path / "recipe.yaml", recipe_to_yaml(recipe))
    RunSummary(path, recipe.name)
    return path


def stage_download(recipe: Recipe, run_dir: Path, token: str | None = None) -> dict[str, Any]:
    summary = RunSummary(run_dir, recipe.name)
    with summary.stage("download"):
        section = run_download(recipe, run_dir, token)
        summary.set_section("download", section)
    return section


def stage_validate(recipe: Recipe, run_dir: Path) -> dict[str, Any]:
    summary = RunSummary(run_dir, recipe.name)
    with summary.stage("validate"):
        manifest = read_manifest(run_dir)
        tokenizer = load_tokenizer(manifest["model"]["root"], recipe.hub.trust_remote_code)
        try:
            section = run_validate(
                recipe, run_dir, dataset_path(manifest, "train"), dataset_path(manifest, "eval"), tokenizer
            )
        except DataValidationError as e:
            summary.set_section("validate", e.section)
            raise
        summary.set_section("validate", section)
    return section


def mark_skipped(run_dir: Path, stages: list[str]) -> None:
    summary = RunSummary(run_dir)
    for s in stages:
        summary.set_stage(s, "skipped", 0.0)


def initial_weights(recipe: Recipe, run_dir: Path) -> Path:
    """The converted torch_dist checkpoint, or (bridge mode, K2.5) the downloaded HF directory itself."""
    if recipe.convert.mode == "bridge":
        return model_root(run_dir)
    from kimi_pipeline.convert.stage import checkpoint_dir, completed

    if completed(run_dir) is None:  # tracker and the stage's completion marker, both written last
        raise PermanentError(f"{checkpoint_dir(run_dir)}: no complete converted checkpoint; "
                             f"run the convert stage first (`kimi run --until convert`)")
    return checkpoint_dir(run_dir)


class ReferenceMismatchError(PermanentError):
    """The KL reference checkpoint (`hub.ref_model`) is not the actor's model."""


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
    data = RunSummary(run_dir).read()
    return (data.get("cluster") or {}).get("address")


def stage_train(
    recipe: Recipe,
    run_dir: Path,
    *,
    ray_address: str | None = None,
    evaluate: Callable[[int, list[str]], dict[str, Any]] | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    on_plan: Callable[[LaunchPlan], None] | None = None,
    stop_after: int | None = None,
    replay: Path | None = None,
    rollout_only: bool = False,
) -> dict[str, Any]:
    """Stage `train`: GRPO from the converted checkpoint on the run's Ray cluster, resuming when re-run; records
    `train` in summary.json. `evaluate` defaults to the in-process eval at each interval. It lives here, above
    `rl` and `eval`, because it wires the two (eval scores the trainer's engines; eval itself uses rl's parts).
    The debugging modes keep their own records beside training's: `replay` (train on the rollouts saved in that
    directory, no engines) as `replay`, `rollout_only` (generate and score, no trainer) as `rollout_only`."""
    from kimi_pipeline.eval.stage import run_eval_step
    from kimi_pipeline.rl.loop import run_training

    summary = RunSummary(run_dir, recipe.name)
    name = "replay" if replay is not None else "rollout_only" if rollout_only else "train"
    with summary.stage(name):
        hf_dir = model_root(run_dir)
        if evaluate is None:
            evaluate = lambda step, urls: run_eval_step(recipe, run_dir, step, urls, hf_dir)  # noqa: E731
        section = run_training(
            recipe, Path(run_dir), init_checkpoint=initial_weights(recipe, run_dir), model_dir=hf_dir,
            ref_checkpoint=reference_weights(recipe, run_dir),
            ray_address=ray_address or cluster_address(run_dir), evaluate=evaluate, on_step=on_step,
            on_plan=on_plan, stop_after=stop_after, replay=replay, rollout_only=rollout_only,
        )
        summary.set_section(name, section)
    return section
