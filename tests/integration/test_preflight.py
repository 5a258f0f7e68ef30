"""`kimi preflight` against a simulated 4-node Ray cluster (raylets on this host) with a fault planted in three of
the nodes' own environments, as a real cluster has them:

- node 1 sees another megatron-core (its Python path holds a different install first);
- node 2's process groups look for a network interface it does not have (GLOO_SOCKET_IFNAME), so its ranks never
  join the collective;
- node 3 has a node-local disk where base_dir should be shared (its raylet runs in its own mount namespace, a fresh
  tmpfs mounted over base_dir).

The CLI exits 1 and names each fault with its node; the healthy head is named by none; it ends within the timeout,
not after a hang. The cluster stage's fast preflight on a healthy cluster passes (`test_cluster.py`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.common import ROOT

# `make test-fast` leaves it out: a simulated multi-node Ray cluster per module (~50 s to start)
pytestmark = pytest.mark.slow

UNSHARE = ["unshare", "--user", "--map-root-user", "--mount"]


def _namespaces_work(base: Path) -> bool:
    """Can this host give a process its own mount namespace (user namespaces allowed)?"""
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run([*UNSHARE, "sh", "-c", f"mount -t tmpfs tmpfs {base} && test ! -e {base}/marker"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.fixture(scope="module")
def faulty_cluster(tmp_path_factory):
    """(address, cluster env, base_dir, {fault: node id}, node-local fault planted?)."""
    import ray

    from kimi_pipeline.cluster.env import auth_mode, ensure_token
    from kimi_pipeline.cluster.lifecycle import export_driver_env
    from kimi_pipeline.cluster.local import LocalCluster, NodeSpec

    root = tmp_path_factory.mktemp("preflight")
    base = root / "shared"
    base.mkdir()
    (base / "marker").write_text("the shared filesystem")
    fake = root / "other-megatron"  # an older megatron-core install, first on that node's path
    (fake / "megatron_core-0.15.0.dist-info").mkdir(parents=True)
    (fake / "megatron_core-0.15.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: megatron-core\nVersion: 0.15.0\n")
    local_ok = _namespaces_work(base)
    pythonpath = os.pathsep.join(p for p in sys.path if p)
    if auth_mode() == "token":
        ensure_token()  # as the cluster stage does before it starts a cluster
    cluster = LocalCluster.start(root / "run", NodeSpec(num_cpus=2, num_gpus=0), loopback=False)  # nodes join later
    faults: dict[str, str] = {}
    try:
        env = {**cluster.env}
        export_driver_env(env["RAY_AUTH_MODE"])
        ray.init(address=cluster.address, log_to_driver=False)

        def node_ids() -> set[str]:
            return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}

        plants = [("version", {"PYTHONPATH": f"{fake}{os.pathsep}{pythonpath}"}, None),
                  ("collective", {"GLOO_SOCKET_IFNAME": "kimi-missing0"}, None),
                  ("storage", {}, [*UNSHARE, "sh", "-c", f'mount -t tmpfs tmpfs "{base}" && exec "$@"', "sh"]
                   if local_ok else None)]
        for i, (fault, extra, prefix) in enumerate(plants, start=1):
            before = node_ids()
            cluster._start_worker(NodeSpec(num_cpus=1, num_gpus=0), i, 120, env_extra=extra, prefix=prefix)
            deadline = time.monotonic() + 60
            while not (node_ids() - before) and time.monotonic() < deadline:
                time.sleep(0.2)
            faults[fault] = (node_ids() - before).pop()
        ray.shutdown()
        yield cluster.address, env, base, faults, local_ok
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.stop()


@pytest.fixture(scope="module")
def report(faulty_cluster, tmp_path_factory):
    """`kimi preflight tiny` on the 4 nodes (one trainer rank each), as a user runs it: (exit code, report, seconds)."""
    address, env, base, _, _ = faulty_cluster
    out = tmp_path_factory.mktemp("report")
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "kimi_pipeline.cli", "preflight", "tiny", "--set", "cluster.nodes=4",
         "--set", "cluster.gpus_per_node=1", "--set", f"paths.base_dir={base}", "--ray-address", address,
         "--timeout", "120", "--join-timeout", "20", "--json", "--out", str(out)],
        cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
    seconds = time.monotonic() - t0
    assert proc.stdout.strip(), proc.stderr[-3000:]
    rep = json.loads(proc.stdout)
    assert json.loads((out / "preflight.json").read_text()) == rep and (out / "preflight.md").is_file()
    return proc.returncode, rep, proc.stderr, seconds


def _failed(rep: dict, name: str) -> dict:
    return next(c for c in rep["checks"] if c["name"] == name and not c["ok"])


def _labels(rep: dict, node_id: str) -> str:
    return next(n["label"] for n in rep["nodes"] if n["label"].endswith(node_id[:8]))


def test_preflight_names_the_node_with_another_package_version(faulty_cluster, report):
    rc, rep, stderr, _ = report
    faults = faulty_cluster[3]
    assert rc == 1 and not rep["ok"]
    check = _failed(rep, "software: megatron-core")
    assert check["nodes"] == [_labels(rep, faults["version"])], check
    assert "0.15.0" in check["detail"] and "install the same versions" in check["fix"]
    assert "FAILED software: megatron-core" in stderr


def test_preflight_names_the_node_that_never_joins_the_collective_within_the_timeout(faulty_cluster, report):
    rc, rep, stderr, seconds = report
    faults = faulty_cluster[3]
    check = _failed(rep, "collective")
    assert check["nodes"] == [_labels(rep, faults["collective"])], check["detail"]
    assert "did not join within 20 s" in check["detail"] and "GLOO_SOCKET_IFNAME" in check["fix"]
    assert seconds < 300, seconds  # a bounded wait, not a hang (20 s rendezvous timeout + start-up on 2 cores)


def test_preflight_names_the_node_whose_base_dir_is_node_local(faulty_cluster, report):
    rc, rep, _, _ = report
    faults, local_ok = faulty_cluster[3], faulty_cluster[4]
    if not local_ok:
        pytest.skip("this host cannot give a process its own mount namespace (unshare --user --mount refused)")
    check = _failed(rep, "base_dir: shared")
    assert check["nodes"] == [_labels(rep, faults["storage"])], check
    assert "must be one shared filesystem" in check["fix"]
    ok = {c["name"] for c in rep["checks"] if c["ok"]}
    assert {"nodes", "software: python", "software: torch", "software: kimi-pipeline", "ports between nodes"} <= ok
    head = next(n["label"] for n in rep["nodes"] if n["label"].split("/")[1] not in {f[:8] for f in faults.values()})
    assert not any(head in c["nodes"] for c in rep["checks"])  # the healthy head is never blamed
