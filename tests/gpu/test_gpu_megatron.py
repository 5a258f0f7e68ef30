"""megatron-core on one GPU, the device passed explicitly: the trainer's bf16 model with fp32 main grads and fp32
main params, every tensor on the GPU, loss falling on a fixed batch; torch_dist save -> resume -> the identical
next step. The GPU twins of tests/integration/test_megatron_model.py's one-process tests."""

from __future__ import annotations

import pytest
from support.common import fixed_batch, nll
from support.gpu import deterministic_kernels, off_device

pytestmark = pytest.mark.gpu


def _bf16():
    """The tiny recipe on CUDA with bf16 parameters (what GPU recipes train in; the tiny preset is fp32)."""
    from kimi_pipeline.recipes import load_recipe

    r = load_recipe("tiny", ["cluster.device=cuda"])
    return r, r.model.model_copy(update={"params_dtype": "bfloat16"})


def _main_params(optimizer):
    """The fp32 copies megatron's (distributed) optimizer steps on, dense and expert parts."""
    return [p for part in getattr(optimizer, "chained_optimizers", [optimizer])
            for group in part.optimizer.param_groups for p in group["params"]]


def test_bf16_trainer_lives_on_the_gpu_and_its_loss_falls(cuda, one_gpu_rank):
    import torch

    from kimi_pipeline.model import megatron_train as mt
    from kimi_pipeline.model.megatron_model import unwrap

    r, spec = _bf16()
    chunks, opt = mt.build_trainable(spec, one_gpu_rank, r.optimizer, device=cuda)
    assert off_device(chunks[0], cuda) == []  # DDP(Float16Module(GPTModel)): every parameter and buffer
    model = unwrap(chunks)
    # Float16Module casts the whole model to bf16 (megatron/core/transformer/module.py:440)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    mains = _main_params(opt)
    # the distributed optimizer steps on fp32 copies of its shards (megatron/core/optimizer/distrib_optimizer.py:399)
    assert mains and {p.dtype for p in mains} == {torch.float32} and {p.device for p in mains} == {cuda}

    tokens, targets = fixed_batch(spec, cuda)
    micro = [{"tokens": tokens[:4], "targets": targets[:4]}, {"tokens": tokens[4:], "targets": targets[4:]}]
    losses = []
    for step in range(5):
        out = mt.forward_backward(chunks, micro, nll, optimizer=opt)
        losses.append(sum(o["loss"].item() for o in out) / len(out))
        if step == 0:
            # grad_reduce_in_fp32 (build_trainable): main_grad buffers are fp32 on the GPU
            # (megatron/core/distributed/distributed_data_parallel.py:147)
            grads = {n: p.main_grad for n, p in model.named_parameters()}
            assert {g.dtype for g in grads.values()} == {torch.float32}
            assert {g.device for g in grads.values()} == {cuda}
            assert all(torch.isfinite(g).all() for g in grads.values())
        ok, grad_norm = mt.optimizer_step(opt)
        assert ok and grad_norm > 0
    assert losses[-1] < losses[0] - 0.5 and all(b < a for a, b in zip(losses, losses[1:])), losses
    # the router keeps its expert bias in fp32 through the bf16 cast (megatron/core/transformer/moe/router.py:209-218)
    biases = [b for n, b in model.named_buffers() if n.endswith("router.expert_bias")]
    assert biases and all(b.dtype == torch.float32 and b.device == cuda for b in biases)
    assert off_device(chunks[0], cuda) == []  # nothing moved off the GPU while training

    # logprobs from the same model agree with a plain log_softmax of its logits, on the GPU
    from kimi_pipeline.model.megatron_model import causal_forward

    # Deterministic kernels: megatron's MoE unpermute adds with atomics on CUDA, so two bf16 forwards of one model
    # differ in a few logits' last bits; on an H200 that moved log-probs by ~1e-4 (2026-11-26). The bound leaves
    # room for the two calls' different batch shapes (cuBLAS picks kernels per shape); a wrong shift or
    # normalisation is off by far more.
    with deterministic_kernels():
        lp, ent = mt.token_logprobs(chunks, tokens, targets)
        assert lp.device == cuda
        with torch.no_grad():
            logp = torch.log_softmax(causal_forward(chunks[0], tokens).float(), dim=-1)
    want_lp, want_ent = logp.gather(-1, targets[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
    assert torch.allclose(lp, want_lp, atol=1e-3), (lp - want_lp).abs().max().item()
    assert torch.allclose(ent, want_ent, atol=1e-3), (ent - want_ent).abs().max().item()


def test_the_bf16_trainers_stacked_experts_take_the_grouped_gemm(cuda, one_gpu_rank, monkeypatch):
    """Without TE, every MoE layer's experts are two stacked Parameters living in megatron's DDP param buffer, and a
    training micro-batch multiplies them with torch's grouped GEMM (bf16, sm80+), never one expert at a time (the
    path for operands grouped_mm does not take, e.g. a misaligned buffer view)."""
    import torch

    from kimi_pipeline.model import grouped_experts
    from kimi_pipeline.model import megatron_train as mt
    from kimi_pipeline.model.hf_bridge import model_uses_te
    from kimi_pipeline.model.megatron_model import unwrap

    if torch.cuda.get_device_capability(cuda)[0] < 8:
        pytest.skip("torch's grouped GEMM on CUDA needs sm80+")
    r, spec = _bf16()
    chunks, opt = mt.build_trainable(spec, one_gpu_rank, r.optimizer, device=cuda)
    if model_uses_te(chunks):
        pytest.skip("with Transformer Engine the experts are TE's grouped linears")
    stacked = grouped_experts.stacked_experts()
    layers = [m for m in unwrap(chunks).modules() if isinstance(m, stacked)]
    assert len(layers) == 3 and all(m.fc1_weight.device == cuda and m.fc1_weight.dtype == torch.bfloat16
                                    for m in layers)
    calls = {"grouped": 0, "one at a time": 0}
    grouped_mm, one_at_a_time = torch._grouped_mm, stacked._one_expert_at_a_time

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(torch, "_grouped_mm", counted("grouped", grouped_mm))
    monkeypatch.setattr(stacked, "_one_expert_at_a_time", counted("one at a time", one_at_a_time))
    tokens, targets = fixed_batch(spec, cuda)
    out = mt.forward_backward(chunks, [{"tokens": tokens, "targets": targets}], nll, optimizer=opt)
    assert calls == {"grouped": 2 * len(layers), "one at a time": 0}, calls  # fc1 and fc2 of each layer's forward
    assert torch.isfinite(out[0]["loss"]) and all(torch.isfinite(m.fc1_weight.main_grad).all() for m in layers)


def test_torch_dist_resume_takes_the_identical_next_step(cuda, one_gpu_rank, tmp_path):
    """Save after one step, take a second step; a fresh model + optimizer loaded from the checkpoint takes the
    same second step: every weight bit-identical (fp32 Adam state and main params restored, not re-derived)."""
    import torch

    from kimi_pipeline.model import hf_bridge
    from kimi_pipeline.model import megatron_train as mt

    r, spec = _bf16()
    tokens, targets = fixed_batch(spec, cuda)
    micro = [{"tokens": tokens, "targets": targets}]

    def step(chunks, opt) -> float:
        out = mt.forward_backward(chunks, micro, nll, optimizer=opt)
        assert mt.optimizer_step(opt)[0]
        return out[0]["loss"].item()

    def weights(chunks):
        return {k: v.detach().clone() for k, v in hf_bridge.model_tensors(chunks).items()}

    with deterministic_kernels():
        chunks, opt = mt.build_trainable(spec, one_gpu_rank, r.optimizer, device=cuda)
        step(chunks, opt)
        ckpt = tmp_path / "ckpt"
        mt.save_checkpoint(ckpt, 1, chunks, opt, {"rollout": 1, "data_pos": 64})
        saved = weights(chunks)
        assert (ckpt / mt.TRACKER).read_text().strip() == "1"
        loss_continued = step(chunks, opt)
        continued = weights(chunks)

        fresh, fresh_opt = mt.build_trainable(spec, one_gpu_rank, r.optimizer, device=cuda)
        assert mt.load_checkpoint(ckpt, fresh, fresh_opt) == {"rollout": 1, "data_pos": 64}
        assert off_device(fresh[0], cuda) == []  # loaded onto the model's device
        now = weights(fresh)
        assert [k for k in saved if not torch.equal(saved[k], now[k])] == []
        loss_resumed = step(fresh, fresh_opt)
        after = weights(fresh)
    assert loss_resumed == loss_continued
    differ = {k: (continued[k].float() - after[k].float()).abs().max().item()
              for k in continued if not torch.equal(continued[k], after[k])}
    assert differ == {}, f"the resumed step differs from the continued one (max |diff| per tensor): {differ}"


def test_offloaded_optimizer_keeps_its_state_on_the_host_and_resumes(cuda, one_gpu_rank, tmp_path):
    """`optimizer_cpu_offload` (the K2 presets): megatron's hybrid optimizer with offload fraction 1.0 keeps every
    fp32 main param and Adam moment in host memory; a fresh one loads a checkpoint (its state allocated by
    `dummy_step` first, megatron_train._ensure_optimizer_state) and takes the same next step."""
    import torch

    from kimi_pipeline.model import hf_bridge
    from kimi_pipeline.model import megatron_train as mt
    from kimi_pipeline.recipes import load_recipe

    r = load_recipe("tiny", ["cluster.device=cuda", "optimizer.optimizer_cpu_offload=true",
                             "optimizer.use_distributed_optimizer=true"])
    spec = r.model.model_copy(update={"params_dtype": "bfloat16"})  # the hybrid optimizer needs fp32 main copies
    tokens, targets = fixed_batch(spec, cuda)
    micro = [{"tokens": tokens, "targets": targets}]

    def step(chunks, opt) -> None:
        mt.forward_backward(chunks, micro, nll, optimizer=opt)
        assert mt.optimizer_step(opt)[0]

    with deterministic_kernels():
        chunks, opt = mt.build_trainable(spec, one_gpu_rank, r.optimizer, device=cuda)
        step(chunks, opt)
        hybrids = [part.optimizer for part in getattr(opt, "chained_optimizers", [opt])]
        assert all(type(h).__name__ == "HybridDeviceOptimizer" and h.offload_fraction == 1.0 for h in hybrids)
        state = [t for h in hybrids for s in h.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
        assert state and {t.device.type for t in state} == {"cpu"}
        mt.save_checkpoint(tmp_path / "ckpt", 1, chunks, opt)
        step(chunks, opt)
        continued = hf_bridge.model_tensors(chunks)

        fresh, fresh_opt = mt.build_trainable(spec, one_gpu_rank, r.optimizer, device=cuda)
        mt.load_checkpoint(tmp_path / "ckpt", fresh, fresh_opt)
        step(fresh, fresh_opt)
        after = hf_bridge.model_tensors(fresh)
    assert [k for k in continued if not torch.equal(continued[k], after[k])] == []
