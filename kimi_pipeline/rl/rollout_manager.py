"""The rollout side of a run, like slime's `RolloutManager`: it owns the engines, the prompt stream, the
reward and the split of each rollout over the trainer's data-parallel ranks."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from kimi_pipeline.recipes import Recipe
from kimi_pipeline.rl.engine.kinds import EngineGroup, start_engines
from kimi_pipeline.rl.prompts import PromptStream, load_prompts
from kimi_pipeline.rl.rollout import rollout
from kimi_pipeline.rl.samples import RankShare, Sample, share_rollout

log = logging.getLogger(__name__)


class RolloutManager:
    def __init__(self, recipe: Recipe, tokenizer, train_file: Path, model_dir: Path, plan, pgs: dict,
                 threads: int) -> None:
        """Load the prompts and start the engines where the launch plan puts them (`close` stops what started)."""
        from kimi_pipeline.reward import AnswerGrader

        d, ro = recipe.data, recipe.rollout
        self.recipe, self.tokenizer = recipe, tokenizer
        self.prompts = PromptStream(load_prompts(train_file, tokenizer, d.input_key, d.label_key,
                                                 d.apply_chat_template), ro.seed, ro.shuffle)
        self.reward = AnswerGrader(ro.rm_type, ro.thinking, strict=ro.reward_strict)
        self.engines: EngineGroup | None = None
        self.router = None
        try:
            self.engines = start_engines(recipe, plan, pgs, model_dir, threads)
        except BaseException:
            self.close()
            raise

    @property
    def urls(self) -> list[str]:
        return self.engines.urls if self.engines else []

    def connect(self) -> None:
        """The router the rollouts go through (after the first weight sync: the engines serve the policy)."""
        from kimi_pipeline.rl.engine.client import Router

        m = self.recipe.model
        self.router = Router(self.urls, num_layers=m.num_layers, topk=m.moe_router_topk,
                             first_k_dense=m.first_k_dense, server_concurrency=self.recipe.sglang.server_concurrency)

    def generate(self, step: int) -> tuple[list[Sample], dict[str, float]]:
        """Rollout `step`: graded samples with advantages, and the rollout's metrics."""
        return rollout(self.router, self.tokenizer, self.reward, self.prompts, self.recipe, step)

    def split(self, samples: list[Sample], step: int) -> tuple[list[RankShare], dict[str, float]]:
        """Each data-parallel rank's share (optimizer steps × micro-batches) and the split's metrics."""
        shares, split = share_rollout(samples, self.recipe)
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
        import ray

        if self.router is not None:
            self.router.close()
        self.reward.close()
        for a in self.engines.actors if self.engines else []:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - best effort: the actor may already be gone
                pass
