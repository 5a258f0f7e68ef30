"""Launch a torch.distributed job with one torchrun agent per node of an existing Ray cluster.

The seeds convert on 4 nodes; on a Ray cluster the stage does it itself: a STRICT_SPREAD placement group
of one bundle per node, one `NodeAgent` actor per bundle, each starting the node's torchrun agent (the
same command `scale_out_command` prints for clusters without Ray), rendezvousing on node 0's address and
a port node 0 picked. The driver streams every agent's log (prefixed with its node) into the stage log
and into `<work_dir>/logs/<name>.node<i>.log`, and reports a failure exactly as the local launcher does:
the failing rank and its node from the ranks' error reports on the shared filesystem, with that node's
log tail. Agents die with their actor (PDEATHSIG); the actors and the group are removed in every case.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kimi_pipeline.cluster.env import auth_mode, require_auth
from kimi_pipeline.cluster.lifecycle import attach_driver
from kimi_pipeline.cluster.placement import GroupSpec, create_group, remove_placement_groups
from kimi_pipeline.cluster.readiness import connected
from kimi_pipeline.util.lifetime import die_with_parent
from kimi_pipeline.util.net import free_port
from kimi_pipeline.weightjobs.launch import (
    WORKER_ENV,
    JobResult,
    _job_error,
    node_command,
    read_failures,
)

log = logging.getLogger(__name__)


class TooFewNodes(RuntimeError):
    """The Ray cluster has fewer live nodes than the job has nodes (the caller may run it on one host)."""


class NodeAgent:
    """Runs one node's torchrun agent and hands its log over in pieces (a Ray actor)."""

    def __init__(self, node: int):
        self.node = node
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(tempfile.mkdtemp(prefix=f"kimi-node{node}-")) / "agent.log"

    def address(self) -> tuple[str, str]:
        """(IP, Ray node id) of the node this agent landed on."""

        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()

    def free_port(self) -> int:
        """A port free on this node's address, where node 0's rendezvous store will listen (`weightjobs.agent`)."""
        return free_port(ray.util.get_node_ip_address())

    def start(self, cmd: list[str], env: dict[str, str]) -> int:
        """Start the node's agent with this node's Python (the cluster's environment, not the driver's)."""

        cmd = [sys.executable, *cmd[1:]]
        with open(self.log_path, "wb") as fh:
            self.proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                         start_new_session=True, preexec_fn=die_with_parent)
        return self.proc.pid

    def poll(self, offset: int) -> tuple[int | None, bytes]:
        """(exit code or None while running, log bytes from `offset`)."""
        code = self.proc.poll() if self.proc else None
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(offset)
                data = fh.read(1 << 20)
        except OSError:
            data = b""
        return code, data

    def stop(self, grace_s: float = 10.0) -> int | None:
        """Stop the agent's process group if it still runs (SIGTERM, then SIGKILL); remove the node-local log."""
        try:
            if self.proc is None or self.proc.poll() is not None:
                return self.proc.returncode if self.proc else None
            for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            return self.proc.returncode
        finally:
            shutil.rmtree(self.log_path.parent, ignore_errors=True)


def launch_ray(module: str, args: list[str], *, nodes: int, procs_per_node: int, work_dir: str | Path,
               report_dir: str | Path, address: str, name: str = "job", gpus_per_node: int = 0,
               env: dict[str, str] | None = None, timeout: float | None = None, grace: float = 15.0,
               placement_timeout_s: float = 120.0, allow_insecure: bool = False) -> JobResult:
    """Run `python -m module args` as a `nodes` x `procs_per_node` job, one torchrun agent per Ray node.

    Raises WeightJobPermanentError / WeightJobError naming the failing rank and node, PlacementError
    when the cluster has fewer nodes (or resources) than the job needs; ClusterConfigError for a cluster of
    several nodes without token auth unless `allow_insecure` (`cluster.allow_insecure`, `env.require_auth`).
    """

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
            commands = [node_command(module, args, nnodes=nodes, node_rank=i, nproc_per_node=procs_per_node,
                                     master_addr=master, master_port=port) for i in range(nodes)]
            log.info("%s: %d torchrun agents on Ray nodes %s, rendezvous %s:%d", name, nodes, hosts, master, port)
            ray.get([a.start.remote(c, full_env) for a, c in zip(agents, commands)])
            codes, seconds, timed_out = _watch(agents, name, log_dir, timeout, grace)
        finally:
            try:
                ray.get([a.stop.remote() for a in agents], timeout=30)
            except Exception:  # noqa: BLE001 - the actors go next anyway, taking their agents with them
                pass
            for a in agents:
                ray.kill(a)
            remove_placement_groups({"agents": pg})
    logs = [log_dir / f"{name}.node{i}.log" for i in range(nodes)]
    if all(c == 0 for c in codes):
        return JobResult(nodes, procs_per_node, seconds, logs, commands, "ray", node_ids)
    raise _job_error(name, nodes, procs_per_node, codes, read_failures(report_dir), logs, timed_out, timeout)


def _watch(agents, name: str, log_dir: Path, timeout: float | None, grace: float
           ) -> tuple[list[int | None], float, bool]:
    """Stream logs and wait: all agents exit, or one fails (then `grace` for the rest), or the timeout."""

    n = len(agents)
    offsets, partial = [0] * n, [b""] * n
    codes: list[int | None] = [None] * n
    files = [open(log_dir / f"{name}.node{i}.log", "wb") for i in range(n)]
    t0, failed_at, timed_out = time.monotonic(), None, False
    def pump() -> bool:
        """One round of polls; True if any log bytes came."""
        got = False
        for i, (code, data) in enumerate(ray.get([a.poll.remote(o) for a, o in zip(agents, offsets)])):
            codes[i] = code
            if data:
                got = True
                offsets[i] += len(data)
                files[i].write(data)
                files[i].flush()
                *lines, partial[i] = (partial[i] + data).split(b"\n")
                for line in lines:
                    text = line.decode(errors="replace")
                    if text and "Warning" not in text and "warnings.warn" not in text:
                        log.info("[%s node %d] %s", name, i, text)
        return got

    try:
        while True:
            pump()
            if all(c is not None for c in codes):
                while pump():  # the log tails written just before the agents exited
                    pass
                break
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > grace:
                break
            if timeout is not None and time.monotonic() - t0 > timeout:
                timed_out = True
                break
            time.sleep(0.3)
    finally:
        for f in files:
            f.close()
    return codes, time.monotonic() - t0, timed_out
