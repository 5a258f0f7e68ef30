"""What the GPU tests (tests/gpu) share: device checks, the deterministic-kernel context, and the CPU tests'
helpers with the device as a parameter (`engine_samples` of support.common, the fixed batch and NLL loss of
tests/integration/test_megatron_model.py)."""

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


def fixed_batch(spec, device, n: int = 8, s: int = 24):
    """test_megatron_model's fixed batch (same seed), on `device`: tokens and next-token targets [n, s]."""
    import torch

    tokens = torch.randint(0, spec.vocab_size, (n, s), generator=torch.Generator().manual_seed(5))
    return tokens.to(device), torch.roll(tokens, -1, dims=1).to(device)


def nll(logits, batch):
    """test_megatron_model's token NLL in megatron's per-token-loss contract (loss sum, token count, metrics)."""
    from kimi_pipeline.model.megatron_train import logprobs_from_logits

    lp, _ = logprobs_from_logits(logits, batch["targets"])
    return -lp.sum(), lp.numel(), {"loss": (-lp.mean()).detach()}


def tiny_hf_tensors() -> dict:
    """The shipped tiny checkpoint's HF-named tensors (CPU), for load_hf_tensors_into_model."""
    from kimi_pipeline.convert.hf_reader import iter_stored_tensors

    return dict(iter_stored_tensors(TINY_MODEL))


def engine_samples(recipe, device, n_prompts: int = 4, n: int = 2):
    """support.common.engine_samples with the engine on `device`: samples of the tiny prompts from the embedded
    engine in-process, with their routed experts."""
    from kimi_pipeline.model.tokenizer import load_tokenizer
    from kimi_pipeline.rl.engine.model import EngineModel
    from kimi_pipeline.rl.engine.sampler import RolloutEngine, SamplingParams
    from kimi_pipeline.rl.prompts import load_prompts
    from kimi_pipeline.rl.samples import Sample

    prompts = load_prompts(TINY / "dapo-math-tiny.jsonl", load_tokenizer(TINY_MODEL))[:n_prompts]
    engine = RolloutEngine(EngineModel.from_pretrained(TINY_MODEL, device=device), seed=3)
    out = engine.generate([p.ids for p in prompts for _ in range(n)], 1,
                          SamplingParams(temperature=1.0, max_new_tokens=recipe.rollout.max_response_len, seed=3),
                          return_routed_experts=True)
    return [Sample(prompt_ids=list(c.prompt_ids), response_ids=list(c.output_ids), rollout_logprobs=list(c.logprobs),
                   routed_experts=c.routed_experts) for c in out]
