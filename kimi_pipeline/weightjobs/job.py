"""The one entry of the distributed weight jobs (conversion, its verification, the INT4 export): the layout they run
in (`JobLayout`, the recipe's weight-job layout), the programs one job runs in turn (`JobPhase`), and running them
to every rank's report (`run_weight_job`): the per-node command built once (`commands`), started where
`convert.launcher` says (`launch`, `ray_agents`), judged the same way whoever started it (`outcome`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kimi_pipeline.recipes.layout import Layout
from kimi_pipeline.recipes.models import ClusterSpec, ConvertSpec
from kimi_pipeline.weightjobs.commands import NodeCommand
from kimi_pipeline.weightjobs.launch import launch_local, launch_manual
from kimi_pipeline.weightjobs.outcome import JobResult, WeightJobPermanentError, rank_reports
from kimi_pipeline.weightjobs.rank import RANK_ENTRY, rank_args
from kimi_pipeline.weightjobs.ray_agents import TooFewNodes, launch_ray

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class JobPhase:
    """One program of a weight job: ranks of `kind` (a `weightjobs.rank` kind: convert, verify, export) reading
    `job_file`, each reporting `<report_prefix>_<rank>.json` into `reports`; logs named `name`. `world_size`: a
    phase of another size than the job's (the verification, under another layout): on the job's nodes when it has
    their rank count, else on one node."""

    kind: str
    job_file: Path
    reports: Path
    name: str
    report_prefix: str = "rank"
    world_size: int | None = None


@dataclass(frozen=True)
class PhaseResult:
    """A finished phase: how it ran (`result`), every rank's report by rank, the per-node command it printed."""

    result: JobResult
    reports: list[dict[str, Any]]
    command: str


def run_weight_job(job: JobLayout, phases: Sequence[JobPhase], timeout: float | None) -> list[PhaseResult]:
    """Run `phases` in turn over `job`'s nodes x ranks (the next starts when every rank of the last reported; a
    failed phase raises `outcome`'s error naming its rank and node): log each phase's per-node command (what to run
    on a cluster without Ray), start its agents where `job.launcher` says (`auto` = on the Ray cluster at
    `cluster.address` when it has the nodes, else on this host), return each phase's result."""
    done = []
    for phase in phases:
        world = phase.world_size or job.nodes * job.ranks_per_node
        nodes, per_node = (job.nodes, job.ranks_per_node) if world == job.nodes * job.ranks_per_node else (1, world)
        job_file = phase.job_file.resolve()
        command = NodeCommand(RANK_ENTRY, tuple(rank_args(phase.kind, job_file)), nodes, per_node)
        printed = command.scale_out(job.master_port)
        log.info("%s: %d node(s) x %d rank(s), tp=%d pp=%d ep=%d; on a cluster without Ray run on every node:\n  %s",
                 phase.name, nodes, per_node, job.layout.tp, job.layout.pp, job.layout.ep, printed)
        where = dict(work_dir=job_file.parent, report_dir=phase.reports, name=phase.name, timeout=timeout)
        result = None
        if job.launcher == "manual":
            result = launch_manual(command, **where, report_prefix=phase.report_prefix, master_port=job.master_port)
        elif job.launcher == "ray" and not job.address:
            raise WeightJobPermanentError(
                f"{phase.name}: convert.launcher=ray needs cluster.address (an existing Ray cluster)")
        elif job.launcher in ("auto", "ray") and job.address:
            try:
                result = launch_ray(command, **where, address=job.address, allow_insecure=job.allow_insecure,
                                    gpus_per_node=job.ranks_per_node if job.device == "cuda" else 0)
            except TooFewNodes as e:
                if job.launcher == "ray":
                    raise WeightJobPermanentError(f"{e}; add nodes or set convert.launcher=local") from None
                log.warning("%s; running all %d nodes' ranks on this host", e, nodes)  # a small model, a small cluster
        if result is None:
            result = launch_local(command, **where)
        ranks = rank_reports(result, phase.name, phase.reports, phase.report_prefix, world, timeout)
        done.append(PhaseResult(result, ranks, printed))
    return done
