"""Rollout samples and their tensor form for the trainer.

A sample is one response to one prompt, with what the rollout engine measured (per-token logprobs,
routed experts) and what the driver added (reward, group-normalized advantage). Samples cross process
boundaries (Ray) as plain lists, so they stay cheap to serialize and never need pickle of tensors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from kimi_pipeline.recipes.models import ParallelSpec, RolloutSpec
from kimi_pipeline.rl.batching import RolloutSplit, split_rollout, step_batch_size


@dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]  # per response token, from the engine
    label: str = ""
    group: int = 0  # index of the prompt in its rollout (samples of one prompt share it)
    reward: float = 0.0
    advantage: float = 0.0
    finish_reason: str = "stop"
    response_text: str = ""
    # [len(prompt)+len(response)-1][moe_layers][topk] expert ids for routing replay (None: live routing)
    routed_experts: list | None = field(default=None, repr=False)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class MicroBatch:
    """Right-padded tensors for one forward (megatron MLA wants positions 0..s-1 in every row).

    `targets[b, t]` is the token predicted at position t (tokens shifted left); `mask[b, t]` is 1 where
    that target is a response token, so logprobs line up with the engine's per-token logprobs.
    """

    tokens: torch.Tensor  # [b, s] long
    targets: torch.Tensor  # [b, s] long
    mask: torch.Tensor  # [b, s] float
    rollout_logprobs: torch.Tensor  # [b, s] float (0 outside the mask)
    advantages: torch.Tensor  # [b, s] float, broadcast over response tokens
    index: list[int]  # positions of these samples in the step's sample list
    routed_experts: torch.Tensor | None = None  # [b, s, moe_layers, topk] long
    lengths: list[int] | None = None  # real tokens per row (THD packing packs only these, padded to the TP/CP multiple)
    rows: int = 0  # rows with response tokens (counted on the host: the loss needs it and must not wait for the device)

    def to(self, device: torch.device) -> MicroBatch:
        """The same micro-batch with its tensors on `device`: the one place where a batch moves to the trainer's
        device (collate builds it on the host, where the samples are)."""
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return dataclasses.replace(self, tokens=move(self.tokens), targets=move(self.targets), mask=move(self.mask),
                                   rollout_logprobs=move(self.rollout_logprobs), advantages=move(self.advantages),
                                   routed_experts=move(self.routed_experts))


def collate(samples: list[Sample], index: list[int], pad_id: int, pad_to_multiple: int = 1) -> MicroBatch:
    width = max(s.num_tokens for s in samples)
    width = -(-width // pad_to_multiple) * pad_to_multiple
    b = len(samples)
    tokens = torch.full((b, width), pad_id, dtype=torch.long)
    targets = torch.full((b, width), pad_id, dtype=torch.long)
    mask = torch.zeros((b, width))
    rollout = torch.zeros((b, width))
    adv = torch.zeros((b, width))
    routed = None
    if all(s.routed_experts is not None for s in samples):
        first = samples[0].routed_experts
        layers, topk = len(first[0]), len(first[0][0])
        # positions the engine never routed (the last token, padding) get experts 0..k-1: they feed no loss
        routed = torch.arange(topk).expand(b, width, layers, topk).clone()
    for i, s in enumerate(samples):
        seq = torch.tensor(s.tokens, dtype=torch.long)
        n, p, r = len(seq), len(s.prompt_ids), len(s.response_ids)
        tokens[i, :n] = seq
        targets[i, : n - 1] = seq[1:]
        # target at position t is token t+1: response tokens are targets at positions p-1 .. p+r-2
        mask[i, p - 1 : p - 1 + r] = 1.0
        rollout[i, p - 1 : p - 1 + r] = torch.tensor(s.rollout_logprobs[:r], dtype=torch.float32)
        adv[i, p - 1 : p - 1 + r] = s.advantage
        if routed is not None:
            ids = torch.tensor(s.routed_experts, dtype=torch.long)
            routed[i, : ids.shape[0]] = ids
    rows = sum(1 for s in samples if s.response_ids)
    return MicroBatch(tokens, targets, mask, rollout, adv, list(index), routed, [s.num_tokens for s in samples], rows)


@dataclass
class RankShare:
    """One data-parallel rank's part of a rollout: only its samples, and per optimizer step its
    micro-batches as positions in `samples` (an empty micro-batch is zero-weight padding). The driver puts
    each share in Ray's object store once; every trainer rank of that DP rank (TP/PP/CP peers) reads it."""

    dp_rank: int
    samples: list[Sample]
    steps: list[list[list[int]]]


def share_rollout(samples: list[Sample], rollout: RolloutSpec, parallel: ParallelSpec,
                  dp: int) -> tuple[list[RankShare], RolloutSplit]:
    """The recipe's split of a rollout over `dp` data-parallel ranks (`Recipe.data_parallel_size`) and optimizer
    steps (see `batching.split_rollout`): steps of `rollout.global_batch_size` samples as the seeds (or one step
    of all with a dynamic global batch); with no global batch set, `num_steps_per_rollout` steps of whatever
    dynamic sampling kept."""
    if rollout.use_dynamic_global_batch_size or rollout.global_batch_size is not None:
        size = step_batch_size(len(samples), rollout.samples_per_step, dp, rollout.use_dynamic_global_batch_size)
        steps = {"global_batch_size": size}
    else:
        steps = {"num_steps": rollout.num_steps_per_rollout}
    split = split_rollout([s.num_tokens for s in samples], dp_size=dp, balance=rollout.balance_data, **steps,
                          max_tokens_per_gpu=parallel.max_tokens_per_gpu if parallel.use_dynamic_batch_size else None)
    shares = []
    for r in range(dp):
        mine = split.rank_samples(r)
        local = {g: j for j, g in enumerate(mine)}
        shares.append(RankShare(r, [samples[g] for g in mine],
                                [[[local[g] for g in mb] for mb in step] for step in split.rank_steps(r)]))
    return shares, split


def padding_micro_batch(pad_id: int = 0, routed: tuple[int, int] | None = None, width: int = 1) -> MicroBatch:
    """A one-row micro-batch with no response token: a rank with nothing to train in a micro-batch slot
    still runs it (collectives are per micro-batch) and it adds zero to the loss and the gradient.
    `routed` = (moe_layers, topk) gives it replay ids (experts 0..k-1) like collate's padding positions;
    `width` = the sequence multiple TP/CP need."""
    z = torch.zeros((1, width))
    t = torch.full((1, width), pad_id, dtype=torch.long)
    ids = None if routed is None else torch.arange(routed[1]).expand(1, width, *routed).clone()
    return MicroBatch(t, t.clone(), z, z.clone(), z.clone(), [], ids, [1], rows=0)


def response_values(values: torch.Tensor, sample: Sample) -> list[float]:
    """A sample's per-response-token values out of its [s] row (inverse of collate's placement)."""
    p, r = len(sample.prompt_ids), len(sample.response_ids)
    return values[p - 1 : p - 1 + r].tolist()


def response_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sample mean over response tokens: [b, s] → [b]."""
    return (values * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)
