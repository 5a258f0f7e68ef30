"""Training plumbing on megatron-core: DDP + megatron optimizer, schedules, logprobs, torch_dist checkpoints.

Plain torch optimizers on a megatron-DDP model silently do not update (DDP keeps grads in its own
buffers, `main_grad`), so training always goes through `get_megatron_optimizer` (the distributed
optimizer when the recipe asks). Losses go through megatron's forward/backward schedule so pipeline
parallelism works unchanged. Checkpoints use megatron's layout (`iter_0000020/` in torch_dist format +
`latest_checkpointed_iteration.txt`), written atomically: a temp dir renamed into place, the tracker last.
"""

from __future__ import annotations

import base64
import functools
import json
import logging
import math
import os
import queue
import random
import shutil
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: megatron raises it on every rank

from kimi_pipeline.errors import PermanentError
from kimi_pipeline.model.checkpoint_dirs import TRACKER, CheckpointError, iteration_dir, latest_step
from kimi_pipeline.model.checkpoint_manifest import (
    CheckpointSpaceError,
    entries,
    failure_line,
    is_enospc,
    rank_files,
    resume_candidates,
    shared_files,
    space_problem,
    verify_share,
    write_manifest,
)
from kimi_pipeline.model.context_parallel import Packing, SeqLayout, batch_logprobs, cp_group, seq_multiple
from kimi_pipeline.model.megatron_compat import megatron_kernels
from kimi_pipeline.model.megatron_model import build_model, causal_mask, check_positions, model_device, unwrap
from kimi_pipeline.recipes.layout import Layout
from kimi_pipeline.recipes.models import ModelSpec, OptimizerSpec
from kimi_pipeline.util.files import atomic_write_json, atomic_write_text
from kimi_pipeline.util.threads import one_intraop_thread_for_helpers

log = logging.getLogger(__name__)

EXTRA = "kimi_extra.json"
CHECKPOINT_VERSION = 3.0  # what Megatron-LM's --load expects in common state
# Optimizer state sharding that reshards across TP/PP/EP/DP changes (megatron's canonical form). Saving it
# gathers each model-parallel shard's whole fp32 optimizer state (main params + two Adam moments): by default
# on EVERY data-parallel rank, on the GPU (`distrib_optimizer.py:1443-1451`, ~16 GB GPU + ~48 GB host per rank
# at K2 scale); "mem_efficient" gathers it over megatron's gloo DP group on DP rank 0 only, in host memory —
# the figure `kimi plan` reports as the checkpoint-time host peak (`plan.memory.checkpoint_gather_bytes`).
SHARDED_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "distrib_optim_fully_reshardable_mem_efficient": True,
    "singleton_local_shards": False,
    "chained_optim_avoid_prefix": True,
}


LossFn = Callable[[torch.Tensor, dict], tuple[torch.Tensor, Any, dict]]


# --------------------------------------------------------------------------- build


