"""Host syncs: the calls that make the host wait for the device, counted where they are made.

On a GPU every such call stalls the host until the queued kernels finish, so the next kernels are not queued
while the GPU works: with small kernels (a training micro-batch of MoE layers) the GPU idles between them. The
training micro-batch makes none beyond those megatron itself requires (`MEGATRON_SYNCS`); `HostSyncRecorder`
proves it on any device, CPU included, by recording the operations that would wait on a GPU:

- at the Python level (a `TorchFunctionMode`): `.item()`, `.tolist()`, `.cpu()`, `.numpy()`, `bool()` / `int()` /
  `float()` of a tensor, `torch.equal`, `.nonzero()`, and a blocking `.to("cpu")` of a device tensor: on a CPU
  tensor some of these never reach the dispatcher, so they are caught where they are called (a `.to()` whose
  tensor is already on the host is no copy on any device, and a non-blocking copy waits for nothing);
- at the dispatcher (a `TorchDispatchMode`): the same reads made inside torch (`aten._local_scalar_dense`,
  `aten.equal`, `aten.nonzero`, `aten.is_nonzero`), boolean-mask indexing and `masked_select` (the result size
  is read back), `repeat_interleave` without an output size, `unique`;
- megatron's own device-to-host waits (`torch.cuda.Event.synchronize` and friends): on CPU the compat layer's
  stand-ins for CUDA events report them (`megatron_compat._NoOpEvent`), so the count is the GPU's.

A sync inside another recorded call (the `_local_scalar_dense` of an `.item()`) counts once. Each record keeps
the first caller frame outside torch, so a report names the line to fix.

On a GPU, `torch.cuda.set_sync_debug_mode` sees what the CUDA runtime does; `tests/gpu` runs the training step
under it too.
"""

from __future__ import annotations

import contextlib
import os
import threading
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# megatron-core 0.16.1's host syncs in a training micro-batch of this project's layouts, each with where megatron
# requires it. A recorded sync whose caller is one of these files (and function, for "file in function" keys) is
# megatron's; any other is ours to remove.
MEGATRON_SYNCS: dict[str, str] = {
    # The alltoall dispatcher copies the per-expert token counts (and, at EP x TP > 1, the all-to-all split sizes)
    # to the host and waits for that copy once per MoE layer and forward: the experts' split sizes and
    # all_to_all_single's split lists are host integers. token_dispatcher.py:862-901 (_maybe_dtoh_and_synchronize:
    # the copy at cuda_dtoh_point, event.synchronize() at cuda_sync_point, chosen at 497-589).
    "megatron/core/transformer/moe/token_dispatcher.py": "MoE token counts to the host, once per MoE layer and "
    "forward (token_dispatcher.py:862-901)",
    # At EP x TP > 1 the received tokens are sorted by local expert with split sizes megatron already copied to the
    # host at its sync point above (token_dispatcher.py:891-894): `.tolist()` of host tensors, no wait on a GPU.
    "megatron/core/transformer/moe/moe_utils.py in sort_chunks_by_idxs": "host split sizes of the expert sort "
    "(moe_utils.py:505-509), read after the dispatcher's wait",
    # Pipeline stages (PP > 1) exchange each micro-batch's activation shape first (variable_seq_lengths: rollouts
    # differ in length) and read it back (p2p_communication.py:242-250), and megatron synchronises the device after
    # each batched send/recv (batch_p2p_sync, p2p_communication.py:395-398).
    "megatron/core/pipeline_parallel/p2p_communication.py": "pipeline shapes and batched send/recv, per micro-batch "
    "and stage boundary (p2p_communication.py:242-250, 395-398)",
    # With the per-token loss the step's token count decides whether gradients are scaled: `if num_tokens > 0`
    # reads it once per optimizer step, after the last micro-batch's backward. finalize_model_grads.py:493-497.
    "megatron/core/distributed/finalize_model_grads.py": "the step's token count, once per optimizer step "
    "(finalize_model_grads.py:493-497)",
}


@dataclass(frozen=True)
class HostSync:
    op: str  # what waited: "Tensor.item", "aten.nonzero", "cuda.Event.synchronize", ...
    where: str  # the first caller outside torch: "path/to/file.py:123 in function"

    @property
    def megatron(self) -> bool:
        return megatrons(self.where)


def megatrons(where: str) -> bool:
    """Whether a sync made at `where` ("path:line in function") is one megatron requires (`MEGATRON_SYNCS`)."""
    return any(all(part in where for part in key.split(" in ")) for key in MEGATRON_SYNCS)


