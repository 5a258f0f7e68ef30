"""The embedded rollout engine on one GPU, given the device: prefill/decode logits and sampled-token logprobs
equal transformers' on the same GPU (fp32), sampling is reproducible for a seed, the bf16 path (torch's
grouped_mm experts) runs, and the HTTP server on a GPU engine serves what the engine generates, weight updates
included. The GPU twins of tests/integration/test_engine.py's parity, sampling and HTTP tests; and the decode
steps captured in CUDA graphs (bf16, sm90/sm100) sample what the same static step samples eagerly, weight updates
included."""

from __future__ import annotations

import pytest

from support.common import ROOT, assert_bf16_engine_tracks_fp32, random_tiny_hf

pytestmark = pytest.mark.gpu

# fp32 on CUDA: cuBLAS and the engine's absorbed attention sum in other orders than transformers' eager path;
# differences stay at float rounding of logits of magnitude ~10 (CPU bound: 1e-5 relative, 2e-5 on logprobs).
REL = 1e-4
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def hf_a(cuda):
    return random_tiny_hf(0, cuda)


def _prompts(seed: int, lengths=(5, 9, 12, 7)) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 384, (n,), generator=g).tolist() for n in lengths]


def _close(a, b, rel: float = REL) -> float:
    diff = (a - b).abs().max().item()
    assert diff <= rel * max(1.0, b.abs().max().item()), diff
    return diff


