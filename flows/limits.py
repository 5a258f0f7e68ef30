"""One run per Ray cluster: a Prefect global concurrency limit named after the cluster.

The deployment's own `concurrency_limit: 1` keeps two runs of `kimi/full` apart; this limit also keeps
apart runs of different deployments (or parameters) that point at the same cluster. It is held from
the cluster stage until the run's cluster is torn down. The limit must exist on the server
(`kimi serve` and infra/prefect/setup.sh create it); without it (e.g. `kimi run`'s ephemeral API) the
flow runs unguarded and says so once in its log.
"""

from __future__ import annotations

import contextlib
import re
import socket
from collections.abc import Iterator

from kimi_pipeline.recipes import Recipe

PREFIX = "kimi-cluster-"


def cluster_limit_name(recipe: Recipe) -> str:
    """`kimi-cluster-local` for a run's embedded cluster (this host), else the cluster address, slugged."""
    address = (recipe.cluster.address or "").strip()
    key = address if address and address != "auto" else "local"
    return PREFIX + re.sub(r"[^A-Za-z0-9_.-]+", "-", key).strip("-")


def ensure_cluster_limit(name: str = PREFIX + "local", limit: int = 1) -> None:
    """Create (or reset to `limit`) the global concurrency limit `name` on the current Prefect API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=limit))
            return
        client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(limit=limit, active=True))


def _limit_exists(name: str) -> bool:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
            return True
        except ObjectNotFound:
            return False


@contextlib.contextmanager
def cluster_slot(recipe: Recipe) -> Iterator[str | None]:
    """Hold the cluster's slot for the block (waits while another run holds it)."""
    from prefect.concurrency.sync import concurrency
    from prefect.logging import get_run_logger

    name = cluster_limit_name(recipe)
    log = get_run_logger()
    if not _limit_exists(name):
        log.info("no concurrency limit %r on this Prefect API: runs sharing this cluster are not serialized "
                 "(`kimi serve` / infra/prefect/setup.sh create it)", name)
        yield None
        return
    log.info("waiting for concurrency slot %r (one run per cluster; host %s)", name, socket.gethostname())
    with concurrency(name, occupy=1, strict=True):
        log.info("holding concurrency slot %r", name)
        yield name
