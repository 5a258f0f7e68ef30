"""What the tests share: project paths, recipe overrides for the tiny runs, the metrics-row comparison and
engine samples."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "data" / "tiny"


# Runs whose metrics are compared bit for bit (kill -9 + retry vs an uninterrupted run) use one intra-op thread
# per process: a multi-threaded CPU reduction may split work differently from one process to the next, and
# on the tiny model a 1e-7 difference can flip a near-tied expert choice (CI saw two runs differ at step 1).
REPRODUCIBLE = ["cluster.cpus_per_node=1"]


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


# the train stage's small, quick run: 4 rollouts of 8 prompts x 4 samples, checkpoint every 2, eval every 2
TRAIN_SET = [
    "rollout.num_rollout=4", "rollout.rollout_batch_size=8", "rollout.n_samples_per_prompt=4",
    "rollout.over_sampling_batch_size=16", "quant.int4_qat=true",  # the QAT loop: engines sample the fake-INT4 policy
    "checkpoint.save_interval=2", "eval.interval=2", "eval.n_samples_per_prompt=2",
    "convert.nodes=1", "convert.pp=1", "convert.ep=1",
]
TIMING = ("seconds", "tokens_per_s", "_s")


def train_recipe(tiny: Path, extra: list[str] | None = None):
    from kimi_pipeline.recipes import load_recipe

    return load_recipe("tiny", tiny_overrides(tiny) + TRAIN_SET + (extra or []))


def stable_row(row: dict) -> dict:
    """A metrics row without its timings (which differ from run to run)."""
    return {k: v for k, v in row.items() if not any(t in k for t in TIMING)}


def engine_samples(recipe, n_prompts: int = 4, n: int = 2):
    """Samples of the tiny prompts from the embedded engine in-process, with their routed experts."""
    from kimi_pipeline.model.tokenizer import load_tokenizer
    from kimi_pipeline.rl.engine.model import EngineModel
    from kimi_pipeline.rl.engine.sampler import RolloutEngine, SamplingParams
    from kimi_pipeline.rl.prompts import load_prompts
    from kimi_pipeline.rl.samples import Sample

    prompts = load_prompts(TINY / "dapo-math-tiny.jsonl", load_tokenizer(TINY / "model"))[:n_prompts]
    engine = RolloutEngine(EngineModel.from_pretrained(TINY / "model"), seed=3)
    out = engine.generate([p.ids for p in prompts for _ in range(n)], 1,
                          SamplingParams(temperature=1.0, max_new_tokens=recipe.rollout.max_response_len, seed=3),
                          return_routed_experts=True)
    return [Sample(prompt_ids=list(c.prompt_ids), response_ids=list(c.output_ids), rollout_logprobs=list(c.logprobs),
                   routed_experts=c.routed_experts) for c in out]
