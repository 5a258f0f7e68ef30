"""megatron-core on CPU: the compat guard, layouts, one-process training, checkpoints, and real multi-process
gloo runs (TP2 x EP2 against one process, torch_dist resharding 1 -> TP2xEP2 -> PP2xEP2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.common import fixed_batch, nll

from kimi_pipeline.model import megatron_compat
from kimi_pipeline.recipes import load_recipe
from kimi_pipeline.recipes.layout import Layout, LayoutError

CPU = torch.device("cpu")

ROOT = Path(__file__).resolve().parents[2]
TINY_WEIGHTS = ROOT / "data" / "tiny" / "model"


# --------------------------------------------------------------------------- compat guard


def test_every_patch_target_exists_in_pinned_megatron():
    import megatron.core

    assert megatron.core.__version__ == megatron_compat.MEGATRON_CORE_VERSION, (
        f"megatron-core {megatron.core.__version__} installed; the CPU shim was written for "
        f"{megatron_compat.MEGATRON_CORE_VERSION}: re-check every row of megatron_compat.PATCHES"
    )
    missing = megatron_compat.missing_targets()
    assert missing == [], "patched megatron targets moved or vanished:\n" + "\n".join(missing)
    assert all(p.why.strip() for p in megatron_compat.PATCHES)


def test_guard_reports_a_vanished_target():
    ghost = megatron_compat.Patch(megatron_compat.CPU, "megatron.core.tensor_parallel.random", "NoSuchTracker", "test",
                                  lambda o: o)
    with pytest.raises(AttributeError, match="NoSuchTracker no longer exists"):
        megatron_compat._resolve(ghost)


def test_apply_is_idempotent_and_applies_the_rows_of_this_process():
    first = megatron_compat.apply_compat(CPU, "gloo")
    assert first == megatron_compat.apply_compat(CPU, "gloo")
    te, torch_adam = megatron_compat.megatron_kernels()  # a CPU box: no TE, no apex (a GPU box may have them)
    assert first == megatron_compat.patches_for(megatron_compat.compat_causes(CPU, "gloo", te=te, torch_adam=torch_adam))
    if not te and torch_adam:
        assert first == [p.name for p in megatron_compat.PATCHES]
    assert torch.cuda.current_device() == torch.device("cpu")


# The documented sets: what a process gets for (device, Transformer Engine installed?, apex/TE Adam?, backend).
TE_LESS = [
    "megatron.core.transformer.multi_latent_attention.HAVE_TE",
    "megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__",
    "megatron.core.transformer.moe.router.router_gating_linear",
    "megatron.core.optimizer.cpu_offloading.hybrid_optimizer.HybridDeviceOptimizer._sync_sub_optimizers_state_to_hdo",
    "megatron.core.optimizer.cpu_offloading.hybrid_optimizer.HybridDeviceOptimizer._update_fp32_params_by_new_state",
    "megatron.core.tensor_parallel.layers.linear_with_grad_accumulation_and_async_allreduce",
    "megatron.core.transformer.moe.token_dispatcher.sort_chunks_by_idxs",
    "megatron.core.transformer.moe.token_dispatcher.permute",
]
TORCH_ADAM = [
    "megatron.core.optimizer.clip_grads.l2_norm_impl",
    "megatron.core.optimizer.torch",
    "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states",
    "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.load_state_dict",
]
GLOO = [
    "megatron.core.transformer.moe.token_dispatcher.all_to_all",
    "megatron.core.distributed.param_and_grad_buffer.dist_all_gather_func",
    "megatron.core.distributed.param_and_grad_buffer.dist_reduce_scatter_func",
    "megatron.core.distributed.param_and_grad_buffer._coalescing_manager",
    "megatron.core.tensor_parallel.mappings._gather_along_first_dim",
    "megatron.core.tensor_parallel.mappings._reduce_scatter_along_first_dim",
]


@pytest.mark.parametrize("device, te, torch_adam, backend, expected", [
    ("cuda", True, False, "nccl", []),  # a full GPU stack: megatron as shipped
    ("cuda", False, True, "nccl", TE_LESS + TORCH_ADAM),  # the H100 image: no TE, no apex
    ("cuda", False, False, "nccl", TE_LESS),  # apex without TE
    ("cuda", False, True, "gloo", TE_LESS + TORCH_ADAM + GLOO),
    ("cpu", False, True, "gloo", None),  # every row (CPU rows included)
    ("cpu", False, True, None, "no-gloo"),  # before a process group exists
])
def test_each_device_te_backend_gets_the_documented_patch_set(device, te, torch_adam, backend, expected):
    causes = megatron_compat.compat_causes(device, backend, te=te, torch_adam=torch_adam)
    got = megatron_compat.patches_for(causes)
    if expected is None:
        assert got == [p.name for p in megatron_compat.PATCHES]
    elif expected == "no-gloo":
        assert got == [p.name for p in megatron_compat.PATCHES if p.name not in GLOO]
    else:
        assert sorted(got) == sorted(expected)
        assert not any(p.cause == megatron_compat.CPU for p in megatron_compat.PATCHES if p.name in got)


def test_a_gpu_process_gets_no_cpu_row_and_keeps_the_te_less_ones():
    """Switching causes restores the rows that no longer apply: on a (TE-less) GPU, megatron's own CUDA calls
    are back and the TE-less rows stay; the CPU set is re-applied after."""
    cpu_set = megatron_compat.apply_compat(CPU, "gloo")
    try:
        gpu_set = megatron_compat.apply_compat(torch.device("cuda"), "nccl")
        te, torch_adam = megatron_compat.megatron_kernels()
        assert sorted(gpu_set) == sorted((TE_LESS if not te else []) + (TORCH_ADAM if torch_adam else []))
        assert torch.cuda.current_device is not megatron_compat._cpu_device
        from megatron.core.transformer import multi_latent_attention

        if not te:  # the TE-less rows stay on a GPU
            assert multi_latent_attention.HAVE_TE is False
    finally:
        assert megatron_compat.apply_compat(CPU, "gloo") == cpu_set
    assert torch.cuda.current_device() == torch.device("cpu")


EAGER_PROBE = """
import sys
import kimi_pipeline.model.megatron_model  # megatron imported through our package, as every rank and actor does
import megatron.core.jit as jit
from megatron.core.fusions import fused_bias_swiglu
import torch
y, b = torch.randn(3, 8), torch.randn(8)
same = torch.equal(fused_bias_swiglu.bias_swiglu_impl(y, b), torch.nn.functional.silu((y + b)[:, :4]) * (y + b)[:, 4:])
print(jit.jit_fuser.__name__, fused_bias_swiglu.bias_swiglu.__name__, "torch._dynamo" in sys.modules, same)
import megatron.core.timers as timers
from megatron.core.inference.contexts import dynamic_context
from megatron.core.inference.engines import dynamic_engine
print("wandb" in sys.modules, timers.wandb, dynamic_context.HAVE_WANDB, dynamic_engine.HAVE_WANDB)
import wandb  # the pipeline's own W&B logger still imports it
print(wandb.Settings.__name__)
"""


def test_with_dynamo_off_megatrons_fused_functions_run_eagerly_without_importing_dynamo(monkeypatch):
    """TORCHDYNAMO_DISABLE=1 (every CPU rank and actor): megatron's fuser is its own no-op decorator from its first
    import (model/megatron_import.py), so its fused functions are plain functions computing the same, and torch._dynamo
    is never imported; without it (a GPU process) nothing is installed and megatron keeps torch.compile. Megatron's
    timers and dynamic inference modules import without wandb (their writers unused), which stays importable."""
    from kimi_pipeline.model import megatron_import

    out = subprocess.run([sys.executable, "-W", "ignore", "-c", EAGER_PROBE], capture_output=True, text=True,
                         env={**os.environ, "TORCHDYNAMO_DISABLE": "1"}, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["noop_decorator", "bias_swiglu", "False", "True",
                                  "False", "None", "False", "False", "Settings"], out.stdout
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delitem(sys.modules, megatron_import.JIT_MODULE, raising=False)
    assert megatron_import.eager_fused_functions_when_dynamo_is_off() is False
    assert not any(type(f).__name__ == "_EagerJitFuser" for f in sys.meta_path)


# --------------------------------------------------------------------------- layouts


def test_layouts_from_recipe_sections():
    r = load_recipe("tiny")
    conv = Layout.from_convert(r.convert)
    assert (conv.world_size, conv.pp, conv.ep, conv.dp, conv.edp) == (4, 2, 2, 2, 1)
    assert conv.pp_stage_layers(4) == [2, 2]
    train = Layout.from_parallel(r.parallel, world_size=1)
    assert (train.tp, train.dp, train.sequence_parallel) == (1, 1, False)
    k2 = Layout(world_size=256, tp=8, pp=8, ep=32, etp=1, last_pp_stage_layers=5)
    assert k2.pp_stage_layers(61) == [8] * 7 + [5] and k2.dp == 4 and k2.layer_offset(61, 7) == 56


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"world_size": 6, "tp": 4}, "not divisible"),
        ({"world_size": 2, "tp": 2, "etp": 1}, "ep=1 needs etp == tp"),
        ({"world_size": 2, "pp": 2, "last_pp_stage_layers": 5}, "do not split"),
    ],
)
def test_bad_layouts_fail_clearly(kwargs, match):
    with pytest.raises(LayoutError, match=match):
        layout = Layout(**kwargs)
        layout.check_model(load_recipe("tiny").model)


# --------------------------------------------------------------------------- one process


@pytest.fixture(scope="module")
def single_process():
    from kimi_pipeline.model import parallel

    layout = Layout()
    parallel.init_distributed(layout, device=CPU, seed=11)
    yield layout
    parallel.destroy()


def test_one_process_trains_with_megatron_optimizer(single_process):
    from kimi_pipeline.model import hf_bridge
    from kimi_pipeline.model import megatron_train as mt

    r = load_recipe("tiny")
    chunks, opt = mt.build_trainable(r.model, single_process, r.optimizer, device=CPU)
    tokens, targets = fixed_batch(r.model)
    micro = [{"tokens": tokens[:4], "targets": targets[:4]}, {"tokens": tokens[4:], "targets": targets[4:]}]
    before = {k: v.detach().clone() for k, v in hf_bridge.model_tensors(chunks).items()}
    losses = []
    for _ in range(5):
        out = mt.forward_backward(chunks, micro, nll, optimizer=opt)
        losses.append(sum(o["loss"].item() for o in out) / len(out))
        ok, grad_norm = mt.optimizer_step(opt)
        assert ok and grad_norm > 0
    after = hf_bridge.model_tensors(chunks)
    frozen = sorted(k for k in before if torch.equal(before[k], after[k]))
    assert frozen == [f"decoder.layers.{i}.mlp.router.expert_bias" for i in (1, 2, 3)]  # bias is fixed in RL
    assert losses[-1] < losses[0] - 0.5 and all(b < a for a, b in zip(losses, losses[1:])), losses

    # token_logprobs / entropy agree with a plain log_softmax of the model's logits
    from kimi_pipeline.model.megatron_model import causal_forward

    lp, ent = mt.token_logprobs(chunks, tokens, targets)
    with torch.no_grad():
        logp = torch.log_softmax(causal_forward(chunks[0], tokens).float(), dim=-1)
    assert torch.allclose(lp, logp.gather(-1, targets[..., None]).squeeze(-1), atol=1e-5)
    assert torch.allclose(ent, -(logp.exp() * logp).sum(-1), atol=1e-5)
    assert chunks[0].training  # token_logprobs restores train mode

    # the recipe's schedule drives megatron's param scheduler: linear warm-up over 2 steps
    warm = r.optimizer.model_copy(update={"lr_warmup_steps": 2, "lr_decay_style": "linear"})
    sched = mt.lr_scheduler(opt, warm, total_steps=10)
    lrs = {g["lr"] for g in opt.param_groups}
    mt.forward_backward(chunks, micro, nll, optimizer=opt)
    mt.optimizer_step(opt, sched)
    assert lrs == {0.0}
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([warm.lr / 2] * len(opt.param_groups))


def _moe_layer(chunks):
    from kimi_pipeline.model.megatron_model import unwrap

    return unwrap(chunks[0]).decoder.layers[1].mlp


def _sequential_twin(model, spec, layout, monkeypatch):
    """A model built with megatron's own SequentialMLP experts (where experts cannot stack), holding `model`'s
    weights through its state dict (the stacked experts name theirs as SequentialMLP does)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from kimi_pipeline.model import megatron_model

    with monkeypatch.context() as m:
        m.setattr(megatron_model, "stackable", lambda config, expert_tp: False)
        twin = megatron_model.build_model(spec, layout, device=CPU)
    assert type(twin.decoder.layers[1].mlp.experts) is SequentialMLP
    twin.load_state_dict(model.state_dict())  # strict: every name matches
    return twin


