"""GPU and node figures the plan measures a layout against.

Memory is what `nvidia-smi` reports as total (MiB / 1024 = GiB; every `_gb` figure of the plan is GiB,
as torch and SGLang count it). Compute is the dense BF16 tensor-core peak from the vendor data sheets
(sparsity excluded). Decode throughput and host RAM are assumptions, printed with every plan.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class GPU:
    key: str
    name: str
    mem_gb: float  # GiB, nvidia-smi total
    bf16_tflops: float  # dense peak
    decode_tok_s_per_gpu: float  # assumed aggregate decode tokens/s per GPU of a large-MoE engine
    host_ram_gb: float  # assumed RAM per node (DGX-class), GiB

    def as_dict(self) -> dict:
        return asdict(self)


GPUS: dict[str, GPU] = {
    # H100 SXM: 81559 MiB, 989 TFLOPS dense BF16; DGX H100: 2 TiB RAM.
    "h100": GPU("h100", "NVIDIA H100 SXM 80GB", 81559 / 1024, 989.0, 800.0, 2048.0),
    # H200 SXM: same compute as H100, 143771 MiB (141 GB) of faster HBM3e; DGX H200: 2 TiB RAM.
    "h200": GPU("h200", "NVIDIA H200 SXM 141GB", 143771 / 1024, 989.0, 1000.0, 2048.0),
    # A100 SXM 80GB: 81920 MiB, 312 TFLOPS dense BF16; DGX A100: 1 TiB RAM (2 TiB option).
    "a100": GPU("a100", "NVIDIA A100 SXM 80GB", 81920 / 1024, 312.0, 300.0, 1024.0),
}


def get_gpu(key: str) -> GPU:
    """Look up a GPU by its short name (case-insensitive); KeyError lists the known ones."""
    try:
        return GPUS[key.lower()]
    except KeyError:
        raise KeyError(f"unknown GPU {key!r}; known: {', '.join(GPUS)}") from None
