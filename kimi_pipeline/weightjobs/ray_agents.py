"""Launch a weight job with one torchrun agent per node of an existing Ray cluster.

The seeds convert on 4 nodes; on a Ray cluster the stage does it itself: a STRICT_SPREAD placement group of one
bundle per node, one `ray_node.NodeAgent` actor per bundle, each starting the node's torchrun agent (the same
command `commands.NodeCommand.scale_out` prints for clusters without Ray), rendezvousing on node 0's address and a
port node 0 picked. The driver streams every agent's log (`ray_node.watch_agents`) and returns every agent's exit;
`outcome` names the failing rank and its node from the ranks' error reports on the shared filesystem, exactly as for
the local launcher. The actors and the group are removed in every case.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kimi_pipeline.cluster.env import auth_mode, require_auth
from kimi_pipeline.cluster.lifecycle import attach_driver
from kimi_pipeline.cluster.placement import GroupSpec, create_group, remove_placement_groups
from kimi_pipeline.cluster.readiness import connected
from kimi_pipeline.weightjobs.commands import WORKER_ENV, NodeCommand
from kimi_pipeline.weightjobs.outcome import JobResult
from kimi_pipeline.weightjobs.ray_node import NodeAgent, watch_agents

log = logging.getLogger(__name__)


class TooFewNodes(RuntimeError):
    """The Ray cluster has fewer live nodes than the job has nodes (the caller may run it on one host)."""


def launch_ray(command: NodeCommand, *, work_dir: str | Path, report_dir: str | Path, address: str,
               name: str = "job", gpus_per_node: int = 0, env: dict[str, str] | None = None,
               timeout: float | None = None, grace: float = 15.0, placement_timeout_s: float = 120.0,
               allow_insecure: bool = False) -> JobResult:
    """Run `command` with one torchrun agent per Ray node; returns every agent's exit (`JobResult.ok`).

    Raises TooFewNodes when the cluster has fewer live nodes than the job, PlacementError when it lacks the
    resources; ClusterConfigError for a cluster of several nodes without token auth unless `allow_insecure`
    (`cluster.allow_insecure`, `env.require_auth`), before connecting.
    """
    nodes = command.nnodes
    address = attach_driver(address)
    require_auth(auth_mode(), nodes, allow_insecure)

    work_dir, report_dir = Path(work_dir), Path(report_dir)
    log_dir = work_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    report_dir.mkdir(parents=True, exist_ok=True)
    for stale in report_dir.glob("rank_*.error.json"):
        stale.unlink()
    bundle = {"CPU": 1.0, **({"GPU": float(gpus_per_node)} if gpus_per_node else {})}
    with connected(address):
        alive = sum(1 for n in ray.nodes() if n.get("Alive"))
        if alive < nodes:
            raise TooFewNodes(f"{name}: {nodes} nodes needed, the Ray cluster at {address} has {alive}")
        pg = create_group(GroupSpec(f"{name}-agents", tuple(dict(bundle) for _ in range(nodes)), "STRICT_SPREAD"),
                          placement_timeout_s)
        actor_cls = ray.remote(NodeAgent)
        agents = [actor_cls.options(num_cpus=1, num_gpus=gpus_per_node or 0, name=None, max_restarts=0,
                                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i))
                  .remote(i) for i in range(nodes)]
        try:
            where = ray.get([a.address.remote() for a in agents], timeout=placement_timeout_s)
            hosts, node_ids = [w[0] for w in where], [w[1] for w in where]
            master, port = hosts[0], ray.get(agents[0].free_port.remote())
            full_env = {**WORKER_ENV, "KIMI_LAUNCH_TIME": repr(time.time()), **(env or {})}
            commands = [command.for_node(i, master, port) for i in range(nodes)]
            log.info("%s: %d torchrun agents on Ray nodes %s, rendezvous %s:%d", name, nodes, hosts, master, port)
            ray.get([a.start.remote(c, full_env) for a, c in zip(agents, commands)])
            codes, seconds, timed_out = watch_agents(agents, name, log_dir, timeout, grace)
        finally:
            try:
                ray.get([a.stop.remote() for a in agents], timeout=30)
            except Exception:  # noqa: BLE001 - the actors go next anyway, taking their agents with them
                pass
            for a in agents:
                ray.kill(a)
            remove_placement_groups({"agents": pg})
    logs = [log_dir / f"{name}.node{i}.log" for i in range(nodes)]
    return JobResult(nodes, command.nproc_per_node, seconds, logs, commands, "ray", node_ids, codes, timed_out)
