"""Graders by name (recipe field ``rollout.rm_type``): one module per built-in, or the user's own function.

A custom grader is a function path ``package.module:function`` (like slime's ``custom_rm_path``), called
as ``function(response, label, thinking=..., strict=...)`` and returning a ``Verdict``.
"""

from __future__ import annotations

import importlib

from kimi_pipeline.reward.graders import deepscaler, math
from kimi_pipeline.reward.graders.base import Grader, Verdict
from kimi_pipeline.reward.reward_errors import RewardError

GRADERS: dict[str, Grader] = {"math": math.grade, "deepscaler": deepscaler.grade}

__all__ = ["GRADERS", "Grader", "Verdict", "grader_for"]


def grader_for(rm_type: str) -> Grader:
    """The grading function `rm_type` names: a registered grader, or a function path `package.module:function`."""
    if rm_type in GRADERS:
        return GRADERS[rm_type]
    module_name, _, attr = rm_type.partition(":")
    if not module_name or not attr:
        raise RewardError(
            f"unknown rm_type {rm_type!r} (recipe field rollout.rm_type): choose one of {', '.join(GRADERS)}, "
            "or name your own grader as a function path package.module:function"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - whatever the import raised, the recipe names a grader we cannot load
        raise RewardError(
            f"rm_type {rm_type!r} (recipe field rollout.rm_type): cannot import module {module_name!r} "
            f"({type(e).__name__}: {e}); install it or put its directory on PYTHONPATH"
        ) from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardError(
            f"rm_type {rm_type!r} (recipe field rollout.rm_type): module {module_name!r} has no function {attr!r}; "
            "name a function defined there"
        )
    return fn
