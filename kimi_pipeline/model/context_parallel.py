"""Context parallelism: megatron's load-balanced split of each sequence over the CP ranks, and its inverse.

Under a causal mask late tokens cost more attention than early ones, so megatron (with Transformer Engine's
CP attention, which the model itself needs for CP > 1) cuts a sequence into 2·CP equal chunks and gives CP
rank r the chunks r and 2·CP-1-r. The trainer feeds each rank its part of the tokens (and routing-replay
ids), computes logprobs on its part of the logits, and gathers them back to whole sequences so every loss
is computed as without CP. Sequences must be padded to `seq_multiple` first.

Hand-written: megatron's `get_batch_on_this_cp_rank` lives in Megatron-LM's training utilities, not in
megatron-core, and has no inverse.
"""

from __future__ import annotations

import torch


def seq_multiple(tp: int, cp: int, sequence_parallel: bool) -> int:
    """What every micro-batch's sequence length must divide by: 2·CP chunks, each split over TP under SP."""
    return (2 * cp if cp > 1 else 1) * (tp if sequence_parallel and tp > 1 else 1)


def cp_positions(seq_len: int, cp: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Sequence positions CP rank `rank` holds, in the order it holds them (chunk r, then chunk 2·cp-1-r)."""
    if cp == 1:
        return torch.arange(seq_len, device=device)
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2 x context parallel size ({2 * cp}); "
                         "pad micro-batches to kimi_pipeline.model.context_parallel.seq_multiple")
    chunk = seq_len // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk, device=device),
                      torch.arange(second, second + chunk, device=device)])


def cp_split(t: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This CP rank's part of `t` along the sequence dimension `dim`."""
    if cp == 1:
        return t
    return t.index_select(dim, cp_positions(t.shape[dim], cp, rank, t.device))


def cp_unsplit(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Whole sequences from every CP rank's part (in rank order): the inverse of `cp_split`."""
    cp = len(parts)
    if cp == 1:
        return parts[0]
    seq_len = sum(p.shape[dim] for p in parts)
    order = torch.cat([cp_positions(seq_len, cp, r, parts[0].device) for r in range(cp)])
    out = torch.empty_like(torch.cat(parts, dim=dim))
    return out.index_copy_(dim, order, torch.cat(parts, dim=dim))


class _GatherFromCP(torch.autograd.Function):
    """All-gather along the sequence; backward hands each rank the gradient of its own positions (every CP
    rank computes the same whole-sequence loss, so no sum over ranks is needed)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group, dim: int) -> torch.Tensor:  # noqa: D401
        cp = torch.distributed.get_world_size(group)
        ctx.dim, ctx.cp, ctx.rank = dim, cp, torch.distributed.get_rank(group)
        parts = [torch.empty_like(local) for _ in range(cp)]
        torch.distributed.all_gather(parts, local.contiguous(), group=group)
        return cp_unsplit(parts, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return cp_split(grad, ctx.cp, ctx.rank, ctx.dim), None, None


def cp_gather(local: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """Whole sequences on every CP rank from each rank's part (differentiable)."""
    if torch.distributed.get_world_size(group) == 1:
        return local
    return _GatherFromCP.apply(local, group, dim)


def cp_group():
    """(size, rank, group) of megatron's context-parallel group; (1, 0, None) before megatron is set up."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1, 0, None
    return ps.get_context_parallel_world_size(), ps.get_context_parallel_rank(), ps.get_context_parallel_group()
