"""Per-token log-probabilities and entropy from vocab-parallel logits (each TP rank holds V/tp of the vocabulary):
the one place the softmax normaliser is assembled across the TP group. Used by the context-parallel loss path
(`context_parallel.batch_logprobs`) and the training step."""

from __future__ import annotations

import torch


def _tp_reduce(x: torch.Tensor, op=None) -> torch.Tensor:
    """All-reduce over the TP group: autograd-aware sum (backward = identity) or a detached max."""
    from megatron.core import parallel_state as ps  # megatron loads in the trainer, not where this module is imported

    if ps.get_tensor_model_parallel_world_size() == 1:
        return x
    if op == "max":
        x = x.detach().clone()
        torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
        return x
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x)


def logprobs_from_logits(
    logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log p(target) and entropy from vocab-parallel logits [..., V/tp] (differentiable).

    Correct under TP: the softmax normaliser is assembled with a max / sum all-reduce over the TP group.
    `targets` must match the logits position for position: losses use `context_parallel.batch_logprobs`,
    which handles a CP split or packing. `temperature` divides the logits first (the rollout's temperature).
    """
    from megatron.core import parallel_state as ps

    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    v_local = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * v_local
    shifted = logits - _tp_reduce(logits.max(dim=-1, keepdim=True).values, op="max")
    exp = shifted.exp()
    sum_exp = _tp_reduce(exp.sum(dim=-1, keepdim=True))
    lse = sum_exp.log().squeeze(-1)
    local = targets - start
    inside = (local >= 0) & (local < v_local)
    picked = shifted.gather(-1, local.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1) * inside
    logprobs = _tp_reduce(picked) - lse
    if not with_entropy:
        return logprobs, None
    entropy = lse - _tp_reduce((exp / sum_exp * shifted).sum(dim=-1))
    return logprobs, entropy
