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
from kimi_pipeline.util.net import NODE_ADDRESS


@dataclass(frozen=True)
class EngineKind:
    name: str
    actor_class: Callable[[], type]  # imported lazily: SGLang's actor module must not load on CPU-only drivers
    # constructor arguments of one engine process: (recipe, model_dir, node_rank, base_gpu_id, multi-node address)
    actor_args: Callable[[Recipe, Path, int, int, str | None], tuple[tuple, dict[str, Any]]]
    one_process_per_node: bool  # a node-spanning engine runs one process per node (a command line each)
    owned_bucket_updates: bool  # each trainer rank can hand it its own buckets through this host's shared memory
    colocated_updates_by_cuda_ipc: bool  # colocated, it takes CUDA-IPC handles of the trainer's GPU buckets


def _embedded_class() -> type:
    return EmbeddedEngine


def engine_host(recipe: Recipe) -> str:
    """Where an engine binds: the recipe's host (loopback by default) on one node; the node's own address when the
    layout spans nodes, so trainers and the router on other nodes reach it (with the cluster's key,
    `cluster.env.engine_api_key`)."""
    return recipe.sglang.host if recipe.cluster.nodes == 1 else NODE_ADDRESS


def _embedded_args(recipe: Recipe, model_dir: Path, node_rank: int, base_gpu_id: int, addr: str | None):
    return (str(model_dir), recipe.rollout.seed), {"host": engine_host(recipe), "device": recipe.cluster.device,
                                                    "base_gpu_id": base_gpu_id}


def _sglang_class() -> type:
    return SGLangEngine


def _sglang_args(recipe: Recipe, model_dir: Path, node_rank: int, base_gpu_id: int, addr: str | None):
    return (str(model_dir), recipe.sglang), {
        "gpus_per_node": recipe.cluster.gpus_per_node, "node_rank": node_rank, "dist_init_addr": addr,
        "base_gpu_id": base_gpu_id, "routing_replay": recipe.rollout.routing_replay, "seed": recipe.rollout.seed,
        "trust_remote_code": recipe.hub.trust_remote_code, "memory_saver": recipe.cluster.colocate,
        "host": engine_host(recipe)}


ENGINE_KINDS: dict[str, EngineKind] = {
    "embedded": EngineKind("embedded", _embedded_class, _embedded_args, one_process_per_node=False,
                           owned_bucket_updates=True, colocated_updates_by_cuda_ipc=False),
    # SGLang colocated takes CUDA-IPC handles (update_weights_from_tensor, rl/weight_sync.py CudaIpcBuckets); not
    # colocated it joins a weight-update group like the embedded engine.
    "sglang": EngineKind("sglang", _sglang_class, _sglang_args, one_process_per_node=True,
                         owned_bucket_updates=False, colocated_updates_by_cuda_ipc=True),
}


def engine_kind(recipe: Recipe) -> EngineKind:
    return ENGINE_KINDS[recipe.rollout.engine]
