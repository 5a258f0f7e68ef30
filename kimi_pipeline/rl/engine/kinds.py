"""The rollout engine kinds behind `rollout.engine`, and starting a run's engines on the cluster.

The one place that knows there are two kinds: the loop, the launch plan and the weight updater ask an
`EngineKind` what it can do instead of testing the engine's name. A third engine is one more entry here
(an actor class with start / get_url / stop that serves SGLang's HTTP API) plus its row in
`recipes/models.py`'s `rollout.engine`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    from kimi_pipeline.rl.engine.embedded import EmbeddedEngine

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
    from kimi_pipeline.rl.engine.sglang import SGLangEngine

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


@dataclass
class EngineGroup:
    """A run's engine processes (Ray actors), by engine (a node-spanning engine has one per node), and the URL of
    each engine's node 0."""

    by_engine: list[list]
    urls: list[str]

    @property
    def actors(self) -> list:
        return [a for actors in self.by_engine for a in actors]


def _launch(recipe: Recipe, plan, pgs: dict, model_dir: Path, threads: int, e: int) -> tuple[list, Any]:
    """Engine e's processes, where the launch plan puts it (started, not yet serving): (actors, its node-0 actor)."""
    import ray

    from kimi_pipeline.cluster.placement import free_port_on
    from kimi_pipeline.rl.launch import engine_options

    kind = engine_kind(recipe)
    cls = ray.remote(kind.actor_class())
    engine = plan.engines[e]
    slot = plan.placement.engines[engine.id]
    addr = None
    if len(engine.nodes) > 1:  # a multi-node engine's rendezvous on its node 0
        ip, port = free_port_on(pgs[slot.group], slot.bundles[0])
        addr = f"{ip}:{port}"
    actors, head = [], None
    for n in engine.nodes:
        args, kwargs = kind.actor_args(recipe, model_dir, n.node_rank, n.base_gpu_id, addr)
        actor = cls.options(**engine_options(plan, recipe, pgs, engine.id, n.node_rank, threads)).remote(*args, **kwargs)
        actors.append(actor)
        head = actor if n.node_rank == 0 else head
    return actors, head


def start_engines(recipe: Recipe, plan, pgs: dict, model_dir: Path, threads: int) -> EngineGroup:
    """One actor per engine process, where the launch plan puts it (`rl.launch`); waits until each serves."""
    import ray

    launched = [_launch(recipe, plan, pgs, model_dir, threads, e) for e in range(len(plan.engines))]
    ray.get([a.start.remote() for actors, _ in launched for a in actors])
    return EngineGroup([actors for actors, _ in launched], ray.get([head.get_url.remote() for _, head in launched]))


def restart_engine(group: EngineGroup, e: int, recipe: Recipe, plan, pgs: dict, model_dir: Path,
                   threads: int) -> str:
    """Engine e again, in its placement (its old processes killed first, which frees their bundle share);
    serving the model it started with. Returns its URL."""
    import ray

    for actor in group.by_engine[e]:
        try:
            ray.kill(actor)
        except Exception:  # noqa: BLE001 - the dead process's actor may already be gone
            pass
    actors, head = _launch(recipe, plan, pgs, model_dir, threads, e)
    group.by_engine[e] = actors
    ray.get([a.start.remote() for a in actors])
    group.urls[e] = ray.get(head.get_url.remote())
    return group.urls[e]
