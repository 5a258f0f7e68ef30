"""Rollout throughput on one GPU: the embedded engine vs transformers `generate` at its fastest, Kimi-shaped models.

    .venv/bin/python bench/gpu_rollout.py [--sizes 0.5b,2.5b] [--prompts 32] [--n 8] [--prompt-len 64]
                                          [--max-new 128] [--repeats 2] [--seed 0]

For each size (bench/gpu_common.py: Kimi-K2's shape at ~0.5 B and ~2.5 B parameters, random weights, seeded) one
bf16 transformers DeepseekV3ForCausalLM is built on the GPU and the engine copies ITS weights
(`EngineModel.from_hf_model`), so both sides sample the same model. Workload: `--prompts` random prompts of
`--prompt-len` tokens, `--n` samples each (default 32 x 8 = 256 rows), temperature 1, top-p 1, top-k off
(`top_k=0`: transformers would default to 50), stop at eos (token 3, rare under random weights) or `--max-new`
new tokens, a fixed seed per run. Throughput = generated tokens (up to and including eos) per second of wall
time, CUDA synchronised around each run; the sides alternate `--repeats` times after a small warm-up and each
keeps its best run.

transformers side, its fastest settings: SDPA attention, bf16, `experts_implementation="grouped_mm"` (torch's
grouped GEMM; the default `batched_mm` gathers expert weights per token). `generate` itself switches grouped_mm
to batched_mm for the decode steps on GPUs (transformers/generation/utils.py:2500-2522, "much more performant
on smaller inputs"); the bench times that as-shipped variant and one with grouped_mm kept for decode, and
compares the engine with the faster of the two (a variant that runs out of memory is reported and skipped).

Embedded engine side: `RolloutEngine` as the pipeline runs it (prefill of each distinct prompt once, a latent
MLA cache, grouped MoE, routed experts returned as routing replay needs them), decode mode "graphs": each decode
step replayed from a CUDA graph captured once per (batch bucket, cache-length bucket), lazily, the first time a
batch needs it (so inside the first timed run; the best of `--repeats` keeps a run without captures). Where the GPU
cannot capture the step (graphs need bf16 on sm90/sm100) the engine runs "dynamic" and says so. Whether CUDA graphs
ran is measured at torch's entry points (captures/replays counted) and printed with the graphs the engine holds.

Lines: per-run detail, per-size `size <s>: ... ratio <engine / generate> (goal >= 3: met|NOT met)`, and last
`gpu_rollout ratio=<min over sizes>`. Without CUDA it prints one "needs CUDA" line and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import time

import gpu_common  # bench/ is sys.path[0] when run as a script

NAME = "gpu_rollout"
GOAL = 3.0
EOS = 3  # hf_config_dict's eos_token_id


def _sync() -> None:
    import torch

    torch.cuda.synchronize()


def make_prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (count, length), generator=g).tolist()


def hf_generate(model, prompts: list[list[int]], n: int, max_new: int, seed: int, keep_grouped: bool) -> int:
    """One batched `generate` over all prompts (equal lengths: no padding), n return sequences each; returns the
    tokens generated up to and including each row's first eos."""
    import torch

    ids = torch.tensor(prompts, device=model.device)
    torch.manual_seed(seed)
    if keep_grouped:  # generate() swaps grouped_mm -> batched_mm for decode unless this context does nothing
        model._optimize_model_for_decode = contextlib.nullcontext
    try:
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                 top_p=1.0, top_k=0, max_new_tokens=max_new, num_return_sequences=n,
                                 eos_token_id=EOS, pad_token_id=0)
    finally:
        model.__dict__.pop("_optimize_model_for_decode", None)
    new = out[:, ids.shape[1]:]
    is_eos = new == EOS
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, torch.full_like(is_eos[:, 0], new.shape[1],
                                                                                     dtype=torch.long))
    return int(first.sum())


def engine_generate(engine, prompts: list[list[int]], n: int, max_new: int, seed: int) -> int:
    from kimi_pipeline.engine.rollout_engine import SamplingParams

    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=max_new, stop_token_ids=(EOS,),
                            seed=seed)
    return sum(len(c.output_ids) for c in engine.generate(prompts, n, params, return_routed_experts=True))


def timed(fn) -> tuple[int, float]:
    _sync()
    t0 = time.perf_counter()
    tokens = fn()
    _sync()
    return tokens, time.perf_counter() - t0


