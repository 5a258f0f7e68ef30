"""Symmetric group-wise INT4: fake-quant with a straight-through gradient, quantize/dequantize, and
int32 packing in compressed-tensors' `pack-quantized` layout (the format Kimi-K2-Thinking ships).

Scheme (the Kimi-K2-Thinking recipe): per group of `group_size` consecutive input-dimension weights,
scale = max(amax / 7, 1e-5), q = clamp(round(w / scale), -7, 7).

Exactness contract (why the scale is rounded): the export stores `weight_scale` in bf16 as Kimi
does, and inference engines dequantize as bf16(q * scale). So fake-quant computes in fp32, rounds the
scale to the storage dtype *before* dividing (the trainer sees exactly the grid the engine will use),
and rounds the product q * scale to the storage dtype (one correctly rounded fp32 product, which is what
a bf16 multiply does). Hence `fake_quant_int4(w) == dequantize_int4(*quantize_int4(w))` bit for bit, in
any weight dtype — the property the export verification checks.
"""

from __future__ import annotations

import sys

import torch

from kimi_pipeline.errors import PermanentError

QMAX = 7  # symmetric: -8 is never used, as in the recipe and Kimi's checkpoint
MIN_SCALE = 1e-5
NUM_BITS = 4
SCALE_DTYPE = torch.bfloat16  # Kimi-K2-Thinking's weight_scale dtype


class Int4ShapeError(PermanentError):
    pass


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    cols = w.shape[-1]
    if w.ndim < 2 or cols % group_size:
        raise Int4ShapeError(
            f"INT4 group quantization needs a [..., out, in] weight with in divisible by group_size={group_size}; "
            f"got shape {tuple(w.shape)} (set quant.group_size to a divisor of {cols})"
        )
    return w.float().unflatten(-1, (cols // group_size, group_size))


def quantize_int4(
    w: torch.Tensor, group_size: int = 32, scale_dtype: torch.dtype = SCALE_DTYPE
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 in [-7, 7] with w's shape, scale [..., out, in/group_size] in scale_dtype)."""
    g = _grouped(w.detach(), group_size)
    scale = (g.abs().amax(dim=-1, keepdim=True) / QMAX).clamp_min(MIN_SCALE).to(scale_dtype)
    q = torch.round(g / scale.float()).clamp_(-QMAX, QMAX)
    return q.flatten(-2).to(torch.int8), scale.squeeze(-1)


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """q * scale rounded once to scale's dtype (what compressed-tensors and engines do), then cast to dtype."""
    group_size = q.shape[-1] // scale.shape[-1]
    prod = q.float().unflatten(-1, (scale.shape[-1], group_size)) * scale.float().unsqueeze(-1)
    out = prod.flatten(-2).to(scale.dtype)
    return out if dtype is None else out.to(dtype)


class _FakeQuantSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: torch.Tensor, group_size: int, scale_dtype: torch.dtype) -> torch.Tensor:
        q, scale = quantize_int4(w, group_size, scale_dtype)
        return dequantize_int4(q, scale, w.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None  # straight-through: d fq(w) / dw := identity


def fake_quant_int4(w: torch.Tensor, group_size: int = 32, scale_dtype: torch.dtype = SCALE_DTYPE) -> torch.Tensor:
    """Fake INT4 (quantize + dequantize) in w's dtype, with an identity (straight-through) gradient.

    An autograd.Function rather than `w + (fq - w).detach()`: the latter is not bit-exact in floating point.
    """
    return _FakeQuantSTE.apply(w, group_size, scale_dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7] -> int32 words, eight per word along the last dim, +8 offset, low nibble first.

    compressed-tensors' layout. Hand-written fast path (why: the library's generic scatter packer is
    ~4.5x slower for 4 bits): pair nibbles into bytes and view four bytes as one little-endian int32,
    mirroring the library's own 4-bit unpack; tests pin it equal to `pack_to_int32`. Other shapes and
    big-endian hosts use the library.
    """
    if q.dtype is not torch.int8:
        raise TypeError(f"pack_int4 needs int8 values, got {q.dtype}")
    if q.shape[-1] % 8 == 0 and sys.byteorder == "little":
        u = q.view(torch.uint8) + 8  # wraps: -8..7 -> 0..15
        return (u[..., 0::2] | (u[..., 1::2] << 4)).contiguous().view(torch.int32)
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32  # ~3 s import: lazy

    return pack_to_int32(q, NUM_BITS)


def unpack_int4(packed: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """Inverse of pack_int4: int32 words -> int8 values of `shape` (the stored `weight_shape`)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    return unpack_from_int32(packed, NUM_BITS, torch.Size(shape))
