"""Weight sync in the engine's own format (issue 15 item 1): the seeds' engines serve INT4 compressed-tensors
(K2-Thinking, K2.5) or FP8 blocks (K2-Instruct), not the trainer's bf16. The trainer converts each bucket;
the embedded engine dequantizes what SGLang loads natively, even when a Linear's parts straddle buckets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kimi_pipeline.convert.dequant import dequant_fp8_block, quantize_fp8_block
from kimi_pipeline.quant.engine_format import engine_weight_format, to_engine_format
from kimi_pipeline.quant.export import KEEP_FP32, is_quantized
from kimi_pipeline.quant.int4 import fake_quant_int4
from kimi_pipeline.recipes import load_recipe
from kimi_pipeline.rl.engine.client import chunk_named_tensors
from kimi_pipeline.rl.engine.model import EngineModel, EngineWeightError, iter_safetensors

TINY_MODEL = Path(__file__).resolve().parents[2] / "data" / "tiny" / "model"


def _expected(name: str, t: torch.Tensor, fmt: str) -> torch.Tensor:
    """What an engine serving `fmt` holds for trainer tensor `t`."""
    if not t.is_floating_point() or name.endswith(KEEP_FP32):
        return t
    if fmt == "int4" and is_quantized(name):
        return fake_quant_int4(t, 32)
    if fmt == "fp8" and name.endswith(("_proj.weight", "_proj_with_mqa.weight")):
        return dequant_fp8_block(*quantize_fp8_block(t, (128, 128)), (128, 128))
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


def test_auto_format_follows_the_seeds():
    assert engine_weight_format(load_recipe("kimi-k2-thinking")) == "int4"
    assert engine_weight_format(load_recipe("kimi-k2.5")) == "int4"
    assert engine_weight_format(load_recipe("kimi-k2-instruct")) == "fp8"
    assert engine_weight_format(load_recipe("tiny")) == "model"  # the embedded engine holds the trainer's dtype
    assert engine_weight_format(load_recipe("tiny", ["rollout.engine_weight_format=int4"])) == "int4"


@pytest.mark.parametrize(("colocate", "weight_sync"), [(True, "auto"), (False, "auto"), (True, "disk")])
def test_policy_sync_in_int4_gives_the_engine_the_trainers_fake_quant_policy(colocate, weight_sync, tmp_path):
    """A QAT policy synced as INT4 buckets (colocated: through shared memory; not: broadcast over a gloo
    weight-update group): the engine's experts are exactly the fake-quant weights the trainer's forward
    uses; the rest is the bf16 an INT4 checkpoint stores."""
    from kimi_pipeline.rl.engine.sampler import RolloutEngine
    from kimi_pipeline.rl.engine.server import EngineServer
    from kimi_pipeline.rl.policy import PolicyWorker

    recipe = load_recipe("tiny", ["quant.int4_qat=true", "rollout.engine_weight_format=int4",
                                  "rollout.update_weight_buffer_size=262144", f"cluster.colocate={str(colocate).lower()}",
                                  f"rollout.weight_sync={weight_sync}"])
    w = PolicyWorker(recipe)
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
