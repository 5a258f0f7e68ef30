"""`kimi plan`: parameter counts, per-GPU / per-node memory and step time of a recipe's layout, before any GPU.

Pure Python over the typed recipe; `make_plan(recipe, gpu)` returns the JSON-able plan, `plan_command` is the CLI.
"""

from kimi_pipeline.model.params import ParamCounts, count_params
from kimi_pipeline.plan.command import make_plan, plan_command
from kimi_pipeline.plan.hardware import GPUS, get_gpu
from kimi_pipeline.plan.memory import MemoryAssumptions, PlanLayout, megatron_bytes_per_param
from kimi_pipeline.plan.timing import TimeAssumptions

__all__ = [
    "GPUS",
    "PlanLayout",
    "MemoryAssumptions",
    "ParamCounts",
    "TimeAssumptions",
    "count_params",
    "get_gpu",
    "make_plan",
    "megatron_bytes_per_param",
    "plan_command",
]
