"""Errors that retrying cannot fix (bad recipe, bad data, corrupt local files): tasks do not retry them."""

from __future__ import annotations

from typing import Any


class PermanentError(RuntimeError):
    """Deterministic failure: the input must change before a retry can succeed."""


def is_permanent(exc: BaseException | None) -> bool:
    return isinstance(exc, PermanentError)


class SectionError(PermanentError):
    """A stage failed after working out what its summary section says (the rows a validation refused, the tensors
    an export got wrong): the stage runner records `section`, and the report shows it."""

    def __init__(self, message: str, section: dict[str, Any] | None = None):
        super().__init__(message)
        self.section = section or {}
