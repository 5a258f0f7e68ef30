"""The weight format a rollout engine serves, and trained weights converted into it for weight sync.

The seeds' engines do not serve the trainer's bf16: Kimi-K2-Thinking and K2.5 serve the INT4
compressed-tensors checkpoint (routed experts pack-quantized, group 32; everything else bf16, the
router's expert bias fp32), Kimi-K2-Instruct serves FP8 with one fp32 `weight_scale_inv` per 128 x 128
block. A sync that sent bf16 `.weight` tensors would match neither the names nor the dtypes, and FP8
scales would go stale, so each bucket is converted on the trainer side into exactly what such a
checkpoint stores (the INT4 tensors are the export's own, `hf.int4_checkpoint.int4_storage`). The embedded
engine dequantizes them on load (`hf.source_formats.QuantizedParts`); SGLang loads them natively.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Literal

import torch

from kimi_pipeline.hf.int4_checkpoint import int4_storage, kimi_quantization_config, storage_dtype
from kimi_pipeline.hf.source_formats import FP8_SCALE_SUFFIX, FP8_TARGET, fp8_quant_config, quantize_fp8_block
from kimi_pipeline.recipes.models import RolloutSpec

EngineFormat = Literal["model", "bf16", "fp8", "int4"]
FP8_BLOCK = (128, 128)


def engine_weight_format(rollout: RolloutSpec, export_format: str, source_format: str) -> EngineFormat:
    """`rollout.engine_weight_format`, with `auto` resolved: SGLang serves what the seeds serve (the INT4
    export's format when the policy is exported to INT4, `quant.export_format`; FP8 for an FP8 hub checkpoint,
    `hub.source_format`; else bf16); the embedded engine holds the trainer's dtype ("model": no conversion)."""
    fmt = rollout.engine_weight_format
    if fmt != "auto":
        return fmt
    if rollout.engine != "sglang":
        return "model"
    if export_format == "int4":
        return "int4"
    return "fp8" if source_format == "fp8" else "bf16"


def engine_quant_config(fmt: EngineFormat, group_size: int) -> dict[str, Any] | None:
    """The config.json `quantization_config` of a checkpoint in this format (None: unquantized)."""
    if fmt == "int4":
        return kimi_quantization_config(group_size)
    if fmt == "fp8":
        return fp8_quant_config(FP8_BLOCK)
    return None


def to_engine_format(named: Iterable[tuple[str, torch.Tensor]], fmt: EngineFormat,
                     group_size: int) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named trainer tensors -> the tensors an engine checkpoint in `fmt` stores (streamed, per tensor).

    For int4 pass the *stored* weights, not fake-quantized ones: the engine's dequantization of the
    packed experts is bit for bit the trainer's fake-quant forward (`weightjobs.export_verify.check_tensors`).
    """
    if fmt == "model":
        yield from named
    elif fmt == "bf16":
        for name, t in named:
            yield name, t.to(storage_dtype(name, t))
    elif fmt == "int4":
        for _, _, parts in int4_storage(named, group_size):
            yield from parts.items()
    elif fmt == "fp8":
        for name, t in named:
            if FP8_TARGET.search(name) and t.ndim == 2:
                q, scale_inv = quantize_fp8_block(t, FP8_BLOCK)
                yield name, q
                yield name + FP8_SCALE_SUFFIX, scale_inv
            else:
                yield name, t.to(storage_dtype(name, t))
    else:
        raise ValueError(f"unknown engine weight format {fmt!r}")
