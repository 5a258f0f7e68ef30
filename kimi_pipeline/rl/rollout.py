"""One rollout: prompts → n samples per prompt from the engines → rewards → group-normalized advantages
(DAPO dynamic sampling when the recipe asks) and the rollout's metrics. Seeded by (`rollout.seed`, step).
Reads the rollout section and the GRPO advantage estimator's name."""

from __future__ import annotations

import time

import torch

from kimi_pipeline.engine.rollout_engine import SamplingParams
from kimi_pipeline.recipes.models import RolloutSpec
from kimi_pipeline.reward import decode_responses
from kimi_pipeline.rl.dynamic_sampling import collect_groups
from kimi_pipeline.rl.grpo import ADVANTAGE_ESTIMATORS
from kimi_pipeline.rl.prompts import Prompt, PromptStream
from kimi_pipeline.rl.samples import Sample


def rollout_seed(rollout: RolloutSpec, step: int) -> int:
    return rollout.seed * 1_000_003 + step


def generate_groups(client, tokenizer, reward, prompts: list[Prompt], rollout: RolloutSpec, seed: int,
                    first_group: int = 0) -> list[list[Sample]]:
    """n samples per prompt from the engines, graded; one list of samples per prompt (a group)."""

    params = SamplingParams(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                            max_new_tokens=rollout.max_response_len, seed=seed)
    n = rollout.n_samples_per_prompt
    completions = client.generate([p.ids for p in prompts], n=n, params=params,
                                  return_routed_experts=rollout.returns_routed_experts)
    texts = decode_responses(tokenizer, [c.output_ids for c in completions])
    rewards = reward.score(texts, [p.label for p in prompts for _ in range(n)])
    groups: list[list[Sample]] = []
    for g, p in enumerate(prompts):
        group = []
        for j in range(n):
            i = g * n + j
            c = completions[i]
            group.append(Sample(prompt_ids=list(c.prompt_ids), response_ids=list(c.output_ids),
                                rollout_logprobs=list(c.logprobs), label=p.label, group=first_group + g,
                                reward=float(rewards[i]), finish_reason=c.finish_reason, response_text=texts[i],
                                routed_experts=c.routed_experts))
        groups.append(group)
    return groups


def collect_rollout(client, tokenizer, reward, stream: PromptStream, rollout: RolloutSpec, advantage_estimator: str,
            step: int) -> tuple[list[Sample], dict]:
    """One rollout's samples with group-normalized advantages (`grpo.advantage_estimator`; dynamic sampling when
    the rollout section asks)."""

    t0 = time.perf_counter()
    if rollout.dynamic_sampling:
        per_draw = rollout.over_sampling_batch_size or rollout.rollout_batch_size
        seen: list[Sample] = []  # every sample drawn: the policy's reward, not the filtered batch's

        def draw(d: int) -> list[list[Sample]]:
            drawn = generate_groups(client, tokenizer, reward, stream.take(per_draw), rollout,
                                    rollout_seed(rollout, step) * 31 + d, first_group=d * per_draw)
            seen.extend(s for g in drawn for s in g)
            return drawn

        kept, _surplus, report = collect_groups(draw, target=rollout.rollout_batch_size,
                                                max_draws=rollout.dynamic_sampling_max_draws,
                                                rewards_of=lambda grp: [s.reward for s in grp])
        groups, extra = kept, {"dynamic_kept_groups": float(report.kept), "dynamic_dropped_groups": float(report.dropped),
                               "dynamic_draws": float(report.draws)}
        if not groups:  # every group was all-right or all-wrong: nothing to learn from this rollout
            groups = generate_groups(client, tokenizer, reward, stream.take(rollout.rollout_batch_size), rollout,
                                     rollout_seed(rollout, step))
    else:
        groups = generate_groups(client, tokenizer, reward, stream.take(rollout.rollout_batch_size), rollout,
                                 rollout_seed(rollout, step))
        seen, extra = [], {}
    gen_seconds = time.perf_counter() - t0
    samples = [s for g in groups for s in g]
    seen = seen or samples
    rewards = torch.tensor([s.reward for s in samples])
    if rollout.dynamic_sampling:
        extra["reward_trained_mean"] = float(rewards.mean())
    seen_rewards = torch.tensor([s.reward for s in seen])
    adv = ADVANTAGE_ESTIMATORS[advantage_estimator](rewards, rollout.n_samples_per_prompt)
    for s, a in zip(samples, adv.tolist()):
        s.advantage = float(a)
    n = rollout.n_samples_per_prompt
    lengths = [len(s.response_ids) for s in seen]
    out_tokens = sum(lengths)
    seen_groups = seen_rewards.view(-1, n)
    metrics = {
        "reward_mean": float(seen_rewards.mean()),  # over every sample drawn (dynamic sampling keeps a subset)
        "reward_std": float(seen_rewards.std()) if len(seen_rewards) > 1 else 0.0,
        "solved_group_fraction": float((seen_groups.max(dim=1).values > 0.5).float().mean()),
        "all_solved_group_fraction": float((seen_groups.min(dim=1).values > 0.5).float().mean()),
        "response_len_mean": out_tokens / len(seen),
        "response_len_max": float(max(lengths)),
        "truncated_fraction": sum(s.finish_reason == "length" for s in seen) / len(seen),
        "rollout_seconds": gen_seconds,
        "rollout_tokens_per_s": out_tokens / gen_seconds if gen_seconds > 0 else 0.0,
        "samples": float(len(samples)),
        "samples_drawn": float(len(seen)),
        "reward_timeouts": float(reward.last_stats.as_dict().get("timeouts", 0)),
        **extra,
    }
    return samples, metrics
