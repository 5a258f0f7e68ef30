"""Buckets of HF-named tensors pushed to engines through their HTTP API, and the calls around any weight update.

Engines that read this host's shared memory get a JSON descriptor per bucket (`shm.py`), engines in a
weight-update process group receive the bucket by broadcast (`dist_group.WeightGroup`), any other embedded engine
a safetensors body; never a pickle. `weight_update_session` and `paused` wrap every update (SGLang refuses tensor and
distributed updates outside a session). Used by `engine.client.Router.update_weights` and the updaters.
"""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

import torch
from safetensors.torch import save

from kimi_pipeline.weight_sync import shm

if TYPE_CHECKING:
    from kimi_pipeline.weight_sync.dist_group import WeightGroup


class BucketReceiver(Protocol):
    """One engine's client as a bucket push sees it (`engine.client.EngineClient`; named here, not imported: the
    engine package stands above weight sync)."""

    def shares_memory(self) -> bool: ...
    def post_weight_chunk(self, serialized: str, weight_version: str | None, load_format: str = "safetensors") -> None: ...


class Engines(Protocol):
    """One engine's client or a router over several: what the calls around an update need."""

    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def begin_weight_update(self) -> None: ...
    def end_weight_update(self) -> None: ...


def chunk_named_tensors(named: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
                        buffer_bytes: int) -> Iterable[dict[str, torch.Tensor]]:
    """Group tensors into dicts of at most buffer_bytes raw bytes (an oversized tensor is its own chunk)."""
    items = named.items() if isinstance(named, Mapping) else named
    chunk: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        if chunk and size + nbytes > buffer_bytes:
            yield chunk
            chunk, size = {}, 0
        chunk[name] = t
        size += nbytes
    if chunk:
        yield chunk


def serialize_chunk(chunk: Mapping[str, torch.Tensor]) -> str:
    # own, contiguous CPU copies: safetensors refuses views that share storage
    owned = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in chunk.items()}
    return base64.b64encode(save(owned)).decode("ascii")


def push_weights(clients: list[BucketReceiver], named_tensors, buffer_bytes: int, weight_version: str | None,
                 pool: ThreadPoolExecutor | None = None, segment: shm.SharedBucket | None = None,
                 group: WeightGroup | None = None) -> int:
    """HF-named tensors to embedded engines in `buffer_bytes` buckets; returns the bucket count. Engines on
    this host read each bucket from one shared-memory segment (`shm.py`); the others receive it through the
    weight-update process group `group` (`dist_group.WeightGroup`, its members), or as a safetensors body
    when there is none. The weight version moves with the last bucket only, so no sample reports
    half-applied weights."""
    grouped = list(group.clients) if group is not None else []
    local = [c for c in clients if c not in grouped and c.shares_memory()]
    remote = [c for c in clients if c not in local and c not in grouped]
    run = (lambda fn, items: list(pool.map(fn, items))) if pool else (lambda fn, items: [fn(x) for x in items])

    def send(segment, chunk, version) -> None:
        if local:
            desc = json.dumps(segment.write_bucket(chunk))
            run(lambda c: c.post_weight_chunk(desc, version, shm.LOAD_FORMAT), local)
        if grouped:
            group.send(chunk, version)
        if remote:
            body = serialize_chunk(chunk)
            run(lambda c: c.post_weight_chunk(body, version), remote)

    count, pending = 0, None
    owned = shm.SharedBucket() if local and segment is None else contextlib.nullcontext(segment)
    with owned as segment:
        for chunk in chunk_named_tensors(named_tensors, buffer_bytes):
            if pending is not None:
                send(segment, pending, None)
            pending, count = chunk, count + 1
        if pending is not None:
            send(segment, pending, weight_version)
        elif weight_version is not None:  # nothing left to send: an empty bucket commits the version
            send(segment, {}, weight_version)
    return count


@contextlib.contextmanager
def weight_update_session(engines: Engines, enabled: bool = True) -> Iterator[None]:
    """SGLang's weight-update session around tensor and distributed updates (sglang 0.5.23
    `scheduler_components/weight_updater.py:192-197, 234-239` answer 400 outside one; `http_server.py:1458-1486`).
    Ended however the update ends, so a failed sync leaves no session open for the next one."""
    if not enabled:
        yield
        return
    engines.begin_weight_update()
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):  # the update's own error is the one to raise, not the cleanup's
            engines.end_weight_update()
        raise
    engines.end_weight_update()


@contextlib.contextmanager
def paused(engines: Engines, enabled: bool = True) -> Iterator[None]:
    """Generation paused in place around a weight update (one engine or all of a router's), resumed however
    the update ends."""
    if not enabled:
        yield
        return
    engines.pause()
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):  # as in `weight_update_session`: the update's error is the one raised
            engines.resume()
        raise
    engines.resume()
