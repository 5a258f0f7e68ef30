"""The run's engine processes as Ray actors, started where the actor layout puts them (`rl.actor_layout`) and
restarted in place after a crash; the engine itself (`kimi_pipeline.engine`) knows nothing of Ray placement."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from kimi_pipeline.cluster.placement import free_port_on
from kimi_pipeline.engine.kinds import EngineSections, engine_kind
from kimi_pipeline.rl.actor_layout import ActorLayout, engine_options


@dataclass
class EngineGroup:
    """A run's engine processes (Ray actors), by engine (a node-spanning engine has one per node), and the URL of
    each engine's node 0."""

    by_engine: list[list]
    urls: list[str]

    @property
    def actors(self) -> list:
        return [a for actors in self.by_engine for a in actors]


def _start_engine(
    settings: EngineSections, actor_layout: ActorLayout, pgs: dict, model_dir: Path, threads: int, e: int
) -> tuple[list, Any]:
    """Engine e's processes, where the actor layout puts it (started, not yet serving): (actors, its node-0 actor)."""
    kind = engine_kind(settings.kind)
    cls = ray.remote(kind.actor_class())
    engine = actor_layout.engines[e]
    slot = actor_layout.placement.engines[engine.id]
    addr = None
    if len(engine.nodes) > 1:  # a multi-node engine's rendezvous on its node 0
        ip, port = free_port_on(pgs[slot.group], slot.bundles[0])
        addr = f"{ip}:{port}"
    actors, head = [], None
    for n in engine.nodes:
        args, kwargs = kind.actor_args(settings, model_dir, n.node_rank, n.base_gpu_id, addr)
        actor = cls.options(**engine_options(actor_layout, pgs, engine.id, n.node_rank, threads)).remote(
            *args, **kwargs
        )
        actors.append(actor)
        head = actor if n.node_rank == 0 else head
    return actors, head


def start_engines(
    settings: EngineSections, actor_layout: ActorLayout, pgs: dict, model_dir: Path, threads: int
) -> EngineGroup:
    """One actor per engine process, where the actor layout puts it (`rl.actor_layout`); waits until each serves."""
    started = [
        _start_engine(settings, actor_layout, pgs, model_dir, threads, e) for e in range(len(actor_layout.engines))
    ]
    ray.get([a.start.remote() for actors, _ in started for a in actors])
    return EngineGroup([actors for actors, _ in started], ray.get([head.get_url.remote() for _, head in started]))


def restart_engine(
    group: EngineGroup, e: int, settings: EngineSections, actor_layout: ActorLayout, pgs: dict, model_dir: Path,
    threads: int,
) -> str:
    """Engine e again, in its placement (its old processes killed first, which frees their bundle share);
    serving the model it started with. Returns its URL. Killing an actor does not wait for its server's GPU
    memory: an SGLang engine's `start` waits, bounded and naming the engine, until its GPUs have the free memory
    SGLang's start-up sizing needs (`engine.sglang.wait_for_gpu_memory`)."""
    for actor in group.by_engine[e]:
        try:
            ray.kill(actor)
        except Exception:  # noqa: BLE001 - the dead process's actor may already be gone
            pass
    actors, head = _start_engine(settings, actor_layout, pgs, model_dir, threads, e)
    group.by_engine[e] = actors
    ray.get([a.start.remote() for a in actors])
    group.urls[e] = ray.get(head.get_url.remote())
    return group.urls[e]
