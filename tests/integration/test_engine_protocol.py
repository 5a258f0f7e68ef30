"""SGLang 0.5.23's control protocol as the embedded engine serves it, so the CPU suite makes the calls a GPU run
makes: the weight-update session, the live weight version in /model_info, the colocated memory handoff
(release / resume of weights, KV cache and CUDA graphs) in the order the train loop runs it, and the run's key,
which every engine requires, on loopback too."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from support import engine_http
from support.common import TINY, random_tiny_hf

from kimi_pipeline.engine.client import (
    EngineBadRequest,
    EngineClient,
    EngineRequestError,
    EnginesDown,
    Router,
    sampling_payload,
)
from kimi_pipeline.engine.embedded import EmbeddedEngine
from kimi_pipeline.engine.key import KEY_FILE_VAR, EngineKeyError, engine_api_key, use_run_key
from kimi_pipeline.engine.model import EngineModel
from kimi_pipeline.engine.rollout_engine import MEMORY_TAGS, RolloutEngine, SamplingParams
from kimi_pipeline.engine.server import EngineServer
from kimi_pipeline.plan.residency import RESIDENT
from kimi_pipeline.rl.handoff import Handoff
from kimi_pipeline.weight_sync.push import weight_update_session

PROMPTS = [[3, 5, 7, 9], [4, 6, 8]]
PARAMS = SamplingParams(max_new_tokens=6, temperature=1.0, seed=123)


@pytest.fixture(scope="module")
def hf():
    torch.manual_seed(0)
    return random_tiny_hf()


@pytest.fixture
def server(hf):
    with EngineServer(RolloutEngine(EngineModel.from_hf_model(hf), seed=0, decode_mode="static")) as s:
        yield s


def _samples(client) -> list[tuple[list[int], list[float]]]:
    return [(c.output_ids, c.logprobs) for c in client.generate(PROMPTS, 2, PARAMS, return_routed_experts=True)]


def test_updates_outside_a_session_are_refused_as_sglang_refuses_them(server, hf):
    url = server.url
    body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[8]], "group_name": "g"}
    for path, payload in (("/update_weights_from_tensor", {"serialized_named_tensors": []}),
                          ("/update_weights_from_distributed", body)):
        r = engine_http.post(url + path, json=payload, timeout=60)
        assert r.status_code == 400
        assert r.json()["message"] == f"{path[1:]} must run between begin_weight_update() and end_weight_update()"
    answer = engine_http.post(url + "/end_weight_update", json={}).json()
    assert answer["message"].startswith("no weight-update session")
    assert engine_http.post(url + "/begin_weight_update", json={}).status_code == 200
    assert "already open" in engine_http.post(url + "/begin_weight_update", json={}).json()["message"]
    assert engine_http.post(url + "/end_weight_update", json={}).status_code == 200
    # the client opens and ends the session itself, and the live version is /model_info's
    with EngineClient(url) as client:
        assert client.update_weights(hf.state_dict().items(), 1 << 20, weight_version="v7") > 1
        assert client.weight_version() == "v7" == client.model_info()["weight_version"]
        assert client.server_info()["weight_version"] == "0"  # the start-up configuration, cached
        assert not server.update_session
        # a failed update still ends the session: the next one can open its own
        with pytest.raises(EngineRequestError, match="shape"):
            client.update_weights([("model.norm.weight", torch.zeros(3))], 1 << 20, weight_version="bad")
        assert not server.update_session
        with weight_update_session(client):
            assert server.update_session


def test_release_and_resume_around_a_sync_give_back_the_same_generation(server, hf):
    """The colocated handoff on the engine: release everything (KV cache, graphs, weights) → generation refused
    (503) → resume weights → still refused until a sync filled every weight → sync the same weights → resume the
    KV cache and graphs → the same samples, logprobs and routed experts as before the release."""
    with EngineClient(server.url) as client:
        before = _samples(client)
        assert server.engine.static.cache is not None  # the static decoder's KV cache exists
        model = server.engine.model
        weight_bytes = sum(t.untyped_storage().nbytes() for t in model._tensors())
        client.release_memory_occupation(MEMORY_TAGS)
        assert server.engine.static.cache is None and not server.engine.static.graphs
        assert sum(t.untyped_storage().nbytes() for t in model._tensors()) == 0 < weight_bytes  # really freed
        with pytest.raises(EngineRequestError, match="HTTP 503.*memory is released"):
            client.generate(PROMPTS, 1, PARAMS)
        assert server.engine.released == set(MEMORY_TAGS)
        client.resume_memory_occupation(["weights"])
        assert sum(t.untyped_storage().nbytes() for t in model._tensors()) == weight_bytes
        client.resume_memory_occupation(["kv_cache", "cuda_graph"])
        with pytest.raises(EngineRequestError, match="HTTP 503.*have not been loaded since its memory was resumed"):
            client.generate(PROMPTS, 1, PARAMS)
        half = list(hf.state_dict().items())
        client.update_weights(half[: len(half) // 2], 1 << 20)
        with pytest.raises(EngineRequestError, match="have not been loaded"):  # half a sync is not a policy
            client.generate(PROMPTS, 1, PARAMS)
        client.update_weights(half[len(half) // 2:], 1 << 20, weight_version="1")
        after = _samples(client)
    assert after == before
    assert server.memory_events == [("release", tuple(sorted(MEMORY_TAGS))), ("resume", ("weights",)),
                                    ("resume", ("cuda_graph", "kv_cache"))]


def test_unknown_memory_tags_are_refused(server):
    r = engine_http.post(server.url + "/release_memory_occupation", json={"tags": ["activations"]}, timeout=60)
    assert r.status_code == 400 and "known tags are ['weights', 'kv_cache', 'cuda_graph']" in r.text
    assert not server.engine.released


def test_the_handoff_runs_the_resident_table_in_order(hf):
    """The train loop's handoff (`rl/handoff.py`) with two real engines and a recording trainer: start-up, then
    two steps; at every phase the engines hold exactly the memory `RESIDENT` names (what `kimi plan` counts), each
    move frees before it takes, and the engines generate after the step what they generated before it."""
    servers = [EngineServer(RolloutEngine(EngineModel.from_hf_model(hf), seed=i)) for i in range(2)]
    for s in servers:
        s.start()
    trainer: list[tuple[str, tuple[str, ...]]] = []
    try:
        with Router([s.url for s in servers]) as router:
            def engines(action, tags):
                (router.release_memory_occupation if action == "release" else router.resume_memory_occupation)(tags)

            handoff = Handoff(True, engines, lambda action, parts: trainer.append((action, parts)))
            before = None
            for phase in ("train", "weight_sync", "rollout", "train", "weight_sync", "rollout"):
                handoff.to(phase)
                tags, parts = RESIDENT[phase]
                assert all(set(s.engine.released) == set(MEMORY_TAGS) - set(tags) for s in servers), phase
                assert handoff.trainer_held == parts
                if phase == "weight_sync":
                    router.update_weights(hf.state_dict().items(), 1 << 20, weight_version=str(len(trainer)))
                if phase == "rollout":
                    out = [(c.output_ids, c.logprobs) for c in router.generate(PROMPTS, 2, PARAMS)]
                    assert before is None or out == before
                    before = out
            # free first, then take: every release / sleep of a move precedes its wake / resume
            kinds = [(side, action) for side, action, _ in handoff.events]
            assert kinds == [("engines", "release"),  # start-up: the engines give way to the loading trainer
                             ("trainer", "sleep"), ("engines", "resume"),  # -> weight_sync
                             ("trainer", "sleep"), ("engines", "resume"),  # -> rollout
                             ("engines", "release"), ("trainer", "wake"),  # -> train
                             ("trainer", "sleep"), ("engines", "resume"),
                             ("trainer", "sleep"), ("engines", "resume")]
            assert trainer[:2] == [("sleep", ("grads", "optimizer")), ("sleep", ("weights",))]
            assert trainer[2] == ("wake", ("weights", "grads", "optimizer"))
    finally:
        for s in servers:
            s.stop()


# every endpoint a local user could abuse without the key: swap the policy from a path of theirs, push tensors or join
# a weight-update group, free memory, stop or abort generation, read the state
CONTROL = [
    ("POST", "/update_weights_from_disk", {"model_path": str(TINY / "model")}),
    ("POST", "/update_weights_from_tensor", {"serialized_named_tensors": []}),
    ("POST", "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 9, "rank_offset": 1,
                                            "world_size": 2, "group_name": "g", "backend": "gloo"}),
    ("POST", "/begin_weight_update", {}), ("POST", "/release_memory_occupation", {"tags": ["kv_cache"]}),
    ("POST", "/pause_generation", {"mode": "abort"}), ("POST", "/abort_request", {"abort_all": True, "rid": ""}),
    ("POST", "/flush_cache", {}), ("POST", "/generate", {"input_ids": PROMPTS[0]}),
    ("GET", "/model_info", None), ("GET", "/server_info", None),
]


def test_an_engine_on_loopback_wants_the_runs_key(tmp_path):
    """The embedded engine as the run starts it, on loopback: every control endpoint answers 401 without the run's
    key (`<run_dir>/engine.key`, 0600, found through $KIMI_ENGINE_KEY_FILE) or with another key, and does nothing;
    /health* stay open, as in SGLang; the run's clients send the key; a resumed run keeps it; a client of another
    run gets 401 and is told why."""
    key_file = use_run_key(tmp_path / "run")
    key = key_file.read_text()
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and len(key) == 64
    assert os.environ[KEY_FILE_VAR] == str(key_file) and use_run_key(tmp_path / "run").read_text() == key
    engine = EmbeddedEngine(str(TINY / "model"), seed=0)
    url = engine.start()
    try:
        assert url.startswith("http://127.0.0.1:")
        for path in ("/health", "/health_generate"):
            assert httpx.get(url + path, timeout=60).status_code == 200, path
        for method, path, body in CONTROL:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
                r = httpx.request(method, url + path, json=body, headers=headers, timeout=60)
                assert r.status_code == 401, (path, headers, r.status_code, r.text[:200])
        assert engine.server.memory_events == [] and not engine.server.update_session
        with EngineClient(url) as client:
            assert client.weight_version() == "0" and client.model_info()["model_path"] == str(TINY / "model")
        use_run_key(tmp_path / "another-run")
        with EngineClient(url) as client, pytest.raises(EngineRequestError, match=f"401.*{KEY_FILE_VAR}"):
            client.weight_version()
    finally:
        engine.stop()


def test_a_key_file_others_can_read_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "engine.key"
    path.write_text("k" * 64)
    path.chmod(0o644)
    monkeypatch.setenv(KEY_FILE_VAR, str(path))
    with pytest.raises(EngineKeyError, match="chmod 600"):
        engine_api_key()


# --------------------------------------------------------------------------- an engine that dies mid-rollout


def _serve(seed: int) -> tuple[subprocess.Popen, str]:
    """An embedded engine on the shipped tiny checkpoint in its own process (as an engine actor's server is): its
    URL once it serves."""
    proc = subprocess.Popen([sys.executable, "-m", "kimi_pipeline.engine.server", "--model-path", str(TINY / "model"),
                             "--seed", str(seed), "--threads", "1"], stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


@pytest.mark.slow  # engine processes killed and awaited (~15 s)
def test_an_engine_killed_mid_rollout_leaves_its_prompt_groups_to_the_others():
    """Two engine processes behind the router; one is SIGKILLed while it has rows in flight: every prompt still gets
    exactly n samples, of its own prompt, the dead engine is out, its unanswered requests were sent again; a
    replacement serves after `rejoin` finds it at the policy's weight version; with no engine left, EnginesDown."""
    served = [_serve(i) for i in range(3)]
    procs, urls = [p for p, _ in served], [u for _, u in served]
    try:
        prompts = [[3 + i % 50, 5, 7 + i % 7, 9] for i in range(96)]
        params = SamplingParams(max_new_tokens=48, temperature=1.0, seed=5, stop_token_ids=())
        with Router(urls[:2], server_concurrency=64) as router, EngineClient(urls[1]) as watch:
            out: list = []
            gen = threading.Thread(target=lambda: out.extend(router.generate(prompts, 4, params)))
            gen.start()
            while not watch.server_info(refresh=True)["running_requests"]:  # rows in flight on engine 1
                time.sleep(0.005)
            procs[1].send_signal(signal.SIGKILL)
            gen.join(300)
            assert len(out) == len(prompts) * 4
            assert [c.prompt_ids for c in out] == [p for p in prompts for _ in range(4)]  # each group once, in place
            assert all(len(c.output_ids) == 48 for c in out)
            assert list(router.down) == [1] and router.serving() == [0] and router.retried_requests >= 1
            assert f"{urls[1]}/generate" in router.down[1]  # why: the transport error of its request

            router.replace(1, urls[2])  # the restarted engine: control calls yes, generation not yet
            assert router.serving() == [0] and router.pending == {1}
            assert router.rejoin("7") == [] and router.pending == {1}  # not at the policy's version yet
            router.update_weight_version("7")  # stands for the weight sync, which reaches pending engines
            assert router.rejoin("7") == [1] and router.serving() == [0, 1]
            assert len(router.generate(prompts[:4], 2, params)) == 8

            for p in (procs[0], procs[2]):
                p.send_signal(signal.SIGKILL)
                p.wait(30)
            with pytest.raises(EnginesDown, match=r"every rollout engine stopped answering \(.*/generate: \w+Error"):
                router.generate(prompts[:4], 2, params)
    finally:
        for p in procs:
            p.kill()
            p.wait(30)
            p.stdout.close()


# --------------------------------------------------------------------------- SGLang 0.5.23's answers and sampling rules


def _sglang_like(handler) -> EngineClient:
    """A client whose transport answers as `handler` does: SGLang's exact answers without a GPU."""
    client = EngineClient("http://sglang.test")
    client._http.close()
    client._http = httpx.Client(base_url="http://sglang.test", transport=httpx.MockTransport(handler))
    return client


def test_the_client_takes_sglangs_plain_text_empty_and_null_answers():
    """What SGLang 0.5.23 sends (entrypoints/http_server.py): /flush_cache plain text (:1025-1040), /health and
    /abort_request an empty 200, memory release / resume JSON null, pause / continue {"message", "status"}.
    The old client parsed every body as JSON and failed at the end of every colocated sync (/flush_cache)."""
    answers = {
        "/flush_cache": httpx.Response(200, content=b"Cache flushed.\nPlease check backend logs for more details. "
                                                    b"(When there are running or waiting requests, the operation "
                                                    b"will not be performed.)\n"),
        "/health": httpx.Response(200), "/health_generate": httpx.Response(200),
        "/abort_request": httpx.Response(200),
        "/release_memory_occupation": httpx.Response(200, json=None),
        "/resume_memory_occupation": httpx.Response(200, json=None),
        "/pause_generation": httpx.Response(200, json={"message": "Generation paused successfully.", "status": "ok"}),
        "/continue_generation": httpx.Response(200, json={"message": "Generation continued successfully.",
                                                          "status": "ok"}),
        "/model_info": httpx.Response(200, json={"model_path": "/m", "weight_version": "3"}),
    }
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        return answers[request.url.path]

    with _sglang_like(handler) as client:
        client.flush_cache()
        assert client.health() and client.health_generate()
        client.abort()
        client.release_memory_occupation()
        client.resume_memory_occupation()
        client.pause()
        client.resume()
        assert client.weight_version() == "3"
    assert set(seen) == set(answers)


def test_sglangs_refusals_reach_the_caller_with_their_message():
    """SGLang's 400s: /flush_cache's text while requests run (retryable: a state), {"error": {"message"}} of
    `_create_error_response`, {"success": false, "message"} of the weight endpoints; 503 from /health."""
    answers = {
        "/flush_cache": httpx.Response(400, content=b"Flush cache failed.\n"),
        "/release_memory_occupation": httpx.Response(400, json={"error": {"message": "server is not idle"}}),
        "/begin_weight_update": httpx.Response(400, json={"success": False, "message": "a session is open"}),
        "/health": httpx.Response(503),
    }
    with _sglang_like(lambda r: answers[r.url.path]) as client:
        with pytest.raises(EngineRequestError, match="Flush cache failed") as flush:
            client.flush_cache()
        assert not isinstance(flush.value, EngineBadRequest)
        with pytest.raises(EngineBadRequest, match="HTTP 400: server is not idle"):
            client.release_memory_occupation()
        with pytest.raises(EngineBadRequest, match="HTTP 400: a session is open"):
            client.begin_weight_update()
        assert not client.health()


def test_sampling_params_are_sent_as_sglang_reads_them():
    """top_k off is -1 (0 is SGLang's 400); stop ids never go with ignore_eos, which turns them off in SGLang
    (schedule_batch.py:1856-1858); `()` is ignore_eos alone; a seeded request gives every row its own seed."""
    sp = sampling_payload(SamplingParams(top_k=0))
    assert sp["top_k"] == -1 and "ignore_eos" not in sp and "stop_token_ids" not in sp and "sampling_seed" not in sp
    assert sampling_payload(SamplingParams(top_k=5))["top_k"] == 5
    sp = sampling_payload(SamplingParams(stop_token_ids=(7, 9)))
    assert sp["stop_token_ids"] == [7, 9] and "ignore_eos" not in sp
    sp = sampling_payload(SamplingParams(stop_token_ids=()))
    assert sp["ignore_eos"] is True and "stop_token_ids" not in sp
    rows = sampling_payload(SamplingParams(seed=5), 8)
    assert isinstance(rows, list) and len(rows) == 8
    assert len({r["sampling_seed"] for r in rows}) == 8 and all(0 <= r["sampling_seed"] < 2**63 for r in rows)
    assert rows == sampling_payload(SamplingParams(seed=5), 8)  # reproducible
    other = sampling_payload(SamplingParams(seed=6), 8)
    assert not {r["sampling_seed"] for r in rows} & {r["sampling_seed"] for r in other}


def test_the_embedded_engine_samples_as_sglang_does_for_the_same_request(server):
    """One seed for n samples of a prompt gives n identical samples in SGLang (deterministic inference: the draw
    hashes seed and position, sampler.py:934-958), and so here; the client's per-row seeds give distinct samples,
    the same ones on every call. ignore_eos turns the stop ids off; top_k 0 is refused with SGLang's message."""
    url = server.url
    body = {"input_ids": [PROMPTS[0]] * 4, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 42, "ignore_eos": True}}
    shared = engine_http.post(url + "/generate", json=body, timeout=60).json()
    assert len({tuple(x["output_ids"]) for x in shared}) == 1
    with EngineClient(url) as client:
        a, b = _samples(client), _samples(client)
    assert a == b and len({tuple(ids) for ids, _ in a[:2]}) == 2
    stops = list(range(0, 384))  # every token is a stop id: without ignore_eos the first token stops
    out = engine_http.post(url + "/generate", json={"input_ids": PROMPTS[0], "sampling_params": {
        "max_new_tokens": 5, "stop_token_ids": stops, "ignore_eos": True}}, timeout=60).json()
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    r = engine_http.post(url + "/generate", json={"input_ids": PROMPTS[0], "sampling_params": {"top_k": 0}}, timeout=60)
    assert r.status_code == 400
    assert r.json() == {"error": {"message": "top_k must be -1 (disable) or at least 1, got 0."}}


