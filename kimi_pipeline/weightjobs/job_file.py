"""What a weight job's rank reads and reports besides its own work: the job file (everything a rank needs, on the
shared filesystem), dtypes by recipe name, and its memory figures."""

from __future__ import annotations

import dataclasses
import resource
from pathlib import Path
from typing import Any

import psutil
import torch

from kimi_pipeline.recipes.layout import Layout
from kimi_pipeline.recipes.models import ModelSpec
from kimi_pipeline.util.files import atomic_write_json


def dtype_of(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def write_job_file(path: str | Path, *, model: ModelSpec, layout: Layout, device: str, model_dir: str | Path,
                   out_dir: str | Path, report_dir: str | Path, text_config_key: str | None = None,
                   **extra: Any) -> Path:
    """Everything a rank needs, in one JSON file on the shared filesystem (the command line stays short).
    `device` is the recipe's `cluster.device`; each rank resolves it with `model.device.job_device`."""
    payload = {
        "model": model.model_dump(mode="json"),
        "layout": dataclasses.asdict(layout),
        "device": device,
        "model_dir": str(model_dir),
        "out_dir": str(out_dir),
        "report_dir": str(report_dir),
        "text_config_key": text_config_key,
        **extra,
    }
    return atomic_write_json(Path(path), payload)


def peak_rss_mb() -> float:
    """Peak resident set size of this process (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def current_rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20