def _expert_grads(experts) -> list[torch.Tensor]:
    """[fc1 grads [E, 2F, H], fc2 grads [E, H, F]] of stacked experts or of megatron's per-expert Linears."""
    if hasattr(experts, "fc1_weight"):
        return [experts.fc1_weight.grad.clone(), experts.fc2_weight.grad.clone()]
    return [torch.stack([getattr(e, lin).weight.grad for e in experts.local_experts]) for lin in ("linear_fc1",
                                                                                                  "linear_fc2")]


@pytest.mark.parametrize("qat", [False, True])
def test_stacked_experts_equal_megatrons_sequential_mlp(single_process, qat, monkeypatch):
    """The stacked experts (grouped GEMMs, and the one-expert-at-a-time path where grouped_mm cannot run) compute
    what megatron's SequentialMLP computes with the same weights: the layer's output, the input's and every
    expert's gradient, empty experts included, with and without INT4 QAT; and the whole model's logits."""
    from kimi_pipeline.model import grouped_experts
    from kimi_pipeline.model.megatron_model import build_model, causal_forward
    from kimi_pipeline.model.qat import enable_int4_qat

    r = load_recipe("tiny")
    model = build_model(r.model, single_process, device=CPU)
    twin = _sequential_twin(model, r.model, single_process, monkeypatch)
    if qat:
        assert enable_int4_qat(model, r.quant.group_size) == [f"decoder.layers.{i}.mlp.experts" for i in (1, 2, 3)]
        enable_int4_qat(twin, r.quant.group_size)
    experts, reference = model.decoder.layers[1].mlp.experts, twin.decoder.layers[1].mlp.experts
    assert type(experts) is grouped_experts.stacked_experts()
    assert [n for n, _ in experts.named_parameters()] == ["fc1_weight", "fc2_weight"]
    g = torch.Generator().manual_seed(3)
    counts = torch.tensor([5, 0, 9, 1] + [3] * (experts.num_local_experts - 4))
    x = torch.randn(int(counts.sum()), r.model.hidden_size, generator=g)
    probs = torch.rand(x.shape[0], generator=g)
    upstream = torch.randn(x.shape[0], r.model.hidden_size, generator=g)

    def run(module):
        xi = x.clone().requires_grad_()
        module.zero_grad(set_to_none=True)
        out, bias = module(xi, counts, probs)
        assert bias is None
        out.backward(upstream)
        return out.detach(), xi.grad.clone(), _expert_grads(module)

    grouped = run(experts)
    with monkeypatch.context() as m:
        m.setattr(grouped_experts, "grouped_mm_supported", lambda *a: False)
        one_at_a_time = run(experts)
    want = run(reference)
    for got in (grouped, one_at_a_time):
        assert torch.allclose(got[0], want[0], atol=1e-5), (got[0] - want[0]).abs().max()
        assert torch.allclose(got[1], want[1], atol=1e-5)
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got[2], want[2]))
    assert all(gr[1:].abs().sum() > 0 for gr in want[2]) and not want[2][0][1].any()  # expert 1 got no tokens
    tokens, _ = fixed_batch(r.model)
    with torch.no_grad():
        assert torch.allclose(causal_forward(model, tokens), causal_forward(twin, tokens), atol=1e-4)


