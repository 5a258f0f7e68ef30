"""Routed experts as two grouped GEMMs on the local (non-TE) spec: megatron's `SequentialMLP`, same
parameters and checkpoint keys, without its per-expert Python loop.

Why hand-written: megatron-core's grouped expert modules need Transformer Engine (`TEGroupedMLP`) or the
CUDA-only `grouped_gemm` package (`GroupedMLP`, whose fused [hidden, E·ffn] weight also breaks INT4 groups).
`SequentialMLP` runs fc1 → GLU → fc2 once per expert (16 small GEMMs per layer on tiny, 384 at K2 scale);
on CPU that loop plus its split/cat autograd nodes was a third of a training step. Here the per-expert
weights are stacked (a view-sized copy; gradients flow back into each expert's own Parameter, so DDP's
grad hooks, the distributed optimizer and QAT see exactly what they saw before) and multiplied with
`torch._grouped_mm` over the dispatcher's expert-sorted tokens — the same kernel transformers' `grouped_mm`
experts use. Results equal the loop's to float rounding (tested).

Used when expert-TP is 1 and `torch._grouped_mm` takes the operands (`grouped_mm_supported`: any float on CPU,
bf16 on sm80+ GPUs — the same rule on both, so a TE-less GPU runs what the CPU tests run); otherwise (expert-TP
> 1 needs the Linear layers' TP collectives) it falls back to the loop.
"""

from __future__ import annotations

import functools

import torch

_ALIGN_BYTES = 16  # torch._grouped_mm on CPU needs row strides that are multiples of 16 bytes
# An expert Linear carrying this attribute computes with `transform(weight)` instead of its weight (QAT's
# fake-quant, set by model/qat.py). The transform is hashable: experts of one layer must share one.
WEIGHT_TRANSFORM_ATTR = "kimi_weight_transform"


class _ContiguousGrad(torch.autograd.Function):
    """Identity on a grouped_mm output whose backward makes the gradient contiguous (grouped_mm's backward needs
    real strides; a gradient from e.g. `.sum()` arrives expanded with stride 0)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _stacked_weights(linears: list[torch.nn.Module]) -> torch.Tensor:
    """[E, out, in]: the weights the expert Linears would compute with. Their weight transform when they carry
    one (QAT's fake-INT4), applied once to the stack: INT4 groups run along `in`, so this equals transforming
    each expert."""
    w = torch.stack([lin.weight for lin in linears])
    transforms = {getattr(lin, WEIGHT_TRANSFORM_ATTR, None) for lin in linears}
    if transforms == {None}:
        return w
    if len(transforms) != 1:
        raise ValueError(f"experts of one layer have different weight transforms: {sorted(map(str, transforms))}")
    return transforms.pop()(w)


def grouped_mm_supported(t: torch.Tensor, *dims: int) -> bool:
    """Whether `torch._grouped_mm` takes operands like `t` whose rows are `dims` elements long: on CPU any float
    dtype, on CUDA bf16 on sm80+; rows 16-byte aligned on both. One rule for the trainer's experts and the
    engine's."""
    if any((d * t.element_size()) % _ALIGN_BYTES for d in dims):
        return False
    if t.device.type == "cpu":
        return True
    if t.device.type == "cuda":
        return t.dtype == torch.bfloat16 and torch.cuda.get_device_capability(t.device)[0] >= 8
    return False


@functools.cache
def grouped_sequential_mlp() -> type:
    """`SequentialMLP` subclass with the grouped forward (built lazily: megatron imports are heavy)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    class GroupedSequentialMLP(SequentialMLP):
        def _can_group(self, hidden: torch.Tensor) -> bool:
            c = self.config
            first = self.local_experts[0] if len(self.local_experts) else None
            return (
                first is not None
                and self.tp_group.size() == 1
                and c.gated_linear_unit
                and not (c.fp8 or c.fp4 or c.moe_apply_probs_on_input or c.add_bias_linear)
                and getattr(c, "activation_func_clamp_value", None) is None
                and getattr(c, "glu_linear_offset", 0.0) == 0.0
                and hidden.dim() == 2
                and grouped_mm_supported(hidden, hidden.shape[-1], *first.linear_fc1.weight.shape[-1:],
                                         *first.linear_fc2.weight.shape[-1:])
                and first.linear_fc1.weight.dtype == hidden.dtype
            )

        def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
            x = permuted_local_hidden_states
            if not self._can_group(x):
                return super().forward(x, tokens_per_expert, permuted_probs)
            # megatron hands the counts over on the host (`token_dispatcher.py:862-901` copies them there for the
            # experts' split sizes); the offsets are computed on the device from a copy that does not wait
            counts = torch.as_tensor(tokens_per_expert).to(x.device, non_blocking=True)
            offs = torch.cumsum(counts, 0).to(torch.int32)
            w1 = _stacked_weights([e.linear_fc1 for e in self.local_experts])  # [E, 2F, H]
            w2 = _stacked_weights([e.linear_fc2 for e in self.local_experts])  # [E, H, F]
            h = _ContiguousGrad.apply(torch._grouped_mm(x, w1.transpose(1, 2), offs=offs))
            gate, up = torch.chunk(h, 2, dim=-1)
            h = self.config.activation_func(gate) * up
            h = (h * permuted_probs.unsqueeze(-1)).to(x.dtype)  # megatron's MLP: probs after the activation
            out = _ContiguousGrad.apply(torch._grouped_mm(h.contiguous(), w2.transpose(1, 2), offs=offs))
            return out, None

    return GroupedSequentialMLP
