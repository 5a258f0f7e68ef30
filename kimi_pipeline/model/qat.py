"""INT4 QAT in the megatron forward: routed-expert weights pass through `fake_quant_int4` (STE).

The Parameters are never replaced: megatron's DDP buffers and the distributed optimizer hold
references to them (and torch parametrize would rename them in the state dict). Instead each routed
expert Linear gets an instance-level forward that computes the fake-quant weight from its Parameter
and *shadows* the attribute for the duration of the call (an entry in the instance `__dict__`
wins over `nn.Module.__getattr__`, while `parameters()`/`state_dict()` still see the real Parameter).
The fake-quant is computed inside forward, after any megatron forward pre-hook (param all-gather)
ran, and its gradient flows straight through into the Parameter's own grad accumulator, so DDP's
grad hooks fire as usual.

Routed experts are found by type, not name (wrappers add prefixes): the stacked experts module
(`fc1_weight`/`fc2_weight`, local spec, `model/grouped_experts.py`: the fake-quant runs once per stack, which
equals each expert's since INT4 groups run along the input dim), `SequentialMLP.local_experts[*]` (local spec
where experts cannot stack) and `TEGroupedMLP.linear_fc1/linear_fc2` (`weight{e}`, TE spec). Attention, router,
shared experts, dense MLP, embeddings and lm_head are left alone.
"""

from __future__ import annotations

import re
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from kimi_pipeline.errors import PermanentError
from kimi_pipeline.hf.int4 import fake_quant_int4
from kimi_pipeline.hf.int4_checkpoint import is_quantized
from kimi_pipeline.model.grouped_experts import stacked_experts

# `weight` (local Linear), `weight{e}` (TE grouped linear) or `fc{1,2}_weight` (stacked experts)
WEIGHT = re.compile(r"(fc\d_)?weight\d*")
# A routed-expert module carrying this attribute computes with `transform(weight)` instead of its weights.
WEIGHT_TRANSFORM_ATTR = "kimi_weight_transform"


@dataclass(frozen=True)
class FakeInt4:
    """The weight transform QAT installs on a routed-expert Linear (`WEIGHT_TRANSFORM_ATTR`)."""

    group_size: int

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        return fake_quant_int4(weight, self.group_size)


class QATError(PermanentError):
    pass


def _qat_forward(self: torch.nn.Module, *args, **kwargs):
    transform = getattr(self, WEIGHT_TRANSFORM_ATTR)
    names = [n for n, p in self._parameters.items() if p is not None and WEIGHT.fullmatch(n)]
    for n in names:
        self.__dict__[n] = transform(self._parameters[n])
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        for n in names:
            self.__dict__.pop(n, None)


def routed_expert_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(name, module) of every module holding routed-expert weights in a megatron-core model (any wrapper): a
    layer's stacked experts, or each expert Linear."""
    from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP, TEGroupedMLP

    stacked = stacked_experts()
    for name, mod in model.named_modules():
        if isinstance(mod, stacked):
            yield name, mod
        if isinstance(mod, GroupedMLP):
            raise QATError(
                f"{name}: legacy GroupedMLP stores experts as one [hidden, E*ffn] matrix, where INT4 groups "
                "along the input dim are not contiguous; build with the local (SequentialMLP) or TE spec"
            )
        if isinstance(mod, SequentialMLP):
            for e, expert in enumerate(mod.local_experts):
                yield f"{name}.local_experts.{e}.linear_fc1", expert.linear_fc1
                yield f"{name}.local_experts.{e}.linear_fc2", expert.linear_fc2
        elif isinstance(mod, TEGroupedMLP):
            yield f"{name}.linear_fc1", mod.linear_fc1
            yield f"{name}.linear_fc2", mod.linear_fc2


def enable_int4_qat(model: torch.nn.Module, group_size: int = 32) -> list[str]:
    """Make every routed-expert Linear compute with fake-INT4 weights; returns their names. Idempotent.

    Needs `gradient_accumulation_fusion=False`: the fused wgrad kernel writes into `weight.main_grad`
    of the tensor the Linear sees, which is the fake-quant tensor, not the Parameter.
    """
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "gradient_accumulation_fusion", False):
        raise QATError(
            "INT4 QAT needs gradient_accumulation_fusion=False (the fused wgrad writes into the Parameter's "
            "main_grad, which the fake-quant weight does not carry); turn it off in the trainer config"
        )
    names = []
    for name, lin in routed_expert_modules(model):
        for pname, p in lin._parameters.items():
            if p is not None and WEIGHT.fullmatch(pname) and p.shape[-1] % group_size:
                raise QATError(
                    f"{name}.{pname}: input dim {p.shape[-1]} is not divisible by quant.group_size={group_size} "
                    "(with expert-TP, ffn/etp must be a multiple of it too)"
                )
        setattr(lin, WEIGHT_TRANSFORM_ATTR, FakeInt4(group_size))
        if not isinstance(lin.__dict__.get("forward"), types.MethodType):
            lin.forward = types.MethodType(_qat_forward, lin)
        names.append(name)
    if not names:
        raise QATError("INT4 QAT is on but the model has no routed experts (no stacked experts, SequentialMLP or "
                       "TEGroupedMLP found)")
    return names


def disable_int4_qat(model: torch.nn.Module) -> None:
    """Undo enable_int4_qat (e.g. for a bf16 reference forward)."""
    for _, lin in routed_expert_modules(model):
        lin.__dict__.pop("forward", None)
        lin.__dict__.pop(WEIGHT_TRANSFORM_ATTR, None)


def fake_quant_hf_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], group_size: int = 32
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors with the routed experts fake-quantized exactly as the trainer's forward sees them
    (same selection as the export's ignore list); the reference the export must dequantize to."""
    for name, t in named_tensors:
        yield name, (fake_quant_int4(t.detach(), group_size) if is_quantized(name) else t)
