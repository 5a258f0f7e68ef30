"""What the GPU tests (tests/gpu) share beyond support.common (whose `engine_samples`, `fixed_batch` and `nll`
take the device as a parameter): device checks and the deterministic-kernel context."""

from __future__ import annotations

import contextlib
import os

from support.common import TINY

TINY_MODEL = TINY / "model"


def off_device(module, device) -> list[str]:
    """Parameters and buffers of `module` that are NOT on `device` (empty: all are), named for the failure."""
    wrong = [f"parameter {n} on {p.device}" for n, p in module.named_parameters() if p.device != device]
    wrong += [f"buffer {n} on {b.device}" for n, b in module.named_buffers() if b is not None and b.device != device]
    return wrong


@contextlib.contextmanager
def deterministic_kernels():
    """Bit-reproducible CUDA kernels for a comparison that must be exact (a resumed step vs the original one).

    - torch.use_deterministic_algorithms: scatter_add_ / index_add on CUDA (megatron's MoE unpermute and
      token dispatch, the embedding backward) take their deterministic implementations (torch/__init__.py,
      use_deterministic_algorithms docstring, "will act deterministically"); warn_only so an op without one
      warns instead of failing the test for a reason other than the resume.
    - SDPA pinned to its math backend: the memory-efficient backward that MLA's unequal q/k and v head dims
      select (flash needs equal head dims) is non-deterministic unless deterministic mode is strict.
    - NVTE_ALLOW_NONDETERMINISTIC_ALGO=0: Transformer Engine's attention picks deterministic kernels when the
      TE spec is in use (read when its attention modules are built, so enter this before building models).
    - CUBLAS_WORKSPACE_CONFIG is set by tests/gpu/conftest.py before the first cuBLAS call of the process.
    """
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    nvte = os.environ.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO")
    os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        if nvte is None:
            os.environ.pop("NVTE_ALLOW_NONDETERMINISTIC_ALGO", None)
        else:
            os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = nvte


def tiny_hf_tensors() -> dict:
    """The shipped tiny checkpoint's HF-named tensors (CPU), for load_hf_tensors_into_model."""
    from kimi_pipeline.hf.reader import iter_stored_tensors

    return dict(iter_stored_tensors(TINY_MODEL))
