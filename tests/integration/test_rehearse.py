"""`kimi rehearse` on a real, simulated 32 × 8-GPU Ray cluster (32 raylets on this host, GPUs as resources):
the seeds' three recipes place their trainer ranks and colocated SGLang engines without over-subscribing,
and stand-in actors with the real options land on the nodes the plan names (issue 14)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from kimi_pipeline.cluster.local import LocalCluster
from kimi_pipeline.recipes import load_recipe

pytestmark = pytest.mark.slow

KIMI = ("kimi-k2-instruct", "kimi-k2-thinking", "kimi-k2.5")


@pytest.fixture(scope="module")
def cluster_32x8(tmp_path_factory):
    from kimi_pipeline.rl.rehearse import simulated_cluster

    # owned by this test process: its watchdog stops the 32 nodes if the process dies before the teardown
    c = simulated_cluster(load_recipe("kimi-k2-instruct"), tmp_path_factory.mktemp("sim32"), owner_pid=os.getpid())
    yield c
    c.stop()


@pytest.mark.parametrize("name", KIMI)
def test_seed_recipe_launches_on_a_simulated_32x8_cluster(cluster_32x8, name, tmp_path):
    from kimi_pipeline.rl.rehearse import run_rehearsal

    d = run_rehearsal(load_recipe(name), tmp_path, address=cluster_32x8.address)
    assert d["ok"], d["problems"]
    assert d["cluster_nodes"] == 32 and d["gpus_available"] == 256 and d["gpus_requested"] == 256
    trainer_nodes = d["bundle_nodes"]["trainer"]
    assert sorted(trainer_nodes) == list(range(32))  # one bundle per node
    assert d["master_addr_node"] == trainer_nodes[d["ranks"][0]["node"]]
    observed = {o["actor"]: o for o in d["observed"]}
    assert {f"rank {r}" for r in range(8)} <= set(observed)  # every rank of the first node really started
    assert any(a.startswith("engine ") for a in observed)  # and the engine process(es) on that node
    assert observed["rollout manager"]["ray_gpu_ids"] == []  # on the driver's node, no GPU of the plan taken
    for o in d["observed"]:
        assert o["node"] == o["expected_node"], o
        if o["actor"] == "rollout manager":
            continue
        assert o["env"]["NCCL_TIMEOUT"] == "3600"
        # megatron's one CUDA connection for the trainer ranks only; never for an engine (SGLang's process starts
        # from a clean environment, `engine.sglang.sglang_env`)
        if o["actor"].startswith("rank "):
            assert o["env"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "1", o
        else:
            assert "CUDA_DEVICE_MAX_CONNECTIONS" not in o["env"], o
        assert "CUDA_VISIBLE_DEVICES" not in o["env"]  # colocated actors choose their own GPU
    assert re.fullmatch(r"\d+ distinct command\(s\) parsed by sglang 0\.5\.23's ServerArgs parser", d["sglang_parser"])
    md = (tmp_path / "launch-plan.md").read_text()
    assert "ok: **True**" in md and "## Engines" in md and "SGLang commands: " in md


def test_kimi_rehearse_cli_starts_and_stops_its_own_cluster(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kimi_pipeline.cli", "rehearse", "tiny", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=480)  # < the test limit
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    d = json.loads((tmp_path / "tiny" / "launch-plan.json").read_text())
    assert d["ok"] and d["cluster_nodes"] == 1 and [o["actor"] for o in d["observed"]] == ["rank 0", "engine 0 node 0",
                                                                                "rollout manager"]
    assert d["sglang_parser"] == "no SGLang commands (embedded engine)"
    state = json.loads((tmp_path / "tiny" / "rehearsal-cluster" / "cluster" / "state.json").read_text())
    assert state["stopped_at"] is not None  # nothing left running
    # a killed `kimi rehearse` leaves nothing either: its cluster's watchdog (the one `kimi run`'s kill tests prove,
    # test_reliability.py) watched the CLI's process, and went with the cluster
    assert state["owner_pid"] is not None and state["watchdog_pid"] is not None, state
    left = LocalCluster.load(tmp_path / "tiny" / "rehearsal-cluster").processes()  # by the marker the watchdog carries
    assert left == [], [" ".join(p.cmdline()) for p in left]
