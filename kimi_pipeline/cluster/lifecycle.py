"""The run's Ray cluster, brought up and torn down: the cluster stage's work (`stages.cluster`).

- `cluster.address` set: use that cluster (never started or stopped by us), wait until it is big enough.
- otherwise: an embedded cluster owned by the run (head on this host; `nodes > 1` on device=cpu adds
  simulated nodes), recorded in `<run_dir>/cluster/state.json`. It stays up for the following stages
  and is torn down by `stop_cluster(run_dir)` in the flow's `finally` (unless `cluster.keep`), or by a
  watchdog if the owning process dies first.

Cluster facts go to `<run_dir>/cluster/facts.json` / `facts.md` and the `cluster` section of summary.json.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import ray

from kimi_pipeline.cluster.cluster_errors import (
    ClusterConfigError,
    ClusterHealthError,
    LocalClusterTooSmall,
    PreflightError,
)
from kimi_pipeline.cluster.env import (
    RAY_METRICS_OFF,
    RAY_METRICS_VAR,
    auth_mode,
    ensure_token,
    require_auth,
    token_source,
)
from kimi_pipeline.cluster.local import LocalCluster, NodeSpec
from kimi_pipeline.cluster.preflight import report_markdown, run_preflight
from kimi_pipeline.cluster.readiness import ClusterFacts, Requirements, wait_until_healthy
from kimi_pipeline.recipes.models import ClusterSpec
from kimi_pipeline.report.stage_reports import cluster_report
from kimi_pipeline.report.summary import RunSummary
from kimi_pipeline.util.files import atomic_write_json, atomic_write_text

log = logging.getLogger(__name__)

EMBEDDED_TIMEOUT_S = 120.0  # local raylets register within seconds; this only bounds a broken start
EXISTING_TIMEOUT_S = 900.0  # a real cluster may still be provisioning nodes


def local_gpu_count() -> int:
    """GPUs this host can give an embedded head (CUDA_VISIBLE_DEVICES wins, else `nvidia-smi -L`)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def embedded_layout(cluster: ClusterSpec) -> tuple[NodeSpec, list[NodeSpec]]:
    """Head + simulated worker specs for an embedded cluster, or a clear error if this host cannot."""
    req = Requirements.of(cluster)
    total_gb = psutil.virtual_memory().total / 1024**3
    if req.memory_gb_per_node and total_gb < req.memory_gb_per_node:
        raise LocalClusterTooSmall(
            f"cluster.memory_gb_per_node={req.memory_gb_per_node:g} but this host has {total_gb:.1f} GB",
            [f"memory {total_gb:.1f} GB < {req.memory_gb_per_node:g} GB"],
        )
    if cluster.device == "cuda":
        if cluster.nodes > 1:
            raise ClusterConfigError(
                f"cluster.nodes={cluster.nodes} × {cluster.gpus_per_node} GPUs cannot be embedded on one host: start a cluster "
                "(infra/ray/head.sh + worker.sh, or infra/kuberay/) and set cluster.address=HEAD:6379"
            )
        have = local_gpu_count()
        if have < cluster.gpus_per_node:
            raise LocalClusterTooSmall(
                f"cluster.gpus_per_node={cluster.gpus_per_node} but this host has {have} GPU(s): use device=cpu "
                "(the tiny recipe) or set cluster.address to a GPU cluster",
                [f"GPU {have} < {cluster.gpus_per_node}"],
            )
        return NodeSpec(num_gpus=cluster.gpus_per_node, log_monitor=cluster.keep, autoscaler_monitor=cluster.keep), []
    cpus = int(req.cpus_per_node)
    if cluster.nodes == 1:  # Ray's CPUs are logical: oversubscribing a small host is slow, not wrong
        return NodeSpec(num_cpus=max(os.cpu_count() or 1, cpus), num_gpus=0, log_monitor=cluster.keep,
                        autoscaler_monitor=cluster.keep), []
    specs = [NodeSpec(num_cpus=cpus, num_gpus=0, resources={f"node_{i}": 1.0}, log_monitor=cluster.keep and i == 0,
                      autoscaler_monitor=cluster.keep) for i in range(cluster.nodes)]
    return specs[0], specs[1:]


