"""INT4 QAT (quant/qat.py enable_int4_qat) on one GPU: only the routed experts compute with fake-INT4 weights;
forward and straight-through gradients through megatron DDP equal a model whose expert weights ARE the
fake-quant values; the bf16 trainer with QAT on trains. The GPU twin of tests/integration/test_int4.py's
megatron QAT tests, for whichever expert module the device gets (local grouped experts, or TE's grouped
linear `weight{e}` when Transformer Engine is installed)."""

from __future__ import annotations

import re

import pytest

from support.gpu import fixed_batch, nll, off_device

pytestmark = pytest.mark.gpu

_WEIGHT = re.compile(r"weight\d*")  # as quant/qat.py: `weight` (local Linear) or `weight{e}` (TE grouped linear)


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

    from kimi_pipeline.model.megatron_model import causal_forward
    from kimi_pipeline.quant.qat import disable_int4_qat, enable_int4_qat

    model, _ = megatron_pair
    params = {n: p for n, p in model.named_parameters()}
    tokens = torch.randint(4, 300, (2, 12), generator=torch.Generator().manual_seed(0)).to(cuda)
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
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from kimi_pipeline.model.megatron_model import causal_forward
    from kimi_pipeline.quant.int4 import fake_quant_int4
    from kimi_pipeline.quant.qat import disable_int4_qat, enable_int4_qat, routed_expert_linears

    model, ref = megatron_pair
    with torch.no_grad():
        for _, lin in routed_expert_linears(ref):
            for name, p in lin._parameters.items():
                if p is not None and _WEIGHT.fullmatch(name):
                    p.copy_(fake_quant_int4(p, 32))
    expert_params = {id(p) for _, lin in routed_expert_linears(model) for p in lin.parameters()}
    enable_int4_qat(model, 32)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=model)
    try:
        tokens = torch.randint(4, 300, (2, 12), generator=torch.Generator().manual_seed(1)).to(cuda)
        up = torch.randn(2, 12, 384, generator=torch.Generator().manual_seed(2)).to(cuda)
        ddp.zero_grad_buffer()
        got = causal_forward(ddp, tokens)
        (got * up).sum().backward()
        ddp.finish_grad_sync()
        ref.zero_grad(set_to_none=True)
        want = causal_forward(ref, tokens)
        (want * up).sum().backward()
        # same kernels on the same values; only the order of CUDA atomic adds (MoE unpermute) may differ
        scale = want.abs().max().item()
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * scale), (got - want).abs().max()
        ref_grads = dict(ref.named_parameters())
        expert_grads = 0
        for n, p in model.named_parameters():
            g, w = p.main_grad, ref_grads[n].grad
            assert g.device == cuda and torch.allclose(g, w, rtol=1e-4, atol=1e-6 + 1e-4 * w.abs().max().item()), n
            expert_grads += id(p) in expert_params and bool(g.abs().sum() > 0)
        # routed experts received (straight-through) gradients: 24 tokens x top-4 reach most of the 16 per layer
        assert expert_grads >= len(expert_params) // 4, (expert_grads, len(expert_params))
    finally:
        disable_int4_qat(model)


def test_bf16_trainer_with_qat_trains_on_the_gpu(cuda, one_gpu_rank):
    """What a K2 recipe runs: the bf16 trainer with INT4 QAT on; loss falls, expert grads are finite and non-zero."""
    import torch

    from kimi_pipeline.model import megatron_train as mt
    from kimi_pipeline.model.megatron_model import unwrap
    from kimi_pipeline.quant.qat import enable_int4_qat, routed_expert_linears
    from kimi_pipeline.recipes import load_recipe

    r = load_recipe("tiny", ["cluster.device=cuda", "quant.int4_qat=true"])
    spec = r.model.model_copy(update={"params_dtype": "bfloat16"})
    chunks, opt = mt.build_trainable(spec, one_gpu_rank, r.optimizer, device=cuda)
    assert enable_int4_qat(chunks[0], r.quant.group_size)
    expert = [p for _, lin in routed_expert_linears(unwrap(chunks)) for p in lin.parameters()]
    tokens, targets = fixed_batch(spec, cuda)
    micro = [{"tokens": tokens, "targets": targets}]
    losses = []
    for step in range(5):
        out = mt.forward_backward(chunks, micro, nll, optimizer=opt)
        losses.append(out[0]["loss"].item())
        if step == 0:
            assert all(torch.isfinite(p.main_grad).all() for p in expert)
            assert sum(bool(p.main_grad.abs().sum() > 0) for p in expert) > len(expert) // 2
        assert mt.optimizer_step(opt)[0]
    assert losses[-1] < losses[0] - 0.5, losses
    assert off_device(chunks[0], cuda) == []
