"""What the tests share: project paths, recipe overrides for the tiny runs, the metrics-row comparison and
engine samples."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kimi_pipeline.errors import PermanentError

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "data" / "tiny"


# Runs whose metrics are compared bit for bit (kill -9 + retry vs an uninterrupted run) use one intra-op thread
# per process: a multi-threaded CPU reduction may split work differently from one process to the next, and
# on the tiny model a 1e-7 difference can flip a near-tied expert choice (CI saw two runs differ at step 1).
REPRODUCIBLE = ["cluster.cpus_per_node=1"]


def makefile_var(name: str) -> str:
    """A variable the Makefile sets (`NAME := v`, `NAME ?= v` or `NAME = v`), as written there."""
    m = re.search(rf"^{name} [:?]?= *(\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert m, f"Makefile sets no {name}"
    return m.group(1)


def assert_same_rows(got: list[dict], expected: list[dict], resumed_after: int) -> None:
    """Metrics rows equal, or a failure naming the first step/keys that differ and whether that step ran
    before the checkpoint the retry resumed from (then the runs themselves are not reproducible)."""
    for g, e in zip(got, expected):
        diff = sorted((k, g.get(k), e.get(k)) for k in set(g) | set(e) if g.get(k) != e.get(k))
        if diff:
            where = (f"before the step-{resumed_after} checkpoint the retry resumed from: two uninterrupted "
                     "processes already disagree (not a resume bug)" if g["step"] <= resumed_after
                     else f"after resuming from the step-{resumed_after} checkpoint")
            pytest.fail(f"step {g['step']} differs {where}: (key, got, expected) {diff[:10]}")
    assert [r["step"] for r in got] == [r["step"] for r in expected]


def tiny_overrides(data_dir: Path) -> list[str]:
    return [
        f"hub.model.path={data_dir / 'model'}",
        f"data.train.path={data_dir / 'dapo-math-tiny.jsonl'}",
        f"data.eval.path={data_dir / 'aime-tiny.jsonl'}",
    ]


# Runs whose claim is not the weight jobs' layout convert and export on one node: the tiny recipe's 4-node jobs
# (4 torchrun agents and 4 ranks each, ~8 CPU-s a process to start) are proven by test_convert, test_int4 and the
# learning run.
ONE_NODE_WEIGHT_JOBS = ["convert.nodes=1", "convert.pp=1", "convert.ep=1"]
# the train stage's small, quick run: 4 rollouts of 8 prompts x 4 samples, checkpoint every 2, eval every 2
TRAIN_SET = [
    "rollout.num_rollout=4", "rollout.rollout_batch_size=8", "rollout.n_samples_per_prompt=4",
    "rollout.over_sampling_batch_size=16", "quant.int4_qat=true",  # the QAT loop: engines sample the fake-INT4 policy
    "checkpoint.save_interval=2", "eval.interval=2", "eval.n_samples_per_prompt=2",
    *ONE_NODE_WEIGHT_JOBS,
]
# The wall-clock figures of a metrics row (rl/rollout.py, rl/policy.py, weight_sync/updaters.py, rl/loop.py, rl/handoff.py): they differ
# from run to run. Every other key (reward_std, global_batch_size, optimizer_steps, train_samples, ...) is compared.
TIMING = frozenset({"rollout_seconds", "rollout_tokens_per_s", "train_seconds", "train_tokens_per_s", "sync_seconds",
                    "step_seconds", "handoff_seconds"})


def tiny_answer(text: str) -> str | None:
    """The final answer of a tiny-task response, read independently of kimi_pipeline.reward: the last
    \\boxed{...}, else a last line "Answer: X" (the tiny policy writes "Answer: \\boxed{6}")."""
    import re

    boxes = re.findall(r"\\boxed\{([^{}]*)\}", text)
    if boxes:
        return boxes[-1].strip()
    lines = text.strip().splitlines()
    m = re.fullmatch(r"\s*answer\s*:\s*(.+?)\s*", lines[-1], re.IGNORECASE) if lines else None
    return m.group(1) if m else None


def tiny_correct(text: str, label: str) -> bool:
    """Whether a tiny-task response answers `label` (integers: equal as strings or as numbers)."""
    answer = tiny_answer(text)
    if answer is None:
        return False
    if answer == label.strip():
        return True
    try:
        return float(answer) == float(label)
    except ValueError:
        return False


def assert_eval_agrees_with_its_problems(result: dict, step_file: Path) -> None:
    """An eval result (avg@n, pass@1, pass@n, maj@n) is what its per-problem table in `step_file` adds up to,
    and that table's correct counts agree with the responses it recorded, graded here: the first sample of
    each problem (`example`), and all n when they gave one answer (maj_votes == n)."""
    import json

    data = json.loads(Path(step_file).read_text())
    table, n = data["problems_table"], result["n"]
    for key in ("step", "avg_at_n", "pass_at_1", "pass_at_n", "maj_at_n", "n", "problems"):
        assert data[key] == result[key], key
    assert len(table) == result["problems"] and all(t["n"] == n and 0 <= t["correct"] <= n for t in table)
    assert result["avg_at_n"] == pytest.approx(sum(t["correct"] for t in table) / (n * len(table)))
    assert result["pass_at_1"] == pytest.approx(result["avg_at_n"])
    assert result["pass_at_n"] == pytest.approx(sum(t["correct"] > 0 for t in table) / len(table))
    assert result["maj_at_n"] == pytest.approx(sum(t["maj_correct"] for t in table) / len(table))
    first_right = 0
    for t in table:
        right = tiny_correct(t["example"], t["label"])
        first_right += right
        assert (t["correct"] >= 1) if right else (t["correct"] <= n - 1), t
        if t["maj_answer"] is not None:
            assert t["maj_correct"] == tiny_correct(f"\\boxed{{{t['maj_answer']}}}", t["label"]), t
            if t["maj_votes"] == n:
                assert t["correct"] == (n if t["maj_correct"] else 0), t
    assert 0 < first_right < len(table), "the tiny policy solves some problems, not all: nothing was checked"


def train_recipe(tiny: Path, extra: list[str] | None = None):
    from kimi_pipeline.recipes import load_recipe

    return load_recipe("tiny", tiny_overrides(tiny) + TRAIN_SET + (extra or []))


def stable_row(row: dict) -> dict:
    """A metrics row without its timings (which differ from run to run): the keys named in TIMING, no others."""
    return {k: v for k, v in row.items() if k not in TIMING}


def engine_samples(recipe, device="cpu", n_prompts: int = 4, n: int = 2):
    """Samples of the tiny prompts from the embedded engine in-process on `device`, with their routed experts."""
    from kimi_pipeline.engine.model import EngineModel
    from kimi_pipeline.engine.rollout_engine import RolloutEngine, SamplingParams
    from kimi_pipeline.model.tokenizer import load_tokenizer
    from kimi_pipeline.rl.prompts import load_prompts
    from kimi_pipeline.rl.samples import Sample

    prompts = load_prompts(TINY / "dapo-math-tiny.jsonl", load_tokenizer(TINY / "model"))[:n_prompts]
    engine = RolloutEngine(EngineModel.from_pretrained(TINY / "model", device=device), seed=3)
    out = engine.generate([p.ids for p in prompts for _ in range(n)], 1,
                          SamplingParams(temperature=1.0, max_new_tokens=recipe.rollout.max_response_len, seed=3),
                          return_routed_experts=True)
    return [Sample(prompt_ids=list(c.prompt_ids), response_ids=list(c.output_ids), rollout_logprobs=list(c.logprobs),
                   routed_experts=c.routed_experts) for c in out]


def graded_share(recipe, device="cpu", n_prompts: int = 4, n: int = 4, reward=lambda i: float(i % 2)):
    """`n_prompts` x `n` embedded-engine samples of the tiny prompts from the tiny checkpoint on `device`, graded
    for a test (sample i's reward `reward(i)`: alternating 0/1 by default; GRPO advantages per prompt) and split as
    the driver splits a rollout: the one DP rank's share (`share.samples` the samples)."""
    import torch

    from kimi_pipeline.rl.grpo import group_advantages
    from kimi_pipeline.rl.samples import share_rollout

    samples = engine_samples(recipe, device, n_prompts=n_prompts, n=n)
    rewards = torch.tensor([reward(i) for i in range(len(samples))])
    for s, a, r in zip(samples, group_advantages(rewards, n).tolist(), rewards.tolist()):
        s.advantage, s.reward = a, r
    (share,), _ = share_rollout(samples, recipe.rollout, recipe.parallel, recipe.data_parallel_size)
    return share


def one_grpo_step(recipe, device="cpu") -> dict:
    """`PolicyWorker.train` of one DP rank on 16 embedded-engine samples of the tiny prompts (4 prompts x 4,
    `graded_share`), from the tiny checkpoint on `device`: the trainer's metrics row."""
    from kimi_pipeline.rl.policy import PolicySections, PolicyWorker

    w = PolicyWorker(PolicySections.of(recipe))
    try:
        w.load("/nonexistent-checkpoints", str(TINY / "model"))
        return w.train(graded_share(recipe, device), 0)
    finally:
        w.close()


def fixed_batch(spec, device="cpu", n: int = 8, s: int = 24):
    """A fixed random batch (seed 5) on `device`: tokens and next-token targets [n, s]."""
    import torch

    tokens = torch.randint(0, spec.vocab_size, (n, s), generator=torch.Generator().manual_seed(5))
    return tokens.to(device), torch.roll(tokens, -1, dims=1).to(device)


def nll(logits, batch):
    """Token NLL in megatron's per-token-loss contract (loss sum, token count, metrics)."""
    from kimi_pipeline.model.vocab_parallel import logprobs_from_logits

    lp, _ = logprobs_from_logits(logits, batch["targets"])
    return -lp.sum(), lp.numel(), {"loss": (-lp.mean()).detach()}


def replay_diffs(worker, samples) -> dict[str, float]:
    """Routing replay measured on a trainer `worker`: max |trainer - engine| logprob with the engine's own expert
    ids ("replayed"), how far other ids move the trainer ("moved"), and how far no ids (the live router) are
    from the replayed forward ("live")."""
    import numpy as np

    def max_diff(xs, ys):
        return max(abs(a - b) for x, y in zip(xs, ys) for a, b in zip(x, y))

    base = worker._token_logprobs(worker.model, samples)
    assert [len(b) for b in base] == [len(s.rollout_logprobs) for s in samples]
    out = {"replayed": max_diff(base, [s.rollout_logprobs for s in samples])}
    experts = worker.spec.num_experts
    for s in samples:
        s.routed_experts = ((s.routed_experts.astype(np.int64) + 5) % experts).astype(np.int16)
    out["moved"] = max_diff(base, worker._token_logprobs(worker.model, samples))
    for s in samples:
        s.routed_experts = None
    with pytest.raises(PermanentError, match="no routed expert ids"):  # never a silent fall back to live routing
        worker._token_logprobs(worker.model, samples)
    worker.rollout.routing_replay = False
    try:
        out["live"] = max_diff(base, worker._token_logprobs(worker.model, samples))
    finally:
        worker.rollout.routing_replay = True
    return out


def experts_reached(grads) -> tuple[int, int]:
    """(experts whose weight got a non-zero gradient, experts) over routed-expert weight gradients: a stacked
    [E, out, in] gradient counts E experts, a per-expert [out, in] one counts one."""
    per_expert = [g.reshape(-1, *g.shape[-2:]) for g in grads]
    return (sum(int((g.abs().sum((1, 2)) > 0).sum()) for g in per_expert), sum(g.shape[0] for g in per_expert))


def qat_vs_quantized_weights(model, ref, device) -> tuple:
    """INT4 QAT (group 32) on `model` in megatron DDP against `ref` whose routed-expert weights ARE the fake-quant
    values: the same forward and backward of a fixed batch on `device` through both. Returns (QAT logits, ref
    logits, {param name: (QAT main_grad, ref grad)}, names of the routed-expert params); QAT is off after."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from kimi_pipeline.hf.int4 import fake_quant_int4
    from kimi_pipeline.model.megatron_model import causal_forward
    from kimi_pipeline.model.qat import WEIGHT, disable_int4_qat, enable_int4_qat, routed_expert_modules

    with torch.no_grad():
        for _, lin in routed_expert_modules(ref):
            for name, p in lin._parameters.items():
                if p is not None and WEIGHT.fullmatch(name):
                    p.copy_(fake_quant_int4(p, 32))
    expert_ids = {id(p) for _, lin in routed_expert_modules(model) for p in lin.parameters()}
    experts = {n for n, p in model.named_parameters() if id(p) in expert_ids}
    enable_int4_qat(model, 32)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=model)
    try:
        tokens = torch.randint(4, 300, (2, 12), generator=torch.Generator().manual_seed(1)).to(device)
        up = torch.randn(2, 12, 384, generator=torch.Generator().manual_seed(2)).to(device)
        ddp.zero_grad_buffer()
        got = causal_forward(ddp, tokens)
        (got * up).sum().backward()
        ddp.finish_grad_sync()
        ref.zero_grad(set_to_none=True)
        want = causal_forward(ref, tokens)
        (want * up).sum().backward()
        ref_grads = dict(ref.named_parameters())
        grads = {n: (p.main_grad, ref_grads[n].grad) for n, p in model.named_parameters()}
    finally:
        disable_int4_qat(model)
    return got, want, grads, experts


def random_tiny_hf(seed: int = 0, device="cpu", **changes):
    """The tiny model (transformers) with larger random weights and a non-zero expert bias, so routing and logits
    are non-trivial; `changes` edit the tiny ModelSpec."""
    import torch

    from kimi_pipeline.model.hf_model import build_hf_model
    from kimi_pipeline.recipes import load_recipe

    model = build_hf_model(load_recipe("tiny").model.model_copy(update=changes), seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.12, generator=g)
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05, generator=g)
    return model.to(device)


def assert_bf16_engine_tracks_fp32(hf, prompts: list[list[int]], device="cpu") -> None:
    """The GPU dtype path (bf16 weights, fp32 router/softmax/logits) of the embedded engine built from `hf` on
    `device`: prefill logits close to the fp32 engine's on average, and sampling runs."""
    import numpy as np
    import torch

    from kimi_pipeline.engine.model import EngineModel
    from kimi_pipeline.engine.rollout_engine import RolloutEngine, SamplingParams

    fp32 = EngineModel.from_hf_model(hf, device=device)
    bf16 = EngineModel.from_hf_model(hf, device=device, dtype=torch.bfloat16)
    assert bf16.embed.dtype == torch.bfloat16 and bf16.device == torch.device(device)
    ids = torch.tensor(prompts, device=device)
    ref, low = fp32.prefill(ids, all_logits=True)[0], bf16.prefill(ids, all_logits=True)[0]
    assert low.dtype == torch.float32
    # bf16 rounding can flip a near-tie expert choice at a few tokens, so compare on average
    assert (ref - low).abs().mean() < 0.02 * ref.abs().max()
    out = RolloutEngine(bf16).generate(ids.tolist(), 2, SamplingParams(max_new_tokens=4, stop_token_ids=(), seed=0))
    assert all(len(c.output_ids) == 4 and np.isfinite(c.logprobs).all() for c in out)
