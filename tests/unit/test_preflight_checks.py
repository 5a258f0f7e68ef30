"""The preflight's per-node verdicts (`cluster/preflight.py` check_nodes) from node facts as probes report them, on
the GPU layout of a real preset: each fault names its node and only its node."""

from __future__ import annotations

import copy

from kimi_pipeline.cluster.preflight import Node, check_nodes, collective_cause, plan_gpu
from kimi_pipeline.recipes import load_recipe

SOFTWARE = {"python": "3.12.3", "torch": "2.14.1+cu130", "megatron-core": "0.16.1", "transformer-engine": "2.20.2",
            "sglang": "0.5.23", "kimi-pipeline": "0.1.0+0123456789ab"}
H200 = {"name": "NVIDIA H200", "memory_gib": 140.4}


def _facts() -> dict:
    return {"software": dict(SOFTWARE), "cuda": "13.0", "driver": "580.159.04", "gpus": [dict(H200) for _ in range(8)],
            "ram_gib": 2015.0, "shm_gib": 1007.0}


def _nodes(n: int) -> list[Node]:
    return [Node(f"10.0.0.{i}/abcd{i:04d}", f"abcd{i:04d}" + "0" * 48, f"10.0.0.{i}", facts=_facts()) for i in range(n)]


def _failed(checks) -> dict[str, list[str]]:
    return {c.name: c.nodes for c in checks if not c.ok}


def test_a_healthy_gpu_cluster_passes_and_each_fault_names_its_node():
    r = load_recipe("kimi-k2-thinking")
    nodes = _nodes(r.cluster.nodes)
    assert _failed(check_nodes(r, nodes, [])) == {}
    bad = copy.deepcopy(nodes)
    bad[3].facts["software"]["megatron-core"] = "0.15.0"
    bad[5].facts["gpus"] = bad[5].facts["gpus"][:7]  # one GPU lost
    bad[7].facts["driver"] = "570.86.15"
    bad[9].facts["shm_gib"] = 0.06  # docker's default 64 MB
    bad[11].facts["ram_gib"] = 512.0
    assert _failed(check_nodes(r, bad, ["10.0.0.30/abcd0030: no answer within 120 s"])) == {
        "nodes": ["10.0.0.30/abcd0030"],
        "software: megatron-core": ["10.0.0.3/abcd0003"],
        "gpus: count": ["10.0.0.5/abcd0005"],
        "gpus: driver": ["10.0.0.7/abcd0007"],
        "/dev/shm": ["10.0.0.9/abcd0009"],
        "host RAM": ["10.0.0.11/abcd0011"],
    }


def test_a_layout_that_does_not_fit_the_nodes_gpu_fails_on_every_node():
    r = load_recipe("kimi-k2-instruct")  # its SGLang FP8 weights do not fit an H100's static budget (kimi plan)
    nodes = _nodes(r.cluster.nodes)
    for n in nodes:
        n.facts["gpus"] = [{"name": "NVIDIA H100 80GB HBM3", "memory_gib": 79.6} for _ in range(8)]
    memory = next(c for c in check_nodes(r, nodes, []) if c.name == "gpus: memory")
    assert plan_gpu("NVIDIA H100 80GB HBM3") == "h100" and not memory.ok and len(memory.nodes) == r.cluster.nodes
    assert "kimi plan on h100" in memory.detail and "no room for a KV cache" in memory.detail, memory.detail


def test_the_collective_blames_the_node_whose_rank_failed_not_the_ranks_that_lost_it():
    """The errors measured on the simulated cluster: one node's rank cannot bind its interface; the other nodes' ranks
    see their connections cut (when the failed rank held the store) or time out: only the first node is named."""
    lost = {"ok": False, "error": "DistNetworkError: Failed to recv, got 0 bytes. Connection was likely closed. Did "
                                  "the remote server shutdown or crash?"}
    timed_out = {"ok": False, "error": "DistStoreError: Timed out after 21 seconds waiting for clients. 3/4 clients"}
    bad = {"ok": False, "error": "RuntimeError: [enforce fail at device.cc:84] ifa != nullptr. Unable to find address "
                                 "for: kimi-missing0"}
    assert collective_cause({"head": [lost], "n1": [bad], "n2": [timed_out], "n3": [lost], "n4": []}) == ["n1"]
    refused = {"ok": False, "error": "DistNetworkError: The client socket has failed to connect: Connection refused"}
    assert collective_cause({"head": [timed_out], "n1": [refused]}) == ["n1"]  # cannot reach the store: its own fault
    assert collective_cause({"head": [timed_out], "n1": [lost]}) == ["head", "n1"]  # nothing tells which: both
    assert collective_cause({"head": [], "n1": []}) == []


def test_a_node_local_base_dir_is_blamed_whether_or_not_it_wrote_the_probe_file():
    """The suite once blamed the three healthy nodes: Ray listed the node with the node-local base_dir first, so it
    wrote the file only it could read."""
    from kimi_pipeline.cluster.preflight import storage_blame

    assert storage_blame("a", ["b", "c", "d"], ["c"]) == ["c"]  # a reader that did not see it
    assert storage_blame("a", ["b", "c", "d"], ["b", "c", "d"]) == ["a"]  # no one saw the writer's file
    assert storage_blame("a", ["b"], ["b"]) == ["b"]  # two nodes: either could be the one; the reader is named
    assert storage_blame("a", ["b", "c"], []) == []
