"""The parallel layout of a job: how it splits the model (TP, PP, EP, expert-TP, CP; DP derived from the world
size; uneven first/last pipeline stages), built from the recipe's `convert` or `parallel` section.

Plain arithmetic over the recipe, no process groups: the HF names table (`hf.names`), `kimi plan` and the trainer
read it; `model.parallel.init_distributed` turns it into process groups."""

from __future__ import annotations

import os
from dataclasses import dataclass

from kimi_pipeline.errors import PermanentError
from kimi_pipeline.recipes.checks import PipelineSplitError, pipeline_layers
from kimi_pipeline.recipes.models import ConvertSpec, ModelSpec, ParallelSpec


class LayoutError(PermanentError):
    """The parallel layout does not fit the world size or the model shape."""


@dataclass(frozen=True)
class Layout:
    world_size: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1
    first_pp_stage_layers: int | None = None  # decoder_first_pipeline_num_layers
    last_pp_stage_layers: int | None = None  # decoder_last_pipeline_num_layers
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        mp = self.tp * self.pp * self.cp
        if self.world_size % mp:
            raise LayoutError(f"world size {self.world_size} is not divisible by tp*pp*cp = {mp}")
        expert_mp = self.ep * self.etp * self.pp
        if self.world_size % expert_mp:
            raise LayoutError(f"world size {self.world_size} is not divisible by ep*etp*pp = {expert_mp}")
        if self.ep == 1 and self.etp != self.tp:
            # With EP=1 megatron reduces expert grads over the dense DP group only, which misses the TP
            # ranks that hold the same expert shard but route other (sequence-parallel) tokens.
            raise LayoutError(f"ep=1 needs etp == tp (got tp={self.tp}, etp={self.etp}): set etp={self.tp} or ep>1")
        if self.pp == 1 and (self.first_pp_stage_layers or self.last_pp_stage_layers):
            object.__setattr__(self, "first_pp_stage_layers", None)
            object.__setattr__(self, "last_pp_stage_layers", None)
        if self.sequence_parallel and self.tp == 1:
            object.__setattr__(self, "sequence_parallel", False)

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> int:
        """Expert data-parallel size (replicas of each expert shard)."""
        return self.world_size // (self.ep * self.etp * self.pp)

    def pp_stage_layers(self, num_layers: int) -> list[int]:
        """Decoder layers per pipeline stage: the recipe check's rule (`recipes.checks.pipeline_layers`)."""

        first, last = self.first_pp_stage_layers, self.last_pp_stage_layers
        try:
            return pipeline_layers(num_layers, self.pp, first, last)
        except PipelineSplitError as e:
            raise LayoutError(
                f"{num_layers} layers do not split over pp={self.pp} with first={first}, last={last}: {e}; set "
                "decoder_first/last_pipeline_num_layers so the rest divides evenly"
            ) from None

    def layer_offset(self, num_layers: int, pp_rank: int) -> int:
        return sum(self.pp_stage_layers(num_layers)[:pp_rank])

    def check_model(self, spec: ModelSpec) -> None:
        """Raise LayoutError when the model shape cannot be split this way."""
        problems = []
        if spec.num_attention_heads % self.tp:
            problems.append(f"num_attention_heads {spec.num_attention_heads} % tp {self.tp}")
        if spec.vocab_size % self.tp:
            problems.append(f"vocab_size {spec.vocab_size} % tp {self.tp}")
        if spec.num_experts % self.ep:
            problems.append(f"num_experts {spec.num_experts} % ep {self.ep}")
        if spec.moe_ffn_hidden_size % self.etp:
            problems.append(f"moe_ffn_hidden_size {spec.moe_ffn_hidden_size} % etp {self.etp}")
        if spec.ffn_hidden_size % self.tp:
            problems.append(f"ffn_hidden_size {spec.ffn_hidden_size} % tp {self.tp}")
        if problems:
            raise LayoutError("model shape does not split over the layout: " + "; ".join(problems) + " must be 0")
        self.pp_stage_layers(spec.num_layers)

    @classmethod
    def from_convert(cls, convert: ConvertSpec, world_size: int | None = None) -> Layout:
        """The conversion job's layout: world size = nodes x ranks per node unless given."""
        return cls(
            world_size=world_size or convert.nodes * convert.gpus_per_node,
            tp=convert.tp,
            pp=convert.pp,
            ep=convert.ep,
            etp=convert.etp,
            first_pp_stage_layers=convert.decoder_first_pipeline_num_layers,
            last_pp_stage_layers=convert.decoder_last_pipeline_num_layers,
        )

    @classmethod
    def from_parallel(cls, parallel: ParallelSpec, world_size: int | None = None) -> Layout:
        """The trainer's layout. World size: given, else tp*pp*cp*dp if the recipe sets dp, else $WORLD_SIZE."""
        if world_size is None:
            if parallel.dp is not None:
                world_size = parallel.dp * parallel.tp * parallel.pp * parallel.cp
            else:
                world_size = int(os.environ.get("WORLD_SIZE", "1"))
        return cls(
            world_size=world_size,
            tp=parallel.tp,
            pp=parallel.pp,
            ep=parallel.ep,
            etp=parallel.etp,
            cp=parallel.cp,
            first_pp_stage_layers=parallel.decoder_first_pipeline_num_layers,
            last_pp_stage_layers=parallel.decoder_last_pipeline_num_layers,
            sequence_parallel=parallel.sequence_parallel,
        )
