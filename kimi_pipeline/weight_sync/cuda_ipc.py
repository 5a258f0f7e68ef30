"""Colocated weight sync to SGLang over CUDA IPC, without importing SGLang: the bytes of one
`/update_weights_from_tensor` call that SGLang 0.5.23 deserializes.

SGLang runs in its own Python environment, so the trainer cannot call SGLang's `MultiprocessingSerializer`. This
module produces what that serializer would: a `ForkingPickler` dump, base64-encoded, of one TP rank's bucket in
SGLang's "flattened_bucket" format (the format slime and miles send for colocated sync). Citations are of SGLang
0.5.23 (`sglang/srt/...`).

How SGLang reads the request:
- HTTP body: `UpdateWeightsFromTensorReqInput` (managers/io_struct.py:2027-2047). `serialized_named_tensors` is one
  base64 string per SGLang TP rank; the HTTP schema decodes them with `Base64Bytes` (utils/msgspec_utils.py:12-35,
  `base64.b64decode(..., validate=True)`), and the tokenizer manager normalizes them to raw pickle bytes
  (managers/tokenizer_control_mixin.py:578-580, utils/common.py:3109-3133). Unknown keys are ignored
  (utils/msgspec_utils.py:94-99); `weight_version` must be a string.
- Each TP rank's scheduler unpickles only entry `[tp_rank]` (managers/tp_worker.py:194-201, called from
  managers/scheduler_components/weight_updater.py:243-245), after `monkey_patch_torch_reductions()` and with
  `SafeUnpickler`, an allow-list of globals (utils/common.py:3084-3099, 3144-3370). An entry must be unpickled
  exactly once: a second load of the same CUDA-IPC payload would release the producer's reference count twice
  (tp_worker.py:195-197).
- With `load_format == "flattened_bucket"` the unpickled object is a dict `{"flattened_tensor", "metadata"}`; SGLang
  reads each metadata item by attribute (`name, shape, dtype, start_idx, end_idx, numel`), rebuilds its own
  `FlattenedTensorMetadata`, views `flattened_tensor[start_idx:end_idx].view(dtype).reshape(shape)` and calls
  `model.load_weights` (model_executor/model_runner_components/weight_updater.py:352-357, 383-413;
  weight_sync/tensor_bucket.py:7-16, 118-135).

Choices, and why:
- Metadata items are `types.SimpleNamespace`, not SGLang's `FlattenedTensorMetadata` dataclass. Pickle names a
  class by its import path and the pickler checks that path by importing it, so a payload naming
  `sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata` cannot be written without SGLang (or a fake
  `sglang` module in `sys.modules`). SGLang converts the items by attribute anyway (weight_updater.py:393-402), and
  `("types", "SimpleNamespace")` is on SafeUnpickler's allow-list (utils/common.py:3176). The payload then holds
  only builtins, `types.SimpleNamespace` and torch's own rebuild functions and dtypes, all on that list.
- "flattened_bucket" rather than the plain list of `(name, tensor)` (load_format None): one CUDA-IPC handle and one
  producer reference count per bucket instead of per tensor (a Kimi MoE checkpoint has tens of thousands of
  tensors), and it is the path slime and miles drive against SGLang. The cost is one copy of the bucket on the
  trainer's GPU.
- Each tensor starts at a multiple of `_ALIGN` bytes. SGLang's reader does `.view(dtype)` on a uint8 slice, which
  needs the slice's offset to be a multiple of the dtype's size; SGLang's own `FlattenedTensorBucket` packs tensors
  back to back (tensor_bucket.py:53-69), so a 3-byte fp8 scale before a bf16 weight would fail there. The reader
  uses `start_idx`/`end_idx` only, so the gaps are never read.
- CUDA tensors name their device by UUID, not index. torch's `reduce_tensor` puts the producer's device index at
  argument 6 of `rebuild_cuda_tensor`; SGLang's `monkey_patch_torch_reductions` makes the receiver accept either an
  int or a UUID string there and map the UUID to its own index (utils/patch_torch.py:41-52, 64, 80-99), which is
  what makes the handle land on the right GPU when the trainer and SGLang see the GPUs under different
  CUDA_VISIBLE_DEVICES. The receiver's `find_class("torch.multiprocessing.reductions", "rebuild_cuda_tensor")`
  returns the patched function because the patch replaces that module attribute before unpickling
  (tp_worker.py:198). We write the UUID with a reducer installed on our pickler instance only: no global monkey
  patch, and CPU tensors keep torch's reducer (SGLang's patched reducer rewrites argument 6 of every tensor's
  reduction, which a CPU tensor's 3-tuple does not have).

The caller's part: gather one entry per SGLang TP rank, in TP-rank order, onto one rank (the one on TP rank 0's
GPU), which posts `build_update_request(entries)` between `/begin_weight_update` and `/end_weight_update` (SGLang
refuses the update outside that session: managers/scheduler_components/weight_updater.py:232-240, 309-334). The
shared buffer stays allocated after `serialize_bucket` returns: torch parks a freed CUDA block that a consumer still
references in its IPC "limbo" until SGLang drops its view (the consumer synchronizes its stream before releasing),
so call `torch.cuda.ipc_collect()` after the engine answers. An entry that SGLang never unpickles (a refused
request) keeps its buffer until the trainer process exits.
"""

