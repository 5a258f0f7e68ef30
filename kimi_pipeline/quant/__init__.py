"""INT4 for Kimi-K2: fake-quant QAT of the routed experts in the megatron forward, and the
compressed-tensors `pack-quantized` export inference engines load (Kimi-K2-Thinking's format)."""

from kimi_pipeline.quant.int4 import (
    dequantize_int4,
    fake_quant_int4,
    pack_int4,
    quantize_int4,
    unpack_int4,
)

__all__ = ["dequantize_int4", "fake_quant_int4", "pack_int4", "quantize_int4", "unpack_int4"]
