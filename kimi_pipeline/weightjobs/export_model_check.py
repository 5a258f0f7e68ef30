"""The INT4 export's model-level check against the checkpoint it came from, in a child process
(`python -m kimi_pipeline.weightjobs.export_model_check JOB.json`): the export reloaded with transformers +
compressed-tensors, its logits compared with the checkpoint's own one-rank megatron forward (fake-quant experts
when the recipe trains with INT4 QAT), and generation. A child, so megatron's process groups and gloo rendezvous
stay out of the flow process; the export stage runs it when the model fits in this host's memory
(`model_check_fits`)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import torch

from kimi_pipeline.errors import is_permanent
from kimi_pipeline.model.device import resolve_device
from kimi_pipeline.model.megatron_model import causal_forward, model_device
from kimi_pipeline.model.params import count_params
from kimi_pipeline.model.qat import enable_int4_qat
from kimi_pipeline.recipes.models import ModelSpec, QuantSpec
from kimi_pipeline.util.files import atomic_write_json
from kimi_pipeline.util.lifetime import bind_to_parent_if_asked, bound_env
from kimi_pipeline.util.secret_env import without_secrets
from kimi_pipeline.weight_sync.policy_tensors import checkpoint_model, policy_tensors
from kimi_pipeline.weightjobs.export_verify import ExportInputError, check_model_into

JOB_FILE, RESULT_FILE, ERROR_FILE = "model_check.json", "model_check.result.json", "model_check.error.json"
CHILD_ENTRY = "kimi_pipeline.weightjobs.export_model_check"


def run_model_check(spec: ModelSpec, quant: QuantSpec, device: str, export: Path, checkpoint_dir: str | Path,
                    step: int, work: Path, timeout_s: float | None) -> dict[str, Any]:
    """`check_checkpoint_model` in a child, its job and result files under `work`; returns its fields (with
    `problems` when a gate failed), or why it was skipped (`model_check_fits`). The child is sent the sections it
    reads, and dies with this process."""
    fits, reason = model_check_fits(spec)
    if not fits:
        return {"model_check": f"skipped: {reason}"}
    work.mkdir(parents=True, exist_ok=True)
    for stale in (RESULT_FILE, ERROR_FILE):
        (work / stale).unlink(missing_ok=True)
    job = {"checkpoint_dir": str(checkpoint_dir), "step": step, "export": str(export),
           "model": spec.model_dump(mode="json"), "quant": quant.model_dump(mode="json"), "device": device}
    atomic_write_json(work / JOB_FILE, job)
    env = {**without_secrets(), "TORCHDYNAMO_DISABLE": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        env.pop(var, None)  # the child is its own one-rank world
    proc = subprocess.run([sys.executable, "-m", CHILD_ENTRY, str(work / JOB_FILE)], env=bound_env(env),
                          timeout=timeout_s, capture_output=True, text=True)  # the child binds itself to us
    if proc.returncode != 0:
        err = json.loads((work / ERROR_FILE).read_text()) if (work / ERROR_FILE).is_file() else {}
        message = err.get("message") or f"export model check exited {proc.returncode}: {proc.stderr[-2000:]}"
        if err.get("permanent"):
            raise ExportInputError(message)
        raise RuntimeError(message)
    return json.loads((work / RESULT_FILE).read_text())


def model_check_fits(spec: ModelSpec) -> tuple[bool, str | None]:
    """Reloading on CPU holds three fp32 copies of the model (export + two references)."""

    need = count_params(spec).total * 4 * 3 * 3 // 2
    avail = psutil.virtual_memory().available
    if need > avail:
        return False, f"needs ~{need / 2**30:.1f} GiB of RAM for a CPU reload, {avail / 2**30:.1f} GiB available"
    return True, None


def check_checkpoint_model(spec: ModelSpec, quant: QuantSpec, device: str, out: Path, checkpoint_dir: str | Path,
                           step: int) -> dict[str, Any]:
    """In THIS process (the child): the export vs the checkpoint's one-rank megatron forward on `device`
    (fake-quant experts when the policy trains with QAT); returns the model-check section fields and problems."""

    with checkpoint_model(spec, checkpoint_dir, step, device=resolve_device(device)) as (model, layout, _):
        if quant.int4_qat:
            enable_int4_qat(model, quant.group_size)
        model.eval()

        @torch.no_grad()
        def trainer_logits(ids: torch.Tensor) -> torch.Tensor:  # host tokens in, host logits out
            return causal_forward(model, ids.to(model_device(model))).cpu()

        section: dict[str, Any] = {}
        check_model_into(section, spec, quant, out, policy_tensors(model, spec, layout), trainer_logits)
        return section


def main(argv: list[str] | None = None) -> None:
    """Child entry point: `python -m kimi_pipeline.weightjobs.export_model_check JOB.json`."""

    bind_to_parent_if_asked()
    job_path = Path((argv or sys.argv[1:])[0])
    job = json.loads(job_path.read_text())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        result = check_checkpoint_model(ModelSpec.model_validate(job["model"]), QuantSpec.model_validate(job["quant"]),
                                        job["device"], Path(job["export"]), job["checkpoint_dir"], job["step"])
        atomic_write_json(job_path.parent / RESULT_FILE, result)
    except BaseException as e:
        atomic_write_json(job_path.parent / ERROR_FILE, {
            "type": type(e).__name__, "message": str(e), "permanent": is_permanent(e),
        })
        raise


if __name__ == "__main__":
    main()