def test_stacked_experts_keep_sequential_mlps_names_and_checkpoint_layout(single_process, monkeypatch):
    """Outside the module the experts are SequentialMLP's: state_dict names (views: a write reaches the stack),
    load_state_dict from either form, and the torch_dist layout (one key per layer, global expert axis)."""
    from kimi_pipeline.model import hf_bridge
    from kimi_pipeline.model.megatron_model import build_model

    r = load_recipe("tiny")
    model = build_model(r.model, single_process, device=CPU)
    twin = _sequential_twin(model, r.model, single_process, monkeypatch)
    def tensors(m) -> list[str]:
        return sorted(k for k in m.state_dict() if not k.endswith("._extra_state"))  # megatron Linear's (None)

    assert tensors(model) == tensors(twin)
    live = hf_bridge.model_tensors(model)
    assert sorted(live) == tensors(twin)
    experts = model.decoder.layers[2].mlp.experts
    with torch.no_grad():
        live["decoder.layers.2.mlp.experts.local_experts.5.linear_fc2.weight"].fill_(0.25)
    assert (experts.fc2_weight[5] == 0.25).all() and not (experts.fc2_weight[4] == 0.25).all()
    twin.decoder.layers[2].mlp.experts.local_experts[7].linear_fc1.weight.data.mul_(3)
    model.load_state_dict(twin.state_dict())  # SequentialMLP's state dict, its Linears' _extra_state included
    assert torch.equal(experts.fc1_weight[7], twin.decoder.layers[2].mlp.experts.local_experts[7].linear_fc1.weight)

    def layout(m):
        return {sh.key: (tuple(sh.global_shape), tuple(sh.global_offset), sh.replica_id)
                for sh in _sharded_tensors(m.sharded_state_dict()) if ".mlp.experts." in sh.key}

    twin_layout, stacked_layout = layout(twin), layout(model)
    assert sorted(stacked_layout) == sorted(twin_layout) == sorted(
        f"decoder.layers.{i}.mlp.experts.experts.linear_fc{k}.weight" for i in (1, 2, 3) for k in (1, 2))
    for key, (shape, offset, replica) in stacked_layout.items():  # one rank: every expert from offset 0
        assert shape == twin_layout[key][0] and shape[-3] == r.model.num_experts, (key, shape)
        assert offset[-3:] == (0, 0, 0) and replica == twin_layout[key][2] == (0, 0, 0)


