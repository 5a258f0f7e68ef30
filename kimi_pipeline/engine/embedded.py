"""The embedded rollout engine as a Ray actor: our own decoder (`model.EngineModel`) behind SGLang's HTTP API
(`server.EngineServer`), so the trainer and eval talk to it exactly as to an SGLang server."""

from __future__ import annotations

import os

import torch

from kimi_pipeline.engine.key import engine_api_key
from kimi_pipeline.engine.model import EngineModel
from kimi_pipeline.engine.rollout_engine import RolloutEngine
from kimi_pipeline.engine.server import EngineServer
from kimi_pipeline.model.device import actor_gpu_index, resolve_device
from kimi_pipeline.util.net import bind_host


class EmbeddedEngine:
    """One embedded engine process; the same start / get_url / stop as `sglang.SGLangEngine`."""

    def __init__(self, model_path: str, seed: int, host: str = "127.0.0.1", device: str = "cpu",
                 base_gpu_id: int = 0, decode_mode: str | None = None):
        """`device`: the recipe's cluster.device; `base_gpu_id`: the node-local GPU the actor layout gave this
        engine (as SGLang's --base-gpu-id), used as such when the actor picks its own GPU (colocated);
        `decode_mode`: RolloutEngine's (None: CUDA graphs where the model's device and dtype allow them)."""
        self.model_path, self.seed, self.host = model_path, seed, host
        self.device, self.base_gpu_id, self.decode_mode = device, base_gpu_id, decode_mode
        self.server = None

    def start(self) -> str:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        device = resolve_device(self.device, actor_gpu_index(self.base_gpu_id))
        model = EngineModel.from_pretrained(self.model_path, device=device)
        engine = RolloutEngine(model, seed=self.seed, decode_mode=self.decode_mode)
        host = bind_host(self.host)
        self.server = EngineServer(engine, host, 0, None, self.model_path, api_key=engine_api_key())
        return self.server.start()

    def get_url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
