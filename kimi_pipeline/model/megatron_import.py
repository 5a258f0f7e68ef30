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

Also, in every process: megatron's timers and its dynamic-inference context and engine import wandb at module top
(`try: import wandb`) for metric writers a caller passes in, which the pipeline never does (it runs neither
megatron's inference engine nor its timers' writers): 0.25-0.4 CPU-s in each of the ~150 processes of a test suite
that import megatron (measured 2026-11-28, 2-core AMD EPYC: megatron through this package 2.21-2.82 CPU-s, 1.96-2.20
without wandb). Those three modules run with wandb unimportable, as where it is not installed (their `wandb = None`
branch); wandb itself stays importable for the pipeline's own W&B logger (report/metrics_log.py).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable
from types import ModuleType

JIT_MODULE = "megatron.core.jit"
# megatron modules whose only use of wandb is a writer argument the pipeline never passes (see the docstring)
WANDB_FREE = ("megatron.core.timers", "megatron.core.inference.contexts.dynamic_context",
              "megatron.core.inference.engines.dynamic_engine")


def dynamo_disabled() -> bool:
    """torch's own switch (torch/_dynamo/config.py: `disable = os.environ.get("TORCHDYNAMO_DISABLE") == "1"`)."""
    return os.environ.get("TORCHDYNAMO_DISABLE") == "1"


Exec = Callable[[ModuleType], None]  # a loader's exec_module


def _spec_running(finder: importlib.abc.MetaPathFinder, name: str, path, target,
                  around: Callable[[Exec, ModuleType], None]) -> importlib.machinery.ModuleSpec | None:
    """`name`'s spec from the finders other than `finder`, its module executed through `around(exec_module, module)`
    (both finders below wrap a megatron module's execution this way)."""
    others = (f for f in sys.meta_path if f is not finder and hasattr(f, "find_spec"))
    spec = next((s for f in others if (s := f.find_spec(name, path, target)) is not None), None)
    if spec is None or spec.loader is None:
        return spec
    run = spec.loader.exec_module
    spec.loader.exec_module = lambda module: around(run, module)  # type: ignore[method-assign]
    return spec


class _EagerJitFuser(importlib.abc.MetaPathFinder):
    """Finds megatron's jit module once (through the other finders) and disables its fuser right after it runs."""

    def find_spec(self, name: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        if name != JIT_MODULE:
            return None
        sys.meta_path.remove(self)  # once
        return _spec_running(self, name, path, target, _then_disable_jit_fuser)


def _then_disable_jit_fuser(run: Exec, module: ModuleType) -> None:
    run(module)
    module.disable_jit_fuser()


class _WithoutWandb(importlib.abc.MetaPathFinder):
    """Runs the WANDB_FREE modules with `import wandb` failing, unless wandb is imported already (then it costs
    nothing and they take it)."""

    def find_spec(self, name: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        if name not in WANDB_FREE or "wandb" in sys.modules:
            return None
        return _spec_running(self, name, path, target, _without_wandb)


def _without_wandb(run: Exec, module: ModuleType) -> None:
    sys.modules["wandb"] = None  # type: ignore[assignment]  # `import wandb` raises ImportError
    try:
        run(module)
    finally:
        if sys.modules.get("wandb", 0) is None:
            del sys.modules["wandb"]


def megatron_without_wandb() -> None:
    """Install the finder (once) for the WANDB_FREE modules not imported yet."""
    if not any(isinstance(f, _WithoutWandb) for f in sys.meta_path):
        sys.meta_path.insert(0, _WithoutWandb())


def eager_fused_functions_when_dynamo_is_off() -> bool:
    """Install the finder if dynamo is off and megatron's jit module has not run yet; returns whether it did."""
    if not dynamo_disabled() or JIT_MODULE in sys.modules:
        return False
    if not any(isinstance(f, _EagerJitFuser) for f in sys.meta_path):
        sys.meta_path.insert(0, _EagerJitFuser())
    return True
