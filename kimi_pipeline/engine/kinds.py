"""The rollout engine kinds behind `rollout.engine` (the run starts them: `rl.engine_group`).

The one place that knows there are two kinds: the loop, the actor layout and the weight updater ask an
`EngineKind` what it can do instead of testing the engine's name. A third engine is one more entry here
(an actor class with start / get_url / stop that serves SGLang's HTTP API) plus its row in
`recipes/models.py`'s `rollout.engine`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kimi_pipeline.engine.embedded import EmbeddedEngine
from kimi_pipeline.engine.sglang import SGLangEngine
from kimi_pipeline.recipes import Recipe
from kimi_pipeline.recipes.models import SGLangSpec
from kimi_pipeline.util.net import NODE_ADDRESS


@dataclass(frozen=True)
class EngineSections:
    """What every engine process of a run starts with: resolved once on the driver from the rollout, sglang,
    cluster and hub sections (`EngineSections.of`), so the engine side never reads the recipe."""

    kind: str  # rollout.engine: the `ENGINE_KINDS` entry
    sglang: SGLangSpec  # SGLang's own server settings (its launch command)
    seed: int  # rollout.seed
    routing_replay: bool  # rollout.returns_routed_experts: engines return the routed expert ids
    device: str  # cluster.device
    gpus_per_node: int  # cluster.gpus_per_node
    colocate: bool  # cluster.colocate: the engines share the trainers' GPUs (SGLang's memory saver)
    trust_remote_code: bool  # hub.trust_remote_code
    host: str  # where an engine binds

    @classmethod
    def of(cls, recipe: Recipe) -> EngineSections:
        """`host`: the recipe's host (loopback by default) on one node; the node's own address when the layout spans
        nodes, so trainers and the router on other nodes reach it. Either way with the run's key (`engine.key`)."""
        rollout, cluster = recipe.rollout, recipe.cluster
        return cls(kind=rollout.engine, sglang=recipe.sglang, seed=rollout.seed,
                   routing_replay=rollout.returns_routed_experts,
                   device=cluster.device, gpus_per_node=cluster.gpus_per_node, colocate=cluster.colocate,
                   trust_remote_code=recipe.hub.trust_remote_code,
                   host=recipe.sglang.host if cluster.nodes == 1 else NODE_ADDRESS)


@dataclass(frozen=True)
class EngineKind:
    name: str
    actor_class: Callable[[], type]  # imported lazily: SGLang's actor module must not load on CPU-only drivers
    # constructor arguments of one engine process: (settings, model_dir, node_rank, base_gpu_id, multi-node address)
    actor_args: Callable[[EngineSections, Path, int, int, str | None], tuple[tuple, dict[str, Any]]]
    one_process_per_node: bool  # a node-spanning engine runs one process per node (a command line each)


def _embedded_class() -> type:
    return EmbeddedEngine


def _embedded_args(settings: EngineSections, model_dir: Path, node_rank: int, base_gpu_id: int, addr: str | None):
    return (str(model_dir), settings.seed), {"host": settings.host, "device": settings.device,
                                             "base_gpu_id": base_gpu_id}


def _sglang_class() -> type:
    return SGLangEngine


def _sglang_args(settings: EngineSections, model_dir: Path, node_rank: int, base_gpu_id: int, addr: str | None):
    return (str(model_dir), settings.sglang), {
        "gpus_per_node": settings.gpus_per_node, "node_rank": node_rank, "dist_init_addr": addr,
        "base_gpu_id": base_gpu_id, "routing_replay": settings.routing_replay, "seed": settings.seed,
        "trust_remote_code": settings.trust_remote_code, "memory_saver": settings.colocate, "host": settings.host}


ENGINE_KINDS: dict[str, EngineKind] = {
    # how each kind takes trained weights: `weight_sync.updaters.COLOCATED_HANDOFFS`
    "embedded": EngineKind("embedded", _embedded_class, _embedded_args, one_process_per_node=False),
    "sglang": EngineKind("sglang", _sglang_class, _sglang_args, one_process_per_node=True),
}


def engine_kind(engine: str) -> EngineKind:
    """The kind behind `rollout.engine`."""
    return ENGINE_KINDS[engine]
