"""The one place that decides which device a process computes on.

A process asks once, with what the recipe says (`cluster.device`: "cuda" or "cpu") and which of the GPUs it
can see is its own; everything below (process groups, the megatron compatibility patches, every model built,
every batch) receives the answer as a parameter. Nothing else in `kimi_pipeline` asks torch whether CUDA
exists, so the CPU tests run the program a GPU runs, with only the device value changed.

Which visible GPU is "its own":
- a Ray actor whose GPUs Ray made visible (`CUDA_VISIBLE_DEVICES` set to its share): the first one, index 0;
- a colocated actor that chooses its own GPU (`RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`, all GPUs of the
  node visible): the local GPU its placement names (`rl/actor_layout.py`);
- a torchrun rank of a weight job: `KIMI_LOCAL_DEVICE_BASE + LOCAL_RANK` (several simulated "nodes" on one
  host take consecutive GPUs).
"""

from __future__ import annotations

import os

import torch

from kimi_pipeline.errors import PermanentError

# Set by a Ray actor that picks its own GPU among all of its node's (colocated trainers and engines).
NOSET_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
# Set by a weight-job launcher that runs the job's ranks on the CPU (more ranks than GPUs on one host).
JOB_DEVICE_ENV = "KIMI_JOB_DEVICE"
LOCAL_DEVICE_BASE_ENV = "KIMI_LOCAL_DEVICE_BASE"


class DeviceError(PermanentError):
    """The recipe asks for a device this process cannot use."""


def cuda_device_count() -> int:
    """GPUs this process can see (0 without a CUDA build of torch or without a driver)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(requested: str, local_index: int = 0) -> torch.device:
    """`torch.device` for `cluster.device` = `requested`; on CUDA the visible GPU `local_index` (made current).

    Raises DeviceError naming the recipe field when CUDA is asked for and cannot be had: never a silent CPU run.
    """
    if requested == "cpu":
        return torch.device("cpu")
    if requested != "cuda":
        raise DeviceError(f"cluster.device={requested!r}: expected 'cuda' or 'cpu'")
    count = cuda_device_count()
    if count == 0:
        raise DeviceError(
            f"cluster.device=cuda but this process sees no GPU (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): install a CUDA "
            "torch (make install TORCH_SPEC=... EXTRAS=dev,gpu) or run with --set cluster.device=cpu")
    if not 0 <= local_index < count:
        raise DeviceError(f"this process would need visible GPU {local_index} but sees {count} "
                          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): one rank per GPU")
    torch.cuda.set_device(local_index)
    return torch.device("cuda", local_index)


def actor_gpu_index(local_gpu: int) -> int:
    """The visible-GPU index of a Ray actor whose placement put it on node-local GPU `local_gpu`: that
    GPU when the actor chooses its own (colocated), else 0 — Ray made exactly the actor's GPUs visible."""
    return local_gpu if os.environ.get(NOSET_VISIBLE_DEVICES) == "1" else 0


def job_device(requested: str) -> torch.device:
    """Device of one torchrun rank of a weight job (conversion, verification, export): the recipe's, unless
    the launcher moved the job to the CPU; GPU = KIMI_LOCAL_DEVICE_BASE + LOCAL_RANK."""
    requested = os.environ.get(JOB_DEVICE_ENV) or requested
    index = int(os.environ.get(LOCAL_DEVICE_BASE_ENV, "0")) + int(os.environ.get("LOCAL_RANK", "0"))
    return resolve_device(requested, index)  # the index only matters for "cuda"
