"""An embedded Ray cluster owned by a run: a head (and optional simulated nodes) on this host.

Started with `ray start` subprocesses, so the cluster outlives the call that made it (the train stage
connects later with `ray.init(address=...)`), and recorded in `<run_dir>/cluster/state.json` so that
anything holding the run dir (the flow's `finally`, a watchdog, `kimi cluster down`) can tear it down.

Simulated nodes are extra raylets on the same host (`ray start --address`), each with its own CPU count
and a `node_<i>` custom resource: enough to test multi-node placement on one machine.

A cluster of one node (the one-host layout) runs on 127.0.0.1: every Ray process of it listens on loopback only
(`env.use_loopback_ray` says how, and why simulated nodes cannot: Ray's single-host mode takes no second raylet).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kimi_pipeline.cluster.cluster_errors import ClusterConfigError, ClusterError, RayStartTimedOut
from kimi_pipeline.cluster.env import SINGLE_HOST_VAR, choose_temp_dir, gcs_reachable, loopback_env, ray_env
from kimi_pipeline.cluster.procs import MARKER_VAR, cluster_processes, stop_cluster_processes
from kimi_pipeline.util.files import atomic_write_json
from kimi_pipeline.util.net import LOOPBACK, free_port, free_ports
from kimi_pipeline.util.secret_env import without_secrets

T = TypeVar("T")
log = logging.getLogger(__name__)

# the venv's Ray whatever PATH says: its `ray start`, less the CLI's `ray serve` group and the Ray Client server
# (`ray_start`: neither is used)
RAY_START = [sys.executable, "-m", "kimi_pipeline.cluster.ray_start"]
# Every node of a LocalCluster is on this host, so its workers' and drivers' ports come from the kernel (port 0), the
# one allocator that knows every port of the host. `ray start` would give each raylet Ray's fixed range 10002-19999
# (ray/scripts/scripts.py:515-530), handed out in the same order by every raylet, each port checked free by a test
# bind that it then closes (raylet/worker_pool.cc, `WorkerPool::GetNextFreePort`): two raylets on one host (a
# simulated node, another run's cluster) can give one port to two workers, and the one that binds second aborts, a
# driver with the process it runs in (core worker grpc_server.cc:134 "Failed to start the grpc server. The specified
# port is 14455": a pytest worker of the suite, connecting to its new cluster while other tests' clusters ran). 0 for
# both bounds is Ray's "random ports" (_private/parameter.py:375-396 accepts it, services.py:1852-1856 passes it on).
KERNEL_WORKER_PORTS = ["--min-worker-port", "0", "--max-worker-port", "0"]
START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class NodeSpec:
    """Resources one raylet advertises (None = let Ray detect)."""

    num_cpus: int | None = None
    num_gpus: int | None = None
    resources: dict[str, float] = field(default_factory=dict)
    object_store_bytes: int | None = None
    # Ray's log monitor streams the workers' output to drivers that ask (`ray.init(log_to_driver=True)`); the run's
    # own drivers never do (their actors log into the run dir), so only a cluster kept for users' drivers runs one,
    # on its head (simulated nodes share the head's log directory)
    log_monitor: bool = True
    # Ray's autoscaler monitor (a head's autoscaler/_private/monitor.py) feeds `ray status` and scales a cluster that
    # has a node provider; an embedded cluster's nodes are fixed, so only one kept for users' drivers (`kimi cluster
    # up`) runs it. Elsewhere it cost ~0.6 CPU-s a head and, as it ignores SIGTERM, each teardown's 2 s wait before
    # `procs.stop_processes` killed it. `ray start --no-monitor` (hidden; scripts.py:694-700, node.py:1654-1655)
    autoscaler_monitor: bool = True

    def args(self) -> list[str]:
        out: list[str] = [] if self.log_monitor else ["--include-log-monitor", "false"]
        if not self.autoscaler_monitor:
            out.append("--no-monitor")
        if self.num_cpus is not None:
            out += ["--num-cpus", str(self.num_cpus)]
        if self.num_gpus is not None:
            out += ["--num-gpus", str(self.num_gpus)]
        if self.resources:
            out += ["--resources", json.dumps(self.resources, sort_keys=True)]
        if self.object_store_bytes is not None:
            out += ["--object-store-memory", str(self.object_store_bytes)]
        return out


def state_path(run_dir: Path) -> Path:
    return Path(run_dir) / "cluster" / "state.json"


class LocalCluster:
    """Handle on an embedded cluster; all of it lives in the state file, so handles are cheap to rebuild."""

    def __init__(self, run_dir: Path, state: dict[str, Any]):
        self.run_dir = Path(run_dir)
        self.state = state

    # ---- persistence -------------------------------------------------------------------------
    @classmethod
    def load(cls, run_dir: Path) -> LocalCluster | None:
        p = state_path(run_dir)
        if not p.is_file():
            return None
        return cls(run_dir, json.loads(p.read_text()))

    def save(self) -> None:
        atomic_write_json(state_path(self.run_dir), self.state)

    @property
    def address(self) -> str | None:
        return self.state.get("address")

    @property
    def env(self) -> dict[str, str]:
        return dict(self.state.get("env", {}))

    @property
    def loopback(self) -> bool:
        """Every process of the cluster listens on 127.0.0.1 only (its drivers: `env.use_loopback_ray(True)`)."""
        return bool(self.state.get("loopback"))

    @property
    def stopped(self) -> bool:
        return self.state.get("stopped_at") is not None

    # ---- start -------------------------------------------------------------------------------
    @classmethod
    def start(
        cls,
        run_dir: Path,
        head: NodeSpec,
        workers: list[NodeSpec] | None = None,
        *,
        dashboard: bool = False,
        owner_pid: int | None = None,
        timeout_s: float = START_TIMEOUT_S,
        loopback: bool | None = None,
    ) -> LocalCluster:
        """Start a head (+ simulated worker raylets). On any failure, whatever started is stopped.

        `loopback` (default: when there are no workers): every Ray process of the cluster listens on 127.0.0.1 only
        (`env.use_loopback_ray`); such a cluster cannot take a second node, so a caller that adds nodes later passes
        False."""
        if loopback and workers:
            raise ClusterConfigError("a Ray cluster on loopback has one node (Ray's single-host mode): no simulated nodes")
        run_dir = Path(run_dir)
        (run_dir / "cluster").mkdir(parents=True, exist_ok=True)
        temp_dir, temp_note = choose_temp_dir(run_dir)
        marker = uuid.uuid4().hex
        env = ray_env(temp_dir)
        state: dict[str, Any] = {
            "mode": "embedded",
            "marker": marker,
            "sids": [],
            "temp_dir": str(temp_dir),
            "temp_dir_note": temp_note,
            "env": env,
            "address": None,
            "loopback": not workers if loopback is None else loopback,
            "dashboard_url": None,
            "nodes_started": 0,
            "owner_pid": owner_pid,
            "started_at": time.time(),
            "stopped_at": None,
        }
        cluster = cls(run_dir, state)
        cluster.save()  # before the first process exists, so a crash mid-start is still cleaned up
        try:
            cluster._start_head(head, dashboard, timeout_s)
            if owner_pid is not None:  # before the workers: a simulated 32-node start takes minutes to be killed in
                cluster._start_watchdog(owner_pid)
            for i, w in enumerate(workers or [], start=1):
                cluster._start_worker(w, i, timeout_s)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def process_env(self, env_extra: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of this cluster's Ray processes: this process's, without the flow's secrets (every Ray
        process, and so every actor of the run, inherits it, and none needs the hub token, the W&B key or the
        webhook), plus the cluster's variables, `env_extra` and the marker that finds them at teardown."""
        env = without_secrets()
        env.pop(SINGLE_HOST_VAR, None)  # a driver's own mode is not this cluster's
        env.update(self.env)
        env.update(env_extra or {})
        env[MARKER_VAR] = self.state["marker"]
        return env

    def _ray_start(self, args: list[str], log_name: str, timeout_s: float, env_extra: dict[str, str] | None = None,
                   prefix: list[str] | None = None) -> str:
        """`ray start ARGS` with `process_env(env_extra)`, run through `prefix` when given (a command that execs the
        rest, e.g. into another mount namespace)."""
        env = self.process_env(env_extra)
        log_path = self.run_dir / "cluster" / f"{log_name}.log"
        with open(log_path, "w") as out:
            proc = subprocess.Popen(
                [*(prefix or []), *RAY_START, *args, *KERNEL_WORKER_PORTS, "--temp-dir", self.state["temp_dir"],
                 "--disable-usage-stats"],
                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )
            self.state["sids"].append(proc.pid)  # start_new_session: sid == pid of the `ray start` process
            self.save()
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise ClusterError(f"`ray start` ({log_name}) did not finish in {timeout_s:.0f} s; see {log_path}") from None
        text = log_path.read_text(errors="replace")
        if rc != 0 and "timed out during startup" in text:
            stop_cluster_processes(None, [proc.pid])  # what this start left behind, not the cluster
            raise RayStartTimedOut(f"`ray start` ({log_name}): its raylet did not register in Ray's 30 s; "
                                   f"see {log_path}")
        if rc != 0:
            tail = "\n".join(text.strip().splitlines()[-8:])
            raise ClusterError(f"`ray start` ({log_name}) exited {rc}; see {log_path}:\n{tail}")
        return text

    def _start_head(self, head: NodeSpec, dashboard: bool, timeout_s: float) -> None:
        t0 = time.monotonic()

        def start() -> tuple[str, int]:
            # fresh ports on each attempt (a port taken meanwhile may be why one failed), distinct within it
            dash_port, agent_port = free_ports(2)
            args = [
                "--head", "--port", "0", *(["--node-ip-address", LOOPBACK] if self.loopback else []),
                "--include-dashboard", "true" if dashboard else "false",
                "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash_port),
                "--dashboard-agent-listen-port", str(agent_port),
                *head.args(),
            ]
            env_extra = loopback_env() if self.loopback else None
            return self._ray_start(args, "ray-start-head", timeout_s, env_extra), dash_port

        text, dash_port = _once_more_if_it_timed_out(start)
        current = Path(self.state["temp_dir"]) / "ray_current_cluster"
        address = current.read_text().strip() if current.is_file() else None
        if not address:
            m = re.search(r"ray start --address='([^']+)'", text)
            address = m.group(1) if m else None
        if not address or not gcs_reachable(address):
            raise ClusterError(f"Ray head started but its GCS address is unknown or unreachable ({address!r})")
        self.state.update(address=address, nodes_started=1, dashboard_url=f"http://127.0.0.1:{dash_port}" if dashboard else None)
        self.save()
        log.info("Ray head up at %s in %.1f s (temp dir %s)", address, time.monotonic() - t0, self.state["temp_dir"])

    def _start_worker(self, node: NodeSpec, index: int, timeout_s: float, env_extra: dict[str, str] | None = None,
                      prefix: list[str] | None = None) -> None:
        """A simulated node; `env_extra` / `prefix` make it differ from the others (a node's own environment)."""
        if self.loopback:
            raise ClusterConfigError(f"the Ray cluster at {self.address} is on loopback (one node): it takes no other node")
        t0 = time.monotonic()
        _once_more_if_it_timed_out(lambda: self._ray_start(
            ["--address", self.address, "--dashboard-agent-listen-port", str(free_port()), *node.args()],
            f"ray-start-node-{index}", timeout_s, env_extra, prefix))
        self.state["nodes_started"] += 1
        self.save()
        log.info("simulated Ray node %d joined in %.1f s", index, time.monotonic() - t0)

    def _start_watchdog(self, owner_pid: int) -> None:
        """A detached helper that tears the cluster down if the owning process dies without doing so."""
        env = without_secrets()
        env[MARKER_VAR] = self.state["marker"]
        out = open(self.run_dir / "cluster" / "watchdog.log", "a")
        with out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kimi_pipeline.cluster.watchdog", "--owner-pid", str(owner_pid),
                 "--run-dir", str(self.run_dir)],
                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )
        self.state["watchdog_pid"] = proc.pid
        self.save()

    # ---- inspect / stop ----------------------------------------------------------------------
    def processes(self):
        return cluster_processes(self.state["marker"], self.state.get("sids", []))

    def alive(self) -> bool:
        return not self.stopped and bool(self.address) and gcs_reachable(self.address)

    def stop(self, grace_s: float = 5.0) -> dict[str, Any]:
        """Stop every process of this cluster (and only those); idempotent."""
        t0 = time.monotonic()
        counts = stop_cluster_processes(self.state["marker"], self.state.get("sids", []), grace_s=grace_s)
        self._collect_logs()
        self.state["stopped_at"] = time.time()
        self.save()
        report = {**counts, "seconds": round(time.monotonic() - t0, 2)}
        log.info("stopped embedded Ray cluster %s: %s", self.address, report)
        return report

    def _collect_logs(self) -> None:
        """A fallback temp dir lives in /tmp: move its logs into the run dir, delete the rest."""
        if not self.state.get("temp_dir_note"):
            return
        short = Path(self.state["temp_dir"])
        link = self.run_dir / "ray"
        if link.is_symlink():
            link.unlink()
        if short.is_dir():
            for session in short.glob("session_2*"):
                logs = session / "logs"
                if logs.is_dir() and not session.is_symlink():
                    dest = link / session.name / "logs"
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    shutil.move(str(logs), str(dest))
            shutil.rmtree(short, ignore_errors=True)


def _once_more_if_it_timed_out(start: Callable[[], T]) -> T:
    """`start()`, and once more when its raylet missed Ray's registration wait: that wait is a fixed 30 s that a
    briefly overloaded host (measured: beside a 32-raylet simulated cluster on 2 cores) can miss; a second miss is
    reported."""
    try:
        return start()
    except RayStartTimedOut as e:
        log.warning("%s; starting it once more", e)
        return start()
