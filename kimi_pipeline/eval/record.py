"""Evaluation as a unit of work: one call per (step, engines), recorded in DIR/eval and summary.json.

Called by the training loop every `eval.interval` steps (the Prefect layer wraps each call in its
own retried task run), and by `kimi eval --checkpoint` on any HF or torch_dist checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kimi_pipeline.engine.client import Router
from kimi_pipeline.engine.model import EngineModel
from kimi_pipeline.engine.rollout_engine import RolloutEngine
from kimi_pipeline.engine.server import EngineServer
from kimi_pipeline.errors import PermanentError
from kimi_pipeline.eval.evaluate import eval_step_path, evaluate
from kimi_pipeline.model.checkpoint_dirs import TRACKER, latest_step
from kimi_pipeline.model.device import resolve_device
from kimi_pipeline.model.tokenizer import load_tokenizer
from kimi_pipeline.recipes import Recipe
from kimi_pipeline.recipes.models import DataSpec, EvalSpec, ModelSpec, QuantSpec, RolloutSpec
from kimi_pipeline.report.stage_reports import eval_report
from kimi_pipeline.report.summary import RunSummary
from kimi_pipeline.rl.prompts import load_prompts
from kimi_pipeline.weight_sync.policy_tensors import checkpoint_model, policy_tensors

SUMMARY_KEYS = ("step", "avg_at_n", "pass_at_1", "pass_at_n", "maj_at_n")


@dataclass(frozen=True)
class EvalSections:
    """What an evaluation reads of the recipe (`EvalSections.of`): `eval` its sampling and sizes, `data` the prompt
    columns, `rollout` the seed and the grader (rm_type, thinking, reward_strict, top_k), `spec` / `quant` /
    `device` how a torch_dist checkpoint is read back (QAT fake-quant as the policy sampled), and the hub's
    `trust_remote_code` and SGLang's `server_concurrency`."""

    eval: EvalSpec
    data: DataSpec
    rollout: RolloutSpec
    spec: ModelSpec
    quant: QuantSpec
    device: str
    trust_remote_code: bool
    server_concurrency: int

    @classmethod
    def of(cls, recipe: Recipe) -> EvalSections:
        return cls(recipe.eval, recipe.data, recipe.rollout, recipe.model, recipe.quant, recipe.cluster.device,
                   recipe.hub.trust_remote_code, recipe.sglang.server_concurrency)


def score_engines(sections: EvalSections, engine_urls: list[str], run_dir: Path, tokenizer_dir: Path, step: int,
                  out_dir: Path, data_file: Path | None = None) -> dict[str, Any]:
    """The eval set scored on the engines at `engine_urls` with the recipe's sampling, seed and grader, recorded in
    `out_dir` (`eval.evaluate.evaluate`): the one scoring of the in-training eval, `kimi eval` and the served
    export (`eval.served`). Prompts: `data_file`, or the run's validated eval set."""
    tokenizer = load_tokenizer(tokenizer_dir, sections.trust_remote_code)
    data, rollout = sections.data, sections.rollout
    prompts = load_prompts(data_file or Path(run_dir) / "validate" / "eval.jsonl", tokenizer, data.input_key,
                           data.label_key, data.apply_chat_template)
    with Router(engine_urls, server_concurrency=sections.server_concurrency) as client:
        return evaluate(client, tokenizer, prompts, sections.eval, step=step, seed=rollout.seed,
                        rm_type=rollout.rm_type, thinking=rollout.thinking, strict=rollout.reward_strict,
                        out_dir=out_dir, top_k=rollout.top_k)


def run_eval_step(sections: EvalSections, run_dir: Path, step: int, engine_urls: list[str],
                  model_dir: Path) -> dict[str, Any]:
    """Evaluate the engines' current weights at `step`; returns the eval.jsonl row (+ `markdown`)."""

    out_dir = Path(run_dir) / "eval"
    result = score_engines(sections, engine_urls, run_dir, model_dir, step, out_dir)
    RunSummary(run_dir).upsert_row("eval", {k: result[k] for k in SUMMARY_KEYS})
    table = json.loads(eval_step_path(out_dir, step).read_text()).get("problems_table")
    return {**result, "markdown": eval_report(result, table)}