def build_trainable(
    spec: ModelSpec,
    layout: Layout,
    opt: OptimizerSpec,
    *,
    device: torch.device,
    use_te: bool | None = None,
    **config_overrides: Any,
) -> tuple[list[torch.nn.Module], Any]:
    """(model_chunks, optimizer): this stage's GPTModel on `device` in megatron DDP + megatron's optimizer.

    The loss contract is per-token style (config.calculate_per_token_loss): see `forward_backward`.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    config_overrides.setdefault("calculate_per_token_loss", True)
    model = build_model(spec, layout, device=device, use_te=use_te, **config_overrides)
    config = model.config
    use_te_flag = model.kimi_use_te
    # Routed-expert params always get their own (expert-data-parallel) grad buffers and optimizer, as
    # megatron does for EP>1. With EP=1 (and etp == tp) that group equals the DP group, so training is
    # unchanged, but the optimizer checkpoint keeps one structure (dense + expert) across layouts;
    # otherwise an EP=1 checkpoint cannot be loaded with EP>1 ("Expected 2 entries in state dict").
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False
    if config.bf16 or config.fp16:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        # the seeds' --overlap-grad-reduce: each bucket's reduce(-scatter) starts during backward, once its grads
        # are in (distributed/param_and_grad_buffer.py); finalize_model_grads waits for them (finish_grad_sync)
        overlap_grad_reduce=True,
        # not --overlap-param-gather: it defers the optimizer step's param all-gather to the next forward's
        # pre-hooks, so the weight sync, checkpoints and the logprob passes that follow a step would read stale
        # shards unless each first finished the gather (finish_param_sync); none does yet
        overlap_param_gather=False,
        use_distributed_optimizer=opt.use_distributed_optimizer,
        check_for_nan_in_grad=False,
        bucket_size=None,
    )
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    ddp.kimi_use_te = use_te_flag
    opt_config = OptimizerConfig(
        optimizer=opt.optimizer,
        lr=opt.lr,
        min_lr=0.0 if opt.lr_decay_style != "constant" else opt.lr,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1,
        adam_beta2=opt.adam_beta2,
        adam_eps=opt.adam_eps,
        clip_grad=opt.clip_grad,
        bf16=config.bf16,
        fp16=config.fp16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=opt.use_distributed_optimizer,
        **optimizer_placement(opt, device, te=megatron_kernels()[0]),
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    config.grad_scale_func = optimizer.scale_loss
    return [ddp], optimizer


def optimizer_placement(opt: OptimizerSpec, device: torch.device, *, te: bool) -> dict[str, Any]:
    """OptimizerConfig fields for where the optimizer state lives.

    `optimizer_cpu_offload` keeps ALL of it (fp32 main params, Adam moments) in host memory and steps there:
    megatron's HybridDeviceOptimizer offloads `optimizer_offload_fraction` of the parameters, default 0.0 —
    nothing (`optimizer/optimizer_config.py:307`, `optimizer/__init__.py:306-345`) — so the fraction is 1.0,
    what `kimi plan` counts as host memory. It moves GPU parameters only (`cpu_offloading/hybrid_optimizer.py`
    splits them by `param.is_cuda`): with the model's tensors already on the host there is nothing to offload.
    The precision-aware optimizer needs Transformer Engine: its config check reads TE's version before anything
    else (`optimizer_config.py:375-383`, a TypeError without TE)."""
    offload = opt.optimizer_cpu_offload and device.type == "cuda"
    if opt.use_precision_aware_optimizer and not te:
        log.warning("optimizer.use_precision_aware_optimizer needs Transformer Engine (not installed): off")
    return {
        "optimizer_cpu_offload": offload,
        "optimizer_offload_fraction": 1.0 if offload else 0.0,
        "overlap_cpu_optimizer_d2h_h2d": offload and opt.overlap_cpu_optimizer_d2h_h2d,
        "use_precision_aware_optimizer": opt.use_precision_aware_optimizer and te,
    }


def state_tensors(model_chunks: Sequence[torch.nn.Module], optimizer,
                  frozen: Sequence[torch.nn.Module] = ()) -> dict[str, list[torch.Tensor]]:
    """A trainer's state by part (`model.offload.PARTS`), for putting it to sleep while colocated engines run:
    weights = parameters and buffers of the model chunks (and of `frozen` models, e.g. the KL reference) plus DDP's
    contiguous param buffers; grads = DDP's grad buffers (`main_grad` views them); optimizer = every tensor of
    the optimizer state and the optimizer's own (fp32 main) parameters, through megatron's ChainedOptimizer
    (`chained_optimizers`) and each wrapper's torch optimizer (`.optimizer`)."""
    weights, grads, optim = [], [], []
    for chunk in [*model_chunks, *frozen]:
        weights += [*chunk.parameters(), *torch.nn.Module.buffers(chunk)]  # DDP's `buffers` is its list of buffers
        if hasattr(chunk, "expert_parallel_buffers"):  # megatron DDP: its contiguous param / grad buffers
            for buf in chunk.buffers + chunk.expert_parallel_buffers:
                weights += [buf.param_data] if buf.param_data is not None else []
                grads += [buf.grad_data] if buf.grad_data is not None else []
    for opt in getattr(optimizer, "chained_optimizers", None) or ([optimizer] if optimizer is not None else []):
        inner = getattr(opt, "optimizer", None)
        if inner is None:  # megatron's stub optimizer of a rank with nothing to optimize
            continue
        optim += [p for group in inner.param_groups for p in group["params"]]
        optim += [v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return {"weights": weights, "grads": grads, "optimizer": optim}


def lr_scheduler(optimizer, opt: OptimizerSpec, total_steps: int):
    """megatron's OptimizerParamScheduler for the recipe's schedule (step it after each optimizer step)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay_style = {"constant": "constant", "linear": "linear", "cosine": "cosine"}[opt.lr_decay_style]
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if opt.lr_warmup_steps else opt.lr,
        max_lr=opt.lr,
        min_lr=0.0 if decay_style != "constant" else opt.lr,
        lr_warmup_steps=opt.lr_warmup_steps,
        lr_decay_steps=max(total_steps, opt.lr_warmup_steps + 1),
        lr_decay_style=decay_style,
        start_wd=opt.weight_decay,
        end_wd=opt.weight_decay,
        wd_incr_steps=max(total_steps, 1),
        wd_incr_style="constant",
    )


# --------------------------------------------------------------------------- schedules


def zero_grad(model_chunks: Sequence[torch.nn.Module], optimizer=None) -> None:
    for m in model_chunks:
        m.zero_grad_buffer()
    if optimizer is not None:
        optimizer.zero_grad()


def _forward_step(loss_fn: LossFn, data_iterator, model):
    batch = next(data_iterator)
    tokens = batch["tokens"]
    position_ids = check_positions(batch.get("position_ids"), tokens)
    layout = seq_layout(model, batch)
    batch = {**batch, "seq_layout": layout}  # read back by batch_logprobs in the loss
    tokens, position_ids = layout.model_inputs(tokens, position_ids)  # this rank's part; packed under THD
    if layout.packing is not None:
        output = model(tokens, position_ids, None, packed_seq_params=layout.packing.seq_params(tokens.device))
    else:
        output = model(tokens, position_ids, causal_mask(tokens.shape[1], device=tokens.device))
    return output, functools.partial(_call_loss, loss_fn, batch, layout.cp_rank)


def seq_layout(model, batch: dict) -> SeqLayout:
    """The CP split of this rank, and THD packing when the attention is Transformer Engine's and the batch
    says its row lengths (megatron's local attention takes neither: padded [b, s], CP 1)."""
    cp, cp_rank, group = cp_group()
    packing = None
    if getattr(model, "kimi_use_te", False) and batch.get("lengths") is not None:
        config = model.config
        multiple = seq_multiple(config.tensor_model_parallel_size, cp, config.sequence_parallel)
        packing = Packing(tuple(int(n) for n in batch["lengths"]), batch["tokens"].shape[1], multiple)
    return SeqLayout(cp, cp_rank, group, packing)


def _call_loss(loss_fn: LossFn, batch: dict, cp_rank: int, logits: torch.Tensor):
    out = loss_fn(logits, batch)
    if len(out) != 3:
        raise TypeError("loss_fn must return (loss_sum, denominator, metrics)")
    loss, denom, metrics = out
    if not torch.is_tensor(denom):  # a fill kernel: torch.tensor(n, device=cuda) would copy and wait
        denom = torch.full((), denom, dtype=torch.int, device=loss.device)
    if cp_rank > 0:  # every CP rank computed the whole-sequence loss: megatron sums denominators over DP x CP
        denom = denom * 0
    return loss, denom.to(torch.int).reshape(()), metrics


def forward_backward(
    model_chunks: Sequence[torch.nn.Module],
    micro_batches: Sequence[dict],
    loss_fn: LossFn,
    *,
    forward_only: bool = False,
    optimizer=None,
) -> list[dict]:
    """Run micro-batches through megatron's forward/backward schedule (handles pipeline parallelism).

    Each micro-batch is a dict with "tokens" [b, s] (right-padded; positions are 0..s-1) plus whatever
    `loss_fn` needs; every pipeline rank must be given the same micro-batches. `loss_fn(logits, batch)`
    runs on the last stage with vocab-parallel logits [b, s, V/tp] and returns
    (loss_sum, denominator, metrics): the gradient is that of sum(loss_sum) / sum(denominator) over all
    micro-batches and data-parallel ranks (megatron's per-token-loss mode) — e.g. summed token losses
    with the token count, or summed per-sample means with the sample count. Returns the metrics dicts
    (last stage; [] elsewhere). Zeroes grads first unless forward_only; then call `optimizer_step`.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not micro_batches:
        raise ValueError("forward_backward needs at least one micro-batch")
    if not forward_only:
        zero_grad(model_chunks, optimizer)
    seq = max(b["tokens"].shape[1] for b in micro_batches)
    mbs = micro_batches[0]["tokens"].shape[0]
    fb = get_forward_backward_func()
    with torch.set_grad_enabled(not forward_only):
        out = fb(
            forward_step_func=functools.partial(_forward_step, loss_fn),
            data_iterator=iter(list(micro_batches)),
            model=list(model_chunks),
            num_microbatches=len(micro_batches),
            seq_length=seq,
            micro_batch_size=mbs,
            forward_only=forward_only,
        )
    return list(out or [])


class NonFiniteError(PermanentError):
    """A non-finite gradient norm or weight, found on every rank at the same point (the value is reduced over the
    ranks first), before the optimizer step or the checkpoint that would take it."""


def optimizer_step(optimizer, scheduler=None, *, require_finite: bool = False) -> tuple[bool, float | None]:
    """One megatron optimizer step with gradient clipping; returns (updated, grad_norm).

    Runs the phases of megatron's own `step()` (megatron/core/optimizer/optimizer.py:593-625 for one optimizer,
    :1308-1338 chained: prepare the grads, the global grad norm, clip by it, step) so that `require_finite` can
    stop between the norm and the step: without a grad scaler megatron applies a NaN gradient as it is (its clip
    factor max/(nan + eps) is not < 1, and `step_with_ready_grads` runs). The norm is megatron's, reduced over
    the grad-stats group, so every rank holds the same value and raises at the same point: no rank is left in a
    collective the others skipped. Same arithmetic as `optimizer.step()`: a run's metrics do not change."""
    # the name megatron's own step() calls, so what model/megatron_compat.py patches there applies here too
    from megatron.core.optimizer import optimizer as megatron_optimizer

    if optimizer.prepare_grads():  # a grad scaler (fp16) found inf/nan: megatron skips the step itself
        return False, None
    grad_norm = float(optimizer.get_grad_norm())
    if require_finite and not math.isfinite(grad_norm):
        optimizer.zero_grad()
        raise NonFiniteError(f"the gradient norm is {grad_norm} (a non-finite loss or an overflow in backward); "
                             "the optimizer step did not run")
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        params = opt.get_parameters()
        if params and opt.config.clip_grad > 0.0 and not getattr(opt, "is_stub_optimizer", False):
            megatron_optimizer.clip_grad_by_total_norm_fp32(
                params, max_norm=opt.config.clip_grad, total_norm=grad_norm,
                use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    ok = optimizer.step_with_ready_grads()
    if ok and scheduler is not None:
        scheduler.step(increment=1)
    return bool(ok), grad_norm


def require_finite_params(model_chunks) -> None:
    """Refuse to go on with NaN/inf weights (a checkpoint must never keep them): one flag all-reduced over the
    world (a MAX of 0/1, the same single collective on every rank), so all ranks raise together."""
    model = unwrap(model_chunks)
    bad = torch.zeros((), device=model_device(model))
    for p in model.parameters():  # device flags, read back once
        bad = torch.maximum(bad, (~torch.isfinite(p.detach())).any().to(bad.dtype))
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
    if bad.item():
        raise NonFiniteError("the weights hold NaN or inf values: no checkpoint is written from them")


def _broadcast_from_last_pp_stage(parts: list[torch.Tensor] | None, shapes: list[tuple[int, ...]],
                                  device: torch.device) -> list[torch.Tensor]:
    """The last pipeline stage's tensors on every stage: one flat broadcast, not one per micro-batch."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        assert parts is not None
        return parts
    sizes = [math.prod(s) for s in shapes]
    if parts is not None:
        buf = torch.cat([p.reshape(-1).float() for p in parts])
    else:  # the same device as the last stage's tensors (NCCL broadcasts device tensors)
        buf = torch.empty(sum(sizes), device=device)
    src = ps.get_pipeline_model_parallel_last_rank()
    torch.distributed.broadcast(buf, src=src, group=ps.get_pipeline_model_parallel_group())
    return [x.view(s) for x, s in zip(buf.split(sizes), shapes)]


@torch.no_grad()
def micro_batch_logprobs(
    model_chunks, batches: Sequence[dict], *, temperature: float = 1.0, with_entropy: bool = False,
) -> list[torch.Tensor] | list[tuple[torch.Tensor, torch.Tensor]]:
    """Logprobs [b, s] of each micro-batch's "targets" (with entropy: (logprobs, entropy) pairs), on every rank.

    All micro-batches go through one forward-only schedule (pipelined at PP > 1; shapes may differ, megatron
    exchanges them: `variable_seq_lengths`), then the last stage's results are broadcast to the others."""
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    for m in chunks:
        m.eval()

    def collect(logits, batch):
        lp, ent = batch_logprobs(logits, batch, temperature=temperature, with_entropy=with_entropy)
        return lp.sum() * 0, 1, {"logprobs": lp, "entropy": ent}

    try:
        out = forward_backward(chunks, list(batches), collect, forward_only=True)
    finally:
        for m in chunks:
            m.train()
    shapes = [tuple(b["targets"].shape) for b in batches]
    device = model_device(unwrap(chunks))
    lps = _broadcast_from_last_pp_stage([o["logprobs"] for o in out] if out else None, shapes, device)
    if not with_entropy:
        return lps
    ents = _broadcast_from_last_pp_stage([o["entropy"] for o in out] if out else None, shapes, device)
    return list(zip(lps, ents))


def token_logprobs(
    model_chunks, tokens: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
    micro_batch_size: int | None = None, with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprobs, entropy) [b, s] of `targets` under the model, on every rank (no grad).

    `targets[:, t]` is the token predicted at position t (usually tokens shifted left; pad the end).
    `with_entropy=False` skips the entropy (a full-vocab pass) and returns None for it.
    """
    mbs = micro_batch_size or tokens.shape[0]
    batches = [
        {"tokens": tokens[i : i + mbs], "targets": targets[i : i + mbs]} for i in range(0, tokens.shape[0], mbs)
    ]
    got = micro_batch_logprobs(model_chunks, batches, temperature=temperature, with_entropy=with_entropy)
    if not with_entropy:
        return torch.cat(got), None
    return torch.cat([lp for lp, _ in got]), torch.cat([e for _, e in got])


# --------------------------------------------------------------------------- RNG


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state(device: torch.device) -> dict:
    """This rank's RNG states (python, numpy, torch CPU, `device`'s when a GPU, megatron tracker) as JSON data."""
    from megatron.core import tensor_parallel

    np_state = np.random.get_state()
    state = {
        "python": [list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": _b64(torch.get_rng_state()),
        "tracker": {k: _b64(v) for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()},
    }
    if device.type == "cuda":
        state["cuda"] = _b64(torch.cuda.get_rng_state(device))
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    from megatron.core import tensor_parallel

    random.setstate((3, tuple(state["python"][0]), state["python"][1]))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(_unb64(state["cuda"]), device)
    tensor_parallel.get_cuda_rng_tracker().set_states({k: _unb64(v) for k, v in state["tracker"].items()})


# --------------------------------------------------------------------------- checkpoints


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _model_sharded_state_dict(model_chunks) -> dict:
    # The unwrapped GPTModel, as Megatron-LM does: DDP would prefix every key with "module.".
    return unwrap(model_chunks).sharded_state_dict(metadata=dict(SHARDED_METADATA))


def _write_results_in_process() -> None:
    """Hand megatron's torch_dist writer an in-process results queue, so that no save starts a Manager process.

    The writer collects its write results through a queue it makes on first use: a Manager queue served by a
    `spawn`ed process (megatron/core/dist_checkpointing/strategies/filesystem_async.py:51-56, megatron-core 0.16.1), a
    fresh interpreter that re-imports the saving process's `__main__` (measured: 2.7 CPU-s for each converter rank
    and trainer process). It exists for asynchronous saves, whose worker process puts the results. Every save here
    is synchronous (`dist_checkpointing.save` -> `AsyncRequest.execute_sync`, strategies/base.py:212-215): the
    writer runs in this process, its forked writers report through their own local queue, and this process puts
    the gathered results (filesystem_async.py:335) and reads them back in finalize (:435-441). A plain queue does
    that. An asynchronous save would need megatron's own queue back: this runs before synchronous saves only."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is None:  # not made yet (absent: megatron moved it)
        filesystem_async._results_queue = queue.Queue()


