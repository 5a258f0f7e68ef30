"""How the train stage lays its actors onto the cluster: one layout, used by the real run and by `kimi rehearse`.

slime-style colocation, on the placement of `cluster/placement.py`: one placement group with a bundle per node
(STRICT_SPREAD). Trainer rank r lives in bundle r // gpus_per_node and drives local GPU r % gpus_per_node, so
a TP group (consecutive ranks) never leaves its node; the rollout engine e of a colocated run covers the same
global GPUs [e·g, (e+1)·g) as the trainer ranks it shares them with (one SGLang node process per node it
spans, `--nnodes/--node-rank/--dist-init-addr`, `--base-gpu-id` = its first local GPU). Colocated actors ask
Ray for GPU *fractions* of their bundle (a GPU is time-shared between training and rollout) and choose their
device themselves (`RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`), so 256 trainer ranks plus the engines
request exactly the 256 GPUs of 32 × 8 nodes. Rank 0 — the `MASTER_ADDR` of the trainer process group —
is in bundle 0, and so is engine 0's node 0.

`lay_out_actors` is pure (no Ray): every problem it finds names the recipe field to change.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from kimi_pipeline.cluster.cluster_errors import ClusterConfigError
from kimi_pipeline.cluster.placement import Placement, compute_placement
from kimi_pipeline.engine.key import key_env
from kimi_pipeline.engine.kinds import EngineSections, engine_kind
from kimi_pipeline.engine.sglang import sglang_command
from kimi_pipeline.model.device import NOSET_VISIBLE_DEVICES
from kimi_pipeline.model.megatron_compat import CPU_ENV
from kimi_pipeline.recipes import Problem, Recipe
from kimi_pipeline.recipes.layout import Layout, LayoutError

# The seeds' launcher environment for GPU jobs (seed 001): a long NCCL timeout for 1 T-parameter weight syncs
# and checkpoint barriers, and one CUDA work queue so megatron's TP/SP communication overlaps in order.
SEED_CUDA_ENV = {"NCCL_TIMEOUT": "3600", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
MODEL_PLACEHOLDER = "<run_dir>/download/model"


@dataclass(frozen=True)
class RankPlacement:
    rank: int
    node: int  # bundle index of the trainer placement group = simulated/real node order
    gpus: tuple[int, ...]  # local GPU ids this rank drives (empty on CPU)
    tp: int
    pp: int
    cp: int
    ep: int
    dp: int


@dataclass(frozen=True)
class EngineNode:
    node: int
    node_rank: int
    gpus: tuple[int, ...]
    base_gpu_id: int
    command: tuple[str, ...]  # SGLang launch command (empty for the embedded CPU engine)


@dataclass(frozen=True)
class EnginePlacement:
    id: int
    nodes: tuple[EngineNode, ...]

    @property
    def gpus(self) -> int:
        return sum(len(n.gpus) for n in self.nodes)


@dataclass
class ActorLayout:
    recipe: str
    device: str
    nodes: int
    gpus_per_node: int
    colocate: bool
    placement: Placement | None
    ranks: list[RankPlacement] = field(default_factory=list)
    engines: list[EnginePlacement] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)

    @property
    def master_addr_node(self) -> int:
        """Bundle of rank 0: MASTER_ADDR of the trainer process group."""
        return self.ranks[0].node if self.ranks else 0

    @property
    def gpus_requested(self) -> int:
        """Whole GPUs the run occupies: the trainer's, plus the engines' own when not colocated."""
        if self.device != "cuda":
            return 0
        trainer = len(self.ranks)
        return trainer if self.colocate else trainer + sum(e.gpus for e in self.engines)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe, "ok": self.ok, "device": self.device, "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node, "colocate": self.colocate, "gpus_requested": self.gpus_requested,
            "master_addr_node": self.master_addr_node, "env": dict(self.env),
            "ranks": [asdict(r) for r in self.ranks],
            "engines": [{"id": e.id, "nodes": [n.node for n in e.nodes], "gpus": e.gpus,
                         "node_processes": [asdict(n) for n in e.nodes],
                         "command": list(e.nodes[0].command) if e.nodes else []} for e in self.engines],
            "placement": self.placement.to_dict() if self.placement else None,
            "problems": [{"field": p.field, "message": p.message} for p in self.problems],
        }


# --------------------------------------------------------------------------- the layout


def worker_env(device: str, threads: int = 1, *, choose_own_gpu: bool = False, trainer: bool = True) -> dict[str, str]:
    """Environment of every trainer/engine actor on `device` (`cluster.device`): this interpreter's packages (the
    actor runs this package's code), `threads` intra-op threads, torch.compile off on CPU only (megatron compiles
    its small fused ops, `core/jit.py`: ~22 s per CPU process for less than it saves there; on a GPU those are the
    fusions megatron relies on, `core/fusions/`, so GPU actors keep them); on CUDA the seeds' NCCL/CUDA
    settings — megatron's CUDA_DEVICE_MAX_CONNECTIONS for trainer ranks only (`trainer=False`: an engine actor) —
    and (colocated) no Ray-set CUDA_VISIBLE_DEVICES; the path of the run's engine key file (`engine.key.key_env`).
    An SGLang server an engine actor starts gets none of the trainer's variables: `engine.sglang.sglang_env` strips
    them (PYTHONPATH included)."""
    env = {"OMP_NUM_THREADS": str(max(1, threads)), "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), **key_env()}
    if device == "cuda":
        env.update(SEED_CUDA_ENV if trainer else {k: v for k, v in SEED_CUDA_ENV.items()
                                                   if k != "CUDA_DEVICE_MAX_CONNECTIONS"})
        if choose_own_gpu:
            env[NOSET_VISIBLE_DEVICES] = "1"
    else:
        env.update(CPU_ENV)
    return env


def rank_coordinates(layout) -> list[dict[str, int]]:
    """(tp, pp, cp, ep, dp) index of every rank of a `Layout`, from megatron's own rank generator."""

    with warnings.catch_warnings():  # megatron warns about missing Transformer Engine / apex on import
        warnings.simplefilter("ignore")
        from megatron.core.parallel_state import RankGenerator

    order = "tp-cp-ep-dp-pp"
    dense = RankGenerator(tp=layout.tp, ep=1, dp=layout.dp, pp=layout.pp, cp=layout.cp, order=order)
    expert = RankGenerator(tp=layout.etp, ep=layout.ep, dp=layout.edp, pp=layout.pp, cp=1, order=order)
    coords: list[dict[str, int]] = [{} for _ in range(layout.world_size)]
    for gen, tokens in ((dense, ("tp", "pp", "cp", "dp")), (expert, ("ep",))):
        for token in tokens:
            for group in gen.get_ranks(token):
                for i, r in enumerate(group):
                    coords[r][token] = i
    return coords


