"""Routed experts as two stacked Parameters and two grouped GEMMs on the local (non-TE) spec: megatron's
`SequentialMLP` (same initial weights, same checkpoint keys and layout) without its per-expert modules.

Why hand-written: megatron-core's grouped expert modules need Transformer Engine (`TEGroupedMLP`, one Parameter
per expert) or the CUDA-only `grouped_gemm` package (`GroupedMLP`, whose [hidden, E·ffn] weight breaks INT4
groups and needs sharded factories that change the optimizer's checkpoint layout). `SequentialMLP` keeps one
Linear per expert: 16 small GEMMs per layer on tiny, 384 at K2 scale, and as many Parameters, each with its own
grad-accumulation `add_`, grad-norm term and optimizer update (the H200 profile's host time). Here a layer's local
experts are one `fc1_weight` [E, 2F, H] and one `fc2_weight` [E, H, F], multiplied with `torch._grouped_mm` over
the dispatcher's expert-sorted tokens with offsets computed on the device — the kernel transformers' `grouped_mm`
experts use. Results equal megatron's loop to float rounding (tested against `SequentialMLP` itself).

What the rest of the project sees is unchanged: `state_dict()` names the experts as `SequentialMLP` does
(`local_experts.{e}.linear_fc{1,2}.weight`, views into the stacks, so a `copy_` into one writes the stack), and
`sharded_state_dict` writes megatron's `SequentialMLP` checkpoint layout (one key per layer, the global expert
index as an axis: megatron-core 0.16.1 `transformer/moe/experts.py:935-975`), as one ShardedTensor whose data is
the stacked Parameter itself, which the distributed optimizer maps its state by. Checkpoints written before the
stacking load unchanged (torch_dist re-chunks the per-expert pieces on load), and a stacked checkpoint loads where
experts do not stack (both tested, Adam state included).

Built where the stacked form holds (`stackable`: expert-TP 1, gated linear unit, unbiased expert Linears, no FP8/FP4, no
delayed wgrad); otherwise megatron's `SequentialMLP`. At run time the grouped GEMM needs `torch._grouped_mm` to
take the operands (`grouped_mm_supported`: any float on CPU, bf16 on sm80+ GPUs — one rule, so a TE-less GPU runs
what the CPU tests run); elsewhere the same stacks run one expert at a time.
"""

from __future__ import annotations

import functools

import torch

_ALIGN_BYTES = 16  # torch._grouped_mm on CPU needs row strides that are multiples of 16 bytes
STACKED = ("fc1_weight", "linear_fc1"), ("fc2_weight", "linear_fc2")  # (stacked Parameter, SequentialMLP's Linear)