def _save(ckpt_dir: Path, step: int, state: dict, extra: dict | None, device: torch.device) -> Path:
    """torch_dist save into a temp dir, its manifest, rename into place, tracker last (collective).

    Collectives beyond megatron's own: one object broadcast before (rank 0's free-space verdict,
    `checkpoint_manifest.space_problem`) and one object all-gather after (each rank's files with sizes and CRC-32,
    or its failure), so every rank takes the same branch. A full disk, foreseen or met (ENOSPC, which megatron's
    writer reports to all ranks as a CheckpointException), removes the temp dir and raises CheckpointSpaceError
    (permanent: a retry would redo the rollouts since the last save and fail the same way). Any other failure is
    raised as it was on each rank that had it (retryable unless permanent)."""
    from megatron.core import dist_checkpointing

    final = iteration_dir(ckpt_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    rank = _rank()
    problem = None
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save of this step
        problem = space_problem(ckpt_dir)
        if problem is None:
            tmp.mkdir()
    problem = _from_rank0(problem)  # also the barrier before anyone writes
    if problem is not None:
        raise CheckpointSpaceError(problem)
    own: BaseException | None = None
    _write_results_in_process()
    try:
        dist_checkpointing.save(state, str(tmp), content_metadata=dict(SHARDED_METADATA))
        atomic_write_json(tmp / f"rng_rank{rank:05d}.json", rng_state(device))
        mine = {"files": entries(tmp, rank_files(tmp, rank))}
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank reaches the gather, whatever failed
        own, mine = e, {"error": failure_line(e), "enospc": is_enospc(e)}
    parts = _all_gather(mine)
    failed = [(r, p) for r, p in enumerate(parts) if "error" in p]
    if failed:
        why = "; ".join(f"rank {r}: {p['error']}" for r, p in failed[:4])
        if any(p["enospc"] for _, p in failed):  # the partial save goes: it holds the space the next one needs
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            _barrier()
            raise CheckpointSpaceError(
                f"{final}: the disk filled up during the save ({why}); the partial {tmp.name} was removed: free "
                f"space in {ckpt_dir} (free now: {shutil.disk_usage(ckpt_dir).free} bytes) or set "
                "checkpoint.keep_last, then retry")
        # anything else stays what it was (retryable unless permanent); the next save of this step replaces the
        # partial temp dir, as after a crash
        if own is not None:
            raise own
        raise RuntimeError(f"{final}: the save failed on another rank ({why})")
    if rank == 0:
        # save_id: new on every save, so a re-save of the same step is a new checkpoint to its readers' caches
        atomic_write_json(tmp / EXTRA, {"step": step, "save_id": uuid.uuid4().hex, "extra": extra or {}})
        files = {name: entry for p in parts for name, entry in p["files"].items()}
        write_manifest(tmp, {**files, **entries(tmp, shared_files(tmp, set(files)))})
        old = final.with_name(final.name + ".old")
        if final.exists():  # re-saving a step: keep the old copy until the new one is in place
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        _fsync_dir(ckpt_dir)
        atomic_write_text(ckpt_dir / TRACKER, f"{step}\n")  # last: only now is the checkpoint "latest"
    _barrier()
    return final


def resume_step(ckpt_dir: str | Path) -> tuple[int | None, list[str]]:
    """The newest checkpoint of `ckpt_dir` that verifies against its manifest (`checkpoint_manifest.verify_share`:
    each rank checks every file's size and the CRC of its share; one object all-gather per iteration tried), and a
    warning for each newer one skipped; (None, []) without a tracker. None verifying: CheckpointError naming each."""
    ckpt_dir = Path(ckpt_dir)
    rank, world = _rank(), _world()
    skipped: list[str] = []
    for step in resume_candidates(ckpt_dir):
        path = iteration_dir(ckpt_dir, step)
        problems = [p for part in _all_gather(verify_share(path, rank, world)) for p in part]
        if not problems:
            return step, [f"{s}; resuming from {path} instead" for s in skipped]
        skipped.append(f"{path} does not verify ({'; '.join(problems[:3])})")
    if skipped:
        raise CheckpointError(f"{ckpt_dir}: no checkpoint verifies: {' | '.join(skipped)}; move the broken "
                              "iterations away (or the whole directory to start afresh)")
    return None, []


def _world() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def _from_rank0(obj):
    """Rank 0's `obj` on every rank (one object broadcast)."""
    if not torch.distributed.is_initialized():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _all_gather(obj) -> list:
    """Every rank's `obj`, in rank order (one object all-gather)."""
    if not torch.distributed.is_initialized():
        return [obj]
    out: list = [None] * _world()
    torch.distributed.all_gather_object(out, obj)
    return out


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@one_intraop_thread_for_helpers()
def save_checkpoint(ckpt_dir: str | Path, step: int, model_chunks, optimizer, extra: dict | None = None) -> Path:
    """Model + optimizer (+ per-rank RNG + JSON `extra`) as megatron torch_dist `iter_{step:07d}`.

    Collective over all ranks. The optimizer state is saved in megatron's fully reshardable form, so
    `load_checkpoint` works under a different TP/PP/EP/DP layout.
    """
    model_sd = _model_sharded_state_dict(model_chunks)
    state = {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=False, metadata=dict(SHARDED_METADATA)),
        "iteration": step,
        "checkpoint_version": CHECKPOINT_VERSION,
    }
    return _save(Path(ckpt_dir), step, state, extra, model_device(unwrap(model_chunks)))


