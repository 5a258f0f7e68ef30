"""Ray cluster bring-up: embedded head (+ simulated nodes), existing clusters, health, placement, infra.

Importing this package does not import Ray (the CLI stays fast); Ray is imported where it is used.
"""

from kimi_pipeline.cluster.errors import (
    ClusterConfigError,
    ClusterError,
    ClusterHealthError,
    LocalClusterTooSmall,
    PlacementError,
)
from kimi_pipeline.cluster.health import ClusterFacts, NodeFacts, Requirements, read_facts, wait_until_healthy
from kimi_pipeline.cluster.local import LocalCluster, NodeSpec
from kimi_pipeline.cluster.placement import (
    PlacementPlan,
    GroupSpec,
    bundle_nodes,
    create_group,
    create_placement_groups,
    plan_placement,
    remove_placement_groups,
)
from kimi_pipeline.cluster.stage import cluster_session, stage_cluster, stop_cluster

__all__ = [
    "ClusterConfigError",
    "ClusterError",
    "ClusterFacts",
    "ClusterHealthError",
    "GroupSpec",
    "LocalCluster",
    "LocalClusterTooSmall",
    "NodeFacts",
    "NodeSpec",
    "PlacementError",
    "PlacementPlan",
    "Requirements",
    "bundle_nodes",
    "cluster_session",
    "create_group",
    "create_placement_groups",
    "plan_placement",
    "read_facts",
    "remove_placement_groups",
    "stage_cluster",
    "stop_cluster",
    "wait_until_healthy",
]