def _sharded_tensors(sharded: dict) -> list:
    """Every ShardedTensor of a sharded state dict, factories built (the GLU fc1's swiglu split) as a save does."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = []
    for v in sharded.values():
        if isinstance(v, dict):
            out += _sharded_tensors(v)
        elif isinstance(v, ShardedTensorFactory):
            built = v.build()
            out += [t for t in (built if isinstance(built, list) else [built]) if isinstance(t, ShardedTensor)]
        elif isinstance(v, ShardedTensor):
            out.append(v)
    return out


def test_sdpa_attention_equals_megatrons_local_attention(single_process):
    """The local MLA core attention's SDPA path equals megatron's baddbmm + masked softmax + bmm."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from kimi_pipeline.model import megatron_train as mt
    from kimi_pipeline.model.megatron_model import causal_mask

    r = load_recipe("tiny")
    chunks, _ = mt.build_trainable(r.model, single_process, r.optimizer, device=CPU)
    from kimi_pipeline.model.megatron_model import unwrap

    core = unwrap(chunks[0]).decoder.layers[0].self_attention.core_attention
    m = r.model
    s, b, n = 11, 3, m.num_attention_heads
    g = torch.Generator().manual_seed(0)
    q = torch.randn(s, b, n, m.qk_head_dim + m.qk_pos_emb_head_dim, generator=g, requires_grad=True)
    k = torch.randn(s, b, n, m.qk_head_dim + m.qk_pos_emb_head_dim, generator=g, requires_grad=True)
    v = torch.randn(s, b, n, m.v_head_dim, generator=g, requires_grad=True)
    assert v.shape[-1] < q.shape[-1]  # MLA: on CPU V is zero-padded to the q/k head size for the flash kernel
    from torch.nn.attention import SDPBackend

    from kimi_pipeline.model.megatron_model import _sdpa_choice

    qq, kk, vv = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    assert _sdpa_choice(qq, kk, vv, core.softmax_scale) == SDPBackend.MATH.value
    padded_v = torch.nn.functional.pad(vv, (0, q.shape[-1] - v.shape[-1]))
    assert _sdpa_choice(qq, kk, padded_v, core.softmax_scale) == SDPBackend.FLASH_ATTENTION.value
    mask = causal_mask(s)
    fast = core(q, k, v, mask)
    slow = DotProductAttention.forward(core, q, k, v, mask)
    assert fast.shape == slow.shape == (s, b, n * m.v_head_dim)
    assert torch.allclose(fast, slow, atol=1e-5)
    weights = torch.randn(fast.shape, generator=g)
    fast_grads = torch.autograd.grad((fast * weights).sum(), (q, k, v))
    slow_grads = torch.autograd.grad((slow * weights).sum(), (q, k, v))
    for a, b_ in zip(fast_grads, slow_grads):
        assert torch.allclose(a, b_, atol=1e-5), (a - b_).abs().max()
    from megatron.core.transformer.enums import AttnMaskType

    # the spec's mask type decides (never a look at the mask tensor): any other type is megatron's own path
    other = mask.clone()
    other[..., 0] = False  # not causal: the first key is visible to every query
    padding = core(q, k, v, other, attn_mask_type=AttnMaskType.padding)
    assert torch.equal(padding, DotProductAttention.forward(core, q, k, v, other, AttnMaskType.padding))


