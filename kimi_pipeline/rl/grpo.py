"""GRPO loss math as slime/miles compute it, as pure torch functions.

Shapes: per-token tensors are ``[B, T]`` (B samples, T response positions, right-padded) with a 0/1
``mask`` of the same shape marking response tokens; per-sample tensors are ``[B]``. Any leading
shape works as long as the last dim is tokens. Nothing here knows about models or distribution.

Aggregation is the per-sample token mean: each sample's loss is the mean over its own response
tokens, and samples are averaged, so long responses do not outweigh short ones. When one global
batch is split into micro-batches, pass ``num_samples`` (samples in the whole step, per rank) so
that the accumulated gradient equals the full-batch mean.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kimi_pipeline.rl.step_metrics import DeviceMetric

if TYPE_CHECKING:
    from kimi_pipeline.recipes.models import GRPOSpec

LOG_RATIO_CLAMP = 20.0
KL_CLAMP = 10.0
ADV_EPS = 1e-6


def group_advantages(rewards: torch.Tensor, n_samples_per_prompt: int, eps: float = ADV_EPS) -> torch.Tensor:
    """A = (r - mean_group) / (std_group + eps), unbiased std over each prompt's n consecutive samples.

    ``rewards`` is ``[num_prompts * n]`` with each prompt's samples adjacent. A group whose rewards
    are all equal gets A = 0 (no signal). n = 1 has no defined std: advantages are 0.
    """
    r = rewards.reshape(-1)
    if not r.is_floating_point():
        r = r.float()
    n = n_samples_per_prompt
    if n < 1 or r.numel() % n:
        raise ValueError(f"{r.numel()} rewards do not split into groups of n_samples_per_prompt={n}")
    groups = r.view(-1, n)
    centered = groups - groups.mean(dim=1, keepdim=True)
    if n == 1:
        return torch.zeros_like(r)
    std = groups.std(dim=1, unbiased=True, keepdim=True)
    return (centered / (std + eps)).reshape(-1)


# `grpo.advantage_estimator` → (rewards [prompts * n], n) -> advantages; a new estimator is one more entry
ADVANTAGE_ESTIMATORS = {"grpo": group_advantages}


def broadcast_to_tokens(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sample ``[B]`` advantages -> per-token ``[B, T]`` (zero outside the response)."""
    return advantages.to(mask.dtype if mask.is_floating_point() else torch.float32).unsqueeze(-1) * mask


def per_sample_token_mean(x: torch.Tensor, mask: torch.Tensor, num_samples: int | None = None) -> torch.Tensor:
    """Mean over each sample's masked tokens, then over samples (sum / num_samples if given).

    A sample with no response tokens contributes 0 (and still counts in the denominator)."""
    mask = mask.to(x.dtype)
    per_sample = (x * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)
    denom = num_samples if num_samples is not None else per_sample.numel()
    return per_sample.sum() / max(denom, 1)