def test_engine_weights_live_on_the_gpu_and_prefill_decode_match_transformers(hf_a, cuda):
    import torch

    from kimi_pipeline.engine.model import EngineModel

    eng = EngineModel.from_hf_model(hf_a, device=cuda)
    assert eng.device == cuda
    off = [n for n in eng.weight_names() if eng._target(n).device != cuda]
    assert off == [] and eng.cos.device == cuda
    prompts = _prompts(0)
    ids = torch.zeros(len(prompts), max(map(len, prompts)), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    logits, _, experts = eng.prefill(ids.to(cuda), all_logits=True)
    assert logits.device == cuda and experts.device == cuda
    with torch.no_grad():
        for i, p in enumerate(prompts):
            _close(logits[i, : len(p)], hf_a(torch.tensor([p], device=cuda)).logits[0].float())
        seq = prompts[2]
        ref = hf_a(torch.tensor([seq], device=cuda)).logits[0].float()
    _, pre, _ = eng.prefill(torch.tensor([seq[:4]], device=cuda))
    cache = eng.new_cache(1, len(seq))
    assert cache.device == cuda
    cache[:, :, :4] = pre
    for t in range(4, len(seq)):
        step, _ = eng.decode(torch.tensor([seq[t]], device=cuda), torch.tensor([t], device=cuda), cache, t + 1)
        _close(step[0], ref[t])


def test_gpu_sampling_is_seeded_and_its_logprobs_are_transformers(hf_a, cuda):
    import numpy as np
    import torch

    from kimi_pipeline.engine.model import EngineModel
    from kimi_pipeline.engine.rollout_engine import RolloutEngine, SamplingParams

    engine = RolloutEngine(EngineModel.from_hf_model(hf_a, device=cuda), seed=0)
    prompts, temp = _prompts(2), 0.7
    params = SamplingParams(temperature=temp, max_new_tokens=10, stop_token_ids=(), seed=7)
    out = engine.generate(prompts, 3, params)
    again = engine.generate(prompts, 3, params)
    # the same seed draws the same tokens (MoE sums use CUDA atomics, so logprobs agree to rounding only)
    assert [c.output_ids for c in out] == [c.output_ids for c in again]
    assert np.allclose([c.logprobs for c in out], [c.logprobs for c in again], atol=1e-6)
    other = engine.generate(prompts, 3, SamplingParams(temperature=temp, max_new_tokens=10, stop_token_ids=(), seed=8))
    assert [c.output_ids for c in other] != [c.output_ids for c in out]
    with torch.no_grad():
        for c in out:
            assert c.finish_reason == "length" and len(c.output_ids) == 10
            assert c.routed_experts.dtype == np.int16 and c.routed_experts.shape == (len(c.prompt_ids) + 9, 3, 4)
            seq = c.prompt_ids + c.output_ids
            logits = hf_a(torch.tensor([seq[:-1]], device=cuda)).logits[0].float()
            ref = torch.log_softmax(logits / temp, -1)[len(c.prompt_ids) - 1 :].gather(
                1, torch.tensor(c.output_ids, device=cuda)[:, None]).squeeze(1)
            assert torch.allclose(torch.tensor(c.logprobs, device=cuda), ref, atol=LOGPROB_ATOL), (c.logprobs, ref)


def test_bf16_engine_on_the_gpu_runs_the_same_model(hf_a, cuda):
    """The GPU dtype: bf16 weights through torch's grouped_mm (CUDA, bf16, sm80+), fp32 router/softmax/logits."""
    import torch

    from kimi_pipeline.model.grouped_experts import grouped_mm_supported

    if torch.cuda.get_device_capability(cuda)[0] >= 8:  # the engine's experts take torch's grouped GEMM here
        assert grouped_mm_supported(torch.empty(1, dtype=torch.bfloat16, device=cuda), 128, 64)
    assert_bf16_engine_tracks_fp32(hf_a, _prompts(9, (12, 12)), cuda)


def test_http_server_on_a_gpu_engine_serves_the_engines_samples_and_takes_weights(hf_a, cuda):
    import numpy as np

    from kimi_pipeline.engine.client import EngineClient
    from kimi_pipeline.engine.model import EngineModel
    from kimi_pipeline.engine.rollout_engine import RolloutEngine, SamplingParams
    from kimi_pipeline.engine.server import EngineServer

    server = EngineServer(RolloutEngine(EngineModel.from_hf_model(hf_a, device=cuda), seed=0))
    server.start()
    try:
        prompts = _prompts(5)
        params = SamplingParams(temperature=1.0, max_new_tokens=6, stop_token_ids=(), seed=3)
        direct = RolloutEngine(EngineModel.from_hf_model(hf_a, device=cuda)).generate(prompts, 2, params)
        with EngineClient(server.url) as client:
            info = client.server_info(refresh=True)
            assert info["device"] == str(cuda)
            got = client.generate(prompts, 2, params, return_routed_experts=True)
            assert [c.output_ids for c in got] == [c.output_ids for c in direct]
            assert np.allclose([c.logprobs for c in got], [c.logprobs for c in direct], atol=1e-5)
            assert all(np.array_equal(g.routed_experts, d.routed_experts) for g, d in zip(got, direct))

            # a weight update (CPU tensors over HTTP) lands on the GPU: the engine now samples model B
            hf_b = random_tiny_hf(1, cuda)
            client.update_weights({k: v.cpu() for k, v in hf_b.state_dict().items()}, 1 << 20, weight_version="1")
            assert server.engine.model.embed.device == cuda
            want = RolloutEngine(EngineModel.from_hf_model(hf_b, device=cuda)).generate(prompts, 2, params)
            got_b = client.generate(prompts, 2, params)
            assert [c.output_ids for c in got_b] == [c.output_ids for c in want]
            assert all(c.weight_version == "1" for c in got_b)
    finally:
        server.stop()


def _bf16_with_graphs(hf, cuda):
    """hf's weights in a bf16 engine on the GPU; skips where its decode step cannot be captured."""
    import torch

    from kimi_pipeline.engine.model import EngineModel
    from kimi_pipeline.engine.static_decode import graphs_supported

    model = EngineModel.from_hf_model(hf, device=cuda, dtype=torch.bfloat16)
    if not graphs_supported(model):
        pytest.skip("CUDA-graph decode needs bf16 on an sm90/sm100 GPU (torch's sync-free grouped GEMM)")
    return model


def _graph_counter():
    """bench/gpu_common.py's GraphCounter: CUDA graph captures and replays counted at torch's own entry points."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gpu_common", ROOT / "bench" / "gpu_common.py")
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    return common.GraphCounter()


def _same_samples(a, b) -> None:
    import numpy as np

    assert [c.output_ids for c in a] == [c.output_ids for c in b]
    assert [c.finish_reason for c in a] == [c.finish_reason for c in b]
    for x, y in zip(a, b):
        assert np.allclose(x.logprobs, y.logprobs, atol=1e-6, rtol=0)
        assert np.array_equal(x.routed_experts, y.routed_experts)


def test_cuda_graph_decode_draws_the_static_paths_tokens(hf_a, cuda):
    """Issue 25 item 5: in bf16, decode steps replayed from CUDA graphs (one per batch bucket x cache length,
    captured lazily, kept across calls) sample exactly what the same static step run eagerly samples for a seed,
    rows stopping early so compaction moves the batch down through smaller buckets."""
    from kimi_pipeline.engine.rollout_engine import RolloutEngine, SamplingParams

    model = _bf16_with_graphs(hf_a, cuda)
    eager, graphs = RolloutEngine(model, decode_mode="static"), RolloutEngine(model)
    assert graphs.decode_mode == "graphs" and graphs.static.use_graphs  # the default where supported
    stops = tuple(range(4, 384, 9))
    prompts = _prompts(3)
    calls = [(9, 10, 4), (5, 14, 1), (1, 3, 2)]  # 36, 20, 4 rows: the first batch sizes the buffers for all
    with _graph_counter() as counted:
        for n, max_new, seed in calls:
            params = SamplingParams(temperature=0.8, max_new_tokens=max_new, stop_token_ids=stops, seed=seed)
            _same_samples(eager.generate(prompts, n, params), graphs.generate(prompts, n, params))
        dec = graphs.static
        steps = sum(dec.steps.values())
        assert len(dec.graphs) >= 3 and counted.captures == dec.captures == len(dec.graphs)
        assert counted.replays == dec.replays == steps  # every decode step was a replay
        assert eager.static.captures == 0 and not eager.static.graphs
        # the same batches again: no new capture, only replays
        captured = dict(dec.graphs)
        for n, max_new, seed in calls:
            params = SamplingParams(temperature=0.8, max_new_tokens=max_new, stop_token_ids=stops, seed=seed)
            _same_samples(eager.generate(prompts, n, params), graphs.generate(prompts, n, params))
        assert dec.graphs == captured and counted.captures == len(captured) and counted.replays > steps


def test_cuda_graphs_captured_before_a_weight_update_serve_the_new_weights(hf_a, cuda):
    """Weight updates copy into the tensors the graphs read (merged weights included), so the graphs captured with
    model A, replayed after loading model B, sample what a fresh engine of model B samples."""
    import torch

    from kimi_pipeline.engine.model import EngineModel
    from kimi_pipeline.engine.rollout_engine import RolloutEngine, SamplingParams

    model = _bf16_with_graphs(hf_a, cuda)
    engine = RolloutEngine(model, decode_mode="graphs")
    prompts = _prompts(7, (5, 10, 8))
    params = SamplingParams(max_new_tokens=8, stop_token_ids=(), seed=4)
    before = engine.generate(prompts, 2, params)
    captured = dict(engine.static.graphs)
    assert captured
    hf_b = random_tiny_hf(1, cuda)
    model.load_weights(hf_b.state_dict().items())
    assert model.storage_epoch == 0  # nothing rebound: the captured addresses still hold the weights
    after = engine.generate(prompts, 2, params)
    assert engine.static.graphs == captured  # replayed, not captured again
    fresh = RolloutEngine(EngineModel.from_hf_model(hf_b, device=cuda, dtype=torch.bfloat16), decode_mode="graphs")
    want = fresh.generate(prompts, 2, params)
    _same_samples(after, want)
    assert [c.output_ids for c in after] != [c.output_ids for c in before]
