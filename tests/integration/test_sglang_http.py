"""The client's endpoints as SGLang 0.5.23's own HTTP layer answers them, and the embedded engine answering the same.

SGLang's `sglang.srt.entrypoints.http_server.app` runs here on CPU, for real: `make sglang-parser` installs sglang
and what its HTTP layer imports (`tests/sglang-parser.txt`), and a subprocess (this file run as a script, so that
sglang's import-time side effects, uvloop's event-loop policy among them, stay out of pytest's process) serves
SGLang's own `app` with uvicorn. Only the tokenizer manager is replaced, by `_StandInManager`: SGLang's own
TokenizerManager methods for every control and weight endpoint (flush, pause / continue, abort, the weight-update
session, tensor / distributed / disk updates, weight version, memory release / resume, internal state), with the
scheduler behind them answered by a recording stand-in that returns the scheduler's own reply objects
(`io_struct.py`) as `weight_updater.py` builds them; and `/generate` answered in the shape
`tokenizer_manager.py:2505-2669` builds. SGLang's real `ServerArgs`, runtime context and `ModelConfig` (of the
tiny checkpoint) sit behind /model_info and /server_info.

One module is stubbed, for import only: `torchvision` (imported at module level by
`srt/multimodal/internvl_utils.py` through `srt/configs/__init__.py`; its only index wheels are CUDA builds whose
`_C` needs libtorch_cuda, and `torchvision/_meta_registrations.py:163` then fails against the CPU torch 2.13 with
`operator torchvision::nms does not exist`). The stub holds three empty modules and one placeholder name for a
`from ... import`; nothing calls into it on these endpoints, and it is taken out of `sys.modules` again once
`http_server` has imported.

Every endpoint the client uses is then driven through SGLang's app and through the embedded engine with the same
requests: same status codes, content types and body shapes. The client (`EngineClient`) is driven against SGLang's
app too, and what SGLang parsed out of its requests (its own request structs) is checked. The handlers' answers
are also read from the pinned source with `ast`, a check that needs no import at all.
"""

from __future__ import annotations

import ast
import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from support import engine_http
from support.common import random_tiny_hf

from kimi_pipeline.engine.client import EngineBadRequest, EngineClient
from kimi_pipeline.engine.model import EngineModel
from kimi_pipeline.engine.rollout_engine import RolloutEngine
from kimi_pipeline.engine.server import EngineServer
from kimi_pipeline.engine.sglang import PARSER_PATH_VAR
from kimi_pipeline.hf.config import hf_config_dict
from kimi_pipeline.model.hf_model import save_hf_model
from kimi_pipeline.recipes import load_recipe

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out: SGLang's own HTTP app and an engine process (~10 s)

# what each endpoint the client uses answers in SGLang 0.5.23 (route → handler's answer kind, JSON keys)
EMPTY, TEXT, NULL, SUCCESS, STATUS, JSON = "empty", "text", "null", "success-message", "message-status", "json"
EXPECTED: dict[str, tuple[str, frozenset[str]]] = {
    "/health": (EMPTY, frozenset()),
    "/health_generate": (EMPTY, frozenset()),
    "/abort_request": (EMPTY, frozenset()),
    "/flush_cache": (TEXT, frozenset()),
    "/release_memory_occupation": (NULL, frozenset()),
    "/resume_memory_occupation": (NULL, frozenset()),
    "/pause_generation": (STATUS, frozenset({"message", "status"})),
    "/continue_generation": (STATUS, frozenset({"message", "status"})),
    "/begin_weight_update": (SUCCESS, frozenset({"success", "message"})),
    "/end_weight_update": (SUCCESS, frozenset({"success", "message"})),
    "/update_weights_from_tensor": (SUCCESS, frozenset({"success", "message"})),
    "/update_weights_from_distributed": (SUCCESS, frozenset({"success", "message"})),
    "/init_weights_update_group": (SUCCESS, frozenset({"success", "message"})),
    "/destroy_weights_update_group": (SUCCESS, frozenset({"success", "message"})),
    "/update_weights_from_disk": (SUCCESS, frozenset({"success", "message", "num_paused_requests"})),
    "/update_weight_version": (SUCCESS, frozenset({"success", "message", "new_version"})),
    "/model_info": (JSON, frozenset({
        "model_path", "served_model_name", "tokenizer_path", "is_generation", "preferred_sampling_params",
        "weight_version", "load_format", "reasoning_parser", "tool_call_parser", "disaggregation_mode",
        "has_image_understanding", "has_audio_understanding", "model_type", "architectures"})),
    "/generate": (JSON, frozenset()),
    "/server_info": (JSON, frozenset()),
}


