"""Write the trained policy as the INT4 checkpoint inference engines load: a HF directory in
compressed-tensors `pack-quantized` format with Kimi-K2-Thinking's `quantization_config`.

Which Linear layers get packed is decided by that config's own `ignore` list (matched with
compressed-tensors' matcher), not by a second hand-kept rule, so the file and the config cannot
disagree: on a Kimi/DeepSeek-V3 model exactly the routed experts remain. Everything else is stored
bf16, except the router's `e_score_correction_bias`, which stays fp32 as in DeepSeek-V3/Kimi
checkpoints (it only shifts the top-k choice, and rounding it can flip near-ties).
Tensors stream through: one shard is held in memory at a time.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kimi_pipeline.errors import PermanentError
from kimi_pipeline.model.hf_model import copy_tokenizer_files
from kimi_pipeline.quant.int4 import SCALE_DTYPE, Int4ShapeError, pack_int4, quantize_int4
from kimi_pipeline.util.files import atomic_write_json

INDEX_NAME = "model.safetensors.index.json"
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


def _storage_dtype(name: str, t: torch.Tensor) -> torch.dtype:
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


class _ShardWriter:
    """Accumulate tensors up to max_shard_bytes, write each shard as it fills; names fixed at the end."""

    def __init__(self, out: Path, max_shard_bytes: int):
        self.out, self.max = out, max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[tuple[Path, list[str]]] = []

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max:
            self.flush()
        self.pending[name] = t.contiguous()
        self.pending_bytes += nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        path = self.out / f".shard-{len(self.shards):05d}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.shards.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> dict[str, str]:
        self.flush()
        n = len(self.shards)
        weight_map = {}
        for i, (tmp, names) in enumerate(self.shards, 1):
            final = f"model-{i:05d}-of-{n:05d}.safetensors"
            tmp.rename(self.out / final)
            weight_map.update(dict.fromkeys(names, final))
        return weight_map


def export_int4(
    hf_tensors: Iterable[tuple[str, torch.Tensor]],
    config: dict[str, Any],
    tokenizer_dir: str | Path | None,
    out_dir: str | Path,
    group_size: int = 32,
    *,
    max_shard_bytes: int = 5 * 1024**3,
) -> ExportInfo:
    """Write `out_dir` (atomically: temp dir + rename) as a compressed-tensors INT4 HF checkpoint.

    `hf_tensors` are HF-named tensors as Kimi stores them on disk (per-expert
    `mlp.experts.{e}.{gate,up,down}_proj.weight`); `config` is the Kimi config.json dict (its
    model_type is kept; `quantization_config` and `torch_dtype` are set here).
    """
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    qcfg = kimi_quantization_config(group_size)
    ignore = qcfg["ignore"]
    writer = _ShardWriter(tmp, max_shard_bytes)
    seen: set[str] = set()
    quantized: list[str] = []
    int4_bytes = bf16_bytes = 0
    try:
        for name, t in hf_tensors:
            if name in seen:
                raise ExportError(f"{name}: tensor given twice; the HF tensor source yields duplicates")
            seen.add(name)
            t = t.detach().cpu()
            bf16_bytes += t.numel() * (2 if t.is_floating_point() else t.element_size())
            if is_quantized(name, ignore):
                parts = int4_tensors(name, t, group_size)
                quantized.append(name)
            else:
                parts = {name: t.to(_storage_dtype(name, t))}
            for n, p in parts.items():
                int4_bytes += p.numel() * p.element_size()
                writer.add(n, p)
        if not seen:
            raise ExportError("no tensors to export: the HF tensor source was empty")
        weight_map = writer.finish()
        total = sum((tmp / f).stat().st_size for f in set(weight_map.values()))
        atomic_write_json(tmp / INDEX_NAME, {"metadata": {"total_size": int4_bytes}, "weight_map": weight_map})
        cfg = copy.deepcopy(config)
        cfg["quantization_config"] = qcfg
        cfg["torch_dtype"] = "bfloat16"
        atomic_write_json(tmp / "config.json", cfg)
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, tmp)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportInfo(
        path=str(out_dir), int4_bytes=int4_bytes, bf16_bytes=bf16_bytes, disk_bytes=total,
        num_quantized=len(quantized), num_tensors=len(seen), shards=len(set(weight_map.values())),
        quantized_names=quantized,
    )


def _replace_dir(new: Path, dest: Path) -> None:
    """Swap a finished directory into place; a crash leaves either the old or the new one, never a mix."""
    old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
    if dest.exists():
        dest.rename(old)
    new.rename(dest)
    shutil.rmtree(old, ignore_errors=True)


def read_index(model_dir: str | Path) -> dict[str, str]:
    path = Path(model_dir) / INDEX_NAME
    if not path.is_file():
        raise ExportError(f"{path} not found: not a sharded safetensors checkpoint")
    return json.loads(path.read_text())["weight_map"]


def iter_hf_dir_tensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor of an HF safetensors directory, one file open at a time, as stored."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ExportError(f"{model_dir}: no *.safetensors files")
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)
