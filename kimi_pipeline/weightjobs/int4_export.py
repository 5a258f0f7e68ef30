"""The INT4 export of a trained policy -> compressed-tensors HF directory, verified (the export stage runs it).

Output: `<run_dir>/export/<name>/` (config.json with Kimi-K2-Thinking's quantization_config,
sharded safetensors + index, tokenizer files) and `<run_dir>/export/export.json` (the summary
section, written last: its presence marks a finished export).

`export_checkpoint` exports a megatron torch_dist training checkpoint (the tracker's
latest, or a chosen step). It is distributed like the conversion, in the weight-job layout (`job.JobLayout`, one
rank per GPU over its nodes): every rank loads its slice, quantizes and writes the tensors it owns and
checks them bit for bit (`weightjobs/export_rank.py`); then this process names the shards and writes the index
last. When the model fits in this host's memory, a one-rank child process (`export_model_check`) then reloads the
export with transformers + compressed-tensors and compares its logits with the checkpoint's own megatron forward
(fake-quant experts when the recipe trains with INT4 QAT). `run_export` is the same export in one
process from any source of HF-named tensors (tests, tools).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kimi_pipeline.hf.int4_checkpoint import ExportInfo, Int4Part, export_int4, export_temp_dir, finish_int4_dir
from kimi_pipeline.hf.names import HFLayout
from kimi_pipeline.model.checkpoint_dirs import CheckpointError
from kimi_pipeline.model.megatron_train import EXTRA, resolve_iteration
from kimi_pipeline.model.params import count_params
from kimi_pipeline.recipes import Recipe
from kimi_pipeline.recipes.models import ModelSpec, QuantSpec
from kimi_pipeline.util.files import sha256_files, sha256_json
from kimi_pipeline.weightjobs.export_rank import REPORT_PREFIX
from kimi_pipeline.weightjobs.export_model_check import model_check_fits, run_model_check
from kimi_pipeline.weightjobs.export_verify import (
    ExportInputError,
    LogitsFn,
    TensorCheck,
    check_model_into,
    check_tensors,
    export_section,
    finish_export,
)
from kimi_pipeline.weightjobs.job import JobLayout, JobPhase, run_weight_job
from kimi_pipeline.weightjobs.job_file import write_job_file

log = logging.getLogger(__name__)

TensorSource = Callable[[], Iterable[tuple[str, torch.Tensor]]]
MIN_SHARD, MAX_SHARD = 1 << 20, 5 << 30
SECTION_FILE = "export.json"


@dataclass(frozen=True)
class ExportSections:
    """What the export reads of the recipe (`ExportSections.of`): `spec` the model, `quant` the format, group
    size and whether the policy trained with QAT, `job` the weight-job layout the distributed export runs in (nodes,
    ranks, split, launcher, device)."""

    spec: ModelSpec
    quant: QuantSpec
    job: JobLayout

    @classmethod
    def of(cls, recipe: Recipe) -> ExportSections:
        return cls(recipe.model, recipe.quant, JobLayout.of(recipe.convert, recipe.cluster))


def export_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "export"


def shard_bytes(spec: ModelSpec) -> int:
    """~4 shards for small models (so sharding is exercised), 5 GiB shards for real ones."""
    return int(min(MAX_SHARD, max(MIN_SHARD, count_params(spec).total * 2 // 4)))


def run_export(
    spec: ModelSpec,
    quant: QuantSpec,
    run_dir: str | Path,
    hf_tensors_source: TensorSource,
    *,
    model_dir: str | Path,
    reference_logits: LogitsFn | None = None,
    checkpoint: str | None = None,
    name: str = "int4",
    parity_tol: float | None = None,
    verify_model: bool | None = None,
) -> dict[str, Any]:
    """Export + verify in this process; returns the `export` section (raises ExportVerificationError with it).

    hf_tensors_source: zero-argument callable returning the trained policy's HF-named tensors (the names table's:
      no checkpoint prefix; called once to write and once per check); model_dir: the base checkpoint (its config,
      files and the parts RL does not train are carried over);
    reference_logits: the trainer's fake-quant forward (ids [1, T] -> logits [1, T, V]), if available;
    checkpoint: what was exported (recorded).
    """
    t0 = time.monotonic()
    if quant.export_format != "int4":
        return {"skipped": f"quant.export_format={quant.export_format!r}: only the INT4 export is written here"}
    config = base_config(model_dir)
    out = export_dir(run_dir) / name
    (export_dir(run_dir) / SECTION_FILE).unlink(missing_ok=True)
    info = export_int4(
        hf_tensors_source(), config, model_dir, out, quant.group_size, max_shard_bytes=shard_bytes(spec)
    )
    log.info("export: wrote %s (%d packed experts, %d bytes, %d tensors carried as stored)", out, info.num_quantized,
             info.disk_bytes, info.carried_tensors)
    section = export_section(quant, info, check_tensors(out, hf_tensors_source(), quant.group_size), checkpoint)
    fits, reason = model_check_fits(spec)
    checked: dict[str, Any] = {}
    if fits if verify_model is None else verify_model:
        check_model_into(checked, spec, quant, out, hf_tensors_source(), reference_logits, parity_tol)
    else:
        checked["model_check"] = f"skipped: {reason or 'disabled'}"
    return finish_export(section, checked, export_dir(run_dir) / SECTION_FILE, time.monotonic() - t0)


def base_config(model_dir: str | Path) -> dict[str, Any]:
    cfg_path = Path(model_dir) / "config.json"
    if not cfg_path.is_file():
        raise ExportInputError(f"{cfg_path}: not found; model_dir must hold the base model's config.json + tokenizer")
    return json.loads(cfg_path.read_text())


# --------------------------------------------------------------------------- from a training checkpoint


def resolve_checkpoint(checkpoint_dir: str | Path, step: int | None = None) -> tuple[Path, int]:
    """(iter_XXXXXXX dir, step) of a megatron checkpoint: the tracker's latest, or `step`."""

    try:
        return resolve_iteration(checkpoint_dir, step)
    except CheckpointError as e:
        raise ExportInputError(f"{e}; nothing to export (pick another --step or train first)") from None


