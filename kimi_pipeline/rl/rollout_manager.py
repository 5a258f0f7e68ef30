"""The rollout side of a run, like slime's `RolloutManager`: a Ray actor that owns the engines, the prompt
stream, the reward processes and the split of each rollout over the trainer's data-parallel ranks.

Why an actor and not an object in the train task: the samples never pass through the driver. Each rollout's
shares go from this actor into the object store, and every trainer rank reads its data-parallel rank's share
there; the driver only sees the metrics. The engines are this actor's children, so they go when it goes. It is
pinned to the driver's node with no CPU reserved, which is where the rollout ran before (the actor layout's
bundles stay for trainers and engines).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from kimi_pipeline.engine.client import EngineRequestError, EnginesDown, Router
from kimi_pipeline.engine.kinds import EngineSections
from kimi_pipeline.model.tokenizer import load_tokenizer
from kimi_pipeline.recipes import Recipe
from kimi_pipeline.recipes.models import DataSpec, ModelSpec, ParallelSpec, RolloutSpec
from kimi_pipeline.reward import AnswerGrader
from kimi_pipeline.rl.actor_layout import rollout_manager_options
from kimi_pipeline.rl.engine_group import EngineGroup, restart_engine, start_engines
from kimi_pipeline.rl.prompts import PromptStream, load_prompts
from kimi_pipeline.rl.rollout import collect_rollout
from kimi_pipeline.rl.rollout_data import save_rollout
from kimi_pipeline.rl.samples import RankShare, Sample, share_rollout

log = logging.getLogger(__name__)


class EngineRestartsExhausted(EngineRequestError):
    """An engine died more often than `rollout.max_engine_restarts` allows (retryable: the stage retry starts
    every engine afresh)."""


@dataclass(frozen=True)
class RolloutSections:
    """The sections the rollout manager reads (`RolloutSections.of`): `data` the prompt columns, `rollout`
    sampling, rewards and the step schedule, `advantage_estimator` (`grpo.advantage_estimator`), `parallel` and
    `dp` (data-parallel ranks) the split over the trainer, `spec` the model shape (routed-expert ids), `engines` how
    its engines start (the tokenizer trusts remote code as they do). The hub token stays on the driver."""

    spec: ModelSpec
    data: DataSpec
    rollout: RolloutSpec
    advantage_estimator: str
    parallel: ParallelSpec
    dp: int
    engines: EngineSections

    @classmethod
    def of(cls, recipe: Recipe) -> RolloutSections:
        return cls(recipe.model, recipe.data, recipe.rollout, recipe.grpo.advantage_estimator, recipe.parallel,
                   recipe.data_parallel_size, EngineSections.of(recipe))


class RolloutManager:
    """Constructed by `start_rollout_manager`; every method is called through Ray (`.remote`)."""

    def __init__(self, sections: RolloutSections, *, train_file: str, model_dir: str,
                 save_dir: str | None = None) -> None:
        """`sections` what it reads (`RolloutSections`); `train_file` the validated prompts; `model_dir` what its
        engines serve. `save_dir`: where each rollout is saved (`rollout_data`), None: not saved."""
        self.spec, self.data, self.rollout = sections.spec, sections.data, sections.rollout
        self.advantage_estimator = sections.advantage_estimator
        self.parallel, self.dp, self.engine_sections = sections.parallel, sections.dp, sections.engines
        self.train_file, self.model_dir = Path(train_file), Path(model_dir)
        self.save_dir = Path(save_dir) if save_dir else None
        self.engines: EngineGroup | None = None
        self.router = None
        self.reward = None
        self.restarts: dict[int, int] = {}  # engine -> times restarted in this stage attempt
        self.retried_reported = 0  # the router's retried_requests up to the last rollout's metrics

    def start(self, actor_layout, pgs: dict, threads: int) -> list[str]:
        """Load the tokenizer and prompts, start the reward pool and the engines where the actor layout puts them;
        the engines' URLs. On failure, whatever started is stopped before the error is raised."""

        data, rollout = self.data, self.rollout
        try:
            self.tokenizer = load_tokenizer(self.model_dir, self.engine_sections.trust_remote_code)
            self.prompts = PromptStream(load_prompts(self.train_file, self.tokenizer, data.input_key, data.label_key,
                                                     data.apply_chat_template), rollout.seed, rollout.shuffle)
            self.reward = AnswerGrader(rollout.rm_type, rollout.thinking, strict=rollout.reward_strict)
            self.engines = start_engines(self.engine_sections, actor_layout, pgs, self.model_dir, threads)
            self._placed = (actor_layout, pgs, threads)  # where a restarted engine goes
        except BaseException:
            self.close()
            raise
        return self.engines.urls

    def connect(self) -> str:
        """The router the rollouts go through (after the first weight sync: the engines serve the policy); returns
        the engines' weight version."""
        return self._control().weight_version()

    def release_memory(self, tags: tuple[str, ...]) -> None:
        """Colocated: the engines free these kinds of GPU memory for the trainer (they must be idle)."""
        self._control().release_memory_occupation(tags)

    def resume_memory(self, tags: tuple[str, ...]) -> None:
        self._control().resume_memory_occupation(tags)

    def _control(self):
        """The router for control calls: the rollout router once connected, else one made for the engines (the
        first handoff comes before the first weight sync)."""

        if self.router is None:
            self.router = Router(self.engines.urls, server_concurrency=self.engine_sections.sglang.server_concurrency,
                                 **self._shape())
        return self.router

    def _shape(self) -> dict[str, int]:
        model = self.spec
        return {"num_layers": model.num_layers, "topk": model.moe_router_topk, "first_k_dense": model.first_k_dense}

    def generate(self, step: int) -> tuple[list, dict[str, float]] | None:
        """Rollout `step`: one object-store reference per data-parallel rank (its `RankShare`) and the
        rollout's and the split's metrics (`retried_requests`: requests sent again because their engine stopped
        answering). None when every engine stopped answering: the prompt stream is back where the rollout began,
        so the same rollout runs again once `heal` has restarted them."""

        start = self.prompts.state()
        try:
            samples, metrics = collect_rollout(self.router, self.tokenizer, self.reward, self.prompts, self.rollout,
                                       self.advantage_estimator, step)
        except EnginesDown as e:
            log.warning("step %d: %s; the rollout runs again after the engines restart", step + 1, e)
            self.prompts.restore(start)
            return None
        shares, split = self._split(samples, step)
        # since the last rollout that completed: a rollout every engine dropped counts in the one that ran again
        metrics["retried_requests"] = float(self.router.retried_requests - self.retried_reported)
        self.retried_reported = self.router.retried_requests
        metrics = {**metrics, **split}
        if self.save_dir is not None:
            save_rollout(self.save_dir, step + 1, samples, metrics)
        return [ray.put(s) for s in shares], metrics

    def heal(self) -> tuple[list[str], int]:
        """Restart every engine that stopped answering (taken out mid-rollout, or failing its health check now),
        in its placement, into the router as pending: it serves generation again after the next weight sync
        brings it to the policy (`rejoin`). Returns (the engines' URLs, engines restarted now). Past
        `rollout.max_engine_restarts` restarts of one engine: EngineRestartsExhausted naming it."""
        router = self._control()
        for e, client in enumerate(router.clients):
            if e not in router.down and not client.health():
                router.down[e] = f"{client.url}/health: no answer"
        dead = sorted(router.down)
        limit = self.rollout.max_engine_restarts
        for e in dead:
            self.restarts[e] = self.restarts.get(e, 0) + 1
            if self.restarts[e] > limit:
                raise EngineRestartsExhausted(
                    f"rollout engine {e} ({router.clients[e].url}) stopped answering and its restarts are used up "
                    f"(rollout.max_engine_restarts={limit}); its log is in the Ray session's logs; a retry of the "
                    f"stage starts every engine afresh")
            log.warning("restarting rollout engine %d (%s), restart %d of at most %d", e, router.clients[e].url,
                        self.restarts[e], limit)
            url = restart_engine(self.engines, e, self.engine_sections, *self._placed[:2], self.model_dir, self._placed[2])
            router.replace(e, url)
        return list(self.engines.urls), len(dead)

    def rejoin(self, version: str) -> None:
        """Restarted engines that the last weight sync brought to `version` serve generation again."""
        router = self._control()
        back = router.rejoin(version)
        if back:
            log.info("rollout engine(s) %s back at weight version %s", back, version)
        if router.pending:
            late = {e: router.clients[e].weight_version() for e in sorted(router.pending)}
            raise EngineRequestError(f"restarted rollout engine(s) not at weight version {version} after the "
                                     f"weight sync: {late}")

    def _split(self, samples: list[Sample], step: int) -> tuple[list[RankShare], dict[str, float]]:
        """Each data-parallel rank's share (optimizer steps × micro-batches) and the split's metrics."""
        shares, split = share_rollout(samples, self.rollout, self.parallel, self.dp)
        if split.trimmed:
            log.info("step %d: %d samples past the last full global batch (%d) not trained", step + 1,
                     len(split.trimmed), split.global_batch_size)
        return shares, {"global_batch_size": float(split.global_batch_size),
                        "samples_trimmed": float(len(split.trimmed))}

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the rollout side: the prompt stream's position."""
        return self.prompts.state()

    def restore(self, state: dict[str, Any]) -> None:
        self.prompts.restore(state)

    def close(self) -> None:
        """Stop the router, the reward processes and the engines (best effort: at teardown)."""

        if self.router is not None:
            self.router.close()
        if self.reward is not None:
            self.reward.close()
        for a in self.engines.actors if self.engines else []:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - best effort: the actor may already be gone
                pass
        self.router = self.reward = self.engines = None


