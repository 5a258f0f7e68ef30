"""HF DeepseekV3ForCausalLM <-> megatron GPTModel: names, shard slicing, logits parity, bit-exact round trip.

The HF side is transformers' own DeepSeek-V3 implementation (the architecture Kimi-K2 ships), randomly
initialised from the tiny recipe's shape, with a random expert bias so routing depends on it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kimi_pipeline.hf import names
from kimi_pipeline.hf.config import hf_config_dict
from kimi_pipeline.model import hf_bridge
from kimi_pipeline.recipes import load_recipe
from kimi_pipeline.recipes.layout import Layout

CPU = torch.device("cpu")

LOGITS_ATOL = 1e-5  # fp32; measured max |diff| ~4e-7 on logits of magnitude ~1


@pytest.fixture(scope="module")
def spec():
    return load_recipe("tiny").model


def hf_model(spec, seed: int = 0):
    import transformers

    cfg = hf_config_dict(spec)
    cfg.pop("architectures")
    cfg.pop("model_type")  # kimi_k2 is DeepSeek-V3; transformers knows it only as deepseek_v3
    cfg["torch_dtype"] = "float32"
    config = transformers.DeepseekV3Config(**cfg)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.05)
    return model


@pytest.fixture(scope="module")
def hf_saved(spec, tmp_path_factory):
    """(model, {name: tensor} as written on disk by save_pretrained)."""
    from kimi_pipeline.hf.reader import iter_stored_tensors

    model = hf_model(spec)
    out: Path = tmp_path_factory.mktemp("hf")
    model.save_pretrained(out)
    return model, dict(iter_stored_tensors(out))


@pytest.fixture(scope="module")
def single_process():
    from kimi_pipeline.model import parallel

    layout = Layout()
    parallel.init_distributed(layout, device=CPU)
    yield layout
    parallel.destroy()


def test_checkpoint_names_are_exactly_the_mapped_names(spec, hf_saved):
    _, disk = hf_saved
    assert names.check_complete(disk, spec) == []
    assert sorted(disk) == sorted(names.all_hf_names(spec))
    assert all(s == tuple(disk[n].shape) for n, s in names.hf_shapes(spec).items() if n in disk)


def test_unfuse_matches_disk_layout(hf_saved):
    model, disk = hf_saved
    state = {k: v for k, v in model.state_dict().items() if k in disk or ".experts." in k}
    unfused = names.unfuse_hf_experts(state)
    assert set(unfused) == set(disk)
    assert all(torch.equal(unfused[k], disk[k]) for k in disk)


def test_logits_parity_and_bit_exact_round_trip(spec, hf_saved, single_process):
    from kimi_pipeline.model import megatron_model as mm

    model, disk = hf_saved
    torch.manual_seed(1)
    mg = mm.build_model(spec, single_process, device=CPU).eval()
    read = hf_bridge.load_hf_tensors_into_model(mg, disk.__getitem__, spec, single_process)
    assert sorted(read) == sorted(disk)
    tokens = torch.randint(0, spec.vocab_size, (3, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(tokens).logits
        got = mm.causal_forward(mg, tokens)
    diff = (ref - got).abs().max().item()
    assert diff < LOGITS_ATOL, f"HF vs megatron logits differ by {diff}"
    assert torch.equal(ref.argmax(-1), got.argmax(-1))

    back = dict(hf_bridge.export_hf_tensors(mg, spec, single_process))
    assert sorted(back) == sorted(disk)
    mismatched = [k for k in disk if not (back[k].dtype == disk[k].dtype and torch.equal(back[k], disk[k]))]
    assert mismatched == [], f"HF -> megatron -> HF not bit-exact: {mismatched[:5]}"


def test_expert_bias_changes_routing(spec, hf_saved, single_process):
    """The bias must reach the router: zeroing it changes the logits (so parity above is meaningful)."""
    from kimi_pipeline.model import megatron_model as mm

    _, disk = hf_saved
    zeroed = {k: (torch.zeros_like(v) if k.endswith("e_score_correction_bias") else v) for k, v in disk.items()}
    mg = mm.build_model(spec, single_process, device=CPU).eval()
    tokens = torch.randint(0, spec.vocab_size, (2, 32), generator=torch.Generator().manual_seed(4))
    hf_bridge.load_hf_tensors_into_model(mg, disk.__getitem__, spec, single_process)
    with torch.no_grad():
        a = mm.causal_forward(mg, tokens)
    hf_bridge.load_hf_tensors_into_model(mg, zeroed.__getitem__, spec, single_process)
    with torch.no_grad():
        b = mm.causal_forward(mg, tokens)
    assert (a - b).abs().max().item() > 1e-4


def test_loader_fails_on_missing_or_misshaped_tensor(spec, hf_saved, single_process):
    from kimi_pipeline.model import megatron_model as mm

    _, disk = hf_saved
    mg = mm.build_model(spec, single_process, device=CPU)
    gone = "model.layers.2.mlp.experts.5.up_proj.weight"
    with pytest.raises(names.NameMappingError, match="experts.5.up_proj"):
        hf_bridge.load_hf_tensors_into_model(mg, lambda n: None if n == gone else disk[n], spec, single_process)
    bad = "model.layers.1.self_attn.kv_b_proj.weight"
    with pytest.raises(names.NameMappingError, match="kv_b_proj"):
        hf_bridge.load_hf_tensors_into_model(mg, lambda n: disk[n][:-1] if n == bad else disk[n], spec, single_process)


def test_positions_must_be_left_aligned(spec, single_process):
    from kimi_pipeline.model import megatron_model as mm

    mg = mm.build_model(spec, single_process, device=CPU)
    tokens = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="right-pad"):
        mm.causal_forward(mg, tokens, position_ids=torch.tensor([[0, 0, 1, 2]]))


# --------------------------------------------------------------------------- pure name/shard functions


def test_tp_slices_reassemble_and_fc1_is_interleaved_per_partition(spec):
    layout = Layout(world_size=4, tp=4, etp=4)
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s, generator=g) for n, s in names.hf_shapes(spec).items()}
    per_rank = [names.hf_to_megatron_names(spec, layout, tp_rank=r, etp_rank=r) for r in range(4)]
    assert [len(x) for x in per_rank] == [len(per_rank[0])] * 4
    for shards in zip(*per_rank):
        parts = [names.shard_from_hf(s, [full[n] for n in s.hf]) for s in shards]
        back = names.hf_from_gathered(shards[0], parts)
        assert all(torch.equal(b, full[n]) for b, n in zip(back, shards[0].hf)), shards[0]
    fc1 = next(s for s in per_rank[1] if s.megatron == "decoder.layers.0.mlp.linear_fc1.weight")
    gate, up = full[fc1.hf[0]], full[fc1.hf[1]]
    f = spec.ffn_hidden_size // 4
    expect = torch.cat([gate[f : 2 * f], up[f : 2 * f]])
    assert torch.equal(names.shard_from_hf(fc1, [gate, up]), expect)
    o_proj = next(s for s in per_rank[0] if s.hf == ("model.layers.0.self_attn.o_proj.weight",))
    assert (o_proj.dim, o_proj.size) == (1, 4)


def test_pipeline_and_expert_ranks_partition_the_checkpoint(spec):
    layout = Layout(world_size=4, pp=2, ep=2)
    seen: list[str] = []
    for pp in range(2):
        for ep in range(2):
            seen += [n for n in names.hf_names_for_rank(spec, layout, pp, ep) if ".experts." in n or ep == 0]
    assert sorted(seen) == sorted(names.all_hf_names(spec))
    stage1 = names.megatron_to_hf_names(spec, layout, pp_rank=1, ep_rank=1)
    s = stage1["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"]
    assert s.hf == ("model.layers.2.mlp.experts.8.gate_proj.weight", "model.layers.2.mlp.experts.8.up_proj.weight")
    assert "output_layer.weight" in stage1 and "embedding.word_embeddings.weight" not in stage1


def test_te_names_differ_only_where_documented(spec):
    layout = Layout()
    local = {s.hf: s.megatron for s in names.hf_to_megatron_names(spec, layout)}
    te = {s.hf: s.megatron for s in names.hf_to_megatron_names(spec, layout, use_te=True)}
    diff = {local[k]: te[k] for k in local if local[k] != te[k]}
    assert diff["decoder.layers.1.self_attention.q_layernorm.weight"] == (
        "decoder.layers.1.self_attention.linear_q_up_proj.layer_norm_weight"
    )
    assert diff["decoder.layers.0.pre_mlp_layernorm.weight"] == "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"
    assert diff["decoder.layers.3.mlp.experts.local_experts.15.linear_fc2.weight"] == (
        "decoder.layers.3.mlp.experts.linear_fc2.weight15"
    )
    allowed = ("q_layernorm", "kv_layernorm", "layers.0.pre_mlp_layernorm", "local_experts")
    assert all(any(a in k for a in allowed) for k in diff), sorted(diff)
