"""Train tokens/s on one GPU: the megatron-core trainer step vs transformers + torch AdamW, Kimi-shaped models.

    .venv/bin/python bench/gpu_train.py [--sizes 0.5b,2.5b] [--batch 16] [--seq 1024] [--micro 4] [--steps 5]

For each size (bench/gpu_common.py: Kimi-K2's shape at ~0.5 B and ~2.5 B parameters) both sides train the same
weights (a seeded random transformers model; megatron loads its tensors through convert/names.py, then its
optimizer reloads them as its fp32 main params) on the same batch: `--batch` rows of `--seq` random tokens,
next-token NLL (token mean), in micro-batches of `--micro` rows accumulated into one optimizer step with
gradient clipping at the recipe's 1.0, Adam with the kimi-k2-thinking preset's betas / eps / weight decay.

megatron side: what GRPO runs, `build_trainable` (megatron DDP, distributed optimizer, per-token-loss schedule,
Float16Module bf16 compute with fp32 main params and fp32 grads) -> `forward_backward` -> `optimizer_step`, as
bench/train_step.py does on CPU; the optimizer on the GPU (the preset's CPU offload is a memory choice for 1 T
parameters, off here), Transformer Engine layers when TE is installed, megatron's local ones otherwise.
transformers side: DeepseekV3ForCausalLM in bf16 with SDPA attention and `experts_implementation="grouped_mm"`,
`torch.optim.AdamW(fused=True)` directly on the bf16 parameters: cheaper per step than the megatron side's mixed
precision (no fp32 master copy or fp32 grads), so the ratio is conservative for megatron.

Tokens/s = batch x seq x steps / wall seconds of `--steps` steps after one warm-up step, CUDA synchronised. The
megatron side's MFU = 6 x active params x tokens/s / peak dense bf16 FLOP/s (H100 SXM, H200: 989e12; other GPUs:
n/a). Lines: per-size detail and `size <s>: ... ratio <megatron / transformers> (goal >= 1.5: met|NOT met)`, last
`gpu_train ratio=<min over sizes>`. Without CUDA it prints one "needs CUDA" line and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import time

import gpu_common  # bench/ is sys.path[0] when run as a script

NAME = "gpu_train"
GOAL = 1.5


def _batch(vocab: int, rows: int, seq: int, device, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, vocab, (rows, seq), generator=g)
    return tokens.to(device), torch.roll(tokens, -1, dims=1).to(device)


def _optimizer_spec():
    from kimi_pipeline.recipes import load_recipe

    opt = load_recipe("kimi-k2-thinking", check=False).optimizer
    return opt.model_copy(update={"optimizer_cpu_offload": False, "overlap_cpu_optimizer_d2h_h2d": False,
                                  "use_precision_aware_optimizer": False, "lr": 1e-5})


def _timed(step, steps: int) -> float:
    import torch

    step()  # warm-up: kernels, allocator, optimizer state
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def transformers_seconds(hf, tokens, targets, micro: int, steps: int, opt_spec) -> float:
    import torch

    hf.train()
    opt = torch.optim.AdamW(hf.parameters(), lr=opt_spec.lr, betas=(opt_spec.adam_beta1, opt_spec.adam_beta2),
                            eps=opt_spec.adam_eps, weight_decay=opt_spec.weight_decay, fused=True)
    total = tokens.numel()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for i in range(0, tokens.shape[0], micro):
            logits = hf(input_ids=tokens[i : i + micro], use_cache=False).logits.float()
            lp = torch.log_softmax(logits, -1).gather(-1, targets[i : i + micro, :, None]).squeeze(-1)
            (-lp.sum() / total).backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), opt_spec.clip_grad)
        opt.step()

    try:
        return _timed(step, steps)
    finally:
        del opt


def megatron_seconds(spec, layout, device, hf_state, tokens, targets, micro: int, steps: int, opt_spec):
    """(seconds, whether TE layers were used)."""
    from kimi_pipeline.convert.names import load_hf_tensors_into_model
    from kimi_pipeline.model.megatron_model import unwrap
    from kimi_pipeline.model.megatron_train import build_trainable, forward_backward, optimizer_step
    from kimi_pipeline.model.vocab_parallel import logprobs_from_logits

    chunks, opt = build_trainable(spec, layout, opt_spec, device=device)
    load_hf_tensors_into_model(unwrap(chunks), hf_state.__getitem__, spec, layout)
    # the fp32 main params from the loaded weights (megatron/core/optimizer/optimizer.py:1173, ChainedOptimizer)
    opt.reload_model_params()

    def loss_fn(logits, batch):
        lp, _ = logprobs_from_logits(logits, batch["targets"], with_entropy=False)
        return -lp.sum(), lp.numel(), {}

    batches = [{"tokens": tokens[i : i + micro], "targets": targets[i : i + micro]}
               for i in range(0, tokens.shape[0], micro)]

    def step() -> None:
        forward_backward(chunks, batches, loss_fn, optimizer=opt)
        ok, _ = optimizer_step(opt)
        if not ok:
            raise SystemExit(f"{NAME}: megatron skipped an optimizer step (non-finite grads)")

    te = bool(getattr(chunks[0], "kimi_use_te", False))
    try:
        return _timed(step, steps), te
    finally:
        del chunks, opt


def bench_size(size: str, device, layout, args) -> float:
    import torch

    from kimi_pipeline.convert.names import unfuse_hf_experts

    spec = gpu_common.kimi_spec(size)
    counts = gpu_common.param_counts(spec)
    opt_spec = _optimizer_spec()
    tokens, targets = _batch(spec.vocab_size, args.batch, args.seq, device, args.seed)
    per_step = tokens.numel()
    print(f"size {size}: {counts.total / 1e9:.2f} B params ({counts.active / 1e9:.2f} B active), {args.batch} rows x "
          f"{args.seq} tokens = {per_step} tokens/step in micro-batches of {args.micro}, {args.steps} steps")
    hf = gpu_common.hf_model(spec, device, seed=args.seed)
    hf_state = {k: v.detach().clone() for k, v in unfuse_hf_experts(hf.state_dict()).items()}
    hf_s = transformers_seconds(hf, tokens, targets, args.micro, args.steps, opt_spec)
    hf_peak = torch.cuda.max_memory_allocated(device) / 2**30
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    mg_s, te = megatron_seconds(spec, layout, device, hf_state, tokens, targets, args.micro, args.steps, opt_spec)
    mg_peak = torch.cuda.max_memory_allocated(device) / 2**30
    del hf_state
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)

    hf_tps, mg_tps = per_step * args.steps / hf_s, per_step * args.steps / mg_s
    layers = "TE" if te else "local"
    print(f"  transformers + torch AdamW (bf16, fused):     {hf_s / args.steps * 1000:8.1f} ms/step  "
          f"{hf_tps:10,.0f} tok/s  peak {hf_peak:.1f} GiB")
    print(f"  megatron-core DDP + dist. Adam ({layers:5s} layers): {mg_s / args.steps * 1000:8.1f} ms/step  "
          f"{mg_tps:10,.0f} tok/s  peak {mg_peak:.1f} GiB")
    peak, board = gpu_common.peak_bf16_flops(torch.cuda.get_device_name(device))
    if peak is None:
        print(f"  megatron MFU n/a ({board})")
    else:
        mfu = 6 * counts.active * mg_tps / peak
        print(f"  megatron MFU {mfu:.3f} (6 x {counts.active / 1e9:.3f} B active params x {mg_tps:,.0f} tok/s / "
              f"{peak / 1e12:.0f} TFLOP/s bf16 dense, {board})")
    ratio = mg_tps / hf_tps
    print(f"size {size}: megatron / transformers tokens/s ratio {ratio:.2f} "
          f"(goal >= {GOAL:g}: {'met' if ratio >= GOAL else 'NOT met'})")
    return ratio


def main(argv: list[str] | None = None) -> float | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="0.5b,2.5b", help=f"comma-separated, of {', '.join(gpu_common.SIZES)}")
    ap.add_argument("--batch", type=int, default=16, help="rows per optimizer step")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per row")
    ap.add_argument("--micro", type=int, default=4, help="rows per micro-batch")
    ap.add_argument("--steps", type=int, default=5, help="timed steps (after one warm-up step)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.batch % args.micro:
        ap.error("--batch must be a multiple of --micro")
    device = gpu_common.cuda_device(NAME)
    if device is None:
        return None
    import torch

    from kimi_pipeline.model.parallel import Layout, destroy, init_distributed

    print(f"{NAME}: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    layout = Layout()
    init_distributed(layout, device=device)
    try:
        ratios = {size: bench_size(size, device, layout, args) for size in args.sizes.split(",") if size}
    finally:
        destroy()
    worst = min(ratios.values())
    print(f"{NAME} ratio={worst:.2f}")
    return worst


if __name__ == "__main__":
    main()
