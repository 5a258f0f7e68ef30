"""Stage `cluster`: a Ray address for the train stage that provably has what the recipe needs: an existing
cluster (`cluster.address`) waited for until it is big enough, or an embedded one owned by the run
(`kimi_pipeline.cluster.lifecycle`), preflighted. Never cached: a cluster is live state."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kimi_pipeline.cluster.lifecycle import bring_up
from kimi_pipeline.recipes import Recipe
from kimi_pipeline.report.stage_reports import cluster_report
from kimi_pipeline.stages.runner import Stage, StageReport


def run(recipe: Recipe, run_dir: Path, timeout_s: float | None = None, owner_pid: int | None = None) -> dict[str, Any]:
    """`owner_pid` (default: this process) is watched: if it dies, the embedded cluster is torn down."""
    return bring_up(recipe, run_dir, timeout_s, os.getpid() if owner_pid is None else owner_pid)


CLUSTER = Stage(
    name="cluster",
    reads=("cluster", "parallel", "rollout", "model"),
    needs=(),
    outputs=(),
    report=StageReport(key="cluster-facts", render=cluster_report, title="Ray cluster of {recipe} ({mode})"),
)