@pytest.fixture(scope="module")
def parser_dir() -> Path:
    """`make sglang-parser`'s directory (sglang and what its HTTP layer imports); absent: skipped, saying so."""
    d = Path(os.environ.get(PARSER_PATH_VAR, ""))
    if not os.environ.get(PARSER_PATH_VAR) or not (d / "sglang" / "srt" / "entrypoints" / "http_server.py").is_file():
        pytest.skip(f"no sglang in ${PARSER_PATH_VAR} ({str(d) or 'unset'}): run `make sglang-parser` (make test does)")
    return d


@pytest.fixture(scope="module")
def handlers(parser_dir) -> dict[str, ast.AsyncFunctionDef]:
    """Route → handler of the pinned SGLang's http_server.py."""
    path = parser_dir / "sglang" / "srt" / "entrypoints" / "http_server.py"
    out = {}
    for node in ast.parse(path.read_text()).body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for d in node.decorator_list:
            if (isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and isinstance(d.func.value, ast.Name)
                    and d.func.value.id == "app" and d.args and isinstance(d.args[0], ast.Constant)):
                out[d.args[0].value] = node
    return out


def _dict_keys(node: ast.AST, fn: ast.AST) -> frozenset[str] | None:
    """The keys of a dict literal, or of the dict literal a local name was assigned."""
    if isinstance(node, ast.Name):
        for a in ast.walk(fn):
            if isinstance(a, ast.Assign) and any(isinstance(t, ast.Name) and t.id == node.id for t in a.targets):
                return _dict_keys(a.value, fn)
        return None
    if isinstance(node, ast.Dict):
        return frozenset(k.value for k in node.keys if isinstance(k, ast.Constant))
    return None


def _answer(fn: ast.AsyncFunctionDef) -> tuple[str, frozenset[str]]:
    """What a handler answers when it succeeds, read from its body."""
    returns = [n for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value is not None]
    tried = [s for s in fn.body if isinstance(s, ast.Try)]
    if tried and not any(isinstance(n, ast.Return) for s in tried[0].body for n in ast.walk(s)):
        return NULL, frozenset()  # the success path falls off the end: None, which FastAPI sends as `null`
    for r in returns:
        call = r.value
        if not isinstance(call, ast.Call):
            continue
        name = call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", "")
        kw = {k.arg: k.value for k in call.keywords}
        if name == "Response" and "content" not in kw and not call.args and kw.get("status_code") is not None:
            status = kw["status_code"]
            if isinstance(status, ast.Constant) and status.value == 200:
                return EMPTY, frozenset()
        if name == "Response" and "content" in kw:
            return TEXT, frozenset()
        if name == "ORJSONResponse":
            keys = _dict_keys(kw.get("content", call.args[0] if call.args else None), fn)
            if keys == {"message", "status"}:
                return STATUS, keys
            if keys and "success" in keys:
                return SUCCESS, keys
    if fn.name == "model_info":
        return JSON, _dict_keys(ast.Name(id="result"), fn)
    return JSON, frozenset()


def test_the_pinned_sglang_answers_as_the_table_says(handlers):
    """Each endpoint the client uses, read from SGLang 0.5.23's source (what the client must take)."""
    assert set(EXPECTED) <= set(handlers), set(EXPECTED) - set(handlers)
    got = {path: _answer(handlers[path]) for path in EXPECTED}
    for path, (kind, keys) in EXPECTED.items():
        assert got[path][0] == kind, (path, got[path])
        if keys:
            assert got[path][1] == keys, (path, got[path])


@pytest.fixture(scope="module")
def server():
    torch.manual_seed(0)
    with EngineServer(RolloutEngine(EngineModel.from_hf_model(random_tiny_hf()), seed=0)) as s:
        yield s


