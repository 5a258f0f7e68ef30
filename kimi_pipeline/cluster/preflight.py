"""`kimi preflight`: check the real cluster before a run holds it, in its first minute, not after a 30-minute hang.

What users of the recipes' framework report most once the recipe is right: a launch that hangs in NCCL or Ray
rendezvous, a node whose environment or shared filesystem differs. One `NodeProbe` actor per node (pinned to it,
no resources reserved) reports that node's facts; the driver compares them and runs the cross-node checks:

- GPUs: count, model, memory, driver and CUDA versions, against the recipe (`cluster.gpus_per_node`) and the GPU
  `kimi plan` counts for this model (its peak per GPU);
- software: python, torch, megatron-core, transformer-engine, sglang (its own interpreter) and this package (its
  version and a digest of its sources): any difference names the nodes;
- `paths.base_dir`: a file written on the first node is read back byte-exact on every other (shared, not
  node-local); free space against what the run writes (checkpoints × `checkpoint.keep_last`, the export); read
  throughput;
- host RAM and /dev/shm against the plan's host figure and the weight-sync segments;
- ports: every node reaches a port opened on every other (the rendezvous);
- a collective over every rank of the layout's world (NCCL on GPU, gloo on CPU): all-reduce of a bucket the size
  of megatron's gradient buckets, bus bandwidth per node, and the nodes whose ranks did not join within the timeout.

Each probe call is bounded in time: a node that does not answer is named, not waited for. `fast` (the cluster
stage runs it after bring-up) skips the collective and reads a small file.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kimi_pipeline.cluster.probe import GIB, NodeProbe
from kimi_pipeline.cluster.readiness import connected
from kimi_pipeline.engine.sglang import sglang_python
from kimi_pipeline.model.params import count_params
from kimi_pipeline.plan.command import make_plan
from kimi_pipeline.plan.hardware import GPUS, get_gpu
from kimi_pipeline.recipes import Recipe
from kimi_pipeline.recipes.models import ClusterSpec
from kimi_pipeline.util.paths import resolve_path

# megatron-core's DDP gradient bucket: 40M fp32 elements (distributed/distributed_data_parallel_config.py,
# bucket_size default max(40_000_000, 1_000_000 * dp)); on CPU a bucket of the tiny model's size
BUCKET_BYTES = {"cuda": 40_000_000 * 4, "cpu": 8 * 1024**2}
SOFTWARE = ("python", "torch", "megatron-core", "transformer-engine", "sglang", "kimi-pipeline")


@dataclass
class Check:
    """One check's verdict; `nodes` are the ones it failed on, `fix` what to do."""

    name: str
    ok: bool
    detail: str
    fix: str = ""
    nodes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- the driver's side


@dataclass
class Node:
    label: str  # ip/node-id prefix, as the cluster facts name nodes
    node_id: str
    ip: str
    probe: Any = None
    facts: dict[str, Any] = field(default_factory=dict)


def plan_gpu(gpu_name: str | None) -> str:
    """`kimi plan`'s GPU for a model name nvidia-smi reports ("NVIDIA H100 80GB HBM3" → h100); h200 when unknown."""
    return next((key for key in GPUS if key in (gpu_name or "").lower()), "h200")


