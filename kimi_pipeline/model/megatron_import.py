"""megatron-core's fused functions without torch.compile where dynamo is off (no torch import here: any process
that later imports megatron runs this first, through `kimi_pipeline.model`).

megatron decorates its small fused functions with `jit_fuser` as its modules import (core/jit.py: torch.compile on
torch >= 2.2), and `torch.compile(fn)` imports torch._dynamo to build its wrapper even when TORCHDYNAMO_DISABLE=1
(torch/__init__.py `compile`: `get_default_backend`, then `torch._dynamo.optimize`) — 1.9-2.1 CPU-s for that import
alone, in every process, for wrappers that, with dynamo off, call the function unchanged (measured 2026-11-28, 2-core
AMD EPYC beside a running suite: megatron imported through this package 4.5 CPU-s with the switch, 5.6 without,
medians of three). Where TORCHDYNAMO_DISABLE=1 (every CPU rank
and actor: `megatron_compat.CPU_ENV`), megatron's own `disable_jit_fuser()` (core/jit.py: `noop_decorator`) is called
as soon as its jit module has run, before any fused module imports `jit_fuser`: the functions run eagerly as they
would through the disabled wrapper. A GPU process has dynamo on and keeps torch.compile.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType

JIT_MODULE = "megatron.core.jit"


def dynamo_disabled() -> bool:
    """torch's own switch (torch/_dynamo/config.py: `disable = os.environ.get("TORCHDYNAMO_DISABLE") == "1"`)."""
    return os.environ.get("TORCHDYNAMO_DISABLE") == "1"


class _EagerJitFuser(importlib.abc.MetaPathFinder):
    """Finds megatron's jit module once (through the other finders) and disables its fuser right after it runs."""

    def find_spec(self, name: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        if name != JIT_MODULE:
            return None
        sys.meta_path.remove(self)  # once: the next lookup (ours, just below) goes to the real finders
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            module.disable_jit_fuser()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def eager_fused_functions_when_dynamo_is_off() -> bool:
    """Install the finder if dynamo is off and megatron's jit module has not run yet; returns whether it did."""
    if not dynamo_disabled() or JIT_MODULE in sys.modules:
        return False
    if not any(isinstance(f, _EagerJitFuser) for f in sys.meta_path):
        sys.meta_path.insert(0, _EagerJitFuser())
    return True
