"""Conversion throughput vs `cp`: HF safetensors -> torch_dist with the real launcher, same files, one run.

    .venv/bin/python bench/convert.py [--gb 1.1] [--ranks 1] [--keep DIR]

Generates (in a temp dir) a bf16 checkpoint of the tiny recipe's architecture with larger dims — MLA,
sigmoid-routed MoE with expert bias, shared expert, first layer dense — of at least `--gb` GB, written
the way Kimi ships it (per-expert tensors, sharded safetensors + index). It then
1. converts it with `run_convert` (the stage's code path: a torchrun agent, one node × `--ranks` ranks,
   pp=`--ranks`; verification off — the tests cover it). One rank by default: on a 2-core machine one
   rank plus the writer processes megatron's torch_dist save forks already use both cores; and
2. copies the same safetensors files with `cp` and, as torch_dist's writer fsyncs its files, `sync`s them.
Both read the source from the page cache (it was just written). Conversion bytes/s = source bytes ÷ the
job's wall time (start-up of every rank, imports, model build, read, dequantize, save, tracker); the
detail lines also give the data phase alone (read + save, the slowest rank). Last line:
`convert ratio=<conversion bytes/s ÷ cp bytes/s>`.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kimi_pipeline.hf.config import hf_config_dict  # noqa: E402
from kimi_pipeline.recipes import load_recipe  # noqa: E402
from kimi_pipeline.recipes.models import ModelSpec  # noqa: E402
from kimi_pipeline.util.files import atomic_write_json  # noqa: E402
from kimi_pipeline.weightjobs.conversion import ConvertSections, run_convert  # noqa: E402

SHARD_BYTES = 256 * 2**20


def bench_spec(base: ModelSpec, experts: int) -> ModelSpec:
    """The tiny architecture, wider: 5 layers (1 dense + 4 MoE) so that pp=2 splits the experts evenly."""
    return base.model_copy(update=dict(
        num_layers=5, first_k_dense=1, hidden_size=1024, ffn_hidden_size=2816, num_attention_heads=8,
        q_lora_rank=256, kv_lora_rank=128, qk_head_dim=64, qk_pos_emb_head_dim=32, v_head_dim=64,
        vocab_size=32000, num_experts=experts, moe_router_topk=8, moe_ffn_hidden_size=512,
        params_dtype="bfloat16",
    ))


def hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """On-disk tensor names and shapes, from transformers' own DeepSeek-V3 module tree (built on meta)."""
    from transformers import DeepseekV3ForCausalLM

    from kimi_pipeline.hf.names import unfuse_hf_experts
    from kimi_pipeline.model.hf_model import deepseek_config

    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(deepseek_config(hf_config_dict(spec)))
    return {k: tuple(v.shape) for k, v in unfuse_hf_experts(model.state_dict()).items()}


def write_checkpoint(spec: ModelSpec, out: Path, seed: int = 0) -> int:
    """Random bf16 weights (norms = 1, small expert bias) in ~256 MiB shards; returns the bytes written."""
    from kimi_pipeline.util.shards import ShardWriter, finish_shards

    shapes = hf_shapes(spec)
    g = torch.Generator().manual_seed(seed)
    writer = ShardWriter(out, SHARD_BYTES)
    for name, shape in shapes.items():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        elif name.endswith("e_score_correction_bias"):
            t = torch.randn(shape, generator=g, dtype=torch.float32) * 1e-3
        else:
            t = (torch.randn(shape, generator=g, dtype=torch.float32) * 0.02).to(torch.bfloat16)
        writer.add(name, t)
    weight_map = finish_shards(out, writer.close())
    atomic_write_json(out / "config.json", hf_config_dict(spec))
    return sum((out / f).stat().st_size for f in set(weight_map.values()))


