"""One client for every rollout engine: the embedded engine's server and SGLang servers speak the same HTTP.

`EngineClient` talks to one server; `Router` spreads generation over several (least outstanding sampled
rows first, like the recipes' router) and broadcasts control calls, with the same interface.

Weight sync to the embedded engine sends shared-memory descriptors or safetensors (never pickle), in chunks of
at most `buffer_bytes` of raw tensor data; a tensor larger than the buffer goes alone. SGLang's
/update_weights_from_tensor takes pickled payloads: to SGLang we send only CUDA-IPC handles of our own tensors
to our own colocated engine (`weight_sync/cuda_ipc.py`, posted by `weight_sync.updaters.CudaIpcHandoff`), or
sync through a weight-update group, or from disk. Tensor and distributed updates run inside SGLang's weight-update
session (`weight_sync.push.weight_update_session`).
"""

from __future__ import annotations

import base64
import logging
import socket
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import torch

from kimi_pipeline.engine.key import KEY_FILE_VAR, KEY_VAR, auth_headers
from kimi_pipeline.engine.rollout_engine import ENGINE_NAME, MEMORY_TAGS, Completion, SamplingParams, row_seeds
from kimi_pipeline.errors import PermanentError
from kimi_pipeline.weight_sync import shm
from kimi_pipeline.weight_sync.dist_group import WeightGroup
from kimi_pipeline.weight_sync.push import paused, push_weights, weight_update_session

log = logging.getLogger(__name__)

# how tensors reach engines: auto = shared memory on this host, a process group to other hosts; distributed =
# the process group for every engine (non-colocated, GPU: NCCL); http = safetensors bodies (explicit fallback)
WEIGHT_TRANSPORTS = ("auto", "distributed", "http")


class EngineRequestError(RuntimeError):
    """The engine answered with an error (the message says which endpoint and why)."""


class EngineBadRequest(EngineRequestError, PermanentError):
    """HTTP 400: the request itself is wrong; retrying will not help."""


class EngineUnreachable(EngineRequestError):
    """No answer from the engine (connection refused or reset, the reply cut off, no reply in time): its process
    is gone or hung. The router takes such an engine out and sends its requests to the others."""


class EnginesDown(EngineRequestError):
    """Every engine of a router is out: nothing can generate until one is restarted."""


def sampling_payload(params: SamplingParams, rows: int = 1) -> dict[str, Any] | list[dict[str, Any]]:
    """SGLang 0.5.23's sampling_params for `rows` rows sampled with `params` (sglang/srt/sampling/sampling_params.py):

    - top_k off is -1; 0 is a 400 there (:209, 249-266), so our "<= 0: off" goes as -1.
    - stop ids: SGLang stops at `stop_token_ids` *and* the model's EOS; `ignore_eos` turns both off
      (srt/managers/schedule_batch.py:1856-1858), so stop ids never go with it. `()` (never stop early) is
      `ignore_eos` alone.
    - seeds: each row gets its own `sampling_seed` (`row_seeds`), one dict per row (io_struct.py:227 takes a
      list): SGLang honours the seed only with deterministic inference, and then rows sharing one seed and one
      prompt sample the same tokens (sampling_batch_info.py:157-170, layers/sampler.py:934-958) — a group of
      identical samples has no GRPO advantage. Unseeded: one dict for every row."""
    sp: dict[str, Any] = {"temperature": params.temperature, "top_p": params.top_p,
                          "top_k": params.top_k if params.top_k > 0 else -1,
                          "max_new_tokens": params.max_new_tokens, "n": 1}
    if params.stop_token_ids:
        sp["stop_token_ids"] = list(params.stop_token_ids)
    elif params.stop_token_ids is not None:
        sp["ignore_eos"] = True
    if params.seed is None:
        return sp
    return [{**sp, "sampling_seed": s} for s in row_seeds(params.seed, rows)]


def response_body(r: httpx.Response) -> Any:
    """What an endpoint answered, as SGLang 0.5.23 answers (entrypoints/http_server.py): JSON (dict, list, or
    None for `null`: /release_memory_occupation, /resume_memory_occupation :1575-1596), None for an empty body
    (/health, /health_generate :721-799, /abort_request :1721-1731), or the text of a plain-text answer
    (/flush_cache :1025-1040)."""
    if not r.content:
        return None
    if r.headers.get("content-type", "").split(";")[0].strip() == "application/json":
        try:
            return r.json()
        except ValueError as exc:
            raise EngineRequestError(f"{r.request.url}: a JSON answer that does not parse: {r.text[:200]!r}") from exc
    return r.text


