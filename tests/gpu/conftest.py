"""GPU tests: the CPU suite's claims on one CUDA device, the device passed explicitly everywhere.

Every test here carries the `gpu` marker (collection fails naming any that does not) and is skipped, with
the reason, where torch sees no CUDA device, so CI lists them as skipped. On a GPU machine run them with
`make gpu-check` (which also runs the GPU benchmarks and writes gpu-check.json / gpu-check.md) or
`.venv/bin/python -m pytest -m gpu tests/gpu`. Only tests ask torch whether CUDA exists; the project code
is handed a device (`kimi_pipeline.model.device.resolve_device`).

Collection stays cheap: test modules import torch and the project inside their tests and fixtures.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

GPU_TESTS = Path(__file__).resolve().parent
SKIP_REASON = "needs CUDA: run `make gpu-check` on a GPU machine"

# The resume test compares a training step bit for bit. cuBLAS picks its workspace per handle, at the first
# cuBLAS call of the process; ":4096:8" makes its results independent of stream scheduling (what torch's
# reproducibility notes ask for with deterministic algorithms). Set before any test touches CUDA.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [item for item in items if GPU_TESTS in Path(str(item.path)).resolve().parents]
    if not mine:
        return
    unmarked = [item.nodeid for item in mine if item.get_closest_marker("gpu") is None]
    if unmarked:
        raise pytest.UsageError("tests under tests/gpu must be marked @pytest.mark.gpu: " + ", ".join(unmarked))
    if not cuda_available():
        skip = pytest.mark.skip(reason=SKIP_REASON)
        for item in mine:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cuda():
    """This process's GPU, as the pipeline resolves it from `cluster.device=cuda`."""
    from kimi_pipeline.model.device import resolve_device

    return resolve_device("cuda")


@pytest.fixture(scope="module")
def one_gpu_rank(cuda):
    """A one-rank megatron world (NCCL) on the GPU, for the tests of one module; torn down after them."""
    from kimi_pipeline.model.parallel import destroy, init_distributed
    from kimi_pipeline.recipes.layout import Layout

    layout = Layout()
    init_distributed(layout, device=cuda, seed=11)
    yield layout
    destroy()

