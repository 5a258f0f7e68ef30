"""The Recipe: all sections together, plus the derived layout numbers later stages need."""

from __future__ import annotations

from pydantic import Field

from kimi_pipeline.recipes.models import (
    CheckpointSpec,
    ClusterSpec,
    ConvertSpec,
    DataSpec,
    EvalSpec,
    ExportSpec,
    GRPOSpec,
    HealthSpec,
    HubSpec,
    ModelSpec,
    OptimizerSpec,
    ParallelSpec,
    PathsSpec,
    QuantSpec,
    RolloutSpec,
    Section,
    SGLangSpec,
)


class Recipe(Section):
    name: str
    description: str = ""
    model: ModelSpec
    hub: HubSpec
    data: DataSpec
    convert: ConvertSpec = Field(default_factory=ConvertSpec)
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    cluster: ClusterSpec = Field(default_factory=ClusterSpec)
    rollout: RolloutSpec
    sglang: SGLangSpec = Field(default_factory=SGLangSpec)
    grpo: GRPOSpec = Field(default_factory=GRPOSpec)
    eval: EvalSpec = Field(default_factory=EvalSpec)
    optimizer: OptimizerSpec
    quant: QuantSpec = Field(default_factory=QuantSpec)
    export: ExportSpec = Field(default_factory=ExportSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    health: HealthSpec = Field(default_factory=HealthSpec)
    paths: PathsSpec = Field(default_factory=PathsSpec)

    # ---- derived numbers (never stored, so they cannot drift from the fields) ----
    @property
    def data_parallel_size(self) -> int:
        p = self.parallel
        return p.dp if p.dp is not None else self.cluster.world_size // (p.tp * p.pp * p.cp)

    @property
    def global_batch_size(self) -> int:
        return self.rollout.samples_per_step

    def worker_dump(self) -> dict:
        """The whole recipe as JSON for another process (a Ray actor, a child, a log, the run's recipe.yaml):
        the hub token never leaves this process (a worker that needs it reads HF_TOKEN)."""
        return self.model_dump(mode="json", exclude={"hub": {"token"}})

    def section_dump(self, *names: str) -> dict:
        """JSON-able dump of some sections (used for cache keys); secrets are excluded."""
        dumped = self.model_dump(mode="json", include=set(names))
        hub = dumped.get("hub")
        if isinstance(hub, dict):
            hub.pop("token", None)
        model = dumped.get("model")
        if isinstance(model, dict) and model.get("vision", 0) is None:
            del model["vision"]  # a text-only model keeps the keys it had before model.vision existed (cached stages)
        return dumped