# Python-level calls that read a tensor back to the host (on a CUDA tensor: a wait for the device).
_FUNCTIONS = {
    torch.Tensor.item: "Tensor.item",
    torch.Tensor.tolist: "Tensor.tolist",
    torch.Tensor.cpu: "Tensor.cpu",
    torch.Tensor.numpy: "Tensor.numpy",
    torch.Tensor.__bool__: "Tensor.__bool__",
    torch.Tensor.__int__: "Tensor.__int__",
    torch.Tensor.__float__: "Tensor.__float__",
    torch.Tensor.__index__: "Tensor.__index__",
    torch.Tensor.nonzero: "Tensor.nonzero",
    torch.nonzero: "torch.nonzero",
    torch.equal: "torch.equal",
}
_AT = torch.ops.aten
# Dispatcher ops whose result (or its size) is read on the host.
_OPS = {
    _AT._local_scalar_dense.default: "aten._local_scalar_dense",
    _AT.equal.default: "aten.equal",
    _AT.nonzero.default: "aten.nonzero",
    _AT.is_nonzero.default: "aten.is_nonzero",
    _AT.masked_select.default: "aten.masked_select",
    _AT._unique2.default: "aten._unique2",
    _AT.unique_consecutive.default: "aten.unique_consecutive",
    _AT.unique_dim.default: "aten.unique_dim",
}
_TORCH_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(contextlib.__file__))
# Never the cause of a sync: this module, and the CPU stand-ins for CUDA streams and events that report megatron's.
_HERE = os.path.abspath(__file__)
_NOT_CALLERS = (_HERE, os.path.join(os.path.dirname(_HERE), "megatron_compat.py"))
_active: list[HostSyncRecorder] = []
_lock = threading.Lock()


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()[:-1]):
        path = os.path.abspath(frame.filename)
        if path in _NOT_CALLERS or path.startswith(_TORCH_DIRS):
            continue
        return f"{frame.filename}:{frame.lineno} in {frame.name}"
    return "?"


def note(op: str) -> None:
    """Record a host wait that no tensor operation shows (megatron's CUDA event waits, through the CPU stand-ins)."""
    with _lock:
        recorders = list(_active)
    for r in recorders:
        r._add(op)


def _is_to_host(args: tuple, kwargs: dict) -> bool:
    """A blocking device-to-host `.to()`."""
    dev = kwargs.get("device", args[1] if len(args) > 1 else None)
    if not isinstance(dev, (str, torch.device)) or kwargs.get("non_blocking"):
        return False
    return torch.device(dev).type == "cpu" and args[0].device.type != "cpu"


def _bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(t is not None and t.dtype == torch.bool for t in indices)


class _Functions(TorchFunctionMode):
    def __init__(self, recorder: HostSyncRecorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _FUNCTIONS.get(func)
        if name is None and func is torch.Tensor.to and _is_to_host(args, kwargs):
            name = "Tensor.to(cpu)"
        if name is None or self.recorder._inside:
            return func(*args, **kwargs)
        self.recorder._add(name)
        self.recorder._inside = True
        try:
            return func(*args, **kwargs)
        finally:
            self.recorder._inside = False


class _Ops(TorchDispatchMode):
    def __init__(self, recorder: HostSyncRecorder):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _OPS.get(func)
        if name is None and func in (_AT.index.Tensor, _AT.index_put.default, _AT.index_put_.default) \
                and _bool_index(args):
            name = f"{func.overloadpacket.__name__} with a boolean mask"
        if name is None and func is _AT.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            name = "aten.repeat_interleave without output_size"
        if name is not None and not self.recorder._inside:
            self.recorder._add(name)
        return func(*args, **kwargs)


@dataclass
class HostSyncRecorder:
    """Records the host syncs of what runs inside `with recorder.recording():`."""

    syncs: list[HostSync] = field(default_factory=list)
    _inside: bool = False

    def _add(self, op: str) -> None:
        self.syncs.append(HostSync(op, _caller()))

    @contextlib.contextmanager
    def recording(self) -> Iterator[HostSyncRecorder]:
        with _lock:
            _active.append(self)
        try:
            with _Functions(self), _Ops(self):
                yield self
        finally:
            with _lock:
                _active.remove(self)

    def ours(self) -> list[HostSync]:
        """The syncs megatron does not require: each one a line of this project (or of a library it calls)."""
        return [s for s in self.syncs if not s.megatron]

    def megatron(self) -> list[HostSync]:
        return [s for s in self.syncs if s.megatron]

    def summary(self) -> str:
        counts = Counter(f"{s.op} at {s.where}" for s in self.syncs)
        return "\n".join(f"{n:4d} x {what}" for what, n in counts.most_common()) or "no host syncs"
