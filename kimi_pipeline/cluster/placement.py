"""Placement groups for the train stage, derived from the recipe.

- trainer: one bundle per node holding that node's ranks (STRICT_SPREAD), so rank r lives on node
  r // ranks_per_node and tensor/expert-parallel groups stay inside a node.
- rollout engines: colocated -> they share the trainer bundles (engine e covers global GPUs
  [e*g, (e+1)*g) of the trainer layout; an engine wider than a node spans several bundles);
  not colocated -> their own group (whole-node bundles, STRICT_SPREAD, for engines of >= one node;
  one bundle per engine, PACK, for smaller engines).
On device=cpu (the embedded engine) "GPUs" are trainer ranks on CPUs and there is one engine per node.

Ray never fails an unplaceable group; it waits forever. `create_placement_groups` waits with a timeout
and reports why the group does not fit (too few nodes for STRICT_SPREAD, a bundle no node can hold).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kimi_pipeline.cluster.cluster_errors import ClusterConfigError, PlacementError
from kimi_pipeline.recipes.models import ClusterSpec
from kimi_pipeline.util.net import free_port

log = logging.getLogger(__name__)

# Colocated actors share a GPU/CPU: Ray only checks that the fractions on a device sum to <= 1.
COLOCATED_TRAINER_FRACTION = 0.4
COLOCATED_ENGINE_FRACTION = 0.2


@dataclass(frozen=True)
class GroupSpec:
    name: str
    bundles: tuple[dict[str, float], ...]
    strategy: str

    def describe(self) -> str:
        shapes: dict[str, int] = {}
        for b in self.bundles:
            key = "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(b.items())) + "}"
            shapes[key] = shapes.get(key, 0) + 1
        return f"{self.name}: " + " + ".join(f"{n} × {k}" for k, n in shapes.items()) + f", {self.strategy}"


@dataclass(frozen=True)
class EngineSlot:
    """Where rollout engine i goes: bundle indices of a group (several when it spans nodes)."""

    group: str
    bundles: tuple[int, ...]
    devices: int


@dataclass(frozen=True)
class Placement:
    groups: tuple[GroupSpec, ...]
    ranks_per_bundle: int
    engines: tuple[EngineSlot, ...]
    colocate: bool
    device: str
    trainer_actor: dict[str, float]  # resources one trainer rank actor asks of its bundle
    engine_actor: dict[str, float]  # resources an engine's head actor asks of its first bundle

    def group(self, name: str) -> GroupSpec:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(name)

    def trainer_bundle(self, rank: int) -> int:
        return rank // self.ranks_per_bundle

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["groups"] = [{"name": g.name, "strategy": g.strategy, "bundles": list(g.bundles)} for g in self.groups]
        return d


def compute_placement(cluster: ClusterSpec, gpus_per_engine: int, rollout_devices: int | None = None) -> Placement:
    """The placement groups for the cluster section with engines of `gpus_per_engine` GPUs
    (`sglang.gpus_per_engine`). `rollout_devices`: GPUs for non-colocated engines (default: the trainer's)."""
    per_node, nodes = cluster.gpus_per_node, cluster.nodes
    cuda = cluster.device == "cuda"
    res = "GPU" if cuda else "CPU"
    trainer_bundle = {"GPU": float(per_node), "CPU": float(per_node)} if cuda else {"CPU": float(per_node)}
    trainer = GroupSpec("trainer", tuple(dict(trainer_bundle) for _ in range(nodes)), "STRICT_SPREAD")
    frac = COLOCATED_TRAINER_FRACTION if cluster.colocate else 1.0
    trainer_actor = {"GPU": frac, "CPU": frac} if cuda else {"CPU": 0.5 if cluster.colocate else 1.0}

    if not cuda:  # embedded engine: one per node, one CPU each
        if cluster.colocate:
            engines = tuple(EngineSlot("trainer", (i,), 1) for i in range(nodes))
            return Placement((trainer,), per_node, engines, True, cluster.device, trainer_actor, {"CPU": 0.5})
        rollout = GroupSpec("rollout", tuple({"CPU": 1.0} for _ in range(nodes)), "STRICT_SPREAD")
        engines = tuple(EngineSlot("rollout", (i,), 1) for i in range(nodes))
        return Placement((trainer, rollout), per_node, engines, False, cluster.device, trainer_actor, {"CPU": 1.0})

    gpe = gpus_per_engine
    if gpe > per_node and gpe % per_node:
        raise ClusterConfigError(
            f"sglang.gpus_per_engine={gpe} spans nodes but is not a multiple of cluster.gpus_per_node={per_node}"
        )
    if gpe < per_node and per_node % gpe:
        raise ClusterConfigError(f"sglang.gpus_per_engine={gpe} does not divide cluster.gpus_per_node={per_node}")
    if cluster.colocate:
        total = cluster.world_size
        if total % gpe:
            raise ClusterConfigError(f"{total} trainer GPUs cannot be split into engines of sglang.gpus_per_engine={gpe}")
        engines = tuple(
            EngineSlot("trainer", tuple(sorted({g // per_node for g in range(e * gpe, (e + 1) * gpe)})), gpe)
            for e in range(total // gpe)
        )
        return Placement(
            (trainer,), per_node, engines, True, cluster.device, trainer_actor,
            {"GPU": COLOCATED_ENGINE_FRACTION, "CPU": COLOCATED_ENGINE_FRACTION},
        )
    total = rollout_devices or cluster.world_size
    if total % gpe:
        raise ClusterConfigError(f"{total} rollout GPUs cannot be split into engines of sglang.gpus_per_engine={gpe}")
    n_engines = total // gpe
    if gpe >= per_node:
        span = gpe // per_node
        bundles = tuple({res: float(per_node), "CPU": float(per_node)} for _ in range(n_engines * span))
        rollout = GroupSpec("rollout", bundles, "STRICT_SPREAD")
        engines = tuple(EngineSlot("rollout", tuple(range(e * span, (e + 1) * span)), gpe) for e in range(n_engines))
    else:
        bundles = tuple({res: float(gpe), "CPU": float(gpe)} for _ in range(n_engines))
        rollout = GroupSpec("rollout", bundles, "PACK")
        engines = tuple(EngineSlot("rollout", (e,), gpe) for e in range(n_engines))
    return Placement((trainer, rollout), per_node, engines, False, cluster.device, trainer_actor, {"GPU": 1.0, "CPU": 1.0})


def diagnose(group: GroupSpec, nodes: list[dict[str, float]]) -> list[str]:
    """Why `group` cannot be placed on nodes with these *available* resources (best effort)."""
    out = []
    if group.strategy == "STRICT_SPREAD" and len(group.bundles) > len(nodes):
        out.append(f"STRICT_SPREAD needs {len(group.bundles)} distinct nodes; the cluster has {len(nodes)}")
    for i, b in enumerate(group.bundles):
        if not any(all(n.get(k, 0) >= v for k, v in b.items()) for n in nodes):
            out.append(f"bundle {i} {b} fits on no node (largest free: " + _largest(nodes, b) + ")")
            break
    totals = {k: sum(n.get(k, 0) for n in nodes) for b in group.bundles for k in b}
    need = {k: sum(b.get(k, 0) for b in group.bundles) for k in totals}
    for k in need:
        if need[k] > totals[k]:
            out.append(f"needs {need[k]:g} {k} in total; {totals[k]:g} free")
    if group.strategy == "STRICT_PACK" and len(group.bundles) > 1:
        out.append("STRICT_PACK needs every bundle on one node")
    return out or ["no single reason found: resources are probably held by other placement groups or actors"]


def _largest(nodes: list[dict[str, float]], bundle: dict[str, float]) -> str:
    return ", ".join(f"{k} {max((n.get(k, 0) for n in nodes), default=0):g}" for k in bundle)


def create_group(group: GroupSpec, timeout_s: float = 60.0) -> Any:
    """Create one placement group and wait for it (ray.init already done).

    If it is not placed within `timeout_s` it is removed and PlacementError says why it does not fit.
    """

    t0 = time.monotonic()
    pg = placement_group([dict(b) for b in group.bundles], strategy=group.strategy, name=f"kimi-{group.name}")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        avail = _available_per_node()
        reasons = diagnose(group, avail)
        raise PlacementError(
            f"placement group {group.describe()} was not placed within {timeout_s:g} s on "
            f"{len(avail)} node(s):\n  - " + "\n  - ".join(reasons)
        )
    log.info("placement group %s ready in %.2f s", group.describe(), time.monotonic() - t0)
    return pg


def create_placement_groups(placement: Placement, timeout_s: float = 60.0) -> dict[str, Any]:
    """Every group of `placement`, name -> PlacementGroup; all or nothing (earlier groups are removed on failure)."""
    made: dict[str, Any] = {}
    try:
        for g in placement.groups:
            made[g.name] = create_group(g, timeout_s)
    except BaseException:
        remove_placement_groups(made)
        raise
    return made


def remove_placement_groups(groups: dict[str, Any]) -> None:
    for pg in groups.values():
        remove_placement_group(pg)


def bundle_nodes(pg) -> list[str]:
    """Node id of each bundle of a ready placement group, in bundle order."""

    table = placement_group_table(pg)["bundles_to_node_id"]
    return [table[i] for i in sorted(table)]


def _available_per_node() -> list[dict[str, float]]:
    """Free resources per alive node (a Ray DeveloperAPI; falls back to node totals)."""

    try:
        from ray._private.state import available_resources_per_node

        return [dict(v) for v in available_resources_per_node().values()]
    except Exception:  # noqa: BLE001 - diagnosis only; totals still explain most failures
        return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def free_port_on(pg, bundle: int) -> tuple[str, int]:
    """(IP, free port) of the node holding `bundle`: rendezvous addresses must be free where they are bound."""

    @ray.remote(num_cpus=0.01)
    def probe() -> tuple[str, int]:
        ip = ray.util.get_node_ip_address()
        return ip, free_port(ip)  # where rank 0's store will listen (`util.rendezvous.tcp_store`)

    if ray.is_initialized() and len(ray.nodes()) > 1:
        return ray.get(probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=bundle)).remote())
    return "127.0.0.1", free_port()
