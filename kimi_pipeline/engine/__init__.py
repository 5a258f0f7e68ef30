"""Rollout engines behind one HTTP client.

- model.EngineModel: our batched DeepSeek-V3 forward (absorbed MLA over a latent KV cache, grouped MoE),
  loaded from HF-named tensors.
- sampler.RolloutEngine: `generate(prompts, n, SamplingParams) -> list[Completion]` with per-token logprobs,
  routed experts and finish reasons.
- static_decode.StaticDecoder: the static-shape decode step the engine runs eagerly ("static") or captured in
  CUDA graphs per batch / cache-length bucket ("graphs", the default where the GPU and dtype allow them).
- server.EngineServer: the embedded engine behind SGLang's HTTP endpoints (import it explicitly; it pulls
  in FastAPI/uvicorn).
- client.EngineClient / client.Router: one client for embedded and SGLang servers.
- sglang.SGLangEngine: launches `sglang.launch_server` (GPU only) inside a Ray actor.
"""

from kimi_pipeline.engine.model import EngineConfig, EngineModel, EngineWeightError
from kimi_pipeline.engine.rollout_engine import Completion, EngineInputError, RolloutEngine, SamplingParams

__all__ = ["Completion", "EngineConfig", "EngineInputError", "EngineModel", "EngineWeightError", "RolloutEngine",
           "SamplingParams"]