def test_control_answers_are_sglangs(server):
    """Status, content type and body of each control endpoint exactly as SGLang 0.5.23 answers it."""
    url = server.url
    flush = engine_http.post(url + "/flush_cache", timeout=60)
    assert flush.status_code == 200 and "content-type" not in flush.headers
    assert flush.text.startswith("Cache flushed.\n")
    for path in ("/health", "/health_generate"):
        r = engine_http.get(url + path, timeout=60)
        assert (r.status_code, r.content, r.headers.get("content-type")) == (200, b"", None), path
    r = engine_http.post(url + "/abort_request", json={"abort_all": True, "rid": ""}, timeout=60)
    assert (r.status_code, r.content) == (200, b"")
    for path in ("/release_memory_occupation", "/resume_memory_occupation"):
        r = engine_http.post(url + path, json={"tags": ["kv_cache"]}, timeout=60)
        assert (r.status_code, r.headers["content-type"], r.content) == (200, "application/json", b"null"), path
    r = engine_http.post(url + "/pause_generation", json={"mode": "in_place"}, timeout=60)
    assert r.json() == {"message": "Generation paused successfully.", "status": "ok"}
    r = engine_http.post(url + "/continue_generation", json={}, timeout=60)
    assert r.json() == {"message": "Generation continued successfully.", "status": "ok"}
    r = engine_http.post(url + "/begin_weight_update", json={}, timeout=60)
    assert r.json() == {"success": True, "message": "Success"}
    r = engine_http.post(url + "/end_weight_update", json={}, timeout=60)
    assert r.json() == {"success": True, "message": "Success"}
    r = engine_http.post(url + "/generate", json={"input_ids": "not ids"}, timeout=60)
    assert r.status_code == 400 and r.json()["object"] == "error" and r.json()["code"] == 400  # not FastAPI's 422
    # SGLang 0.5.23 has no such route
    assert engine_http.get(url + "/get_weight_version", timeout=60).status_code == 404
