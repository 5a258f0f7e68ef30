"""The embedded rollout engine as a Ray actor: our own decoder (`model.EngineModel`) behind SGLang's HTTP API
(`server.EngineServer`), so the trainer and eval talk to it exactly as to an SGLang server."""

from __future__ import annotations

import os

import torch


class EmbeddedEngine:
    """One embedded engine process; the same start / get_url / stop as `sglang.SGLangEngine`."""

    def __init__(self, model_path: str, seed: int, host: str = "127.0.0.1", device: str | None = None):
        self.model_path, self.seed, self.host, self.device = model_path, seed, host, device
        self.server = None

    def start(self) -> str:
        from kimi_pipeline.rl.engine.model import EngineModel
        from kimi_pipeline.rl.engine.sampler import RolloutEngine
        from kimi_pipeline.rl.engine.server import EngineServer

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        model = EngineModel.from_pretrained(self.model_path, device=device)
        self.server = EngineServer(RolloutEngine(model, seed=self.seed), self.host, 0, None, self.model_path)
        return self.server.start()

    def get_url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