def error_message(r: httpx.Response) -> str:
    """The message of an error answer, in any of SGLang's shapes: {"error": {"message"}} (_create_error_response,
    http_server.py:2246-2250), {"success": false, "message"}, ErrorResponse {"message", ...}, or plain text."""
    try:
        body = response_body(r)
    except EngineRequestError:
        body = None
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message") is not None:
            return str(err["message"])[:500]
        if body.get("message") is not None:
            return str(body["message"])[:500]
    return (r.text or "(empty body)")[:500].strip()


def decode_routed_experts(b64: str, num_tokens: int, num_layers: int, topk: int, first_k_dense: int) -> np.ndarray:
    """SGLang's base64 int32 [num_tokens, num_layers, topk] → int16 [num_tokens, moe_layers, topk]."""
    flat = np.frombuffer(base64.b64decode(b64), dtype=np.int32)
    if flat.size != num_tokens * num_layers * topk:
        raise EngineRequestError(
            f"routed_experts has {flat.size} ids, expected {num_tokens}x{num_layers}x{topk}; "
            "is the client's model shape (num_layers/topk) the engine's?"
        )
    return flat.reshape(num_tokens, num_layers, topk)[:, first_k_dense:].astype(np.int16)


class EngineClient:
    """HTTP client for one engine server (embedded or SGLang).

    num_layers / topk / first_k_dense describe the model for decoding routed experts; when omitted they
    are read from the server's /server_info (the embedded engine reports them; pass them for SGLang).
    """

    def __init__(self, url: str, *, timeout_s: float = 3600.0, num_layers: int | None = None, topk: int | None = None,
                 first_k_dense: int | None = None):
        self.url = url.rstrip("/")
        # TCP_NODELAY: h11 writes headers and body separately; with Nagle + the server's delayed ACK every POST
        # waited ~40 ms (measured: pause + resume 80 ms -> see README's weight-sync row)
        transport = httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        # every engine wants the run's key (`engine.key`), on loopback too
        self._http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(timeout_s, connect=10.0), transport=transport,
                                  headers=auth_headers())
        self._layout = (num_layers, topk, first_k_dense) if None not in (num_layers, topk, first_k_dense) else None
        self._info: dict[str, Any] | None = None

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- plumbing
    def _call(self, method: str, path: str, json: Any = None, timeout_s: float | None = None,
              params: dict[str, Any] | None = None) -> Any:
        """One request; the answer as SGLang 0.5.23 sends it (`response_body`): a dict or list from JSON, None
        for an empty body or JSON null, a str for plain text. Errors: HTTP >= 400 (400: EngineBadRequest), or
        a 200 JSON object saying `"success": false`."""
        try:
            limit = {"timeout": httpx.Timeout(timeout_s, connect=min(10.0, timeout_s))} if timeout_s else {}
            r = self._http.request(method, path, json=json, params=params, **limit)
        except httpx.TransportError as exc:
            raise EngineUnreachable(f"{self.url}{path}: {type(exc).__name__}: {exc}") from exc
        except httpx.HTTPError as exc:
            raise EngineRequestError(f"{self.url}{path}: {type(exc).__name__}: {exc}") from exc
        if r.status_code >= 400:
            cls = EngineBadRequest if r.status_code == 400 else EngineRequestError
            hint = (f" (this process's engine key, from ${KEY_FILE_VAR} or ${KEY_VAR}, is not the engine's run's)"
                    if r.status_code == 401 else "")
            raise cls(f"{self.url}{path}: HTTP {r.status_code}: {error_message(r)}{hint}")
        body = response_body(r)
        if isinstance(body, dict) and body.get("success") is False:
            raise EngineRequestError(f"{self.url}{path}: {body.get('message')}")
        return body

    def _call_json(self, method: str, path: str, **kwargs) -> dict[str, Any]:
        """A call whose answer must be a JSON object (server_info, model_info)."""
        body = self._call(method, path, **kwargs)
        if not isinstance(body, dict):
            raise EngineRequestError(f"{self.url}{path}: expected a JSON object, got {body!r:.200}")
        return body

    def server_info(self, refresh: bool = False) -> dict[str, Any]:
        """The start-up configuration (SGLang 0.5.23: /server_info; /get_server_info is its deprecated name)."""
        if self._info is None or refresh:
            self._info = self._call_json("GET", "/server_info")
        return self._info

    def model_info(self) -> dict[str, Any]:
        """What a weight update changes, live: weight_version, model_path (`http_server.py:812-826`)."""
        return self._call_json("GET", "/model_info")

    def _expert_layout(self) -> tuple[int, int, int]:
        if self._layout is None:
            info = self.server_info()
            try:
                self._layout = (info["num_hidden_layers"], info["num_experts_per_tok"], info["first_k_dense_replace"])
            except KeyError:
                raise PermanentError(
                    f"{self.url} does not report its model shape: "
                    "pass num_layers, topk and first_k_dense to EngineClient"
                ) from None
        return self._layout

    # --- generation
    def generate(self, prompts: list[list[int]], n: int = 1, params: SamplingParams | None = None,
                 return_routed_experts: bool = False) -> list[Completion]:
        """n samples per prompt, prompt-major; each prompt is sent n times (SGLang's radix cache / our
        prefill de-duplication make the repeats cheap, and the output order is then unambiguous)."""
        params = params or SamplingParams()
        rows = [list(p) for p in prompts for _ in range(n)]
        if not rows:
            return []
        payload: dict[str, Any] = {"input_ids": rows, "sampling_params": sampling_payload(params, len(rows)),
                                   "return_logprob": True, "return_routed_experts": return_routed_experts}
        body = self._call("POST", "/generate", payload)
        items = body if isinstance(body, list) else [body]
        if len(items) != len(rows):
            raise EngineRequestError(f"{self.url}/generate returned {len(items)} outputs for {len(rows)} prompts")
        return [self._completion(prompt, item, return_routed_experts) for prompt, item in zip(rows, items)]

    def _completion(self, prompt: list[int], item: dict[str, Any], want_experts: bool) -> Completion:
        meta = item.get("meta_info", {})
        lps = meta.get("output_token_logprobs")
        tokens = [int(x[1]) for x in lps] if lps is not None else list(item.get("output_ids", []))
        finish = meta.get("finish_reason") or {}
        kind = finish.get("type", "length") if isinstance(finish, dict) else str(finish)
        matched = finish.get("matched") if isinstance(finish, dict) else None
        experts = None
        if want_experts and meta.get("routed_experts") is not None:
            layers, topk, dense = self._expert_layout()
            experts = decode_routed_experts(meta["routed_experts"], len(prompt) + len(tokens) - 1, layers, topk, dense)
        return Completion(
            prompt_ids=prompt,
            output_ids=tokens,
            logprobs=[float(x[0]) for x in lps] if lps is not None else [],
            finish_reason=kind,
            matched_stop=matched if isinstance(matched, int) else None,
            routed_experts=experts,
            weight_version=str(meta.get("weight_version", "")),
        )

    # --- weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
                       buffer_bytes: int, weight_version: str | None = None, pause: bool = True) -> int:
        """Send HF-named tensors in buffer-sized safetensors chunks; returns the number of chunks.

        Generation is paused in place meanwhile (unless pause=False); the weight version moves only
        with the last chunk, so no sample reports a version whose weights were half-applied."""
        self._require_embedded()
        with paused(self, pause), weight_update_session(self):
            return push_weights([self], named_tensors, buffer_bytes, weight_version)

    def post_weight_chunk(self, serialized: str, weight_version: str | None, load_format: str = "safetensors") -> None:
        self._call("POST", "/update_weights_from_tensor", {
            "serialized_named_tensors": [serialized], "load_format": load_format,
            "flush_cache": weight_version is not None, "weight_version": weight_version})

    def begin_weight_update(self) -> None:
        self._call("POST", "/begin_weight_update", {})

    def post_tensor_request(self, body: dict[str, Any]) -> None:
        """One `/update_weights_from_tensor` body built elsewhere (`cuda_ipc.build_update_request`)."""
        self._call("POST", "/update_weights_from_tensor", body)

    def update_weight_version(self, version: str) -> None:
        self._call("POST", "/update_weight_version", {"new_version": version})

    def end_weight_update(self) -> None:
        self._call("POST", "/end_weight_update", {})

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str) -> None:
        """Join the trainer's weight-update process group (blocks until every member joined)."""
        self._call("POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend})

    def update_weights_from_distributed(self, meta: dict[str, list], group_name: str,
                                        weight_version: str | None) -> None:
        """Receive one bucket (names, dtypes, shapes) broadcast by the group's rank 0 and load it."""
        self._call("POST", "/update_weights_from_distributed", {
            **meta, "group_name": group_name, "flush_cache": weight_version is not None,
            "weight_version": weight_version})

    def destroy_weights_update_group(self, group_name: str) -> None:
        self._call("POST", "/destroy_weights_update_group", {"group_name": group_name})

    def shares_memory(self) -> bool:
        """Whether the engine reads weight buckets from this host's shared memory (an embedded engine here)."""
        info = self.server_info()
        return shm.LOAD_FORMAT in info.get("weight_update_formats", ()) and info.get("hostname") == socket.gethostname()

    def _require_embedded(self) -> None:
        if self.server_info().get("engine") != ENGINE_NAME:
            raise PermanentError(
                f"{self.url} is not the embedded engine: SGLang takes tensors only as pickles, which we never send; "
                "sync it through a weight-update group (weight_transport='distributed') or save an HF checkpoint "
                "and use update_weights_from_disk"
            )

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> None:
        payload: dict[str, Any] = {"model_path": str(model_path)}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        self._call("POST", "/update_weights_from_disk", payload)

    # --- control
    def pause(self, mode: str = "in_place") -> None:
        self._call("POST", "/pause_generation", {"mode": mode})

    def resume(self) -> None:
        self._call("POST", "/continue_generation", {})

    def flush_cache(self, timeout_s: float = 0.0) -> None:
        """Drop the radix cache. SGLang answers plain text, 200 when flushed and 400 ("Flush cache failed.") while
        requests run or wait unpaused (http_server.py:1025-1040); `timeout_s` lets it wait that long for idle
        first (flush_wrapper.py:28-36). Refused: EngineRequestError, retryable (a state, not a bad request)."""
        try:
            self._call("POST", "/flush_cache", params={"timeout": timeout_s} if timeout_s else None,
                       timeout_s=timeout_s + 60.0 if timeout_s else None)
        except EngineBadRequest as exc:
            raise EngineRequestError(f"{exc} (the engine flushes only while no request runs or waits)") from None

    def abort(self) -> None:
        """Abort everything queued or running (their samples come back with finish_reason "abort"); SGLang
        answers an empty 200 (http_server.py:1721-1731)."""
        self._call("POST", "/abort_request", {"abort_all": True, "rid": ""})

    def health(self, timeout_s: float = 30.0) -> bool:
        """The server answers /health with a 200 within `timeout_s` (an empty body in SGLang; 503 while it starts
        or shuts down, http_server.py:721-752); a hung engine is as good as a dead one."""
        try:
            self._call("GET", "/health", timeout_s=timeout_s)
            return True
        except EngineRequestError:
            return False

    def health_generate(self) -> bool:
        try:
            self._call("GET", "/health_generate")
            return True
        except EngineRequestError:
            return False

    def weight_version(self) -> str:
        """The live weight version (/server_info reports the start-up one)."""
        return str(self.model_info().get("weight_version", ""))

    def release_memory_occupation(self, tags: Iterable[str] = MEMORY_TAGS) -> None:
        """Free the engine's GPU memory of these kinds (`--enable-memory-saver`); the engine must be idle. SGLang
        answers JSON null, or {"error": {"message"}} (http_server.py:1575-1584)."""
        self._call("POST", "/release_memory_occupation", {"tags": list(tags)})

    def resume_memory_occupation(self, tags: Iterable[str] = MEMORY_TAGS) -> None:
        """Take it back. Resumed weights hold no values until the next weight sync fills them."""
        self._call("POST", "/resume_memory_occupation", {"tags": list(tags)})


class Router:
    """Several engines behind EngineClient's interface.

    generate: each prompt (with all its n samples, so a group shares one engine's prefill) goes to the
    engine with the fewest outstanding rows; engines run concurrently and outputs come back in order.
    Control and weight calls go to every engine. `server_concurrency` (recipe `sglang.server_concurrency`,
    the seeds' --sglang-server-concurrency) caps the rows one engine has in flight: larger shares go out as
    consecutive requests of whole prompt groups.

    An engine that stops answering (`EngineUnreachable`) is taken out: the prompt groups of its unanswered
    requests go to the engines still serving (a request holds whole groups, so each group still yields its n
    samples, once), and `retried_requests` counts them. `replace` puts a restarted engine in its place, serving
    control and weight calls but no generation until `rejoin` finds it at the policy's weight version.
    """

    def __init__(self, engines: list[str | EngineClient], *, server_concurrency: int | None = None,
                 weight_transport: str = "auto", group_backend: str = "gloo", **client_kwargs):
        """`group_backend`: the weight-update group's backend, the pushing trainer's (nccl from GPU tensors,
        gloo from CPU ones)."""
        if not engines:
            raise PermanentError("Router needs at least one engine URL")
        if weight_transport not in WEIGHT_TRANSPORTS:
            raise PermanentError(f"weight_transport={weight_transport!r}: one of {WEIGHT_TRANSPORTS}")
        self.server_concurrency = server_concurrency
        self.weight_transport = weight_transport
        self.group_backend = group_backend
        self._group = None  # dist_group.WeightGroup, made at the first sync that needs it, kept for the run
        self._client_kwargs = client_kwargs
        self.clients = [e if isinstance(e, EngineClient) else EngineClient(e, **client_kwargs) for e in engines]
        self._outstanding = [0] * len(self.clients)
        self.down: dict[int, str] = {}  # stopped answering (why): no calls at all
        self.pending: set[int] = set()  # restarted, not yet at the policy's weights: control calls, no generation
        self.retried_requests = 0  # requests sent again because their engine stopped answering
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(4, 2 * len(self.clients)), thread_name_prefix="router")
        self._segment: shm.SharedBucket | None = None

    @property
    def urls(self) -> list[str]:
        return [c.url for c in self.clients]

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None
        self._pool.shutdown(wait=True)
        if self._segment is not None:
            self._segment.close()
        for c in self.clients:
            c.close()

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _broadcast(self, fn) -> list[Any]:
        return list(self._pool.map(fn, [c for e, c in enumerate(self.clients) if e not in self.down]))

    def serving(self) -> list[int]:
        """The engines generation goes to."""
        return [e for e in range(len(self.clients)) if e not in self.down and e not in self.pending]

    def generate(self, prompts: list[list[int]], n: int = 1, params: SamplingParams | None = None,
                 return_routed_experts: bool = False) -> list[Completion]:
        out: list[Completion | None] = [None] * (len(prompts) * n)
        todo = list(range(len(prompts)))
        while todo:
            serving = self.serving()
            if not serving:
                raise EnginesDown(f"every rollout engine stopped answering ({'; '.join(self.down.values())}); "
                                  f"{len(todo)} of {len(prompts)} prompts unanswered")
            assigned: dict[int, list[int]] = {e: [] for e in serving}
            with self._lock:
                for i in todo:
                    e = min(serving, key=lambda k: self._outstanding[k])
                    assigned[e].append(i)
                    self._outstanding[e] += n
            todo = []
            for e, (done, lost) in zip(assigned, self._pool.map(
                    lambda e: self._generate_on(e, assigned[e], prompts, n, params, return_routed_experts), assigned)):
                for i, completions in done:
                    out[i * n : (i + 1) * n] = completions
                todo += lost
        return out  # type: ignore[return-value]

    def _generate_on(self, e: int, idx: list[int], prompts: list[list[int]], n: int, params: SamplingParams | None,
                     return_routed_experts: bool) -> tuple[list[tuple[int, list[Completion]]], list[int]]:
        """Engine e's share of prompts (indexes `idx`), in requests of whole prompt groups: the groups answered
        with their completions, and the indexes left unanswered when the engine stopped answering (taken out)."""
        done: list[tuple[int, list[Completion]]] = []
        per = max(1, (self.server_concurrency or len(idx) * n) // n)  # prompts per request
        try:
            for lo in range(0, len(idx), per):
                chunk = idx[lo : lo + per]
                got = self.clients[e].generate([prompts[i] for i in chunk], n, params, return_routed_experts)
                done += [(i, got[j * n : (j + 1) * n]) for j, i in enumerate(chunk)]
        except EngineUnreachable as exc:
            lost = idx[len(done):]
            with self._lock:
                self.down[e] = str(exc)
                self.retried_requests += -(-len(lost) // per)
            log.warning("rollout engine %d stopped answering (%s): %d prompt groups go to the other engines",
                        e, exc, len(lost))
            return done, lost
        finally:
            with self._lock:
                self._outstanding[e] -= n * len(idx)
        return done, []

    def replace(self, e: int, url: str) -> None:
        """A restarted engine in engine e's place: control and weight calls reach it, generation waits for
        `rejoin`."""
        old, self.clients[e] = self.clients[e], EngineClient(url, **self._client_kwargs)
        old.close()
        with self._lock:
            self.down.pop(e, None)
            self.pending.add(e)

    def rejoin(self, version: str) -> list[int]:
        """Restarted engines at weight version `version` serve again; returns them. One at another version
        stays out (a sync did not reach it)."""
        back = [e for e in sorted(self.pending) if self.clients[e].weight_version() == version]
        with self._lock:
            self.pending -= set(back)
        return back

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
                       buffer_bytes: int, weight_version: str | None = None, pause: bool = True,
                       session: bool = True) -> int:
        """Each bucket staged once (shared memory for engines on this host, one safetensors body for the
        others) and posted to every engine concurrently, inside a weight-update session (`session=False`: the
        caller holds one open, e.g. around several ranks' buckets)."""
        if self.weight_transport != "distributed":  # SGLang joins a weight-update group; tensor bodies are ours
            for c in self.clients:
                c._require_embedded()
        with paused(self, pause), weight_update_session(self, session):
            group = self._weight_group()
            if self._segment is None and any(c.shares_memory() for c in self.clients if group is None
                                             or c not in group.clients):
                self._segment = shm.SharedBucket()  # kept until close(): later syncs reuse its pages
            return push_weights(self.clients, named_tensors, buffer_bytes, weight_version, self._pool, self._segment,
                                group)

    def _weight_group(self):
        """The process group for engines that do not read this host's shared memory (`weight_transport`:
        auto = the engines on other hosts, distributed = all of them, http = none: safetensors bodies)."""
        if self.weight_transport == "http":
            return None
        if self._group is None:
            members = [c for c in self.clients if self.weight_transport == "distributed" or not c.shares_memory()]
            if not members:
                return None

            # SGLang: every GPU of an engine is a rank of the group (slime: rank_offset = 1 + i * gpus_per_engine)
            sizes = [int(c.server_info().get("tp_size", 1)) * int(c.server_info().get("pp_size", 1)) for c in members]
            self._group = WeightGroup(members, self._pool, backend=self.group_backend, ranks_per_engine=sizes)
        return self._group

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> None:
        self._broadcast(lambda c: c.update_weights_from_disk(model_path, weight_version))

    def begin_weight_update(self) -> None:
        self._broadcast(lambda c: c.begin_weight_update())

    def end_weight_update(self) -> None:
        self._broadcast(lambda c: c.end_weight_update())

    def update_weight_version(self, version: str) -> None:
        self._broadcast(lambda c: c.update_weight_version(version))

    def release_memory_occupation(self, tags: Iterable[str] = MEMORY_TAGS) -> None:
        tags = tuple(tags)
        self._broadcast(lambda c: c.release_memory_occupation(tags))

    def resume_memory_occupation(self, tags: Iterable[str] = MEMORY_TAGS) -> None:
        tags = tuple(tags)
        self._broadcast(lambda c: c.resume_memory_occupation(tags))

    def pause(self, mode: str = "in_place") -> None:
        self._broadcast(lambda c: c.pause(mode))

    def resume(self) -> None:
        self._broadcast(lambda c: c.resume())

    def flush_cache(self) -> None:
        self._broadcast(lambda c: c.flush_cache())

    def abort(self) -> None:
        self._broadcast(lambda c: c.abort())

    def health(self) -> bool:
        return all(self._broadcast(lambda c: c.health()))

    def health_generate(self) -> bool:
        return all(self._broadcast(lambda c: c.health_generate()))

    def weight_version(self) -> str:
        versions = set(self._broadcast(lambda c: c.weight_version()))
        if len(versions) != 1:
            raise EngineRequestError(f"engines disagree on the weight version: {sorted(versions)}")
        return versions.pop()
