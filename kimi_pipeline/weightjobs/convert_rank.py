"""One rank of the HF -> Megatron torch_dist conversion (`python -m kimi_pipeline.weightjobs.rank convert --job JOB.json`).

Launched by `weightjobs.launch.launch_local` (N torchrun agents) or by the same torchrun command on every node of
a cluster. Each rank builds only its pipeline stage's model slice, reads only the HF tensors that slice
owns (its layers, its experts) through the memory-mapped reader, dequantizing on the fly, saves its
shards of the torch_dist checkpoint (the tracker is written last, by rank 0, after every shard), and
records what it read and its peak RSS in `rank_<r>.json`.

The rank runs under the thin entry `weightjobs.rank`, so the helper process megatron's checkpoint writer spawns (it
re-imports the rank's `__main__`) does not load this module's model code.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from kimi_pipeline.errors import PermanentError
from kimi_pipeline.hf.reader import HFCheckpoint
from kimi_pipeline.model.device import job_device
from kimi_pipeline.model.hf_bridge import load_hf_tensors_into_model
from kimi_pipeline.model.megatron_model import build_model
from kimi_pipeline.model.megatron_train import save_model_only
from kimi_pipeline.model.parallel import destroy, init_distributed, ranks
from kimi_pipeline.recipes.layout import Layout
from kimi_pipeline.recipes.models import ModelSpec
from kimi_pipeline.util.files import atomic_write_json
from kimi_pipeline.weightjobs.job_file import current_rss_mb, peak_rss_mb

T_IMPORT = time.time()  # wall clock when this rank's interpreter reached the job (startup cost)


class UnloadedParameterError(PermanentError):
    """A megatron parameter received no value from the HF checkpoint (mapping gap or NaN in the source)."""


def poison_parameters(model: torch.nn.Module) -> None:
    """NaN-fill every floating parameter, so one the loader never writes is caught, not saved as garbage."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.fill_(math.nan)


def check_loaded(model: torch.nn.Module, model_dir: str) -> None:
    bad = [n for n, p in model.named_parameters() if p.is_floating_point() and torch.isnan(p).any()]
    if bad:
        raise UnloadedParameterError(
            f"{len(bad)} megatron parameters were not filled from {model_dir} (or the source holds NaN): "
            + ", ".join(bad[:8])
        )


def convert_rank(job: dict[str, Any]) -> dict[str, Any]:
    """Build this rank's slice, fill it from the HF checkpoint, save torch_dist; return the rank report."""
    t0 = time.monotonic()
    startup = time.time() - float(os.environ.get("KIMI_LAUNCH_TIME", T_IMPORT))
    spec = ModelSpec.model_validate(job["model"])
    layout = Layout(**job["layout"])
    device = job_device(job["device"])
    init_distributed(layout, device=device)
    coords = ranks()
    t_init = time.monotonic()
    # stored dtype (dequantized tensors: the checkpoint's torch_dtype); the loader casts to each parameter's
    # dtype, so the fp32 expert bias stays fp32 in a bf16 model
    reader = HFCheckpoint(job["model_dir"], text_config_key=job.get("text_config_key"))
    # weights come from the checkpoint: skipping megatron's random init saves minutes on big models
    model = build_model(spec, layout, device=device, perform_initialization=False)
    poison_parameters(model)
    rss_before_load = current_rss_mb()
    t_build = time.monotonic()
    load_hf_tensors_into_model(model, reader.get, spec, layout)
    check_loaded(model, job["model_dir"])
    t_load = time.monotonic()
    save_model_only(job["out_dir"], model, extra={"converted_from": job["model_dir"],
                                                  "source_format": reader.format.describe()})
    t_save = time.monotonic()
    params = sum(p.numel() for p in model.parameters())
    del model
    destroy()
    t_destroy = time.monotonic()
    report = {
        **coords,
        "source_format": reader.format.describe(),
        "prefix": reader.prefix,
        **reader.stats(),
        "local_params": params,
        "rss_before_load_mb": round(rss_before_load, 1),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "seconds": {"startup": round(startup, 3), "init": round(t_init - t0, 3), "build": round(t_build - t_init, 3),
                    "load": round(t_load - t_build, 3), "save": round(t_save - t_load, 3),
                    "teardown": round(t_destroy - t_save, 3), "total": round(t_destroy - t0, 3)},
    }
    atomic_write_json(Path(job["report_dir"]) / f"rank_{coords['rank']}.json", report)
    return report