def lay_out_actors(recipe: Recipe, model_path: str = MODEL_PLACEHOLDER) -> ActorLayout:
    """Where every trainer rank and engine process goes, with the exact commands and environment."""

    cluster = recipe.cluster
    cuda = cluster.device == "cuda"
    actor_layout = ActorLayout(
        recipe.name,
        cluster.device,
        cluster.nodes,
        cluster.gpus_per_node,
        cluster.colocate,
        None,
        env=worker_env(cluster.device, choose_own_gpu=cluster.colocate),
    )
    add = lambda f, m: actor_layout.problems.append(Problem(f, m))  # noqa: E731
    parallel = recipe.parallel
    try:
        layout = Layout.from_parallel(parallel, cluster.world_size)
        layout.check_model(recipe.model)
    except LayoutError as e:
        add("parallel", f"{e} (cluster.nodes × cluster.gpus_per_node = {cluster.world_size} ranks)")
        layout = None
    if cuda and (parallel.tp > cluster.gpus_per_node or cluster.gpus_per_node % parallel.tp):
        add(
            "parallel.tp",
            f"tp={parallel.tp} must divide cluster.gpus_per_node={cluster.gpus_per_node}: a TP group must stay "
            "inside one node (NVLink)",
        )
    if parallel.dp is not None and layout is not None and parallel.dp != layout.dp:
        add("parallel.dp", f"dp={parallel.dp} but {cluster.world_size} ranks / (tp·pp·cp) = {layout.dp}")
    try:
        actor_layout.placement = compute_placement(cluster, recipe.sglang.gpus_per_engine)
    except ClusterConfigError as e:
        add("sglang.gpus_per_engine", str(e))
    if layout is not None:
        coords = rank_coordinates(layout)
        for r in range(cluster.world_size):
            gpus = (r % cluster.gpus_per_node,) if cuda else ()
            actor_layout.ranks.append(RankPlacement(r, r // cluster.gpus_per_node, gpus, **coords[r]))
    if actor_layout.placement is not None:
        actor_layout.engines = _engines(EngineSections.of(recipe), actor_layout.placement, model_path, add)
    return actor_layout


def _engines(settings: EngineSections, placement: Placement, model_path: str, add) -> list[EnginePlacement]:
    out = []
    for e, slot in enumerate(placement.engines):
        g, per = slot.devices, settings.gpus_per_node
        # GPUs on each node: a whole node for a node-spanning engine, else g from the first GPU it shares
        base = (e * g) % per if placement.colocate else 0
        local = tuple(range(per)) if g >= per else tuple(range(base, base + g))
        if not engine_kind(settings.kind).one_process_per_node:  # the embedded engine: one process, no command line
            gpus = local[:1] if settings.device == "cuda" else ()  # it computes on the first GPU of its share
            out.append(EnginePlacement(e, (EngineNode(slot.bundles[0], 0, gpus, next(iter(gpus), 0), ()),)))
            continue
        addr = f"<node {slot.bundles[0]} ip>:<port>" if len(slot.bundles) > 1 else None
        nodes = []
        for j, bundle in enumerate(slot.bundles):
            try:
                cmd = sglang_command(model_path, settings.sglang, port=0, gpus_per_node=per, node_rank=j,
                                     dist_init_addr=addr, base_gpu_id=local[0], routing_replay=settings.routing_replay,
                                     seed=settings.seed, trust_remote_code=settings.trust_remote_code,
                                     memory_saver=placement.colocate, python="python", host=settings.host)
            except Exception as exc:  # noqa: BLE001 - a recipe SGLang cannot run: report it, with its field
                add("sglang", str(exc))
                cmd = []
            nodes.append(EngineNode(bundle, j, local, local[0], tuple(cmd)))
        out.append(EnginePlacement(e, tuple(nodes)))
    return out


# --------------------------------------------------------------------------- Ray actor options


def trainer_options(actor_layout: ActorLayout, pg, rank: int, threads: int) -> dict[str, Any]:
    """`ray.remote(...).options(**these)` for trainer rank `rank`: its node's bundle, a GPU share, its env."""

    assert actor_layout.placement is not None
    want = actor_layout.placement.trainer_actor
    return {
        "num_cpus": want.get("CPU", 0.0),
        "num_gpus": want.get("GPU", 0.0),
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=actor_layout.ranks[rank].node
        ),
        "runtime_env": {"env_vars": worker_env(actor_layout.device, threads, choose_own_gpu=actor_layout.colocate)},
    }


def engine_options(
    actor_layout: ActorLayout, pgs: dict[str, Any], engine: int, node_rank: int, threads: int
) -> dict[str, Any]:
    """Options for engine `engine`'s process on its `node_rank`-th node (colocated: a share of the trainer
    bundle; otherwise the whole GPUs of its own rollout bundle, which Ray makes visible)."""

    assert actor_layout.placement is not None
    slot = actor_layout.placement.engines[engine]
    bundle = slot.bundles[node_rank]
    if actor_layout.colocate or actor_layout.device != "cuda":
        res = dict(actor_layout.placement.engine_actor)
    else:
        res = {"GPU": float(len(actor_layout.engines[engine].nodes[node_rank].gpus)), "CPU": 1.0}
    return {
        "num_cpus": res.get("CPU", 0.0),
        "num_gpus": res.get("GPU", 0.0),
        "scheduling_strategy": PlacementGroupSchedulingStrategy(pgs[slot.group], placement_group_bundle_index=bundle),
        "runtime_env": {"env_vars": worker_env(actor_layout.device, threads, choose_own_gpu=actor_layout.colocate,
                                               trainer=False)},
    }


def rollout_manager_options(device: str) -> dict[str, Any]:
    """Options for the `RolloutManager` actor: the driver's node (where the train task runs the loop), no CPU
    or GPU reserved (the layout's bundles are the trainers' and engines'), one intra-op thread."""

    return {
        "num_cpus": 0, "num_gpus": 0,
        "scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
        "runtime_env": {"env_vars": worker_env(device, 1)},
    }


def check_layout(actor_layout: ActorLayout) -> None:
    """Refuse to start actors for a layout with problems (each names its recipe field)."""
    if actor_layout.problems:
        raise ClusterConfigError(
            "the recipe cannot launch on its cluster layout:\n  - "
            + "\n  - ".join(map(str, actor_layout.problems))
            + "\n(`kimi rehearse` shows the layout)"
        )


def layout_markdown(actor_layout: ActorLayout, extra: dict[str, Any] | None = None) -> str:
    """The actor layout for a person (the `launch-plan` Prefect artifact and launch-plan.md)."""
    d = actor_layout.to_dict() | (extra or {})
    lines = [
        f"# Launch plan: {actor_layout.recipe}",
        "",
        f"- ok: **{d['ok']}**; {actor_layout.nodes} node(s) × {actor_layout.gpus_per_node} {'GPU' if actor_layout.device == 'cuda' else 'rank'}"
        f"(s), colocate={actor_layout.colocate}",
        f"- GPUs requested: {d['gpus_requested']}"
        + (f" of {d['gpus_available']} available" if "gpus_available" in d else ""),
        f"- MASTER_ADDR: node {actor_layout.master_addr_node} (rank 0)",
        *([f"- SGLang commands: {d['sglang_parser']}"] if d.get("sglang_parser") else []),
        "- env: " + ", ".join(f"`{k}={v}`" for k, v in sorted(actor_layout.env.items()) if k != "PYTHONPATH"),
    ]
    if actor_layout.problems:
        lines += ["", "## Problems", ""] + [f"- `{p.field}`: {p.message}" for p in actor_layout.problems]
    if d.get("observed"):
        lines += ["", "## Stand-in actors (what Ray gave them)", "",
                  "Colocated actors hold a GPU *share* for Ray's accounting (Ray's id) and drive the GPU the plan gives "
                  "them (CUDA_VISIBLE_DEVICES is not set by Ray).", "",
                  "| actor | node (plan) | drives GPUs | Ray's GPU id |", "|---|---|---|---|"]
        lines += [f"| {o['actor']} | {o['node']} ({o['expected_node']}) | {o['drives_gpus']} | {o['ray_gpu_ids']} |"
                  for o in d["observed"]]
    lines += ["", "## Engines", "", "| engine | nodes | GPUs | command (node 0) |", "|---|---|---|---|"]
    for e in d["engines"]:
        lines.append(f"| {e['id']} | {e['nodes']} | {e['gpus']} | `{' '.join(e['command'])}` |")
    nodes: dict[int, list[RankPlacement]] = {}
    for r in actor_layout.ranks:
        nodes.setdefault(r.node, []).append(r)
    lines += ["", "## Trainer ranks by node", "", "| node | ranks | tp | pp | cp | ep | dp |", "|---|---|---|---|---|---|---|"]
    for n, rs in sorted(nodes.items()):
        span = lambda k: sorted({getattr(r, k) for r in rs})  # noqa: E731
        fmt = lambda v: f"{v[0]}–{v[-1]}" if len(v) > 1 else str(v[0])  # noqa: E731
        lines.append(f"| {n} | {rs[0].rank}–{rs[-1].rank} | {fmt(span('tp'))} | {fmt(span('pp'))} | "
                     f"{fmt(span('cp'))} | {fmt(span('ep'))} | {fmt(span('dp'))} |")
    return "\n".join(lines) + "\n"
