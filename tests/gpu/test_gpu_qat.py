"""INT4 QAT (model/qat.py enable_int4_qat) on one GPU: only the routed experts compute with fake-INT4 weights;
forward and straight-through gradients through megatron DDP equal a model whose expert weights ARE the
fake-quant values; the bf16 trainer with QAT on trains. The GPU twin of tests/integration/test_int4.py's
megatron QAT tests, for whichever expert module the device gets (local grouped experts, or TE's grouped
linear `weight{e}` when Transformer Engine is installed)."""

from __future__ import annotations

import pytest
from support.common import experts_reached, fixed_batch, nll, qat_vs_quantized_weights
from support.gpu import deterministic_kernels, off_device

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def megatron_pair(cuda, one_gpu_rank):
    """Two identical tiny fp32 megatron models on the GPU: `qat` and `ref`."""
    from kimi_pipeline.model.megatron_model import build_model
    from kimi_pipeline.recipes import load_recipe

    spec = load_recipe("tiny", ["cluster.device=cuda"]).model
    qat, ref = build_model(spec, one_gpu_rank, device=cuda), build_model(spec, one_gpu_rank, device=cuda)
    ref.load_state_dict(qat.state_dict())
    assert off_device(qat, cuda) == [] and off_device(ref, cuda) == []
    return qat, ref


def test_qat_wraps_only_routed_experts_on_the_gpu(megatron_pair, cuda):
    import torch

    model, _ = megatron_pair
    params = {n: p for n, p in model.named_parameters()}
    tokens = torch.randint(4, 300, (2, 12), generator=torch.Generator().manual_seed(0)).to(cuda)
    # bit-equal forwards need deterministic kernels: megatron's MoE unpermute adds with atomics on CUDA, and two
    # plain forwards of this model differed in the last bits on an H200 (2026-11-26)
    with deterministic_kernels():
        _qat_wraps_only_routed_experts(model, params, tokens, cuda)


def _qat_wraps_only_routed_experts(model, params, tokens, cuda) -> None:
    import torch

    from kimi_pipeline.model.megatron_model import causal_forward
    from kimi_pipeline.model.qat import disable_int4_qat, enable_int4_qat

    with torch.no_grad():
        plain = causal_forward(model, tokens)
    names = enable_int4_qat(model, 32)
    try:
        assert names and all(".mlp.experts." in n for n in names)
        assert {n.split(".mlp.")[0] for n in names} == {f"decoder.layers.{i}" for i in (1, 2, 3)}  # MoE layers only
        wrapped = {n for n, m in model.named_modules() if "forward" in m.__dict__}
        assert wrapped == set(names)  # no attention, router, shared expert, dense MLP, embedding or output layer
        with torch.no_grad():
            quant = causal_forward(model, tokens)
        assert quant.device == cuda and not torch.equal(plain, quant)
        assert all(p is params[n] for n, p in model.named_parameters())  # the same Parameters, on the GPU
        assert off_device(model, cuda) == []
    finally:
        disable_int4_qat(model)
    with torch.no_grad():
        assert torch.equal(causal_forward(model, tokens), plain)


def test_qat_forward_and_ste_grads_under_megatron_ddp_on_the_gpu(megatron_pair, cuda):
    import torch

    model, ref = megatron_pair
    got, want, grads, experts = qat_vs_quantized_weights(model, ref, cuda)
    # same kernels on the same values; only the order of CUDA atomic adds (MoE unpermute) may differ
    scale = want.abs().max().item()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * scale), (got - want).abs().max()
    for n, (g, w) in grads.items():
        assert g.device == cuda and torch.allclose(g, w, rtol=1e-4, atol=1e-6 + 1e-4 * w.abs().max().item()), n
    # routed experts received (straight-through) gradients: 24 tokens x top-4 reach most of the 16 per layer
    reached, total = experts_reached(grads[n][0] for n in experts)
    assert reached >= total // 4, (reached, total)


def test_bf16_trainer_with_qat_trains_on_the_gpu(cuda, one_gpu_rank):
    """What a K2 recipe runs: the bf16 trainer with INT4 QAT on; loss falls, expert grads are finite and non-zero."""
    import torch

    from kimi_pipeline.model import megatron_train as mt
    from kimi_pipeline.model.megatron_model import unwrap
    from kimi_pipeline.model.qat import enable_int4_qat, routed_expert_modules
    from kimi_pipeline.recipes import load_recipe

    r = load_recipe("tiny", ["cluster.device=cuda", "quant.int4_qat=true"])
    spec = r.model.model_copy(update={"params_dtype": "bfloat16"})
    chunks, opt = mt.build_trainable(spec, one_gpu_rank, r.optimizer, device=cuda)
    assert enable_int4_qat(chunks[0], r.quant.group_size)
    expert = [p for _, lin in routed_expert_modules(unwrap(chunks)) for p in lin.parameters()]
    tokens, targets = fixed_batch(spec, cuda)
    micro = [{"tokens": tokens, "targets": targets}]
    losses = []
    for step in range(5):
        out = mt.forward_backward(chunks, micro, nll, optimizer=opt)
        losses.append(out[0]["loss"].item())
        if step == 0:
            assert all(torch.isfinite(p.main_grad).all() for p in expert)
            reached, total = experts_reached(p.main_grad for p in expert)
            assert reached > total // 2, (reached, total)
        assert mt.optimizer_step(opt)[0]
    assert losses[-1] < losses[0] - 0.5, losses
    assert off_device(chunks[0], cuda) == []
