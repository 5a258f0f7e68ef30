"""Weight sync throughput vs `memcpy`, measured in one run: the colocated sync's collectives on 4 gloo ranks, and
the handoff into an embedded engine.

    .venv/bin/python bench/weight_sync.py [--gb 0.25] [--bucket-mb 64] [--repeat 3] [--engine-gb 1.1]

1. **Multi-rank** (the last line): 4 trainer ranks (real OS processes, gloo over loopback, one thread each) at
   PP 2 x EP 2 hold a randomly initialised bf16 model of the tiny architecture widened to at least `--gb` GB
   (bench/convert.py's layout). Each rank assembles every bucket of `--bucket-mb` the way the colocated sync does
   (`weight_sync.buckets.gather_bucket`: the pipeline broadcast, the EP all-gather, one flat buffer per dtype,
   then the HF tensors). Baseline: `copy_` of the bytes that rank must receive (`BucketSchedule.received_bytes`), in
   the schedule's bucket sizes, on the same rank at the same time as the other ranks copy theirs. Ratio per rank =
   memcpy seconds / sync seconds (best of `--repeat` each); the slowest rank's is printed.
2. **Handoff into one engine** (context, `engine ratio=`): a colocated embedded engine of the same shape as a
   synthetic state dict of at least `--engine-gb` GB (and the tiny model's, 6.9 MB) takes it through one kept
   shared-memory segment (`Router.update_weights`: pause, weight-update session, buckets, version, resume),
   vs `copy_` of the same tensors; the old path, a base64 safetensors HTTP body, timed on its first bucket
   inside a weight-update session.

Last line: `weight_sync ratio=<multi-rank ratio>`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from convert import bench_spec, hf_shapes

from kimi_pipeline.engine.client import Router
from kimi_pipeline.engine.model import EngineConfig, EngineModel, iter_safetensors
from kimi_pipeline.engine.rollout_engine import RolloutEngine
from kimi_pipeline.engine.server import EngineServer
from kimi_pipeline.hf.config import hf_config_dict
from kimi_pipeline.model.hf_model import deepseek_config
from kimi_pipeline.recipes import load_recipe
from kimi_pipeline.recipes.models import ModelSpec
from kimi_pipeline.util.net import free_port
from kimi_pipeline.weight_sync.push import chunk_named_tensors, serialize_chunk, weight_update_session

RANKS, PP, EP = 4, 2, 2


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def widened(gb: float) -> ModelSpec:
    """The tiny architecture widened until its bf16 weights reach `gb` GB (more experts, in powers of two); the
    tiny model itself below its own size (the suite's smoke run)."""
    base = load_recipe("tiny").model
    if gb * 1e9 <= sum(2 * torch.Size(s).numel() for s in hf_shapes(base).values()):
        return base.model_copy(update={"params_dtype": "bfloat16"})
    experts = 8
    while True:
        spec = bench_spec(base, experts)
        if sum(2 * torch.Size(s).numel() for s in hf_shapes(spec).values()) >= gb * 1e9:
            return spec
        experts *= 2


# --------------------------------------------------------------------------- 1. the multi-rank collectives


def rank_main(spec_json: str, bucket: int, repeat: int, out: Path) -> None:
    """One trainer rank: build its slice, time the colocated sync's bucket assembly and the memcpy baseline."""
    import torch.distributed as dist

    from kimi_pipeline.model.hf_bridge import model_tensors
    from kimi_pipeline.model.megatron_model import build_model
    from kimi_pipeline.model.parallel import destroy, init_distributed
    from kimi_pipeline.recipes.layout import Layout
    from kimi_pipeline.weight_sync.buckets import (
        BucketSchedule,
        Groups,
        SyncCounters,
        gather_bucket,
        pp_stage_dtypes,
        received_by_group,
    )

    spec = ModelSpec.model_validate_json(spec_json)
    layout = Layout(world_size=RANKS, pp=PP, ep=EP, last_pp_stage_layers=spec.num_layers // 2)
    init_distributed(layout, device=torch.device("cpu"), seed=0)
    model = build_model(spec, layout, device=torch.device("cpu"))
    tensors, groups = model_tensors(model), Groups.current()
    schedule = BucketSchedule.build(spec, layout, buffer_bytes=bucket, dtype=torch.bfloat16, use_te=False,
                            pp_stage_dtypes=pp_stage_dtypes(tensors, groups))
    counters = SyncCounters()

    def sync() -> None:
        dist.barrier()
        for b in schedule.buckets:
            for _ in gather_bucket(b, tensors, groups, torch.device("cpu"), counters):
                pass

    received = schedule.received_bytes(groups.pp_rank)
    sizes = [sum(received_by_group(b, layout, groups.pp_rank).values()) for b in schedule.buckets]
    src = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    dst = [torch.empty_like(s) for s in src]
    for s in src:
        s.fill_(1)

    def memcpy() -> None:
        dist.barrier()
        for s, d in zip(src, dst):
            d.copy_(s)

    sync()  # warm: the first pass allocates
    t_sync = best(sync, repeat)
    memcpy()
    t_copy = best(memcpy, repeat)
    out.write_text(json.dumps({"rank": dist.get_rank(), "stage": groups.pp_rank, "received": received,
                               "buckets": len(schedule.buckets), "collectives": counters.total // (repeat + 1),
                               "t_sync": t_sync, "t_copy": t_copy}))
    destroy()


def multi_rank(spec: ModelSpec, bucket: int, repeat: int) -> float:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for rank in range(RANKS):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(RANKS), "LOCAL_RANK": str(rank),
                   "LOCAL_WORLD_SIZE": str(RANKS), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "PYTHONWARNINGS": "ignore"}
            procs.append(subprocess.Popen([sys.executable, os.environ.get("KIMI_BENCH_RANK_SCRIPT", __file__), "--rank-worker", spec.model_dump_json(),
                                           str(bucket), str(repeat), f"{tmp}/rank{rank}.json"], env=env, cwd=ROOT))
        codes = [p.wait(timeout=1800) for p in procs]
        if any(codes):
            raise SystemExit(f"multi-rank case failed: exit codes {codes}")
        ranks = [json.loads(Path(f"{tmp}/rank{r}.json").read_text()) for r in range(RANKS)]
    print(f"multi-rank: {RANKS} gloo ranks at PP {PP} x EP {EP}, {ranks[0]['buckets']} buckets of "
          f"{bucket / 2**20:.0f} MiB, {ranks[0]['collectives']} collectives per rank per sync")
    for r in ranks:
        gbs = lambda t, n=r["received"]: n / t / 1e9
        print(f"  rank {r['rank']} (stage {r['stage']}): receives {r['received'] / 1e9:.3f} GB; sync "
              f"{r['t_sync']:.3f} s ({gbs(r['t_sync']):.2f} GB/s) | memcpy {r['t_copy']:.3f} s "
              f"({gbs(r['t_copy']):.2f} GB/s) | ratio {r['t_copy'] / r['t_sync']:.3f}")
    return min(r["t_copy"] / r["t_sync"] for r in ranks)


# --------------------------------------------------------------------------- 2. the handoff into one engine


def engine_handoff(label: str, named: dict[str, torch.Tensor], engine: EngineModel, bucket: int,
                   repeat: int) -> float:
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
            with weight_update_session(client):  # SGLang refuses tensor updates outside one (400)
                t_http = best(lambda: client.post_weight_chunk(serialize_chunk(first), None), 1)
    finally:
        server.stop()
    gbs = lambda t, n=nbytes: n / t / 1e9
    print(f"{label}: {nbytes / 1e9:.3f} GB in {len(named)} tensors, buckets of {bucket / 2**20:.0f} MiB")
    print(f"  memcpy {t_copy:.3f} s ({gbs(t_copy):.2f} GB/s) | shared-memory sync {t_sync:.3f} s "
          f"({gbs(t_sync):.2f} GB/s) | safetensors HTTP body, first bucket: {gbs(t_http, first_bytes):.3f} GB/s")
    ratio = t_copy / t_sync
    print(f"  {label} engine ratio={ratio:.3f} (HTTP bodies: {gbs(t_http, first_bytes) / gbs(t_copy):.4f})")
    return ratio


def synthetic(gb: float) -> tuple[dict[str, torch.Tensor], EngineModel]:
    spec = widened(gb)
    g = torch.Generator().manual_seed(0)
    named = {n: torch.randn(s, generator=g, dtype=torch.float32).to(torch.bfloat16)
             for n, s in hf_shapes(spec).items()}
    cfg = deepseek_config(hf_config_dict(spec))
    return named, EngineModel(EngineConfig.from_hf(cfg), "cpu", torch.bfloat16, hf_config=cfg)


def main(argv: list[str] | None = None) -> float:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank-worker"]:
        rank_main(argv[1], int(argv[2]), int(argv[3]), Path(argv[4]))
        return 0.0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=0.25,
                    help="multi-rank model size (bf16 GB, all ranks together; 0: the tiny model)")
    ap.add_argument("--bucket-mb", type=int, default=64, help="update_weight_buffer_size of the multi-rank case")
    ap.add_argument("--engine-gb", type=float, default=1.1, help="state dict of the engine handoff case (0: skip)")
    ap.add_argument("--engine-bucket-mb", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # the trainer's and the engine's copies each run on one core, as in a colocated rank

    engine_bucket = args.engine_bucket_mb * 2**20
    tiny_dir = ROOT / "data" / "tiny" / "model"
    tiny = {k: v.clone() for k, v in iter_safetensors(tiny_dir)}
    engine_handoff("tiny", tiny, EngineModel.from_pretrained(tiny_dir), engine_bucket, args.repeat)
    if args.engine_gb > 0:
        named, engine = synthetic(args.engine_gb)
        engine_handoff("synthetic", named, engine, engine_bucket, args.repeat)
        del named, engine
    ratio = multi_rank(widened(args.gb), args.bucket_mb * 2**20, args.repeat)
    print(f"weight_sync ratio={ratio:.3f}")
    return ratio


if __name__ == "__main__":
    main()
