"""Errors that retrying cannot fix (bad recipe, bad data, corrupt local files): tasks do not retry them."""

from __future__ import annotations


class PermanentError(RuntimeError):
    """Deterministic failure: the input must change before a retry can succeed."""


def is_permanent(exc: BaseException | None) -> bool:
    return isinstance(exc, PermanentError)
