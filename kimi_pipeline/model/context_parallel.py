"""How a micro-batch's sequences are laid out for the model: context-parallel split and THD packing.

Context parallelism: under a causal mask late tokens cost more attention than early ones, so megatron (with
Transformer Engine's CP attention, which the model itself needs for CP > 1) cuts each sequence into 2·CP
equal chunks and gives CP rank r the chunks r and 2·CP-1-r. The trainer feeds each rank its part of the
tokens (and routing-replay ids), computes logprobs on its part of the logits and gathers them back to whole
sequences, so every loss is written as without CP. Sequences are padded to `seq_multiple` first.

Packing (THD): with Transformer Engine attention a micro-batch's rows are concatenated into one row with
`PackedSeqParams` (cu_seqlens) instead of being padded to the longest row, each sequence padded only to
`seq_multiple`; CP then splits every sequence on its own (as TE's `thd_get_partitioned_indices`).
megatron's local (non-TE) attention supports neither, so on CPU batches stay padded [b, s] and CP = 1.

`batch_logprobs` is the one place logits turn into per-token logprobs of a batch's targets in its [b, s]
layout, whatever the split or packing. Hand-written: Megatron-LM's `get_batch_on_this_cp_rank` and
packing live in its training scripts, not in megatron-core, and have no inverse for logprobs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kimi_pipeline.model.vocab_parallel import logprobs_from_logits


def seq_multiple(tp: int, cp: int, sequence_parallel: bool) -> int:
    """What every sequence length must divide by: 2·CP chunks, each split over TP under SP."""
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


Positions = Callable[[int], torch.Tensor]  # CP rank -> the positions (along the sequence dim) it holds


def cp_split(t: torch.Tensor, cp: int, rank: int, dim: int = 1, positions: Positions | None = None) -> torch.Tensor:
    """This CP rank's part of `t` along the sequence dimension `dim` (default: one sequence per row)."""
    if cp == 1:
        return t
    index = positions(rank) if positions else cp_positions(t.shape[dim], cp, rank)
    return t.index_select(dim, index.to(t.device))


def cp_unsplit(parts: list[torch.Tensor], dim: int = 1, positions: Positions | None = None) -> torch.Tensor:
    """Whole sequences from every CP rank's part (in rank order): the inverse of `cp_split`."""
    cp = len(parts)
    if cp == 1:
        return parts[0]
    joined = torch.cat(parts, dim=dim)
    seq_len = joined.shape[dim]
    order = torch.cat([(positions(r) if positions else cp_positions(seq_len, cp, r)) for r in range(cp)])
    return torch.empty_like(joined).index_copy_(dim, order.to(joined.device), joined)


class _GatherFromCP(torch.autograd.Function):
    """All-gather along the sequence; backward hands each rank the gradient of its own positions (every CP
    rank computes the same whole-sequence loss, so no sum over ranks is needed)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group, dim: int, positions):  # noqa: D401
        cp = torch.distributed.get_world_size(group)
        ctx.dim, ctx.cp, ctx.rank, ctx.positions = dim, cp, torch.distributed.get_rank(group), positions
        parts = [torch.empty_like(local) for _ in range(cp)]
        torch.distributed.all_gather(parts, local.contiguous(), group=group)
        return cp_unsplit(parts, dim, positions)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return cp_split(grad, ctx.cp, ctx.rank, ctx.dim, ctx.positions), None, None, None


def cp_gather(local: torch.Tensor, group, dim: int = 1, positions: Positions | None = None) -> torch.Tensor:
    """Whole sequences on every CP rank from each rank's part (differentiable)."""
    if group is None or torch.distributed.get_world_size(group) == 1:
        return local
    return _GatherFromCP.apply(local, group, dim, positions)


