"""Source weight formats as Kimi ships them, dequantized per tensor on the rank that owns it.

- bf16/fp32: stored as is.
- fp8 (Kimi-K2-Instruct, DeepSeek-V3 style): `X.weight` is float8_e4m3fn and `X.weight_scale_inv`
  holds one float32 scale per 128×128 block; bf16 = fp8.float() × scale broadcast over its block.
- int4 (Kimi-K2-Thinking, the K2.5 actor): compressed-tensors `pack-quantized`, group 32, symmetric;
  `X.weight_packed` (int32, eight 4-bit values), `X.weight_scale`, `X.weight_shape`. Unpacking and
  dequantization use compressed-tensors' own compressor, so the arithmetic is the library's.

The inverse functions (`quantize_*`, `write_quantized_checkpoint`) produce FP8/INT4 copies of a
checkpoint for tests and demos; they are not on the conversion path.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from kimi_pipeline.errors import PermanentError
from kimi_pipeline.hf.config import quantization_config, text_config

FP8_SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv
INT4_SUFFIXES = ("_packed", "_scale", "_shape", "_zero_point", "_g_idx")  # X.weight -> X.weight_packed, ...
FP8_E4M3_MAX = 448.0


class QuantFormatError(PermanentError):
    """config.json declares a quantization we cannot dequantize, or the tensors do not match it."""


@dataclass(frozen=True)
class SourceFormat:
    """What the converter saw in the checkpoint (recorded in the convert summary)."""

    kind: str  # bf16 | fp8 | int4
    details: dict[str, Any] = field(default_factory=dict)
    quant_config: dict[str, Any] | None = None

    def describe(self) -> dict[str, Any]:
        return {"format": self.kind, **self.details}


def detect_format(config: dict[str, Any], text_config_key: str | None = None) -> SourceFormat:
    """The weight format a config.json declares (K2.5 may nest `quantization_config` under text_config)."""
    tcfg = text_config(config, text_config_key)
    qc = quantization_config(config, text_config_key)
    dtype = str(tcfg.get("torch_dtype") or tcfg.get("dtype") or "bfloat16")
    if not qc:
        return SourceFormat("bf16", {"dtype": dtype})
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        block = qc.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2):
            raise QuantFormatError(
                f"config.json quantization_config: fp8 without a 2-element weight_block_size ({block!r}); "
                "only DeepSeek-V3-style block-quantized FP8 is supported"
            )
        fmt = str(qc.get("fmt", "e4m3"))
        if fmt != "e4m3":
            raise QuantFormatError(f"config.json quantization_config.fmt={fmt!r}: only e4m3 FP8 is supported")
        return SourceFormat("fp8", {"weight_block_size": [int(b) for b in block], "fmt": fmt, "dtype": dtype}, qc)
    if method == "compressed-tensors":
        _int4_schemes(qc)  # validate now, not on the first tensor
        groups = qc.get("config_groups") or {}
        w = next(iter(groups.values())).get("weights", {})
        return SourceFormat(
            "int4",
            {"compression_format": qc.get("format"), "num_bits": w.get("num_bits"), "group_size": w.get("group_size"),
             "symmetric": w.get("symmetric"), "strategy": w.get("strategy"), "dtype": dtype},
            qc,
        )
    raise QuantFormatError(
        f"config.json quantization_config.quant_method={method!r} is not supported "
        "(supported: none/bf16, fp8 with weight_block_size, compressed-tensors pack-quantized)"
    )


# ---------------------------------------------------------------- FP8 block quantization
def dequant_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] | list[int],
                      name: str = "tensor") -> torch.Tensor:
    """float32 weight = fp8 weight × its block's scale (blocks may be partial at the edges)."""
    if weight.dim() != 2:
        raise QuantFormatError(f"{name}: FP8 block dequantization expects a 2-D weight, got {tuple(weight.shape)}")
    rows, cols = weight.shape
    br, bc = int(block[0]), int(block[1])
    want = (math.ceil(rows / br), math.ceil(cols / bc))
    if tuple(scale_inv.shape) != want:
        raise QuantFormatError(
            f"{name}: weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {want} for a "
            f"{rows}×{cols} weight in {br}×{bc} blocks"
        )
    s = scale_inv.float().repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return weight.float() * s


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv per block): DeepSeek-V3's scheme, amax/448 per block."""
    rows, cols = w.shape
    br, bc = block
    pr, pc = math.ceil(rows / br) * br, math.ceil(cols / bc) * bc
    padded = torch.nn.functional.pad(w.float(), (0, pc - cols, 0, pr - rows))
    blocks = padded.view(pr // br, br, pc // bc, bc)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / FP8_E4M3_MAX
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    q = q.view(pr, pc)[:rows, :cols].to(torch.float8_e4m3fn).contiguous()
    return q, scale_inv.contiguous()


# ---------------------------------------------------------------- INT4 compressed-tensors
def _int4_schemes(qc: dict[str, Any]):
    """(QuantizationConfig, {group: QuantizationScheme}) validated for pack-quantized integer weights."""
    from compressed_tensors.quantization import QuantizationConfig

    try:
        cfg = QuantizationConfig.model_validate(qc)
    except Exception as e:  # pydantic's message names the bad field
        raise QuantFormatError(f"config.json quantization_config is not a valid compressed-tensors config: {e}") from None
    if cfg.quantization_status != "compressed":
        raise QuantFormatError(
            f"config.json quantization_config.quantization_status={cfg.quantization_status!r}: only "
            "'compressed' checkpoints hold packed weights"
        )
    schemes = {}
    for gname, scheme in cfg.config_groups.items():
        fmt = getattr(scheme, "format", None) or cfg.format
        if fmt != "pack-quantized":
            raise QuantFormatError(
                f"config.json quantization_config group {gname!r}: format {fmt!r} is not supported "
                "(only compressed-tensors pack-quantized)"
            )
        w = scheme.weights
        if w is None or w.type != "int" or not 1 <= w.num_bits <= 8:
            raise QuantFormatError(f"config.json quantization_config group {gname!r}: only 1-8 bit integer weights")
        schemes[gname] = scheme
    if not schemes:
        raise QuantFormatError("config.json quantization_config has no config_groups")
    return cfg, schemes


class Int4Dequantizer:
    """Dequantizes pack-quantized modules by name, choosing the config group whose targets match."""

    def __init__(self, qc: dict[str, Any]):
        self.cfg, self.schemes = _int4_schemes(qc)

    def scheme_for(self, module: str):
        if len(self.schemes) == 1:
            return next(iter(self.schemes.values()))
        for scheme in self.schemes.values():
            for t in scheme.targets:
                if module == t or (t.startswith("re:") and re.match(t[3:], module)):
                    return scheme
        raise QuantFormatError(
            f"{module}: packed weights but no quantization_config group targets it by name "
            f"(groups: {list(self.schemes)}); cannot tell which scheme applies"
        )

    def dequant(self, module: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """`tensors`: weight_packed, weight_scale, weight_shape (+ weight_zero_point) of one Linear."""
        from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

        missing = {"weight_packed", "weight_scale", "weight_shape"} - set(tensors)
        if missing:
            raise QuantFormatError(f"{module}: packed INT4 weight lacks {sorted(missing)}")
        try:
            out = PackedQuantizationCompressor.decompress(dict(tensors), self.scheme_for(module))["weight"]
        except (RuntimeError, ValueError) as e:
            raise QuantFormatError(f"{module}: cannot dequantize its packed INT4 weight ({e})") from None
        shape = tuple(int(x) for x in tensors["weight_shape"].tolist())
        if tuple(out.shape) != shape:
            raise QuantFormatError(f"{module}: dequantized shape {tuple(out.shape)} != weight_shape {shape}")
        return out


def int4_args(group_size: int = 32):
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size,
                            dynamic=False, observer="minmax")


def quantize_int4_packed(w: torch.Tensor, group_size: int = 32, scale_dtype: torch.dtype = torch.bfloat16
                         ) -> dict[str, torch.Tensor]:
    """weight_packed / weight_scale / weight_shape of a symmetric group-quantized weight (compressed-tensors)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    args = int4_args(group_size)
    rows, cols = w.shape
    g = w.float().view(rows, cols // group_size, group_size)
    scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), args)
    scale = scale.to(scale_dtype)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    out = PackedQuantizationCompressor.compress({"weight": w.to(scale_dtype), "weight_scale": scale}, scheme)
    return {k: v.contiguous() for k, v in out.items()}


# Kimi-K2-Thinking's INT4 ignore list, verbatim.
KIMI_IGNORE = [
    "lm_head",
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
]
# Kimi-K2.5's, as its config.json ships it (in text_config): the same modules under the `language_model.` prefix,
# plus the vision tower and the projector.
KIMI_K25_IGNORE = [
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
    "re:.*lm_head.*",
    "re:.*vision_tower.*",
    "re:.*mm_projector.*",
]


# Kimi-K2-Thinking's quantization_config: routed experts only (everything else stays bf16).
def kimi_int4_quant_config(group_size: int = 32) -> dict[str, Any]:
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                      "weights": int4_args(group_size).model_dump(mode="json")}},
        "ignore": list(KIMI_IGNORE),
        "kv_cache_scheme": None,
    }


def fp8_quant_config(block: tuple[int, int] | list[int] = (128, 128)) -> dict[str, Any]:
    """Kimi-K2-Instruct's (DeepSeek-V3's) FP8 `quantization_config`."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}


