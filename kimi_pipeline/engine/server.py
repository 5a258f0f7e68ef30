"""The embedded engine behind SGLang's HTTP API, so one client drives both engines (and CI tests it for real).

Endpoints and JSON shapes follow SGLang's server where practical:

- POST /generate {input_ids: [ids] | [[ids], ...], sampling_params: {temperature, top_p, top_k,
  max_new_tokens, stop_token_ids, ignore_eos, n, sampling_seed}, return_logprob, return_routed_experts, rid}
  (as in SGLang, stop_token_ids add to the model's EOS unless ignore_eos is true)
  → one {text, output_ids, meta_info} per sample (a list unless one prompt and n == 1), prompt-major.
  meta_info: id, prompt_tokens, completion_tokens, finish_reason {type: stop|length|abort, matched|length},
  weight_version, output_token_logprobs [[logprob, token_id, null], ...], routed_experts = base64 of int32
  [prompt_tokens + completion_tokens - 1, num_hidden_layers, topk] (dense layers zero), as SGLang sends it.
- POST /update_weights_from_tensor {serialized_named_tensors: [...], load_format, flush_cache, weight_version}.
  SGLang unpickles this payload (CUDA-IPC handles); we never unpickle anything. load_format "kimi_shm": each
  entry is the JSON descriptor of a shared-memory bucket a colocated trainer wrote (`shm.py`); "safetensors":
  each entry is base64 safetensors bytes (HF-named tensors; one call per update-weight buffer).
- POST /init_weights_update_group {master_address, master_port, rank_offset, world_size, group_name, backend},
  POST /update_weights_from_distributed {names, dtypes, shapes, group_name, weight_version}, POST
  /destroy_weights_update_group {group_name}: non-colocated sync, tensors broadcast by the trainer over a
  gloo (CPU) / NCCL (GPU) group formed as SGLang forms it (`dist_group.py`).
- POST /begin_weight_update, POST /end_weight_update: SGLang 0.5.23's weight-update session; tensor and
  distributed updates outside one are refused with SGLang's 400, so the CPU suite makes the calls a GPU run makes.
- POST /release_memory_occupation {tags}, POST /resume_memory_occupation {tags} (weights, kv_cache, cuda_graph):
  the colocated memory handoff; released memory refuses generation (503) until resumed, resumed weights until
  a sync has filled every one of them.
- POST /update_weights_from_disk {model_path, weight_version}; POST /pause_generation {mode: in_place |
  abort}; POST /continue_generation; POST /flush_cache; POST /abort_request {rid | abort_all};
  GET /health; GET /health_generate; GET /server_info (start-up configuration); GET /model_info (live
  weight_version; SGLang's /get_server_info and /get_model_info are their deprecated names, served too).

Requests are queued and batched: whatever arrived while the engine was busy runs as one batch (grouped
by sampling settings), so many small concurrent requests cost about what one big request costs.
Pause (in place) holds a running batch between decode steps; weights may change under it, exactly as
with SGLang's in-place pause.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import hmac
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from fastapi import FastAPI, HTTPException, Query
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict
from safetensors.torch import load as load_safetensors

from kimi_pipeline.engine.key import KEY_FILE_VAR, KEY_VAR, engine_api_key
from kimi_pipeline.engine.model import EngineModel, EngineWeightError, config_summary, iter_safetensors
from kimi_pipeline.engine.rollout_engine import (
    ENGINE_NAME,
    FINISH_ABORT,
    Completion,
    EngineInputError,
    EngineUnavailable,
    RolloutEngine,
    SamplingParams,
    memory_tags,
    row_seeds,
)
from kimi_pipeline.engine.static_decode import DECODE_MODES
from kimi_pipeline.model.device import resolve_device
from kimi_pipeline.model.tokenizer import load_tokenizer
from kimi_pipeline.util.threads import one_intraop_thread_for_helpers
from kimi_pipeline.weight_sync import shm
from kimi_pipeline.weight_sync.dist_group import broadcast, dtype_from_name, flattened_views, leave_group, make_group

log = logging.getLogger(__name__)

# SGLang's /flush_cache answer when it flushed (http_server.py:1030-1034), plain text
FLUSHED_TEXT = ("Cache flushed.\nPlease check backend logs for more details. "
                "(When there are running or waiting requests, the operation will not be performed.)\n")

# SGLang sampling keys that only shape detokenized text (we return token ids): accepted and ignored
_TEXT_ONLY_KEYS = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stop", "custom_params"}
# keys that would change what is sampled: accepted only at their neutral value
_NEUTRAL = {"min_new_tokens": 0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
            "min_p": 0.0, "regex": None, "json_schema": None, "ebnf": None, "logit_bias": None}


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    input_ids: list[int] | list[list[int]] | None = None
    text: str | list[str] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool = False
    return_routed_experts: bool = False
    rid: str | list[str] | None = None
    stream: bool = False


class TensorUpdate(BaseModel):
    serialized_named_tensors: list[str]
    load_format: str | None = "safetensors"
    flush_cache: bool = True
    weight_version: str | None = None


class GroupInit(BaseModel):
    model_config = ConfigDict(extra="ignore")
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "gloo"


class DistributedUpdate(BaseModel):
    model_config = ConfigDict(extra="ignore")
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    weight_version: str | None = None
    load_format: str | None = None  # "flattened_bucket": one uint8 broadcast (sglang 0.5.23 io_struct.py:2015)


class GroupDestroy(BaseModel):
    model_config = ConfigDict(extra="ignore")
    group_name: str = "weight_update_group"


class VersionUpdate(BaseModel):
    model_config = ConfigDict(extra="ignore")
    new_version: str


class DiskUpdate(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model_path: str
    load_format: str | None = None
    weight_version: str | None = None


class SessionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # SGLang's `selector` (target / draft runners): one runner here


class MemoryRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    tags: list[str] | None = None  # None or empty: every tag, as SGLang reads it


class PauseRequest(BaseModel):
    mode: str = "in_place"


class AbortRequest(BaseModel):
    rid: str | None = None
    abort_all: bool = False


def sampling_params_from_json(sp: dict[str, Any], eos_token_ids: tuple[int, ...] = ()) -> tuple[SamplingParams, int]:
    """SGLang sampling_params → (SamplingParams, n). Unsupported sampling features are a 400, never ignored.

    SGLang stops on EOS plus any stop_token_ids, and `ignore_eos` turns off both (sglang 0.5.23
    `srt/managers/schedule_batch.py:1856-1858` returns before the stop ids are read); SamplingParams takes the
    exact set. top_k is -1 (off) or >= 1; 0 is SGLang's 400 (`srt/sampling/sampling_params.py:209, 249-266`)."""
    sp = dict(sp or {})
    n = int(sp.pop("n", 1) or 1)
    for key in _TEXT_ONLY_KEYS:
        value = sp.pop(key, None)
        if key == "stop" and value:
            raise EngineInputError("sampling_params.stop (strings) is not supported: use stop_token_ids")
    for key, neutral in _NEUTRAL.items():
        value = sp.pop(key, neutral)
        if value != neutral and value is not None:
            raise EngineInputError(f"sampling_params.{key}={value!r} is not supported by the embedded engine")
    known = {"temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "ignore_eos", "sampling_seed", "seed"}
    unknown = sorted(set(sp) - known)
    if unknown:
        raise EngineInputError(f"unknown sampling_params {unknown}; supported: {sorted(known | {'n'})}")
    stop = [int(t) for t in sp.get("stop_token_ids") or []]
    if sp.get("ignore_eos", False):
        stop = []  # SGLang: ignore_eos disables the stop ids too
    else:
        stop = list(eos_token_ids) + [t for t in stop if t not in eos_token_ids]
    seed = sp.get("sampling_seed", sp.get("seed"))
    top_k = int(sp["top_k"]) if sp.get("top_k") is not None else -1
    if top_k < 1 and top_k != -1:
        raise EngineInputError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    params = SamplingParams(
        temperature=float(sp.get("temperature", 1.0)),
        top_p=float(sp.get("top_p", 1.0)),
        top_k=top_k,
        max_new_tokens=int(sp.get("max_new_tokens", 128)),
        stop_token_ids=tuple(stop),
        seed=int(seed) if seed is not None else None,
    )
    return params, n


def request_sampling(sp: dict[str, Any] | list[dict[str, Any]] | None, prompts: int,
                     eos_token_ids: tuple[int, ...] = ()) -> tuple[SamplingParams, int, list[int | None]]:
    """A /generate body's sampling_params — one dict for every prompt, or one per prompt as SGLang takes them
    (`srt/managers/io_struct.py:227, 534-547`) — as (params, n, the seed of each row, prompt-major; None: unseeded).
    Per-prompt dicts may differ only in sampling_seed (one batch samples them together). Each prompt's n rows
    share its seed, as in SGLang (`sampling_batch_info.py:157-170`): with one seed they sample alike."""
    entries = sp if isinstance(sp, list) else [sp or {}] * prompts
    if len(entries) != prompts:
        raise EngineInputError(f"sampling_params has {len(entries)} entries for {prompts} prompts")
    parsed = [sampling_params_from_json(e, eos_token_ids) for e in entries]
    params, n = parsed[0]
    common = dataclasses.replace(params, seed=None)
    for p, k in parsed[1:]:
        if k != n:
            raise EngineInputError("every entry of sampling_params must have the same n")
        if dataclasses.replace(p, seed=None) != common:
            raise EngineInputError("per-prompt sampling_params may differ only in sampling_seed")
    return common, n, [p.seed for p, _ in parsed for _ in range(n)]


def encode_routed_experts(experts: np.ndarray, num_layers: int, first_k_dense: int) -> str:
    """[T-1, moe_layers, topk] → base64 int32 [T-1, num_layers, topk] (SGLang's wire layout, dense layers 0)."""
    full = np.zeros((experts.shape[0], num_layers, experts.shape[2]), dtype=np.int32)
    full[:, first_k_dense:] = experts
    return base64.b64encode(full.tobytes()).decode("ascii")


@dataclass
class _Request:
    prompts: list[list[int]]
    n: int
    params: SamplingParams
    experts: bool
    rids: frozenset[str]
    seeds: list[int | None] | None = None  # per row (SGLang's sampling_seed); None: the params' seed or drawn
    future: Future = field(default_factory=Future)
    aborted: bool = False


class BatchScheduler:
    """One worker thread: drains the queue, batches compatible requests, honours pause/abort between steps."""

    def __init__(self, engine: RolloutEngine):
        self.engine = engine
        self._cond = threading.Condition()
        self._queue: list[_Request] = []
        self._running: list[_Request] = []
        self._paused = False
        self._abort_running = False
        self._stopping = False
        self._batches_run = 0
        self._rows_served = 0
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)
        self._thread.start()

    # --- control
    def submit(self, req: _Request) -> Future:
        with self._cond:
            if self._stopping:
                raise RuntimeError("engine is shutting down")
            self._queue.append(req)
            self._cond.notify_all()
        return req.future

    def pause(self, abort_running: bool = False) -> None:
        with self._cond:
            self._paused = True
            if abort_running:
                self._abort_running = bool(self._running)
            self._cond.notify_all()

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def abort(self, rid: str | None = None) -> int:
        """Abort queued and running requests (all, or the one with this rid); returns how many."""
        with self._cond:
            hit = [r for r in self._queue + self._running if rid is None or rid in r.rids]
            for r in hit:
                r.aborted = True
            queued = [r for r in self._queue if r.aborted]
            self._queue = [r for r in self._queue if not r.aborted]
            if self._running and all(r.aborted for r in self._running):
                self._abort_running = True
            self._cond.notify_all()
        for r in queued:
            r.future.set_result(_aborted(r, self.engine.weight_version))
        return len(hit)

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._paused = False
            self._abort_running = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
        for r in self._queue:
            r.future.set_exception(RuntimeError("engine stopped"))

    def state(self) -> dict[str, Any]:
        with self._cond:
            return {"paused": self._paused, "queued_requests": len(self._queue), "running_requests": len(self._running),
                    "batches_run": self._batches_run, "rows_served": self._rows_served}

    # --- worker
    def _step_hook(self) -> bool:
        with self._cond:
            while self._paused and not self._abort_running and not self._stopping:
                self._cond.wait()
            return self._abort_running or self._stopping

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and (self._paused or not self._queue):
                    self._cond.wait()
                if self._stopping:
                    return
                batch, self._queue = self._queue, []
                self._running = batch
                self._abort_running = False
            groups: dict[tuple, list[_Request]] = {}
            for r in batch:  # seeds are per row: seeded requests batch together and still repeat exactly
                groups.setdefault((r.params.batch_key(), r.experts), []).append(r)
            for reqs in groups.values():
                self._run_group(reqs)  # each group leaves the running batch before its answers go out (_finish)

    def _run_group(self, reqs: list[_Request]) -> None:
        prompts = [p for r in reqs for p in r.prompts for _ in range(r.n)]
        with self._cond:
            self._batches_run += 1
            self._rows_served += len(prompts)
        try:
            seeds = [s for r in reqs for s in self._row_seeds(r)]
            out = self.engine.generate(prompts, 1, reqs[0].params, reqs[0].experts, step_hook=self._step_hook,
                                       seeds=seeds)
        except Exception as exc:  # surfaced to every waiting HTTP request
            self._finish(reqs)
            for r in reqs:
                r.future.set_exception(exc)
            return
        self._finish(reqs)
        start = 0
        for r in reqs:
            count = len(r.prompts) * r.n
            mine = out[start : start + count]
            start += count
            if r.aborted:
                for c in mine:
                    c.finish_reason = FINISH_ABORT
            r.future.set_result(mine)


    def _finish(self, reqs: list[_Request]) -> None:
        """The requests leave the running batch before their answers go out, as in SGLang (the scheduler drops a
        finished request from its batch in the step that sends its output): a client that got every answer and
        then releases memory finds the engine idle, never "should be called only when server is idle"."""
        with self._cond:
            self._running = [r for r in self._running if all(r is not done for done in reqs)]

    def _row_seeds(self, r: _Request) -> list[int]:
        """Request r's row seeds: as sent, the params' seed spread over its rows, or drawn for unseeded rows."""
        rows = len(r.prompts) * r.n
        if r.seeds is None:
            return row_seeds(r.params.seed, rows) if r.params.seed is not None else self.engine.draw_seeds(rows)
        drawn = iter(self.engine.draw_seeds(sum(s is None for s in r.seeds)))
        return [s if s is not None else next(drawn) for s in r.seeds]


