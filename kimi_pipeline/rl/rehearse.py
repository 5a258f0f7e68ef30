"""`kimi rehearse`: the train stage's own launch code on a simulated cluster of the recipe's shape.

`cluster.nodes` raylets on this host, each advertising `gpus_per_node` GPUs as Ray resources (no GPUs, no
weights). The actor layout (`rl/actor_layout.py`, the code the real run uses) creates its placement groups there;
stand-in actors with the real actors' exact options (bundle, GPU/CPU share, runtime env) start for every
trainer rank of node 0, every engine process on it and the rollout manager, and report what Ray gave them.
What is checked: the groups place at all (no deadlock: requested ≤ available), one bundle per node, rank 0
(MASTER_ADDR) on bundle 0's node, every TP group inside one node, each colocated engine on the GPUs of the
ranks it shares them with, each stand-in on the node the plan says, and the rollout manager on the driver's
node. Results: `launch-plan.json` and `launch-plan.md`.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import ray

from kimi_pipeline.cluster.cluster_errors import PlacementError
from kimi_pipeline.cluster.env import is_loopback_address, use_loopback_ray
from kimi_pipeline.cluster.lifecycle import export_driver_env
from kimi_pipeline.cluster.local import LocalCluster, NodeSpec
from kimi_pipeline.cluster.placement import bundle_nodes, create_placement_groups, remove_placement_groups
from kimi_pipeline.engine.sglang import parse_with_sglang
from kimi_pipeline.recipes import Problem, Recipe
from kimi_pipeline.rl.actor_layout import (
    engine_options,
    lay_out_actors,
    layout_markdown,
    rollout_manager_options,
    trainer_options,
)
from kimi_pipeline.rl.stand_in import StandIn
from kimi_pipeline.util.files import atomic_write_json, atomic_write_text
from kimi_pipeline.util.redact import ray_worker_setup

log = logging.getLogger(__name__)

NODE_RESOURCE = "node_{}"  # the simulated node index, as cluster/lifecycle.py names it


def simulated_cluster(recipe: Recipe, work_dir: Path, owner_pid: int | None = None):
    """A LocalCluster of the recipe's shape: one raylet per node with its GPUs (and as many CPUs) as resources.
    `owner_pid`: the process whose death stops it (the cluster's watchdog), so a killed rehearsal leaves none of
    its raylets and agents (~100 processes for 32 nodes) behind.

    Raylets start one after another: concurrent `ray start`s race for the same free ports (measured: a raylet
    then misses its 30 s registration deadline)."""

    cluster = recipe.cluster
    gpus = cluster.gpus_per_node if cluster.device == "cuda" else 0
    cpus = max(cluster.gpus_per_node, 1) + 1  # the bundle's CPUs + one for the node's stand-in bookkeeping
    specs = [NodeSpec(num_cpus=cpus, num_gpus=gpus, resources={NODE_RESOURCE.format(i): 1.0},
                      object_store_bytes=80 * 1024 * 1024, log_monitor=False, autoscaler_monitor=False)
             for i in range(cluster.nodes)]
    return LocalCluster.start(work_dir, specs[0], specs[1:], owner_pid=owner_pid)


def _node_index() -> dict[str, int]:
    """Ray node id -> simulated node index."""

    out = {}
    for n in ray.nodes():
        for key in n.get("Resources", {}):
            if key.startswith("node_") and key[5:].isdigit() and n.get("Alive"):
                out[n["NodeID"]] = int(key[5:])
    return out


def run_rehearsal(recipe: Recipe, out_dir: Path, *, address: str | None = None,
                  stand_in_nodes: int = 1, timeout_s: float = 120.0) -> dict[str, Any]:
    """Rehearse `recipe`'s launch; write launch-plan.json/.md under `out_dir`; return the plan as a dict.

    `address`: an existing (simulated) cluster to use; otherwise one is started here and stopped after."""

    t0 = time.monotonic()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    actor_layout = lay_out_actors(recipe)
    extra: dict[str, Any] = {"simulated": True}
    if actor_layout.ok:
        extra["sglang_parser"] = check_engine_commands(actor_layout, recipe)
    if actor_layout.ok:
        cluster = None
        try:
            if address is None:
                work = out_dir / "rehearsal-cluster"
                shutil.rmtree(work, ignore_errors=True)
                cluster = simulated_cluster(recipe, work, owner_pid=os.getpid())
                address = cluster.address
            extra.update(_on_cluster(actor_layout, recipe, address, stand_in_nodes, timeout_s))
        finally:
            if cluster is not None:
                cluster.stop()
    extra["seconds"] = round(time.monotonic() - t0, 1)
    return write_layout(actor_layout, out_dir, extra)


def check_engine_commands(actor_layout, recipe: Recipe) -> str:
    """Parse every engine command the plan holds with SGLang's own parser (when an interpreter at hand imports
    sglang); a command it refuses is a problem naming the engine and node. Returns what was checked, in words."""

    nodes = [(e.id, n) for e in actor_layout.engines for n in e.nodes if n.command]
    if not nodes:
        return "no SGLang commands (embedded engine)"
    unique = list(dict.fromkeys(tuple(n.command) for _, n in nodes))  # engines differ only by --base-gpu-id
    parsed = parse_with_sglang([list(c) for c in unique], recipe.sglang)
    if not parsed.checked:
        return f"not checked: no interpreter at hand imports sglang ({parsed.reason})"
    refused = dict(zip(unique, parsed.errors))
    for engine, n in nodes:
        if err := refused[tuple(n.command)]:
            actor_layout.problems.append(
                Problem(
                    "sglang", f"engine {engine} node {n.node_rank}: sglang {parsed.version} refuses its command: {err}"
                )
            )
    return f"{len(unique)} distinct command(s) parsed by sglang {parsed.version}'s ServerArgs parser"


def write_layout(actor_layout, out_dir: Path, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    d = actor_layout.to_dict() | (extra or {})
    d["ok"] = actor_layout.ok
    return _write_files(out_dir, d, layout_markdown(actor_layout, extra))


def refused_layout(name: str, problems: list[Problem], out_dir: Path) -> dict[str, Any]:
    """The launch-plan files for a recipe that does not even load (each problem names its field)."""
    d = {"recipe": name, "ok": False, "gpus_requested": None, "ranks": [], "engines": [],
         "problems": [{"field": p.field, "message": p.message} for p in problems]}
    return _write_files(out_dir, d, f"# Launch plan: {name}\n\n- ok: **False**\n\n## Problems\n\n"
                        + "".join(f"- `{p.field}`: {p.message}\n" for p in problems))


def _write_files(out_dir: Path, d: dict[str, Any], markdown: str) -> dict[str, Any]:
    """launch-plan.json and launch-plan.md, atomically."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_json(Path(out_dir) / "launch-plan.json", d)
    atomic_write_text(Path(out_dir) / "launch-plan.md", markdown)
    return d


