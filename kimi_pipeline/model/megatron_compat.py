"""megatron-core 0.16.1 (pinned) compatibility: the ONE place where megatron is patched, each patch for its cause.

megatron-core assumes CUDA tensors, NCCL and Transformer Engine / apex kernels. Each row of `PATCHES` names
the module attribute it replaces, why, and the one cause it exists for:

- `TE_ABSENT`  Transformer Engine is not installed (megatron's own `HAVE_TE` is False): MLA's TE isinstance
  check, the router's `te_general_gemm`, the torch norm under sequence parallelism, the offloaded optimizer's
  load over fp32 main params. A GPU without TE needs these exactly as the CPU does.
- `TORCH_ADAM` neither TE nor apex: megatron falls back to torch's Adam (`optimizer/__init__.py:24-34`), whose
  per-parameter `step` its checkpoint code mishandles, and to its local multi-tensor l2 norm
  (`optimizer/clip_grads.py:17-40`, `utils.py:1200-1208`); torch's Adam is built fused.
- `GLOO`       the process group backend is gloo: int split sizes, equal-size collectives, 1-rank copies.
- `CPU`        tensors live on the CPU: `torch.cuda.*` stand-ins, the CPU RNG, CUDA tensor-type names, CPU
  speed paths.

One switch runs before megatron imports and so cannot be a row here: where dynamo is off, megatron's own
`disable_jit_fuser()` as its jit module loads (`megatron_import`, installed by `kimi_pipeline.model`).

`compat_causes(device, backend)` says which causes hold for a process and `apply_compat` applies exactly their
rows (restoring any row whose cause no longer holds), so a TE-less GPU runs the TE-less rows the CPU tests
run, and no CPU row ever reaches a GPU. `tests/integration/test_megatron_model.py` checks that every target
still exists and that each (device, TE, backend) gets the documented set.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import os
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from kimi_pipeline.model import host_syncs
from kimi_pipeline.model.megatron_import import eager_fused_functions_when_dynamo_is_off

MEGATRON_CORE_VERSION = "0.16.1"

TE_ABSENT, TORCH_ADAM, GLOO, CPU = "te_absent", "torch_adam", "gloo", "cpu"
CAUSES = (TE_ABSENT, TORCH_ADAM, GLOO, CPU)

# Environment every CPU rank needs before megatron compiles anything (set by apply_compat on CPU).
CPU_ENV = {
    "TORCHDYNAMO_DISABLE": "1",  # megatron wraps small ops in torch.compile: a ~22 s compile per process on CPU
}


@dataclass(frozen=True)
class Patch:
    cause: str  # one of CAUSES: the condition under which megatron breaks without this row
    module: str  # importable module path holding the attribute
    attribute: str  # dotted attribute path inside the module (e.g. "Class.method")
    why: str  # one line: what breaks without it
    make: Callable[[Any], Any]  # original -> replacement

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attribute}"


# --------------------------------------------------------------------------- replacements


class _NoOpStream:
    """Stands in for torch.cuda.Stream / current_stream(): CPU work is synchronous."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_event(self, *args: Any, **kwargs: Any) -> _NoOpEvent:
        return _NoOpEvent()

    def synchronize(self) -> None:
        host_syncs.note("cuda.Stream.synchronize")

    def query(self) -> bool:
        return True


class _NoOpEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:  # a host wait on a GPU: reported as one (model/host_syncs.py)
        host_syncs.note("cuda.Event.synchronize")

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def _cpu_rng_tracker_class(original: type) -> type:
    """megatron's RNG tracker, keeping its named states in the CPU generator instead of CUDA's."""

    class CpuRNGStatesTracker(original):  # type: ignore[misc, valid-type]
        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name: str = "model-parallel-rng"):  # same default as megatron
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            orig_name = self._current_state_name
            if orig_name != "default-rng":
                self.states_[orig_name] = orig
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if orig_name != "default-rng":
                    orig = self.states_[orig_name]
                torch.set_rng_state(orig)
                self._current_state_name = orig_name

    CpuRNGStatesTracker.__name__ = CpuRNGStatesTracker.__qualname__ = "CpuRNGStatesTracker"
    return CpuRNGStatesTracker