def test_cpu_speed_patches_compute_what_megatron_computes():
    """The dispatcher / DDP speed patches of the CPU shim are exact: identity expert sort skipped, unpermute by
    index_add, 1-rank collectives as local copies."""
    from megatron.core.transformer.moe import moe_utils

    megatron_compat.apply_compat(CPU, "gloo")
    orig = megatron_compat._originals
    x = torch.randn(10, 4)
    sizes = torch.tensor([3, 0, 7])
    sort = megatron_compat._skip_identity_sort(moe_utils.sort_chunks_by_idxs)
    assert sort(x, sizes, torch.arange(3))[0] is x
    perm = torch.tensor([2, 0, 1])
    assert torch.equal(sort(x, sizes, perm)[0], moe_utils.sort_chunks_by_idxs(x, sizes, perm)[0])

    # permute without reading masked_select's size: the same tokens, probs and indices as megatron's (dropless:
    # every token routed to exactly topk experts)
    g = torch.Generator().manual_seed(2)
    routing = torch.zeros(9, 6, dtype=torch.bool)
    routing[torch.arange(9)[:, None], torch.rand(9, 6, generator=g).topk(2, dim=-1).indices] = True
    probs, hidden = torch.rand(9, 6, generator=g) * routing, torch.randn(9, 4, generator=g)
    mine = megatron_compat._permute_without_reading_sizes(moe_utils.permute)(hidden, routing, probs, num_out_tokens=18)
    theirs = moe_utils.permute(hidden, routing, probs, num_out_tokens=18)
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs))

    idx = torch.tensor([3, 1, 3, 0, 2, 1])
    tokens = torch.randn(6, 4)
    fast = megatron_compat._unpermute_with_index_add(moe_utils.unpermute)(tokens, idx, torch.Size([5, 4]))
    assert torch.allclose(fast, moe_utils.unpermute(tokens, idx, torch.Size([5, 4])), atol=1e-6)

    class OneRank:
        def size(self):
            return 1

    calls = []
    gather = megatron_compat._local_when_one_rank(lambda *a, **k: calls.append(a))
    out, inp = torch.zeros(6), torch.arange(6.0)
    assert gather(out, inp, group=OneRank()) is None and torch.equal(out, inp) and not calls
    assert gather(out, inp, group=OneRank(), async_op=True).wait()
    with megatron_compat._coalescing_when_one_rank(None)(OneRank(), async_ops=True) as cm:
        assert cm.wait()
    assert "megatron.core.distributed.param_and_grad_buffer.dist_all_gather_func" in orig

    from megatron.core.tensor_parallel import layers

    w = torch.randn(5, 4, requires_grad=True)
    x0 = torch.randn(3, 2, 4)
    xs = [x0.clone().requires_grad_() for _ in range(2)]
    outs = [megatron_compat._plain_linear_without_tp(layers.linear_with_grad_accumulation_and_async_allreduce)(
                xs[0], w, None, False, False, False),
            orig["megatron.core.tensor_parallel.layers.linear_with_grad_accumulation_and_async_allreduce"](
                xs[1], w, None, False, False, False)]
    grads = []
    for x, out in zip(xs, outs):
        w.grad = None
        out.backward(torch.ones_like(out))
        grads.append((x.grad.clone(), w.grad.clone()))
    assert torch.allclose(outs[0], outs[1]) and all(torch.allclose(a, b) for a, b in zip(*grads))


def _train_step(chunks, opt, micro) -> None:
    from kimi_pipeline.model import megatron_train as mt

    mt.forward_backward(chunks, micro, nll, optimizer=opt)
    assert mt.optimizer_step(opt)[0]


def _weights(chunks) -> dict[str, torch.Tensor]:
    from kimi_pipeline.model import hf_bridge

    return {k: v.detach().clone() for k, v in hf_bridge.model_tensors(chunks).items()}


