"""The stand-in actor of `kimi rehearse` (`rehearse.py`), in a module of its own: Ray imports an actor's module in
every worker process it starts for it, and this one needs only Ray. Beside `rehearse` (which reaches torch through
the actor layout and the engines) each stand-in's worker took 4.5 s of CPU to import; here, 0.8 s."""

from __future__ import annotations

import os
from typing import Any

import ray

# what a stand-in reports of its environment: the variables the real actors' options set or must not set
REPORTED_ENV = ("CUDA_VISIBLE_DEVICES", "NCCL_TIMEOUT", "CUDA_DEVICE_MAX_CONNECTIONS", "OMP_NUM_THREADS",
                "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES")


class StandIn:
    """A trainer rank, engine node or the rollout manager with the real actor's options; it only reports where
    it landed."""

    def __init__(self, role: str):
        self.role = role

    def report(self) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        return {"actor": self.role, "node_id": ctx.get_node_id(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "env": {k: os.environ[k] for k in REPORTED_ENV if k in os.environ}}
