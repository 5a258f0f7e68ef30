"""Stage `export`: a trained policy -> INT4 compressed-tensors HF directory, verified.

Output: `<run_dir>/export/<name>/` (config.json with Kimi-K2-Thinking's quantization_config,
sharded safetensors + index, tokenizer files) and `<run_dir>/export/export.json` (the summary
section, written last: its presence marks a finished export).

`run_export` takes any source of HF-named tensors (+ optionally the trainer's logits function);
`stage_export` is the pipeline stage: it exports a megatron torch_dist training checkpoint (the
tracker's latest, or a chosen step) in a child process — megatron's process groups and the gloo
rendezvous stay out of the flow process — where the checkpoint is loaded into a one-rank megatron
model with INT4 QAT on (when the recipe trains with it), reverse-converted with
`convert.names.export_hf_tensors`, and that fake-quant megatron forward is the logits reference.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from kimi_pipeline.errors import PermanentError
from kimi_pipeline.hub.download import model_root
from kimi_pipeline.plan.params import count_params
from kimi_pipeline.quant.export import export_int4
from kimi_pipeline.quant.verify import (
    PARITY_TOL,
    PARITY_TOL_BY_DTYPE,
    ExportVerificationError,
    LogitsFn,
    check_model,
    check_tensors,
    model_check_problems,
)
from kimi_pipeline.recipes import Recipe
from kimi_pipeline.util.files import atomic_write_json, sha256_files, sha256_json

log = logging.getLogger(__name__)

TensorSource = Callable[[], Iterable[tuple[str, torch.Tensor]]]
MIN_SHARD, MAX_SHARD = 1 << 20, 5 << 30
SECTION_FILE = "export.json"
ERROR_FILE = "export-error.json"


class ExportInputError(PermanentError):
    pass


def export_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "export"


def shard_bytes(recipe: Recipe) -> int:
    """~4 shards for small models (so sharding is exercised), 5 GiB shards for real ones."""
    return int(min(MAX_SHARD, max(MIN_SHARD, count_params(recipe.model).total * 2 // 4)))


def model_check_fits(recipe: Recipe) -> tuple[bool, str | None]:
    """Reloading on CPU holds three fp32 copies of the model (export + two references)."""
    import psutil

    need = count_params(recipe.model).total * 4 * 3 * 3 // 2
    avail = psutil.virtual_memory().available
    if need > avail:
        return False, f"needs ~{need / 2**30:.1f} GiB of RAM for a CPU reload, {avail / 2**30:.1f} GiB available"
    return True, None


def run_export(
    recipe: Recipe,
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
    """Export + verify; returns the `export` summary section (raises ExportVerificationError with it).

    hf_tensors_source: zero-argument callable returning the trained policy's HF-named tensors
      (called once to write and once per check); model_dir: config.json + tokenizer of the base model;
    reference_logits: the trainer's fake-quant forward (ids [1, T] -> logits [1, T, V]), if available;
    checkpoint: what was exported (recorded).
    """
    t0 = time.monotonic()
    run_dir, model_dir = Path(run_dir), Path(model_dir)
    q = recipe.quant
    if q.export_format != "int4":
        return {"skipped": f"quant.export_format={q.export_format!r}: only the INT4 export is written here"}
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise ExportInputError(f"{cfg_path}: not found; model_dir must hold the base model's config.json + tokenizer")
    config = json.loads(cfg_path.read_text())
    parity_tol = PARITY_TOL_BY_DTYPE.get(recipe.model.params_dtype, PARITY_TOL) if parity_tol is None else parity_tol
    out = export_dir(run_dir) / name
    (export_dir(run_dir) / SECTION_FILE).unlink(missing_ok=True)
    info = export_int4(hf_tensors_source(), config, model_dir, out, q.group_size, max_shard_bytes=shard_bytes(recipe))
    log.info("export: wrote %s (%d packed experts, %d bytes)", out, info.num_quantized, info.disk_bytes)
    tensors = check_tensors(out, hf_tensors_source(), q.group_size)
    section: dict[str, Any] = {
        "path": str(out),
        "format": "compressed-tensors pack-quantized int4",
        "group_size": q.group_size,
        "checkpoint": checkpoint,
        **{k: v for k, v in info.as_dict().items() if k != "path"},
        "compression": round(info.bf16_bytes / info.int4_bytes, 3),
        "dequant_exact": tensors.dequant_exact,
        "others_exact": tensors.others_exact,
        "qat": q.int4_qat,
    }
    problems = [f"{n}: stored tensor differs from the trainer's" for n in tensors.mismatches[:5]]
    fits, reason = model_check_fits(recipe)
    if verify_model is None:
        verify_model = fits
    if verify_model:
        result = check_model(out, hf_tensors_source(), q.group_size, reference_logits=reference_logits,
                             parity_tol=parity_tol)
        section.update(result)
        gate = model_check_problems(result, parity_tol)
        if not q.int4_qat:
            # Trained without fake-quant: INT4 is post-training quantization here, so the export is
            # *expected* to differ from the trainer's forward; only the decode-exactness gates apply.
            gate = [p for p in gate if not p.startswith(("export vs trainer", "HF model of the trainer"))]
            section["note"] = "quant.int4_qat is off: logits_max_diff is post-training quantization error"
        problems += gate
    else:
        section["model_check"] = f"skipped: {reason or 'disabled'}"
    section["seconds"] = round(time.monotonic() - t0, 2)
    if problems:
        section["problems"] = problems
        raise ExportVerificationError(f"INT4 export {out} failed verification: " + "; ".join(problems), section)
    atomic_write_json(export_dir(run_dir) / SECTION_FILE, section)
    return section


# --------------------------------------------------------------------------- from a training checkpoint


def resolve_checkpoint(checkpoint_dir: str | Path, step: int | None = None) -> tuple[Path, int]:
    """(iter_XXXXXXX dir, step) of a megatron checkpoint: the tracker's latest, or `step`."""
    from kimi_pipeline.model.megatron_train import CheckpointError, resolve_iteration

    try:
        return resolve_iteration(checkpoint_dir, step)
    except CheckpointError as e:
        raise ExportInputError(f"{e}; nothing to export (pick another --step or train first)") from None


