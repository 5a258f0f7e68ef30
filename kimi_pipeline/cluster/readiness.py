"""Does the cluster have what the recipe needs? Facts, shortfalls, and a visible wait with a timeout.

Per-node requirements (GPUs, CPUs, memory) are checked node by node, because 32 nodes × 8 GPUs is not
the same as 256 GPUs somewhere: a trainer bundle must fit on one node. Memory is what Ray can use on a
node: its `memory` plus `object_store_memory` resources (Ray splits the node's RAM between the two).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import ray

from kimi_pipeline.cluster.cluster_errors import ClusterError, ClusterHealthError
from kimi_pipeline.cluster.env import gcs_reachable, is_loopback_address, use_loopback_ray
from kimi_pipeline.recipes.models import ClusterSpec
from kimi_pipeline.util.redact import ray_worker_setup

log = logging.getLogger(__name__)
GB = 1024**3
STANDARD = {"CPU", "GPU", "memory", "object_store_memory"}


@dataclass(frozen=True)
class Requirements:
    nodes: int
    gpus_per_node: float = 0
    cpus_per_node: float = 1
    memory_gb_per_node: float | None = None
    resources_per_node: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, cluster: ClusterSpec) -> Requirements:
        """cuda: the cluster section's GPUs per node; cpu: no GPUs, one CPU per trainer rank (gpus_per_node counts
        ranks) plus one for the embedded engine when it is not colocated."""
        ranks = cluster.gpus_per_node
        default_cpus = ranks + (0 if cluster.colocate else 1) if cluster.device == "cpu" else 1
        cpus = cluster.cpus_per_node if cluster.cpus_per_node is not None else default_cpus
        return cls(
            nodes=cluster.nodes,
            gpus_per_node=ranks if cluster.device == "cuda" else 0,
            cpus_per_node=cpus,
            memory_gb_per_node=cluster.memory_gb_per_node,
        )

    def describe(self) -> str:
        parts = [f"{self.nodes} node(s)"]
        if self.gpus_per_node:
            parts.append(f"{self.gpus_per_node:g} GPU")
        parts.append(f"{self.cpus_per_node:g} CPU")
        if self.memory_gb_per_node:
            parts.append(f"{self.memory_gb_per_node:g} GB")
        parts += [f"{v:g} {k}" for k, v in self.resources_per_node.items()]
        return parts[0] + " × (" + ", ".join(parts[1:]) + " each)"


@dataclass(frozen=True)
class NodeFacts:
    node_id: str
    ip: str
    is_head: bool
    cpus: float
    gpus: float
    memory_gb: float
    resources: dict[str, float]

    @property
    def label(self) -> str:
        return f"{self.ip}/{self.node_id[:8]}"

    def shortfalls(self, req: Requirements) -> list[str]:
        out = []
        if self.gpus < req.gpus_per_node:
            out.append(f"GPU {self.gpus:g} < {req.gpus_per_node:g}")
        if self.cpus < req.cpus_per_node:
            out.append(f"CPU {self.cpus:g} < {req.cpus_per_node:g}")
        if req.memory_gb_per_node and self.memory_gb < req.memory_gb_per_node:
            out.append(f"memory {self.memory_gb:.1f} GB < {req.memory_gb_per_node:g} GB")
        for k, v in req.resources_per_node.items():
            if self.resources.get(k, 0) < v:
                out.append(f"{k} {self.resources.get(k, 0):g} < {v:g}")
        return out


@dataclass(frozen=True)
class ClusterFacts:
    address: str
    ray_version: str
    nodes: list[NodeFacts]

    @property
    def cpus(self) -> float:
        return sum(n.cpus for n in self.nodes)

    @property
    def gpus(self) -> float:
        return sum(n.gpus for n in self.nodes)

    @property
    def memory_gb(self) -> float:
        return sum(n.memory_gb for n in self.nodes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "ray_version": self.ray_version,
            "nodes": len(self.nodes),
            "cpus": self.cpus,
            "gpus": self.gpus,
            "memory_gb": round(self.memory_gb, 1),
            "node_list": [asdict(n) for n in self.nodes],
        }

    def missing(self, req: Requirements) -> list[str]:
        """Every shortfall against `req`, in words; empty when the cluster is good enough."""
        qualified = [n for n in self.nodes if not n.shortfalls(req)]
        if len(qualified) >= req.nodes:
            return []
        out = [f"need {req.describe()}; {len(qualified)} of {len(self.nodes)} alive node(s) qualify"]
        if len(self.nodes) < req.nodes:
            out.append(f"nodes: {len(self.nodes)} alive < {req.nodes} required ({req.nodes - len(self.nodes)} missing)")
        for n in self.nodes:
            short = n.shortfalls(req)
            if short:
                out.append(f"node {n.label}: " + ", ".join(short))
        for name, have, per in (("GPU", self.gpus, req.gpus_per_node), ("CPU", self.cpus, req.cpus_per_node)):
            if per and have < per * req.nodes:
                out.append(f"cluster total {name} {have:g} < {per * req.nodes:g} required")
        return out


def read_facts() -> ClusterFacts:
    """Facts of the cluster this process is connected to (ray.init already done)."""

    nodes = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        r = n.get("Resources", {})
        nodes.append(
            NodeFacts(
                node_id=n["NodeID"],
                ip=n.get("NodeManagerAddress", "?"),
                is_head="node:__internal_head__" in r,
                cpus=float(r.get("CPU", 0)),
                gpus=float(r.get("GPU", 0)),
                memory_gb=(float(r.get("memory", 0)) + float(r.get("object_store_memory", 0))) / GB,
                resources={k: v for k, v in r.items() if k not in STANDARD and not k.startswith("node:")},
            )
        )
    nodes.sort(key=lambda n: (not n.is_head, n.ip, n.node_id))
    return ClusterFacts(address=ray.get_runtime_context().gcs_address, ray_version=ray.__version__, nodes=nodes)


@contextlib.contextmanager
def connected(address: str) -> Iterator[None]:
    """A short-lived driver connection (reuses one that is already open to the same cluster)."""

    if ray.is_initialized():
        current = ray.get_runtime_context().gcs_address
        if current != address:
            log.warning("already connected to Ray at %s; checking that cluster, not %s", current, address)
        yield
        return
    use_loopback_ray(is_loopback_address(address))
    try:
        ray.init(address=address, log_to_driver=False, logging_level="WARNING", configure_logging=False,
                 runtime_env=ray_worker_setup())
    except ConnectionError as e:
        raise ClusterError(f"cannot connect to Ray at {address}: {e}") from e
    except Exception as e:  # AuthenticationError and friends: say what to set
        if type(e).__name__ == "AuthenticationError":
            raise ClusterError(
                f"Ray at {address} rejected our credentials: set RAY_AUTH_MODE=token and the cluster's token "
                f"(RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH) — {e}"
            ) from e
        raise
    try:
        yield
    finally:
        ray.shutdown()


def wait_until_healthy(
    address: str,
    req: Requirements,
    timeout_s: float = 120.0,
    poll_s: float = 1.0,
    progress: Callable[[str], None] | None = None,
) -> ClusterFacts:
    """Poll until the cluster meets `req`; on timeout raise ClusterHealthError listing what is missing."""
    say = progress or log.info
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    while not gcs_reachable(address):
        if time.monotonic() > deadline:
            raise ClusterHealthError(f"Ray GCS at {address} is not reachable after {timeout_s:.0f} s", [f"head {address} unreachable"])
        say(f"waiting for Ray head at {address} ({time.monotonic() - t0:.0f}/{timeout_s:.0f} s)")
        time.sleep(min(poll_s * 5, 5.0))
    last = None
    next_report = 0.0
    with connected(address):
        while True:
            facts = read_facts()
            missing = facts.missing(req)
            if not missing:
                say(f"cluster ready: {len(facts.nodes)} node(s), {facts.cpus:g} CPU, {facts.gpus:g} GPU "
                    f"({time.monotonic() - t0:.1f} s)")
                return facts
            now = time.monotonic()
            if now >= deadline:
                raise ClusterHealthError(
                    f"cluster at {address} does not meet the recipe after {timeout_s:.0f} s:\n  - " + "\n  - ".join(missing),
                    missing,
                )
            if missing != last or now >= next_report:
                say(f"waiting for cluster ({now - t0:.0f}/{timeout_s:.0f} s): " + "; ".join(missing))
                last, next_report = missing, now + 10.0
            time.sleep(poll_s)