def _kind(r: httpx.Response) -> tuple[str, frozenset[str]]:
    ctype = r.headers.get("content-type", "").split(";")[0]
    if not r.content:
        return EMPTY, frozenset()
    if ctype != "application/json":
        return TEXT, frozenset()
    body = r.json()
    if body is None:
        return NULL, frozenset()
    if isinstance(body, dict) and set(body) == {"message", "status"}:
        return STATUS, frozenset(body)
    if isinstance(body, dict) and "success" in body:
        return SUCCESS, frozenset(body)
    return JSON, frozenset(body) if isinstance(body, dict) else frozenset()


def test_the_embedded_engine_answers_every_endpoint_as_sglang(server, tmp_path):
    """The same endpoints through the embedded engine: status 200 and the answer kind and JSON keys of the table
    (content type included: text is not JSON, empty is empty, null is JSON null)."""
    url = server.url
    torch.manual_seed(0)
    hf_dir = save_hf_model(random_tiny_hf(), tmp_path / "hf", config=hf_config_dict(load_recipe("tiny").model))
    calls = _calls(hf_dir)[:16]  # the requests both servers answer with 200 (the last ones are refusals)
    for method, path, body in calls:
        r = engine_http.request(method, url + path, json=body, timeout=60)
        assert r.status_code == 200, (path, r.status_code, r.text)
        kind, keys = EXPECTED[path]
        got = _kind(r)
        assert got[0] == kind, (path, got, r.text[:200])
        if keys:
            assert got[1] == keys, (path, got[1] ^ keys)
    with EngineClient(url) as client:  # and the client takes every one of them
        client.flush_cache()
        client.abort()
        assert client.health() and client.health_generate()
        client.release_memory_occupation(["kv_cache"])
        client.resume_memory_occupation(["kv_cache"])
        client.pause()
        client.resume()
        assert client.weight_version() == "d2"


# --- SGLang's own app, served on CPU (the subprocess side: this file run as a script) -------------------------

def _stub_torchvision() -> list[str]:
    """Import-only stand-ins for torchvision (see the module docstring: its index wheels need CUDA's libtorch):
    empty modules, plus the one name `srt/multimodal/internvl_utils.py:7` and `srt/configs/deepseek_ocr.py:7` import,
    a class that cannot be made.
    Nothing on the endpoints checked here calls torchvision; any call would fail, not answer."""
    import types

    class InterpolationMode:  # torchvision.transforms.functional.InterpolationMode, only so the import resolves
        def __init__(self, *args, **kwargs):
            raise RuntimeError("torchvision is stubbed for import only in this test")

    names = ["torchvision", "torchvision.transforms", "torchvision.transforms.functional"]
    for name in names:
        assert name not in sys.modules, f"{name} already imported: the stub would hide it"
        sys.modules[name] = types.ModuleType(name)
    sys.modules["torchvision"].transforms = sys.modules["torchvision.transforms"]
    sys.modules["torchvision.transforms"].functional = sys.modules["torchvision.transforms.functional"]
    sys.modules["torchvision.transforms"].InterpolationMode = InterpolationMode  # srt/configs/deepseek_ocr.py:7
    sys.modules["torchvision.transforms.functional"].InterpolationMode = InterpolationMode
    return names


