"""The one reader of an HF safetensors checkpoint directory: single tensors by name, dequantized, or
every tensor as stored, one file at a time; never the whole model in memory.

The index (`model.safetensors.index.json`, or the header of a lone `model.safetensors`) says which
file holds which tensor; files are opened lazily with safetensors' `safe_open` (memory-mapped), so a
rank touches only the files and bytes of the tensors it asks for. Names are the logical HF names
(`model.layers.3.mlp.experts.7.up_proj.weight`): quantized storage (`weight` + `weight_scale_inv`
for FP8, `weight_packed/scale/shape` for INT4) is resolved and dequantized here, per tensor.

`StoredTensors` is random access to tensors as stored (HFCheckpoint's and the export check's);
`iter_stored_tensors` is the whole-model pass over the same directory (engine load, export inputs):
every tensor as stored, one file open at a time. Both share the index parsing and the errors that name
the missing or corrupt file, so every reader of a checkpoint directory fails the same clear way.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from kimi_pipeline.errors import PermanentError
from kimi_pipeline.hf.names import HFLayout
from kimi_pipeline.hf.source_formats import (
    FP8_SCALE_SUFFIX,
    INT4_SUFFIXES,
    Int4Dequantizer,
    SourceFormat,
    dequant_fp8_block,
    detect_format,
)
from kimi_pipeline.util.shards import INDEX_NAME

SINGLE_NAME = "model.safetensors"


class HFCheckpointError(PermanentError):
    """The checkpoint directory is incomplete or corrupt; the message names the file."""


def _dtype(name: str) -> torch.dtype:
    table = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"unsupported dtype {name!r} (one of {sorted(table)})")
    return table[name]


def _read_index(root: Path) -> dict[str, str] | None:
    """The index's weight map (stored name -> file), or None when the directory has no index."""
    index = root / INDEX_NAME
    if not index.is_file():
        return None
    try:
        return dict(json.loads(index.read_text())["weight_map"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise HFCheckpointError(f"{index}: not a safetensors index ({e.__class__.__name__}: {e})") from None


def _open_file(path: Path):
    """safe_open (memory-mapped), naming the file a partial download or an interrupted save left missing or broken."""

    if not path.is_file():
        raise HFCheckpointError(
            f"{path}: missing (listed in {INDEX_NAME}); the download or save is incomplete — re-run the download "
            "stage or re-save the checkpoint"
        )
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise HFCheckpointError(
            f"{path}: corrupt or truncated safetensors file ({e}); delete it and re-run the download stage "
            "(or re-save the checkpoint)"
        ) from None


def read_weight_map(model_dir: str | Path) -> dict[str, str]:
    """Stored tensor name -> file: the index's weight map, or the header of a lone model.safetensors."""
    root = Path(model_dir)
    index = _read_index(root)
    if index is not None:
        return index
    if (root / SINGLE_NAME).is_file():
        with _open_file(root / SINGLE_NAME) as f:
            return dict.fromkeys(f.keys(), SINGLE_NAME)
    raise HFCheckpointError(
        f"{root}: neither {INDEX_NAME} nor {SINGLE_NAME} found; the checkpoint has no weights "
        "(re-run the download stage, or point hub.model at a directory with safetensors)"
    )


def _weight_files(root: Path) -> list[str]:
    """The index's files in order; without an index every *.safetensors (a directory saved without one)."""
    index = _read_index(root)
    files = sorted(set(index.values())) if index is not None else sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise HFCheckpointError(f"{root}: no *.safetensors files (and no {INDEX_NAME}); not an HF checkpoint directory")
    return files


def iter_stored_files(model_dir: str | Path) -> Iterator[Iterator[tuple[str, torch.Tensor]]]:
    """Each file's (stored name, tensor as stored) pairs, file by file in shard order, one file open at a time,
    so a whole-model pass never maps the whole checkpoint; for a consumer that keeps the source's shards."""
    root = Path(model_dir)
    files = _weight_files(root)
    for fname in files:  # every file present before the first tensor: a consumer is never left half-loaded
        if not (root / fname).is_file():
            _open_file(root / fname)
    for fname in files:
        yield _file_tensors(root / fname)


def _file_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    with _open_file(path) as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


def iter_stored_tensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(stored name, tensor as stored) of every tensor, file by file (`iter_stored_files`). Nothing is
    dequantized: a quantized checkpoint yields its stored parts (`weight_scale_inv`, `weight_packed`, ...)
    under their own names."""
    for tensors in iter_stored_files(model_dir):
        yield from tensors


class StoredTensors:
    """Random access to tensors as stored, by stored name: one lazily opened (memory-mapped) handle per file.

    `weight_map` defaults to the directory's index; a rank checking its own shards before the index exists
    passes its own. Counts what it read, for the readers' stats."""

    def __init__(self, root: str | Path, weight_map: dict[str, str] | None = None):
        self.root = Path(root)
        self.weight_map = read_weight_map(self.root) if weight_map is None else weight_map
        self._handles: dict[str, Any] = {}
        self.bytes_read = 0

    def __contains__(self, stored: str) -> bool:
        return stored in self.weight_map

    def files_opened(self) -> set[str]:
        return set(self._handles)

    def _handle(self, stored: str):
        fname = self.weight_map.get(stored)
        if fname is None:
            raise HFCheckpointError(f"{self.root}: tensor {stored!r} is not in the checkpoint index (wrong model?)")
        h = self._handles.get(fname)
        if h is None:
            h = self._handles[fname] = _open_file(self.root / fname)
        return fname, h

    def shape(self, stored: str) -> tuple[int, ...]:
        """A stored tensor's shape, from its file's header (no data read)."""
        fname, h = self._handle(stored)
        try:
            return tuple(h.get_slice(stored).get_shape())
        except Exception as e:  # as in get()
            raise HFCheckpointError(f"{self.root / fname}: cannot read tensor {stored!r} listed in the index ({e}); "
                                    "the file is corrupt or from another revision — re-run the download stage") from None

    def get(self, stored: str) -> torch.Tensor:
        fname, h = self._handle(stored)
        try:
            t = h.get_tensor(stored)
        except Exception as e:  # safetensors raises its own error type for a name missing from the header
            raise HFCheckpointError(
                f"{self.root / fname}: cannot read tensor {stored!r} listed in the index ({e}); "
                "the file is corrupt or from another revision — re-run the download stage"
            ) from None
        self.bytes_read += t.numel() * t.element_size()
        return t

    def close(self) -> None:
        self._handles.clear()


def reference_mismatch(reference: HFCheckpoint, actor: HFCheckpoint) -> str | None:
    """The first language-model tensor (in name order) whose name or shape differs between a KL reference checkpoint
    and the actor's, described; None when they hold the same tensors. Each is read under its own names (prefix,
    format), so a BF16 reference of an INT4 actor compares by logical shapes."""
    ref, act = set(reference.names()), set(actor.names())
    for name in sorted(ref | act):
        if name not in act:
            return f"{reference.prefix}{name} is in the reference but not in the actor ({actor.root})"
        if name not in ref:
            return f"{actor.prefix}{name} of the actor is missing from the reference"
        if (a := reference.shape(name)) != (b := actor.shape(name)):
            return f"{reference.prefix}{name}: shape {list(a)} in the reference, {list(b)} in the actor"
    return None


class HFCheckpoint:
    """Lazily opened, index-driven view of an HF checkpoint directory.

    `get(name)` returns the logical tensor in `dtype` (None = as stored / dequantized to float32 and then
    cast to the checkpoint's torch_dtype). `stats()` says what was actually read.
    """

    def __init__(self, model_dir: str | Path, *, text_config_key: str | None = None, dtype: torch.dtype | None = None,
                 prefix: str | None = None):
        self.root = Path(model_dir)
        cfg_path = self.root / "config.json"
        if not cfg_path.is_file():
            raise HFCheckpointError(f"{cfg_path}: not found; is {self.root} an HF checkpoint directory?")
        try:
            self.config: dict[str, Any] = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise HFCheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
        self.format: SourceFormat = detect_format(self.config, text_config_key)
        self.dtype = dtype
        self._tensors = StoredTensors(self.root)
        self._stored: dict[str, str] = self._tensors.weight_map  # stored name -> file name
        self.layout = HFLayout.of_config(self.config) if prefix is None else HFLayout(prefix)
        self.prefix = self.layout.prefix
        self._check_prefix()
        self._int4 = Int4Dequantizer(self.format.quant_config) if self.format.kind == "int4" else None
        self._lock = threading.Lock()
        self._tensors_read = 0

    # ------------------------------------------------------------ index
    def _check_prefix(self) -> None:
        """The language model must be where the config's model_type says (`hf.names.HFLayout`): a checkpoint
        whose index disagrees (a text-only copy under a multimodal config, or the reverse) is refused, naming
        where its embeddings really are."""
        want = self.prefix + "model.embed_tokens.weight"
        if want in self._stored:
            return
        found = sorted(k.removesuffix("model.embed_tokens.weight") for k in self._stored
                       if k.endswith("model.embed_tokens.weight"))
        raise HFCheckpointError(
            f"{self.root}: config.json (model_type {self.config.get('model_type')!r}) puts the language model under "
            f"{self.prefix or 'no prefix'!r}, but the index has no {want}"
            + (f" (it has the embeddings under {', '.join(repr(f) for f in found)})" if found else "")
            + "; the config and the weights are from different checkpoints: re-download the model"
        )

    def _logical(self, stored: str) -> str | None:
        name = self.layout.logical(stored)
        if name is None:
            return None
        if self.format.kind == "fp8" and name.endswith(".weight" + FP8_SCALE_SUFFIX):
            return None
        if self.format.kind == "int4":
            for suf in INT4_SUFFIXES:
                if name.endswith(".weight" + suf):
                    return name[: -len(suf)] if suf == "_packed" else None
        return name

    def names(self) -> list[str]:
        """Every logical tensor name of the (language) model."""
        return sorted(n for n in map(self._logical, self._stored) if n is not None)

    def __contains__(self, name: str) -> bool:
        s = self.prefix + name
        return s in self._stored or (s + "_packed" in self._stored if self._int4 else False)

    def files(self) -> list[str]:
        return sorted(set(self._stored.values()))

    # ------------------------------------------------------------ reading
    def _raw(self, stored: str) -> torch.Tensor:
        return self._tensors.get(stored)

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The logical tensor `name`, dequantized if stored quantized, cast to `dtype` (or the reader's)."""
        dtype = dtype or self.dtype
        s = self.prefix + name
        with self._lock:
            if self._int4 is not None and s not in self._stored and s + "_packed" in self._stored:
                module = s[: -len(".weight")]
                parts = {k: self._raw(s + k[len("weight"):]) for k in ("weight_packed", "weight_scale", "weight_shape",
                                                                       "weight_zero_point") if s + k[len("weight"):] in self._stored}
                t = self._int4.dequant(module, parts)
                out_dtype = dtype or _dtype(self.format.details.get("dtype", "bfloat16"))
            elif self.format.kind == "fp8" and s + FP8_SCALE_SUFFIX in self._stored:
                w = self._raw(s)
                t = dequant_fp8_block(w, self._raw(s + FP8_SCALE_SUFFIX), self.format.details["weight_block_size"], name)
                out_dtype = dtype or _dtype(self.format.details.get("dtype", "bfloat16"))
            else:
                t = self._raw(s)
                if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                    raise HFCheckpointError(
                        f"{self.root}: {s} is stored as {t.dtype} without a {s + FP8_SCALE_SUFFIX} "
                        "block scale (or config.json lacks its fp8 quantization_config)"
                    )
                out_dtype = dtype or t.dtype
            self._tensors_read += 1
        return t if t.dtype == out_dtype else t.to(out_dtype)

    def shape(self, name: str) -> tuple[int, ...]:
        """The logical tensor's shape (an INT4 weight's from its stored `weight_shape`), without dequantizing."""
        s = self.prefix + name
        if self._int4 is not None and s not in self._stored and s + "_packed" in self._stored:
            return tuple(int(x) for x in self._raw(s + "_shape").tolist())
        return self._tensors.shape(s)

    def stats(self) -> dict[str, Any]:
        return {"tensors_read": self._tensors_read, "bytes_read": self._tensors.bytes_read,
                "files_opened": len(self._tensors.files_opened()), "files_total": len(self.files())}

    def total_bytes(self) -> int:
        """Bytes of all weight files (what a `cp` of the checkpoint would move)."""
        return sum((self.root / f).stat().st_size for f in self.files() if (self.root / f).is_file())

    def close(self) -> None:
        self._tensors.close()