def _aborted(r: _Request, version: str) -> list[Completion]:
    return [Completion(list(p), [], [], FINISH_ABORT, weight_version=version) for p in r.prompts for _ in range(r.n)]


class EngineServer:
    """An HTTP server (uvicorn in a background thread) around a RolloutEngine. Bound to loopback by default."""

    def __init__(self, engine: RolloutEngine, host: str = "127.0.0.1", port: int = 0, tokenizer=None,
                 model_path: str | None = None, api_key: str | None = None):
        """`api_key`: required as `Authorization: Bearer` on every endpoint but /health* (SGLang's `--api-key`
        rule, sglang/srt/utils/auth.py); None: this process's run key (`engine.key`). There is no open server:
        on loopback too, any local user could otherwise swap the policy or abort the run's requests."""
        self.engine, self.host, self.port, self.tokenizer = engine, host, port, tokenizer
        self.model_path, self.api_key = model_path, api_key or engine_api_key()
        self.weight_groups: dict[str, Any] = {}  # group name -> process group with a trainer (weight_sync/dist_group.py)
        self.update_session = False  # between /begin_weight_update and /end_weight_update (SGLang's protocol)
        self.memory_events: list[tuple[str, tuple[str, ...]]] = []  # (release|resume, tags), in order
        self.scheduler: BatchScheduler | None = None
        self._server = None
        self._thread: threading.Thread | None = None
        self.app = self._build_app()

    # --- lifecycle
    def start(self, timeout_s: float = 30.0) -> str:
        import uvicorn

        if self._thread is not None:
            return self.url
        self.scheduler = BatchScheduler(self.engine)
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # accepted connections inherit it: a response written as headers + body otherwise waited for the
        # client's delayed ACK, 44 ms per request (measured), e.g. 0.14 s of a tiny weight sync
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((self.host, self.port))  # port 0: the OS picks a free port, no race
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, name="engine-http",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"engine HTTP server on {self.host}:{self.port} did not start")
            time.sleep(0.01)
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.scheduler is not None:
            self.scheduler.stop()
        self._server = self._thread = self.scheduler = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _idle(self) -> bool:
        """SGLang's `is_fully_idle(ignore_waiting=paused)` (scheduler.py:5518-5520): nothing runs, and nothing
        waits unless generation is paused."""
        state = self.scheduler.state()
        return not state["running_requests"] and (not state["queued_requests"] or state["paused"])

    def __enter__(self) -> EngineServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- app
    def _build_app(self) -> FastAPI:
        """SGLang's HTTP API, in three groups: generation, weight updates, control and info."""
        app = FastAPI(title="kimi-pipeline embedded rollout engine")

        @app.middleware("http")
        async def _auth(request, call_next):
            if not request.url.path.startswith("/health"):
                given = request.headers.get("authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                    return JSONResponse(status_code=401, content={"error": {"message": "missing or wrong API key"}})
            return await call_next(request)

        @app.exception_handler(EngineInputError)
        async def _bad_input(_, exc: EngineInputError):
            return _error(str(exc))

        @app.exception_handler(EngineUnavailable)
        async def _unavailable(_, exc: EngineUnavailable):
            return _error(str(exc), 503)

        @app.exception_handler(RequestValidationError)
        async def _invalid(_, exc: RequestValidationError):
            """A body that does not parse: SGLang's 400 ErrorResponse, not FastAPI's 422 (http_server.py:635-692)."""
            return JSONResponse(status_code=400, content={"object": "error", "message": str(exc),
                                                          "type": "Bad Request", "param": None, "code": 400})

        @app.exception_handler(HTTPException)
        async def _http_error(_, exc: HTTPException):
            """SGLang's ErrorResponse for an HTTPException (http_server.py:578-631), e.g. 404."""
            return JSONResponse(status_code=exc.status_code, content={
                "object": "error", "message": exc.detail, "type": str(exc.status_code), "param": None,
                "code": exc.status_code})

        self._add_generation_routes(app)
        self._add_weight_routes(app)
        self._add_control_routes(app)
        return app

    def _add_generation_routes(self, app: FastAPI) -> None:
        cfg = self.engine.config

        @app.post("/generate")
        async def generate(req: GenerateRequest):
            if req.stream:
                raise EngineInputError("stream=true is not supported by the embedded engine")
            if why := self.engine.unready_reason():  # memory released, or resumed and not yet synced: 503
                raise EngineUnavailable(f"the engine cannot generate: {why}")
            single, prompts = self._prompts(req)
            params, n, seeds = request_sampling(req.sampling_params, len(prompts), cfg.eos_token_ids)
            count = len(prompts) * n
            if req.rid is None:
                rids = [uuid.uuid4().hex for _ in range(count)]
            elif isinstance(req.rid, str):
                rids = [req.rid] if count == 1 else [f"{req.rid}-{i}" for i in range(count)]
            elif len(req.rid) == len(prompts):
                rids = [r if n == 1 else f"{r}-{j}" for r in req.rid for j in range(n)]
            else:
                raise EngineInputError(f"rid has {len(req.rid)} entries for {len(prompts)} prompts")
            t0 = time.perf_counter()
            names = frozenset(rids) | ({req.rid} if isinstance(req.rid, str) else set())
            fut = self.scheduler.submit(_Request(prompts, n, params, req.return_routed_experts, names, seeds))
            out = await asyncio.wrap_future(fut)
            latency = time.perf_counter() - t0
            items = [self._render(c, rid, req, latency) for c, rid in zip(out, rids)]
            # a JSONResponse, not the dict: FastAPI would first walk every value of a returned dict with
            # jsonable_encoder (fastapi/routing.py:360), on the event loop, ~13 % of a tiny run's engine CPU (py-spy);
            # `_render` builds JSON-native values only, so the body is the same bytes (JSONResponse.render either way)
            return JSONResponse(items[0] if single and n == 1 else items)

    def _add_weight_routes(self, app: FastAPI) -> None:
        """update_weights_from_tensor (shared memory or safetensors bodies), the weight-update process group
        (init / update_weights_from_distributed / destroy) and update_weights_from_disk."""
        engine = self.engine

        def apply(buckets, weight_version: str | None) -> dict[str, Any]:
            """Load buckets of HF-named tensors under the model lock; the last bucket of a sync carries the
            version (then no quantized weight may be left incomplete)."""
            names: list[str] = []
            with engine.model_lock, one_intraop_thread_for_helpers():  # a request thread: see util/threads.py
                for named in buckets:
                    names += engine.model.load_weights(named)
                if weight_version is not None:
                    engine.model.finish_update()
                    engine.weight_version = weight_version
            return _ok(f"updated {len(names)} tensors")

        def outside_session(endpoint: str) -> JSONResponse | None:
            """SGLang answers tensor and distributed updates outside a session with a 400 (weight_updater.py:192-197,
            234-239); so does this engine, so the CPU suite drives the calls a GPU run must make."""
            if self.update_session:
                return None
            return _fail(f"{endpoint} must run between begin_weight_update() and end_weight_update()")

        @app.post("/begin_weight_update")
        def begin_weight_update(req: SessionRequest | None = None):
            with engine.model_lock:
                if self.update_session:
                    return _fail("a weight-update session is already open; call end_weight_update() first")
                self.update_session = True
            return _ok("Success")

        @app.post("/end_weight_update")
        def end_weight_update(req: SessionRequest | None = None):
            with engine.model_lock:
                if not self.update_session:
                    return _fail("no weight-update session is open; call begin_weight_update() first")
                self.update_session = False
                try:
                    engine.model.finish_update()  # no quantized weight may be left waiting for its other parts
                except EngineWeightError as exc:
                    return _fail(str(exc))
            return _ok("Success")

        @app.post("/update_weights_from_tensor")
        def update_weights_from_tensor(req: TensorUpdate):
            if refused := outside_session("update_weights_from_tensor"):
                return refused
            if req.load_format == shm.LOAD_FORMAT:  # colocated: JSON descriptors of shared-memory buckets
                def mapped():
                    for text in req.serialized_named_tensors:
                        with shm.open_bucket(json.loads(text)) as named:
                            yield named

                try:
                    return apply(mapped(), req.weight_version)
                except (EngineWeightError, shm.SharedMemoryError, ValueError, TypeError) as exc:
                    return _fail(str(exc))

            if req.load_format not in (None, "safetensors"):
                return _fail(f"load_format={req.load_format!r}: only 'safetensors' and {shm.LOAD_FORMAT!r} are "
                             "accepted (pickled payloads are refused)")
            try:
                named = {}
                for blob in req.serialized_named_tensors:
                    named.update(load_safetensors(base64.b64decode(blob)))
                return apply([named], req.weight_version)
            except (EngineWeightError, ValueError) as exc:
                return _fail(str(exc))
            except Exception as exc:  # safetensors raises its own error types on corrupt bytes
                return _fail(f"could not read the safetensors payload: {exc}")

        @app.post("/init_weights_update_group")
        def init_weights_update_group(req: GroupInit):
            if req.backend == "nccl" and engine.model.device.type != "cuda":
                return _fail("backend nccl needs the engine on a GPU; this engine runs on "
                             f"{engine.model.device} (use gloo)")
            try:  # blocks until the trainer and every other engine have joined
                self.weight_groups[req.group_name] = make_group(req.master_address, req.master_port, req.rank_offset,
                                                                req.world_size, req.backend, req.group_name)
            except (RuntimeError, ValueError) as exc:
                return _fail(f"could not join weight-update group {req.group_name!r} at "
                             f"{req.master_address}:{req.master_port}: {exc}")
            return _ok(f"joined {req.group_name} as rank {req.rank_offset}")

        @app.post("/update_weights_from_distributed")
        def update_weights_from_distributed(req: DistributedUpdate):
            if refused := outside_session("update_weights_from_distributed"):
                return refused
            pg = self.weight_groups.get(req.group_name)
            if pg is None:
                return _fail(f"no weight-update group {req.group_name!r}: call /init_weights_update_group first")
            if not len(req.names) == len(req.dtypes) == len(req.shapes):
                return _fail("names, dtypes and shapes must have the same length")
            try:
                dtypes = [dtype_from_name(d) for d in req.dtypes]
            except ValueError as exc:
                return _fail(str(exc))
            if req.load_format not in (None, "flattened_bucket"):
                return _fail(f"load_format={req.load_format!r}: None or 'flattened_bucket'")
            if req.load_format == "flattened_bucket":
                # one uint8 buffer, tensors back to back, each at a multiple of its dtype's size, else refused before
                # the broadcast (sglang 0.5.23 weight_sync/tensor_bucket.py:87-112, weight_updater.py:310-319)
                try:
                    views = flattened_views(req.names, dtypes, req.shapes)
                except ValueError as exc:
                    return _fail(str(exc))
                flat = torch.empty(views[-1][1] if views else 0, dtype=torch.uint8, device=engine.model.device)
                broadcast(pg, flat, root=0)
                received = [(name, flat[end - dtype.itemsize * math.prod(shape):end].view(dtype).reshape(shape))
                            for (name, end), dtype, shape in zip(views, dtypes, req.shapes)]
            else:
                # receive everything the trainer broadcasts (a collective: never stop half-way), then load
                received = []
                for name, dtype, shape in zip(req.names, dtypes, req.shapes):
                    t = torch.empty(shape, dtype=dtype, device=engine.model.device)
                    broadcast(pg, t, root=0)
                    received.append((name, t))
            try:
                return apply([received], req.weight_version)
            except (EngineWeightError, ValueError) as exc:
                return _fail(str(exc))

        @app.post("/destroy_weights_update_group")
        def destroy_weights_update_group(req: GroupDestroy):
            pg = self.weight_groups.pop(req.group_name, None)
            if pg is None:
                return _fail(f"no weight-update group {req.group_name!r}")
            leave_group(pg)
            return _ok(f"left {req.group_name}")

        @app.post("/update_weight_version")
        def update_weight_version(req: VersionUpdate):
            with engine.model_lock:
                engine.weight_version = req.new_version
            return {"success": True, "message": f"Weight version updated to {req.new_version}",
                    "new_version": req.new_version}

        @app.post("/update_weights_from_disk")
        def update_weights_from_disk(req: DiskUpdate):
            """SGLang answers {success, message, num_paused_requests}, 200 or 400 (http_server.py:1300-1326)."""
            paused = self.scheduler.state()["paused"]
            try:
                with engine.model_lock, one_intraop_thread_for_helpers():
                    names = engine.model.load_weights(iter_safetensors(req.model_path), strict=True)
                    if req.weight_version is not None:
                        engine.weight_version = req.weight_version
            except EngineWeightError as exc:
                return JSONResponse({"success": False, "message": str(exc), "num_paused_requests": 0},
                                    status_code=400)
            self.model_path = req.model_path
            return {"success": True, "message": f"loaded {len(names)} tensors from {req.model_path}",
                    "num_paused_requests": self.scheduler.state()["queued_requests"] if paused else 0}

    def _add_control_routes(self, app: FastAPI) -> None:
        """Pause / continue / flush / abort, health and server info."""
        engine = self.engine
        cfg = engine.config

        @app.post("/pause_generation")
        def pause_generation(req: PauseRequest | None = None):
            mode = (req or PauseRequest()).mode
            if mode not in ("in_place", "abort"):
                raise EngineInputError(f"pause mode {mode!r}: supported modes are in_place and abort")
            self.scheduler.pause(abort_running=mode == "abort")
            # SGLang's answer (http_server.py:1831-1841)
            return {"message": "Generation paused successfully.", "status": "ok"}

        @app.post("/continue_generation")
        def continue_generation():
            self.scheduler.resume()
            return {"message": "Generation continued successfully.", "status": "ok"}  # http_server.py:1844-1855

        @app.api_route("/flush_cache", methods=["GET", "POST"])  # SGLang takes both; slime uses GET
        async def flush_cache(timeout: float = Query(0.0, ge=0.0)):
            """SGLang's plain-text answer (http_server.py:1025-1040): flushed only when no request runs and none
            waits (waiting ones count not while paused, scheduler.py:5518-5547); `timeout` waits that long for
            idle first (scheduler_components/flush_wrapper.py:28-36). No KV cache outlives a batch here, so there
            is nothing else to drop."""
            deadline = time.monotonic() + timeout
            while not self._idle() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            if self._idle():
                return Response(content=FLUSHED_TEXT, status_code=200)
            return Response(content="Flush cache failed.\n", status_code=400)

        @app.post("/abort_request")
        def abort_request(req: AbortRequest):
            """SGLang aborts the rid, or everything with abort_all, and answers an empty 200
            (http_server.py:1721-1731); an unknown rid is no error."""
            self.scheduler.abort(None if req.abort_all else req.rid or "")
            return Response(status_code=200)

        @app.get("/health")
        def health():
            return Response(status_code=200)  # SGLang: an empty 200 (http_server.py:721-752)

        @app.get("/health_generate")
        async def health_generate():
            token = cfg.eos_token_ids[0] if cfg.eos_token_ids else 0
            probe = _Request([[token]], 1, SamplingParams(max_new_tokens=1, seed=0), False, frozenset({"health"}))
            fut = self.scheduler.submit(probe)
            try:
                await asyncio.wait_for(asyncio.wrap_future(fut), timeout=60)
            except asyncio.TimeoutError:
                log.error("health check failed: the engine did not generate within 60 s (paused?)")
                return Response(status_code=503)  # SGLang: an empty 503 (http_server.py:780-799)
            return Response(status_code=200)

        @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
        def release_memory_occupation(req: MemoryRequest | None = None):
            tags = memory_tags((req or MemoryRequest()).tags)
            state = self.scheduler.state()
            # SGLang asserts the same (weight_updater.py:339-341): nothing running, nothing queued unless paused
            if state["running_requests"] or (state["queued_requests"] and not state["paused"]):
                return _error("release_memory_occupation should be called only when server is idle")
            engine.release_memory(tags)
            self.memory_events.append(("release", tuple(sorted(tags))))
            return None  # SGLang's handler returns None: a JSON null (http_server.py:1575-1584)

        @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
        def resume_memory_occupation(req: MemoryRequest | None = None):
            tags = memory_tags((req or MemoryRequest()).tags)
            engine.resume_memory(tags)
            self.memory_events.append(("resume", tuple(sorted(tags))))
            return None  # JSON null, as SGLang (http_server.py:1587-1596)

        @app.get("/server_info")
        @app.get("/get_server_info")  # SGLang's deprecated name
        def server_info():
            return {"engine": ENGINE_NAME, "weight_version": engine.weight_version, "model_path": self.model_path,
                    "hostname": socket.gethostname(), "weight_update_formats": ["safetensors", shm.LOAD_FORMAT, "distributed"],
                    "device": str(engine.model.device), "dtype": str(engine.model.dtype).replace("torch.", ""),
                    "max_batch_rows": engine.max_batch_rows, "decode_mode": engine.decode_mode,
                    **config_summary(cfg), **self.scheduler.state()}

        @app.get("/model_info")
        @app.get("/get_model_info")  # SGLang's deprecated name
        def model_info():
            """The live state a weight update changes, under SGLang's keys (`http_server.py:812-850`)."""
            return {"model_path": self.model_path, "served_model_name": self.model_path,
                    "tokenizer_path": self.model_path if self.tokenizer is not None else None, "is_generation": True,
                    "preferred_sampling_params": None, "weight_version": engine.weight_version,
                    "load_format": "auto", "reasoning_parser": None, "tool_call_parser": None,
                    "disaggregation_mode": "null", "has_image_understanding": False,
                    "has_audio_understanding": False, "model_type": "deepseek_v3",
                    "architectures": ["DeepseekV3ForCausalLM"]}

    def _prompts(self, req: GenerateRequest) -> tuple[bool, list[list[int]]]:
        if req.input_ids is not None:
            ids = req.input_ids
        elif req.text is not None:
            if self.tokenizer is None:
                raise EngineInputError("this engine has no tokenizer: send input_ids")
            texts = [req.text] if isinstance(req.text, str) else req.text
            ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
            ids = ids[0] if isinstance(req.text, str) else ids
        else:
            raise EngineInputError("send input_ids (a list of token ids, or a list of such lists)")
        if ids and isinstance(ids[0], int):
            return True, [ids]
        return False, ids

    def _render(self, c: Completion, rid: str, req: GenerateRequest, latency: float) -> dict[str, Any]:
        cfg = self.engine.config
        if c.finish_reason == "stop":
            finish = {"type": "stop", "matched": c.matched_stop}
        elif c.finish_reason == "length":
            finish = {"type": "length", "length": len(c.output_ids)}
        else:
            finish = {"type": "abort", "message": "aborted"}
        meta: dict[str, Any] = {"id": rid, "prompt_tokens": len(c.prompt_ids), "completion_tokens": len(c.output_ids),
                                "cached_tokens": 0, "finish_reason": finish, "weight_version": c.weight_version,
                                "e2e_latency": latency}
        if req.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(c.logprobs, c.output_ids)]
        if req.return_routed_experts and c.routed_experts is not None:
            meta["routed_experts"] = encode_routed_experts(c.routed_experts, cfg.num_layers, cfg.first_k_dense)
        text = self.tokenizer.decode(c.output_ids) if self.tokenizer is not None else ""
        return {"text": text, "output_ids": c.output_ids, "meta_info": meta}


