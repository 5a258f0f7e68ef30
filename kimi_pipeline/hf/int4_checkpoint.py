"""Write the trained policy as the INT4 checkpoint inference engines load: a HF directory in
compressed-tensors `pack-quantized` format with Kimi's `quantization_config`.

Which Linear layers get packed is decided by Kimi-K2-Thinking's `ignore` list (matched with
compressed-tensors' matcher) on the language model's names: on a Kimi/DeepSeek-V3 model exactly the routed
experts remain. Everything else is stored bf16, except the router's `e_score_correction_bias`, which stays
fp32 as in DeepSeek-V3/Kimi checkpoints (it only shifts the top-k choice, and rounding it can flip near-ties).

The export is the base checkpoint with its language model replaced: tensors are stored under the base's own
names (`hf.names.HFLayout`: K2.5's `language_model.` prefix), and what RL does not train (K2.5's MoonViT
vision tower and projector) is copied from the base as stored, bit for bit, with every file the base ships
beside its weights (processor and preprocessor configs, chat template, tokenizer, remote code). The config
is the base's, with its own `ignore` list kept where it ships one (K2.5's also names the vision parts);
before the index is written every stored weight is checked against that list, so the file and the config
the engines read cannot disagree.
Tensors stream through: one shard is held in memory at a time (`util.shards`).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kimi_pipeline.errors import PermanentError
from kimi_pipeline.hf.config import quantization_config, with_quantization_config
from kimi_pipeline.hf.int4 import SCALE_DTYPE, Int4ShapeError, pack_int4, quantize_int4
from kimi_pipeline.hf.names import HFLayout
from kimi_pipeline.hf.reader import StoredTensors
from kimi_pipeline.hf.shipped_files import copy_model_files
from kimi_pipeline.hf.source_formats import KIMI_IGNORE
from kimi_pipeline.util.files import atomic_write_json
from kimi_pipeline.util.shards import Shard, ShardWriter, finish_shards

KEEP_FP32 = ("e_score_correction_bias",)
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


def export_quantization_config(base_config: dict[str, Any], group_size: int) -> dict[str, Any]:
    """Kimi's INT4 `quantization_config` for an export of `base_config`'s model, with the base's own `ignore` list
    when it ships one in compressed-tensors form (K2.5's names its vision tower and projector)."""
    qc = kimi_quantization_config(group_size)
    base = quantization_config(base_config)
    if base and base.get("quant_method") == "compressed-tensors" and base.get("ignore"):
        qc["ignore"] = list(base["ignore"])
    return qc


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
    num_tensors: int  # the language model's tensors (as trained)
    shards: int
    carried_tensors: int = 0  # the base's other parts (K2.5's vision tower and projector), copied as stored
    carried_bytes: int = 0
    carried_files: list[str] = field(default_factory=list)  # the base's files beside its weights, copied
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
                      max_shard_bytes: int, prefix: str = ".shard", layout: HFLayout = HFLayout()) -> Int4Part:
    """Quantize and write the language model's `hf_tensors` (the names table's names) as temp-named shards in
    `out`, stored under `layout`'s names (`finish_int4_dir` names the files)."""
    writer = ShardWriter(Path(out), max_shard_bytes, prefix)
    part = Int4Part(shards=writer.shards)
    for name, t, parts in int4_storage(hf_tensors, group_size):
        part.num_tensors += 1
        part.bf16_bytes += t.numel() * (2 if t.is_floating_point() else t.element_size())
        if name not in parts:
            part.quantized_names.append(name)
        for n, p in layout.stored_items(parts.items()):
            part.int4_bytes += p.numel() * p.element_size()
            writer.add(n, p)
    writer.close()
    return part


def carry_other_parts(base_dir: str | Path, out: Path, layout: HFLayout, max_shard_bytes: int) -> list[Shard]:
    """The base checkpoint's tensors outside the language model (K2.5's vision tower and projector) written into
    `out` exactly as stored (names, dtypes, bytes), one tensor in memory at a time. RL never trained them."""
    base = StoredTensors(base_dir)
    try:
        names = sorted(n for n in base.weight_map if layout.logical(n) is None)
        writer = ShardWriter(out, max_shard_bytes, ".carried")
        for name in names:
            writer.add(name, base.get(name))
        return writer.close()
    finally:
        base.close()


def _stem(stored: str) -> tuple[str, bool]:
    """(the Linear's `.weight` name, whether it is stored packed) of a stored tensor name."""
    for suffix in ("_packed", "_scale", "_shape"):
        if stored.endswith(".weight" + suffix):
            return stored.removesuffix(suffix), True
    return stored, False