@pytest.mark.slow  # torch_dist saves and a killed writer (~12 s)
def test_checkpoint_is_atomic_and_round_trips(single_process, tmp_path, monkeypatch):
    from megatron.core import dist_checkpointing

    from kimi_pipeline.model import hf_bridge
    from kimi_pipeline.model import megatron_train as mt

    r = load_recipe("tiny")
    tokens, targets = fixed_batch(r.model)
    micro = [{"tokens": tokens, "targets": targets}]

    chunks, opt = mt.build_trainable(r.model, single_process, r.optimizer, device=CPU)
    _train_step(chunks, opt, micro)
    ckpt = tmp_path / "ckpt"
    mt.save_checkpoint(ckpt, 1, chunks, opt, {"rollout": 1, "data_pos": 64})
    saved = _weights(chunks)
    assert (ckpt / mt.TRACKER).read_text().strip() == "1"
    assert (ckpt / "iter_0000001" / "metadata.json").is_file()
    # torch_dist keys use Transformer Engine names even from the local (CPU) spec: GPU jobs can load it
    keys = set(dist_checkpointing.load_tensors_metadata(str(ckpt / "iter_0000001")))
    assert {"decoder.layers.0.mlp.linear_fc1.layer_norm_weight",
            "decoder.layers.1.self_attention.linear_q_up_proj.layer_norm_weight",
            "decoder.layers.1.self_attention.linear_kv_up_proj.layer_norm_weight",
            "decoder.layers.1.mlp.experts.experts.linear_fc1.weight"} <= keys
    assert not [k for k in keys if "q_layernorm" in k or "kv_layernorm" in k or "layers.0.pre_mlp" in k]
    _train_step(chunks, opt, micro)
    continued = _weights(chunks)  # where training goes from the checkpointed state

    # a crash after the shards are written but before the rename/tracker: "latest" stays at step 1
    real_save = dist_checkpointing.save

    def crash(*args, **kwargs):
        real_save(*args, **kwargs)
        raise RuntimeError("simulated node failure")

    monkeypatch.setattr(dist_checkpointing, "save", crash)
    with pytest.raises(RuntimeError, match="simulated"):
        mt.save_checkpoint(ckpt, 2, chunks, opt, {"rollout": 2})
    monkeypatch.setattr(dist_checkpointing, "save", real_save)
    assert mt.latest_step(ckpt) == 1 and not (ckpt / "iter_0000002").exists()
    assert (ckpt / "iter_0000002.tmp").exists()

    # a fresh model + optimizer resumes from "latest": same weights, and (Adam state, step count) the
    # next step lands exactly where the original run went
    fresh, fresh_opt = mt.build_trainable(r.model, single_process, r.optimizer, device=CPU)
    assert mt.load_checkpoint(ckpt, fresh, fresh_opt) == {"rollout": 1, "data_pos": 64}
    now = _weights(fresh)
    assert all(torch.equal(saved[k], now[k]) for k in saved)
    _train_step(fresh, fresh_opt, micro)
    after = _weights(fresh)
    assert [k for k in continued if not torch.equal(continued[k], after[k])] == []

    mt.save_checkpoint(ckpt, 2, fresh, fresh_opt, {"rollout": 2})  # the leftover temp dir is replaced
    assert mt.latest_step(ckpt) == 2 and not (ckpt / "iter_0000002.tmp").exists()

    # model-only checkpoints (the converter's output) load into a bare, differently initialised GPTModel
    from kimi_pipeline.model.megatron_model import build_model

    plain = tmp_path / "model_only"
    mt.save_model_only(plain, fresh)
    other = build_model(r.model, single_process, device=CPU)
    assert mt.load_model_only(plain, other) == 0
    mine, theirs = hf_bridge.model_tensors(fresh), hf_bridge.model_tensors(other)
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    with pytest.raises(mt.CheckpointError, match="no latest_checkpointed_iteration"):
        mt.load_model_only(tmp_path / "nothing", other)


@pytest.mark.slow  # two trainable models, two torch_dist saves (~15 s)
def test_checkpoints_of_megatrons_expert_modules_and_of_stacked_experts_load_into_each_other(
        single_process, tmp_path, monkeypatch):
    """A run checkpointed before the experts were stacked (megatron's SequentialMLP, also what a layout whose
    experts cannot stack builds) resumes with stacked experts: weights equal, Adam state carried (the next step
    lands where the SequentialMLP run's did, to grouped-GEMM rounding); and a stacked checkpoint loads back."""
    from kimi_pipeline.model import megatron_model
    from kimi_pipeline.model import megatron_train as mt

    r = load_recipe("tiny")
    tokens, targets = fixed_batch(r.model)
    micro = [{"tokens": tokens, "targets": targets}]

    def trainable(stacked: bool):
        with monkeypatch.context() as m:
            if not stacked:
                m.setattr(megatron_model, "stackable", lambda config, expert_tp: False)
            chunks, opt = mt.build_trainable(r.model, single_process, r.optimizer, device=CPU)
        assert hasattr(megatron_model.unwrap(chunks[0]).decoder.layers[1].mlp.experts, "fc1_weight") == stacked
        return chunks, opt

    old, old_opt = trainable(stacked=False)
    _train_step(old, old_opt, micro)
    mt.save_checkpoint(tmp_path / "sequential", 1, old, old_opt, {"rollout": 1})
    saved = _weights(old)
    _train_step(old, old_opt, micro)
    continued = _weights(old)

    new, new_opt = trainable(stacked=True)
    assert mt.load_checkpoint(tmp_path / "sequential", new, new_opt) == {"rollout": 1}
    assert [k for k, v in _weights(new).items() if not torch.equal(v, saved[k])] == []
    _train_step(new, new_opt, micro)
    after = _weights(new)
    worst = max(float((after[k] - continued[k]).abs().max()) for k in continued)
    moved = max(float((continued[k] - saved[k]).abs().max()) for k in continued)
    assert worst < 1e-3 * moved, (worst, moved)  # a fresh Adam would move by lr (~moved) in its first step

    mt.save_checkpoint(tmp_path / "stacked", 2, new, new_opt, {"rollout": 2})
    back, back_opt = trainable(stacked=False)
    assert mt.load_checkpoint(tmp_path / "stacked", back, back_opt) == {"rollout": 2}
    assert [k for k, v in _weights(back).items() if not torch.equal(v, after[k])] == []


