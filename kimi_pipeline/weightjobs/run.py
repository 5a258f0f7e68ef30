"""The one entry of the distributed weight jobs (conversion, its verification, the INT4 export): where a job's
per-node agents start (`convert.launcher`), and running it to every rank's report."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from kimi_pipeline.recipes.models import ClusterSpec, ConvertSpec
from kimi_pipeline.weightjobs.launch import (
    JobResult,
    WeightJobPermanentError,
    launch_local,
    launch_manual,
    read_rank_reports,
    scale_out_command,
)
from kimi_pipeline.weightjobs.rank import RANK_ENTRY, rank_args
from kimi_pipeline.weightjobs.ray_agents import TooFewNodes, launch_ray

log = logging.getLogger(__name__)


def launch(module: str, args: list[str], *, nodes: int, procs_per_node: int, work_dir: str | Path,
           report_dir: str | Path, name: str = "job", launcher: str = "auto", address: str | None = None,
           gpus_per_node: int = 0, report_prefix: str = "rank", master_port: int = 29500,
           timeout: float | None = None, allow_insecure: bool = False) -> JobResult:
    """Start the job's per-node agents where `launcher` says: `ray` (one per node of the cluster at `address`,
    `ray_agents`), `local` (every node's agent on this host), `manual` (print the per-node command, wait for
    every rank's `<report_prefix>_<rank>.json`); `auto` = ray when `address` has at least `nodes` nodes."""
    if launcher == "manual":
        return launch_manual(module, args, nodes=nodes, procs_per_node=procs_per_node, work_dir=work_dir,
                             report_dir=report_dir, name=name, report_prefix=report_prefix, master_port=master_port,
                             timeout=timeout)
    if launcher in ("auto", "ray") and address:
        try:
            return launch_ray(module, args, nodes=nodes, procs_per_node=procs_per_node, work_dir=work_dir,
                              report_dir=report_dir, address=address, name=name, gpus_per_node=gpus_per_node,
                              timeout=timeout, allow_insecure=allow_insecure)
        except TooFewNodes as e:
            if launcher == "ray":
                raise WeightJobPermanentError(f"{e}; add nodes or set convert.launcher=local") from None
            log.warning("%s; running all %d nodes' ranks on this host", e, nodes)  # a small model, a small cluster
    elif launcher == "ray":
        raise WeightJobPermanentError(f"{name}: convert.launcher=ray needs cluster.address (an existing Ray cluster)")
    return launch_local(module, args, nodes=nodes, procs_per_node=procs_per_node, work_dir=work_dir,
                        report_dir=report_dir, name=name, timeout=timeout)


def launch_target(convert: ConvertSpec, cluster: ClusterSpec) -> dict[str, Any]:
    """Where the offline weight jobs (conversion, INT4 export) start their per-node agents (`convert.launcher`):
    on `cluster.address`'s Ray nodes, one torchrun agent per node; on this host; or by hand (manual)."""
    return {"launcher": convert.launcher, "address": cluster.address, "master_port": convert.master_port,
            "gpus_per_node": convert.gpus_per_node if cluster.device == "cuda" else 0,
            "allow_insecure": cluster.allow_insecure}


def run_weight_job(convert: ConvertSpec, cluster: ClusterSpec, kind: str, job: Path, reports: Path, name: str,
                   report_prefix: str, timeout: float | None) -> tuple[JobResult, list[dict[str, Any]], str]:
    """One offline weight job (`kind`: a `weightjobs.rank` kind, conversion or INT4 export) over `convert`'s nodes x
    ranks: log the per-node command, launch it where `launch_target` says, return (job result, every rank's
    report, the command)."""
    job = job.resolve()
    args = rank_args(kind, job)
    command = scale_out_command(RANK_ENTRY, args, nnodes=convert.nodes, nproc_per_node=convert.gpus_per_node,
                                master_port=convert.master_port)
    log.info("%s: %d node(s) x %d rank(s), tp=%d pp=%d ep=%d; on a cluster without Ray run on every node:\n  %s",
             name, convert.nodes, convert.gpus_per_node, convert.tp, convert.pp, convert.ep, command)
    result = launch(RANK_ENTRY, args, nodes=convert.nodes, procs_per_node=convert.gpus_per_node,
                    work_dir=job.parent, report_dir=reports, name=name, timeout=timeout,
                    report_prefix=report_prefix, **launch_target(convert, cluster))
    return result, read_rank_reports(reports, report_prefix, convert.nodes * convert.gpus_per_node), command