def start_rollout_manager(recipe: Recipe, run_dir: Path, model_dir: Path, actor_layout, pgs: dict, threads: int,
                          save_dir: Path | None = None):
    """The run's `RolloutManager` actor, started (engines serving) on the driver's node; its engines' URLs. It reads
    the validated prompts of `run_dir` and saves each rollout under `save_dir` (None: not saved). It is sent the
    sections it reads (the hub token stays here)."""

    manager = ray.remote(RolloutManager).options(**rollout_manager_options(recipe.cluster.device)).remote(
        RolloutSections.of(recipe), train_file=str(run_dir / "validate" / "train.jsonl"), model_dir=str(model_dir),
        save_dir=str(save_dir) if save_dir else None)
    try:
        urls = ray.get(manager.start.remote(actor_layout, pgs, threads))
    except BaseException:
        stop_rollout_manager(manager)
        raise
    return manager, urls


def stop_rollout_manager(manager, timeout_s: float = 30.0) -> None:
    """Let the manager stop its engines and reward processes, then kill it (best effort: at teardown)."""

    try:
        ray.get(manager.close.remote(), timeout=timeout_s)
    except Exception:  # noqa: BLE001 - a dead manager's engines went with it (Ray fate-shares owned actors)
        pass
    try:
        ray.kill(manager)
    except Exception:  # noqa: BLE001 - it may already be gone
        pass
