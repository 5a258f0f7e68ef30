"""Stage `convert`: HF safetensors -> a Megatron torch_dist checkpoint at DIR/convert/torch_dist.

The job writes into a fresh temp directory (`torch_dist.tmp-<id>`, the tracker
`latest_checkpointed_iteration.txt` written last inside it), is verified there under another layout
(unless `convert.verify` is false, which is recorded as verified=false), and only then is renamed to
`torch_dist`; `convert.json` (fingerprint + section) is written after that. A conversion is complete
only when both exist and the fingerprint (source file sha256s + the recipe's model/parallel/convert
sections) matches, so an interrupted run — a temp dir, a directory without tracker, a missing
convert.json — is never taken for a finished one: it is removed and redone.
"""

from __future__ import annotations

import json
import logging
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kimi_pipeline.errors import PermanentError
from kimi_pipeline.hf.reader import HFCheckpoint
from kimi_pipeline.hub.manifest import build_manifest, list_files
from kimi_pipeline.model.checkpoint_dirs import TRACKER
from kimi_pipeline.recipes import Recipe
from kimi_pipeline.recipes.models import ModelSpec
from kimi_pipeline.util.files import atomic_write_json, sha256_json
from kimi_pipeline.weightjobs.convert_verify import (
    SMALL_MODEL_BYTES,
    Verification,
    model_bytes,
    verification_section,
    verify_layout,
)
from kimi_pipeline.weightjobs.job import JobLayout, JobPhase, run_weight_job
from kimi_pipeline.weightjobs.job_file import write_job_file

log = logging.getLogger(__name__)

CKPT_NAME = "torch_dist"
MARKER = "convert.json"
FORMAT_VERSION = 1  # bump when the checkpoint layout written here changes


class ConvertStageError(PermanentError):
    pass


def convert_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "convert"


def checkpoint_dir(run_dir: str | Path) -> Path:
    """What to pass to Megatron's --load (and the training stage)."""
    return convert_dir(run_dir) / CKPT_NAME


@dataclass(frozen=True)
class ConvertSections:
    """What a conversion reads of the recipe (`ConvertSections.of`): `job` the weight-job layout it runs in (nodes,
    ranks, split, launcher, device), `mode` and `verify` the convert section's own switches, `spec` the model,
    `text_config_key` where the checkpoint keeps its text config; `key` the model / parallel / convert sections as
    the fingerprint records them."""

    job: JobLayout
    mode: str
    verify: bool
    spec: ModelSpec
    text_config_key: str | None
    key: dict[str, Any]

    @classmethod
    def of(cls, recipe: Recipe) -> ConvertSections:
        return cls(JobLayout.of(recipe.convert, recipe.cluster), recipe.convert.mode, recipe.convert.verify,
                   recipe.model, recipe.hub.text_config_key, recipe.section_dump("model", "parallel", "convert"))


def fingerprint(sections: ConvertSections, source_files: dict[str, Any]) -> str:
    """Content of the conversion: source file hashes + the recipe sections that shape the checkpoint."""
    files = {k: (v.get("sha256") or v.get("size")) for k, v in sorted(source_files.items())}
    return sha256_json({"v": FORMAT_VERSION, "files": files, "recipe": sections.key})


def source_manifest(model_dir: Path) -> dict[str, Any]:
    """sha256 + size of the checkpoint's files, when no download manifest is at hand."""

    return build_manifest(model_dir, list_files(model_dir))


def completed(run_dir: str | Path, fp: str | None = None) -> dict[str, Any] | None:
    """The recorded section if DIR holds a finished conversion (of `fp`, when given), else None."""
    ckpt, marker = checkpoint_dir(run_dir), convert_dir(run_dir) / MARKER
    if not (ckpt / TRACKER).is_file() or not marker.is_file():
        return None
    try:
        rec = json.loads(marker.read_text())
    except json.JSONDecodeError:
        return None
    if fp is not None and rec.get("fingerprint") != fp:
        return None
    return rec.get("section")