# --------------------------------------------------------------------------- multi-process (real gloo ranks)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def assert_close_by_tensor(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rel: float) -> None:
    """Every tensor within `rel` of the largest value of its own reference (a floor of 1e-3 of the largest
    anywhere, for tensors that are (near) zero), and not all zero."""
    floor = 1e-3 * max(float(t.double().abs().max()) for t in expected.values())
    worst = {k: float((got[k].double() - t.double()).abs().max()) / max(float(t.double().abs().max()), floor)
             for k, t in expected.items()}
    assert max(worst.values()) < rel, sorted(worst.items(), key=lambda kv: -kv[1])[:5]
    assert sum(float(t.double().abs().sum()) for t in expected.values()) > 0


@pytest.mark.slow
def test_tp2_ep2_matches_one_process_and_checkpoints_reshard(tmp_path):
    """1 process vs TP2xEP2 (4 ranks, DDP + distributed optimizer); torch_dist 1 -> TP2xEP2 -> PP2xEP2."""
    from support.megatron_worker import launch

    base = {"weights": str(TINY_WEIGHTS), "batch": 8, "seq": 24}
    ck1, ck2 = tmp_path / "ck_single", tmp_path / "ck_tp2ep2"
    ref = launch("ops", 1, tmp_path / "a", dict(base, ops=[
        ["load_hf"], ["train", 2], ["export", str(tmp_path / "ref2.st")], ["save", str(ck1), 2],
        ["train", 1], ["eval"], ["export", str(tmp_path / "ref3.st")],
    ]))[0]
    par = launch("ops", 4, tmp_path / "b", dict(base, tp=2, ep=2, ops=[
        ["load_hf"], ["train", 2],
        ["load", str(ck1)], ["export", str(tmp_path / "b2.st")],
        ["train", 1], ["eval"], ["export", str(tmp_path / "b3.st")], ["logprobs"], ["save", str(ck2), 3],
    ]))
    assert all(p == par[0] for p in par[1:]), "ranks disagree"
    par = par[0]

    # same weights, same batch: the TP2xEP2 loss and grad norm equal the one-process ones
    assert par["losses"][0] == pytest.approx(ref["losses"][0], rel=1e-6)
    assert par["grad_norms"][0] == pytest.approx(ref["grad_norms"][0], rel=1e-5)
    assert par["losses"][1] == pytest.approx(ref["losses"][1], rel=1e-5)  # after a distributed-optimizer step

    # the one-process checkpoint loads under TP2xEP2: every tensor equal, extra state back
    ref2, b2 = _tensors(tmp_path / "ref2.st"), _tensors(tmp_path / "b2.st")
    assert sorted(ref2) == sorted(b2)
    assert [k for k in ref2 if not torch.equal(ref2[k], b2[k])] == []
    assert par["extra"][0]["rollout"] == 2 and par["extra"][0]["data_pos"] == [1, 2]

    # ...including the Adam state: one more step from it lands where the one-process run did
    ref3, b3 = _tensors(tmp_path / "ref3.st"), _tensors(tmp_path / "b3.st")
    worst = max((ref3[k].double() - b3[k].double()).abs().max().item() for k in ref3)
    assert worst < 1e-5, worst
    assert par["eval"][0] == pytest.approx(ref["eval"][0], rel=1e-5)

    # the TP2xEP2 checkpoint loads under PP2xEP2 (pipeline stages), bit-exact, logprobs on every stage
    pp = launch("ops", 4, tmp_path / "c", dict(base, pp=2, ep=2, micro=2, ops=[
        ["load", str(ck2)], ["export", str(tmp_path / "c3.st")], ["logprobs"],
    ]))
    c3 = _tensors(tmp_path / "c3.st")
    assert [k for k in b3 if not torch.equal(b3[k], c3[k])] == []
    assert all(p["logprobs"] == pp[0]["logprobs"] for p in pp)
    assert pp[0]["logprobs"][0][0] == pytest.approx(par["logprobs"][0][0], rel=1e-6)
    assert "tp=2" in pp[0]["extra"][0]["layout"]
    assert json.loads((ck2 / "latest_checkpointed_iteration.txt").read_text()) == 3


