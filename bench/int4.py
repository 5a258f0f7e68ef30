"""INT4 pack + unpack throughput vs a plain tensor copy of the same bytes.

    .venv/bin/python bench/int4.py [--experts 4] [--rows 2048] [--cols 7168] [--repeats 5] [--threads 1] [--device cpu]

Workload: `--experts` Kimi-K2 routed-expert gate/up weights ([moe_ffn 2048, hidden 7168] each) as int8
values in [-7, 7], i.e. what the export packs. One "pack + unpack" is compressed-tensors'
`pack_to_int32` (eight values per int32, +8 offset) followed by `unpack_from_int32` back to int8; the
baseline copies the same int8 bytes with `Tensor.copy_`. Throughput = int4 values (= input bytes)
per second, best of `--repeats`. Also shown: quantize + pack (the export's per-tensor work from a
bf16 weight). The last line is `int4 ratio=<pack+unpack throughput / copy throughput>`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kimi_pipeline.hf.int4 import pack_int4, quantize_int4, unpack_int4  # noqa: E402


def best_seconds(fn: Callable[[], object], repeats: int, device: str) -> float:
    fn()  # warm-up (allocator, lazy init)
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--rows", type=int, default=2048, help="Kimi-K2 moe_intermediate_size")
    ap.add_argument("--cols", type=int, default=7168, help="Kimi-K2 hidden_size (the packed, input dim)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dev = args.device

    g = torch.Generator(device=dev).manual_seed(0)
    shape = (args.experts, args.rows, args.cols)
    q = torch.randint(-7, 8, shape, generator=g, dtype=torch.int8, device=dev)
    w = (torch.randn(shape, generator=g, device=dev) * 0.02).to(torch.bfloat16)
    dst = torch.empty_like(q)
    n = q.numel()
    packed = pack_int4(q)
    assert torch.equal(unpack_int4(packed, q.shape), q), "round trip failed"

    t_copy = best_seconds(lambda: dst.copy_(q), args.repeats, dev)
    t_pack = best_seconds(lambda: pack_int4(q), args.repeats, dev)
    t_unpack = best_seconds(lambda: unpack_int4(packed, q.shape), args.repeats, dev)
    t_round = best_seconds(lambda: unpack_int4(pack_int4(q), q.shape), args.repeats, dev)
    t_qpack = best_seconds(lambda: pack_int4(quantize_int4(w.view(-1, args.cols), 32)[0]), args.repeats, dev)

    def rate(t: float) -> str:
        return f"{n / t / 1e9:7.3f} G values/s ({t * 1e3:8.2f} ms)"

    print(f"workload: {args.experts} x [{args.rows}, {args.cols}] = {n / 1e6:.1f} M int4 values "
          f"({n / 2**20:.0f} MiB int8 -> {packed.numel() * 4 / 2**20:.0f} MiB packed), device {dev}, "
          f"threads {args.threads}, torch {torch.__version__}")
    print(f"  copy (int8 bytes)      {rate(t_copy)}")
    print(f"  pack                   {rate(t_pack)}")
    print(f"  unpack                 {rate(t_unpack)}")
    print(f"  pack + unpack          {rate(t_round)}")
    print(f"  quantize + pack (bf16) {rate(t_qpack)}")
    ratio = t_copy / t_round
    print(f"int4 ratio={ratio:.4f}")
    return ratio


if __name__ == "__main__":
    main()
