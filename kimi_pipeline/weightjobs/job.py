"""The one entry of the distributed weight jobs (conversion, its verification, the INT4 export): the layout they run
in (`JobLayout`, the recipe's weight-job layout), where a job's per-node agents start (`convert.launcher`), and
running it to every rank's report (`run_weight_job`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kimi_pipeline.recipes.layout import Layout
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


@dataclass(frozen=True)
class JobLayout:
    """Where and how wide a distributed weight job runs: `nodes` x `ranks_per_node` ranks splitting the model as
    `layout` says, its per-node agents started by `launcher` (on `address`'s Ray nodes, on this host, or by hand),
    on `device`. Both weight jobs, the conversion and the INT4 export, run in the recipe's one weight-job layout:
    its `convert` section (nodes, ranks, split, launcher, rendezvous port) on its cluster (device, address)."""

    nodes: int
    ranks_per_node: int
    layout: Layout
    launcher: str
    master_port: int
    device: str
    address: str | None
    allow_insecure: bool

    @classmethod
    def of(cls, convert: ConvertSpec, cluster: ClusterSpec) -> JobLayout:
        return cls(convert.nodes, convert.gpus_per_node, Layout.from_convert(convert), convert.launcher,
                   convert.master_port, cluster.device, cluster.address, cluster.allow_insecure)

    def as_dict(self) -> dict[str, int]:
        """The layout as the stages' sections record it."""
        return {"nodes": self.nodes, "ranks_per_node": self.ranks_per_node, "tp": self.layout.tp,
                "pp": self.layout.pp, "ep": self.layout.ep, "etp": self.layout.etp}


def run_weight_job(job: JobLayout, kind: str, job_file: Path, reports: Path, name: str, report_prefix: str,
                   timeout: float | None, *, world_size: int | None = None) -> tuple[JobResult, list[dict[str, Any]], str]:
    """One offline weight job (`kind`: a `weightjobs.rank` kind: conversion, its verification or the INT4 export)
    over `job`'s nodes x ranks: log the per-node command, launch it where `job.launcher` says, return (job result,
    every rank's report, the command). `world_size`: a job of another size than `job`'s (the verification, under
    another layout): on `job`'s nodes when it has their rank count, else on one node."""
    job_file = job_file.resolve()
    args = rank_args(kind, job_file)
    world = world_size or job.nodes * job.ranks_per_node
    nodes, per_node = (job.nodes, job.ranks_per_node) if world == job.nodes * job.ranks_per_node else (1, world)
    command = scale_out_command(RANK_ENTRY, args, nnodes=nodes, nproc_per_node=per_node, master_port=job.master_port)
    log.info("%s: %d node(s) x %d rank(s), tp=%d pp=%d ep=%d; on a cluster without Ray run on every node:\n  %s",
             name, nodes, per_node, job.layout.tp, job.layout.pp, job.layout.ep, command)
    result = launch(RANK_ENTRY, args, nodes=nodes, procs_per_node=per_node, work_dir=job_file.parent,
                    report_dir=reports, name=name, timeout=timeout, report_prefix=report_prefix,
                    launcher=job.launcher, address=job.address, master_port=job.master_port,
                    gpus_per_node=job.ranks_per_node if job.device == "cuda" else 0,
                    allow_insecure=job.allow_insecure)
    return result, read_rank_reports(reports, report_prefix, world), command