def _ok(message: str) -> dict[str, Any]:
    """SGLang's answer to a weight update, the update group and the weight-update session: exactly
    {success, message} (http_server.py:1404-1500)."""
    return {"success": True, "message": message}


def _fail(message: str) -> JSONResponse:
    """Their failure: the same shape with 400."""
    return JSONResponse(status_code=400, content={"success": False, "message": message})


def _error(message: str, status_code: int = 400) -> JSONResponse:
    """SGLang's `_create_error_response` (http_server.py:2246-2250): {"error": {"message"}}."""
    return JSONResponse(status_code=status_code, content={"error": {"message": message}})


def main(argv: list[str] | None = None) -> None:
    """`python -m kimi_pipeline.engine.server --model-path DIR`: serve a checkpoint until interrupted."""
    ap = argparse.ArgumentParser(description="embedded rollout engine with SGLang's HTTP API")
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cpu", help="cluster.device of the recipe")
    ap.add_argument("--gpu", type=int, default=0, help="visible GPU index (with --device cuda)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--decode-mode", choices=DECODE_MODES, default=None,
                    help="decode steps: eager 'dynamic', eager 'static', or 'static' captured in CUDA 'graphs' "
                         "(default: graphs where the GPU and dtype allow them, else dynamic)")
    args = ap.parse_args(argv)
    if not (os.environ.get(KEY_VAR) or os.environ.get(KEY_FILE_VAR)):  # a key drawn here would be nobody's
        ap.error(f"the server requires a key its clients know: export {KEY_VAR}=$(openssl rand -hex 32) "
                 f"(or {KEY_FILE_VAR}=a 0600 file holding it), then send `Authorization: Bearer $KEY`")
    if args.threads:
        torch.set_num_threads(args.threads)

    model = EngineModel.from_pretrained(args.model_path, device=resolve_device(args.device, args.gpu))
    try:
        tokenizer = load_tokenizer(args.model_path)
    except Exception:  # a weights-only directory still serves input_ids
        tokenizer = None
    engine = RolloutEngine(model, seed=args.seed, decode_mode=args.decode_mode)
    server = EngineServer(engine, args.host, args.port, tokenizer, args.model_path)
    print(server.start(), flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