def checkpoint_content_hash(checkpoint_dir: str | Path, step: int | None = None) -> str:
    """sha256 over every file of the checkpoint iteration (relative path + file sha256): the export's cache key."""
    path, step = resolve_checkpoint(checkpoint_dir, step)
    files = sorted(p for p in path.rglob("*") if p.is_file())
    digests = sha256_files(files)
    return sha256_json({"step": step, "files": {str(p.relative_to(path)): d for p, d in zip(files, digests)}})


def export_checkpoint(recipe: Recipe, run_dir: str | Path, checkpoint_dir: str | Path, model_dir: str | Path,
                      step: int | None = None) -> dict[str, Any]:
    """In THIS process (the child): load the checkpoint into a one-rank megatron model and run_export it."""
    from kimi_pipeline.convert.names import export_hf_tensors
    from kimi_pipeline.model.megatron_model import build_model, causal_forward
    from kimi_pipeline.model.megatron_train import load_model_only
    from kimi_pipeline.model.parallel import Layout, destroy, init_distributed
    from kimi_pipeline.quant.qat import enable_int4_qat

    path, step = resolve_checkpoint(checkpoint_dir, step)
    layout = Layout()
    init_distributed(layout)
    try:
        model = build_model(recipe.model, layout, perform_initialization=False)
        load_model_only(checkpoint_dir, model, step)
        if recipe.quant.int4_qat:
            enable_int4_qat(model, recipe.quant.group_size)
        model.eval()

        def source():
            return export_hf_tensors(model, recipe.model, layout)

        @torch.no_grad()
        def trainer_logits(ids: torch.Tensor) -> torch.Tensor:
            return causal_forward(model, ids)

        return run_export(recipe, run_dir, source, model_dir=model_dir, reference_logits=trainer_logits,
                          checkpoint=str(path))
    finally:
        destroy()


def stage_export(recipe: Recipe, run_dir: str | Path, checkpoint_dir: str | Path, *, step: int | None = None,
                 model_dir: str | Path | None = None, timeout_s: float | None = None) -> dict[str, Any]:
    """The pipeline stage: export checkpoint `step` (default: latest) of `checkpoint_dir` in a child process.

    Records `stages.export` and the `export` section in summary.json (also on a failed verification).
    """
    from kimi_pipeline.recipes import recipe_to_yaml
    from kimi_pipeline.report.summary import RunSummary

    run_dir = Path(run_dir)
    summary = RunSummary(run_dir, recipe.name)
    with summary.stage("export"):
        if recipe.quant.export_format != "int4":
            section = {"skipped": f"quant.export_format={recipe.quant.export_format!r}"}
            summary.set_section("export", section)
            return section
        model_dir = Path(model_dir) if model_dir else model_root(run_dir)
        resolve_checkpoint(checkpoint_dir, step)  # fail here, clearly, before spawning anything
        out = export_dir(run_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / ERROR_FILE).unlink(missing_ok=True)
        (out / "recipe.yaml").write_text(recipe_to_yaml(recipe))
        job = {"run_dir": str(run_dir), "checkpoint_dir": str(checkpoint_dir), "step": step,
               "model_dir": str(model_dir), "recipe": str(out / "recipe.yaml")}
        atomic_write_json(out / "job.json", job)
        env = {**os.environ, "TORCHDYNAMO_DISABLE": "1"}
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
            env.pop(var, None)  # the child is its own one-rank world
        proc = subprocess.run([sys.executable, "-m", "kimi_pipeline.quant.stage", str(out / "job.json")],
                              env=env, timeout=timeout_s, capture_output=True, text=True)
        if proc.returncode != 0:
            err = json.loads((out / ERROR_FILE).read_text()) if (out / ERROR_FILE).is_file() else {}
            if err.get("section"):
                summary.set_section("export", err["section"])
            message = err.get("message") or f"export child exited {proc.returncode}: {proc.stderr[-2000:]}"
            if err.get("permanent"):
                raise ExportVerificationError(message, err.get("section"))
            raise RuntimeError(message)
        section = json.loads((out / SECTION_FILE).read_text())
        summary.set_section("export", section)
    return section


def main(argv: list[str] | None = None) -> None:
    """Child entry point: `python -m kimi_pipeline.quant.stage JOB.json`."""
    from kimi_pipeline.errors import is_permanent
    from kimi_pipeline.recipes import load_recipe

    job_path = Path((argv or sys.argv[1:])[0])
    job = json.loads(job_path.read_text())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        recipe = load_recipe(job["recipe"], env={})
        export_checkpoint(recipe, job["run_dir"], job["checkpoint_dir"], job["model_dir"], job["step"])
    except BaseException as e:
        atomic_write_json(job_path.parent / ERROR_FILE, {
            "type": type(e).__name__, "message": str(e), "permanent": is_permanent(e),
            "section": getattr(e, "section", None),
        })
        raise


if __name__ == "__main__":
    main()
