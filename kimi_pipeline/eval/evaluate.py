"""AIME-style evaluation on the rollout engines: n samples per prompt → avg@n, pass@k, maj@n.

Runs against whatever weights the engines hold (the trainer syncs them after every step), so the
periodic evaluation during training and `kimi eval --checkpoint` share this one function.
Deterministic for a seed: the engine's sampling is seeded per evaluation.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from kimi_pipeline.engine.rollout_engine import SamplingParams
from kimi_pipeline.eval.scores import summarize
from kimi_pipeline.recipes.models import EvalSpec
from kimi_pipeline.report.metrics_log import read_jsonl
from kimi_pipeline.reward import AnswerGrader, decode_responses
from kimi_pipeline.rl.prompts import Prompt
from kimi_pipeline.util.files import atomic_write_json, atomic_write_text

EVAL_SEED_OFFSET = 7_777_777  # eval draws never coincide with a training rollout's seed


def eval_step_path(out_dir: Path, step: int) -> Path:
    return Path(out_dir) / f"step_{step:07d}.json"


def evaluate(client, tokenizer, prompts: list[Prompt], evaluation: EvalSpec, *, step: int, seed: int, rm_type: str,
             thinking: bool = False, strict: bool = False, out_dir: str | Path | None = None,
             top_k: int = -1) -> dict[str, Any]:
    """Evaluate the engines' current weights; write the per-problem table and append eval.jsonl."""

    t0 = time.perf_counter()
    n = evaluation.n_samples_per_prompt
    params = SamplingParams(temperature=evaluation.temperature, top_p=evaluation.top_p, top_k=top_k,
                            max_new_tokens=evaluation.max_response_len, seed=seed + EVAL_SEED_OFFSET + step)
    completions = client.generate([p.ids for p in prompts], n=n, params=params)
    texts = decode_responses(tokenizer, [c.output_ids for c in completions])
    labels = [p.label for p in prompts for _ in range(n)]
    with AnswerGrader(rm_type, thinking, strict=strict) as grader:
        rewards = grader.score(texts, labels)
        answers = grader.answers(texts)
        stats = grader.last_stats.as_dict()
    grid = lambda xs: [xs[i * n : (i + 1) * n] for i in range(len(prompts))]  # noqa: E731
    summary = summarize(
        [[r > 0.5 for r in row] for row in grid(rewards)],
        answers=grid(answers),
        lengths=grid([len(c.output_ids) for c in completions]),
        labels=[p.label for p in prompts],
        ks=sorted({1, n}),
        max_response_len=evaluation.max_response_len,
        prompts=[p.text for p in prompts],
    )
    result = {
        "step": step,
        "eval_set": evaluation.name,
        "avg_at_n": summary.avg_at_n,
        "pass_at_1": summary.pass_at[1],
        "pass_at_n": summary.pass_at[n],
        "maj_at_n": summary.maj_at_n,
        "n": n,
        "problems": summary.num_problems,
        "response_len_mean": summary.lengths.get("mean"),
        "timeouts": stats.get("timeouts", 0),
        "seconds": round(time.perf_counter() - t0, 3),
    }
    if out_dir is not None:
        out_dir = Path(out_dir)
        table = [row.as_dict() for row in summary.rows]
        for row, i in zip(table, range(len(prompts))):
            row["example"] = texts[i * n][:200]
        atomic_write_json(eval_step_path(out_dir, step), {**result, "problems_table": table})
        append_eval_row(out_dir / "eval.jsonl", result)
    return result


def append_eval_row(path: Path, row: dict[str, Any]) -> None:
    """eval.jsonl keeps one row per step (a retried evaluation replaces its row, it is not duplicated)."""
    rows = [r for r in read_jsonl(path) if r.get("step") != row["step"]] + [row]
    rows.sort(key=lambda r: r["step"])
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
