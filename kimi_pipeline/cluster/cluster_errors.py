"""Cluster errors: which ones a retry can fix (a node still joining) and which it cannot (a recipe the
cluster can never satisfy)."""

from __future__ import annotations

from kimi_pipeline.errors import PermanentError


class ClusterError(RuntimeError):
    """Transient cluster trouble (start-up race, unreachable head): retrying may help."""


class RayStartTimedOut(ClusterError):
    """`ray start` gave up waiting for its raylet to register (Ray's fixed 30 s, ray/_private/node.py:428): a host
    too loaded at that moment, or a port another process took meanwhile."""


class ClusterConfigError(PermanentError):
    """The request cannot be met as configured (e.g. 32 GPU nodes from an embedded CPU head)."""


class ClusterHealthError(ClusterError):
    """The cluster did not reach the recipe's size in time; `missing` lists each shortfall."""

    def __init__(self, message: str, missing: list[str]):
        super().__init__(message)
        self.missing = missing


class PlacementError(PermanentError):
    """A placement group cannot be placed on this cluster (reported instead of waiting forever)."""


class LocalClusterTooSmall(ClusterHealthError, PermanentError):
    """This machine cannot host what the recipe asks of an embedded cluster: retrying cannot help."""


class PreflightError(ClusterConfigError):
    """A preflight check failed on the cluster (the message names each check, its nodes and the fix): a retry on the
    same cluster fails the same way."""
