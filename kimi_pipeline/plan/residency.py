"""Who holds the GPU in each phase of a colocated RL step: the table `kimi plan` counts per phase
(`plan.command`) and the train loop's handoff runs (`rl.handoff.Handoff`), one table so the plan's peak is the
sequence the loop runs."""

from __future__ import annotations

from kimi_pipeline.engine.rollout_engine import MEMORY_TAGS
from kimi_pipeline.model.offload import PARTS

PHASES = ("rollout", "train", "weight_sync")
# (engine memory tags, trainer parts) on the GPU in each phase
RESIDENT: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "rollout": (MEMORY_TAGS, ()),
    "train": ((), PARTS),
    "weight_sync": (("weights",), ("weights",)),
}
