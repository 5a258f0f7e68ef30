"""The GRPO driver: rollout → reward → advantages → train → weight sync → checkpoint → eval.

Runs in the stage's process and wires a few objects that each own their phase, as slime's `train.py`
does: the `RolloutManager` actor (engines, prompts, reward, the split over data-parallel ranks; the samples
go from it to the trainers through the object store, not through this process), the `TrainerGroup` (the
`PolicyWorker` ranks, one torch.distributed job) and the `PeriodicEval`. Every random choice is seeded by
(recipe seed, step), and a checkpoint carries the data position, so a retried stage resumes from its latest
checkpoint and ends with the same metrics as an uninterrupted run.

Read it top down: `run_training` (the wiring), the step loop `_loop`, then the pieces they call, each after its
caller. Which failure the stage raises as what lives in `rl.ray_errors`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import ray
from ray.actor import ActorHandle

from kimi_pipeline.cluster.env import is_loopback_address, use_loopback_ray
from kimi_pipeline.cluster.placement import create_placement_groups, remove_placement_groups
from kimi_pipeline.cluster.readiness import Requirements, wait_until_healthy
from kimi_pipeline.engine.client import EngineRequestError, EnginesDown, EngineUnreachable
from kimi_pipeline.engine.key import use_run_key
from kimi_pipeline.engine.kinds import engine_kind
from kimi_pipeline.errors import PermanentError
from kimi_pipeline.hf.names import HFLayout
from kimi_pipeline.model.checkpoint_dirs import iteration_dir, latest_step, prune_checkpoints
from kimi_pipeline.model.megatron_train import NonFiniteError
from kimi_pipeline.recipes import Recipe
from kimi_pipeline.recipes.models import ClusterSpec
from kimi_pipeline.report.metrics_log import MetricsLog, first_last_mean, open_wandb, read_jsonl
from kimi_pipeline.report.progress import TrainProgress
from kimi_pipeline.rl.actor_layout import ActorLayout, check_layout, lay_out_actors
from kimi_pipeline.rl.evaluator import EvalFn, PeriodicEval
from kimi_pipeline.rl.handoff import Handoff
from kimi_pipeline.rl.health_rules import STOP, HealthRules, HealthStop, health_section
from kimi_pipeline.rl.ray_errors import RayHeadLost, first_line, head_lost, root_cause, stage_error
from kimi_pipeline.rl.rollout_data import SavedRollouts
from kimi_pipeline.rl.rollout_manager import start_rollout_manager, stop_rollout_manager
from kimi_pipeline.rl.step_metrics import plain
from kimi_pipeline.rl.trainer_group import TrainerGroup
from kimi_pipeline.util.redact import ray_worker_setup
from kimi_pipeline.util.threads import cpu_threads

log = logging.getLogger(__name__)


def run_training(recipe: Recipe, run_dir: Path, *, init_checkpoint: Path, model_dir: Path,
                 ref_checkpoint: Path | None = None, ray_address: str | None = None, evaluate: EvalFn | None = None,
                 on_step: Callable[[dict[str, Any]], None] | None = None,
                 on_layout: Callable[[ActorLayout], None] | None = None, stop_after: int | None = None,
                 replay: Path | None = None, rollout_only: bool = False) -> dict[str, Any]:
    """Train `recipe.rollout.num_rollout` rollouts (resuming from DIR/train/checkpoints); return the summary section.

    `model_dir` is the base HF checkpoint the engines serve (its names are the ones weight sync sends);
    `ref_checkpoint` the KL reference's own weights (default: `init_checkpoint`).
    `evaluate(step, engine_urls)` is called at step 0 of a fresh run, every `eval.interval` steps and at
    the end (the task layer makes each one a retried Prefect task). `on_layout(layout)` sees the actor layout
    before it is checked (the task shows it, problems and all). `stop_after` ends early (tests).
    `replay`: train on the rollouts saved there (`rollout.save_data`) instead of generating: no engines, no weight
    sync, no eval. `rollout_only`: generate and score with the starting policy, no trainer (rows of rollout
    metrics; with `rollout.save_data` a recording to replay).
    """
    paths = _train_paths(Path(run_dir), replay, rollout_only)
    use_run_key(run_dir)  # before the layout: every actor's environment names the run's engine key file
    layout = lay_out_actors(recipe, str(model_dir))  # pure: no Ray yet
    if on_layout:
        on_layout(layout)
    _connect_ray(ray_address)
    _require_healthy_cluster(recipe.cluster, ray_address)
    total = recipe.rollout.num_rollout
    with_engines = replay is None  # replaying saved rollouts starts no engine, so nothing evaluates or takes weights
    evaluator = PeriodicEval(evaluate, recipe.eval.interval, total) if evaluate and with_engines and not rollout_only \
        else None
    metrics_log = _open_metrics_log(recipe, Path(run_dir), paths)
    actors = TrainingActors()
    # colocated engines and trainer take turns on the GPUs; with one side missing there is nothing to hand over
    handoff = Handoff(recipe.cluster.colocate and with_engines and not rollout_only, actors.engines_memory,
                      actors.trainer_memory)
    end = total if stop_after is None else min(total, stop_after)
    with closing(metrics_log), actors, _train_errors(recipe, ray_address, paths, actors):
        check_layout(layout)
        actors.start(recipe, Path(run_dir), model_dir, layout, paths, with_engines=with_engines)
        if rollout_only:
            _rollout_only(recipe, actors.live_rollouts(handoff), metrics_log, end, on_step)
            return _train_section(paths, recipe)
        handoff.to("train")  # colocated: the engines give their GPUs to the trainer while it builds and loads
        extra = actors.start_trainers(recipe, layout, paths.checkpoints, init_checkpoint, ref_checkpoint, model_dir)
        start, health = _resume(recipe, extra, actors, handoff, metrics_log, paths)
        source = actors.live_rollouts(handoff) if with_engines else _saved_rollouts(recipe, replay)
        _loop(recipe, source, actors.trainers, handoff, evaluator, health, metrics_log, paths, start, end, on_step)
    return _train_section(paths, recipe)


def _loop(
    recipe: Recipe,
    source: LiveRollouts | SavedRollouts,
    trainers: TrainerGroup,
    handoff: Handoff,
    evaluator: PeriodicEval | None,
    health: HealthRules,
    metrics_log: MetricsLog,
    paths: TrainPaths,
    start: int,
    end: int,
    on_step: Callable[[dict[str, Any]], None] | None,
) -> None:
    """rollout (split over DP ranks) → train → health → checkpoint → weight sync → metrics → eval, `start` to `end`.
    `source` gives each step's rollout: the engines' (`LiveRollouts`) or saved ones (`SavedRollouts`, no weight
    sync). Colocated, `handoff` moves the GPUs between engines and trainer around each phase (`rl/handoff.py`);
    the checkpoint is written while the trainer holds them, with the step's row so far in its state, so a run
    stopped before the row is written still logs it. The health rules judge each row before its checkpoint: a stop
    writes the row (its verdicts say which rule) and no checkpoint of the step."""

    total = recipe.rollout.num_rollout
    progress = TrainProgress(total, start)
    if evaluator and start == 0:  # the base policy, on a fresh run only
        progress.log_eval(0, source.evaluate(evaluator, 0))
    progress.start_clock()
    handoff.take_seconds()  # start-up moves are not a step's
    for step in range(start, end):
        t0 = time.perf_counter()
        shares, row, restarts = source.take(step)  # one object-store reference per DP rank
        handoff.to("train")
        done = step + 1
        row = {"step": done, **row, "engine_restarts": float(restarts)}
        try:
            row.update(plain(trainers.train(shares, step)))
        except ray.exceptions.RayTaskError as e:
            if not isinstance(root_cause(e), NonFiniteError):
                raise
            stop = health.nonfinite_stop(done, root_cause(e))
            metrics_log.log({**row, "health_nonfinite": STOP})
            raise stop from e
        verdicts, stop = health.judge(row)
        row.update(verdicts)
        if stop is not None:
            metrics_log.log(row)
            raise stop
        if done % recipe.checkpoint.save_interval == 0 or done == total:
            row["step_seconds"] = time.perf_counter() - t0  # until the save, should the run stop before the row
            trainers.save(paths.checkpoints, done, {"step": done, "data": source.state(), "row": row})
            prune_checkpoints(paths.checkpoints, recipe.checkpoint.keep_last)
        sync: dict[str, float] = {}
        if source.urls:
            sync, restarted = source.sync(str(done))  # engines restarted during this step serve again
            row["engine_restarts"] += restarted
        row = {**row, **sync, "step_seconds": time.perf_counter() - t0}
        if handoff.colocated:  # what the memory handoff cost this step (GPU memory to host and back, at scale)
            row["handoff_seconds"] = handoff.take_seconds()
        metrics_log.log(row)
        progress.log_step(row)
        if on_step:
            on_step(row)
        if evaluator and evaluator.should_evaluate(done):
            progress.log_eval(done, source.evaluate(evaluator, done))


def _rollout_only(
    recipe: Recipe,
    source: LiveRollouts,
    metrics_log: MetricsLog,
    end: int,
    on_step: Callable[[dict[str, Any]], None] | None,
) -> None:
    """Generate and score `end` rollouts with the starting policy, no trainer: one row of rollout metrics each (the
    recipes' framework's rollout-only debug mode; with `rollout.save_data` it records rollouts to replay)."""
    metrics_log.truncate_after(0)  # nothing to resume: every rollout-only run starts at step 1
    progress = TrainProgress(recipe.rollout.num_rollout, 0)
    progress.start_clock()
    for step in range(end):
        t0 = time.perf_counter()
        _shares, row, restarts = source.take(step)
        row = {"step": step + 1, **row, "engine_restarts": float(restarts), "step_seconds": time.perf_counter() - t0}
        metrics_log.log(row)
        progress.log_step(row)
        if on_step:
            on_step(row)


class LiveRollouts:
    """Each step's rollout, weight sync and eval through the engines (the `RolloutManager` actor), through engine
    deaths in any of them: engines that stopped answering are restarted (`heal`) and brought to the policy through
    the normal sync path (without a trainer, rollout-only, they serve the weights they started with), then what
    every engine dropped runs again: the rollout from the same prompts, the sync whole, the eval with its step's
    seed. Each is seeded or deterministic, so the run ends with an uninterrupted run's metrics. A step's row counts
    the engines restarted from its rollout to its row (`engine_restarts`); those restarted during the eval after
    it count in the next row. `urls` (the engines', kept current) is the list the caller passed."""

    def __init__(
        self, manager, urls: list[str], trainers: TrainerGroup | None, handoff: Handoff, start_version: str
    ) -> None:
        self.manager, self.urls, self.trainers, self.handoff = manager, urls, trainers, handoff
        self.start_version = start_version  # what restarted engines serve without a trainer to sync them
        self.uncounted = 0  # engines restarted since the last row (during an eval): the next row counts them

    def take(self, step: int) -> tuple[list, dict[str, Any], int]:
        """(one object-store reference per data-parallel rank, the rollout's metrics, engines restarted)."""
        restarts, self.uncounted = self.uncounted, 0
        while True:
            restarts += self._revive(str(step))  # serve the policy of `step` before the rollout of `step`
            result = ray.get(self.manager.generate.remote(step))
            if result is not None:
                break
        return result[0], result[1], restarts + self._heal()

    def sync(self, version: str) -> tuple[dict[str, float], int]:
        """The trainer's weights to every engine as `version`: (the sync's metrics, engines restarted). An engine
        that stops answering mid-sync is restarted and the sync runs again whole (the restarted engine holds none
        of the buckets sent before; the trainer ranks drop their updater, all of them, and build it for the new
        URLs). Anything but an engine that stopped answering is the stage's error."""
        restarts = 0
        while True:
            self.handoff.to("weight_sync")
            try:
                metrics = plain(self.trainers.sync_weights(self.urls, version))
            except ray.exceptions.RayTaskError as e:
                if not isinstance(root_cause(e), EngineUnreachable):
                    raise
                log.warning("weight sync %s: %s; it runs again after the engines restart", version, first_line(e))
                self.trainers.release()
                restarted = self._heal()
                if not restarted:
                    raise
                restarts += restarted
                continue
            finally:
                self.handoff.to("rollout")
            self.settle(version)
            return metrics, restarts

    def evaluate(self, evaluator: PeriodicEval, step: int) -> dict[str, Any]:
        """`evaluator` on the engines serving the policy of `step`. When every engine stopped answering during it,
        they are restarted, synced to that policy and the eval runs again: seeded by its step, it scores as the
        first try would have (an engine lost beside others only moves its requests, `engine.client.Router`)."""
        while True:
            try:
                return evaluator.evaluate(step, self.urls)
            except EnginesDown as e:
                log.warning("eval at step %d: %s; it runs again after the engines restart", step, e)
                restarted = self._revive(str(step))
                if not restarted:
                    raise
                self.uncounted += restarted

    def _revive(self, version: str) -> int:
        """Restart the engines that stopped answering and bring them to the policy at `version`; how many."""
        restarted = self._heal()
        if restarted and self.trainers is not None:
            _, more = self.sync(version)
            restarted += more
        elif restarted:
            self.settle(self.start_version)
        return restarted

    def _heal(self) -> int:
        urls, restarted = ray.get(self.manager.heal.remote())
        self.urls[:] = urls
        return restarted

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the rollout side (the prompt stream's position)."""
        return ray.get(self.manager.state.remote())

    def settle(self, version: str) -> None:
        """Restarted engines at weight version `version` serve again."""
        ray.get(self.manager.rejoin.remote(version))


def _train_paths(run_dir: Path, replay: Path | None, rollout_only: bool) -> TrainPaths:
    """The directory of this kind of run, made: replay and rollout-only runs keep their own metrics and checkpoints
    beside the run's training (`replay/`, `rollout-only/`, `train/`), never over it. The two modes exclude each
    other."""
    if replay is not None and rollout_only:
        raise PermanentError("--replay-rollouts trains on saved rollouts and --rollout-only only generates them: "
                             "pick one")
    paths = TrainPaths(run_dir / ("replay" if replay is not None else "rollout-only" if rollout_only else "train"))
    paths.root.mkdir(parents=True, exist_ok=True)
    return paths


@dataclass
class TrainPaths:
    root: Path

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def rollouts(self) -> Path:
        """Saved rollouts (`rollout.save_data`), one safetensors/JSON pair per step (`rl/rollout_data.py`)."""
        return self.root / "rollouts"


def _connect_ray(address: str | None) -> None:
    """Join the cluster at `address` unless this process is already connected (a test's cluster, an earlier
    attempt): on a loopback address as a loopback driver, every actor's worker redacting its log records."""
    if ray.is_initialized():
        return
    if address is None:
        raise PermanentError("no Ray cluster: run the cluster stage first (or pass --ray-address)")
    use_loopback_ray(is_loopback_address(address))
    ray.init(address=address, log_to_driver=False, runtime_env=ray_worker_setup())


def _require_healthy_cluster(cluster: ClusterSpec, address: str | None, timeout_s: float = 60.0) -> None:
    """Actors on a cluster that lost a node would wait forever for resources: check first, fail clearly
    (a transient error: the task retry waits again, e.g. for the node to come back)."""

    wait_until_healthy(address or ray.get_runtime_context().gcs_address, Requirements.of(cluster),
                       timeout_s=timeout_s, progress=log.info)


def _open_metrics_log(recipe: Recipe, run_dir: Path, paths: TrainPaths) -> MetricsLog:
    """Where each step's row goes: metrics.jsonl and TensorBoard under `paths`, and a W&B run (named
    RECIPE-RUNDIR) when W&B is configured."""
    wandb_run = open_wandb(None, f"{recipe.name}-{run_dir.name}", recipe.worker_dump())
    return MetricsLog(paths.metrics, tensorboard_dir=paths.tensorboard, wandb_run=wandb_run)


class TrainingActors:
    """What a run starts on the cluster, and stops when its `with` block ends: the placement groups, the
    `RolloutManager` actor (None without engines) with its engines' URLs (one list, which `LiveRollouts` keeps
    current) and the `TrainerGroup` (None until `start_trainers`). `engines_memory` and `trainer_memory` are the
    calls a colocated `Handoff` moves the GPUs with."""

    def __init__(self) -> None:
        self.pgs: dict = {}
        self.rollouts: ActorHandle | None = None  # the RolloutManager actor
        self.urls: list[str] = []  # the engines'
        self.trainers: TrainerGroup | None = None

    def start(self, recipe: Recipe, run_dir: Path, model_dir: Path, layout: ActorLayout, paths: TrainPaths, *,
              with_engines: bool) -> None:
        """The placement groups, then (`with_engines`) the rollout manager with its engines serving `model_dir`."""
        self.pgs = create_placement_groups(layout.placement)
        if with_engines:
            self.rollouts, self.urls = start_rollout_manager(
                recipe,
                run_dir,
                model_dir,
                layout,
                self.pgs,
                _cpu_threads(recipe.cluster, 1),
                paths.rollouts if recipe.rollout.save_data else None,
            )

    def start_trainers(self, recipe: Recipe, layout: ActorLayout, checkpoints: Path, init_checkpoint: Path,
                       ref_checkpoint: Path | None, model_dir: Path) -> dict[str, Any]:
        """The trainer ranks, loaded from the latest checkpoint in `checkpoints`, else from `init_checkpoint` (the KL
        reference from `ref_checkpoint`, default `init_checkpoint`); returns the checkpoint's own state (empty on
        a fresh start)."""
        self.trainers = TrainerGroup(
            recipe, layout, self.pgs["trainer"], _cpu_threads(recipe.cluster, recipe.cluster.gpus_per_node)
        )
        return self.trainers.load(checkpoints, init_checkpoint, ref_checkpoint or init_checkpoint,
                                  HFLayout.of_dir(model_dir))

    def live_rollouts(self, handoff: Handoff) -> LiveRollouts:
        """Each step's rollout through the engines, from the weight version they serve now."""
        return LiveRollouts(self.rollouts, self.urls, self.trainers, handoff, ray.get(self.rollouts.connect.remote()))

    def engines_memory(self, action: str, tags: tuple[str, ...]) -> None:
        """Colocated: the engines release or resume these kinds of GPU memory."""
        method = self.rollouts.release_memory if action == "release" else self.rollouts.resume_memory
        ray.get(method.remote(tags))

    def trainer_memory(self, action: str, parts: tuple[str, ...]) -> None:
        """Colocated: every trainer rank puts these parts of its state to sleep or wakes them."""
        (self.trainers.sleep if action == "sleep" else self.trainers.wake)(parts)

    def __enter__(self) -> TrainingActors:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Stop them all: a retry in this driver must find the bundles free again. Not when the Ray head was lost:
        every call would wait on a dead GCS, and there is nothing left to free."""
        if isinstance(exc, RayHeadLost):
            return
        if self.trainers is not None:
            self.trainers.close()
        if self.rollouts is not None:
            stop_rollout_manager(self.rollouts)
        remove_placement_groups(self.pgs)


def _cpu_threads(cluster: ClusterSpec, ranks_per_node: int) -> int:
    """Intra-op threads of each actor: on CUDA one (the GPU computes); on CPU the node's cores shared out."""
    return 1 if cluster.device == "cuda" else cpu_threads(ranks_per_node, cluster.cpus_per_node)


@contextmanager
def _train_errors(recipe: Recipe, ray_address: str | None, paths: TrainPaths, actors: TrainingActors) -> Iterator[None]:
    """How a failure leaves training: a health stop carries the train section so far, its stop included; a Ray or
    engine error becomes the stage's own (`rl.ray_errors`): the head lost, else a permanent error inside an actor
    or a retryable one naming the actor that failed."""
    try:
        yield
    except HealthStop as stop:
        section = _train_section(paths, recipe)
        section["health"]["stop"] = stop.summary()
        stop.section = section
        raise
    except (ray.exceptions.RayError, EngineRequestError) as e:
        lost = head_lost(e, ray_address or ray.get_runtime_context().gcs_address, paths.checkpoints)
        if lost is not None:
            raise lost from e
        err = stage_error(e, _engine_names(recipe, actors.urls))
        if err is e:
            raise
        raise err from e


def _engine_names(recipe: Recipe, urls: list[str]) -> dict[str, str]:
    """Engine URL → how an error names the engine behind it ("rollout engine 0 (SGLangEngine actor)")."""
    actor = engine_kind(recipe.rollout.engine).actor_class().__name__ if urls else ""
    return {url: f"rollout engine {i} ({actor} actor)" for i, url in enumerate(urls)}


def _resume(recipe: Recipe, extra: dict[str, Any], actors: TrainingActors, handoff: Handoff, metrics_log: MetricsLog,
            paths: TrainPaths) -> tuple[int, HealthRules]:
    """Bring every part to the step the trainers loaded (`extra`: its checkpoint's state, empty on a fresh start):
    the metrics rows after it dropped, the health rules as an uninterrupted run has them, the prompt stream at its
    position, the engines serving its weights, and its row logged if the run stopped between the save and the row.
    Returns (that step, the health rules)."""
    start = int(extra.get("step", 0))
    metrics_log.truncate_after(start)  # a fresh start too: an earlier attempt's rows are not this run's
    health = HealthRules(recipe.health, paths.checkpoints)
    health.replay(read_jsonl(paths.metrics))  # the rules' streaks and best reward, as an uninterrupted run has them
    if extra:
        if actors.rollouts is not None:
            ray.get(actors.rollouts.restore.remote(extra["data"]))
        log.info("resumed from %s at step %d", paths.checkpoints, start)
    sync = _first_weight_sync(actors, handoff, start)
    if extra.get("row") and _last_logged_step(paths) < start:  # saved, then stopped before its row was written
        metrics_log.log({**extra["row"], **sync})
    return start, health


def _first_weight_sync(actors: TrainingActors, handoff: Handoff, start: int) -> dict[str, float]:
    """The engines (if any) take the loaded weights, as version `start`, before the first rollout; the sync's
    metrics."""
    handoff.to("weight_sync")
    sync = plain(actors.trainers.sync_weights(actors.urls, str(start))) if actors.urls else {}
    handoff.to("rollout")
    return sync


def _last_logged_step(paths: TrainPaths) -> int:
    """The step of the last metrics row written (0: none)."""
    rows = read_jsonl(paths.metrics)
    return int(rows[-1]["step"]) if rows else 0


def _saved_rollouts(recipe: Recipe, replay: Path) -> SavedRollouts:
    """The rollouts saved in `replay` (`rollout.save_data`), split over the trainer's data-parallel ranks."""
    source = SavedRollouts(replay, recipe.model, recipe.rollout, recipe.parallel, recipe.data_parallel_size)
    log.info("training on the rollouts saved in %s (no engines)", replay)
    return source


def _train_section(paths: TrainPaths, recipe: Recipe) -> dict[str, Any]:
    """The stage's summary section, read back from what the run wrote: its metrics rows and checkpoints."""
    rows = read_jsonl(paths.metrics)
    first, last = first_last_mean(rows, "reward_mean")
    ckpt_step = latest_step(paths.checkpoints)
    return {
        "steps": len(rows),
        "reward_first": first,
        "reward_last": last,
        "checkpoint": str(iteration_dir(paths.checkpoints, ckpt_step)) if ckpt_step is not None else None,
        "checkpoint_dir": str(paths.checkpoints),
        "checkpoint_step": ckpt_step,
        "metrics": str(paths.metrics),
        "seconds_per_step": sum(r.get("step_seconds", 0) for r in rows) / max(len(rows), 1),
        "health": health_section(rows, recipe.health),
    }