def ppo_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """rho = exp(clamp(logp - old_logp, +-20)): the clamp keeps a stale token from overflowing."""
    return torch.exp((logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def policy_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, eps_clip: float, eps_clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate max(-rho A, -clip(rho, 1-eps, 1+eps_high) A), and where the clip won."""
    ratio = ppo_ratio(logp, old_logp)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    return torch.maximum(loss_unclipped, loss_clipped), (loss_clipped > loss_unclipped)


def tis_weights(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, clip: float, clip_low: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance sampling: (clamp(exp(old - rollout), clip_low, clip), raw ratio).

    Corrects for the rollout engine's logprobs differing from the trainer's (kernels, precision).
    No gradient flows through the weights."""
    raw = torch.exp((old_logp - rollout_logp).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return raw.clamp(clip_low, clip), raw


def mismatch_metrics(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                     mean: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, DeviceMetric]:
    """How far the engine that sampled is from the trainer on the sampled tokens (the train/inference mismatch that
    precedes the collapses of long MoE runs): per-token d = log p_trainer - log p_engine over response tokens.

    mismatch_abs_logp_mean / _max: |d|, per-sample token mean and the extreme; mismatch_k3: k3 = e^d - 1 - d, an
    unbiased, never-negative estimate of KL(engine || trainer) from the engine's own samples (E_engine[e^d] = 1).
    Reported on every step, TIS or not; device tensors, read back with the step's other metrics."""
    d = (old_logp - rollout_logp).detach()
    size = d.abs()
    _, worst = _masked_extremes(size, mask)
    dc = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return {
        "mismatch_abs_logp_mean": DeviceMetric(mean(size)),
        "mismatch_abs_logp_max": DeviceMetric(worst, "max"),
        "mismatch_k3": DeviceMetric(mean((torch.expm1(dc) - dc).clamp_min(0.0))),  # expm1: exact near d = 0
    }


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token KL(pi || ref) estimate. low_var_kl (k3): e^d - 1 - d with d = clamp(ref - logp, +-20),
    clamped to [-10, 10]; k1: logp - ref; k2: (logp - ref)^2 / 2."""
    if kind == "low_var_kl":
        d = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return (torch.exp(d) - 1.0 - d).clamp(-KL_CLAMP, KL_CLAMP)
    if kind == "k1":
        return logp - ref_logp
    if kind == "k2":
        return 0.5 * (logp - ref_logp) ** 2
    raise ValueError(f"unknown kl_loss_type {kind!r}: choose low_var_kl, k1 or k2 (recipe field grpo.kl_loss_type)")


def _masked_extremes(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of `x` where `mask` is set, as device tensors (no boolean indexing: its size is a host sync);
    (0, 0) for an all-padding micro-batch."""
    on = mask.bool()
    some = on.any()
    low = torch.where(on, x, torch.inf).amin()
    high = torch.where(on, x, -torch.inf).amax()
    return torch.where(some, low, 0.0), torch.where(some, high, 0.0)


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor | None,
    ref_logp: torch.Tensor | None,
    entropy: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: "GRPOSpec",
    num_samples: int | None = None,
    rows: int | None = None,
) -> tuple[torch.Tensor, dict[str, DeviceMetric]]:
    """The GRPO objective for one (micro-)batch and its metrics.

    loss = agg(pg * w_tis) + kl_coef * agg(kl) - entropy_coef * agg(H), agg = per-sample token mean.
    ``advantages`` may be per sample ``[B]`` or per token ``[B, T]``. ``rollout_logp`` is needed
    only when ``cfg.use_tis``; ``ref_logp`` only for the KL term (its metric is reported whenever
    given); ``entropy`` only for the bonus/metric. Metrics are `DeviceMetric`s (read back once per step with
    `metrics.settle`), means over this micro-batch (per-sample token means), unscaled by ``num_samples``.
    ``rows``: how many rows are samples (have response tokens; known on the host, so nothing here waits for the
    device); rows without response tokens then add nothing to any mean. Default: every row.
    """
    mask = mask.to(logp.dtype)
    rows = mask.shape[:-1].numel() if rows is None else rows
    mean = lambda x: per_sample_token_mean(x, mask, rows)  # noqa: E731
    if advantages.dim() == logp.dim() - 1:
        advantages = broadcast_to_tokens(advantages, mask)
    advantages = advantages.to(logp.dtype)
    old_logp = old_logp.detach()

    pg, clipped = policy_loss(logp, old_logp, advantages, cfg.eps_clip, cfg.eps_clip_high)
    metrics: dict[str, DeviceMetric] = {}
    if rollout_logp is not None:
        metrics.update(mismatch_metrics(old_logp, rollout_logp, mask, mean))
    if cfg.use_tis:
        if rollout_logp is None:
            raise ValueError("grpo.use_tis is on but no rollout logprobs were given (the rollout must return logprobs)")
        w, raw = tis_weights(old_logp, rollout_logp, cfg.tis_clip, cfg.tis_clip_low)
        pg = pg * w
        tis_min, tis_max = _masked_extremes(raw, mask)
        metrics.update(
            # a per-sample token mean like every other mean here: weighted by rows over micro-batches it is the
            # rollout's mean whatever the micro-batching (a plain token mean changed with DP and max_tokens_per_gpu)
            tis_mean=DeviceMetric(mean(raw)),
            tis_min=DeviceMetric(tis_min, "min"),  # extremes stay extremes over micro-batches, steps and ranks
            tis_max=DeviceMetric(tis_max, "max"),
            tis_clipfrac=DeviceMetric(mean((w != raw).to(logp.dtype))),
        )
    pg_loss = mean(pg)
    loss = pg_loss
    metrics["pg_loss"] = DeviceMetric(pg_loss.detach())
    metrics["clip_fraction"] = DeviceMetric(mean(clipped.to(logp.dtype)))
    with torch.no_grad():
        metrics["ppo_kl"] = DeviceMetric(mean(old_logp - logp))

    if ref_logp is not None:
        kl = mean(kl_penalty(logp, ref_logp.detach(), cfg.kl_loss_type))
        metrics["kl"] = DeviceMetric(kl.detach())
        if cfg.use_kl_loss and cfg.kl_loss_coef > 0:
            loss = loss + cfg.kl_loss_coef * kl
    elif cfg.use_kl_loss and cfg.kl_loss_coef > 0:
        raise ValueError("grpo.use_kl_loss with kl_loss_coef > 0 needs reference logprobs (ref_logp)")

    if entropy is not None:
        ent = mean(entropy)
        metrics["entropy"] = DeviceMetric(ent.detach())
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * ent
    elif cfg.entropy_coef > 0:
        raise ValueError("grpo.entropy_coef > 0 needs per-token entropy")

    metrics["loss"] = DeviceMetric(loss.detach())
    if num_samples is not None:  # this micro-batch's share of the step's per-sample mean
        loss = loss * rows / max(num_samples, 1)
    return loss, metrics
