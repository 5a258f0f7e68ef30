"""Rollout engine: parity with transformers, sampling semantics, and the HTTP server/client/router for real."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from support import engine_http
from support.common import assert_bf16_engine_tracks_fp32, random_tiny_hf

from kimi_pipeline.engine import model as engine_model
from kimi_pipeline.engine.client import EngineBadRequest, EngineClient, Router
from kimi_pipeline.engine.model import EngineModel, EngineWeightError, iter_safetensors
from kimi_pipeline.engine.rollout_engine import EngineInputError, RolloutEngine, SamplingParams, sample_tokens
from kimi_pipeline.engine.server import EngineServer
from kimi_pipeline.engine.sglang import sglang_command
from kimi_pipeline.engine.static_decode import (
    batch_bucket,
    batch_buckets,
    cache_bucket,
    default_decode_mode,
    graphs_supported,
)
from kimi_pipeline.errors import PermanentError
from kimi_pipeline.hf.config import hf_config_dict
from kimi_pipeline.model.hf_model import save_hf_model
from kimi_pipeline.recipes import load_recipe
from kimi_pipeline.weight_sync.push import chunk_named_tensors

ROOT = Path(__file__).resolve().parents[2]
TINY_MODEL = ROOT / "data" / "tiny" / "model"
EOS = 3


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _spec(**changes):
    return load_recipe("tiny").model.model_copy(update=changes)


@pytest.fixture(scope="module")
def hf_a():
    return random_tiny_hf(0)


@pytest.fixture(scope="module")
def hf_b():
    return random_tiny_hf(1)


def _prompts(g: torch.Generator, lengths=(5, 9, 12, 7)) -> list[list[int]]:
    return [torch.randint(4, 384, (n,), generator=g).tolist() for n in lengths]


def _hf_logits(hf, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([seq])).logits[0].float()


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> float:
    """Max abs difference, asserted within rel × the logits' scale (fp32 parity)."""
    diff = (a - b).abs().max().item()
    assert diff <= rel * max(1.0, b.abs().max().item()), diff
    return diff


# ---------------------------------------------------------------- forward parity


