"""Weight sync in the engine's own format (issue 15 item 1): the seeds' engines serve INT4 compressed-tensors
(K2-Thinking, K2.5) or FP8 blocks (K2-Instruct), not the trainer's bf16. The trainer converts each bucket;
the embedded engine dequantizes what SGLang loads natively, even when a Linear's parts straddle buckets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kimi_pipeline.engine.model import EngineModel, EngineWeightError, iter_safetensors
from kimi_pipeline.hf.int4 import fake_quant_int4
from kimi_pipeline.hf.int4_checkpoint import KEEP_FP32, is_quantized
from kimi_pipeline.hf.source_formats import dequant_fp8_block, quantize_fp8_block
from kimi_pipeline.recipes import load_recipe
from kimi_pipeline.weight_sync.formats import to_engine_format
from kimi_pipeline.weight_sync.push import chunk_named_tensors
from kimi_pipeline.weight_sync.updaters import SyncSections

TINY_MODEL = Path(__file__).resolve().parents[2] / "data" / "tiny" / "model"

# ---------------------------------------------------------------- FP8 block oracle (independent of the product)
# Kimi-K2-Instruct's / DeepSeek-V3's block FP8 (config `quant_method: fp8, fmt: e4m3, weight_block_size:
# [128, 128]`), written out block by block from the format's definition rather than taken from
# kimi_pipeline: each 128×128 block (the last row/column of blocks may be partial) is stored as
# float8_e4m3fn values q = clamp(w / s, ±448) and one float32 `weight_scale_inv` s = amax(|block|) / 448,
# so that the dequantized weight is q × s. An all-zero block stores zeros; its s only has to be finite.
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448: the largest finite e4m3 value
BLOCK = 128


def _blocks(rows: int, cols: int) -> list[tuple[int, int, slice, slice]]:
    return [(i, j, slice(r, min(r + BLOCK, rows)), slice(c, min(c + BLOCK, cols)))
            for i, r in enumerate(range(0, rows, BLOCK)) for j, c in enumerate(range(0, cols, BLOCK))]


def oracle_fp8_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 weight_scale_inv of shape ceil(rows/128) × ceil(cols/128))."""
    rows, cols = w.shape
    q = torch.zeros(rows, cols, dtype=torch.float8_e4m3fn)
    scale_inv = torch.ones(-(-rows // BLOCK), -(-cols // BLOCK), dtype=torch.float32)
    for i, j, r, c in _blocks(rows, cols):
        block = w[r, c].float()
        amax = block.abs().max()
        s = amax / FP8_MAX if amax > 0 else torch.tensor(1.0)  # an all-zero block: zeros, scale 1
        scale_inv[i, j] = s
        q[r, c] = (block / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale_inv


def oracle_fp8_dequantize(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """float32 weight = q × its block's weight_scale_inv."""
    out = torch.empty(q.shape, dtype=torch.float32)
    for i, j, r, c in _blocks(*q.shape):
        out[r, c] = q[r, c].float() * scale_inv[i, j]
    return out


def _fp8_test_weight() -> torch.Tensor:
    """300×200: 3×2 blocks, the last row of blocks 44 rows high and the last column 72 wide; block
    magnitudes 1e-3 … 1e2 apart (a per-tensor scale would flush the small blocks to zero) and one all-zero
    block; block (1, 1)'s largest magnitude is exactly 896, so its scale_inv must be exactly 2."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g)
    for (i, j), m in {(0, 0): 1e-3, (0, 1): 1.0, (1, 1): 10.0, (2, 0): 0.05, (2, 1): 100.0}.items():
        w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] *= m
    w[BLOCK:2 * BLOCK, :BLOCK] = 0.0
    w[130, 140] = -896.0
    return w


def test_oracle_fp8_is_the_block_format():
    """The oracle itself: known values, and every block within e4m3's rounding of its own magnitude."""
    w = _fp8_test_weight()
    q, s = oracle_fp8_quantize(w)
    assert s.shape == (3, 2) and s[1, 1] == 2.0 and q[130, 140].float() == -FP8_MAX
    assert s[1, 0] == 1.0 and not q[BLOCK:2 * BLOCK, :BLOCK].float().any()
    d = oracle_fp8_dequantize(q, s)
    for i, j, r, c in _blocks(*w.shape):
        amax = w[r, c].abs().max()
        # e4m3 keeps 3 mantissa bits: half a step is at most 1/16 of the value, so of the block's max
        assert (d[r, c] - w[r, c]).abs().max() <= amax / 16, (i, j)
        if amax > 0:
            assert (d[r, c] - w[r, c]).abs().max() > 0, (i, j)  # it really was rounded to 8 bits


def test_fp8_block_quantization_matches_the_oracle_bit_for_bit():
    """The product's quantizer (weight sync to an FP8 engine, FP8 checkpoint copies) stores the oracle's
    bytes and scales, including partial edge blocks and a zero block; its dequantization (conversion of an
    FP8 source, the engine loading FP8 buckets) reproduces the oracle's from either one's tensors."""
    w = _fp8_test_weight()
    q, s = quantize_fp8_block(w, (BLOCK, BLOCK))
    want_q, want_s = oracle_fp8_quantize(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == want_s.shape == (3, 2)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    nonzero = torch.zeros(3, 2, dtype=torch.bool)
    for i, j, r, c in _blocks(*w.shape):
        nonzero[i, j] = bool(w[r, c].any())
    assert nonzero.sum() == 5
    assert torch.equal(s[nonzero], want_s[nonzero])  # amax / 448, per block, not per tensor, not inverted
    assert torch.isfinite(s).all() and (s > 0).all()  # the zero block's scale too
    want = oracle_fp8_dequantize(want_q, want_s)
    assert torch.equal(dequant_fp8_block(q, s, (BLOCK, BLOCK)), want)
    assert torch.equal(dequant_fp8_block(want_q, want_s, (BLOCK, BLOCK)), want)  # a checkpoint as shipped
    assert not want[BLOCK:2 * BLOCK, :BLOCK].any()


def _expected(name: str, t: torch.Tensor, fmt: str) -> torch.Tensor:
    """What an engine serving `fmt` holds for trainer tensor `t`."""
    if not t.is_floating_point() or name.endswith(KEEP_FP32):
        return t
    if fmt == "int4" and is_quantized(name):
        return fake_quant_int4(t, 32)
    if fmt == "fp8" and name.endswith(("_proj.weight", "_proj_with_mqa.weight")):
        return oracle_fp8_dequantize(*oracle_fp8_quantize(t))
    return t.to(torch.bfloat16)


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_engine_weights_from_quantized_buckets_equal_the_dequantized_source(fmt):
    src = dict(iter_safetensors(TINY_MODEL))
    engine = EngineModel.from_pretrained(TINY_MODEL)
    sent = list(to_engine_format(src.items(), fmt, 32))
    names = {n for n, _ in sent}
    expert = "model.layers.1.mlp.experts.3.down_proj"
    if fmt == "int4":
        assert {f"{expert}.weight_packed", f"{expert}.weight_scale", f"{expert}.weight_shape"} <= names
        assert f"{expert}.weight" not in names and "model.layers.1.self_attn.o_proj.weight" in names
    else:
        sent_d = dict(sent)
        assert sent_d[f"{expert}.weight"].dtype == torch.float8_e4m3fn and f"{expert}.weight_scale_inv" in names
        assert sent_d["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert dict(sent)["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    buckets = list(chunk_named_tensors(sent, 6000))
    straddling = sum(1 for a, b in zip(buckets, buckets[1:])
                     if {n.rsplit(".", 1)[0] for n in a} & {n.rsplit(".", 1)[0] for n in b})
    assert len(buckets) > 5 and straddling > 0, straddling  # some Linears' parts arrive in two buckets
    for b in buckets:
        engine.load_weights(b.items())
    engine.finish_update()
    for name in engine.weight_names():
        want = _expected(name, src[name], fmt).to(engine.dtype)
        assert torch.equal(engine._params[name], want), name
    sent_bytes = sum(t.numel() * t.element_size() for _, t in sent)
    bf16_bytes = sum(t.numel() * 2 for t in src.values())
    assert sent_bytes < (0.75 if fmt == "int4" else 0.6) * bf16_bytes


def test_incomplete_quantized_weights_are_refused():
    src = dict(iter_safetensors(TINY_MODEL))
    engine = EngineModel.from_pretrained(TINY_MODEL)
    parts = dict(to_engine_format([("model.layers.2.mlp.experts.0.up_proj.weight",
                                    src["model.layers.2.mlp.experts.0.up_proj.weight"])], "int4", 32))
    engine.load_weights([(n, t) for n, t in parts.items() if not n.endswith("weight_scale")])
    with pytest.raises(EngineWeightError, match="experts.0.up_proj with only"):
        engine.finish_update()
    engine.finish_update()  # the refused update does not poison the next one


def served(recipe) -> str:
    """The format the run's engines are sent, as the driver resolves it for the trainer ranks."""
    return SyncSections.of(recipe).weight_format


def test_auto_format_follows_the_seeds():
    assert served(load_recipe("kimi-k2-thinking")) == "int4"
    assert served(load_recipe("kimi-k2.5")) == "int4"
    assert served(load_recipe("kimi-k2-instruct")) == "fp8"
    assert served(load_recipe("tiny")) == "model"  # the embedded engine holds the trainer's dtype
    assert served(load_recipe("tiny", ["rollout.engine_weight_format=int4"])) == "int4"


@pytest.mark.parametrize(("colocate", "weight_sync"), [(True, "auto"), (False, "auto"), (True, "disk")])
def test_policy_sync_in_int4_gives_the_engine_the_trainers_fake_quant_policy(colocate, weight_sync, tmp_path):
    """A QAT policy synced as INT4 buckets (colocated: through shared memory; not: broadcast over a gloo
    weight-update group): the engine's experts are exactly the fake-quant weights the trainer's forward
    uses; the rest is the bf16 an INT4 checkpoint stores."""
    from kimi_pipeline.engine.rollout_engine import RolloutEngine
    from kimi_pipeline.engine.server import EngineServer
    from kimi_pipeline.rl.policy import PolicySections, PolicyWorker

    recipe = load_recipe("tiny", ["quant.int4_qat=true", "rollout.engine_weight_format=int4",
                                  "rollout.update_weight_buffer_size=262144", f"cluster.colocate={str(colocate).lower()}",
                                  f"rollout.weight_sync={weight_sync}"])
    w = PolicyWorker(PolicySections.of(recipe))
    engine = RolloutEngine(EngineModel.from_pretrained(TINY_MODEL), seed=0)
    try:
        w.load(str(tmp_path / "checkpoints"), str(TINY_MODEL))
        with EngineServer(engine) as server:
            metrics = w.sync_weights([server.url], "v1")
            assert engine.weight_version == "v1"
            if weight_sync == "disk":  # the explicit fallback: an INT4 HF checkpoint on shared storage
                synced = tmp_path / "weight-sync" / "v1"
                assert server.model_path == str(synced)
                assert json.loads((synced / "config.json").read_text())["quantization_config"]["format"] == "pack-quantized"
            else:
                assert metrics["sync_chunks"] > 1 and bool(server.weight_groups) is not colocate
        policy = dict(w.hf_tensors())  # what the trainer's forward sees (QAT: fake-quant experts)
        stored = dict(w.hf_tensors(fake_quant=False))
        got = engine.model
        for name in got.weight_names():
            if is_quantized(name):
                want = policy[name]
                assert not torch.equal(want, stored[name])  # fake-quant did change these
            else:
                want = _expected(name, stored[name], "int4")
            assert torch.equal(got._params[name], want.to(got.dtype)), name
    finally:
        w.release()
        w.close()