class _ContiguousGrad(torch.autograd.Function):
    """Identity on a grouped_mm output whose backward makes the gradient contiguous (grouped_mm's backward needs
    real strides; a gradient from e.g. `.sum()` arrives expanded with stride 0)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


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


def stackable(config, expert_tp: int) -> bool:
    """Whether a layer's routed experts can be built as stacked Parameters: the stacks hold one whole expert per
    row (expert-TP 1: at expert-TP > 1 the GLU fc1 shard needs megatron's swiglu factory on each Linear), and the
    forward computes megatron's MLP (GLU, no bias, no FP8/FP4 padding, probs after the activation, no delayed
    weight gradient)."""
    return (
        expert_tp == 1
        and config.gated_linear_unit
        and not (config.fp8 or config.fp4 or config.moe_apply_probs_on_input or config.add_bias_linear)
        and getattr(config, "activation_func_clamp_value", None) is None
        and getattr(config, "glu_linear_offset", 0.0) == 0.0
        and not getattr(config, "delay_wgrad_compute", False)
    )


def _expert_view_key(prefix: str, e: int, linear: str, entry: str = "weight") -> str:
    """SequentialMLP's state-dict name of expert `e`'s `entry` (weight, _extra_state) of `linear`."""
    return f"{prefix}local_experts.{e}.{linear}.{entry}"


@functools.cache
def stacked_experts() -> type:
    """The stacked experts module class (built lazily: megatron imports are heavy)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.utils import make_sharded_object_for_checkpoint

    class StackedExperts(MegatronModule):
        """A layer's local routed experts: `fc1_weight` [E, 2F, H] (gate ‖ up) and `fc2_weight` [E, H, F]."""

        def __init__(self, num_local_experts, config, submodules, pg_collection=None):
            # megatron's own experts, built once for their initial weights and the attributes megatron's DDP and
            # optimizer read on a Parameter (allreduce, tensor_model_parallel ...), then dropped (transiently two
            # copies of one layer's local experts)
            template = SequentialMLP(num_local_experts, config, submodules, pg_collection)
            super().__init__(config=template.config)
            self.num_local_experts = num_local_experts
            self.ep_group, self.tp_group, self.dp_group = template.ep_group, template.tp_group, template.dp_group
            if self.tp_group.size() != 1:
                raise ValueError(f"stacked experts need expert-TP 1, got {self.tp_group.size()} (see stackable)")
            for stacked, linear in STACKED:
                weights = [getattr(e, linear).weight for e in template.local_experts]
                param = torch.nn.Parameter(torch.stack([w.detach() for w in weights]))
                for attr, value in vars(weights[0]).items():
                    if not attr.startswith("_"):
                        setattr(param, attr, value)
                if hasattr(param, "partition_dim"):
                    param.partition_dim += 1  # the expert axis comes first
                self.register_parameter(stacked, param)
            del template
            self.register_state_dict_post_hook(_expert_views)
            self.register_load_state_dict_pre_hook(_stack_expert_views)

        def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
            x, w1, w2 = permuted_local_hidden_states, self.fc1_weight, self.fc2_weight  # QAT may shadow w1, w2
            # the stacks may be views into megatron's DDP param buffer, where a Parameter starts wherever the one
            # before it ended (padded to 64 elements only with the distributed optimizer,
            # megatron-core 0.16.1 distributed/param_and_grad_buffer.py:658-666): check their alignment too
            if not (x.dim() == 2 and w1.dtype == x.dtype
                    and grouped_mm_supported(x, x.shape[-1], w1.shape[-1], w2.shape[-1])
                    and all(w.data_ptr() % _ALIGN_BYTES == 0 for w in (x, w1, w2))):
                return self._one_expert_at_a_time(x, tokens_per_expert, permuted_probs, w1, w2), None
            # megatron hands the counts over on the host (`token_dispatcher.py:862-901` copies them there for
            # SequentialMLP's split sizes); the offsets are computed on the device from a copy that does not wait
            counts = torch.as_tensor(tokens_per_expert).to(x.device, non_blocking=True)
            offs = torch.cumsum(counts, 0).to(torch.int32)
            h = _ContiguousGrad.apply(torch._grouped_mm(x, w1.transpose(1, 2), offs=offs))
            h = self._activate(h, permuted_probs).to(x.dtype)
            out = _ContiguousGrad.apply(torch._grouped_mm(h.contiguous(), w2.transpose(1, 2), offs=offs))
            return out, None

        def _activate(self, h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
            """megatron's MLP between fc1 and fc2: GLU, then the router's probs (after the activation)."""
            gate, up = torch.chunk(h, 2, dim=-1)
            return self.config.activation_func(gate) * up * probs.unsqueeze(-1)

        def _one_expert_at_a_time(self, x, tokens_per_expert, probs, w1, w2) -> torch.Tensor:
            """The same maths where `torch._grouped_mm` does not take the operands; needs the counts on the host,
            as megatron's loop does."""
            counts = torch.as_tensor(tokens_per_expert).tolist()
            out = []
            for e, (xe, pe) in enumerate(zip(torch.split(x, counts), torch.split(probs, counts))):
                h = self._activate(torch.nn.functional.linear(xe, w1[e]), pe).to(x.dtype)
                out.append(torch.nn.functional.linear(h, w2[e]))
            return torch.cat(out)

        def backward_dw(self):
            """Nothing is delayed: `stackable` refuses delay_wgrad_compute."""

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            """SequentialMLP's checkpoint layout (`experts.py:935-975` with `MLP`'s swiglu split and the Linear's
            TP axis, both trivial at expert-TP 1): `{prefix}experts.linear_fc{1,2}.weight` of global shape
            [*layer axes, E_global, out, in], this rank's experts at `ep_rank * E_local`, replicated over the
            expert-data-parallel group."""
            if (metadata or {}).get("singleton_local_shards", False):
                raise ValueError("stacked experts write SequentialMLP's layout with singleton_local_shards=False")
            n = len(sharded_offsets)
            ep_rank, ep_size = self.ep_group.rank(), self.ep_group.size()
            replica_id = (0, 0, self.dp_group.rank())
            out = {}
            for stacked, linear in STACKED:
                out[f"{prefix}{stacked}"] = ShardedTensor.from_rank_offsets(
                    f"{prefix}experts.{linear}.weight", getattr(self, stacked), *sharded_offsets,
                    (n, ep_rank, ep_size), replica_id=replica_id, prepend_axis_num=n)
                # each expert Linear's extra state (None), as SequentialMLP writes it: a module that loads per
                # expert (SequentialMLP where experts cannot stack, TEGroupedMLP) asks for it
                e_local = self.num_local_experts
                for e in range(e_local):
                    expert_axis = (n, ep_rank * e_local + e, ep_size * e_local)
                    out[_expert_view_key(prefix, e, linear, "_extra_state")] = make_sharded_object_for_checkpoint(
                        None, f"{prefix}experts.{linear}._extra_state", (*sharded_offsets, expert_axis),
                        replica_id=replica_id)
            return out

    def _expert_views(module, state_dict, prefix, local_metadata):
        """state_dict post-hook: the stacks as SequentialMLP's per-expert weights (views: writes reach the stack)."""
        for stacked, linear in STACKED:
            t = state_dict.pop(prefix + stacked).detach()
            for e in range(t.shape[0]):
                state_dict[_expert_view_key(prefix, e, linear)] = t[e]

    def _stack_expert_views(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        """load_state_dict pre-hook: per-expert weights (SequentialMLP's names, as `state_dict()` gives them)
        back into the stacks' keys; SequentialMLP's Linears' `_extra_state` (None) dropped."""
        for stacked, linear in STACKED:
            keys = [_expert_view_key(prefix, e, linear) for e in range(module.num_local_experts)]
            if all(k in state_dict for k in keys):
                state_dict[prefix + stacked] = torch.stack([state_dict.pop(k) for k in keys])
            for e in range(module.num_local_experts):
                state_dict.pop(_expert_view_key(prefix, e, linear, "_extra_state"), None)

    return StackedExperts