@pytest.mark.parametrize("variant", [
    {},  # kv latent (32) no wider than the nope/v heads: absorbed maps merged into q_b / o_proj
    {"q_lora_rank": None},  # merged into the fused q/kv down-projection instead
    # per-step absorption (latent wider than the heads, as in Kimi), group-limited top-2 routing, plain rope
    {"q_lora_rank": None, "kv_lora_rank": 48, "moe_router_num_groups": 4, "moe_router_group_topk": 2,
     "moe_router_topk": 2},
])
def test_prefill_and_decode_logits_match_transformers(variant):
    hf = random_tiny_hf(3, **variant)
    if "kv_lora_rank" in variant:
        hf.config.rope_interleave = False
    eng = EngineModel.from_hf_model(hf)
    assert eng.config.merge_absorbed == ("kv_lora_rank" not in variant)
    prompts = _prompts(torch.Generator().manual_seed(0))
    S = max(map(len, prompts))
    ids = torch.zeros(len(prompts), S, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    logits, cache, _ = eng.prefill(ids, all_logits=True)
    for i, p in enumerate(prompts):  # right padding never leaks into real positions
        _close(logits[i, : len(p)], _hf_logits(hf, p))
    # decode the longest prompt's tail one token at a time from a prefix cache
    seq = prompts[2]
    ref = _hf_logits(hf, seq)
    _, pre, _ = eng.prefill(torch.tensor([seq[:4]]))
    cache = eng.new_cache(1, len(seq))
    cache[:, :, :4] = pre
    for t in range(4, len(seq)):
        step, _ = eng.decode(torch.tensor([seq[t]]), torch.tensor([t]), cache, t + 1)
        _close(step[0], ref[t])


def test_bfloat16_engine_runs_the_same_model(hf_a):
    """The GPU dtype path (bf16 weights, fp32 router/softmax/logits) on CPU: close to fp32, samples fine."""
    assert_bf16_engine_tracks_fp32(hf_a, _prompts(torch.Generator().manual_seed(9), (12, 12)))


def test_grouped_matmul_fallback_matches(hf_a, monkeypatch):
    eng = EngineModel.from_hf_model(hf_a)
    ids = torch.tensor(_prompts(torch.Generator().manual_seed(1), (10, 10)))
    fast, _, ex_fast = eng.prefill(ids, all_logits=True)
    monkeypatch.setattr(engine_model, "grouped_mm_supported", lambda *a: False)  # the CUDA-fp32 / unaligned path
    slow, _, ex_slow = eng.prefill(ids, all_logits=True)
    assert torch.equal(ex_fast, ex_slow)
    _close(fast, slow, 1e-6)


def test_checkpoint_loading_is_strict(hf_a, tmp_path):
    out = save_hf_model(hf_a, tmp_path / "ckpt", config=hf_config_dict(_spec()), max_shard_size="1MB")
    disk = EngineModel.from_pretrained(out)  # per-expert on-disk names, kimi_k2 config
    mem = EngineModel.from_hf_model(hf_a)  # transformers' fused in-memory names
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(disk.prefill(ids)[0], mem.prefill(ids)[0])
    named = dict(iter_safetensors(out))
    with pytest.raises(EngineWeightError, match="missing"):
        mem.load_weights({k: v for k, v in named.items() if "experts.3.up_proj" not in k}, strict=True)
    with pytest.raises(EngineWeightError, match="shape"):
        mem.load_weights({"model.layers.1.mlp.experts.0.down_proj.weight": torch.zeros(3, 3)})
    with pytest.raises(EngineWeightError, match="not part of"):
        mem.load_weights({"model.layers.9.mlp.gate.weight": torch.zeros(16, 128)})


# ---------------------------------------------------------------- sampling


def test_logprobs_and_routed_experts_match_teacher_forced_transformers(hf_a):
    engine = RolloutEngine(EngineModel.from_hf_model(hf_a), seed=0)
    prompts = _prompts(torch.Generator().manual_seed(2))
    temp = 0.7
    out = engine.generate(prompts, 3, SamplingParams(temperature=temp, max_new_tokens=10, stop_token_ids=(), seed=7))
    assert [c.prompt_ids for c in out] == [p for p in prompts for _ in range(3)]
    picked: dict[int, torch.Tensor] = {}
    hooks = [layer.mlp.gate.register_forward_hook(lambda mod, inp, res, i=i: picked.__setitem__(i, res[2]))
             for i, layer in enumerate(hf_a.model.layers) if hasattr(layer.mlp, "gate")]
    try:
        for c in out:
            assert c.finish_reason == "length" and len(c.output_ids) == 10
            seq = c.prompt_ids + c.output_ids
            logits = _hf_logits(hf_a, seq[:-1])
            ref = torch.log_softmax(logits / temp, -1)[len(c.prompt_ids) - 1 :].gather(
                1, torch.tensor(c.output_ids)[:, None]).squeeze(1)
            assert torch.allclose(torch.tensor(c.logprobs), ref, atol=2e-5), (c.logprobs, ref)
            # routing replay data: what transformers' router picks on the same tokens, every layer
            assert c.routed_experts.dtype == np.int16
            assert c.routed_experts.shape == (len(seq) - 1, 3, 4)
            for m, layer in enumerate(sorted(picked)):
                hf_ids = np.sort(picked[layer].numpy(), axis=1)
                assert np.array_equal(np.sort(c.routed_experts[:, m], axis=1), hf_ids)
    finally:
        for h in hooks:
            h.remove()


def test_stop_tokens_end_samples_and_max_tokens_bounds_them(hf_a):
    engine = RolloutEngine(EngineModel.from_hf_model(hf_a), seed=0)
    stops = tuple(range(4, 384, 9))  # ~1 token in 9: most samples stop early, at different steps
    out = engine.generate(_prompts(torch.Generator().manual_seed(3)), 8,
                          SamplingParams(max_new_tokens=12, stop_token_ids=stops, seed=1))
    reasons = {c.finish_reason for c in out}
    assert reasons == {"stop", "length"}
    lengths = set()
    for c in out:
        inside = [t for t in c.output_ids[:-1] if t in stops]
        assert not inside  # generation stopped at the first stop token
        if c.finish_reason == "stop":
            assert c.output_ids[-1] in stops and c.matched_stop == c.output_ids[-1]
        else:
            assert len(c.output_ids) == 12
        assert len(c.logprobs) == len(c.output_ids)
        assert c.routed_experts.shape[0] == len(c.prompt_ids) + len(c.output_ids) - 1
        lengths.add(len(c.output_ids))
    assert len(lengths) > 3  # rows finished at many different steps (exercises batch compaction)


@pytest.mark.skipif(not (TINY_MODEL / "model.safetensors.index.json").is_file(), reason="no shipped tiny policy")
def test_shipped_tiny_policy_stops_on_eos():
    from kimi_pipeline.model.tokenizer import load_tokenizer
    from kimi_pipeline.rl.prompts import encode_prompt

    tok = load_tokenizer(TINY_MODEL)
    engine = RolloutEngine(EngineModel.from_pretrained(TINY_MODEL), seed=0)
    rows = [json.loads(line) for line in (TINY_MODEL.parent / "dapo-math-tiny.jsonl").read_text().splitlines()[:4]]
    prompts = [encode_prompt(tok, r["prompt"])[1] for r in rows]
    out = engine.generate(prompts, 2, SamplingParams(max_new_tokens=16, seed=0))  # default stop: config eos
    assert all(c.finish_reason == "stop" and c.output_ids[-1] == EOS for c in out)


def test_seeded_generation_is_deterministic(hf_a):
    engine = RolloutEngine(EngineModel.from_hf_model(hf_a), seed=0)
    prompts = _prompts(torch.Generator().manual_seed(4))
    p = SamplingParams(max_new_tokens=8, stop_token_ids=(), seed=11)
    a, b = engine.generate(prompts, 4, p), engine.generate(prompts, 4, p)
    c = engine.generate(prompts, 4, SamplingParams(max_new_tokens=8, stop_token_ids=(), seed=12))
    assert [x.output_ids for x in a] == [x.output_ids for x in b]
    assert [x.logprobs for x in a] == [x.logprobs for x in b]
    assert [x.output_ids for x in a] != [x.output_ids for x in c]
    # samples of one prompt share its prefill but are drawn independently
    assert len({tuple(x.output_ids) for x in a[:4]}) > 1


# ---------------------------------------------------------------- static decode (what CUDA graphs capture)


def test_static_decode_buckets():
    """SGLang's default capture sizes (1, 2, 4, 8, then steps of 8) and cache lengths in steps of 256."""
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 24, 25, 255, 256, 257)] == \
        [1, 2, 4, 4, 8, 8, 16, 16, 24, 24, 32, 256, 256, 264]
    assert batch_buckets(256) == [1, 2, 4, 8] + list(range(16, 257, 8))
    assert all(batch_bucket(n) in batch_buckets(256) for n in range(1, 257))  # every batch lands on a capture size
    assert batch_buckets(6) == [1, 2, 4]
    assert [cache_bucket(n) for n in (1, 255, 256, 257, 600)] == [256, 256, 256, 512, 768]
    assert [cache_bucket(n, 16) for n in (1, 16, 17, 33)] == [16, 16, 32, 48]
    with pytest.raises(ValueError):
        batch_bucket(0)


