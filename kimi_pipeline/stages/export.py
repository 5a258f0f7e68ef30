"""Stage `export`: the trained policy's latest (or a chosen) torch_dist checkpoint → an INT4 compressed-tensors HF
directory engines load (Kimi-K2-Thinking's format), distributed like the conversion and verified bit for bit and by
its logits (`kimi_pipeline.weightjobs.int4_export`), then scored as it will be served: the recipe's engine loads it
from disk and the eval set is scored on it (`kimi_pipeline.eval.served`; `export.score`, `export.max_eval_drop`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kimi_pipeline.eval.served import ServedSections, publish_scored
from kimi_pipeline.hub.fetch import model_root
from kimi_pipeline.recipes import Recipe
from kimi_pipeline.report.stage_reports import export_report
from kimi_pipeline.stages.runner import Stage, StageReport
from kimi_pipeline.weightjobs.int4_export import (
    SECTION_FILE,
    ExportSections,
    export_checkpoint,
    resolve_checkpoint,
)


def run(recipe: Recipe, run_dir: Path, checkpoint_dir: str | Path, *, step: int | None = None,
        model_dir: str | Path | None = None, timeout_s: float | None = None) -> dict[str, Any]:
    """`model_dir`: the base HF checkpoint whose config, tokenizer and untrained parts the export carries
    (default: the run's download)."""
    if recipe.quant.export_format != "int4":
        return {"skipped": f"quant.export_format={recipe.quant.export_format!r}"}
    model_dir = Path(model_dir) if model_dir else model_root(run_dir)
    _, step = resolve_checkpoint(checkpoint_dir, step)
    section = export_checkpoint(ExportSections.of(recipe), run_dir, checkpoint_dir, step, model_dir, timeout_s)
    return publish_scored(ServedSections.of(recipe), section, run_dir, step)


EXPORT = Stage(
    name="export",
    reads=("model", "quant", "convert", "cluster", "eval", "data", "rollout", "hub", "sglang", "export"),
    needs=("download", "train"),
    outputs=(f"export/{SECTION_FILE}", "export/int4/config.json"),
    report=StageReport(key="int4-export", render=export_report, title="INT4 export + parity",
                       failed_title="INT4 export failed"),
)