def _needs(recipe: Recipe, gpu_name: str | None = None) -> dict[str, Any]:
    """What the run will need per node, from the model `kimi plan` counts: disk for checkpoints and the export, host
    RAM and GPU peak (the plan on the nodes' GPU), /dev/shm for each trainer rank's weight-sync segment."""
    pc = count_params(recipe.model)
    weight_bytes = 2 if recipe.model.params_dtype == "bfloat16" else 4
    checkpoint = pc.total * (weight_bytes + 12)  # weights + fp32 main params and two Adam moments
    kept = recipe.checkpoint.keep_last or max(1, recipe.rollout.num_rollout // recipe.checkpoint.save_interval)
    export = pc.routed_experts * 0.5625 + (pc.total - pc.routed_experts) * 2  # INT4 + group-32 scales, bf16 rest
    needs = {"disk_gib": (checkpoint * kept + export) / GIB,
             "shm_gib": recipe.cluster.gpus_per_node * recipe.rollout.update_weight_buffer_size / GIB}
    if recipe.cluster.device == "cuda":
        plan = make_plan(recipe, get_gpu(plan_gpu(gpu_name)))
        needs["host_gib"] = plan["host_mem_gb"]["total"]
        needs["gpu_peak_gib"] = plan["gpu_mem_gb"]["peak"]
        needs["plan_fits"] = plan["fits"]
        needs["plan_reason"] = plan["reason"]
    elif recipe.cluster.memory_gb_per_node:
        needs["host_gib"] = recipe.cluster.memory_gb_per_node
    return needs


def _probes() -> list[Node]:
    """One probe per alive node of the cluster this driver is connected to."""
    nodes = [Node(f"{n['NodeManagerAddress']}/{n['NodeID'][:8]}", n["NodeID"], n["NodeManagerAddress"])
             for n in ray.nodes() if n.get("Alive")]
    probe_cls = ray.remote(NodeProbe)
    for n in nodes:
        pinned = NodeAffinitySchedulingStrategy(n.node_id, soft=False)
        n.probe = probe_cls.options(num_cpus=0, scheduling_strategy=pinned, max_concurrency=4).remote()
    return nodes


def _call(nodes: list[Node], method: str, args_of: Callable[[Node], tuple], timeout_s: float
          ) -> tuple[dict[str, Any], list[str]]:
    """`method` on every node's probe at once, bounded by `timeout_s`: (results by node label, nodes that did not
    answer or failed, with why)."""
    refs = {n.label: getattr(n.probe, method).remote(*args_of(n)) for n in nodes}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    done, missing = {}, []
    for label, ref in refs.items():
        if ref not in ready:
            missing.append(f"{label}: no answer within {timeout_s:.0f} s")
            continue
        try:
            done[label] = ray.get(ref)
        except ray.exceptions.RayError as e:
            missing.append(f"{label}: {str(e).strip().splitlines()[0][:200]}")
    return done, missing


def _differences(values: dict[str, str]) -> tuple[str, list[str]]:
    """The value most nodes have, and the nodes that differ from it."""
    common = Counter(values.values()).most_common(1)[0][0]
    return common, sorted(label for label, v in values.items() if v != common)


def gpu_model(nodes: list[Node]) -> str | None:
    """The GPU model the first node that has GPUs reports (the plan is made for it)."""
    return next((g["name"] for n in nodes if n.facts for g in n.facts["gpus"]), None)


def check_nodes(recipe: Recipe, nodes: list[Node], unanswered: list[str], needs: dict[str, Any] | None = None
                ) -> list[Check]:
    """The per-node facts against the recipe, the plan (`needs`, default: made here) and each other."""
    cluster = recipe.cluster
    gpu_name = gpu_model(nodes)
    needs = needs or _needs(recipe, gpu_name)
    checks = [Check("nodes", len(nodes) >= cluster.nodes and not unanswered,
                    f"{len(nodes)} alive node(s), the recipe needs {cluster.nodes}"
                    + (f"; {'; '.join(unanswered)}" if unanswered else ""),
                    "start the missing nodes (infra/ray/worker.sh) or lower cluster.nodes",
                    [u.split(":")[0] for u in unanswered])]
    answered = [n for n in nodes if n.facts]
    if not answered:
        return checks
    for name in SOFTWARE:
        versions = {n.label: n.facts["software"][name] for n in answered}
        common, odd = _differences(versions)
        detail = f"{common} on every node" if not odd else \
            f"{common} on most nodes; " + ", ".join(f"{label}: {versions[label]}" for label in odd)
        checks.append(Check(f"software: {name}", not odd, detail, "install the same versions on every node (same path "
                            "on the shared filesystem: `make install` once, or one container image)", odd))
    if cluster.device == "cuda":
        few = [n.label for n in answered if len(n.facts["gpus"]) < cluster.gpus_per_node]
        checks.append(Check("gpus: count", not few, f"cluster.gpus_per_node={cluster.gpus_per_node}; " + ", ".join(
            f"{n.label}: {len(n.facts['gpus'])}" for n in answered), "fix the node's GPUs / CUDA_VISIBLE_DEVICES or "
            "lower cluster.gpus_per_node", few))
        for key, of in (("gpus: model", lambda f: ",".join(sorted({g["name"] for g in f["gpus"]}))),
                        ("gpus: driver", lambda f: str(f["driver"])), ("gpus: CUDA (torch)", lambda f: str(f["cuda"]))):
            common, odd = _differences({n.label: of(n.facts) for n in answered})
            checks.append(Check(key, not odd, f"{common}" + (f"; differs on {', '.join(odd)}" if odd else ""),
                                "one GPU model, driver and CUDA build on every node", odd))
        small = [n.label for n in answered for g in n.facts["gpus"][:1] if g["memory_gib"] < needs["gpu_peak_gib"]]
        if not needs["plan_fits"]:  # the layout does not fit this GPU on any node
            small = [n.label for n in answered]
        checks.append(Check("gpus: memory", not small, f"kimi plan on {plan_gpu(gpu_name)}: peak "
                            f"{needs['gpu_peak_gib']:.1f} GiB per GPU; {needs['plan_reason']}",
                            f"run `kimi plan RECIPE --gpu {plan_gpu(gpu_name)}` and change the layout", small))
    if "host_gib" in needs:
        short = [n.label for n in answered if n.facts["ram_gib"] < needs["host_gib"]]
        checks.append(Check("host RAM", not short, f"need {needs['host_gib']:.1f} GiB per node; " + ", ".join(
            f"{n.label}: {n.facts['ram_gib']}" for n in answered), "nodes with more RAM, or optimizer_cpu_offload off",
            short))
    low = [n.label for n in answered if n.facts["shm_gib"] < needs["shm_gib"]]
    checks.append(Check("/dev/shm", not low, f"need {needs['shm_gib']:.2f} GiB (a weight-sync segment per trainer "
                        "rank); "
                        + ", ".join(f"{n.label}: {n.facts['shm_gib']}" for n in answered),
                        "give /dev/shm more room (docker --shm-size, a Memory emptyDir in Kubernetes)", low))
    return checks


def storage_blame(writer: str, others: list[str], unseen: list[str]) -> list[str]:
    """The nodes whose base_dir is not the shared one, from the nodes that did not read the writer's bytes: those,
    unless no other node did (of two or more), when it is the writer whose disk is its own (the nodes are listed in
    Ray's order, so a node-local base_dir is sometimes the one that writes)."""
    if len(others) > 1 and sorted(unseen) == sorted(others):
        return [writer]
    return unseen


def check_storage(nodes: list[Node], base_dir: Path, nbytes: int, timeout_s: float, need_gib: float) -> list[Check]:
    """`paths.base_dir` (resolved: `base_dir`) shared (written on the first node, read byte-exact on every other),
    free space, read throughput."""
    path = base_dir / ".kimi-preflight" / uuid.uuid4().hex
    first = nodes[0]
    try:
        digest = ray.get(first.probe.write_file.remote(str(path), nbytes), timeout=timeout_s)
    except (ray.exceptions.RayError, OSError) as e:
        return [Check("base_dir: shared", False, f"{first.label} cannot write {path}: {str(e).splitlines()[0][:200]}",
                      "make paths.base_dir writable on every node", [first.label])]
    try:
        reads, missing = _call(nodes, "read_file", lambda n: (str(path),), timeout_s)
        free, _ = _call(nodes, "disk_free", lambda n: (str(base_dir),), timeout_s)
    finally:  # by the node that wrote it: the driver may not see that filesystem
        ray.get(first.probe.remove_file.remote(str(path)), timeout=timeout_s)
    local = [label for label, r in reads.items() if r.get("sha256") != digest] + [m.split(":")[0] for m in missing]
    local = storage_blame(first.label, [n.label for n in nodes if n.label != first.label], local)
    detail = f"{path.parent} written on {first.label}; " + ", ".join(
        f"{label}: {'same bytes' if r.get('sha256') == digest else r.get('error', 'different bytes')}"
        for label, r in reads.items())
    checks = [Check("base_dir: shared", not local, detail, f"paths.base_dir={base_dir} must be one shared "
                    "filesystem mounted at the same path on every node (not a node-local disk)", sorted(local))]
    full = [label for label, f in free.items() if f.get("free_gib", 0) < need_gib]
    space = ", ".join(f"{label}: {f.get('free_gib', f.get('error'))}" for label, f in free.items())
    checks.append(Check("base_dir: free space", not full, f"need {need_gib:.1f} GiB (checkpoints × "
                        f"checkpoint.keep_last + the export); {space}",
                        "free space on the shared filesystem or set checkpoint.keep_last", full))
    rates = ", ".join(f"{label}: {r['mb_s']} MB/s" for label, r in reads.items() if "mb_s" in r)
    checks.append(Check("base_dir: read throughput", True, f"{nbytes / 1e6:.0f} MB read back: {rates}"))
    return checks


def check_ports(nodes: list[Node], timeout_s: float) -> list[Check]:
    """Every node reaches a port opened on every other node (what a rendezvous needs)."""
    ports, missing = _call(nodes, "listen", lambda n: (), timeout_s)
    peers = {label: (next(n.ip for n in nodes if n.label == label), port) for label, port in ports.items()}
    reached, more = _call(nodes, "reach", lambda n: ({k: v for k, v in peers.items() if k != n.label}, 5.0), timeout_s)
    _call(nodes, "close", lambda n: (), timeout_s)
    bad = [f"{src} -> {dst}: {err}" for src, errs in reached.items() for dst, err in errs.items() if err]
    bad += missing + more
    return [Check("ports between nodes", not bad, "every node reached every other" if not bad else "; ".join(bad[:8]),
                  "open the nodes' ports to each other (security groups / NetworkPolicy; the rendezvous and NCCL use "
                  "ephemeral ports)", sorted({b.split(" ")[0].rstrip(":") for b in bad}))]


# What a rank sees when another rank's failure ends the rendezvous under it: the store's or the rendezvous' timeout,
# or (when the failed rank held the store, or gloo's mesh was half built) its connection cut. Measured in the suite:
# a rank on a node with GLOO_SOCKET_IFNAME=kimi-missing0 failed at once ("Unable to find address"), the ranks of the
# three healthy nodes with "DistNetworkError: Failed to recv, got 0 bytes. Connection was likely closed".
# A refused connection is not among them: that is a node that cannot reach the store, its own fault.
_WAITED = ("still waiting", "timeout", "timed out", "connection was likely closed", "failed to recv",
           "connection reset", "broken pipe")


def _waited(error: str) -> bool:
    """A rank that gave up waiting for the others, or lost them, not one that failed on its own."""
    text = error.lower()
    return any(w in text for w in _WAITED)


def collective_cause(failed: dict[str, list[dict]]) -> list[str]:
    """The nodes whose own ranks failed (their rank results, by node label); the others merely waited for them.
    When every failed rank only waited, all of them are named: nothing tells which one the others waited for."""
    waited = {label for label, rs in failed.items() if rs and all(_waited(r.get("error", "")) for r in rs)}
    cause = sorted({label for label, rs in failed.items() if rs} - waited)
    return cause or sorted(waited)


def check_collective(cluster: ClusterSpec, nodes: list[Node], timeout_s: float, nbytes: int) -> Check:
    """All-reduce over every rank of the cluster section's layout; the nodes whose ranks did not join are named."""
    master = nodes[0]
    port = ray.get(master.probe.free_port.remote())  # on the master's node, for the rendezvous
    world = len(nodes) * cluster.gpus_per_node
    results, missing = _call(
        nodes,
        "collective",
        lambda n: (
            {
                "master_addr": master.ip,
                "master_port": port,
                "node_rank": nodes.index(n),
                "ranks_per_node": cluster.gpus_per_node,
                "world": world,
                "bytes": nbytes,
                "device": cluster.device,
                "timeout_s": timeout_s,
            },
        ),
        timeout_s + 60,
    )
    failed = {label: [r for r in ranks if not r.get("ok")] for label, ranks in results.items()}
    cause = collective_cause(failed) + [m.split(":")[0] for m in missing]
    if cause:
        why = "; ".join([f"{label}: {failed[label][0].get('error')}" for label in cause if failed.get(label)] + missing)
        return Check(
            "collective",
            False,
            f"{world} ranks ({'nccl' if cluster.device == 'cuda' else 'gloo'}); did not join "
            f"within {timeout_s:.0f} s: {', '.join(cause)} ({why})",
            "fix the named node's network for the process group (NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME, "
            "firewall, InfiniBand) or take it out of the cluster",
            cause,
        )
    bw = {label: min(r["bus_gbps"] for r in ranks) for label, ranks in results.items()}
    return Check(
        "collective",
        True,
        f"all-reduce of {nbytes / 1e6:.0f} MB over {world} ranks "
        f"({'nccl' if cluster.device == 'cuda' else 'gloo'}); bus bandwidth per node: "
        + ", ".join(f"{label}: {v:.2f} GB/s" for label, v in bw.items()),
    )


def run_preflight(
    recipe: Recipe,
    address: str | None = None,
    *,
    fast: bool = False,
    timeout_s: float = 120.0,
    join_timeout_s: float = 120.0,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Every check against the cluster at `address` (None: the one this process is connected to); the report.
    `timeout_s` bounds each probe call (the first starts a worker that imports torch on every node at once);
    `join_timeout_s` the collective's rendezvous. `fast`: no collective, a 1 MiB shared-file check (the cluster
    stage's)."""
    with connected(address) if address else contextlib.nullcontext():
        return _preflight(recipe, fast, timeout_s, join_timeout_s, progress)


def _preflight(
    recipe: Recipe, fast: bool, timeout_s: float, join_timeout_s: float, progress: Callable[[str], None]
) -> dict[str, Any]:
    t0 = time.monotonic()
    nodes = _probes()
    try:
        progress(f"preflight: {len(nodes)} node(s), one probe each")
        facts, unanswered = _call(nodes, "facts", lambda n: (sglang_python(recipe.sglang),), timeout_s)
        for n in nodes:
            n.facts = facts.get(n.label, {})
        needs = _needs(recipe, gpu_model(nodes))
        checks = check_nodes(recipe, nodes, unanswered, needs)
        live = [n for n in nodes if n.facts]
        progress("preflight: shared storage and ports")
        base_dir = resolve_path(recipe.paths.base_dir)
        checks += check_storage(live, base_dir, (1 if fast else 64) * 1024**2, timeout_s, needs["disk_gib"])
        checks += check_ports(live, timeout_s)
        if not fast:
            nbytes = BUCKET_BYTES[recipe.cluster.device]
            ranks = len(live) * recipe.cluster.gpus_per_node
            progress(f"preflight: all-reduce of {nbytes / 1e6:.0f} MB over {ranks} ranks")
            checks.append(check_collective(recipe.cluster, live, join_timeout_s, nbytes))
    finally:
        for n in nodes:
            ray.kill(n.probe)
    failed = [c for c in checks if not c.ok]
    return {"recipe": recipe.name, "ok": not failed, "fast": fast, "seconds": round(time.monotonic() - t0, 1),
            "nodes": [{"label": n.label, **n.facts} for n in nodes], "checks": [asdict(c) for c in checks],
            "failed": [f"{c.name}: {c.detail} — fix: {c.fix}" for c in failed]}


def report_markdown(report: dict[str, Any]) -> str:
    """The report as a table a person reads (the CLI's --out, the cluster stage's artifact)."""
    lines = [f"# Preflight of {report['recipe']}: {'passed' if report['ok'] else 'FAILED'}", "",
             f"{len(report['nodes'])} node(s), {report['seconds']} s{' (fast)' if report['fast'] else ''}.", "",
             "| check | ok | detail | fix |", "|---|---|---|---|"]
    for c in report["checks"]:
        verdict, fix = ("yes", "") if c["ok"] else ("**no**", c["fix"])
        lines.append(f"| {c['name']} | {verdict} | {c['detail']} | {fix} |")
    return "\n".join(lines) + "\n"