def _serve_sglang(model_path: str, record_path: str) -> None:
    """Serve `sglang.srt.entrypoints.http_server.app` on a free loopback port (printed as `PORT n`), its tokenizer
    manager replaced by `_StandInManager`, every call that reaches the scheduler appended to `record_path`."""
    import asyncio
    import dataclasses
    import socket

    import transformers.utils.import_utils  # noqa: F401  its package probes run before the stub exists

    stubbed = _stub_torchvision()
    import sglang.srt.entrypoints.http_server as http

    for name in stubbed:  # imported: nothing else in this process sees the stub
        del sys.modules[name]

    import msgspec
    import uvicorn
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.managers import io_struct as io
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.managers.tokenizer_manager import ServerStatus, TokenizerManager
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.aio_rwlock import RWLock

    server_args = ServerArgs(model_path=model_path, device="cpu", skip_tokenizer_init=True,
                             enable_return_routed_experts=True)
    publish(server_args, role="tokenizer")  # as `Engine._launch_subprocesses` does before the manager exists
    record = open(record_path, "a", buffering=1)

    def plain(obj):
        if isinstance(obj, msgspec.Struct):
            return {k: plain(v) for k, v in msgspec.structs.asdict(obj).items()}
        if dataclasses.is_dataclass(obj):
            return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        if isinstance(obj, (list, tuple)):
            return [plain(v) for v in obj]
        if isinstance(obj, dict):
            return {str(k): plain(v) for k, v in obj.items()}
        return obj if isinstance(obj, (str, int, float, bool, type(None))) else repr(obj)

    def log(call: str, obj) -> None:
        record.write(json.dumps({"call": call, "type": type(obj).__name__, "obj": plain(obj)}) + "\n")

    class _StandInManager:
        """SGLang's TokenizerManager where it meets the scheduler: its own methods for the control and weight
        endpoints (tokenizer_manager.py:2241-2394, tokenizer_control_mixin.py:325-600, 874-887, 967-974,
        1065-1076), the ZMQ round trips to the scheduler replaced by answers built as the scheduler builds them."""

        def __init__(self):
            # the attributes those methods and the handlers read (tokenizer_manager.py:535-778)
            self.server_args = server_args
            self.model_path = self.served_model_name = model_path
            self.model_config = ModelConfig.from_server_args(server_args)
            self.is_generation, self.skip_tokenizer_init, self.enable_metrics = True, True, False
            self.gracefully_exit, self.server_status = False, ServerStatus.Up
            self.last_receive_tstamp, self.startup_time = time.time(), None
            self.rid_to_state, self.mm_processor, self.elastic_worker_count = {}, None, 1
            self.model_update_lock, self.is_pause, self.is_pause_cond = RWLock(), False, asyncio.Condition()
            self.session_open = False  # the scheduler's weight-update session (weight_updater.py:305-335)
            self.flush_cache_communicator = self._scheduler(lambda r: io.FlushCacheReqOutput(success=True))
            self.init_weights_update_group_communicator = self._scheduler(
                lambda r: io.InitWeightsUpdateGroupReqOutput(success=True, message="Succeeded to initialize group."))
            self.destroy_weights_update_group_communicator = self._scheduler(
                lambda r: io.DestroyWeightsUpdateGroupReqOutput(success=True, message="Succeeded to destroy group."))
            self.begin_weight_update_communicator = self._scheduler(self._begin)
            self.end_weight_update_communicator = self._scheduler(self._end)
            self.update_weights_from_distributed_communicator = self._scheduler(self._in_session(
                io.UpdateWeightsFromDistributedReqOutput, "update_weights_from_distributed",
                "Succeeded to update parameter online."))
            self.update_weights_from_tensor_communicator = self._scheduler(self._in_session(
                io.UpdateWeightsFromTensorReqOutput, "update_weights_from_tensor",
                "Succeeded to update model weights."))
            self.release_memory_occupation_communicator = self._scheduler(
                lambda r: io.ReleaseMemoryOccupationReqOutput())
            self.resume_memory_occupation_communicator = self._scheduler(
                lambda r: io.ResumeMemoryOccupationReqOutput())
            self.update_weight_version_communicator = self._scheduler(lambda r: io.UpdateWeightVersionReqOutput())
            self.get_internal_state_communicator = self._scheduler(
                lambda r: io.GetInternalStateReqOutput(internal_state={"weight_version": self.config_value(
                    "weight_version")}))

        def auto_create_handle_loop(self):  # the loop reading the scheduler's replies: none here
            pass

        def _scheduler(self, answer):
            """A communicator (one reply per DP rank; one rank): records the request, answers as the scheduler."""
            async def call(obj):
                log("scheduler", obj)
                self.last_receive_tstamp = time.time()
                return [answer(obj)]
            return call

        def _begin(self, obj):  # weight_updater.py:309-321
            if self.session_open:
                return io.BeginWeightUpdateReqOutput(success=False, message="a weight-update session is already "
                                                     "open; call end_weight_update() first")
            self.session_open = True
            return io.BeginWeightUpdateReqOutput(success=True, message="Success")

        def _end(self, obj):  # weight_updater.py:323-335
            if not self.session_open:
                return io.EndWeightUpdateReqOutput(success=False, message="no weight-update session is open; "
                                                   "call begin_weight_update() first")
            self.session_open = False
            return io.EndWeightUpdateReqOutput(success=True, message="Success")

        def _in_session(self, out, what: str, done: str):  # weight_updater.py:188-197, 232-239, 213, 268
            def answer(obj):
                if not self.session_open:
                    return out(success=False, message=f"{what} must run between begin_weight_update() and "
                                                      "end_weight_update()")
                return out(success=True, message=done)
            return answer

        def _dispatch_to_scheduler(self, obj):
            log("scheduler", obj)
            if isinstance(obj, io.UpdateWeightFromDiskReqInput):  # weight_updater.py:141, 161-163
                self.model_update_result.set_result(io.UpdateWeightFromDiskReqOutput(
                    success=True, message="Succeeded to update model weights.", num_paused_requests=0))

        async def _async_dispatch_to_scheduler(self, obj):
            log("scheduler", obj)

        async def generate_request(self, obj, request=None):
            """One finished answer per request, built as `_handle_batch_output` builds it
            (tokenizer_manager.py:2505-2611, 2666-2669): finish_reason from the scheduler's FINISH_LENGTH,
            logprobs as `detokenize_logprob_tokens` returns them (:3098-3108), routed experts as the detokenizer
            encodes them (detokenizer_manager.py:432-446: base64 of the int32 [prompt + completion - 1,
            num_hidden_layers, topk] tensor, state_capturer/routed_experts.py:105, 166-173)."""
            obj.normalize_batch_and_arguments()  # SGLang's own (io_struct.py:406)
            log("generate", obj)
            hf = self.model_config.hf_config
            rows = [obj.input_ids] if obj.is_single else obj.input_ids
            rids = [obj.rid] if obj.is_single else obj.rid
            params = [obj.sampling_params] if obj.is_single else obj.sampling_params
            out = []
            for prompt, rid, sp in zip(rows, rids, params):
                count = int((sp or {}).get("max_new_tokens", 128))
                ids = [(7 * len(prompt) + i) % hf.vocab_size for i in range(count)]
                meta = {"id": rid, "finish_reason": FINISH_LENGTH(count).to_json(), "prompt_tokens": len(prompt),
                        "weight_version": self.config_value("weight_version"), "num_retractions": 0}
                if obj.return_logprob:
                    meta["input_token_logprobs"] = []
                    meta["output_token_logprobs"] = TokenizerManager.detokenize_logprob_tokens(
                        self, [-0.5] * count, ids, False)
                    meta["output_token_logprobs_length"] = count
                meta.update({"reasoning_tokens": 0, "completion_tokens": count, "cached_tokens": 0})
                if obj.return_routed_experts:
                    experts = np.zeros((len(prompt) + count - 1, hf.num_hidden_layers, hf.num_experts_per_tok),
                                       dtype=np.int32)
                    meta["routed_experts"] = base64.b64encode(experts.tobytes()).decode("utf-8")
                out.append({"text": "", "output_ids": ids, "meta_info": meta})
            self.last_receive_tstamp = time.time()
            yield out[0] if obj.is_single else out

    for name in ("abort_request", "pause_generation", "continue_generation", "update_weights_from_disk",
                 "_wait_for_model_update_from_disk", "_update_model_path_info", "record_config_updates",
                 "config_value", "flush_cache", "init_weights_update_group", "destroy_weights_update_group",
                 "_weight_update_session_call", "begin_weight_update", "end_weight_update",
                 "update_weights_from_distributed", "update_weights_from_tensor", "release_memory_occupation",
                 "resume_memory_occupation", "get_internal_state", "update_weight_version",
                 "_update_weight_version_if_provided"):  # SGLang's own code, run on the stand-in's state
        setattr(_StandInManager, name, getattr(TokenizerManager, name))
    manager = _StandInManager()
    scheduler_info = {"status": "ready", "max_total_num_tokens": 4096, "max_req_input_len": 4096,
                      "startup_time": None}  # the scheduler's handshake (scheduler.py:1943-1948)
    http.set_global_state(http._GlobalState(tokenizer_manager=manager, template_manager=None,
                                            scheduler_info=scheduler_info))
    # what `_setup_and_run_http_server` does next (http_server.py:2870-2897), minus the lifespan: that builds
    # the OpenAI-compatible servings and starts the warm-up, neither on the endpoints checked here
    from sglang.srt.utils.auth import add_api_key_middleware

    from kimi_pipeline.engine.key import engine_api_key

    # as a run starts SGLang: with the run's key (`--api-key` through the engine's private --config file)
    add_api_key_middleware(http.app, api_key=engine_api_key(), admin_api_key=None)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(http.app, log_level="warning", lifespan="off", loop="uvloop")
    uvicorn.Server(config).run(sockets=[sock])