class _CpuTorch:
    """A view of the `torch` module for megatron modules that hard-code `device="cuda"`.

    Tensor factories called with a CUDA device create CPU tensors; everything else is torch itself.
    Installed as the module-global `torch` of a few megatron modules only (see PATCHES).
    """

    _FACTORIES = frozenset({"tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "empty_like", "ones_like"})

    def __init__(self, real: Any) -> None:
        object.__setattr__(self, "_real", real)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real, name)
        if name in self._FACTORIES:

            @functools.wraps(attr)
            def factory(*args: Any, **kwargs: Any) -> Any:
                dev = kwargs.get("device")
                if dev is not None and "cuda" in str(dev):
                    kwargs["device"] = "cpu"
                kwargs.pop("pin_memory", None)
                return attr(*args, **kwargs)

            return factory
        return attr


class _FusedAdamTorch:
    """A view of `torch` for megatron's optimizer factory: its torch Adam/AdamW (the fallback without TE/apex) is
    built with `fused=True`, torch's one-kernel CPU Adam. The default per-tensor loop costs ~6 small ops for each
    of the 146 parameter tensors of tiny (every routed expert is its own tensor): measured 2x slower per step."""

    def __init__(self, real: Any) -> None:
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "optim", _FusedAdamOptim(real.optim))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _FusedAdamOptim:
    def __init__(self, real: Any) -> None:
        self._real = real
        self.Adam = functools.partial(real.Adam, fused=True)
        self.AdamW = functools.partial(real.AdamW, fused=True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@contextlib.contextmanager
def _cuda_type_names():
    """Make `tensor.type()` report `torch.cuda.*Tensor` names, which megatron's optimizers require."""
    original = torch.Tensor.type

    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        if not args and not kwargs and isinstance(out, str) and out.startswith("torch.") and ".cuda." not in out:
            return "torch.cuda." + out[len("torch.") :]
        return out

    torch.Tensor.type = type_  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.type = original  # type: ignore[method-assign]


def _with_cuda_type_names(original: Any) -> Any:
    """Wrap a function / staticmethod / classmethod so it runs under `_cuda_type_names()`."""
    if isinstance(original, (staticmethod, classmethod)):
        return type(original)(_with_cuda_type_names(original.__func__))

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with _cuda_type_names():
            return original(*args, **kwargs)

    return wrapped


def _router_gating_linear(inp: torch.Tensor, weight: torch.Tensor, bias: Any, router_dtype: torch.dtype) -> torch.Tensor:
    """The router projection in `router_dtype` (fp32), as HF computes it: plain autograd linear."""
    return torch.nn.functional.linear(
        inp.to(router_dtype), weight.to(router_dtype), None if bias is None else bias.to(router_dtype)
    )


def _l2_norm(chunk_size: int, noop_flag: Any, tensor_lists: list, per_tensor: bool, *args: Any) -> tuple:
    """megatron's local multi_tensor_l2norm stand-in: the norms stay on the grads' device (no per-tensor host copy)."""
    norms = [torch.linalg.vector_norm(t.float()) for tl in tensor_lists for t in tl]
    if not norms:
        return torch.zeros(1, device=torch.cuda.current_device()), None
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def _tensor_cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self


def _keep_adam_step(original: Callable) -> Callable:
    """Loading skips torch Adam's per-param "step" (restored from param_groups) but then indexes it."""

    @functools.wraps(original)
    def set_states(self: Any, model_param: Any, tensors: dict) -> Any:
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group, order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
            if "step" in state:
                tensors = {**tensors, "step": state["step"]}
        return original(self, model_param, tensors)

    return set_states


def _sequence_parallel_norm(original: Any) -> Any:
    """torch norms refuse sequence parallelism; build them without it and tag their weights instead.

    Under SP each TP rank normalises a different slice of the sequence, so the norm's weight grads
    must be summed over the TP group: finalize_model_grads does that for params tagged
    `sequence_parallel` (TE's norms tag themselves the same way).
    """

    new = original.__func__ if isinstance(original, staticmethod) else original

    def __new__(cls: type, config: Any, hidden_size: int, *args: Any, **kwargs: Any) -> Any:
        if not config.sequence_parallel:
            return new(cls, config, hidden_size, *args, **kwargs)
        module = new(cls, dataclasses.replace(config, sequence_parallel=False), hidden_size, *args, **kwargs)
        for p in module.parameters():
            p.sequence_parallel = True
        return module

    return staticmethod(__new__)


def _split_sizes_as_lists(original: Callable) -> Callable:
    """MoE all-to-all passes split sizes as tensors; gloo's binding takes only int sequences."""

    @functools.wraps(original)
    def all_to_all(group: Any, input_: torch.Tensor, output_split_sizes_: Any = None, input_split_sizes: Any = None):
        def as_list(x: Any) -> Any:
            return x.tolist() if torch.is_tensor(x) else x

        return original(group, input_, as_list(output_split_sizes_), as_list(input_split_sizes))

    return all_to_all


def _uneven_gather(original: Callable) -> Callable:
    """gloo all_gather needs equal sizes: gather zero-padded equal chunks, then cut the padding off."""

    @functools.wraps(original)
    def gather(input_: torch.Tensor, group: Any, output_split_sizes: Any = None, use_global_buffer: bool = False):
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(x) for x in output_split_sizes]
        width = max(sizes)
        padded = input_.new_zeros((width, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([p[:n] for p, n in zip(parts, sizes)], dim=0)

    return gather


def _uneven_reduce_scatter(original: Callable) -> Callable:
    """gloo reduce_scatter needs equal sizes: all-reduce the whole tensor and keep this rank's rows."""

    @functools.wraps(original)
    def reduce_scatter(input_: torch.Tensor, group: Any, input_split_sizes: Any = None, use_global_buffer: bool = False):
        if input_split_sizes is None or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        return list(torch.split(total, [int(x) for x in input_split_sizes], dim=0))[group.rank()].contiguous()

    return reduce_scatter


def _unshare_adam_steps(original: Callable) -> Callable:
    """load_state_dict gives every param the SAME torch-Adam `step` tensor; Adam increments it in place
    once per param, so bias correction drifts within one step. Give each param its own copy."""

    @functools.wraps(original)
    def load_state_dict(self: Any, state_dict: Any) -> Any:
        out = original(self, state_dict)
        inner = getattr(self, "optimizer", None)
        if inner is not None:
            for state in inner.state.values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].clone()
        return out

    return load_state_dict


def _master_param_only_with_fp32_copy(original: Callable) -> Callable:
    """After each step the offloaded (hybrid) optimizer records every state's `master_param`
    (`cpu_offloading/hybrid_optimizer.py:302-321`). Without TE the precision-aware optimizer is off and its
    parameters are the distributed optimizer's fp32 main params: for them `master_param` is only the host copy,
    which the checkpoint does not hold (it saves the main param as "param"), so loading one asks for it
    (KeyError 'master_param', `distrib_optimizer.py:936-940`, seen on an H200). Keep it where there is an fp32 copy."""

    @functools.wraps(original)
    def sync(self: Any) -> None:
        original(self)
        for param, state in self.state.items():
            if param not in self.param_to_fp32_param:
                state.pop("master_param", None)

    return sync


def _refresh_host_copies_on_load(original: Callable) -> Callable:
    """After a load the offloaded (hybrid) optimizer copies each state's `master_param` into the parameter's fp32
    copy, looked up for EVERY parameter (`cpu_offloading/hybrid_optimizer.py:369-374`): KeyError for fp32 main
    params (no TE, so no precision-aware optimizer), which have no fp32 copy. Those get their host copy (the tensor
    the CPU Adam steps and copies back to the GPU, `hybrid_optimizer.py:117-127`) refreshed from the parameter the
    load wrote; left alone it keeps the values it was cloned with before the checkpoint's arrived
    (`distrib_optimizer.py:2117`)."""

    @functools.wraps(original)
    def update(self: Any) -> None:
        if not self.param_update_in_fp32:
            return
        for param, state in self.state.items():
            if param in self.param_to_fp32_param:
                self.param_to_fp32_param[param].data.copy_(state["master_param"])
            elif param in self.gpu_params_map_cpu_copy:
                self.gpu_params_map_cpu_copy[param].data.copy_(param.data)

    return update


def _skip_identity_sort(original: Callable) -> Callable:
    """With EP x TP = 1 the dispatcher's 'sort chunks by local expert' permutation is the identity, yet it
    splits and re-concatenates every token (forward and backward): ~20 % of a CPU training step. Unfused (no TE),
    the permutation is a host tensor the dispatcher builds once (`token_dispatcher.py:404-415`); whether it is the
    identity is read once and kept on that tensor, so no micro-batch compares it again."""

    @functools.wraps(original)
    def sort_chunks_by_idxs(input: torch.Tensor, split_sizes: torch.Tensor, sorted_idxs: torch.Tensor,
                            probs: torch.Tensor | None = None, fused: bool = False):
        if not fused:
            identity = getattr(sorted_idxs, "kimi_is_identity", None)
            if identity is None:
                identity = bool(torch.equal(sorted_idxs.cpu(), torch.arange(sorted_idxs.numel())))
                sorted_idxs.kimi_is_identity = identity
            if identity:
                return input, probs
        return original(input, split_sizes, sorted_idxs, probs=probs, fused=fused)

    return sort_chunks_by_idxs


def _permute_without_reading_sizes(original: Callable) -> Callable:
    """Unfused (no TE), megatron's permute gathers each expert's tokens with `masked_select`, whose result size is
    read back: a host sync per MoE layer and micro-batch (`moe_utils.py:362-372`). Dropless routing knows that
    size, `num_out_tokens` = tokens x topk (the dispatcher passes it as a host int, `token_dispatcher.py:527-530`,
    the same figure TE's fused permute allocates for): a stable argsort of the [experts, tokens] map puts its set
    entries first in masked_select's order, so the first num_out_tokens positions are the same indices, on the
    device."""

    @functools.wraps(original)
    def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor | None = None,
                num_out_tokens: int | None = None, fused: bool = False, drop_and_pad: bool = False):
        if fused or drop_and_pad or not isinstance(num_out_tokens, int):
            return original(tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens, fused=fused,
                            drop_and_pad=drop_and_pad)
        num_tokens = tokens.shape[0]
        by_expert = routing_map.bool().T.reshape(-1)  # [experts * tokens], expert-major like masked_select's
        picked = torch.argsort((~by_expert).to(torch.int8), stable=True)[:num_out_tokens]
        sorted_indices = picked % num_tokens
        permuted_probs = None if probs is None else probs.T.reshape(-1).index_select(0, picked)
        return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices

    return permute


