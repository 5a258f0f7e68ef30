"""The one error every part of the reward package raises."""

from __future__ import annotations

from kimi_pipeline.errors import PermanentError


class RewardError(PermanentError):
    """Bad reward configuration, or the grading workers cannot start in this environment."""