# --- the tests against SGLang's app ----------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
# the requests both servers get: (method, path, JSON body)
def _calls(hf_dir: Path) -> list[tuple[str, str, object]]:
    return [
        ("GET", "/health", None), ("GET", "/health_generate", None),
        ("POST", "/abort_request", {"abort_all": True, "rid": ""}), ("POST", "/flush_cache", {}),
        ("POST", "/pause_generation", {"mode": "in_place"}), ("POST", "/continue_generation", {}),
        ("POST", "/begin_weight_update", {}),
        ("POST", "/update_weights_from_tensor", {"serialized_named_tensors": [], "flush_cache": False}),
        ("POST", "/end_weight_update", {}),
        ("POST", "/update_weights_from_disk", {"model_path": str(hf_dir), "weight_version": "d1"}),
        ("POST", "/update_weight_version", {"new_version": "d2"}),
        ("POST", "/release_memory_occupation", {"tags": ["kv_cache"]}),
        ("POST", "/resume_memory_occupation", {"tags": ["kv_cache"]}),
        ("GET", "/model_info", None), ("GET", "/server_info", None),
        ("POST", "/generate", {"input_ids": [3, 5, 7], "sampling_params": {"max_new_tokens": 2},
                               "return_logprob": True, "return_routed_experts": True}),
        ("POST", "/generate", {"input_ids": [[3, 5, 7], [3, 5]],
                               "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 2}],
                               "return_logprob": True, "return_routed_experts": True}),
        # refused: a tensor update outside a weight-update session, and a session ended twice
        ("POST", "/update_weights_from_tensor", {"serialized_named_tensors": [], "flush_cache": False}),
        ("POST", "/end_weight_update", {}),
    ]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    return save_hf_model(random_tiny_hf(), tmp_path_factory.mktemp("hf"),
                         config=hf_config_dict(load_recipe("tiny").model))


