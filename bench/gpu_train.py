"""Train tokens/s on one GPU: the megatron-core trainer step vs transformers + torch AdamW, Kimi-shaped models.

    .venv/bin/python bench/gpu_train.py [--sizes 0.5b,2.5b] [--batch 16] [--seq 1024] [--micro 4] [--steps 5]
                                        [--profile DIR]

For each size (bench/gpu_common.py: Kimi-K2's shape at ~0.5 B and ~2.5 B parameters) both sides train the same
weights (a seeded random transformers model; megatron loads its tensors through hf/names.py, then its
optimizer reloads them as its fp32 main params) on the same batch: `--batch` rows of `--seq` random tokens,
next-token NLL (token mean), in micro-batches of `--micro` rows accumulated into one optimizer step with
gradient clipping at the recipe's 1.0, Adam with the kimi-k2-thinking preset's betas / eps / weight decay.

megatron side: what GRPO runs, `build_trainable` (megatron DDP, distributed optimizer, per-token-loss schedule,
Float16Module bf16 compute with fp32 main params and fp32 grads) -> `forward_backward` -> `optimizer_step`, as
bench/train_step.py does on CPU; the optimizer on the GPU (the preset's CPU offload is a memory choice for 1 T
parameters, off here), Transformer Engine layers when TE is installed, megatron's local ones otherwise.
transformers side, twice, DeepseekV3ForCausalLM with SDPA attention and `experts_implementation="grouped_mm"`:
- "trainer precision", the like-for-like baseline the ratio uses: bf16 weights and compute, each micro-batch's
  gradients accumulated into fp32 main grads, clipping and `torch.optim.AdamW(fused=True)` on fp32 main params
  copied back to the bf16 weights after the step, what megatron's Float16Module + distributed optimizer does;
- "pure bf16": AdamW(fused) directly on the bf16 parameters and bf16 grads, cheaper per step (no fp32 copies),
  printed for reference.

GPU trainer actors run with torch.compile on (megatron's compiled fusions, `rl/actor_layout.worker_env`); so does
this benchmark unless TORCHDYNAMO_DISABLE=1 is set. Tokens/s = batch x seq x steps / wall seconds of `--steps`
steps after one warm-up step, CUDA synchronised. MFU = 6 x active params x tokens/s / peak dense bf16 FLOP/s
(H100 SXM, H200: 989e12; other GPUs: n/a), for each side. `--profile DIR` writes torch.profiler's table of the
megatron step (the top CUDA kernels and CPU ops by self time) per size. Lines: per-size detail and
`size <s>: ... ratio <megatron / trainer-precision transformers> (goal >= <g>: met|NOT met)` with g = 1.5 with
Transformer Engine, 1.2 without, last `gpu_train ratio=<min over sizes>`. Without CUDA it prints one "needs CUDA"
line and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import gpu_common  # bench/ is sys.path[0] when run as a script

if TYPE_CHECKING:  # types only: the benchmark imports the library after parsing its arguments
    from kimi_pipeline.recipes.models import ModelSpec

NAME = "gpu_train"
GOAL_TE, GOAL_LOCAL = 1.5, 1.2  # issue 42: with Transformer Engine layers / megatron's local ones


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


def transformers_seconds(hf, tokens, targets, micro: int, steps: int, opt_spec, *, fp32_main: bool) -> float:
    """Seconds of `steps` optimizer steps; `fp32_main`: the trainer's precision (fp32 main grads and params)."""
    import torch

    hf.train()
    params = [p for p in hf.parameters() if p.requires_grad]
    main = [p.detach().float() for p in params] if fp32_main else params
    grads = [torch.zeros_like(m) for m in main] if fp32_main else None
    opt = torch.optim.AdamW(main, lr=opt_spec.lr, betas=(opt_spec.adam_beta1, opt_spec.adam_beta2),
                            eps=opt_spec.adam_eps, weight_decay=opt_spec.weight_decay, fused=True)
    total = tokens.numel()

    def step() -> None:
        if fp32_main:
            torch._foreach_zero_(grads)
        else:
            opt.zero_grad(set_to_none=True)
        for i in range(0, tokens.shape[0], micro):
            logits = hf(input_ids=tokens[i : i + micro], use_cache=False).logits.float()
            lp = torch.log_softmax(logits, -1).gather(-1, targets[i : i + micro, :, None]).squeeze(-1)
            (-lp.sum() / total).backward()
            if fp32_main:  # megatron's grad_reduce_in_fp32: accumulate each micro-batch in fp32
                for g, p in zip(grads, params):
                    g.add_(p.grad)
                    p.grad = None
        if fp32_main:
            for m, g in zip(main, grads):
                m.grad = g
        torch.nn.utils.clip_grad_norm_(main, opt_spec.clip_grad)
        opt.step()
        if fp32_main:
            with torch.no_grad():
                torch._foreach_copy_(params, main)

    try:
        return _timed(step, steps)
    finally:
        del opt, main, grads


