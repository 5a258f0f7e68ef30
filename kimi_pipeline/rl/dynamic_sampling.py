"""Dynamic sampling (DAPO): train only on prompt groups whose rewards differ.

A group whose n samples all got the same reward has zero GRPO advantage everywhere: it costs a
forward/backward and teaches nothing. With ``rollout.dynamic_sampling`` the rollout over-samples
prompt batches and keeps drawing until ``rollout_batch_size`` informative groups are collected
(or a draw limit is hit), which is what upstream does in place of the removed
``--filter-zero-reward-samples`` flag.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

MIN_REWARD_STD = 1e-8

G = TypeVar("G")


def group_has_signal(rewards: Sequence[float], min_std: float = MIN_REWARD_STD) -> bool:
    """True if the group's reward std (population) exceeds ``min_std``; a 1-sample group never does."""
    return len(rewards) > 1 and statistics.pstdev(float(r) for r in rewards) > min_std


def _default_rewards(group: Any) -> Sequence[float]:
    return group["rewards"] if isinstance(group, dict) else group.rewards


def filter_groups(
    groups: Sequence[G], rewards_of: Callable[[G], Sequence[float]] = _default_rewards, min_std: float = MIN_REWARD_STD
) -> tuple[list[G], list[G]]:
    """(kept, dropped), order preserved."""
    kept: list[G] = []
    dropped: list[G] = []
    for g in groups:
        (kept if group_has_signal(rewards_of(g), min_std) else dropped).append(g)
    return kept, dropped


@dataclass
class DynamicSamplingReport:
    target: int
    draws: int = 0
    groups_seen: int = 0
    kept: int = 0  # groups returned for training (<= target)
    dropped: int = 0  # zero-std groups thrown away
    surplus: int = 0  # informative groups beyond the target (returned separately, e.g. for the next rollout)
    reached_target: bool = False

    @property
    def keep_rate(self) -> float:
        return (self.kept + self.surplus) / self.groups_seen if self.groups_seen else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "keep_rate": self.keep_rate}


def collect_groups(
    produce: Callable[[int], Sequence[G]],
    target: int,
    max_draws: int,
    rewards_of: Callable[[G], Sequence[float]] = _default_rewards,
    min_std: float = MIN_REWARD_STD,
) -> tuple[list[G], list[G], DynamicSamplingReport]:
    """Call ``produce(draw_index)`` (one over-sampled prompt batch -> its graded groups) until
    ``target`` informative groups are kept or ``max_draws`` batches were drawn.

    Returns (kept[:target], surplus, report). If the draw limit is hit first, ``kept`` is shorter
    than ``target`` and ``report.reached_target`` is False: the caller decides whether to train on
    the smaller batch or stop (a policy that solves, or fails, everything yields no signal).
    Groups are objects with ``.rewards``, dicts with ``"rewards"``, or anything with ``rewards_of``.
    """
    if target < 1 or max_draws < 1:
        raise ValueError(f"dynamic sampling needs target >= 1 and max_draws >= 1 (got {target}, {max_draws})")
    report = DynamicSamplingReport(target=target)
    kept: list[G] = []
    while len(kept) < target and report.draws < max_draws:
        groups = produce(report.draws)
        report.draws += 1
        report.groups_seen += len(groups)
        good, bad = filter_groups(groups, rewards_of, min_std)
        kept.extend(good)
        report.dropped += len(bad)
    kept, surplus = kept[:target], kept[target:]
    report.kept, report.surplus = len(kept), len(surplus)
    report.reached_target = len(kept) == target
    return kept, surplus, report