from __future__ import annotations

import base64
import functools
import io
from collections.abc import Callable, Sequence
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace
from typing import Any

import torch
from torch.multiprocessing import reductions

LOAD_FORMAT = "flattened_bucket"
_ALIGN = 16  # bytes: a multiple of every torch dtype's size (complex128 is the largest, 16)
# Position of the device in `rebuild_cuda_tensor`'s arguments (torch/multiprocessing/reductions.py), the same
# constant as SGLang's `_REDUCE_TENSOR_ARG_DEVICE_INDEX` (utils/patch_torch.py:64).
_DEVICE_ARG = 6

__all__ = ["LOAD_FORMAT", "build_update_request", "flatten_bucket", "serialize_bucket"]


def flatten_bucket(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list[SimpleNamespace]]:
    """Copy the tensors into one uint8 tensor on their device; return it with the metadata SGLang reads.

    Metadata fields and meaning follow SGLang's `FlattenedTensorMetadata` (weight_sync/tensor_bucket.py:7-16):
    `numel` is the byte count, `end_idx - start_idx`. Starts are aligned to `_ALIGN` bytes (see the module doc).
    A new buffer every call: SGLang answers before it is guaranteed to have copied out of the buffer, so a buffer
    that was shared must never be overwritten."""
    if not named:
        raise ValueError("an empty bucket: SGLang's flattened_bucket needs at least one tensor")
    device: torch.device | None = None
    meta: list[SimpleNamespace] = []
    offset = 0
    for name, tensor in named:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected (str, Tensor) pairs, got ({type(name).__name__}, {type(tensor).__name__})")
        device = tensor.device if device is None else device
        if tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device}, the bucket on {device}: one bucket is one device")
        if tensor.layout != torch.strided:
            raise ValueError(f"{name}: only dense tensors can be flattened")
        start = -(-offset // _ALIGN) * _ALIGN
        nbytes = tensor.numel() * tensor.element_size()
        meta.append(SimpleNamespace(name=name, shape=tensor.shape, dtype=tensor.dtype, start_idx=start,
                                    end_idx=start + nbytes, numel=nbytes))
        offset = start + nbytes
    flat = torch.empty(offset, dtype=torch.uint8, device=device)
    for (_, tensor), m in zip(named, meta):
        if m.numel:  # the receiver's own view (weight_sync/tensor_bucket.py:127-131); copy_ takes any strides
            flat[m.start_idx:m.end_idx].view(m.dtype).view(m.shape).copy_(tensor.detach())
    return flat, meta


def serialize_bucket(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """One TP rank's entry of `serialized_named_tensors`: what SGLang's
    `MultiprocessingSerializer.serialize({"flattened_tensor": ..., "metadata": ...}, output_str=True)` returns
    (utils/common.py:3060-3082) — a ForkingPickler dump, standard base64 — with CUDA devices named by UUID.

    CUDA tensors travel as IPC handles (the bytes stay on the GPU); CPU tensors as file descriptors passed through
    multiprocessing's resource sharer, which only a process holding this process's authkey can fetch, once. Each
    entry is for one SGLang TP rank and must be unpickled by exactly one process, once."""
    flat, meta = flatten_bucket(named)
    buf = io.BytesIO()
    _UuidPickler(buf).dump({"flattened_tensor": flat, "metadata": meta})
    return base64.b64encode(buf.getvalue()).decode("ascii")


def build_update_request(entries: Sequence[str], *, flush_cache: bool = False, weight_version: str | None = None,
                         tp_size: int | None = None) -> dict[str, Any]:
    """The JSON body of one `/update_weights_from_tensor` call: `entries[i]` is `serialize_bucket` on the GPU of
    SGLang TP rank i (each rank unpickles only its own index: managers/tp_worker.py:194-201).

    `flush_cache` defaults to False, unlike SGLang (io_struct.py:2039): with requests running or queued a flush
    fails the whole call after the weights were written (scheduler_components/weight_updater.py:120-131), and one
    flush after the last bucket (or `/flush_cache`) is enough."""
    entries = list(entries)
    if not entries:
        raise ValueError("no entries: one per SGLang TP rank is needed")
    if tp_size is not None and len(entries) != tp_size:
        raise ValueError(f"{len(entries)} entries for an engine of tp_size {tp_size}: one per TP rank is needed")
    if not all(isinstance(e, str) for e in entries):
        raise TypeError("entries must be the base64 strings serialize_bucket returns")
    if weight_version is not None and not isinstance(weight_version, str):
        raise TypeError("weight_version must be a str (SGLang's field is Optional[str]: io_struct.py:2043)")
    return {"serialized_named_tensors": entries, "load_format": LOAD_FORMAT, "flush_cache": bool(flush_cache),
            "weight_version": weight_version}


@functools.cache
def _device_uuid(index: int) -> str:
    """The string SGLang compares, `str(get_device_properties(i).uuid)` (utils/patch_torch.py:85-99)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def _uuid_device_args(rebuild: Callable[..., Any], args: tuple[Any, ...],
                      uuid_of: Callable[[int], str] = _device_uuid) -> tuple[Any, ...]:
    """`args` with a CUDA rebuild's device index replaced by that device's UUID; any other reduction unchanged
    (the same rewrite as SGLang's `_reduce_tensor_modified`, patch_torch.py:72-77, limited to CUDA tensors)."""
    if rebuild is reductions.rebuild_cuda_tensor and len(args) > _DEVICE_ARG and isinstance(args[_DEVICE_ARG], int):
        return (*args[:_DEVICE_ARG], uuid_of(args[_DEVICE_ARG]), *args[_DEVICE_ARG + 1:])
    return args


def _reduce_tensor_by_uuid(tensor: torch.Tensor) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    rebuild, args = reductions.reduce_tensor(tensor)
    return rebuild, _uuid_device_args(rebuild, args)


class _UuidPickler(ForkingPickler):
    """SGLang's pickler (`ForkingPickler`, which carries torch's tensor and storage reducers) with the tensor
    reducer swapped for `_reduce_tensor_by_uuid` in this instance's dispatch table only."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)  # ForkingPickler copies its reducers into a per-instance dispatch_table
        for cls in (torch.Tensor, torch.nn.Parameter):
            self.dispatch_table[cls] = _reduce_tensor_by_uuid