def _on_cluster(actor_layout, recipe: Recipe, address: str, stand_in_nodes: int, timeout_s: float) -> dict[str, Any]:
    """Create the plan's placement groups, start stand-ins, check where everything landed (adds problems)."""

    add = lambda f, m: actor_layout.problems.append(Problem(f, m))  # noqa: E731
    export_driver_env(os.environ.get("RAY_AUTH_MODE", "token"))
    use_loopback_ray(is_loopback_address(address))
    ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING, runtime_env=ray_worker_setup())
    try:
        res = ray.cluster_resources()
        out: dict[str, Any] = {"gpus_available": int(res.get("GPU", 0)), "cpus_available": int(res.get("CPU", 0)),
                               "cluster_nodes": len([n for n in ray.nodes() if n.get("Alive")])}
        if actor_layout.device == "cuda" and actor_layout.gpus_requested > out["gpus_available"]:
            add(
                "cluster.nodes",
                f"the run needs {actor_layout.gpus_requested} GPUs; the cluster has {out['gpus_available']}",
            )
        try:
            pgs = create_placement_groups(actor_layout.placement, timeout_s=timeout_s)
        except PlacementError as e:
            add("cluster", f"placement groups do not fit (Ray would wait forever): {e}")
            return out
        try:
            index = _node_index()
            where = {name: [index.get(n, -1) for n in bundle_nodes(pg)] for name, pg in pgs.items()}
            out["bundle_nodes"] = where
            trainer_nodes = where["trainer"]
            if len(set(trainer_nodes)) != len(trainer_nodes):
                add("cluster.nodes", f"trainer bundles share nodes: {trainer_nodes}")
            out["master_addr_node"] = trainer_nodes[actor_layout.master_addr_node]  # as a simulated node index
            _check_groups(actor_layout, trainer_nodes, add)
            out["observed"] = _stand_ins(actor_layout, recipe, pgs, where, index, stand_in_nodes, add)
        finally:
            remove_placement_groups(pgs)
        return out
    finally:
        ray.shutdown()