def ignore_covering(ignore: list[str], weight_map: Iterable[str], layout: HFLayout) -> list[str]:
    """`ignore`, plus what it leaves out of the weights stored unquantized (a base whose list does not name them):
    one pattern per top-level module of the base's other parts (K2.5's vision tower, projector), the exact module
    name of a language-model Linear (a bare `lm_head` in front of K2.5's prefix). An engine must read them so."""
    out = list(ignore)
    uncovered = [n for n in weight_map if n.endswith(".weight") and not _stem(n)[1] and is_quantized(n, out)]
    roots = sorted({n.split(".", 1)[0] for n in uncovered if layout.logical(n) is None})
    out += [f"re:^{re.escape(root)}\\..*" for root in roots]
    out += sorted(n.removesuffix(".weight") for n in uncovered if layout.logical(n) is not None)
    return out


def check_config_agrees(weight_map: Iterable[str], ignore: list[str]) -> None:
    """Every stored weight is packed exactly when the config's ignore list says an engine will read it packed."""
    for stored in weight_map:
        name, packed = _stem(stored)
        if name.endswith(".weight") and is_quantized(name, ignore) != packed:
            raise ExportError(
                f"{stored}: stored {'packed' if packed else 'unquantized'}, but the export's quantization_config "
                f"ignore list {ignore} says {'not ' if packed else ''}quantized; an engine would misread it "
                "(the base's ignore list ignores a Linear Kimi quantizes)")


def finish_int4_dir(tmp: str | Path, out_dir: str | Path, parts: list[Int4Part], config: dict[str, Any],
                    base_dir: str | Path | None, group_size: int, *, max_shard_bytes: int = 5 << 30) -> ExportInfo:
    """Carry the base's other parts and files over, name the shards (parts' first, in order), write the index and
    the config, then swap `tmp` into `out_dir`. `config` is the base's config.json; `base_dir` None carries
    nothing (the config alone describes the model)."""
    tmp, out_dir = Path(tmp), Path(out_dir)
    if not any(p.num_tensors for p in parts):
        raise ExportError("no tensors to export: the HF tensor source was empty")
    layout = HFLayout.of_config(config)
    carried = carry_other_parts(base_dir, tmp, layout, max_shard_bytes) if base_dir is not None else []
    shards = [s for p in parts for s in p.shards] + carried
    other = [n for s in carried for n in s.names]
    try:
        weight_map = finish_shards(tmp, shards)
    except ValueError as e:
        raise ExportError(f"{tmp}: {e}") from None
    qc = export_quantization_config(config, group_size)
    qc["ignore"] = ignore_covering(qc["ignore"], weight_map, layout)
    check_config_agrees(weight_map, qc["ignore"])
    atomic_write_json(tmp / "config.json", with_quantization_config(config, qc, "bfloat16"))
    files = copy_model_files(base_dir, tmp) if base_dir is not None else []
    disk = sum((tmp / f).stat().st_size for f in set(weight_map.values()))
    _replace_dir(tmp, out_dir)
    return ExportInfo(
        path=str(out_dir), int4_bytes=sum(p.int4_bytes for p in parts), bf16_bytes=sum(p.bf16_bytes for p in parts),
        disk_bytes=disk, num_quantized=sum(len(p.quantized_names) for p in parts),
        num_tensors=sum(p.num_tensors for p in parts), shards=len(shards), carried_tensors=len(other),
        carried_bytes=sum(s.nbytes for s in carried), carried_files=files,
        quantized_names=[n for p in parts for n in p.quantized_names],
    )


def export_temp_dir(out_dir: str | Path, tag: str | int | None = None) -> Path:
    """The sibling temp directory an export is written into before it is swapped in."""
    out_dir = Path(out_dir)
    return out_dir.with_name(f".{out_dir.name}.tmp-{tag if tag is not None else os.getpid()}")


def export_int4(
    hf_tensors: Iterable[tuple[str, torch.Tensor]],
    config: dict[str, Any],
    base_dir: str | Path | None,
    out_dir: str | Path,
    group_size: int = 32,
    *,
    max_shard_bytes: int = 5 * 1024**3,
) -> ExportInfo:
    """Write `out_dir` (atomically: temp dir + rename) as a compressed-tensors INT4 HF checkpoint, in
    this process. (The export stage runs the same two steps distributed: each rank writes its share.)

    `hf_tensors` are the language model's tensors under the names table's names, per expert as Kimi stores them
    (`mlp.experts.{e}.{gate,up,down}_proj.weight`); `config` is the base's config.json dict (its model_type and
    layout are kept; `quantization_config` and `torch_dtype` are set here); `base_dir` the base checkpoint whose
    other parts and files are carried over.
    """
    tmp = export_temp_dir(out_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        part = write_int4_shards(hf_tensors, tmp, group_size, max_shard_bytes=max_shard_bytes,
                                 layout=HFLayout.of_config(config))
        return finish_int4_dir(tmp, out_dir, [part], config, base_dir, group_size, max_shard_bytes=max_shard_bytes)
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
