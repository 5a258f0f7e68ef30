"""Non-colocated weight sync: a process group between one trainer rank (each pipeline stage's source,
`updaters.PPStageSources`) and every engine rank.

SGLang's protocol, which the embedded engine implements too: `POST /init_weights_update_group`
{master_address, master_port, rank_offset, world_size, group_name, backend} makes each engine join a
group whose rank 0 is the trainer; then, inside a weight-update session (`/begin_weight_update` …
`/end_weight_update`, `push.weight_update_session`), per bucket `POST /update_weights_from_distributed`
{names, dtypes, shapes, group_name, flush_cache, weight_version} tells the engines what is coming, the
trainer broadcasts the tensors in that order, and the engines load them; `POST /destroy_weights_update_group`
ends it. NCCL when the trainer's tensors live on a GPU, gloo on CPU. The group is made once per set of engines
and kept for the run, under a name of its own (a later group, e.g. after an engine restart, gets a new one).

The group is formed as SGLang forms its side (`init_custom_process_group`, sglang 0.5.23
`python/sglang/srt/utils/common.py:2859-2918`, called from `model_runner_components/weight_updater.py:133`): a
`tcp://` rendezvous store (rank 0 hosts it), `PrefixStore(group_name)`, then torch's `_new_process_group_helper`
adds `"{group_name}/"` and `"{device}/"` (torch/distributed/distributed_c10d.py, `_new_process_group_helper`:
`PrefixStore(f"{group_name}/", store)`, then per device of the backend `PrefixStore(f"{device}/", …)`; "cpu" for
gloo, "cuda" for nccl). Both sides must meet on exactly those keys, or each waits out the timeout. We build the
same store chain and the backend directly instead of calling torch's private helper: the helper registers the
group process-wide by name, which the trainer's megatron world does not need and which would forbid two
members of one group in one process (the CPU tests run several engines in one process).
`tests/integration/test_sglang.py` joins a group made by SGLang's own function (gloo) to prove the layout.
"""

from __future__ import annotations

import datetime
import math
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import BackendConfig

from kimi_pipeline.util.net import LOOPBACK, free_port, is_loopback, node_address
from kimi_pipeline.util.rendezvous import gloo_on, tcp_store
from kimi_pipeline.weight_sync.shm import DTYPES

GROUP_NAME = "kimi-weight-sync"
TIMEOUT = datetime.timedelta(minutes=30)


def group_store(master_address: str, master_port: int, rank: int, world_size: int, backend: str, group_name: str,
                timeout: datetime.timedelta = TIMEOUT) -> dist.Store:
    """The store a member's backend talks through, keys prefixed exactly as SGLang's side prefixes them. The store
    is the one a `tcp://` rendezvous makes (torch/distributed/rendezvous.py:162-214: rank 0 hosts it, multi-tenant),
    except that rank 0's server listens on `master_address` alone (`util.rendezvous.tcp_store`)."""
    store = tcp_store(master_address, master_port, world_size, rank == 0, timeout, multi_tenant=True)
    store.set_timeout(timeout)
    device = next(iter(BackendConfig(dist.Backend(backend)).get_device_backend_map()))  # the helper's first device
    return dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))


def make_group(master_address: str, master_port: int, rank: int, world_size: int, backend: str,
               group_name: str = GROUP_NAME, timeout: datetime.timedelta = TIMEOUT):
    """Join (rank 0: host) the weight-update group `group_name` of `world_size`; blocks until all have joined."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weight-update group backend {backend!r}: gloo or nccl")
    store = group_store(master_address, master_port, rank, world_size, backend, group_name, timeout)
    if backend == "gloo":
        with gloo_on(master_address):
            return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, opts)


def leave_group(pg) -> None:
    """Shut a group's backend down (a gloo backend left to the interpreter's exit aborts the process)."""
    shutdown = getattr(pg, "shutdown", None) or getattr(pg, "abort", None)
    if shutdown is not None:
        shutdown()


def broadcast(pg, tensor: torch.Tensor, root: int = 0) -> None:
    """In place, typed as SGLang's receiver expects (NCCL needs the same count and dtype on every rank);
    gloo has no float8, so over gloo those move as bytes (both sides follow this same rule)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    if tensor.device.type == "cpu" and tensor.dtype.itemsize == 1 and tensor.is_floating_point():
        tensor = tensor.reshape(-1).view(torch.uint8)
    pg.broadcast([tensor], opts).wait()


def dtype_from_name(name: str) -> torch.dtype:
    """A weight dtype by name: the same list the shared-memory transport accepts (`shm.DTYPES`)."""

    dt = DTYPES.get(str(name).removeprefix("torch."))
    if dt is None:
        raise ValueError(f"dtype {name!r} is not a weight dtype")
    return dt