@pytest.mark.slow
def test_pp2_step_on_uneven_micro_batches_has_the_pp1_gradients(tmp_path):
    """Issue 14 items 4 and 10: at PP 2 micro-batches of 3 and 2 samples (different lengths) and a padding
    micro-batch run unpadded (megatron exchanges shapes) and give the PP 1 gradients; padding rows used to
    scale the gradient by real/padded rows."""
    from support.megatron_worker import launch

    args = {"weights": str(TINY_WEIGHTS)}
    one = launch("grpo_padded", 1, tmp_path / "pp1", args)[0]
    two = launch("grpo_padded", 2, tmp_path / "pp2", dict(args, pp=2))
    assert one["rows"] == two[0]["rows"] == [3, 2, 1]  # no padding to one shape
    assert one["real_rows"] == two[1]["real_rows"] == 5.0  # the padding micro-batch adds no row
    assert one["ok"] and two[0]["ok"] and two[0]["grad_norm"] == two[1]["grad_norm"]
    assert two[0]["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    # every parameter's gradient, not only their norm: PP 2 (two stages, gathered) equals PP 1
    g1, g2 = _tensors(tmp_path / "pp1" / "grads.safetensors"), _tensors(tmp_path / "pp2" / "grads.safetensors")
    assert sorted(g1) == sorted(g2) and len(g1) > 10
    assert_close_by_tensor(g2, g1, 1e-5)
    for rank in [one, *two]:  # issue 42: the micro-batches wait for the device only where megatron must
        assert_only_megatrons_host_syncs(rank["host_syncs"])


def assert_only_megatrons_host_syncs(syncs: dict) -> None:
    """A GRPO step's forward_backward (model/host_syncs.py): none of ours; megatron's MoE dispatcher waits for its
    token counts once per MoE layer and micro-batch (on every rank, whatever the EP split), and the per-token
    loss reads the step's token count once."""
    assert syncs["ours"] == [], "\n".join(syncs["ours"])
    events = [s for s in syncs["megatron"] if s.startswith("cuda.Event.synchronize at")]
    assert all("token_dispatcher.py" in s for s in events)
    assert len(events) == syncs["moe_layers"] * syncs["micro_batches"]
    assert len([s for s in syncs["megatron"] if "finalize_model_grads.py" in s]) <= 1


@pytest.mark.slow
def test_an_ep2_grpo_step_waits_for_the_device_only_where_megatron_must(tmp_path):
    """Issue 42 item 1 at EP 2 over gloo (under TORCH_DISTRIBUTED_DEBUG=DETAIL): the same GRPO step as above with
    the routed experts split over two ranks (token all-to-alls with host split sizes) makes no host sync of ours."""
    from support.megatron_worker import launch

    ranks = launch("grpo_padded", 2, tmp_path / "ep2", {"weights": str(TINY_WEIGHTS), "ep": 2},
                   env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert all(r["ok"] for r in ranks) and ranks[0]["grad_norm"] == ranks[1]["grad_norm"]
    for rank in ranks:
        assert_only_megatrons_host_syncs(rank["host_syncs"])


@pytest.mark.slow
def test_grpo_at_dp2_has_the_dp1_losses_and_gradients(tmp_path):
    """The trainer's GRPO step (PolicyWorker.train, the recipe's split, dynamic micro-batches, KL on) on the same
    16 samples at DP 1 and DP 2: the same gradient for every parameter before each optimizer step, the same
    weights after, the same loss metrics as the trainer group reports them."""
    from support.megatron_worker import launch

    from kimi_pipeline.rl.step_metrics import Metric, reduce_metrics

    args = {"model": str(TINY_WEIGHTS)}
    one = launch("grpo_dp", 1, tmp_path / "dp1", args)
    two = launch("grpo_dp", 2, tmp_path / "dp2", args)
    assert [(r["dp"], r["steps"], r["global_batch_size"]) for r in one + two] == [(1, 2, 8)] + [(2, 2, 8)] * 2
    assert [r["samples"] for r in two] == [8, 8] and one[0]["samples"] == 16
    assert all(n >= 2 for r in one + two for n in r["micro_batches"]), "each step accumulates micro-batches"
    for k in range(2):  # each optimizer step's gradient, parameter by parameter
        g1 = _tensors(tmp_path / "dp1" / f"grads{k}.safetensors")
        g2 = _tensors(tmp_path / "dp2" / f"grads{k}.safetensors")
        assert sorted(g1) == sorted(g2) and len(g1) > 10
        assert_close_by_tensor(g2, g1, 1e-5)
    # the weights after the two Adam steps: Adam divides each gradient by its own magnitude, so an element whose
    # gradient is ~0 moves by noise; a wrong optimizer shard would move whole tensors by ~lr (measured: 0.011 lr)
    w1, w2 = _tensors(tmp_path / "dp1" / "weights.safetensors"), _tensors(tmp_path / "dp2" / "weights.safetensors")
    lr = load_recipe("tiny").optimizer.lr
    assert max(float((w2[k].double() - w1[k].double()).abs().max()) for k in w1) < 0.1 * lr
    # the metrics row: DP 2's ranks combined as the trainer group combines them
    ranks = [{k: Metric(v, red, w) for k, (v, red, w) in r["metrics"].items()} for r in two]
    combined, ref = reduce_metrics(ranks, equal_weights=True), one[0]["metrics"]
    for key in ("loss", "pg_loss", "kl", "ppo_kl", "entropy", "clip_fraction", "tis_mean", "tis_min", "tis_max",
                "grad_norm", "optimizer_steps"):
        assert float(combined[key]) == pytest.approx(ref[key][0], rel=1e-5, abs=1e-7), key
    assert ref["kl"][0] > 0 and ref["clip_fraction"][0] > 0  # the second step moved off the reference and the clip

