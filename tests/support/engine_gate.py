"""Holds a rollout engine at a chosen point of its work, so a test can SIGKILL it exactly there.

Installed in every worker of a test's Ray cluster by Ray's `worker_process_setup_hook` (`support.gates`); it does
nothing until armed. Armed by a file `<$KIMI_TEST_ENGINE_GATE>/arm` naming a point and a count:

- `generate 1`: the engine took a batch of requests and answered none (`RolloutEngine.generate` entered);
- `decode K`: the K-th decode step after the arm (mid-batch: tokens decoded, no request answered);
- `weights 1`: a weight bucket of a sync arrived (`EngineModel.load_weights`: the trainer waits on the answer).

The first engine process to reach the point takes the arm (renames it to `held-<pid>`, so an engine restarted in
its place never holds) and sleeps until the test's SIGKILL. The engine modules are patched when a worker imports
them (a meta-path finder), so workers that never serve pay nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time
from pathlib import Path

GATE_ENV = "KIMI_TEST_ENGINE_GATE"
POINTS = ("generate", "decode", "weights")


def _hold_if_armed(gate: Path, point: str, seen: dict[tuple, int]) -> None:
    arm = gate / "arm"
    try:
        st = arm.stat()
        what, count = arm.read_text().split()
    except (OSError, ValueError):
        return
    if what != point:
        return
    key = (st.st_ino, st.st_mtime_ns)
    seen[key] = seen.get(key, 0) + 1
    if seen[key] < int(count):
        return
    # The point is on disk, whole, before `held-<pid>` appears: the test's killer reads it as soon as it sees `held-`.
    point_file, tmp = gate / f"point-{os.getpid()}", gate / f"point-{os.getpid()}.tmp"
    tmp.write_text(f"{point} {count}")
    tmp.rename(point_file)
    try:
        os.rename(arm, gate / f"held-{os.getpid()}")  # one taker
    except OSError:
        point_file.unlink(missing_ok=True)
        return
    while True:  # until the test's SIGKILL
        time.sleep(1)


def _patch(module, gate: Path) -> None:
    seen: dict[tuple, int] = {}

    def gated(cls, name: str, point: str) -> None:
        real = getattr(cls, name)

        def wrapper(*args, **kwargs):
            _hold_if_armed(gate, point, seen)
            return real(*args, **kwargs)

        setattr(cls, name, wrapper)

    if module.__name__ == "kimi_pipeline.engine.rollout_engine":
        gated(module.RolloutEngine, "generate", "generate")
    elif module.__name__ == "kimi_pipeline.engine.server":
        gated(module.BatchScheduler, "_step_hook", "decode")
    elif module.__name__ == "kimi_pipeline.engine.model":
        gated(module.EngineModel, "load_weights", "weights")


TARGETS = ("kimi_pipeline.engine.rollout_engine", "kimi_pipeline.engine.server", "kimi_pipeline.engine.model")


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds the engine modules with the normal finders and patches each once it has run."""

    def __init__(self, gate: Path) -> None:
        self.gate = gate

    def find_spec(self, fullname, path, target=None):
        if fullname not in TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader, gate = spec.loader, self.gate

        class Loader(importlib.abc.Loader):
            def create_module(self, s):
                return loader.create_module(s)

            def exec_module(self, module):
                loader.exec_module(module)
                _patch(module, gate)

        spec.loader = Loader()
        return spec


def install() -> None:
    gate = os.environ.get(GATE_ENV)
    if gate:
        sys.meta_path.insert(0, _PatchOnImport(Path(gate)))