def megatron_seconds(spec: ModelSpec, layout, device, hf_state, tokens, targets, micro: int, steps: int, opt_spec,
                     profile: Path | None = None):
    """(seconds, whether TE layers were used)."""
    from kimi_pipeline.model.hf_bridge import load_hf_tensors_into_model
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
        seconds = _timed(step, steps)
        if profile is not None:
            _profile(step, profile)
        return seconds, te
    finally:
        del chunks, opt


def _profile(step, out: Path) -> None:
    """torch.profiler's table of one more step: where the time goes (kernels vs host work between them)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    out.parent.mkdir(parents=True, exist_ok=True)
    averages = prof.key_averages()
    out.write_text(averages.table(sort_by="self_cuda_time_total", row_limit=30) + "\n\n"
                   + averages.table(sort_by="self_cpu_time_total", row_limit=30) + "\n")
    print(f"  profile of one megatron step: {out}")


def bench_size(size: str, device, layout, args) -> float:
    import torch

    from kimi_pipeline.hf.names import unfuse_hf_experts

    spec = gpu_common.kimi_spec(size)
    counts = gpu_common.param_counts(spec)
    opt_spec = _optimizer_spec()
    tokens, targets = _batch(spec.vocab_size, args.batch, args.seq, device, args.seed)
    per_step = tokens.numel()
    print(f"size {size}: {counts.total / 1e9:.2f} B params ({counts.active / 1e9:.2f} B active), {args.batch} rows x "
          f"{args.seq} tokens = {per_step} tokens/step in micro-batches of {args.micro}, {args.steps} steps")
    hf = gpu_common.hf_model(spec, device, seed=args.seed)
    hf_state = {k: v.detach().clone() for k, v in unfuse_hf_experts(hf.state_dict()).items()}
    seconds, peaks = {}, {}
    for side, fp32_main in (("trainer precision", True), ("pure bf16", False)):
        torch.cuda.reset_peak_memory_stats(device)
        seconds[side] = transformers_seconds(hf, tokens, targets, args.micro, args.steps, opt_spec, fp32_main=fp32_main)
        peaks[side] = torch.cuda.max_memory_allocated(device) / 2**30
        gc.collect()
        torch.cuda.empty_cache()
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile = None if args.profile is None else Path(args.profile) / f"gpu_train_profile_{size}.txt"
    seconds["megatron"], te = megatron_seconds(spec, layout, device, hf_state, tokens, targets, args.micro,
                                               args.steps, opt_spec, profile)
    peaks["megatron"] = torch.cuda.max_memory_allocated(device) / 2**30
    del hf_state
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)

    peak, board = gpu_common.peak_bf16_flops(torch.cuda.get_device_name(device))
    layers = "TE" if te else "local"
    labels = {"trainer precision": "transformers, fp32 main grads + params (fused AdamW)",
              "pure bf16": "transformers, pure bf16 (fused AdamW)",
              "megatron": f"megatron-core DDP + dist. Adam ({layers} layers)"}
    tps = {side: per_step * args.steps / s for side, s in seconds.items()}
    for side in ("trainer precision", "pure bf16", "megatron"):
        mfu = "n/a" if peak is None else f"{6 * counts.active * tps[side] / peak:.3f}"
        print(f"  {labels[side]:53s} {seconds[side] / args.steps * 1000:8.1f} ms/step  {tps[side]:10,.0f} tok/s  "
              f"MFU {mfu}  peak {peaks[side]:.1f} GiB")
    print(f"  MFU = 6 x {counts.active / 1e9:.3f} B active params x tok/s / "
          + (f"{peak / 1e12:.0f} TFLOP/s bf16 dense ({board})" if peak else board))
    goal = GOAL_TE if te else GOAL_LOCAL
    ratio = tps["megatron"] / tps["trainer precision"]
    print(f"size {size}: megatron / transformers (trainer precision) tokens/s ratio {ratio:.2f} "
          f"(goal >= {goal:g}: {'met' if ratio >= goal else 'NOT met'}; vs pure bf16 "
          f"{tps['megatron'] / tps['pure bf16']:.2f})")
    return ratio


def main(argv: list[str] | None = None) -> float | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="0.5b,2.5b", help=f"comma-separated, of {', '.join(gpu_common.SIZES)}")
    ap.add_argument("--batch", type=int, default=16, help="rows per optimizer step")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per row")
    ap.add_argument("--micro", type=int, default=4, help="rows per micro-batch")
    ap.add_argument("--steps", type=int, default=5, help="timed steps (after one warm-up step)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default=None, help="write torch.profiler tables of the megatron step into DIR")
    args = ap.parse_args(argv)
    if args.batch % args.micro:
        ap.error("--batch must be a multiple of --micro")
    device = gpu_common.cuda_device(NAME)
    if device is None:
        return None
    import torch

    from kimi_pipeline.model.parallel import destroy, init_distributed
    from kimi_pipeline.recipes.layout import Layout

    dynamo = "off (TORCHDYNAMO_DISABLE)" if os.environ.get("TORCHDYNAMO_DISABLE") == "1" else "on"
    print(f"{NAME}: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, torch.compile {dynamo}")
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
