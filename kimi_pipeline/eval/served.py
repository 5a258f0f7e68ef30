"""The INT4 export scored as it will be served: the recipe's rollout engine loads the exported directory from disk,
as a deployment would, and the eval set is scored on it.

The export's own checks (`weightjobs.int4_export`) compare tensors and logits with the checkpoint; this is the
number a user's serving stack should reproduce. The engine is the recipe's: the embedded engine in this process
(CPU), or an SGLang server on this node's GPUs (`export_sglang_engine`: the command the train stage's engines run,
`--model-path` the export, on one node). Eval seeds are the training eval's at the exported step, so the two
avg@n differ by what the export changed (INT4 packing of a policy that trained without QAT, kernels), not by
sampling.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kimi_pipeline.engine.model import EngineModel
from kimi_pipeline.engine.rollout_engine import RolloutEngine
from kimi_pipeline.engine.server import EngineServer
from kimi_pipeline.engine.sglang import SGLangEngine
from kimi_pipeline.errors import SectionError
from kimi_pipeline.eval.record import EvalSections, score_engines
from kimi_pipeline.recipes import Recipe
from kimi_pipeline.recipes.models import ExportSpec, SGLangSpec
from kimi_pipeline.report.summary import RunSummary
from kimi_pipeline.util.files import atomic_write_json
from kimi_pipeline.weightjobs.int4_export import SECTION_FILE, export_dir

UNPUBLISHED = "UNPUBLISHED.md"  # in the export directory: the scores fell below the bound; do not serve it


class ExportEvalDropError(SectionError):
    """The served export scores more than `export.max_eval_drop` below the training eval (permanent: a retry scores
    the same files the same way); `section` is the export's section with its scores, unpublished."""


@dataclass(frozen=True)
class ServedSections:
    """What scoring the served export reads of the recipe (`ServedSections.of`): `evaluation` the eval sections,
    `export` the gate, `engine` the rollout engine kind, `sglang` its launch options and `gpus_per_node` the GPUs
    an SGLang server may take on this node."""

    evaluation: EvalSections
    export: ExportSpec
    engine: str
    sglang: SGLangSpec
    gpus_per_node: int

    @classmethod
    def of(cls, recipe: Recipe) -> ServedSections:
        return cls(EvalSections.of(recipe), recipe.export, recipe.rollout.engine, recipe.sglang,
                   recipe.cluster.gpus_per_node)


def publish_scored(sections: ServedSections, section: dict[str, Any], run_dir: Path, step: int) -> dict[str, Any]:
    """The export's section with `eval` (its served scores, `score_export`) and `published`, rewritten as the export
    stage's completion marker; the marker goes while the scoring runs, so a crash there never leaves an unscored
    export marked done, and an export scored below the bound is recorded unpublished before the error is raised."""
    marker = export_dir(run_dir) / SECTION_FILE
    if not sections.export.score:
        section = {**section, "eval": {"skipped": "export.score=false"}, "published": True}
        atomic_write_json(marker, section)
        return section
    marker.unlink(missing_ok=True)
    try:
        scored = score_export(sections, Path(section["path"]), run_dir, step)
    except ExportEvalDropError as e:
        e.section = {**section, **e.section}
        atomic_write_json(marker, e.section)  # the record of this export: scored, unpublished
        raise
    section = {**section, "eval": scored, "published": True}
    atomic_write_json(marker, section)
    return section


def score_export(sections: ServedSections, export_path: Path, run_dir: Path, step: int) -> dict[str, Any]:
    """Serve the export with the recipe's engine, score the eval set at `step`'s seeds; returns `export.eval`:
    the scores, the training eval's avg@n at that step and the drop. Above `export.max_eval_drop` the export is
    marked unpublished (UNPUBLISHED.md beside its files) and ExportEvalDropError (permanent) is raised."""
    ev = sections.evaluation
    out_dir = Path(run_dir) / "export" / "eval"
    with serving(sections, export_path, out_dir / "logs") as url:
        torch.manual_seed(ev.rollout.seed)
        # the export carries the tokenizer it serves with
        result = score_engines(ev, [url], run_dir, export_path, step, out_dir)
    scored = {"engine": sections.engine, "step": step, "problems": result["problems"],
              **{k: result[k] for k in ("avg_at_n", "pass_at_1", "pass_at_n")}}
    reference = training_eval(run_dir, step)
    bound = sections.export.max_eval_drop
    if reference is None:
        scored.update(training_avg_at_n=None, drop=None, max_drop=bound,
                      note=f"no training eval at step {step} to compare with: recorded only")
        return scored
    drop = reference["avg_at_n"] - result["avg_at_n"]
    scored.update(training_avg_at_n=reference["avg_at_n"], drop=round(drop, 6), max_drop=bound)
    (export_path / UNPUBLISHED).unlink(missing_ok=True)
    if bound is not None and drop > bound:
        message = (f"the served INT4 export scores avg@n {result['avg_at_n']:.4f} on the eval set, {drop:.4f} below "
                   f"the training eval at step {step} ({reference['avg_at_n']:.4f}; export.max_eval_drop {bound}). "
                   f"The export stays at {export_path}, marked unpublished ({UNPUBLISHED}): do not serve it. Train "
                   "with quant.int4_qat=true so the policy learns its INT4 experts, or raise export.max_eval_drop")
        (export_path / UNPUBLISHED).write_text(f"# Unpublished\n\n{message}.\n")
        raise ExportEvalDropError(message, {"eval": scored, "published": False})
    return scored


@contextlib.contextmanager
def serving(sections: ServedSections, model_dir: Path, log_dir: Path) -> Iterator[str]:
    """The URL of the recipe's engine serving `model_dir` from disk, for the duration of the block."""
    if sections.engine == "sglang":
        server = export_sglang_engine(sections, model_dir, log_dir)
        try:
            yield server.start()
        finally:
            server.stop()
        return
    engine = RolloutEngine(EngineModel.from_pretrained(model_dir), seed=sections.evaluation.rollout.seed)
    with EngineServer(engine) as server:
        yield server.url


def export_sglang_engine(sections: ServedSections, model_dir: Path, log_dir: Path | None = None) -> SGLangEngine:
    """The SGLang server that scores the export: the rollout engines' options on one node of this cluster. An INT4
    export holds its routed experts (nearly all of K2's 1 T parameters) in a quarter of the bf16 bytes a rollout
    engine holds (~0.6 TB instead of 2 TB), so an engine that spans nodes for bf16 (the K2 presets' 16 GPUs) serves
    the export on one node's GPUs (8 × 141 GB on H200); EP and DP shrink with it where they were wider."""
    sglang, n = sections.sglang, sections.gpus_per_node
    if sglang.gpus_per_engine > n:
        sglang = sglang.model_copy(update={"gpus_per_engine": n, "ep_size": math.gcd(sglang.ep_size, n),
                                       "dp_size": math.gcd(sglang.dp_size, n)})
    ev = sections.evaluation
    return SGLangEngine(model_dir, sglang, gpus_per_node=n, log_dir=log_dir, seed=ev.rollout.seed,
                        trust_remote_code=ev.trust_remote_code)


def training_eval(run_dir: Path, step: int) -> dict[str, Any] | None:
    """The run's in-training eval row at `step` (summary.json), if the run evaluated there."""
    rows = RunSummary(run_dir).read().get("eval") or []
    return next((r for r in reversed(rows) if r.get("step") == step), None)
