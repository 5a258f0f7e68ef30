"""Stage `convert`: the downloaded HF checkpoint → megatron torch_dist, as a distributed weight job over the
recipe's conversion nodes, verified against the source (`kimi_pipeline.weightjobs.conversion`). A recipe that loads
HF weights into the trainer directly (`convert.mode=bridge`, K2.5) skips it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kimi_pipeline.hub.fetch import read_manifest
from kimi_pipeline.model.checkpoint_dirs import TRACKER
from kimi_pipeline.recipes import Recipe
from kimi_pipeline.report.stage_reports import convert_report
from kimi_pipeline.stages.runner import Skipped, Stage, StageReport
from kimi_pipeline.weightjobs.conversion import CKPT_NAME, MARKER, ConvertSections, run_convert


def run(recipe: Recipe, run_dir: Path) -> dict[str, Any]:
    if recipe.convert.mode == "bridge":  # K2.5: the trainer loads HF weights itself; nothing to convert
        return Skipped(mode="bridge", verified=False, skipped="convert.mode=bridge loads HF weights directly")
    model = read_manifest(run_dir)["model"]
    return run_convert(ConvertSections.of(recipe), run_dir, model["root"], source_files=model["files"])


CONVERT = Stage(
    name="convert",
    reads=("model", "parallel", "convert", "cluster", "hub"),
    needs=("download",),
    outputs=(f"convert/{CKPT_NAME}/{TRACKER}", f"convert/{MARKER}"),
    report=StageReport(key="convert", render=convert_report, title="HF → torch_dist conversion"),
)
