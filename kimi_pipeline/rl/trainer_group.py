"""The trainer ranks of a run, like slime's `RayTrainGroup`: one `PolicyWorker` actor per rank (one
torch.distributed job), placed by the actor layout, driven together."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import ray

from kimi_pipeline.cluster.placement import free_port_on
from kimi_pipeline.hf.names import HFLayout
from kimi_pipeline.recipes import Recipe
from kimi_pipeline.rl.actor_layout import trainer_options
from kimi_pipeline.rl.policy import PolicySections, PolicyWorker
from kimi_pipeline.rl.step_metrics import reduce_metrics

log = logging.getLogger(__name__)


class TrainerGroup:
    def __init__(self, recipe: Recipe, actor_layout, pg, threads: int) -> None:
        """One actor per trainer rank in its node's bundle; MASTER_ADDR is rank 0's node."""

        self.actor_layout = actor_layout
        world = recipe.cluster.world_size
        addr, port = free_port_on(pg, actor_layout.master_addr_node)
        sections = PolicySections.of(recipe)  # the sections a rank reads: the hub token stays here
        cls = ray.remote(PolicyWorker)
        self.workers = [cls.options(**trainer_options(actor_layout, pg, rank, threads)).remote(
                            sections, rank=rank, world_size=world, master_addr=addr, master_port=port,
                            local_gpu=next(iter(actor_layout.ranks[rank].gpus), 0))
                        for rank in range(world)]

    def load(self, ckpt_dir: Path, init_checkpoint: Path, ref_checkpoint: Path, hf_layout: HFLayout) -> dict[str, Any]:
        """Resume from `ckpt_dir`'s latest checkpoint, else the initial weights; the KL reference from
        `ref_checkpoint`; weight sync under `hf_layout`'s names. Returns the checkpoint's extra state."""

        extras = ray.get([w.load.remote(str(ckpt_dir), str(init_checkpoint), str(ref_checkpoint), hf_layout.prefix)
                          for w in self.workers])
        extra = extras[0] or {}
        for skipped in extra.pop("skipped_checkpoints", []):  # a newer checkpoint that did not verify
            log.warning("%s", skipped)
        return extra

    def train(self, shares: list, step: int) -> dict[str, float]:
        """`shares[dp]` is the object-store reference of DP rank `dp`'s `RankShare` (the rollout manager put it
        there once); every trainer rank of that DP rank reads it there, the samples are not serialized into 256
        actor calls."""

        return reduce_metrics(ray.get([w.train.remote(shares[self.actor_layout.ranks[i].dp], step)
                                       for i, w in enumerate(self.workers)]), equal_weights=True)

    def sync_weights(self, urls: list[str], version: str) -> dict[str, float]:
        return reduce_metrics(ray.get([w.sync_weights.remote(urls, version) for w in self.workers]),
                              equal_weights=True)

    def release(self) -> None:
        """Every rank drops its weight updater (no collective): the next sync builds it afresh on all of them, as
        after a sync an engine's death cut short."""
        ray.get([w.release.remote() for w in self.workers])

    def sleep(self, parts: tuple[str, ...]) -> dict[str, float]:
        """Colocated: every rank hands these parts of its device state to the engines (`model.offload`)."""

        return reduce_metrics(ray.get([w.sleep.remote(list(parts)) for w in self.workers]), equal_weights=True)

    def wake(self, parts: tuple[str, ...]) -> None:
        ray.get([w.wake.remote(list(parts)) for w in self.workers])

    def save(self, ckpt_dir: Path, step: int, state: dict[str, Any]) -> None:
        ray.get([w.save.remote(str(ckpt_dir), step, state) for w in self.workers])

    def close(self) -> None:
        """Let live trainers remove their shared-memory segments, then kill them (best effort: at teardown)."""

        try:
            ray.get([w.release.remote() for w in self.workers], timeout=10)
        except Exception:  # noqa: BLE001 - dead actors' segments go with the next run's sweep
            pass
        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:  # noqa: BLE001 - the actor may already be gone
                pass
