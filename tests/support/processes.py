"""Reading processes a test did not start and cannot hold still: any of them may exit between a listing and a read."""

from __future__ import annotations

import psutil


def cmdline(p: psutil.Process) -> list[str]:
    """`p`'s command line, or [] where it exited since it was listed (or is not ours to read)."""
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def alive(p: psutil.Process) -> bool:
    """Running and not a zombie (an exited child its parent has not reaped yet holds nothing)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
