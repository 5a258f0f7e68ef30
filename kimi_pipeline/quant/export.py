"""Write the trained policy as the INT4 checkpoint inference engines load: a HF directory in
compressed-tensors `pack-quantized` format with Kimi-K2-Thinking's `quantization_config`.

Which Linear layers get packed is decided by that config's own `ignore` list (matched with
compressed-tensors' matcher), not by a second hand-kept rule, so the file and the config cannot
disagree: on a Kimi/DeepSeek-V3 model exactly the routed experts remain. Everything else is stored
bf16, except the router's `e_score_correction_bias`, which stays fp32 as in DeepSeek-V3/Kimi
checkpoints (it only shifts the top-k choice, and rounding it can flip near-ties).
Tensors stream through: one shard is held in memory at a time (`util.shards`).
"""

from __future__ import annotations

import copy
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kimi_pipeline.errors import PermanentError
from kimi_pipeline.model.hf_model import copy_tokenizer_files
from kimi_pipeline.quant.int4 import SCALE_DTYPE, Int4ShapeError, pack_int4, quantize_int4
from kimi_pipeline.util.files import atomic_write_json
from kimi_pipeline.util.shards import Shard, ShardWriter, finish_shards

KEEP_FP32 = ("e_score_correction_bias",)
# Kimi-K2-Thinking's ignore list, verbatim.
KIMI_IGNORE = [
    "lm_head",
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
]
# Modules with a 2-D `.weight` that are not nn.Linear in the HF model (targets are ["Linear"]).
_NOT_LINEAR = re.compile(r"(^|\.)(embed_tokens|[a-z_]*norm|mlp\.gate)$")


class ExportError(PermanentError):
    pass


