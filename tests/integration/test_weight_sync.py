"""The colocated weight sync at TP 2 x EP 2 x PP 2 (8 gloo ranks), with the code a GPU run takes up to the
handoff: every bucket assembled on every rank by group collectives (`weight_sync.buckets`), handed to the engine of
the rank's device (here two embedded engines, four ranks each, through shared memory; SGLang: CUDA IPC).

Under `TORCH_DISTRIBUTED_DEBUG=DETAIL` torch checks, before each collective, that every member of the group issues
the same collective with the same sizes (what NCCL needs and gloo forgives); a recorder of every torch.distributed
call on each rank proves there is no point-to-point, the collectives are those of the schedule's bound, and no rank
receives more than the model's bytes."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from support.common import random_tiny_hf
from support.megatron_worker import launch

from kimi_pipeline.engine.model import EngineModel
from kimi_pipeline.engine.rollout_engine import RolloutEngine
from kimi_pipeline.engine.server import EngineServer
from kimi_pipeline.recipes import load_recipe
from kimi_pipeline.recipes.layout import Layout
from kimi_pipeline.weight_sync.buckets import BucketSchedule

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out: 8 gloo ranks syncing three ways (~45 s)

LAYOUT = {"tp": 2, "ep": 2, "pp": 2}
BUFFER = 96 * 1024  # bytes: several buckets per stage, some with both dtypes (fp32 weights + the fp32 expert bias)


PATHS = {  # fixture name -> the sync it takes
    "colocated": {"colocate": True, "weight_sync": "auto"},  # each engine covers four ranks' devices; every rank
    # assembles every bucket
    "pp_stage_sources": {"colocate": False, "weight_sync": "auto"},  # each stage's source rank sends its stage
    # through its own weight-update group
    "from_disk": {"colocate": True, "weight_sync": "disk"},  # `rollout.weight_sync=disk`: each stage's source
    # writes its stage's shards, rank 0 the index, every engine loads the directory
}


@pytest.fixture(scope="module")
def synced(tmp_path_factory):
    """Per path, two embedded engines serving another model; then one launch of the 8 trainer ranks runs each
    path's sync to its own engines (one rank start for the three: ~4 CPU-s a rank). Read-only to the tests."""
    torch.set_num_threads(1)
    engines = {name: [EngineServer(RolloutEngine(EngineModel.from_hf_model(random_tiny_hf(0)), seed=i))
                      for i in range(2)] for name in PATHS}
    started = []
    out = tmp_path_factory.mktemp("weight-sync")
    try:
        for pair in engines.values():
            for e in pair:
                e.start()
                started.append(e)
        paths = {name: {**path, "urls": [e.url for e in engines[name]]} for name, path in PATHS.items()}
        ranks = launch("weight_sync", 8, out, {**LAYOUT, "buffer": BUFFER, "paths": paths}, timeout=900,
                       env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
        reference = load_file(str(out / "reference.safetensors"))
        yield {name: (engines[name], [r[name] for r in ranks], reference) for name in PATHS}
    finally:
        for e in started:
            e.stop()


@pytest.fixture(scope="module")
def colocated(synced):
    return synced["colocated"]


@pytest.fixture(scope="module")
def pp_stage_sources(synced):
    return synced["pp_stage_sources"]


@pytest.fixture(scope="module")
def from_disk(synced):
    return synced["from_disk"]


def _schedule() -> BucketSchedule:
    return BucketSchedule.build(load_recipe("tiny").model, Layout(world_size=8, **LAYOUT), buffer_bytes=BUFFER,
                            dtype=torch.float32, use_te=False)


@pytest.mark.parametrize("path", ["colocated", "pp_stage_sources", "from_disk"])
def test_every_engine_holds_every_hf_tensor_bit_exact_and_serves_the_trainers_logits(path, request):
    engines, _, reference = request.getfixturevalue(path)
    expected = EngineModel.from_hf_model(random_tiny_hf(0))
    expected.load_weights(reference.items())
    prompt = torch.arange(5, 17).unsqueeze(0)
    for e in engines:
        got = e.engine.model
        assert got.weight_names() == expected.weight_names()
        for name in expected.weight_names():
            assert torch.equal(got._params[name], expected._params[name]), name
        assert e.engine.weight_version == "synced"
        assert torch.equal(got.prefill(prompt, all_logits=True)[0], expected.prefill(prompt, all_logits=True)[0])
    before = EngineModel.from_hf_model(random_tiny_hf(0))
    assert any(not torch.equal(before._params[n], expected._params[n]) for n in expected.weight_names())


def test_collectives_are_the_plans_bound_with_no_point_to_point_and_no_rank_receives_the_model_twice(colocated):
    _, ranks, reference = colocated
    schedule = _schedule()
    model_bytes = sum(t.numel() * t.element_size() for t in reference.values())
    n_tensors = len(reference)
    assert len(schedule.buckets) >= 4 and len(schedule.buckets) < n_tensors
    bound = len(schedule.buckets) * 2 * 3 + 2  # buckets x dtypes x (pp, tp, ep) + the two barriers around them
    for r in ranks:
        assert r["debug_level"] == "DebugLevel.DETAIL"  # torch checked every collective's consistency
        calls = r["calls"]
        names = {c[0] for c in calls}
        assert names <= {"broadcast", "all_gather_into_tensor", "barrier"}, names  # no send / recv, no object ops
        assert len(calls) == r["metrics"]["sync_collectives"] <= bound
        assert len(calls) == sum(schedule.collectives().values()) + 2
        received = sum(c[2] for c in calls)
        assert received == r["metrics"]["sync_received_bytes"] == schedule.received_bytes(r["pp_rank"])
        assert received <= model_bytes, (received, model_bytes)
        assert r["model_bytes"] == model_bytes
    # the collectives do not grow with the tensor count: fewer than one per tensor, per group
    assert all(n < n_tensors for n in schedule.collectives().values())


def test_each_stage_sends_its_own_layers_from_its_source_alone_without_a_pipeline_broadcast(pp_stage_sources):
    _, ranks, reference = pp_stage_sources
    schedule = _schedule()
    sources = [r for r in ranks if r["source"]]
    assert [r["pp_rank"] for r in sources] == [0, 1]  # one per stage: TP = CP = DP = 0 of each
    stage_bytes = {s: sum(b.hf_bytes for b in schedule.pp_stage_buckets(s)) for s in (0, 1)}
    for r in ranks:
        names = {c[0] for c in r["calls"]}
        assert names <= {"all_gather_into_tensor", "barrier"}, names  # no pipeline broadcast, no point-to-point
        # each stage's HF bytes leave through its source only, once
        assert r["metrics"]["sync_sent_bytes"] == (stage_bytes[r["pp_rank"]] if r["source"] else 0)
        assert r["metrics"]["sync_received_bytes"] <= stage_bytes[r["pp_rank"]]
    assert sum(stage_bytes.values()) == sum(t.numel() * t.element_size() for t in reference.values())


def test_the_disk_fallback_is_written_by_each_stages_source_without_a_funnel(from_disk):
    _, ranks, _ = from_disk
    for r in ranks:
        names = {c[0] for c in r["calls"]}
        assert names <= {"all_gather_into_tensor", "barrier", "gather_object"}, names  # no broadcast to all, no p2p
        assert r["metrics"]["sync_received_bytes"] <= sum(b.hf_bytes for b in _schedule().pp_stage_buckets(
            r["pp_rank"]))