class QuantizedParts:
    """Dense weights back from tensors sent in an engine's quantized format, as they stream in.

    INT4 (`X.weight_packed` + `X.weight_scale` + `X.weight_shape`, group size read off the shapes) and FP8
    (`X.weight` in float8_e4m3fn + `X.weight_scale_inv`, 128x128 blocks) arrive as separate tensors,
    possibly in different weight-sync buckets: parts wait here until their Linear is complete, then it
    is dequantized with the same functions the conversion uses. Other tensors pass through.
    """

    INT4_PARTS = ("weight_packed", "weight_scale", "weight_shape")

    def __init__(self, fp8_block: tuple[int, int] = (128, 128)):
        self.block = fp8_block
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self._int4: dict[int, Int4Dequantizer] = {}  # by group size: validating the config per Linear costs

    @staticmethod
    def _part(name: str, t: torch.Tensor) -> tuple[str, str] | None:
        for part in QuantizedParts.INT4_PARTS + ("weight_scale_inv",):
            if name.endswith("." + part):
                return name[: -len(part) - 1], part
        if name.endswith(".weight") and t.dtype == torch.float8_e4m3fn:
            return name[: -len(".weight")], "weight"
        return None

    def feed(self, named) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in named:
            hit = self._part(name, t)
            if hit is None:
                yield name, t
                continue
            module, part = hit
            parts = self.pending.setdefault(module, {})
            parts[part] = t
            if set(self.INT4_PARTS) <= parts.keys():
                del self.pending[module]
                shape = [int(x) for x in parts["weight_shape"].tolist()]
                groups = parts["weight_scale"].shape[-1]
                if len(shape) != 2 or groups <= 0 or shape[1] % groups:
                    raise QuantFormatError(f"{module}: weight_scale {tuple(parts['weight_scale'].shape)} does not "
                                           f"divide weight_shape {shape} into groups")
                group = shape[1] // groups
                if group not in self._int4:
                    self._int4[group] = Int4Dequantizer(kimi_int4_quant_config(group))
                yield module + ".weight", self._int4[group].dequant(module, parts)
            elif {"weight", "weight_scale_inv"} <= parts.keys():
                del self.pending[module]
                yield module + ".weight", dequant_fp8_block(parts["weight"], parts["weight_scale_inv"], self.block,
                                                            module)

    def check_complete(self) -> None:
        """Every quantized Linear that started arriving has all its parts (call after the last bucket)."""
        if self.pending:
            n, (module, parts) = len(self.pending), next(iter(self.pending.items()))
            self.pending.clear()
            raise QuantFormatError(f"{n} quantized weight(s) arrived incomplete, e.g. {module} with only {sorted(parts)}")


FP8_TARGET = re.compile(r"_proj(_with_mqa)?\.weight$")  # every Linear except lm_head and the router gate
INT4_TARGET = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