def cp_group() -> tuple[int, int, Any]:
    """(size, rank, group) of megatron's context-parallel group; (1, 0, None) before megatron is set up."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1, 0, None
    return ps.get_context_parallel_world_size(), ps.get_context_parallel_rank(), ps.get_context_parallel_group()


# --------------------------------------------------------------------------- THD packing


@dataclass(frozen=True)
class Packing:
    """Rows of a [b, s] micro-batch packed into one [1, T] row, each padded to `multiple` tokens."""

    lengths: tuple[int, ...]  # real tokens per row
    width: int  # s of the padded layout
    multiple: int = 1

    @property
    def padded(self) -> list[int]:
        return [-(-n // self.multiple) * self.multiple for n in self.lengths]

    def _cu(self, sizes: list[int]) -> torch.Tensor:
        return torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """[b, s, ...] → [1, T, ...]: each row's first padded-length positions (padding beyond s is zeros)."""
        rows = []
        for i, n in enumerate(self.padded):
            row = t[i, : min(n, t.shape[1])]
            if n > t.shape[1]:
                row = torch.cat([row, row.new_zeros((n - t.shape[1], *row.shape[1:]))])
            rows.append(row)
        return torch.cat(rows)[None]

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        """[1, T, ...] → [b, s, ...] (zeros where the padded layout has padding)."""
        out = t.new_zeros((len(self.lengths), self.width, *t.shape[2:]))
        offset = 0
        for i, n in enumerate(self.padded):
            k = min(n, self.width)
            out[i, :k] = t[0, offset : offset + k]
            offset += n
        return out

    def positions(self) -> torch.Tensor:
        """[1, T] position of each packed token within its own sequence (rope restarts per sequence)."""
        return torch.cat([torch.arange(n) for n in self.padded])[None]

    def cp_positions(self, cp: int) -> Positions:
        """Per CP rank, the packed positions it holds: each sequence split on its own (TE's THD CP layout)."""
        starts = self._cu(self.padded).tolist()
        return lambda rank: torch.cat([s + cp_positions(n, cp, rank) for s, n in zip(starts, self.padded)])

    def seq_params(self, device: torch.device | str = "cpu"):
        """megatron's PackedSeqParams (qkv_format thd) for this packing."""
        from megatron.core.packed_seq_params import PackedSeqParams

        cu, cu_pad = self._cu(list(self.lengths)).to(device), self._cu(self.padded).to(device)
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_pad,
                               cu_seqlens_kv_padded=cu_pad, max_seqlen_q=max(self.padded),
                               max_seqlen_kv=max(self.padded))


@dataclass(frozen=True)
class SeqLayout:
    """How one micro-batch reached the model: its CP split (size, rank, group) and packing (None = [b, s])."""

    cp: int = 1
    cp_rank: int = 0
    group: Any = None
    packing: Packing | None = None

    def model_inputs(self, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens and positions this rank feeds the model."""
        if self.packing is not None:
            return self.local(tokens), self.split(self.packing.positions().to(tokens.device))
        return self.local(tokens), self.local(positions)

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """Per-token values [b, s, ...] of the batch → this rank's, in the order its model input has them."""
        return self.split(self.packing.pack(t) if self.packing is not None else t)

    def _positions(self) -> Positions | None:
        return self.packing.cp_positions(self.cp) if self.packing is not None and self.cp > 1 else None

    def split(self, t: torch.Tensor) -> torch.Tensor:
        return cp_split(t, self.cp, self.cp_rank, 1, self._positions())

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's per-token values → the batch's [b, s] layout (whole sequences, unpacked)."""
        if self.cp > 1:
            t = cp_gather(t, self.group, 1, self._positions())
        return self.packing.unpack(t) if self.packing is not None else t


def batch_logprobs(logits: torch.Tensor, batch: dict, *, temperature: float = 1.0, with_entropy: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token (logprobs, entropy) [b, s] of batch["targets"] from the logits the model returned for this
    batch, whatever CP split or packing the forward step used (`batch["seq_layout"]`)."""

    layout: SeqLayout = batch.get("seq_layout") or SeqLayout()
    lp, ent = logprobs_from_logits(logits, layout.local(batch["targets"]), temperature=temperature,
                                   with_entropy=with_entropy)
    return layout.gather(lp), None if ent is None else layout.gather(ent)