@pytest.fixture(scope="module")
def sglang_app(parser_dir, hf_dir, tmp_path_factory):
    """SGLang's own app on a loopback port: (url, the file of what reached the stand-in scheduler)."""
    record = tmp_path_factory.mktemp("sglang") / "calls.jsonl"
    record.touch()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(parser_dir), str(ROOT / "tests")])}
    proc = subprocess.Popen([sys.executable, "-P", __file__, "serve", str(hf_dir), str(record)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = proc.stdout.readline()
        if not line.startswith("PORT "):
            proc.kill()
            raise AssertionError(f"SGLang's app did not start: {line!r} {proc.communicate(timeout=60)[1][-3000:]}")
        url = f"http://127.0.0.1:{int(line.split()[1])}"
        deadline = time.monotonic() + 120
        while True:
            try:
                httpx.get(url + "/model_info", timeout=5)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=60)[1][-3000:]
                time.sleep(0.2)
        yield url, record
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _records(record: Path) -> list[dict]:
    return [json.loads(line) for line in record.read_text().splitlines()]


def _media(r: httpx.Response) -> str:
    return r.headers.get("content-type", "").split(";")[0].strip()


# what the client reads of a /generate answer (client.py `_completion`), which both must send
GENERATE_ITEM = {"text", "output_ids", "meta_info"}
GENERATE_META = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "weight_version",
                 "output_token_logprobs", "routed_experts", "cached_tokens"}


