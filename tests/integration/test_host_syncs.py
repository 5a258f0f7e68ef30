"""Issue 42 item 1: a training micro-batch never makes the host wait for the device beyond what megatron requires
(model/host_syncs.py lists those, with megatron's file:line). The recorder is checked on planted syncs first."""

from __future__ import annotations

import torch

from kimi_pipeline.model.host_syncs import HostSyncRecorder
from support.common import one_grpo_step


def test_the_recorder_sees_each_kind_of_host_read_once_and_names_the_line():
    x, mask = torch.arange(6.0), torch.tensor([True, False] * 3)
    recorder = HostSyncRecorder()
    with recorder.recording():
        x.sum().item()  # Tensor.item (its aten._local_scalar_dense is not counted again)
        x[mask]  # boolean-mask indexing: the result size is read back
        torch.equal(x, x)
        bool(x[0] > 1)
        x.nonzero()
        x.tolist()
        x.to("cpu", non_blocking=True)  # already on the host, and a non-blocking copy waits for nothing
        torch.where(mask, x, 0.0).amax()  # device-side: no read
    ops = [s.op for s in recorder.syncs]
    assert ops == ["Tensor.item", "index with a boolean mask", "torch.equal", "Tensor.__bool__", "Tensor.nonzero",
                   "Tensor.tolist"], recorder.summary()
    assert all(__file__ in s.where for s in recorder.syncs) and recorder.ours() == recorder.syncs


def test_a_grpo_step_of_the_trainer_waits_only_where_megatron_must(monkeypatch):
    """PolicyWorker.train on tiny, every loss term on (TIS, KL against the reference model, entropy): the
    micro-batches' forward_backward records none of ours, and megatron's MoE dispatcher waits once per MoE layer
    and micro-batch."""
    from kimi_pipeline.recipes import load_recipe
    from kimi_pipeline.rl import policy as policy_module

    recipe = load_recipe("tiny", ["grpo.use_tis=true", "grpo.use_kl_loss=true", "grpo.kl_loss_coef=0.01",
                                  "grpo.entropy_coef=0.001", "rollout.num_steps_per_rollout=1",
                                  "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4"])
    recorder, micro_batches = HostSyncRecorder(), []
    real = policy_module.forward_backward

    def recorded(model, batches, loss_fn, **kwargs):
        micro_batches.append(len(batches))
        with recorder.recording():
            return real(model, batches, loss_fn, **kwargs)

    monkeypatch.setattr(policy_module, "forward_backward", recorded)
    metrics = one_grpo_step(recipe)
    assert metrics["optimizer_steps"] == 1 and {"kl", "entropy", "tis_mean", "tis_max"} <= set(metrics)
    assert recorder.ours() == [], recorder.summary()
    moe_layers = recipe.model.num_layers - recipe.model.first_k_dense
    events = [s for s in recorder.megatron() if s.op == "cuda.Event.synchronize"]
    assert len(events) == moe_layers * sum(micro_batches) > 0, recorder.summary()