@one_intraop_thread_for_helpers()
def save_model_only(ckpt_dir: str | Path, model_chunks, step: int = 0, extra: dict | None = None) -> Path:
    """Weights only, in the layout Megatron `--load` reads (the converter's output)."""
    state = {
        "model": _model_sharded_state_dict(model_chunks),
        "iteration": step,
        "checkpoint_version": CHECKPOINT_VERSION,
    }
    return _save(Path(ckpt_dir), step, state, extra, model_device(unwrap(model_chunks)))


def resolve_iteration(ckpt_dir: str | Path, step: int | None = None) -> tuple[Path, int]:
    """(iter_XXXXXXX dir, step): the tracker's latest complete iteration, or `step` if it is complete."""
    ckpt_dir = Path(ckpt_dir)
    if step is None:
        step = latest_step(ckpt_dir)
        if step is None:
            raise CheckpointError(f"{ckpt_dir}: no {TRACKER}; no complete checkpoint was written there")
    path = iteration_dir(ckpt_dir, step)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not found (no checkpoint of step {step} in {ckpt_dir})")
    if not (path / "metadata.json").is_file():
        raise CheckpointError(f"{path}: not a complete torch_dist checkpoint (metadata.json missing)")
    return path, step


def _load_model_state(model_chunks, loaded: dict) -> None:
    unwrap(model_chunks).load_state_dict(loaded["model"], strict=True)