def _shape(body) -> object:
    """A JSON body's shape: types, dict keys, list lengths; /generate items by the keys the client reads."""
    if isinstance(body, list):
        return [_shape(x) for x in body]
    if isinstance(body, dict) and GENERATE_ITEM <= set(body):
        meta = body["meta_info"]
        return ("generate", sorted(GENERATE_META & set(meta)), meta["finish_reason"]["type"],
                [(type(lp).__name__, type(t).__name__, v) for lp, t, v in meta["output_token_logprobs"]],
                len(base64.b64decode(meta["routed_experts"])) // 4, len(body["output_ids"]))
    if isinstance(body, dict):
        return ("object", sorted(body))
    return type(body).__name__


def test_sglang_and_the_embedded_engine_answer_every_endpoint_alike(sglang_app, server, hf_dir):
    """The same requests to SGLang's app and to the embedded engine: the same status code, content type and body
    shape for each (JSON keys of every object answer; /server_info and /model_info's values differ by nature:
    SGLang's is its resolved ServerArgs, ours the engine's state, so only their being JSON objects and the keys
    the client reads are compared)."""
    url, record = sglang_app
    hf = json.loads((hf_dir / "config.json").read_text())
    for method, path, body in _calls(hf_dir):
        # without the run's key: the same 401 (or, /health*, the same answer), and nothing reaches SGLang's scheduler
        reached = len(_records(record))
        theirs = httpx.request(method, url + path, json=body, timeout=120)
        ours = httpx.request(method, server.url + path, json=body, timeout=120)
        assert ours.status_code == theirs.status_code == (200 if path.startswith("/health") else 401), path
        assert path.startswith("/health") or len(_records(record)) == reached, path
        assert _media(ours) == _media(theirs), path
        theirs = engine_http.request(method, url + path, json=body, timeout=120)
        ours = engine_http.request(method, server.url + path, json=body, timeout=120)
        assert (ours.status_code, _media(ours)) == (theirs.status_code, _media(theirs)), (
            path, theirs.status_code, theirs.text[:300], ours.status_code, ours.text[:300])
        assert bool(ours.content) == bool(theirs.content), (path, theirs.content[:200], ours.content[:200])
        if _media(theirs) != "application/json":
            if theirs.status_code == 200:
                assert ours.text == theirs.text, path  # /flush_cache's plain text, word for word
            continue
        a, b = theirs.json(), ours.json()
        if path == "/server_info":
            assert isinstance(a, dict) and isinstance(b, dict)
            assert {"tp_size", "pp_size", "weight_version"} <= set(a), sorted(a)  # what Router reads of SGLang's
            continue
        if path == "/model_info":
            # SGLang adds "embedding" for every model (http_server.py:842-848: ModelConfig.embedding_model_spec is
            # never None, configs/embedding_model_spec.py:293-306), which the source table above cannot see and the
            # embedded engine does not send; the client reads neither
            assert set(a) == EXPECTED[path][1] | {"embedding"} and set(b) == EXPECTED[path][1], (set(a) ^ set(b), a)
            assert (a["weight_version"], b["weight_version"]) == ("d2", "d2")
            continue
        assert _shape(a) == _shape(b), (path, a if path != "/generate" else _shape(a), _shape(b))
        if theirs.status_code == 200 and path in EXPECTED:
            kind, keys = EXPECTED[path]
            assert _kind(theirs) == (kind, keys or _kind(theirs)[1]), (path, _kind(theirs))
    # what SGLang parsed out of the single /generate (its GenerateReqInput, normalized)
    single = [r["obj"] for r in _records(record) if r["type"] == "GenerateReqInput" and r["obj"]["input_ids"] == [3, 5, 7]]
    assert single and single[-1]["return_routed_experts"] and single[-1]["return_logprob"]
    assert single[-1]["sampling_params"]["max_new_tokens"] == 2
    # one [prompt + completion - 1, layers, topk] int32 block per row, as both encode it
    assert _shape(engine_http.post(url + "/generate", json=_calls(hf_dir)[15][2], timeout=60).json())[4] == \
        (3 + 2 - 1) * hf["num_hidden_layers"] * hf["num_experts_per_tok"]


def test_the_client_takes_sglang_s_answers(sglang_app, hf_dir):
    """EngineClient against SGLang's own app: every control call, the weight-update session around tensor and
    distributed updates, disk updates, versions and generation with logprobs and routed experts; and what
    SGLang parsed out of each request (its own request structs, as the scheduler would get them)."""
    url, record = sglang_app
    hf = json.loads((hf_dir / "config.json").read_text())
    start = len(_records(record))
    with EngineClient(url, num_layers=hf["num_hidden_layers"], topk=hf["num_experts_per_tok"],
                      first_k_dense=hf["first_k_dense_replace"]) as client:
        assert client.health() and client.health_generate()
        client.flush_cache()
        client.abort()
        client.pause()
        client.resume()
        client.release_memory_occupation(["kv_cache", "weights"])
        client.resume_memory_occupation(["kv_cache", "weights"])
        client.begin_weight_update()  # the session the weight syncs hold around tensor and distributed updates
        client.post_tensor_request({"serialized_named_tensors": [], "flush_cache": False})
        client.init_weights_update_group("127.0.0.1", 29555, 1, 2, "kimi-sync", "gloo")
        client.update_weights_from_distributed({"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2, 3]]},
                                               "kimi-sync", "v3")
        client.destroy_weights_update_group("kimi-sync")
        with pytest.raises(EngineBadRequest, match="a weight-update session is already open"):
            client.begin_weight_update()
        client.end_weight_update()
        with pytest.raises(EngineBadRequest, match="must run between begin_weight_update"):
            client.post_tensor_request({"serialized_named_tensors": [], "flush_cache": False})
        with pytest.raises(EngineBadRequest, match="no weight-update session is open"):
            client.end_weight_update()
        assert client.weight_version() == "v3"  # moved by the distributed update's weight_version
        client.update_weights_from_disk(str(hf_dir), weight_version="v4")
        assert client.weight_version() == "v4" and client.model_info()["model_path"] == str(hf_dir)
        client.update_weight_version("v5")
        assert client.weight_version() == "v5"
        assert client.server_info()["version"] == "0.5.23"
        done = client.generate([[3, 5, 7], [4, 6]], n=2, return_routed_experts=True)
        assert [len(c.output_ids) for c in done] == [16] * 4 and all(c.weight_version == "v5" for c in done)
        assert [c.routed_experts.shape for c in done] == [
            (len(c.prompt_ids) + 16 - 1, hf["num_hidden_layers"] - hf["first_k_dense_replace"],
             hf["num_experts_per_tok"]) for c in done]
        assert all(c.finish_reason == "length" and c.logprobs == [-0.5] * 16 for c in done)
    sent = [(r["type"], r["obj"]) for r in _records(record)[start:]]
    types = [t for t, _ in sent]
    for name in ("FlushCacheReqInput", "AbortReq", "PauseGenerationReqInput", "ContinueGenerationReqInput",
                 "ReleaseMemoryOccupationReqInput", "ResumeMemoryOccupationReqInput", "BeginWeightUpdateReqInput",
                 "UpdateWeightsFromTensorReqInput", "InitWeightsUpdateGroupReqInput",
                 "UpdateWeightsFromDistributedReqInput", "DestroyWeightsUpdateGroupReqInput",
                 "EndWeightUpdateReqInput", "UpdateWeightFromDiskReqInput", "UpdateWeightVersionReqInput"):
        assert name in types, (name, types)
    got = {t: o for t, o in sent}
    assert got["AbortReq"]["abort_all"] is True
    assert got["PauseGenerationReqInput"]["mode"] == "in_place"
    assert got["ReleaseMemoryOccupationReqInput"]["tags"] == ["kv_cache", "weights"]
    assert {k: got["InitWeightsUpdateGroupReqInput"][k] for k in ("master_address", "master_port", "rank_offset",
            "world_size", "group_name", "backend")} == {"master_address": "127.0.0.1", "master_port": 29555,
                                                         "rank_offset": 1, "world_size": 2,
                                                         "group_name": "kimi-sync", "backend": "gloo"}
    dist = got["UpdateWeightsFromDistributedReqInput"]
    assert (dist["names"], dist["dtypes"], dist["shapes"], dist["group_name"], dist["flush_cache"],
            dist["weight_version"]) == (["w"], ["bfloat16"], [[2, 3]], "kimi-sync", True, "v3")
    assert (got["UpdateWeightFromDiskReqInput"]["model_path"], got["UpdateWeightFromDiskReqInput"]["weight_version"]) \
        == (str(hf_dir), "v4")
    gen = [o for t, o in sent if t == "GenerateReqInput" and isinstance(o["input_ids"][0], list)][-1]
    assert gen["input_ids"] == [[3, 5, 7], [3, 5, 7], [4, 6], [4, 6]] and gen["return_routed_experts"]
    assert all(sp["top_k"] == -1 and sp["n"] == 1 for sp in gen["sampling_params"])


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    _serve_sglang(*sys.argv[2:4])
