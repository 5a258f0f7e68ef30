"""The client's endpoints as SGLang 0.5.23's own HTTP layer answers them, and the embedded engine answering the same.

Running `sglang.srt.entrypoints.http_server.app` on CPU is not possible with `make sglang-parser`'s install: its
import chain needs `uvloop` (absent), then `torchvision` (imported by `srt/multimodal/internvl_utils.py` through
`srt/configs/__init__.py`; the index wheel does not load against the CPU torch 2.13: `operator torchvision::nms
does not exist`), then `tvm_ffi`, `sentencepiece` and `gguf`; and `srt/layers/quantization/gguf.py:155` reads
`gguf.GGMLQuantizationType.F32` at import time, so an import-only stub no longer suffices there (a stub that
answered would be an imitation, which is what this check must not rest on). So each handler's answer is read
from the pinned source instead: `http_server.py` parsed with `ast` (the handler behind each route, what it
returns: an empty `Response`, plain text, JSON null, `{success, message}`, ...), and the embedded engine is driven
over HTTP and must answer each endpoint the same way (status, content type, body shape). A newer SGLang whose
handlers answer differently fails the first half; an embedded engine kinder than SGLang fails the second.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import httpx
import pytest
import torch

from kimi_pipeline.engine.client import EngineClient
from kimi_pipeline.engine.model import EngineModel
from kimi_pipeline.engine.sampler import RolloutEngine
from kimi_pipeline.engine.server import EngineServer
from kimi_pipeline.engine.sglang import PARSER_PATH_VAR
from kimi_pipeline.model.hf_config import hf_config_dict
from kimi_pipeline.model.hf_model import save_hf_model
from kimi_pipeline.recipes import load_recipe
from support.common import random_tiny_hf

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
def handlers() -> dict[str, ast.AsyncFunctionDef]:
    """Route → handler of the pinned SGLang's http_server.py."""
    path = Path(os.environ[PARSER_PATH_VAR]) / "sglang" / "srt" / "entrypoints" / "http_server.py"
    assert path.is_file(), f"no {path}: run `make sglang-parser` (make test does)"
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
    calls = [
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
    ]
    for method, path, body in calls:
        r = httpx.request(method, url + path, json=body, timeout=60)
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
