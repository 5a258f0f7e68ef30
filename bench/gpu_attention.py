"""MLA attention on one GPU: V as it is (q/k 192, v 128) vs V zero-padded to the q/k head size.

    .venv/bin/python bench/gpu_attention.py [--batch 4] [--seq 4096] [--heads 16] [--steps 20]

The local spec's core attention (`model/megatron_model.py`, MLADotProductAttention) pads MLA's 128-wide value
heads to the 192-wide query/key heads only where torch's SDPA would otherwise run its math path (CPU, whose flash
kernel needs one head size); this benchmark is the GPU evidence for leaving V unpadded there (on an H200 cuDNN's
kernel takes 192/128 as it is). Both run causal fwd+bwd in bf16 on [b, n, s, d] views of
[s, b, n, d] tensors, as the trainer does; the time is the mean of `--steps` after three warm-ups, CUDA
synchronised. Also prints which kernel each variant dispatched to (torch.profiler) and the largest difference of
their outputs. Last line: `gpu_attention ratio=<unpadded seconds / padded seconds>` (> 1: padding is faster).
"""

from __future__ import annotations

import argparse
import time

import gpu_common  # bench/ is sys.path[0] when run as a script

NAME = "gpu_attention"


def _run(q, k, v, pad: bool):
    import torch.nn.functional as F

    qq, kk, vv = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    dv = vv.shape[-1]
    if pad:
        vv = F.pad(vv, (0, qq.shape[-1] - dv))
    return F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=0.07)[..., :dv]


def _seconds(q, k, v, pad: bool, steps: int) -> float:
    import torch

    grad = torch.randn_like(_run(q, k, v, pad))

    def step():
        _run(q, k, v, pad).backward(grad)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def _kernels(q, k, v, pad: bool) -> str:
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _run(q, k, v, pad).sum().backward()
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages() if "attention" in e.key.lower() or "fmha" in e.key.lower()
             or "flash" in e.key.lower()}
    return ", ".join(sorted(n[:60] for n in names)) or "?"


def main(argv: list[str] | None = None) -> float | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16, help="heads on this rank (K2: 64 / TP)")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    device = gpu_common.cuda_device(NAME)
    if device is None:
        return None
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    shape = (args.seq, args.batch, args.heads)
    q, k = (torch.randn(*shape, 192, device=device, dtype=torch.bfloat16, generator=g, requires_grad=True)
            for _ in range(2))
    v = torch.randn(*shape, 128, device=device, dtype=torch.bfloat16, generator=g, requires_grad=True)
    with torch.no_grad():
        diff = (_run(q, k, v, True).float() - _run(q, k, v, False).float()).abs().max().item()
    plain, padded = _seconds(q, k, v, False, args.steps), _seconds(q, k, v, True, args.steps)
    print(f"{NAME}: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, b {args.batch} s {args.seq} "
          f"heads {args.heads}, q/k 192 v 128, causal fwd+bwd bf16")
    print(f"  V as it is:      {plain * 1000:8.2f} ms  kernels: {_kernels(q, k, v, False)}")
    print(f"  V padded to 192: {padded * 1000:8.2f} ms  kernels: {_kernels(q, k, v, True)}")
    print(f"  largest output difference {diff:.3g} (bf16)")
    ratio = plain / padded
    print(f"{NAME} ratio={ratio:.2f}")
    return ratio


if __name__ == "__main__":
    main()
