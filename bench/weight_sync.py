"""Weight sync throughput vs `memcpy`: trainer tensors → a colocated embedded engine, measured in one run.

    .venv/bin/python bench/weight_sync.py [--gb 1.1] [--bucket-mb 512] [--repeat 3]

Two state dicts: the tiny model's (data/tiny/model, 6.9 MB) and a synthetic bf16 one of at least `--gb` GB
(the tiny architecture widened, as bench/convert.py builds it). For each, an embedded engine of that shape
serves SGLang's HTTP API in this process, and the trainer side pushes the tensors the way `PolicyWorker`
does (`Router.update_weights`: pause, buckets of `--bucket-mb`, each staged once in shared memory and read by
the engine, weight version with the last bucket, resume). Bytes made visible to the engine per second are
divided by the bytes per second of a plain `copy_` of the same tensors into preallocated buffers (the
memcpy baseline, measured right before). For context the old path is timed too on the first bucket: base64
safetensors in an HTTP body. Best of `--repeat` (the first sync also allocates the segment's pages; a run
keeps its segment, so later syncs are what a run sees). Last line: `weight_sync ratio=<≥ 1 GB ratio>`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from convert import bench_spec, hf_shapes  # noqa: E402  (one synthetic Kimi-shaped layout for both benches)

from kimi_pipeline.engine.client import Router, chunk_named_tensors, serialize_chunk  # noqa: E402
from kimi_pipeline.engine.model import EngineConfig, EngineModel, iter_safetensors  # noqa: E402
from kimi_pipeline.engine.sampler import RolloutEngine  # noqa: E402
from kimi_pipeline.engine.server import EngineServer  # noqa: E402
from kimi_pipeline.model.hf_config import hf_config_dict  # noqa: E402
from kimi_pipeline.model.hf_model import deepseek_config  # noqa: E402
from kimi_pipeline.recipes import load_recipe  # noqa: E402


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(label: str, named: dict[str, torch.Tensor], engine: EngineModel, bucket: int, repeat: int) -> float:
    nbytes = sum(t.numel() * t.element_size() for t in named.values())
    dst = {k: torch.empty_like(t) for k, t in named.items()}

    def memcpy() -> None:
        for k, t in named.items():
            dst[k].copy_(t)

    server = EngineServer(RolloutEngine(engine))
    server.start()
    try:
        with Router([server.url]) as router:
            client = router.clients[0]
            assert client.shares_memory(), "the engine should read this host's shared memory"
            t_copy = best(memcpy, repeat)
            t_sync = best(lambda: router.update_weights(named.items(), bucket, weight_version="v"), repeat)

            first = next(iter(chunk_named_tensors(named.items(), bucket)))  # the old path: one bucket is enough
            first_bytes = sum(t.numel() * t.element_size() for t in first.values())
            t_http = best(lambda: client.post_weight_chunk(serialize_chunk(first), None), 1)
    finally:
        server.stop()
    gbs = lambda t, n=nbytes: n / t / 1e9  # noqa: E731
    print(f"{label}: {nbytes / 1e9:.3f} GB in {len(named)} tensors, buckets of {bucket / 2**20:.0f} MiB")
    print(f"  memcpy {t_copy:.3f} s ({gbs(t_copy):.2f} GB/s) | shared-memory sync {t_sync:.3f} s "
          f"({gbs(t_sync):.2f} GB/s) | safetensors HTTP body, first bucket: {gbs(t_http, first_bytes):.3f} GB/s")
    ratio = t_copy / t_sync
    print(f"  {label} ratio={ratio:.3f} (HTTP bodies: {gbs(t_http, first_bytes) / gbs(t_copy):.4f})")
    return ratio


def synthetic(gb: float) -> tuple[dict[str, torch.Tensor], EngineModel]:
    base = load_recipe("tiny").model
    experts = 8
    while True:
        spec = bench_spec(base, experts)
        shapes = hf_shapes(spec)
        total = sum(2 * torch.Size(s).numel() for s in shapes.values())
        if total >= gb * 1e9:
            break
        experts *= 2
    g = torch.Generator().manual_seed(0)
    named = {n: torch.randn(s, generator=g, dtype=torch.float32).to(torch.bfloat16) for n, s in shapes.items()}
    cfg = deepseek_config(hf_config_dict(spec))
    engine = EngineModel(EngineConfig.from_hf(cfg), "cpu", torch.bfloat16, hf_config=cfg)
    return named, engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.1)
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)  # the trainer's and the engine's copies each run on one core, as in a colocated rank
    bucket = args.bucket_mb * 2**20

    tiny_dir = ROOT / "data" / "tiny" / "model"
    tiny = {k: v.clone() for k, v in iter_safetensors(tiny_dir)}
    measure("tiny", tiny, EngineModel.from_pretrained(tiny_dir), bucket, args.repeat)
    named, engine = synthetic(args.gb)
    ratio = measure("synthetic", named, engine, bucket, args.repeat)
    print(f"weight_sync ratio={ratio:.3f}")


if __name__ == "__main__":
    main()