def resolve_address(address: str) -> str:
    a = address.strip()
    if a == "auto":
        a = os.environ.get("RAY_ADDRESS", "")
        if not a:
            raise ClusterConfigError("cluster.address=auto but RAY_ADDRESS is not set (it is inside a Ray job)")
    if a.startswith("ray://"):
        raise ClusterConfigError(f"cluster.address={address}: give the GCS address HOST:6379, not a Ray Client ray:// URL")
    if a.startswith(("http://", "https://")):
        raise ClusterConfigError(f"cluster.address={address} is a dashboard URL: give the GCS address HOST:6379")
    return a if ":" in a.rsplit("]", 1)[-1] else f"{a}:6379"


def _driver_auth_mode() -> str:
    """Auth for connecting to a cluster we did not start: the user's choice, else token if we hold one."""
    if os.environ.get("RAY_AUTH_MODE"):
        return auth_mode()
    src = token_source()
    return "token" if src == "RAY_AUTH_TOKEN" or Path(src).is_file() else "disabled"


def attach_driver(address: str) -> str:
    """A cluster we did not start, for a driver in this process: its GCS address, with our auth mode exported."""
    resolved = resolve_address(address)
    export_driver_env(_driver_auth_mode())
    return resolved


def export_driver_env(mode: str, ray_metrics: bool = True) -> None:
    """Drivers in this process (the train stage's ray.init) must use the cluster's auth mode; `ray_metrics` False on
    a cluster that records none (`env.RAY_METRICS_OFF`: the embedded ones; any other keeps what the user set)."""
    os.environ["RAY_AUTH_MODE"] = mode
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    if not ray_metrics:
        os.environ.update(RAY_METRICS_OFF)
    if "ray" in sys.modules:  # Ray caches its config at import: refresh it like Ray itself does
        with contextlib.suppress(Exception):
            from ray._raylet import Config

            Config.initialize("")


def _section(
    facts: ClusterFacts,
    req: Requirements,
    mode: str,
    auth: str,
    seconds: float,
    cluster: LocalCluster | None,
    keep: bool,
) -> dict[str, Any]:
    d = facts.to_dict()
    section: dict[str, Any] = {
        "address": d["address"],
        "nodes": d["nodes"],
        "cpus": d["cpus"],
        "gpus": d["gpus"],
        "memory_gb": d["memory_gb"],
        "ray_version": d["ray_version"],
        "mode": mode,
        "auth_mode": auth,
        "required": req.describe(),
        "seconds_to_ready": round(seconds, 2),
    }
    if cluster is not None:
        section.update(
            dashboard=cluster.state.get("dashboard_url"),
            temp_dir=cluster.state["temp_dir"],
            temp_dir_note=cluster.state.get("temp_dir_note"),
            keep=keep,
        )
    section["node_list"] = d["node_list"]
    return section