def time_cp(files: list[Path], dst: Path) -> tuple[float, float]:
    """(seconds of `cp`, seconds of `cp` + `sync` of the copies)."""
    dst.mkdir()
    t0 = time.monotonic()
    subprocess.run(["cp", *map(str, files), str(dst)], check=True)
    t1 = time.monotonic()
    subprocess.run(["sync", *[str(dst / f.name) for f in files]], check=True)
    t2 = time.monotonic()
    return t1 - t0, t2 - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.1, help="minimum checkpoint size in GB (1e9 bytes)")
    ap.add_argument("--ranks", type=int, default=1, help="ranks on the one node (pipeline stages)")
    ap.add_argument("--keep", type=Path, default=None, help="work here and keep the files (default: temp dir)")
    args = ap.parse_args()

    base = load_recipe("tiny")
    # experts so that the checkpoint reaches --gb: each routed expert is 3 * 1024 * 512 bf16 values per MoE layer
    per_expert = 3 * 1024 * 512 * 2 * 4
    experts = max(8, math.ceil((args.gb * 1e9 - 0.17e9) / per_expert / 8) * 8)
    spec = bench_spec(base.model, experts)
    recipe = base.model_copy(update={
        "name": "bench-convert",
        "model": spec,
        "convert": base.convert.model_copy(update=dict(nodes=1, gpus_per_node=args.ranks, tp=1, pp=args.ranks, ep=1,
                                                       decoder_first_pipeline_num_layers=3 if args.ranks == 2 else None,
                                                       verify=False)),
    })
    work = args.keep or Path(tempfile.mkdtemp(prefix="kimi-bench-convert-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.monotonic()
        src = work / "hf"
        shutil.rmtree(src, ignore_errors=True)
        nbytes = write_checkpoint(spec, src)
        print(f"generated {nbytes / 1e9:.3f} GB ({experts} experts x 4 MoE layers, hidden 1024, bf16) "
              f"in {time.monotonic() - t0:.1f} s -> {src}")
        files = sorted(src.glob("*.safetensors"))

        run_dir = work / "run"
        shutil.rmtree(run_dir, ignore_errors=True)
        section = run_convert(ConvertSections.of(recipe), run_dir, src, source_files={}, verify=False, reuse=False)
        reports = [json.loads(p.read_text()) for p in sorted((run_dir / "convert" / "work" / "reports").glob("rank_*.json"))]
        conv_s = section["seconds"]
        data_s = max(r["seconds"]["load"] + r["seconds"]["save"] for r in reports)

        cp_dst = work / "cp"
        shutil.rmtree(cp_dst, ignore_errors=True)
        cp_s, cp_sync_s = time_cp(files, cp_dst)

        conv_bps, data_bps, cp_bps = nbytes / conv_s, nbytes / data_s, nbytes / cp_sync_s
        print(f"convert: {conv_s:.2f} s end to end ({conv_bps / 1e6:.0f} MB/s), {args.ranks} ranks, "
              f"torch_dist {section['output_bytes'] / 1e9:.3f} GB")
        for r in reports:
            s = r["seconds"]
            print(f"  rank {r['rank']}: startup {s['startup']:.2f} s, init {s['init']:.2f} s, build {s['build']:.2f} s, read+load {s['load']:.2f} s, "
                  f"save {s['save']:.2f} s, teardown {s['teardown']:.2f} s, exit {conv_s - s['startup'] - s['total']:.2f} s, "
                  f"read {r['bytes_read'] / 1e9:.3f} GB, peak RSS {r['peak_rss_mb']:.0f} MiB")
        print(f"  data phase (read + save, slowest rank): {data_s:.2f} s ({data_bps / 1e6:.0f} MB/s)")
        print(f"cp: {cp_s:.2f} s, cp + sync {cp_sync_s:.2f} s ({cp_bps / 1e6:.0f} MB/s with sync, "
              f"{nbytes / cp_s / 1e6:.0f} MB/s without)")
        print(f"data-phase ratio={data_bps / cp_bps:.3f}")
        print(f"convert ratio={conv_bps / cp_bps:.3f}")
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