def checkpoint_content_hash(checkpoint_dir: str | Path, step: int | None = None) -> str:
    """The export's cache key, from the checkpoint's metadata, not its ~14 TB of weights + Adam state at K2
    size: the save's own id (`kimi_extra.json`, new on every save), megatron's metadata files, and the
    name and size of every data file."""

    path, step = resolve_checkpoint(checkpoint_dir, step)
    files = sorted(p for p in path.rglob("*") if p.is_file())
    small = [p for p in files if p.name in (EXTRA, "metadata.json", ".metadata", "common.pt")]
    return sha256_json({"step": step, "metadata": {p.name: d for p, d in zip(small, sha256_files(small))},
                        "files": {str(p.relative_to(path)): p.stat().st_size for p in files}})


def export_distributed(
    sections: ExportSections,
    run_dir: Path,
    checkpoint_dir: str | Path,
    step: int,
    model_dir: Path,
    name: str = "int4",
    timeout_s: float | None = None,
) -> tuple[ExportInfo, dict[str, Any]]:
    """Every rank of the weight-job layout writes the experts it owns; the index is merged here, last."""

    job, quant, spec = sections.job, sections.quant, sections.spec
    job.layout.check_model(spec)
    config = base_config(model_dir)
    out = export_dir(run_dir)
    final = out / name
    for stale in out.glob(f".{name}.tmp-*"):  # an interrupted export's shards
        shutil.rmtree(stale, ignore_errors=True)
    tmp = export_temp_dir(final, uuid.uuid4().hex[:8])
    tmp.mkdir(parents=True)
    work = out / "work"
    shutil.rmtree(work, ignore_errors=True)
    reports = work / "reports"
    job_file = write_job_file(
        work / "job.json",
        model=spec,
        layout=job.layout,
        device=job.device,
        model_dir=model_dir.resolve(),
        out_dir=tmp.resolve(),
        report_dir=reports.resolve(),
        checkpoint_dir=str(Path(checkpoint_dir).resolve()),
        step=step,
        group_size=quant.group_size,
        max_shard_bytes=shard_bytes(spec),
        hf_prefix=HFLayout.of_config(config).prefix,
    )
    t0 = time.monotonic()
    try:
        (done,) = run_weight_job(job, [JobPhase("export", job_file, reports, "export", REPORT_PREFIX)], timeout_s)
        ranks = done.reports
        info = finish_int4_dir(
            tmp,
            final,
            [Int4Part.from_json(r["part"]) for r in ranks],
            config,
            model_dir,
            quant.group_size,
            max_shard_bytes=shard_bytes(spec),
        )
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    checks = [r["check"] for r in ranks]
    tensors = TensorCheck(dequant_exact=all(c["dequant_exact"] for c in checks),
                          others_exact=all(c["others_exact"] for c in checks),
                          num_quantized=sum(c["num_quantized"] for c in checks), num_other=sum(c["num_other"] for c in checks),
                          mismatches=[m for c in checks for m in c["mismatches"]])
    extra = {
        "ranks": job.layout.world_size,
        "layout": {k: v for k, v in job.as_dict().items() if k != "etp"},
        "peak_rss_mb_per_rank": [r["peak_rss_mb"] for r in ranks],
        "write_seconds": round(time.monotonic() - t0, 3),
        "command": done.command,
        "launcher": done.result.launcher,
    }
    return info, {"tensors": tensors, **extra}


def export_checkpoint(
    sections: ExportSections,
    run_dir: Path,
    checkpoint_dir: str | Path,
    step: int | None,
    model_dir: Path,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """Export checkpoint `step` (default: latest) of `checkpoint_dir`, distributed, then check the export's model
    where it fits; returns the export section (written last as DIR/export/export.json). A failed verification
    raises ExportVerificationError carrying the section."""
    t0 = time.monotonic()
    path, step = resolve_checkpoint(checkpoint_dir, step)  # fail here, clearly, before spawning anything
    out = export_dir(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / SECTION_FILE).unlink(missing_ok=True)
    info, dist_info = export_distributed(sections, run_dir, checkpoint_dir, step, model_dir, timeout_s=timeout_s)
    log.info(
        "export: wrote %s (%d packed experts, %d bytes) from %d ranks",
        info.path,
        info.num_quantized,
        info.disk_bytes,
        dist_info["ranks"],
    )
    checked = run_model_check(sections.spec, sections.quant, sections.job.device, Path(info.path), checkpoint_dir,
                              step, out / "work", timeout_s)
    section = {**export_section(sections.quant, info, dist_info.pop("tensors"), str(path)), **dist_info}
    return finish_export(section, checked, out / SECTION_FILE, time.monotonic() - t0)