def _unpermute_with_index_add(original: Callable) -> Callable:
    """The non-deterministic unpermute scatter_adds with an expanded [tokens, hidden] index, whose backward is a
    gather that costs ~7 ms per MoE layer on CPU; index_add (megatron's own deterministic branch) sums the same
    rows and its backward is an index_select."""

    @functools.wraps(original)
    def unpermute(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor, restore_shape: torch.Size,
                  probs: torch.Tensor | None = None, routing_map: torch.Tensor | None = None,
                  fused: bool = False, drop_and_pad: bool = False) -> torch.Tensor:
        if fused or drop_and_pad or probs is not None:
            return original(permuted_tokens, sorted_indices, restore_shape, probs=probs, routing_map=routing_map,
                            fused=fused, drop_and_pad=drop_and_pad)
        out = permuted_tokens.new_zeros(restore_shape)
        return out.index_add_(0, sorted_indices, permuted_tokens)

    return unpermute


def _plain_linear_without_tp(original: Callable) -> Callable:
    """With nothing to communicate or fuse (TP = 1 or expert-TP = 1, no sequence parallel, no wgrad fusion), megatron's
    Linear still runs its Python autograd Function (~21 calls per tiny step); torch's own linear computes the same
    values and gradients (DDP's grad hooks see the same param.grad)."""

    @functools.wraps(original)
    def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gradient_accumulation_fusion: bool,
               allreduce_dgrad: bool, sequence_parallel: bool, grad_output_buffer: Any = None,
               wgrad_deferral_limit: Any = 0, async_grad_allreduce: Any = None, tp_group: Any = None):
        if (gradient_accumulation_fusion or allreduce_dgrad or sequence_parallel or grad_output_buffer is not None
                or async_grad_allreduce):
            return original(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                            grad_output_buffer, wgrad_deferral_limit, async_grad_allreduce, tp_group)
        return torch.nn.functional.linear(input, weight, bias)

    return linear