def bring_up(recipe, run_dir: Path, timeout_s: float | None = None, owner_pid: int | None = None) -> dict[str, Any]:
    """Start or attach, wait until healthy, write facts; returns the summary section."""
    run_dir = Path(run_dir)
    wanted = recipe.cluster
    req = Requirements.of(wanted)
    t0 = time.monotonic()
    cdir = run_dir / "cluster"
    cdir.mkdir(parents=True, exist_ok=True)
    cluster: LocalCluster | None = None
    previous = LocalCluster.load(run_dir)
    if wanted.address:
        address = attach_driver(wanted.address)
        mode, auth = "existing", auth_mode()
        require_auth(auth, wanted.nodes, wanted.allow_insecure)
        if previous is not None and previous.state.get("mode") == "embedded" and not previous.stopped:
            previous.stop()  # the run dir's own cluster must not outlive the record that tracks it
        atomic_write_json(cdir / "state.json", {"mode": "existing", "address": address, "stopped_at": None})
        facts = wait_until_healthy(address, req, timeout_s or EXISTING_TIMEOUT_S)
        require_auth(auth, len(facts.nodes), wanted.allow_insecure)  # more nodes than the recipe asks for
    else:
        mode, auth = "embedded", auth_mode()
        require_auth(auth, wanted.nodes, wanted.allow_insecure)  # simulated nodes listen beyond loopback
        if previous is not None and previous.state.get("mode") == "embedded" and not previous.stopped:
            if previous.alive():
                log.info("reusing the embedded Ray cluster at %s recorded in %s", previous.address, cdir)
                cluster = previous
            else:
                previous.stop()  # leftovers of a crashed attempt
        if cluster is None:
            head, workers = embedded_layout(wanted)
            if auth == "token":
                ensure_token()
            dashboard = wanted.keep or wanted.device == "cuda" or os.environ.get("KIMI_RAY_DASHBOARD") == "1"
            cluster = LocalCluster.start(run_dir, head, workers, dashboard=dashboard,
                                         owner_pid=None if wanted.keep else owner_pid)
        auth = cluster.env.get("RAY_AUTH_MODE", auth)  # a reused cluster keeps the mode it started with
        try:
            export_driver_env(auth, ray_metrics=cluster.env.get(RAY_METRICS_VAR) != RAY_METRICS_OFF[RAY_METRICS_VAR])
            facts = wait_until_healthy(cluster.address, req, timeout_s or EMBEDDED_TIMEOUT_S)
        except ClusterHealthError as e:
            cluster.stop()
            raise LocalClusterTooSmall(str(e), e.missing) from e
        except BaseException:
            cluster.stop()
            raise
        cluster.state["keep"] = wanted.keep
        cluster.save()
    section = _section(facts, req, mode, auth, time.monotonic() - t0, cluster, wanted.keep)
    report = fast_preflight(recipe, facts.address, cdir)
    section["preflight"] = {"ok": report["ok"], "seconds": report["seconds"], "failed": report["failed"]}
    atomic_write_json(cdir / "facts.json", section)
    atomic_write_text(cdir / "facts.md", cluster_report(section))
    if not report["ok"]:
        raise PreflightError(f"preflight of the cluster at {facts.address} failed ({cdir / PREFLIGHT_MD}): "
                             + "; ".join(report["failed"]))
    return section


PREFLIGHT_MD = "preflight.md"


def fast_preflight(recipe, address: str, cdir: Path) -> dict[str, Any]:
    """`kimi preflight --fast` on the cluster just brought up (software, shared base_dir, free space, RAM and
    /dev/shm, ports; no collective), its report in DIR/cluster/preflight.json and .md. A driver connects only for
    it, unless this process already had one."""
    # imported here: the watchdog and `kimi cluster` import this module and must stay light (0.13 s and 23 MB to
    # import; with the preflight's plan, torch and ray 3 s and 280 MB)

    report = run_preflight(recipe, address, fast=True, progress=log.info)
    atomic_write_json(cdir / "preflight.json", report)
    atomic_write_text(cdir / PREFLIGHT_MD, report_markdown(report))
    return report


def stop_cluster(run_dir: Path, keep: bool | None = None) -> dict[str, Any] | None:
    """Tear down the run's embedded cluster (no-op for an existing cluster or when none was started).

    `keep` None = what the recipe said at start-up. Safe to call any number of times, from `finally`.
    """
    run_dir = Path(run_dir)
    cluster = LocalCluster.load(run_dir)
    if cluster is None or cluster.state.get("mode") != "embedded" or cluster.stopped:
        return None
    keep = bool(cluster.state.get("keep")) if keep is None else keep
    if keep:
        log.warning("keeping the embedded Ray cluster at %s (cluster.keep); stop it with `kimi cluster down --run-dir %s`",
                    cluster.address, run_dir)
        return {"kept": True, "address": cluster.address}
    _disconnect_driver(cluster.address)
    report = cluster.stop()
    summary = RunSummary(run_dir)
    section = summary.read().get("cluster")
    if isinstance(section, dict):
        section.update(stopped=True, teardown=report)
        summary.set_section("cluster", section)
    return report


def _disconnect_driver(address: str | None) -> None:
    """A driver whose GCS disappears exits its process after a timeout: disconnect it first."""
    if "ray" not in sys.modules:
        return

    if ray.is_initialized() and ray.get_runtime_context().gcs_address == address:
        ray.shutdown()