def flattened_views(names: Sequence[str], dtypes: Sequence[torch.dtype],
                    shapes: Sequence[Sequence[int]]) -> list[tuple[str, int]]:
    """(name, end byte) of each tensor of a "flattened_bucket" distributed update: tensors back to back in one
    uint8 buffer, each starting at a multiple of its dtype's size, else ValueError naming it (what SGLang 0.5.23's
    receiver allocates and checks: `FlattenedTensorBucket.empty`, weight_sync/tensor_bucket.py:87-112)."""
    out, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        if offset % dtype.itemsize:
            raise ValueError(f"unaligned tensor {name} in a flattened bucket: byte offset {offset}, dtype {dtype}")
        if any(d < 0 for d in shape):
            raise ValueError(f"negative dimension in {name}: {list(shape)}")
        offset += dtype.itemsize * math.prod(shape)
        out.append((name, offset))
    return out


def flatten_bucket(named: Sequence[tuple[str, torch.Tensor]], device: str | torch.device) -> tuple[torch.Tensor, dict]:
    """One uint8 buffer of a bucket, as SGLang's receiver lays it out (`flattened_views`), and the request's
    names, dtypes and shapes. Tensors go in order of decreasing element size, so every offset is aligned without
    padding (SGLang's layout has none)."""
    ordered = sorted(named, key=lambda nt: -nt[1].element_size())  # stable: the bucket's order within a size
    meta = {"names": [n for n, _ in ordered], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in ordered],
            "shapes": [list(t.shape) for _, t in ordered]}
    ends = flattened_views(meta["names"], [t.dtype for _, t in ordered], meta["shapes"])
    flat = torch.empty(ends[-1][1] if ends else 0, dtype=torch.uint8, device=device)
    start = 0
    for (_, t), (_, end) in zip(ordered, ends):
        flat[start:end].copy_(t.detach().reshape(-1).view(torch.uint8))
        start = end
    return flat, meta


def _reachable_address(urls: list[str]) -> str:
    """An address of this host the engines can reach: loopback when they are all local."""
    hosts = {u.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0].strip("[]") for u in urls}
    return LOOPBACK if all(is_loopback(h) for h in hosts) else node_address()


class WeightGroup:
    """The trainer side: rank 0 of a group with every engine (one rank each; SGLang: its TP ranks)."""

    def __init__(self, clients, pool: ThreadPoolExecutor, backend: str = "gloo", ranks_per_engine: list[int] | None = None,
                 master_address: str | None = None, name: str = GROUP_NAME):
        self.clients, self.pool, self.backend = clients, pool, backend
        sizes = ranks_per_engine or [1] * len(clients)
        self.world_size = 1 + sum(sizes)
        self.master_address = master_address or _reachable_address([c.url for c in clients])
        self.master_port = free_port(self.master_address)
        self.group_name = f"{name}-{uuid.uuid4().hex[:8]}"  # SGLang keeps groups by name: one per group made
        offsets = [1 + sum(sizes[:i]) for i in range(len(clients))]
        joins = [pool.submit(c.init_weights_update_group, self.master_address, self.master_port, off, self.world_size,
                             self.group_name, backend) for c, off in zip(clients, offsets)]
        try:
            self.pg = make_group(self.master_address, self.master_port, 0, self.world_size, backend, self.group_name)
        finally:
            for j in joins:
                j.result()

    def send(self, bucket: Mapping[str, torch.Tensor], weight_version: str | None) -> None:
        """Announce the bucket to every engine, broadcast its tensors in order, wait until all loaded them."""
        names = list(bucket)
        tensors = [bucket[n].detach().to(self.device).contiguous() for n in names]
        meta = {"names": names, "dtypes": [str(t.dtype).replace("torch.", "") for t in tensors],
                "shapes": [list(t.shape) for t in tensors]}
        self._broadcast(meta, tensors, weight_version)

    def send_flattened(self, named: Sequence[tuple[str, torch.Tensor]], weight_version: str | None) -> int:
        """The bucket as one uint8 buffer and one broadcast (`load_format: "flattened_bucket"`, SGLang 0.5.23
        weight_updater.py:275-276, 310-319); returns the bytes sent."""
        flat, meta = flatten_bucket(named, self.device)
        self._broadcast({**meta, "load_format": "flattened_bucket"}, [flat], weight_version)
        return flat.numel()

    @property
    def device(self) -> str:
        return "cuda" if self.backend == "nccl" else "cpu"

    def _broadcast(self, meta: dict, tensors: list[torch.Tensor], weight_version: str | None) -> None:
        posted = [self.pool.submit(c.update_weights_from_distributed, meta, self.group_name, weight_version)
                  for c in self.clients]
        try:
            for t in tensors:
                broadcast(self.pg, t)
        finally:
            for p in posted:
                p.result()

    def close(self) -> None:
        for f in [self.pool.submit(c.destroy_weights_update_group, self.group_name) for c in self.clients]:
            try:
                f.result()
            except Exception:  # noqa: BLE001 - an engine that is gone has no group left to destroy
                pass
        if self.pg is not None:
            leave_group(self.pg)
        self.pg = None