def bench_size(size: str, device, args) -> float:
    import torch

    from kimi_pipeline.engine.model import EngineModel
    from kimi_pipeline.engine.rollout_engine import RolloutEngine
    from kimi_pipeline.engine.static_decode import graphs_supported

    spec = gpu_common.kimi_spec(size)
    counts = gpu_common.param_counts(spec)
    prompts = make_prompts(spec.vocab_size, args.prompts, args.prompt_len, args.seed)
    rows = len(prompts) * args.n
    print(f"size {size}: {counts.total / 1e9:.2f} B params ({counts.active / 1e9:.2f} B active), {rows} rows "
          f"({len(prompts)} prompts x {args.n}), prompt {args.prompt_len} tokens, up to {args.max_new} new tokens")
    hf = gpu_common.hf_model(spec, device, seed=args.seed)
    model = EngineModel.from_hf_model(hf, device=device, dtype=torch.bfloat16)
    mode = "graphs" if graphs_supported(model) else "dynamic"
    engine = RolloutEngine(model, seed=args.seed, max_batch_rows=max(1024, rows), decode_mode=mode)
    sides = {
        "generate (grouped_mm prefill, batched_mm decode: as shipped)": lambda s: hf_generate(
            hf, prompts, args.n, args.max_new, s, keep_grouped=False),
        "generate (grouped_mm throughout)": lambda s: hf_generate(hf, prompts, args.n, args.max_new, s, True),
        "engine": lambda s: engine_generate(engine, prompts, args.n, args.max_new, s),
    }
    failed: dict[str, str] = {}
    best: dict[str, float] = {k: 0.0 for k in sides}
    graphs = gpu_common.GraphCounter()
    # warm-up: kernels, cuBLAS heuristics, allocator pools (a small batch, few tokens)
    small = prompts[:2]
    for side in sides:
        try:
            if side == "engine":
                with graphs:
                    engine_generate(engine, small, 2, 4, args.seed)
            else:
                hf_generate(hf, small, 2, 4, args.seed, keep_grouped="throughout" in side)
        except torch.cuda.OutOfMemoryError as e:
            failed[side] = f"out of memory in warm-up: {str(e).splitlines()[0]}"
    for rep in range(args.repeats):
        for side, fn in sides.items():
            if side in failed:
                continue
            try:
                if side == "engine":
                    with graphs:
                        tokens, secs = timed(lambda: fn(args.seed + rep))
                else:
                    tokens, secs = timed(lambda: fn(args.seed + rep))
            except torch.cuda.OutOfMemoryError as e:
                failed[side] = f"out of memory: {str(e).splitlines()[0]}"
                gc.collect()
                torch.cuda.empty_cache()
                continue
            best[side] = max(best[side], tokens / secs)
            print(f"  run {rep} {side}: {tokens} tokens in {secs:.2f} s ({tokens / secs:,.0f} tok/s)")
    for side, why in failed.items():
        print(f"  {side}: skipped, {why}")
    hf_sides = {k: v for k, v in best.items() if k != "engine" and k not in failed}
    if not hf_sides or "engine" in failed:
        raise SystemExit(f"{NAME}: size {size}: nothing to compare ({failed})")
    hf_best_side = max(hf_sides, key=hf_sides.get)
    ratio = best["engine"] / hf_sides[hf_best_side]
    print(f"  transformers best: {hf_sides[hf_best_side]:,.0f} tok/s ({hf_best_side})")
    if engine.static is not None and engine.static.use_graphs:
        kept = engine.static.graphs
        held = f"{len(kept)} graphs held (batch x cache length: {', '.join(f'{b}x{L}' for b, L in sorted(kept))})"
    else:
        held = "decode mode dynamic: this GPU cannot capture the step (graphs need bf16 on sm90/sm100)"
    print(f"  embedded engine:   {best['engine']:,.0f} tok/s; CUDA graphs: {graphs.describe()}; {held}; "
          f"peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB")
    print(f"size {size}: engine / transformers generate ratio {ratio:.2f} "
          f"(goal >= {GOAL:g}: {'met' if ratio >= GOAL else 'NOT met'})")
    del hf, engine, model
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return ratio


def main(argv: list[str] | None = None) -> float | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="0.5b,2.5b", help=f"comma-separated, of {', '.join(gpu_common.SIZES)}")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    device = gpu_common.cuda_device(NAME)
    if device is None:
        return None
    import torch

    print(f"{NAME}: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    ratios = {size: bench_size(size, device, args) for size in args.sizes.split(",") if size}
    worst = min(ratios.values())
    print(f"{NAME} ratio={worst:.2f}")
    return worst


if __name__ == "__main__":
    main()