@one_intraop_thread_for_helpers()
def load_checkpoint(
    ckpt_dir: str | Path,
    model_chunks,
    optimizer=None,
    step: int | None = None,
    *,
    restore_rng: bool = True,
) -> dict:
    """Load `iter_{step}` (default: the tracker's) into the model (and optimizer); returns `extra`.

    Works under a different parallel layout than the save (torch_dist reshards). RNG states are
    restored only when this rank's file exists and the world size is unchanged.
    """
    from megatron.core import dist_checkpointing

    path, step = resolve_iteration(ckpt_dir, step)
    model_sd = _model_sharded_state_dict(model_chunks)
    state: dict = {"model": model_sd}
    if optimizer is not None:
        _ensure_optimizer_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=dict(SHARDED_METADATA))
    with torch.serialization.safe_globals(_optimizer_classes(optimizer)):
        loaded = dist_checkpointing.load(state, str(path))
    _load_model_state(model_chunks, loaded)
    if optimizer is not None:
        if "optimizer" not in loaded:
            raise CheckpointError(f"{path}: has no optimizer state (a model-only checkpoint?)")
        optimizer.load_state_dict(loaded["optimizer"])
    meta = json.loads((path / EXTRA).read_text()) if (path / EXTRA).is_file() else {"extra": {}}
    rng_file = path / f"rng_rank{_rank():05d}.json"
    saved_world = len(list(path.glob("rng_rank*.json")))
    if restore_rng and rng_file.is_file() and saved_world == _world():
        set_rng_state(json.loads(rng_file.read_text()), model_device(unwrap(model_chunks)))
    _barrier()
    return meta.get("extra", {})