def evaluate_checkpoint(sections: EvalSections, checkpoint: Path, run_dir: Path, *, model_dir: Path | None = None,
                        data_file: Path | None = None, step: int | None = None) -> dict[str, Any]:
    """`kimi eval --checkpoint`: an HF directory (config.json) or a torch_dist checkpoint, evaluated on
    an in-process embedded engine. Eval prompts: `data_file` or the run's validated eval set."""

    checkpoint = Path(checkpoint)
    if step is None:  # a training checkpoint evaluates with the seed of the in-training eval at its step
        step = _checkpoint_step(checkpoint)
    if (checkpoint / "config.json").is_file():
        engine_model = EngineModel.from_pretrained(checkpoint)
        tokenizer_dir = checkpoint if (checkpoint / "tokenizer.json").is_file() else model_dir
    elif (checkpoint / TRACKER).is_file() or checkpoint.name.startswith("iter_"):
        if model_dir is None or not (Path(model_dir) / "config.json").is_file():
            raise PermanentError(f"{model_dir}: a torch_dist checkpoint needs the HF config + tokenizer directory "
                                 "it was converted from (--model-dir, or the run's download stage)")
        tokenizer_dir = model_dir
        engine_model = EngineModel.from_pretrained(model_dir)
        engine_model.load_weights(_torch_dist_hf_tensors(sections, checkpoint), strict=True)
    else:
        raise PermanentError(f"{checkpoint}: neither an HF checkpoint (config.json) nor a torch_dist checkpoint "
                             f"({TRACKER} or iter_NNNNNNN/)")
    with EngineServer(RolloutEngine(engine_model, seed=sections.rollout.seed)) as server:
        torch.manual_seed(sections.rollout.seed)
        return score_engines(sections, [server.url], run_dir, tokenizer_dir, step or 0, Path(run_dir) / "eval",
                             data_file)


def base_policy_scores(sections: EvalSections, model_dir: Path, data_file: Path, work_dir: Path) -> dict[str, float]:
    """How an HF checkpoint behaves on an eval set, as the pipeline measures it: the recipe's sampled eval at
    step 0 (`avg_at_n`, its seed) and a greedy pass (temperature 0, one sample: `greedy`)."""
    greedy = dataclasses.replace(sections, eval=sections.eval.model_copy(update={"temperature": 0.0,
                                                                                "n_samples_per_prompt": 1}))
    sampled = evaluate_checkpoint(sections, model_dir, Path(work_dir) / "sampled", data_file=data_file, step=0)
    first = evaluate_checkpoint(greedy, model_dir, Path(work_dir) / "greedy", data_file=data_file, step=0)
    return {"avg_at_n": sampled["avg_at_n"], "greedy": first["avg_at_n"], "problems": sampled["problems"]}


def _checkpoint_step(checkpoint: Path) -> int:
    if checkpoint.name.startswith("iter_") and checkpoint.name[5:].isdigit():
        return int(checkpoint.name[5:])
    return latest_step(checkpoint) or 0


def _torch_dist_hf_tensors(sections: EvalSections, checkpoint: Path) -> dict:
    """A torch_dist checkpoint's HF-named tensors in this (one-rank) process, as the policy sampled them."""

    ckpt_dir, step = (checkpoint.parent, int(checkpoint.name.split("_")[1])) if checkpoint.name.startswith("iter_") \
        else (checkpoint, None)
    spec, quant = sections.spec, sections.quant
    with checkpoint_model(spec, ckpt_dir, step, device=resolve_device(sections.device)) as (model, layout, _):
        qat = quant.group_size if quant.int4_qat else None
        return dict(policy_tensors(model, spec, layout, qat_group_size=qat))
