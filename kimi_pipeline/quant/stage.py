"""Stage `export`: trained policy (HF-named tensors) -> INT4 compressed-tensors HF directory, verified.

Output: `<run_dir>/export/<name>/` (config.json with Kimi-K2-Thinking's quantization_config,
sharded safetensors + index, tokenizer files) and `<run_dir>/export/export.json` (the summary
section, written last: its presence marks a finished export). The caller records the section in
summary.json under `export`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from kimi_pipeline.errors import PermanentError
from kimi_pipeline.plan.params import count_params
from kimi_pipeline.quant.export import export_int4
from kimi_pipeline.quant.verify import (
    PARITY_TOL,
    ExportVerificationError,
    LogitsFn,
    check_model,
    check_tensors,
    model_check_problems,
)
from kimi_pipeline.recipes import Recipe
from kimi_pipeline.util.files import atomic_write_json

log = logging.getLogger(__name__)

TensorSource = Callable[[], Iterable[tuple[str, torch.Tensor]]]
MIN_SHARD, MAX_SHARD = 1 << 20, 5 << 30
SECTION_FILE = "export.json"


class ExportInputError(PermanentError):
    pass


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
    parity_tol: float = PARITY_TOL,
    verify_model: bool | None = None,
) -> dict[str, Any]:
    """Export + verify; returns the `export` summary section (raises ExportVerificationError with it).

    hf_tensors_source: zero-argument callable returning the trained policy's HF-named tensors
      (called once to write and once per check); model_dir: config.json + tokenizer of the base model;
    reference_logits: the trainer's fake-quant forward (ids [1, T] -> logits [1, T, V]), if available;
    checkpoint: what was exported (recorded, e.g. the trainer checkpoint path + hash).
    """
    t0 = time.monotonic()
    run_dir, model_dir = Path(run_dir), Path(model_dir)
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise ExportInputError(f"{cfg_path}: not found; model_dir must hold the base model's config.json + tokenizer")
    config = json.loads(cfg_path.read_text())
    q = recipe.quant
    if q.export_format != "int4":
        return {"skipped": f"quant.export_format={q.export_format!r}: only the INT4 export is written here"}
    out = run_dir / "export" / name
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
            gate = [p for p in gate if not p.startswith("export vs trainer")]
            section["note"] = "quant.int4_qat is off: logits_max_diff is post-training quantization error"
        problems += gate
    else:
        section["model_check"] = f"skipped: {reason or 'disabled'}"
    section["seconds"] = round(time.monotonic() - t0, 2)
    if problems:
        section["problems"] = problems
        raise ExportVerificationError(f"INT4 export {out} failed verification: " + "; ".join(problems), section)
    atomic_write_json(run_dir / "export" / SECTION_FILE, section)
    return section
