"""Task `cluster`: not cached (a cluster is live state, a cached address may point at nothing);
retried on transient failures (start-up races, a head not reachable yet); facts as a markdown artifact,
and the preflight's table (also, above all, when a check failed).

The embedded cluster outlives this task on purpose: the flow tears it down in its `finally` with
`kimi_pipeline.cluster.stop_cluster(run_dir)`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from kimi_pipeline.cluster.lifecycle import PREFLIGHT_MD
from kimi_pipeline.recipes import Recipe
from kimi_pipeline.stages import CLUSTER, cluster
from tasks.common import RETRY_DELAYS, markdown_artifact, retry_unless_permanent, stage_task


@task(
    name="cluster",
    retries=2,
    retry_delay_seconds=RETRY_DELAYS,
    retry_jitter_factor=0.2,
    retry_condition_fn=retry_unless_permanent,
    cache_policy=NO_CACHE,
    persist_result=False,
)
def cluster_task(recipe: Recipe, run_dir: str, timeout_s: float | None = None) -> dict[str, Any]:
    # The owner is the flow process (tasks run in its threads): if it dies, the watchdog cleans up.
    try:
        with stage_task(CLUSTER, recipe, run_dir) as record:
            return record(cluster.run(recipe, Path(run_dir), timeout_s=timeout_s, owner_pid=os.getpid()))
    finally:
        report = Path(run_dir) / "cluster" / PREFLIGHT_MD
        if report.is_file():
            markdown_artifact(report.read_text(), "cluster-preflight", f"preflight of the Ray cluster of {recipe.name}")
