"""One device per process, decided in one place and passed down (kimi_pipeline/model/device.py): the rules that
pick it, and the GPU-path decisions that hang on it, checked on the CPU."""

from __future__ import annotations

import datetime
import re
from pathlib import Path

import pytest
import torch

from kimi_pipeline.model import device as dev
from kimi_pipeline.model import parallel
from kimi_pipeline.model.megatron_train import optimizer_placement
from kimi_pipeline.recipes import load_recipe
from kimi_pipeline.rl.actor_layout import lay_out_actors
from kimi_pipeline.rl.policy import flex_dispatcher_refusal
from kimi_pipeline.rl.samples import Sample, collate

PACKAGE = Path(__file__).resolve().parents[2] / "kimi_pipeline"
CPU = torch.device("cpu")


def test_only_the_device_module_asks_torch_whether_cuda_exists():
    found = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                   if re.search(r"torch\.cuda\.is_available\(\)", p.read_text()))
    assert found == ["model/device.py"]


def test_cpu_is_cpu_and_cuda_without_a_gpu_names_the_recipe_field():
    assert dev.resolve_device("cpu") == CPU
    with pytest.raises(dev.DeviceError, match="cluster.device='tpu'"):
        dev.resolve_device("tpu")
    if dev.cuda_device_count():  # a GPU machine running the CPU suite
        assert dev.resolve_device("cuda").type == "cuda"
        with pytest.raises(dev.DeviceError, match="one rank per GPU"):
            dev.resolve_device("cuda", dev.cuda_device_count())
    else:
        with pytest.raises(dev.DeviceError, match="cluster.device=cuda but this process sees no GPU.*cluster.device=cpu"):
            dev.resolve_device("cuda")


def test_an_actor_uses_its_planned_gpu_only_when_it_picks_its_own(monkeypatch):
    """Not colocated, Ray makes exactly the actor's GPU visible: index 0 for every rank, whatever its local rank
    (rank 5 of a node asking for GPU 5 of one visible GPU was the old failure). Colocated, all GPUs are visible."""
    monkeypatch.delenv(dev.NOSET_VISIBLE_DEVICES, raising=False)
    assert [dev.actor_gpu_index(g) for g in range(8)] == [0] * 8
    monkeypatch.setenv(dev.NOSET_VISIBLE_DEVICES, "1")
    assert [dev.actor_gpu_index(g) for g in range(8)] == list(range(8))


def test_a_weight_job_moved_to_the_cpu_by_its_launcher_runs_there(monkeypatch):
    monkeypatch.setenv(dev.JOB_DEVICE_ENV, "cpu")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert dev.job_device("cuda") == CPU
    monkeypatch.delenv(dev.JOB_DEVICE_ENV)
    assert dev.job_device("cpu") == CPU


def test_the_seeds_nccl_timeout_reaches_init_process_group_and_megatron(monkeypatch):
    """NCCL_TIMEOUT (seconds) is read by no library: it must arrive as the process group's timeout."""
    seen: dict = {}
    real_init = torch.distributed.init_process_group

    def init_process_group(*args, **kwargs):
        seen["torch"] = kwargs["timeout"]
        return real_init(*args, **kwargs)

    from megatron.core import parallel_state

    real_mp = parallel_state.initialize_model_parallel

    def initialize_model_parallel(*args, **kwargs):
        seen["megatron_minutes"] = kwargs["distributed_timeout_minutes"]
        return real_mp(*args, **kwargs)

    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    monkeypatch.setattr(parallel_state, "initialize_model_parallel", initialize_model_parallel)
    monkeypatch.setenv("NCCL_TIMEOUT", "3600")
    parallel.destroy()  # an earlier test's group would skip init_process_group
    try:
        parallel.init_distributed(parallel.Layout(), device=CPU)
    finally:
        parallel.destroy()
    assert seen == {"torch": datetime.timedelta(seconds=3600), "megatron_minutes": 60}
    monkeypatch.setenv("NCCL_TIMEOUT", "1h")
    with pytest.raises(parallel.LayoutError, match="NCCL_TIMEOUT='1h': expected whole seconds"):
        parallel.process_group_timeout()
    monkeypatch.delenv("NCCL_TIMEOUT")
    assert parallel.process_group_timeout() == datetime.timedelta(minutes=30)


def test_flex_dispatcher_only_where_megatron_can_run_it():
    gpu = torch.device("cuda", 0)
    assert flex_dispatcher_refusal(8 * 32, gpu, have_deep_ep=True) is None
    assert "TP x EP = 1" in flex_dispatcher_refusal(1, gpu, have_deep_ep=True)
    assert "not installed" in flex_dispatcher_refusal(8, gpu, have_deep_ep=False)
    assert "needs a GPU" in flex_dispatcher_refusal(8, CPU, have_deep_ep=True)


def test_optimizer_offload_moves_all_state_to_the_host_on_a_gpu():
    """megatron's hybrid optimizer offloads `optimizer_offload_fraction` (default 0.0: nothing) of the GPU
    parameters; `kimi plan` counts all optimizer state as host memory, so the fraction must be 1.0."""
    opt = load_recipe("kimi-k2-thinking").optimizer
    assert opt.optimizer_cpu_offload and opt.use_precision_aware_optimizer
    on_gpu = optimizer_placement(opt, torch.device("cuda", 0), te=True)
    assert on_gpu == {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0,
                      "overlap_cpu_optimizer_d2h_h2d": True, "use_precision_aware_optimizer": True}
    assert optimizer_placement(opt, torch.device("cuda", 0), te=False)["use_precision_aware_optimizer"] is False
    on_cpu = optimizer_placement(opt, CPU, te=False)  # the tensors are already on the host
    assert on_cpu["optimizer_cpu_offload"] is False and on_cpu["optimizer_offload_fraction"] == 0.0


def test_a_micro_batch_moves_to_the_trainer_device_whole():
    """Every tensor the loss reads moves at the collate boundary: the meta device stands in for a GPU (a stray
    host tensor would stay on 'cpu')."""
    s = Sample(prompt_ids=[1, 2, 3], response_ids=[4, 5], rollout_logprobs=[-0.1, -0.2], reward=1.0, advantage=0.5,
               routed_experts=[[[0, 1]], [[1, 0]], [[0, 1]], [[1, 0]]])
    mb = collate([s], [0], pad_id=0).to(torch.device("meta"))
    tensors = {k: v for k, v in vars(mb).items() if torch.is_tensor(v)}
    assert set(tensors) == {"tokens", "targets", "mask", "rollout_logprobs", "advantages", "routed_experts"}
    assert {t.device.type for t in tensors.values()} == {"meta"}


def test_embedded_engines_on_gpus_get_their_own_gpu():
    """Colocated embedded engines each take the first GPU of the share they were placed on, never all GPU 0."""
    r = load_recipe("tiny", ["cluster.device=cuda", "cluster.gpus_per_node=4", "cluster.nodes=1",
                             "cluster.colocate=true", "rollout.engine=embedded", "sglang.gpus_per_engine=2"])
    plan = lay_out_actors(r)
    nodes = [n for e in plan.engines for n in e.nodes]
    assert [n.base_gpu_id for n in nodes] == [0, 2]
    assert [n.gpus for n in nodes] == [(0,), (2,)]