class _DoneWork:
    """A finished collective's handle (what `wait()` callers expect)."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _one_rank(group: Any) -> bool:
    return group is not None and group.size() == 1


def _local_when_one_rank(original: Callable) -> Callable:
    """DDP's grad reduce-scatter / param all-gather over a 1-rank group is a copy, yet gloo runs it on its own
    thread, whose parallel copy of the multi-MB buffer starts a second OpenMP team: from then on every op of the
    training step ran at one-thread speed (measured: forward 53 -> 78 ms at 2 threads). Copy locally instead."""

    @functools.wraps(original)
    def collective(output: torch.Tensor, input_: torch.Tensor, *args: Any, group: Any = None, async_op: bool = False,
                   **kwargs: Any):
        if not _one_rank(group):
            return original(output, input_, *args, group=group, async_op=async_op, **kwargs)
        if output.data_ptr() != input_.data_ptr():
            output.view(-1).copy_(input_.reshape(-1))
        return _DoneWork() if async_op else None

    return collective


def _coalescing_when_one_rank(original: Callable) -> Callable:
    """The coalescing context around those collectives: nothing to coalesce on a 1-rank group."""

    @contextlib.contextmanager
    def coalescing_manager(group: Any = None, device: Any = None, async_ops: bool = False):
        if _one_rank(group):
            yield _DoneWork()
            return
        with original(group, device, async_ops) as cm:
            yield cm

    return coalescing_manager


def _device_synchronize(*args: Any, **kwargs: Any) -> None:
    host_syncs.note("cuda.synchronize")


# --------------------------------------------------------------------------- the table

PATCHES: list[Patch] = [
    Patch(CPU, "torch.cuda", "current_device",
          "megatron allocates on torch.cuda.current_device() (~100 call sites): CPU",
          lambda orig: _cpu_device),
    Patch(CPU, "torch.cuda", "synchronize",
          "DDP buffer free/alloc and dist-checkpointing sync the device; nothing to wait for",
          lambda orig: _device_synchronize),
    Patch(CPU, "torch.cuda", "Stream", "the MoE all-to-all dispatcher creates a device-to-host side stream at init",
          lambda orig: _NoOpStream),
    Patch(CPU, "torch.cuda", "current_stream", "the MoE dispatcher syncs its side stream with the current one",
          lambda orig: lambda *a, **k: _NoOpStream()),
    Patch(CPU, "torch.cuda", "default_stream", "as current_stream (DDP / offloading paths)",
          lambda orig: lambda *a, **k: _NoOpStream()),
    Patch(CPU, "torch.cuda", "stream", "MoE dispatcher / grad buffers run copies under `with torch.cuda.stream(s)`",
          lambda orig: lambda *a, **k: contextlib.nullcontext()),
    Patch(CPU, "torch.cuda", "Event", "dispatcher / timers record CUDA events; CPU work is synchronous",
          lambda orig: _NoOpEvent),
    Patch(CPU, "torch", "Tensor.cuda",
          "state exchange in the distributed optimizer / dist-checkpointing calls .cuda(); "
          "on a CPU-only build it returns the tensor itself", lambda orig: _tensor_cuda),
    Patch(TE_ABSENT, "megatron.core.transformer.multi_latent_attention", "HAVE_TE",
          "TE's MagicMock stand-ins import fine, so MLA thinks TE is present and isinstance()s a mock",
          lambda orig: False),
    Patch(TE_ABSENT, "megatron.core.transformer.torch_norm", "WrappedTorchNorm.__new__",
          "asserts no sequence parallelism (needed for TP x EP); build unparallel + tag weights sequence_parallel",
          _sequence_parallel_norm),
    Patch(TE_ABSENT, "megatron.core.transformer.moe.router", "router_gating_linear",
          "its autograd Function reads te_general_gemm, undefined without TE (NameError)",
          lambda orig: _router_gating_linear),
    Patch(TE_ABSENT, "megatron.core.optimizer.cpu_offloading.hybrid_optimizer",
          "HybridDeviceOptimizer._sync_sub_optimizers_state_to_hdo",
          "the offloaded optimizer over fp32 main params (no precision-aware optimizer without TE) records a "
          "`master_param` its checkpoints do not save; loading asks for it (KeyError)", _master_param_only_with_fp32_copy),
    Patch(TE_ABSENT, "megatron.core.optimizer.cpu_offloading.hybrid_optimizer",
          "HybridDeviceOptimizer._update_fp32_params_by_new_state",
          "the same optimizer looks up an fp32 copy of every parameter after a load (KeyError) and would step "
          "host copies older than the checkpoint", _refresh_host_copies_on_load),
    Patch(GLOO, "megatron.core.transformer.moe.token_dispatcher", "all_to_all",
          "expert all-to-all passes tensor split sizes; gloo accepts int lists only", _split_sizes_as_lists),
    Patch(TE_ABSENT, "megatron.core.tensor_parallel.layers", "linear_with_grad_accumulation_and_async_allreduce",
          "speed: megatron's Python autograd Linear where it has nothing to communicate (the local spec's Linear; "
          "TE's layers do not call it); torch's linear instead", _plain_linear_without_tp),
    Patch(TE_ABSENT, "megatron.core.transformer.moe.token_dispatcher", "sort_chunks_by_idxs",
          "speed: unfused permutation (moe_permute_fusion needs TE): an identity expert sort (EP x TP = 1) still "
          "copies every token twice per layer", _skip_identity_sort),
    Patch(TE_ABSENT, "megatron.core.transformer.moe.token_dispatcher", "permute",
          "unfused permutation reads masked_select's size (a host sync per MoE layer and micro-batch); dropless "
          "routing knows it", _permute_without_reading_sizes),
    Patch(CPU, "megatron.core.transformer.moe.token_dispatcher", "unpermute",
          "speed: scatter_add with an expanded index has a slow CPU backward; index_add sums the same rows",
          _unpermute_with_index_add),
    Patch(GLOO, "megatron.core.distributed.param_and_grad_buffer", "dist_all_gather_func",
          "speed: a 1-rank param all-gather on gloo's thread leaves the trainer at one-thread speed",
          _local_when_one_rank),
    Patch(GLOO, "megatron.core.distributed.param_and_grad_buffer", "dist_reduce_scatter_func",
          "speed: a 1-rank grad reduce-scatter on gloo's thread leaves the trainer at one-thread speed",
          _local_when_one_rank),
    Patch(GLOO, "megatron.core.distributed.param_and_grad_buffer", "_coalescing_manager",
          "the coalescing context of those 1-rank collectives has nothing to coalesce", _coalescing_when_one_rank),
    Patch(GLOO, "megatron.core.tensor_parallel.mappings", "_gather_along_first_dim",
          "uneven all_gather (MoE tokens under TP x EP) is unsupported by gloo", _uneven_gather),
    Patch(GLOO, "megatron.core.tensor_parallel.mappings", "_reduce_scatter_along_first_dim",
          "uneven reduce_scatter (MoE tokens under TP x EP) is unsupported by gloo", _uneven_reduce_scatter),
    Patch(CPU, "megatron.core.tensor_parallel.random", "CudaRNGStatesTracker",
          "the model-parallel RNG tracker keeps CUDA generator states; keep them in the CPU generator",
          _cpu_rng_tracker_class),
    Patch(CPU, "megatron.core.tensor_parallel.random", "_get_cuda_rng_state",
          "activation recompute saves the CUDA RNG state; save the CPU one",
          lambda orig: lambda *a, **k: torch.get_rng_state()),
    Patch(CPU, "megatron.core.tensor_parallel.random", "_set_cuda_rng_state",
          "activation recompute restores the CUDA RNG state; restore the CPU one",
          lambda orig: lambda new_state, *a, **k: torch.set_rng_state(new_state)),
    Patch(CPU, "megatron.core.optimizer.clip_grads", "torch", "grad-norm buffers are created with device='cuda'",
          _CpuTorch),
    Patch(TORCH_ADAM, "megatron.core.optimizer.clip_grads", "l2_norm_impl",
          "the local l2-norm fallback (no TE/apex) copies each norm to the host (a sync per tensor on GPU) and "
          "returns on device='cuda'", lambda orig: _l2_norm),
    Patch(TORCH_ADAM, "megatron.core.optimizer", "torch",
          "speed: torch's per-tensor Adam loop (CPU and CUDA alike); build it fused",
          _FusedAdamTorch),
    Patch(CPU, "megatron.core.optimizer.optimizer", "torch", "found_inf / scale buffers are created with device='cuda'",
          _CpuTorch),
    Patch(CPU, "megatron.core.pipeline_parallel.schedules", "torch", "token counters are created with device='cuda'",
          _CpuTorch),
    Patch(CPU, "megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.__init__",
          "rejects parameters whose type() is not torch.cuda.*Tensor", _with_cuda_type_names),
    Patch(TORCH_ADAM, "megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer._set_main_param_and_optimizer_states",
          "KeyError 'step' when loading a reshardable checkpoint with torch Adam (no TE/apex)", _keep_adam_step),
    Patch(TORCH_ADAM, "megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.load_state_dict",
          "restores one torch-Adam `step` tensor shared by all params; Adam then bumps it once per param",
          _unshare_adam_steps),
    Patch(CPU, "megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32",
          "asserts grad.type() == 'torch.cuda.FloatTensor'", _with_cuda_type_names),
    Patch(CPU, "megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__",
          "rejects parameters whose type() is not torch.cuda.*Tensor", _with_cuda_type_names),
]

_applied: dict[str, Patch] = {}
_originals: dict[str, Any] = {}


def _resolve(patch: Patch) -> tuple[Any, str, Any]:
    """(owner object, final attribute name, current value) for a patch target; raises if it moved."""
    owner: Any = importlib.import_module(patch.module)
    *path, leaf = patch.attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    if not hasattr(owner, leaf):
        raise AttributeError(f"{patch.module}.{patch.attribute} no longer exists ({patch.why})")
    # Keep staticmethod/classmethod descriptors as such (the class __dict__ holds the descriptor).
    value = vars(owner).get(leaf, getattr(owner, leaf)) if isinstance(owner, type) else getattr(owner, leaf)
    return owner, leaf, value


def missing_targets() -> list[str]:
    """Patch targets that do not exist in the installed megatron-core (an upgrade moved them)."""
    out = []
    for patch in PATCHES:
        try:
            _resolve(patch)
        except (ImportError, AttributeError) as exc:
            out.append(f"{patch.name}: {exc}")
    return out


def megatron_kernels() -> tuple[bool, bool]:
    """(Transformer Engine present, megatron uses torch's Adam) as megatron itself decided at import."""

    with warnings.catch_warnings():  # megatron warns about the missing TE / apex it falls back from
        warnings.simplefilter("ignore")
        from megatron.core import optimizer as mcore_optimizer
        from megatron.core.models.gpt import gpt_layer_specs
    return bool(gpt_layer_specs.HAVE_TE), bool(mcore_optimizer.USING_PYTORCH_OPTIMIZER)


def compat_causes(device: torch.device | str, backend: str | None, *, te: bool | None = None,
                  torch_adam: bool | None = None) -> frozenset[str]:
    """The causes that hold for a process computing on `device` over `backend` (None: no process group yet)."""
    if te is None or torch_adam is None:
        have_te, using_torch_adam = megatron_kernels()
        te = have_te if te is None else te
        torch_adam = using_torch_adam if torch_adam is None else torch_adam
    causes = set()
    if not te:
        causes.add(TE_ABSENT)
    if torch_adam:
        causes.add(TORCH_ADAM)
    if backend == "gloo":
        causes.add(GLOO)
    if torch.device(device).type == "cpu":
        causes.add(CPU)
    return frozenset(causes)


def patches_for(causes: Iterable[str]) -> list[str]:
    """Names of the rows applied for `causes`, in table order."""
    wanted = set(causes)
    return [p.name for p in PATCHES if p.cause in wanted]


def apply_compat(device: torch.device | str, backend: str | None = None) -> list[str]:
    """Patch megatron-core for this process's device and backend; returns the applied row names.

    Idempotent; a later call with other causes (a test process that builds a GPU model after CPU ones)
    restores the rows that no longer apply before applying the new ones."""
    causes = compat_causes(device, backend)
    if CPU in causes:
        for key, value in CPU_ENV.items():
            os.environ.setdefault(key, value)
        eager_fused_functions_when_dynamo_is_off()  # a process that had not set it before importing this package
    for name, patch in list(_applied.items()):
        if patch.cause not in causes:
            owner, leaf, _ = _resolve(patch)
            setattr(owner, leaf, _originals.pop(name))
            del _applied[name]
    for patch in PATCHES:
        if patch.cause in causes and patch.name not in _applied:
            owner, leaf, original = _resolve(patch)
            _originals[patch.name] = original
            setattr(owner, leaf, patch.make(original))
            _applied[patch.name] = patch
    return applied()


def applied() -> list[str]:
    """The applied rows' names, in table order."""
    return [p.name for p in PATCHES if p.name in _applied]