def test_decode_mode_is_chosen_from_the_models_device_and_dtype(hf_a):
    fp32, bf16 = EngineModel.from_hf_model(hf_a), EngineModel.from_hf_model(hf_a, dtype=torch.bfloat16)
    for m in (fp32, bf16):  # CUDA graphs need a CUDA device: never on CPU, whatever the dtype
        assert not graphs_supported(m) and default_decode_mode(m) == "dynamic"
        assert RolloutEngine(m).decode_mode == "dynamic" and RolloutEngine(m).static is None
        with pytest.raises(ValueError, match="graphs"):
            RolloutEngine(m, decode_mode="graphs")
    with pytest.raises(ValueError, match="decode_mode"):
        RolloutEngine(fp32, decode_mode="eager")
    static = RolloutEngine(fp32, decode_mode="static")
    assert static.decode_mode == "static" and not static.static.use_graphs
    params = SamplingParams(max_new_tokens=4, stop_token_ids=(), seed=0)
    out = RolloutEngine(bf16, decode_mode="static").generate(_prompts(torch.Generator().manual_seed(9), (12, 5)), 3,
                                                             params)
    assert all(len(c.output_ids) == 4 and np.isfinite(c.logprobs).all() for c in out)  # bf16: the GPU dtype


def _same_samples(a, b, atol: float = 2e-5) -> None:
    """Same tokens, finish reasons and routed experts; logprobs equal to fp32 rounding (other summation orders)."""
    assert [c.output_ids for c in a] == [c.output_ids for c in b]
    assert [(c.finish_reason, c.matched_stop) for c in a] == [(c.finish_reason, c.matched_stop) for c in b]
    for x, y in zip(a, b):
        assert len(x.logprobs) == len(y.logprobs) and np.allclose(x.logprobs, y.logprobs, atol=atol, rtol=0)
        assert np.array_equal(x.routed_experts, y.routed_experts)


def test_static_decode_draws_the_dynamic_paths_tokens(hf_a):
    """Issue 25 item 5 on CPU: the static-shape step (padded batch buckets, whole-bucket attention under the -inf
    mask, sync-free experts) run eagerly samples exactly what the dynamic loop samples for a seed, across batch and
    cache-length buckets, with rows stopping early so compaction moves live rows down into smaller buckets."""
    model = EngineModel.from_hf_model(hf_a)
    dynamic, static = RolloutEngine(model, decode_mode="dynamic"), RolloutEngine(model, decode_mode="static")
    static.static.cache_step = 16  # small cache buckets, so these short batches cross them
    stops = tuple(range(4, 384, 9))  # ~1 token in 9 ends a sample
    prompts = _prompts(torch.Generator().manual_seed(3))  # lengths 5, 9, 12, 7
    seen: set[tuple[int, int]] = set()
    for n, max_new, seed in ((5, 14, 1), (1, 3, 2), (3, 22, 5), (9, 10, 4)):  # 20, 4, 12, 36 rows
        params = SamplingParams(temperature=0.8, max_new_tokens=max_new, stop_token_ids=stops, seed=seed)
        static.static.steps.clear()
        a, b = dynamic.generate(prompts, n, params), static.generate(prompts, n, params)
        _same_samples(a, b)
        assert all(len(c.routed_experts) == len(c.prompt_ids) + len(c.output_ids) - 1 for c in b)
        steps = set(static.static.steps)
        assert {L for _, L in steps} == {cache_bucket(12 + max_new, 16)}
        if n > 1:  # rows stopped at many steps: the batch moved down through several buckets
            assert len({c.finish_reason for c in b}) == 2 and len({bb for bb, _ in steps}) >= 2
        seen |= steps
    assert {bb for bb, _ in seen} >= {1, 2, 4, 8, 16, 24, 32}
    assert len({L for _, L in seen}) >= 3
    # the buffers (with graphs: the captures reading them) outlive a batch; one that fits them reuses them
    cache = static.static.cache
    static.generate(prompts, 2, SamplingParams(max_new_tokens=5, stop_token_ids=(), seed=5))
    assert static.static.cache is cache


def test_static_decode_padding_rows_never_reach_the_outputs(hf_a):
    """Padding rows (ids past the live rows) share the batch's matmuls and expert groups but no output: another pad
    token, which routes differently, changes nothing the samples report."""
    model = EngineModel.from_hf_model(hf_a)
    prompts = _prompts(torch.Generator().manual_seed(5), (6, 11, 8))
    params = SamplingParams(max_new_tokens=9, stop_token_ids=tuple(range(4, 384, 7)), seed=3)  # 15 rows: bucket 16
    runs = []
    for pad in (0, 383):
        engine = RolloutEngine(model, decode_mode="static")
        engine.static.pad_id = pad
        runs.append(engine.generate(prompts, 5, params))
        assert len(runs[-1]) == 15 and all(len(c.output_ids) <= 9 for c in runs[-1])
    _same_samples(*runs, atol=1e-5)
    _same_samples(RolloutEngine(model, decode_mode="dynamic").generate(prompts, 5, params), runs[0])