def _optimizer_classes(optimizer) -> list[type]:
    """The classes this process's optimizer keeps in its param groups: the offloaded (hybrid) optimizer stores its
    `cpu_optimizer_cls` / `gpu_optimizer_cls` there (`cpu_offloading/hybrid_optimizer.py:57-68`), megatron saves
    the groups into common.pt, and its `torch.load` (weights_only, `dist_checkpointing/strategies/common.py:89`)
    refuses any class not allow-listed (seen on an H200, torch 2.11). Taken from our own optimizer, never from the
    file, so nothing else becomes loadable."""
    parts = getattr(optimizer, "chained_optimizers", None) or ([optimizer] if optimizer is not None else [])
    groups = [g for part in parts for g in getattr(getattr(part, "optimizer", None), "param_groups", [])]
    return sorted({v for g in groups for v in g.values() if isinstance(v, type)}, key=lambda c: c.__qualname__)


def _ensure_optimizer_state(optimizer) -> None:
    """Give a fresh (never stepped) optimizer its state tensors so megatron can describe them for loading.

    megatron keeps `init_state_fn` for this but never calls it itself; torch's Adam also needs a `step`
    entry (megatron's DistributedOptimizer.state_dict() reads it), which load_state_dict then overwrites. The
    offloaded (hybrid) optimizer has no `init_state_fn`: its `dummy_step` allocates its sub-optimizers' state.
    """
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if inner is None or any(len(s) for s in inner.state.values()):
            continue
        if isinstance(inner, HybridDeviceOptimizer):  # offloaded: megatron's own way to allocate its state
            inner.dummy_step()  # (distrib_optimizer.py:727-729 does the same before reading a fresh state)
            continue
        if getattr(part, "init_state_fn", None) is not None:
            part.init_state_fn(inner, part.config)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            for group in inner.param_groups:
                for p in group["params"]:
                    inner.state[p].setdefault("step", torch.tensor(0.0))


@one_intraop_thread_for_helpers()
def load_model_only(ckpt_dir: str | Path, model_chunks, step: int | None = None) -> int:
    """Load weights from a torch_dist checkpoint (e.g. the converter's) into a model; returns the step."""
    from megatron.core import dist_checkpointing

    path, step = resolve_iteration(ckpt_dir, step)
    loaded = dist_checkpointing.load({"model": _model_sharded_state_dict(model_chunks)}, str(path))
    _load_model_state(model_chunks, loaded)
    _barrier()
    return step
