"""FP8 / INT4 copies of an HF checkpoint, stored as Kimi ships them: what the tests and the tiny K2.5 pair use to
prove the loaders read the real formats (the inverse of `hf.source_formats`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kimi_pipeline.hf.config import with_quantization_config
from kimi_pipeline.hf.names import HFLayout
from kimi_pipeline.hf.reader import iter_stored_files
from kimi_pipeline.hf.shipped_files import copy_model_files
from kimi_pipeline.hf.source_formats import (
    FP8_SCALE_SUFFIX,
    FP8_TARGET,
    INT4_TARGET,
    KIMI_K25_IGNORE,
    fp8_quant_config,
    kimi_int4_quant_config,
    quantize_fp8_block,
    quantize_int4_packed,
)
from kimi_pipeline.util.files import atomic_write_json
from kimi_pipeline.util.shards import ShardWriter, finish_shards


def write_quantized_checkpoint(src: str | Path, dst: str | Path, kind: str, *, group_size: int = 32,
                               block: tuple[int, int] = (128, 128)) -> Path:
    """Copy an HF checkpoint with its language model's Linear weights stored as Kimi ships them (fp8 or int4); a
    multimodal checkpoint's other parts (K2.5's vision tower and projector) are copied as stored, and its INT4
    `quantization_config` is K2.5's (in text_config, its ignore list naming the vision parts)."""
    if kind not in ("fp8", "int4"):
        raise ValueError(f"kind must be fp8 or int4, not {kind!r}")
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    layout = HFLayout.of_config(config)
    writer = ShardWriter(dst, max_shard_bytes=1 << 62)  # one output shard per source shard
    for tensors in iter_stored_files(src):
        for name, t in tensors:
            if layout.logical(name) is None:  # not the language model: as stored
                writer.add(name, t)
            elif kind == "fp8" and FP8_TARGET.search(name):
                q, scale_inv = quantize_fp8_block(t, block)
                writer.add(name, q)
                writer.add(name + FP8_SCALE_SUFFIX, scale_inv)
            elif kind == "int4" and INT4_TARGET.search(name):
                for k, v in quantize_int4_packed(t, group_size).items():
                    writer.add(name[: -len(".weight")] + "." + k, v)
            else:
                writer.add(name, t.to(torch.bfloat16) if t.is_floating_point() else t)
        writer.flush()
    copy_model_files(src, dst)
    qc = fp8_quant_config(block) if kind == "fp8" else kimi_int4_quant_config(group_size)
    if kind == "int4" and layout.prefix:
        qc["ignore"] = list(KIMI_K25_IGNORE)
    atomic_write_json(dst / "config.json", with_quantization_config(config, qc, "bfloat16"))
    finish_shards(dst, writer.close())  # index last
    return dst