def test_static_decode_through_the_per_expert_fallback(hf_a, monkeypatch):
    """Where grouped_mm does not take the operands (CUDA fp32, unaligned) the static step's group ends still work."""
    model = EngineModel.from_hf_model(hf_a)
    params = SamplingParams(max_new_tokens=6, stop_token_ids=(), seed=2)
    prompts = _prompts(torch.Generator().manual_seed(6), (7, 4))
    want = RolloutEngine(model, decode_mode="static").generate(prompts, 3, params)
    monkeypatch.setattr(engine_model, "grouped_mm_supported", lambda *a: False)
    _same_samples(RolloutEngine(model, decode_mode="static").generate(prompts, 3, params), want, atol=1e-5)


@pytest.mark.parametrize("variant", [{}, {"q_lora_rank": None}])  # merged weights in q_b / in the fused q/kv
def test_weight_updates_copy_in_place_so_captured_graphs_stay_valid(variant, hf_a, hf_b):
    """A CUDA graph reads every weight by address. load_weights copies into the engine's tensors and refresh copies
    the merged (derived) weights into theirs: no address changes, storage_epoch stays; the static path then
    samples what a fresh engine with the new weights samples. A rebound tensor is detected (the graphs' cue)."""
    src_a, src_b = (hf_a, hf_b) if not variant else (random_tiny_hf(5, **variant), random_tiny_hf(6, **variant))
    model = EngineModel.from_hf_model(src_a)
    engine = RolloutEngine(model, decode_mode="static")
    prompts = _prompts(torch.Generator().manual_seed(7), (5, 10))
    params = SamplingParams(max_new_tokens=6, stop_token_ids=(), seed=4)
    before = engine.generate(prompts, 2, params)
    storage = model._storage_signature()
    model.load_weights(src_b.state_dict().items())
    assert model._storage_signature() == storage and model.storage_epoch == 0
    fresh = RolloutEngine(EngineModel.from_hf_model(src_b), decode_mode="static").generate(prompts, 2, params)
    after = engine.generate(prompts, 2, params)
    assert [c.output_ids for c in after] == [c.output_ids for c in fresh] != [c.output_ids for c in before]
    assert [c.logprobs for c in after] == [c.logprobs for c in fresh]
    layer = model.layers[1]
    layer.o = layer.o.clone()  # what a loader that rebinds would do
    model.load_weights([])
    assert model.storage_epoch == 1


def test_sample_tokens_distribution_and_truncation():
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(20000, 4).contiguous()
    tok, lp = sample_tokens(logits, 1.0, 1.0, -1, g)
    freq = torch.bincount(tok, minlength=4).float() / len(tok)
    assert torch.allclose(freq, probs, atol=0.015), freq
    assert torch.allclose(lp, probs.log()[tok])
    tok, lp = sample_tokens(logits, 1.0, 0.7, -1, g)  # nucleus {0, 1}
    assert set(tok.tolist()) == {0, 1}
    assert torch.allclose(lp, probs.log()[tok])  # logprob of the untruncated distribution
    tok, _ = sample_tokens(logits, 1.0, 1.0, 3, g)
    assert set(tok.tolist()) == {0, 1, 2}
    tok, lp = sample_tokens(logits, 0.0, 1.0, -1, g)
    assert set(tok.tolist()) == {0} and torch.allclose(lp, probs.log()[0].expand(len(tok)))
    tok, lp = sample_tokens(logits, 2.0, 1.0, -1, g)  # temperature flattens
    assert torch.allclose(lp, torch.log_softmax(probs.log() / 2, -1)[tok])


def test_bad_requests_are_clear(hf_a):
    engine = RolloutEngine(EngineModel.from_hf_model(hf_a))
    with pytest.raises(EngineInputError, match="token ids"):
        engine.generate([[1, 999]])
    with pytest.raises(EngineInputError, match="empty"):
        engine.generate([[]])
    with pytest.raises(EngineInputError, match="positions"):
        engine.generate([[1, 2]], params=SamplingParams(max_new_tokens=5000))
    with pytest.raises(EngineInputError, match="top_p"):
        SamplingParams(top_p=0)


# ---------------------------------------------------------------- HTTP: server, client, router


@pytest.fixture(scope="module")
def servers(hf_a):
    started = [EngineServer(RolloutEngine(EngineModel.from_hf_model(hf_a), seed=i)) for i in range(2)]
    for s in started:
        s.start()
    yield started
    for s in started:
        s.stop()


def _reset(server: EngineServer, hf) -> None:
    server.engine.model.load_weights(hf.state_dict().items(), strict=True)
    server.engine.weight_version = "0"
    server.scheduler.resume()