def _check_groups(actor_layout, trainer_nodes: list[int], add) -> None:
    """TP groups inside one node; each colocated engine on the nodes/GPUs of the ranks it shares."""
    tp = max((r.tp for r in actor_layout.ranks), default=0) + 1
    groups: dict[int, set[int]] = {}
    for r in actor_layout.ranks:  # TP is megatron's innermost dimension: a TP group is tp consecutive ranks
        groups.setdefault(r.rank // tp, set()).add(trainer_nodes[r.node])
    split = [k for k, nodes in groups.items() if len(nodes) > 1]
    if split:
        add("parallel.tp", f"{len(split)} TP group(s) span nodes (TP needs NVLink): e.g. {split[0]}")
    if not actor_layout.colocate or actor_layout.device != "cuda":
        return
    per = actor_layout.gpus_per_node
    for e in actor_layout.engines:
        first = e.id * e.gpus
        ranks = range(first, first + e.gpus)
        want = sorted({(actor_layout.ranks[r].node, actor_layout.ranks[r].gpus[0]) for r in ranks})
        have = sorted((n.node, g) for n in e.nodes for g in n.gpus)
        if want != have:
            add("sglang.gpus_per_engine", f"engine {e.id} runs on {have[:4]}… but its colocated ranks "
                                          f"{first}–{first + e.gpus - 1} hold {want[:4]}…")
        if any(n.base_gpu_id != n.gpus[0] or n.gpus[-1] >= per for n in e.nodes):
            add("sglang.gpus_per_engine", f"engine {e.id}: base GPU ids {[n.base_gpu_id for n in e.nodes]} "
                                          f"do not match its GPUs")


def _stand_ins(actor_layout, recipe, pgs, where, index: dict[str, int], stand_in_nodes: int, add) -> list[dict]:
    """Start stand-ins for the ranks of the first `stand_in_nodes` bundles, every engine node on them and the
    rollout manager."""

    actor = ray.remote(StandIn)
    started: list[tuple[str, int, list[int], Any]] = []
    for r in actor_layout.ranks:
        if r.node < stand_in_nodes:
            a = actor.options(**trainer_options(actor_layout, pgs["trainer"], r.rank, 1)).remote(
                f"rank {r.rank}"
            )
            started.append((f"rank {r.rank}", where["trainer"][r.node], list(r.gpus), a))
    hosts = {where["trainer"][b] for b in range(min(stand_in_nodes, len(where["trainer"])))}
    for e in actor_layout.engines:  # every engine process on those nodes (colocated or in the rollout group)
        slot = actor_layout.placement.engines[e.id]
        for n in e.nodes:
            if where[slot.group][n.node] in hosts:
                a = actor.options(**engine_options(actor_layout, pgs, e.id, n.node_rank, 1)).remote(
                    f"engine {e.id} node {n.node_rank}"
                )
                started.append((f"engine {e.id} node {n.node_rank}", where[slot.group][n.node], list(n.gpus), a))
    driver_node = index.get(ray.get_runtime_context().get_node_id(), -1)
    started.append(("rollout manager", driver_node, [],
                    actor.options(**rollout_manager_options(actor_layout.device)).remote("rollout manager")))
    reports = ray.get([a.report.remote() for *_, a in started], timeout=300)
    observed = []
    for (name, expected, gpus, a), rep in zip(started, reports):
        node = index.get(rep["node_id"], -1)
        observed.append({"actor": name, "node": node, "expected_node": expected, "drives_gpus": gpus,
                         "ray_gpu_ids": rep["gpu_ids"], "env": rep["env"]})
        if node != expected:
            add("cluster", f"{name} landed on node {node}, the plan says node {expected}")
        ray.kill(a)
    return observed