def _clean_incomplete(out: Path) -> list[str]:
    """Remove what an interrupted or superseded conversion left behind; returns what was removed."""
    removed = []
    (out / MARKER).unlink(missing_ok=True)  # from here on nothing here counts as complete
    for p in sorted(out.glob(f"{CKPT_NAME}.tmp-*")):
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p.name)
    ckpt = out / CKPT_NAME
    if ckpt.exists() and not (ckpt / TRACKER).is_file():
        shutil.rmtree(ckpt, ignore_errors=True)
        removed.append(f"{CKPT_NAME} (no tracker)")
    return removed


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run_convert(sections: ConvertSections, run_dir: str | Path, model_dir: str | Path, *,
                source_files: dict[str, Any] | None = None, verify: bool | None = None,
                reuse: bool = True, timeout: float | None = None) -> dict[str, Any]:
    """Convert `model_dir` per the convert section into DIR/convert/torch_dist, verify, return the summary
    section."""

    job, spec = sections.job, sections.spec
    if sections.mode != "torch_dist":
        raise ConvertStageError(
            f"convert.mode={sections.mode!r}: only torch_dist is converted here (bridge mode loads HF weights directly)"
        )
    run_dir, model_dir = Path(run_dir), Path(model_dir)
    out = convert_dir(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    fp = fingerprint(sections, source_files if source_files is not None else source_manifest(model_dir))
    if reuse and (prev := completed(run_dir, fp)) is not None:
        log.info("convert: %s already holds this conversion (fingerprint %s); reusing it", checkpoint_dir(run_dir), fp[:12])
        return {**prev, "reused": True}
    removed = _clean_incomplete(out)
    if removed:
        log.warning("convert: removed the leftovers of an interrupted conversion: %s", ", ".join(removed))

    do_verify = sections.verify if verify is None else verify
    job.layout.check_model(spec)
    reader = HFCheckpoint(model_dir, text_config_key=sections.text_config_key)  # fails early on a bad index
    source_bytes = reader.total_bytes()
    work = out / "work"
    shutil.rmtree(work, ignore_errors=True)
    tmp = out / f"{CKPT_NAME}.tmp-{uuid.uuid4().hex[:8]}"
    check = verification(sections, model_dir, tmp, work) if do_verify else None
    reports = work / "reports"
    job_file = write_job_file(work / "job.json", model=spec, layout=job.layout, device=job.device,
                              model_dir=model_dir.resolve(), out_dir=tmp.resolve(), report_dir=reports.resolve(),
                              text_config_key=sections.text_config_key)
    phases = [JobPhase("convert", job_file, reports, "convert"), *([check.phase] if check else [])]
    done = run_weight_job(job, phases, timeout)  # the verification reloads what the conversion wrote
    converted, ranks = done[0].result, done[0].reports
    if not (tmp / TRACKER).is_file():
        raise ConvertStageError(f"{tmp}: the conversion job exited cleanly but wrote no {TRACKER}; not marking it complete")

    section: dict[str, Any] = {
        "nodes": job.nodes,
        "ranks_per_node": job.ranks_per_node,
        "layout": {"tp": job.layout.tp, "pp": job.layout.pp, "ep": job.layout.ep, "etp": job.layout.etp},
        "source_format": ranks[0]["source_format"]["format"],
        "source": ranks[0]["source_format"],
        "path": str(checkpoint_dir(run_dir)),
        "verified": False,
        "max_abs_diff": None,
        "logits_max_diff": None,
        "peak_rss_mb_per_rank": [r["peak_rss_mb"] for r in ranks],
        "bytes_read_per_rank": [r["bytes_read"] for r in ranks],
        "bytes": source_bytes,
        "output_bytes": _dir_bytes(tmp),
        "seconds": round(converted.seconds, 3),
        "bytes_per_second": round(source_bytes / converted.seconds, 1) if converted.seconds else None,
        "command": done[0].command,
        "launcher": converted.launcher,
        "placement": converted.placement,
    }
    if check:
        section.update(verification_section(check, done[1]))
    else:
        section["verify_skipped"] = "convert.verify=false"
        log.warning("convert: verification skipped by convert.verify=false; the checkpoint is NOT verified")

    final = checkpoint_dir(run_dir)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    atomic_write_json(out / MARKER, {"fingerprint": fp, "section": section})  # completion marker, last
    return section


def verification(sections: ConvertSections, model_dir: Path, ckpt: Path, work: Path) -> Verification:
    """The verification of the torch_dist checkpoint `ckpt` that the conversion writes in the convert section's
    layout: its ranks (`weightjobs.convert_verify`) reload it under another layout and compare it with the HF
    checkpoint `model_dir`; its job file written now, under WORK."""
    spec, job = sections.spec, sections.job
    logits = model_bytes(spec) <= SMALL_MODEL_BYTES
    layout = verify_layout(spec, job.layout, logits)
    reports = work / "reports"
    job_file = write_job_file(work / "verify.json", model=spec, layout=layout, device=job.device,
                              model_dir=model_dir.resolve(), out_dir=ckpt.resolve(), ckpt_dir=ckpt.resolve(),
                              report_dir=reports.resolve(), text_config_key=sections.text_config_key, logits=logits)
    phase = JobPhase("verify", job_file, reports, "verify", "verify_rank", world_size=layout.world_size)
    return Verification(phase, layout, logits, ckpt, model_dir, work)


def verify_conversion(sections: ConvertSections, model_dir: str | Path, ckpt: str | Path, work: str | Path,
                      timeout: float | None = None) -> dict[str, Any]:
    """Verify an existing torch_dist checkpoint `ckpt`, written in the convert section's layout, against the HF
    checkpoint `model_dir` on its own (the stage runs the same check as the conversion job's second phase); returns
    the verdict's fields for the convert section, or raises ConversionVerifyError listing every tensor that differs
    (the whole verdict is then in WORK/verify_failed.json)."""
    check = verification(sections, Path(model_dir), Path(ckpt), Path(work))
    (done,) = run_weight_job(sections.job, [check.phase], timeout)
    return verification_section(check, done)