def test_http_generate_equals_the_engine(servers, hf_a):
    server = servers[0]
    _reset(server, hf_a)
    assert server.url.startswith("http://127.0.0.1:")
    prompts = _prompts(torch.Generator().manual_seed(5))
    params = SamplingParams(temperature=1.0, max_new_tokens=6, stop_token_ids=(), seed=3)
    direct = RolloutEngine(EngineModel.from_hf_model(hf_a)).generate(prompts, 2, params)
    with EngineClient(server.url) as client:
        assert client.health() and client.health_generate()
        got = client.generate(prompts, 2, params, return_routed_experts=True)
    assert [c.output_ids for c in got] == [c.output_ids for c in direct]
    assert np.allclose([c.logprobs for c in got], [c.logprobs for c in direct])
    for g, d in zip(got, direct):
        assert g.finish_reason == d.finish_reason == "length" and g.weight_version == "0"
        assert np.array_equal(g.routed_experts, d.routed_experts)
    # SGLang's JSON shapes on the wire
    body = engine_http.post(server.url + "/generate", json={
        "input_ids": prompts[0], "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
        "return_logprob": True, "return_routed_experts": True}, timeout=60).json()
    meta = body["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    assert [len(x) for x in meta["output_token_logprobs"]] == [3, 3, 3]
    assert meta["completion_tokens"] == 3 and meta["weight_version"] == "0"
    ids = np.frombuffer(__import__("base64").b64decode(meta["routed_experts"]), dtype=np.int32)
    assert ids.reshape(len(prompts[0]) + 2, 4, 4)[:, 0].max() == 0  # dense layer 0 carries no experts


def test_sglang_stop_semantics():
    from kimi_pipeline.engine.server import sampling_params_from_json

    p, n = sampling_params_from_json({"stop_token_ids": [7], "n": 2}, eos_token_ids=(3,))
    assert p.stop_token_ids == (3, 7) and n == 2 and p.max_new_tokens == 128  # SGLang's defaults
    # SGLang: ignore_eos turns the stop ids off too (schedule_batch.py:1856-1858)
    p, _ = sampling_params_from_json({"stop_token_ids": [7], "ignore_eos": True}, eos_token_ids=(3,))
    assert p.stop_token_ids == ()
    with pytest.raises(EngineInputError, match="top_k must be -1"):  # SGLang's off is -1; 0 is its 400
        sampling_params_from_json({"top_k": 0})
    p, _ = sampling_params_from_json({"skip_special_tokens": False, "no_stop_trim": True, "top_k": -1}, (3,))
    assert p.stop_token_ids == (3,) and p.top_k == -1
    with pytest.raises(EngineInputError, match="stop_token_ids"):
        sampling_params_from_json({"stop": ["</s>"]})
    with pytest.raises(EngineInputError, match="unknown"):
        sampling_params_from_json({"temprature": 1.0})


def test_http_rejects_what_it_cannot_do(servers):
    url = servers[0].url
    with EngineClient(url) as client:
        with pytest.raises(EngineBadRequest, match="token ids"):
            client.generate([[1, 500]])
    r = engine_http.post(url + "/generate", json={"input_ids": [1, 2], "sampling_params": {"frequency_penalty": 0.5}},
                         timeout=60)
    assert r.status_code == 400 and "frequency_penalty" in r.text
    with _session(url):
        r = engine_http.post(url + "/update_weights_from_tensor",
                             json={"serialized_named_tensors": ["AAAA"], "load_format": "direct"}, timeout=60)
        assert r.status_code == 400 and "pickled payloads are refused" in r.json()["message"]
        r = engine_http.post(url + "/update_weights_from_tensor",
                             json={"serialized_named_tensors": ["bm90IHNhZmV0ZW5zb3Jz"]}, timeout=60)
        assert r.status_code == 400 and r.json()["success"] is False


@contextlib.contextmanager
def _session(url: str):
    """SGLang's weight-update session around hand-made update requests."""
    assert engine_http.post(url + "/begin_weight_update", json={}, timeout=60).status_code == 200
    try:
        yield
    finally:
        assert engine_http.post(url + "/end_weight_update", json={}, timeout=60).status_code == 200


def test_weight_update_by_safetensors_chunks_switches_the_model(servers, hf_a, hf_b, tmp_path):
    server = servers[0]
    _reset(server, hf_a)
    b_dir = save_hf_model(hf_b, tmp_path / "b", config=hf_config_dict(_spec()))
    named = list(iter_safetensors(b_dir))  # on-disk per-expert names, as weight sync sends them
    buffer = 256 * 1024
    chunks = list(chunk_named_tensors(named, buffer))
    assert len(chunks) > 5
    assert all(sum(t.numel() * t.element_size() for t in c.values()) <= buffer for c in chunks)
    prompts = _prompts(torch.Generator().manual_seed(6))
    greedy = SamplingParams(temperature=0, max_new_tokens=6, stop_token_ids=())
    with EngineClient(server.url) as client:
        before = client.generate(prompts, 1, greedy)
        assert client.update_weights(named, buffer, weight_version="7") == len(chunks)
        after = client.generate(prompts, 1, greedy)
        assert client.weight_version() == "7" and all(c.weight_version == "7" for c in after)
        for b, a in zip(before, after):  # logprobs are now model B's, teacher-forced
            for model, c in ((hf_a, b), (hf_b, a)):
                seq = c.prompt_ids + c.output_ids
                ref = torch.log_softmax(_hf_logits(model, seq[:-1]), -1)[len(c.prompt_ids) - 1 :]
                ref = ref.gather(1, torch.tensor(c.output_ids)[:, None]).squeeze(1)
                assert torch.allclose(torch.tensor(c.logprobs), ref, atol=2e-5)
        assert [c.output_ids for c in before] != [c.output_ids for c in after]
        # and back from disk
        a_dir = save_hf_model(hf_a, tmp_path / "a", config=hf_config_dict(_spec()))
        client.update_weights_from_disk(str(a_dir), weight_version="8")
        assert [c.output_ids for c in client.generate(prompts, 1, greedy)] == [c.output_ids for c in before]
        assert client.server_info(refresh=True)["weight_version"] == "8"
        client.flush_cache()
        (tmp_path / "empty").mkdir()
        with pytest.raises(Exception, match="no \\*.safetensors"):
            client.update_weights_from_disk(str(tmp_path / "empty"))


def _wait_for(cond, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_pause_batches_queued_requests_and_abort_ends_them(servers, hf_a):
    server = servers[1]
    _reset(server, hf_a)
    prompts = _prompts(torch.Generator().manual_seed(7))
    params = SamplingParams(max_new_tokens=4, stop_token_ids=())
    results: dict[int, object] = {}

    def call(i: int, prompt: list[int]) -> None:
        try:
            results[i] = client.generate([prompt], 2 if i < 4 else 1, params)
        except Exception as exc:  # surfaced by the asserts below
            results[i] = exc

    with EngineClient(server.url) as client:
        client.pause()
        batches_before = server.scheduler.state()["batches_run"]
        threads = [threading.Thread(target=call, args=(i, prompts[i])) for i in range(4)]
        for t in threads:
            t.start()
        # paused: all 4 wait in the queue (an unpaused scheduler takes each request as it arrives), none ran
        _wait_for(lambda: server.scheduler.state()["queued_requests"] == 4)
        state = server.scheduler.state()
        assert state["paused"] and state["running_requests"] == 0 and state["batches_run"] == batches_before, state
        assert not results
        client.resume()
        for t in threads:
            t.join(60)
        assert sorted(results) == [0, 1, 2, 3]
        for i in range(4):
            assert isinstance(results[i], list) and len(results[i]) == 2, results[i]
            assert results[i][0].prompt_ids == prompts[i]
        assert server.scheduler.state()["batches_run"] == batches_before + 1  # the 4 requests ran as one batch
        # abort: queued requests come back at once with finish_reason "abort"
        client.pause()
        t = threading.Thread(target=call, args=(9, prompts[0]))
        t.start()
        _wait_for(lambda: server.scheduler.state()["queued_requests"] == 1)
        client.abort()
        t.join(60)
        client.resume()
    assert isinstance(results[9], list), results[9]
    assert results[9][0].finish_reason == "abort" and results[9][0].output_ids == []


def test_in_place_pause_holds_a_running_batch(hf_a):
    engine = RolloutEngine(EngineModel.from_hf_model(hf_a))
    steps = []
    gate = threading.Event()

    def hook() -> bool:
        steps.append(time.monotonic())
        if len(steps) == 2:
            assert gate.wait(300), "the test never released the hook"  # held between decode steps until "continue"
        return False

    done = []
    t = threading.Thread(target=lambda: done.append(engine.generate([[5, 6, 7]], 1, SamplingParams(max_new_tokens=5,
                                                                         stop_token_ids=()), step_hook=hook)))
    t.start()
    _wait_for(lambda: len(steps) == 2)
    assert not done and len(steps) == 2  # the engine waits on the hook: no decode step runs past it
    gate.set()
    t.join(300)
    assert done and len(done[0][0].output_ids) == 5


def test_router_spreads_over_two_engines_and_broadcasts(servers, hf_a, hf_b):
    for s in servers:
        _reset(s, hf_a)
    prompts = _prompts(torch.Generator().manual_seed(8), (4, 5, 6, 7, 8, 9))
    with Router([s.url for s in servers]) as router:
        assert router.health() and router.health_generate()
        served = [s.scheduler.state()["rows_served"] for s in servers]
        out = router.generate(prompts, 3, SamplingParams(max_new_tokens=3, stop_token_ids=()),
                              return_routed_experts=True)
        assert [c.prompt_ids for c in out] == [p for p in prompts for _ in range(3)]
        assert all(c.routed_experts.shape == (len(c.prompt_ids) + 2, 3, 4) for c in out)
        grew = [s.scheduler.state()["rows_served"] - before for s, before in zip(servers, served)]
        assert grew == [9, 9]  # three prompts (x3 samples) each
        router.update_weights(hf_b.state_dict().items(), 512 * 1024, weight_version="b")
        assert router.weight_version() == "b"
    for s in servers:
        _reset(s, hf_a)


def test_router_keeps_at_most_server_concurrency_rows_in_flight_per_engine(servers, hf_a):
    """Issue 14 item 6: `sglang.server_concurrency` is read: an engine's share goes out in requests of whole
    prompt groups of at most that many rows (here 6 rows = 2 prompts x 3 samples), one after another."""
    for s in servers:
        _reset(s, hf_a)
    prompts = _prompts(torch.Generator().manual_seed(9), (4, 5, 6, 7, 8, 9))
    with Router([s.url for s in servers], server_concurrency=6) as router:
        before = [s.scheduler.state() for s in servers]
        out = router.generate(prompts, 3, SamplingParams(max_new_tokens=2, stop_token_ids=()))
        after = [s.scheduler.state() for s in servers]
    assert [c.prompt_ids for c in out] == [p for p in prompts for _ in range(3)]
    assert [a["rows_served"] - b["rows_served"] for a, b in zip(after, before)] == [9, 9]
    assert [a["batches_run"] - b["batches_run"] for a, b in zip(after, before)] == [2, 2]  # 6 + 3 rows each


def test_colocated_weight_sync_goes_through_shared_memory_not_http_bodies(servers, hf_a, hf_b):
    """Issue 15 item 1 (CPU): an engine on the trainer's host reads each bucket from one shared-memory segment
    (a JSON descriptor in the request, no tensor bytes); the weights equal a safetensors-body update, and the
    segment is gone afterwards."""
    from kimi_pipeline.weight_sync import shm

    for s in servers:
        _reset(s, hf_a)
    ours = f"{shm.PREFIX}{os.getpid()}-*"  # this process's segments: the other test worker's runs make their own
    before = {p.name for p in shm.shm_dir().glob(ours)}
    sent: list[int] = []
    with Router([s.url for s in servers]) as router:
        assert all(c.shares_memory() for c in router.clients)
        for c in router.clients:  # record request body sizes (the real client still sends them)
            post = c.post_weight_chunk
            c.post_weight_chunk = lambda body, v, fmt="safetensors", post=post: (sent.append(len(body)), post(body, v, fmt))
        buckets = router.update_weights(hf_b.state_dict().items(), 1 << 20, weight_version="b")
        assert router.weight_version() == "b"
    assert buckets > 1 and len(sent) == 2 * buckets and max(sent) < 64 * 1024  # descriptors, not tensor bytes
    assert {p.name for p in shm.shm_dir().glob(ours)} == before  # no segment left behind
    via_body = EngineModel.from_hf_model(hf_a)
    via_body.load_weights(hf_b.state_dict().items())
    got = servers[0].engine.model
    for name in got.weight_names():
        assert torch.equal(got._params[name], via_body._params[name]), name
    for s in servers:
        _reset(s, hf_a)


def _post_shm(url: str, descriptor: dict) -> httpx.Response:
    from kimi_pipeline.weight_sync import shm

    with _session(url):
        body = {"serialized_named_tensors": [json.dumps(descriptor)], "load_format": shm.LOAD_FORMAT}
        return engine_http.post(f"{url}/update_weights_from_tensor", json=body)


# a trainer rank that stages one bucket (norm weights of 7.0) and is then SIGKILLed: its segment stays behind
_OWNER = """
import json, sys, time, torch
from kimi_pipeline.weight_sync import shm
seg = shm.SharedBucket()
print(json.dumps(seg.write_bucket({"model.norm.weight": torch.full((int(sys.argv[1]),), 7.0)})), flush=True)
time.sleep(600)
"""


def test_shared_memory_descriptors_are_checked(servers, hf_a):
    import os
    import signal
    import stat
    import subprocess
    import sys

    from kimi_pipeline.weight_sync import shm

    server = servers[0]
    _reset(server, hf_a)
    url, name = server.url, "model.norm.weight"
    weight = server.engine.model._params[name]
    before = weight.clone()
    seven = torch.full_like(before, 7.0)  # a bucket the engine takes: right name, shape and dtype
    with shm.SharedBucket() as seg:
        assert stat.S_IMODE(seg.path.stat().st_mode) == 0o600  # only this user's engine may read the weights
        desc = seg.write_bucket({name: seven})
        size = seg.path.stat().st_size
        bad = [  # (descriptor, what the 400 names)
            ({**desc, "segment": "../../etc/passwd"}, "segment '../../etc/passwd' is not one of ours"),
            ({**desc, "segment": f"{shm.PREFIX}{os.getpid()}-{'0' * 31}"}, "is not one of ours"),
            ({**desc, "tensors": [[name, "float32", [size // 4 + 1], 0]]},
             f"{name}: bytes 0..{size + 4} outside the {size}-byte segment"),
            ({**desc, "tensors": [[name, "float32", list(seven.shape), -4]]}, f"{name}: bytes -4.."),
            ({**desc, "tensors": [[name, "object", list(seven.shape), 0]]},
             f"{name}: dtype 'object' is not a weight dtype"),
        ]
        for d, names in bad:
            r = _post_shm(url, d)
            assert r.status_code == 400 and r.json()["success"] is False and names in r.json()["message"], (d, r.text)
            assert torch.equal(weight, before), d  # no weight changed
        ok = _post_shm(url, desc)  # control: the well-formed descriptor of the same bucket is taken
        assert ok.status_code == 200 and ok.json()["success"] and torch.equal(weight, seven), ok.text
    _reset(server, hf_a)
    gone = _post_shm(url, desc)  # the segment was removed at close
    assert gone.status_code == 400 and "no such segment" in gone.json()["message"] and torch.equal(weight, before)

    # a segment whose owner died (a SIGKILLed trainer) is removed when the next one is created; live ones stay
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, str(before.numel())], stdout=subprocess.PIPE, text=True,
                             cwd=ROOT)
    try:
        dead = json.loads(owner.stdout.readline())
    finally:
        owner.kill()  # SIGKILL
        owner.wait()
    assert owner.returncode == -signal.SIGKILL
    stale = shm.shm_dir() / dead["segment"]
    assert dead["segment"].startswith(f"{shm.PREFIX}{owner.pid}-") and stale.exists()  # it could not clean up
    assert stat.S_IMODE(stale.stat().st_mode) == 0o600
    with shm.SharedBucket() as live:
        assert not stale.exists() and live.path.exists()
        assert live.name not in shm.remove_stale_segments()
        r = _post_shm(url, dead)  # the dead trainer's bucket is gone, not half-read
        assert r.status_code == 400 and "no such segment" in r.json()["message"] and torch.equal(weight, before)
    client = EngineClient("http://127.0.0.1:9")
    client._info = {"engine": "x", "weight_update_formats": [shm.LOAD_FORMAT], "hostname": "another-node"}
    assert not client.shares_memory()  # an engine elsewhere gets safetensors bodies
    client.close()


def test_client_refuses_tensor_sync_to_sglang_and_needs_its_shape():
    info = {"weight_version": "default"}  # what an SGLang server reports: no engine name, no model shape
    client = EngineClient("http://127.0.0.1:9")
    client._info = info
    with pytest.raises(PermanentError, match="update_weights_from_disk"):
        client.update_weights({"x": torch.zeros(1)}, 1024)
    with pytest.raises(PermanentError, match="num_layers"):
        client._expert_layout()
    client.close()


# ---------------------------------------------------------------- SGLang launch command


def test_sglang_command_follows_the_recipe():
    r = load_recipe("kimi-k2-thinking")
    cmd = sglang_command("/ckpt", r.sglang, port=30000, gpus_per_node=8, dist_init_addr="10.0.0.1:5000",
                         node_rank=1, routing_replay=True)
    line = " ".join(cmd)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    assert f"--tp-size {r.sglang.gpus_per_engine}" in line and f"--ep-size {r.sglang.ep_size}" in line
    assert "--host 127.0.0.1" in line and "--enable-memory-saver" not in cmd
    assert "--nnodes 2 --node-rank 1 --dist-init-addr 10.0.0.1:5000" in line
    assert "--enable-return-routed-experts" in cmd and "--trust-remote-code" not in cmd
    assert r.sglang.enable_dp_attention and f"--attn-dp-size {r.sglang.dp_size}" in line  # 0.5.23's name
    assert "--dp-size" not in cmd and "--enable-dp-attention" not in cmd
    with pytest.raises(PermanentError, match="dist_init_addr"):
        sglang_command("/ckpt", r.sglang, port=1, gpus_per_node=8)


def test_bench_runs_and_reports_a_ratio(capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_rollout", ROOT / "bench" / "rollout.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    ratio = bench.main(["--prompts", "4", "--n", "2", "--max-new", "4", "--repeats", "1", "--model", "random"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert ratio > 0 and last == f"rollout ratio={ratio:.2f}"


def test_non_colocated_weight_sync_through_a_process_group(servers, hf_a, hf_b):
    """Issue 15 item 1, non-colocated: SGLang's init_weights_update_group / update_weights_from_distributed
    protocol (gloo on CPU) — no tensor bytes in the HTTP requests; every engine ends up with the weights a
    safetensors-body update gives; the group is made once, reused by the next sync and left at close."""
    from kimi_pipeline.weight_sync.formats import to_engine_format

    for s in servers:
        _reset(s, hf_a)
    sent: list[int] = []
    with Router([s.url for s in servers], weight_transport="distributed") as router:
        for c in router.clients:
            call = c._call
            c._call = lambda m, path, json=None, call=call: (sent.append(len(str(json))), call(m, path, json))[1]
        buckets = router.update_weights(hf_b.state_dict().items(), 1 << 20, weight_version="b")
        assert router.weight_version() == "b" and buckets > 1
        assert all(len(s.weight_groups) == 1 for s in servers)
        group = router._group
        # the engine's own format over the same group: INT4 parts (int32 packed, bf16 scales, int64 shapes)
        assert router.update_weights(to_engine_format(hf_b.state_dict().items(), "int4", 32), 1 << 20,
                                     weight_version="b-int4") > 1
        assert router._group is group and router.weight_version() == "b-int4"
        # FP8 blocks: gloo has no float8, those move as bytes on both sides
        assert router.update_weights(to_engine_format(hf_b.state_dict().items(), "fp8", 32), 1 << 20,
                                     weight_version="b-fp8") > 1
        assert router.weight_version() == "b-fp8"
        assert router.update_weights(to_engine_format(hf_b.state_dict().items(), "int4", 32), 1 << 20,
                                     weight_version="b-int4") > 1
    assert all(not s.weight_groups for s in servers)  # left at close
    assert max(sent) < 64 * 1024  # names, dtypes, shapes: no tensor bytes over HTTP
    via_body = EngineModel.from_hf_model(hf_a)
    via_body.load_weights(hf_b.state_dict().items())
    for s in servers:
        got = s.engine.model
        for name in got.weight_names():
            if ".mlp.experts." in name:
                continue  # the INT4 round changed the routed experts
            want = via_body._params[name]
            if not name.endswith("e_score_correction_bias"):  # kept fp32, as Kimi's INT4 checkpoints do
                want = want.to(torch.bfloat16).to(got.dtype)
            assert torch.equal(got._params[name], want), name
    for s in servers:
        _reset(s, hf_a)


@pytest.mark.parametrize("rope", [
    None,  # the tiny checkpoint's own: YaRN, factor 64, mscale_all_dim 1
    {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},  # Kimi-K2's rope_scaling
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
     "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707},
    {"rope_type": "default"},
])
def test_rope_and_softmax_scale_are_transformers_deepseek_v3s(rope):
    """The engine's rotary frequencies and attention scale (engine/model.py `rope_frequencies`,
    `attention_softmax_scale`, read without importing transformers' DeepSeek-V3 modeling module) are exactly what
    that module computes: DeepseekV3RotaryEmbedding's inv_freq and attention_scaling, and yarn_apply_mscale."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding, yarn_apply_mscale

    from kimi_pipeline.model.hf_model import deepseek_config, read_config
    from support.common import TINY

    raw = read_config(TINY / "model")
    if rope is not None:
        raw = {**raw, "rope_scaling": None if rope["rope_type"] == "default" else rope}
    cfg = deepseek_config(raw)
    assert cfg.rope_parameters["rope_type"] == (rope or {"rope_type": "yarn"})["rope_type"]
    inv_freq, scale = engine_model.rope_frequencies(cfg)
    theirs = DeepseekV3RotaryEmbedding(cfg)
    assert torch.equal(inv_freq.float(), theirs.inv_freq.float()) and scale == theirs.attention_scaling
    qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    assert engine_model.attention_softmax_scale(cfg.rope_parameters, qk_head_dim) == pytest.approx(
        yarn_apply_mscale(cfg.rope_parameters, qk_head_dim ** (-0.5)), rel=1e-15)
