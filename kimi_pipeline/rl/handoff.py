"""The colocated memory handoff: who holds the GPUs in each phase of an RL step, and the calls that move them.

Trainer and engines share every GPU when `cluster.colocate` is on, so they take turns, in the order the seeds'
framework runs them (slime/miles `train.py` with --offload-rollout / --offload-train):

    rollout      engines: weights + KV cache + CUDA graphs     trainer: asleep (its device state on the host)
    train        engines: nothing (released)                   trainer: weights + grads + optimizer
    weight_sync  engines: weights only                         trainer: weights (the sync gathers from them)

Moving to a phase frees first, then takes: rollout -> train releases the engines' memory, then wakes the
trainer; train -> weight_sync puts the trainer's grads and optimizer to sleep, then resumes the engines' weights;
weight_sync -> rollout puts the trainer's weights to sleep, then resumes the KV cache and graphs. Engines need
SGLang's `--enable-memory-saver` (`sglang_command(memory_saver=...)`); the embedded engine implements the same
calls. The table it runs, `plan.residency.RESIDENT`, is also what `kimi plan` counts per phase, so the plan's peak
is the sequence this module runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kimi_pipeline.engine.rollout_engine import MEMORY_TAGS
from kimi_pipeline.model.offload import PARTS
from kimi_pipeline.plan.residency import PHASES, RESIDENT

log = logging.getLogger(__name__)


class Handoff:
    """Moves a colocated run between phases; without colocation every call is a no-op (each side keeps its GPUs).

    `engine_memory(action, tags)` releases / resumes engine memory (the rollout manager's engines);
    `trainer_memory(action, parts)` puts trainer state to sleep / wakes it (every trainer rank). `events` records the
    moves in order."""

    def __init__(self, colocated: bool, engine_memory: Callable[[str, tuple[str, ...]], None],
                 trainer_memory: Callable[[str, tuple[str, ...]], None]) -> None:
        self.colocated, self.engine_memory, self.trainer_memory = colocated, engine_memory, trainer_memory
        # at start-up both sides hold everything they loaded: the first move frees whatever its phase does not hold
        self.engine_held: tuple[str, ...] = MEMORY_TAGS
        self.trainer_held: tuple[str, ...] = PARTS
        self.phase: str | None = None
        self.events: list[tuple[str, str, tuple[str, ...]]] = []
        self.seconds = 0.0  # spent moving memory since the last `take_seconds`

    def take_seconds(self) -> float:
        """Seconds spent in moves since the last call (a step's `handoff_seconds`)."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def to(self, phase: str) -> None:
        if phase not in RESIDENT:
            raise ValueError(f"phase {phase!r}: one of {PHASES}")
        if not self.colocated or phase == self.phase:
            self.phase = phase
            return
        t0 = time.perf_counter()
        want_engine, want_trainer = RESIDENT[phase]
        self._move("engines", "release", [t for t in self.engine_held if t not in want_engine])
        self._move("trainer", "sleep", [p for p in self.trainer_held if p not in want_trainer])
        self._move("trainer", "wake", [p for p in want_trainer if p not in self.trainer_held])
        self._move("engines", "resume", [t for t in want_engine if t not in self.engine_held])
        self.engine_held, self.trainer_held, self.phase = tuple(want_engine), tuple(want_trainer), phase
        self.seconds += time.perf_counter() - t0

    def _move(self, side: str, action: str, what: list[str]) -> None:
        if not what:
            return
        (self.engine_memory if side == "engines" else self.trainer_memory)(action, tuple(what))
        self.events.append((side, action, tuple(what)))
        log.debug("colocated handoff: %s %s %s", side, action, ", ".join(what))
