"""KubeRay RayCluster manifests generated from a recipe, so the cluster never drifts from it.

One pod per node, the head included (as in the seeds, the head is also a training node with its
GPUs): 32 × 8 GPUs = a head + 31 workers, every pod `nvidia.com/gpu: 8`. Token auth via KubeRay's
`authOptions` (KubeRay >= 1.5.1 creates the token Secret and sets RAY_AUTH_MODE / RAY_AUTH_TOKEN on
every container), usage stats off, a shared ReadWriteMany volume at BASE_DIR, /dev/shm in memory for
the object store. Shipped manifests live in infra/kuberay/<recipe>.yaml; `check_manifests` compares
them with a fresh rendering.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from pathlib import Path
from typing import Any

import yaml

from kimi_pipeline.recipes import load_recipe, preset_names
from kimi_pipeline.recipes.models import ClusterSpec
from kimi_pipeline.util.files import atomic_write_text
from kimi_pipeline.util.paths import PROJECT_ROOT

MANIFEST_DIR = PROJECT_ROOT / "infra" / "kuberay"
SHARED_MOUNT = "/shared"
SHARED_CLAIM = "kimi-shared"


def _version(dist: str, fallback: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return fallback


def default_image() -> str:
    return f"kimi-pipeline:{_version('kimi-pipeline', '0.1.0')}"


def k8s_name(recipe_name: str) -> str:
    """RFC 1123 label: lowercase alphanumerics and '-', <= 63 chars (kimi-k2.5 -> kimi-k2-5)."""
    name = re.sub(r"[^a-z0-9-]+", "-", recipe_name.lower()).strip("-")
    return (name if name.startswith("kimi") else f"kimi-{name}")[:63].rstrip("-")


def _container(role: str, image: str, recipe_name: str, cluster: ClusterSpec) -> dict[str, Any]:
    limits: dict[str, Any] = {}
    if cluster.device == "cuda":
        limits["nvidia.com/gpu"] = cluster.gpus_per_node
    if cluster.cpus_per_node:
        limits["cpu"] = cluster.cpus_per_node
    if cluster.memory_gb_per_node:
        limits["memory"] = f"{int(cluster.memory_gb_per_node)}Gi"
    container: dict[str, Any] = {
        "name": f"ray-{role}",
        "image": image,
        "env": [
            {"name": "BASE_DIR", "value": SHARED_MOUNT},
            {"name": "RAY_USAGE_STATS_ENABLED", "value": "0"},
            {"name": "KIMI_RECIPE", "value": recipe_name},
        ],
        "resources": {"limits": dict(limits), "requests": dict(limits)},
        "volumeMounts": [{"name": "shared", "mountPath": SHARED_MOUNT}, {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if role == "head":
        container["ports"] = [
            {"containerPort": 6379, "name": "gcs-server"},
            {"containerPort": 8265, "name": "dashboard"},
            {"containerPort": 10001, "name": "client"},
        ]
    return container


def _pod(role: str, image: str, recipe_name: str, cluster: ClusterSpec) -> dict[str, Any]:
    return {
        "spec": {
            "containers": [_container(role, image, recipe_name, cluster)],
            "volumes": [
                {"name": "shared", "persistentVolumeClaim": {"claimName": SHARED_CLAIM}},
                {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            ],
        }
    }


def render_manifest(recipe, image: str | None = None) -> str:
    """The RayCluster YAML for `recipe` (deterministic: same recipe + versions -> same bytes)."""
    cluster = recipe.cluster
    image = image or default_image()
    start: dict[str, str] = {"num-gpus": str(cluster.gpus_per_node if cluster.device == "cuda" else 0)}
    if cluster.cpus_per_node:
        start["num-cpus"] = str(cluster.cpus_per_node)
    workers = cluster.nodes - 1
    doc: dict[str, Any] = {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {
            "name": k8s_name(recipe.name),
            "labels": {"app.kubernetes.io/name": "kimi-pipeline", "kimi-pipeline/recipe": k8s_name(recipe.name)},
            "annotations": {
                "kimi-pipeline/recipe": recipe.name,
                "kimi-pipeline/layout": f"{cluster.nodes} nodes x {cluster.gpus_per_node} {cluster.device}, colocate={cluster.colocate}",
            },
        },
        "spec": {
            "rayVersion": _version("ray", "2.60.0"),
            "authOptions": {"mode": "token"},
            "headGroupSpec": {"rayStartParams": dict(start), "template": _pod("head", image, recipe.name, cluster)},
            "workerGroupSpecs": [],
        },
    }
    if workers:
        doc["spec"]["workerGroupSpecs"].append(
            {
                "groupName": "nodes",
                "replicas": workers,
                "minReplicas": workers,
                "maxReplicas": workers,
                "rayStartParams": dict(start),
                "template": _pod("worker", image, recipe.name, cluster),
            }
        )
    header = (
        f"# RayCluster for recipe {recipe.name}: {cluster.nodes} pods (head + {workers} workers) x "
        f"{cluster.gpus_per_node} {'GPUs' if cluster.device == 'cuda' else 'ranks'}.\n"
        f"# Generated by `kimi cluster manifest --recipe {recipe.name} --write`; do not edit by hand.\n"
        f"# CI checks it against the recipe (`kimi cluster manifest --recipe {recipe.name} --check`).\n"
        f"# Needs KubeRay >= 1.5.1 (authOptions) and a ReadWriteMany PVC named {SHARED_CLAIM}. "
        "The image: `make images`\n"
        f"# builds {default_image()} (infra/docker); push it and regenerate with --image <registry>/<name:tag>.\n"
        f"# Then: set cluster.address to the head service, port 6379.\n"
    )
    return header + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=120)


def manifest_path(recipe_name: str, directory: Path = MANIFEST_DIR) -> Path:
    return Path(directory) / f"{recipe_name}.yaml"


def manifest_presets() -> list[str]:
    """Presets that get a shipped manifest: the GPU ones."""

    return [n for n in preset_names() if load_recipe(n, check=False).cluster.device == "cuda"]


def check_manifest(recipe, path: Path | None = None, image: str | None = None) -> str | None:
    """None when `path` matches a fresh rendering; else a one-line reason."""
    path = path or manifest_path(recipe.name)
    if not path.is_file():
        return f"{path} is missing: run `kimi cluster manifest --recipe {recipe.name} --write`"
    if path.read_text() != render_manifest(recipe, image):
        return f"{path} differs from recipe {recipe.name}: run `kimi cluster manifest --recipe {recipe.name} --write`"
    return None


def write_manifest(recipe, directory: Path = MANIFEST_DIR, image: str | None = None) -> Path:

    path = atomic_write_text(manifest_path(recipe.name, directory), render_manifest(recipe, image))
    os.chmod(path, 0o644)  # a tracked file, not a secret
    return path