def kimi_quantization_config(group_size: int = 32) -> dict[str, Any]:
    """The `quantization_config` Kimi-K2-Thinking ships (group_size from the recipe; Kimi uses 32)."""
    return {
        "config_groups": {
            "group_0": {
                "input_activations": None,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {
                    "actorder": None,
                    "block_structure": None,
                    "dynamic": False,
                    "group_size": group_size,
                    "num_bits": 4,
                    "observer": "minmax",
                    "observer_kwargs": {},
                    "strategy": "group",
                    "symmetric": True,
                    "type": "int",
                },
            }
        },
        "format": "pack-quantized",
        "ignore": list(KIMI_IGNORE),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


def is_quantized(tensor_name: str, ignore: Iterable[str] = KIMI_IGNORE) -> bool:
    """Whether an HF tensor is the weight of a Linear the config quantizes (targets Linear, minus ignore)."""
    if not tensor_name.endswith(".weight"):
        return False
    from compressed_tensors.utils.match import match_name  # the library's own ignore semantics (lazy: ~3 s import)

    module = tensor_name.removesuffix(".weight")
    if _NOT_LINEAR.search(module):
        return False
    return not any(match_name(module, pattern) for pattern in ignore)


def storage_dtype(name: str, t: torch.Tensor) -> torch.dtype:
    if not t.is_floating_point():
        return t.dtype
    return torch.float32 if name.endswith(KEEP_FP32) else torch.bfloat16


def int4_tensors(name: str, w: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """One Linear weight -> its compressed-tensors triple (`weight_packed`, `weight_scale`, `weight_shape`)."""
    if w.ndim != 2:
        raise ExportError(f"{name}: expected a 2-D Linear weight to quantize, got shape {tuple(w.shape)}")
    try:
        q, scale = quantize_int4(w, group_size, SCALE_DTYPE)
    except Int4ShapeError as e:
        raise Int4ShapeError(f"{name}: {e}") from None
    prefix = name.removesuffix(".weight")
    return {
        f"{prefix}.weight_packed": pack_int4(q),
        f"{prefix}.weight_scale": scale.contiguous(),
        f"{prefix}.weight_shape": torch.tensor(w.shape, dtype=torch.int64),  # as compressed-tensors writes it
    }


@dataclass
class ExportInfo:
    path: str
    int4_bytes: int  # tensor payload of the export (packed experts + bf16 rest)
    bf16_bytes: int  # tensor payload of the same model stored all-bf16
    disk_bytes: int  # safetensors files on disk (payload + headers)
    num_quantized: int
    num_tensors: int
    shards: int
    quantized_names: list[str] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("quantized_names")
        return d


@dataclass
class Int4Part:
    """What one writer (the whole export, or one rank's share of it) wrote into the output directory."""

    shards: list[Shard]
    int4_bytes: int = 0
    bf16_bytes: int = 0
    num_tensors: int = 0
    quantized_names: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "shards": [asdict(s) for s in self.shards]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Int4Part:
        return cls(**{**d, "shards": [Shard(**s) for s in d["shards"]]})


def int4_storage(hf_tensors: Iterable[tuple[str, torch.Tensor]], group_size: int,
                 ignore: Iterable[str] = KIMI_IGNORE) -> Iterator[tuple[str, torch.Tensor, dict[str, torch.Tensor]]]:
    """(source name, source tensor, the tensors stored for it): packed triples for quantized
    Linears, the storage dtype for the rest. Refuses a name given twice."""
    ignore = list(ignore)
    seen: set[str] = set()
    for name, t in hf_tensors:
        if name in seen:
            raise ExportError(f"{name}: tensor given twice; the HF tensor source yields duplicates")
        seen.add(name)
        t = t.detach()  # stays on its device (weight sync quantizes on the GPU); writers copy to the host
        parts = int4_tensors(name, t, group_size) if is_quantized(name, ignore) else {name: t.to(storage_dtype(name, t))}
        yield name, t, parts


def write_int4_shards(hf_tensors: Iterable[tuple[str, torch.Tensor]], out: str | Path, group_size: int, *,
                      max_shard_bytes: int, prefix: str = ".shard") -> Int4Part:
    """Quantize and write `hf_tensors` as temp-named shards in `out` (`finish_int4_dir` names them)."""
    writer = ShardWriter(Path(out), max_shard_bytes, prefix)
    part = Int4Part(shards=writer.shards)
    for name, t, parts in int4_storage(hf_tensors, group_size):
        part.num_tensors += 1
        part.bf16_bytes += t.numel() * (2 if t.is_floating_point() else t.element_size())
        if name not in parts:
            part.quantized_names.append(name)
        for n, p in parts.items():
            part.int4_bytes += p.numel() * p.element_size()
            writer.add(n, p)
    writer.close()
    return part


def finish_int4_dir(tmp: str | Path, out_dir: str | Path, parts: list[Int4Part], config: dict[str, Any],
                    tokenizer_dir: str | Path | None, group_size: int) -> ExportInfo:
    """Name the parts' shards (in order), write index, config and tokenizer, then swap `tmp` into `out_dir`."""
    tmp, out_dir = Path(tmp), Path(out_dir)
    shards = [s for p in parts for s in p.shards]
    if not any(p.num_tensors for p in parts):
        raise ExportError("no tensors to export: the HF tensor source was empty")
    try:
        weight_map = finish_shards(tmp, shards)
    except ValueError as e:
        raise ExportError(f"{tmp}: {e}") from None
    cfg = copy.deepcopy(config)
    cfg["quantization_config"] = kimi_quantization_config(group_size)
    cfg["torch_dtype"] = "bfloat16"
    atomic_write_json(tmp / "config.json", cfg)
    if tokenizer_dir is not None:
        copy_tokenizer_files(tokenizer_dir, tmp)
    disk = sum((tmp / f).stat().st_size for f in set(weight_map.values()))
    _replace_dir(tmp, out_dir)
    return ExportInfo(
        path=str(out_dir), int4_bytes=sum(p.int4_bytes for p in parts), bf16_bytes=sum(p.bf16_bytes for p in parts),
        disk_bytes=disk, num_quantized=sum(len(p.quantized_names) for p in parts),
        num_tensors=sum(p.num_tensors for p in parts), shards=len(shards),
        quantized_names=[n for p in parts for n in p.quantized_names],
    )


def export_temp_dir(out_dir: str | Path, tag: str | int | None = None) -> Path:
    """The sibling temp directory an export is written into before it is swapped in."""
    out_dir = Path(out_dir)
    return out_dir.with_name(f".{out_dir.name}.tmp-{tag if tag is not None else os.getpid()}")


def export_int4(
    hf_tensors: Iterable[tuple[str, torch.Tensor]],
    config: dict[str, Any],
    tokenizer_dir: str | Path | None,
    out_dir: str | Path,
    group_size: int = 32,
    *,
    max_shard_bytes: int = 5 * 1024**3,
) -> ExportInfo:
    """Write `out_dir` (atomically: temp dir + rename) as a compressed-tensors INT4 HF checkpoint, in
    this process. (The export stage runs the same two steps distributed: each rank writes its share.)

    `hf_tensors` are HF-named tensors as Kimi stores them on disk (per-expert
    `mlp.experts.{e}.{gate,up,down}_proj.weight`); `config` is the Kimi config.json dict (its
    model_type is kept; `quantization_config` and `torch_dtype` are set here).
    """
    tmp = export_temp_dir(out_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        part = write_int4_shards(hf_tensors, tmp, group_size, max_shard_bytes=max_shard_bytes)
        return finish_int4_dir(tmp, out_dir, [part], config, tokenizer_dir, group_size)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace_dir(new: Path, dest: Path) -> None:
    """Swap a finished directory into place; a crash leaves either the old or the new one, never a mix."""
    old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
    if dest.exists():
        dest.rename(old)
    new.rename(dest)
    shutil.rmtree(old, ignore_errors=True)
