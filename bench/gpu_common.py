"""What the GPU benchmarks share (bench/gpu_rollout.py, bench/gpu_train.py): the CUDA check that makes them a
one-line no-op on a CPU machine, the Kimi-shaped model sizes, a transformers model of a size with random weights
and its fastest settings, and the GPU's peak bf16 FLOP/s for MFU.

The sizes keep Kimi-K2's shape (the kimi-k2-thinking preset's model: MLA with q_lora / kv_lora 512 / qk 128+64 /
v 128, sigmoid router with expert bias and scaling 2.827, one shared expert, first layer dense, YaRN rope) and
shrink width, depth, experts and vocabulary:

    0.5b: 8 layers, hidden 1024, 8 heads, 64 experts top-8 of FFN 320, vocab 32768: 0.55 B params (0.17 B active)
    2.5b: 12 layers, hidden 2048, 16 heads, 64 experts top-8 of FFN 512, vocab 32768: 2.56 B params (0.62 B active)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # types only: the benchmark imports the library after parsing its arguments
    from kimi_pipeline.recipes.models import ModelSpec

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SIZES: dict[str, dict] = {
    "0.5b": dict(num_layers=8, hidden_size=1024, ffn_hidden_size=2816, num_attention_heads=8, q_lora_rank=384,
                 kv_lora_rank=512, num_experts=64, moe_router_topk=8, moe_ffn_hidden_size=320, vocab_size=32768),
    "2.5b": dict(num_layers=12, hidden_size=2048, ffn_hidden_size=5632, num_attention_heads=16, q_lora_rank=768,
                 kv_lora_rank=512, num_experts=64, moe_router_topk=8, moe_ffn_hidden_size=512, vocab_size=32768),
}

# Dense bf16 tensor-core peak (no sparsity), by what torch reports as the device name. H100 SXM reports
# "NVIDIA H100 80GB HBM3"; the PCIe and NVL boards have lower peaks and are not listed (MFU prints n/a).
PEAK_BF16 = {"H200": 989e12, "H100 SXM": 989e12}


def needs_cuda_line(name: str) -> str:
    return f"{name}: needs CUDA (no GPU here); run `make gpu-check` on a GPU machine"


def cuda_device(name: str):
    """The GPU to benchmark on, or None after printing the needs-CUDA line (the caller exits 0)."""
    import torch

    if not torch.cuda.is_available():
        print(needs_cuda_line(name))
        return None
    from kimi_pipeline.model.device import resolve_device

    return resolve_device("cuda")


def kimi_spec(size: str):
    """A Kimi-shaped ModelSpec of `size` (see the module docstring), bf16."""
    from kimi_pipeline.recipes import load_recipe

    if size not in SIZES:
        raise SystemExit(f"unknown size {size!r}: one of {', '.join(SIZES)}")
    base = load_recipe("kimi-k2-thinking", check=False).model
    return base.model_copy(update={**SIZES[size], "params_dtype": "bfloat16"})


def param_counts(spec: ModelSpec):
    from kimi_pipeline.model.params import count_params

    return count_params(spec)


def hf_model(spec: ModelSpec, device, *, seed: int = 0, attn: str = "sdpa", experts: str = "grouped_mm"):
    """transformers' DeepseekV3ForCausalLM of `spec` with random weights (seeded), bf16 on `device`, with its
    fastest settings for DeepSeek-V3 on Hopper: SDPA attention and `experts_implementation="grouped_mm"`
    (transformers 5's kwarg, configuration_utils.py:493-494; its default for this model is the per-token
    weight-gathering `batched_mm`)."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    from kimi_pipeline.hf.config import hf_config_dict
    from kimi_pipeline.model.hf_model import deepseek_config

    cfg = deepseek_config({**hf_config_dict(spec), "attn_implementation": attn, "experts_implementation": experts})
    torch.manual_seed(seed)
    with torch.device(device):
        model = DeepseekV3ForCausalLM(cfg)
    model = model.to(torch.bfloat16)
    got = (model.config._attn_implementation, model.config._experts_implementation)
    if got != (attn, experts):
        raise SystemExit(f"transformers built attention/experts {got}, not ({attn}, {experts})")
    return model


def peak_bf16_flops(device_name: str) -> tuple[float | None, str]:
    """(peak dense bf16 FLOP/s, which board) from the device name; (None, reason) when not known."""
    if "H200" in device_name:
        return PEAK_BF16["H200"], "H200"
    if "H100" in device_name and not any(k in device_name for k in ("PCIe", "NVL")):
        return PEAK_BF16["H100 SXM"], "H100 SXM"
    return None, f"peak bf16 FLOP/s of {device_name!r} not known"


class GraphCounter:
    """Counts CUDA graph captures and replays (torch.cuda.CUDAGraph.capture_begin / replay, torch/cuda/graphs.py)
    while active: whether the code measured used CUDA graphs, whatever API it reached them through."""

    def __init__(self) -> None:
        self.captures = self.replays = 0
        self._saved: list = []

    def __enter__(self) -> GraphCounter:
        import torch

        cls = torch.cuda.CUDAGraph
        for attr, field in (("capture_begin", "captures"), ("replay", "replays")):
            orig = getattr(cls, attr)

            def counted(graph, *args, _orig=orig, _field=field, **kwargs):
                setattr(self, _field, getattr(self, _field) + 1)
                return _orig(graph, *args, **kwargs)

            self._saved.append((cls, attr, orig))
            setattr(cls, attr, counted)
        return self

    def __exit__(self, *exc) -> None:
        for cls, attr, orig in self._saved:
            setattr(cls, attr, orig)
        self._saved.clear()

    def describe(self) -> str:
        if self.captures or self.replays:
            return f"used ({self.captures} captures, {self.replays} replays)"
        return "not used (0 captures, 0 replays: every decode step ran eagerly)"
