"""The one writer of sharded HF safetensors directories (INT4 export, disk weight sync).

Tensors stream in; a shard is written as soon as it would exceed `max_shard_bytes`, so one shard is in
memory at a time. Shards get temporary names first (`<prefix>-NNNNN.safetensors`): the final
`model-XXXXX-of-NNNNN` names need the total, which is known only when every writer is done — for a
distributed export, only when every rank is. `finish_shards` renames them in the given order and
writes the index last, so a directory with an index is complete.

Hand-written, not `huggingface_hub.save_torch_state_dict`: that one needs the whole state dict in
memory and names shards from one process.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from kimi_pipeline.util.files import atomic_write_json

INDEX_NAME = "model.safetensors.index.json"


@dataclass
class Shard:
    file: str  # name inside the output directory
    names: list[str]
    nbytes: int  # tensor payload


@dataclass
class ShardWriter:
    """Accumulate tensors up to `max_shard_bytes`; write each shard as it fills (fsynced)."""

    out: Path
    max_shard_bytes: int
    prefix: str = ".shard"
    shards: list[Shard] = field(default_factory=list)
    _pending: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    _pending_bytes: int = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self.flush()
        # own, contiguous CPU copy: safetensors refuses views sharing storage
        self._pending[name] = t.detach().to("cpu").contiguous()
        self._pending_bytes += nbytes

    def add_all(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> ShardWriter:
        for name, t in tensors:
            self.add(name, t)
        return self

    def flush(self) -> None:
        if not self._pending:
            return
        Path(self.out).mkdir(parents=True, exist_ok=True)
        fname = f"{self.prefix}-{len(self.shards):05d}.safetensors"
        path = Path(self.out) / fname
        save_file(self._pending, str(path), metadata={"format": "pt"})
        with open(path, "rb") as f:  # the index may say "complete" only over bytes that are on disk
            os.fsync(f.fileno())
        self.shards.append(Shard(fname, list(self._pending), self._pending_bytes))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[Shard]:
        self.flush()
        return self.shards


def finish_shards(out: Path, shards: list[Shard], *, metadata: dict | None = None) -> dict[str, str]:
    """Rename `shards` (files in `out`, in this order) to model-i-of-n and write the index last; returns
    the weight map. Names given twice (two writers claiming one tensor) are refused."""
    out = Path(out)
    n = len(shards)
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, 1):
        final = f"model-{i:05d}-of-{n:05d}.safetensors"
        for name in shard.names:
            if name in weight_map:
                raise ValueError(f"{name}: written into two shards ({weight_map[name]} and {shard.file})")
            weight_map[name] = final
        if shard.file != final:
            os.replace(out / shard.file, out / final)
    total = sum(s.nbytes for s in shards)
    atomic_write_json(out / INDEX_NAME, {"metadata": {"total_size": total, **(metadata or {})},
                                         "weight_map": weight_map})
    return weight_map
