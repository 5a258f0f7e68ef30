"""Non-colocated weight sync: one process group between the trainer's sending rank and every engine.

SGLang's protocol, which the embedded engine implements too: `POST /init_weights_update_group`
{master_address, master_port, rank_offset, world_size, group_name, backend} makes each engine join a
group whose rank 0 is the trainer; then per bucket `POST /update_weights_from_distributed` {names, dtypes,
shapes, group_name, flush_cache, weight_version} tells the engines what is coming, the trainer broadcasts
the tensors in that order, and the engines load them; `POST /destroy_weights_update_group` ends it.
NCCL when the trainer's tensors live on a GPU, gloo on CPU. The group is made once and kept for the run.

The group is a bare `ProcessGroupGloo` / `ProcessGroupNCCL` over a TCPStore, not `init_process_group`:
both sides already have (or must not disturb) their own default group.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

GROUP_NAME = "kimi-weight-sync"
TIMEOUT = datetime.timedelta(minutes=30)


def make_group(master_address: str, master_port: int, rank: int, world_size: int, backend: str,
               group_name: str = GROUP_NAME, timeout: datetime.timedelta = TIMEOUT):
    """Join (rank 0: host) a process group of `world_size` over a TCPStore; blocks until all have joined."""
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout,
                          wait_for_workers=False)
    store = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    raise ValueError(f"weight-update group backend {backend!r}: gloo or nccl")


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
    from kimi_pipeline.rl.engine.shm import DTYPES

    dt = DTYPES.get(str(name).removeprefix("torch."))
    if dt is None:
        raise ValueError(f"dtype {name!r} is not a weight dtype")
    return dt


def _reachable_address(urls: list[str]) -> str:
    """An address of this host the engines can reach: loopback when they are all local."""
    hosts = {u.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0].strip("[]") for u in urls}
    if hosts <= {"127.0.0.1", "localhost", "::1"}:
        return "127.0.0.1"
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return socket.gethostbyname(socket.gethostname())


class WeightGroup:
    """The trainer side: rank 0 of a group with every engine (one rank each; SGLang: its TP ranks)."""

    def __init__(self, clients, pool: ThreadPoolExecutor, backend: str = "gloo", ranks_per_engine: list[int] | None = None,
                 master_address: str | None = None):
        from kimi_pipeline.util.net import free_port

        self.clients, self.pool, self.backend = clients, pool, backend
        sizes = ranks_per_engine or [1] * len(clients)
        self.world_size = 1 + sum(sizes)
        self.master_address = master_address or _reachable_address([c.url for c in clients])
        self.master_port = free_port()
        offsets = [1 + sum(sizes[:i]) for i in range(len(clients))]
        joins = [pool.submit(c.init_weights_update_group, self.master_address, self.master_port, off, self.world_size,
                             GROUP_NAME, backend) for c, off in zip(clients, offsets)]
        try:
            self.pg = make_group(self.master_address, self.master_port, 0, self.world_size, backend)
        finally:
            for j in joins:
                j.result()

    def send(self, bucket: Mapping[str, torch.Tensor], weight_version: str | None) -> None:
        """Announce the bucket to every engine, broadcast its tensors in order, wait until all loaded them."""
        names = list(bucket)
        device = "cuda" if self.backend == "nccl" else "cpu"
        tensors = [bucket[n].detach().to(device).contiguous() for n in names]
        meta = {"names": names, "dtypes": [str(t.dtype).replace("torch.", "") for t in tensors],
                "shapes": [list(t.shape) for t in tensors]}
        posted = [self.pool.submit(c.update_weights_from_distributed, meta, GROUP_NAME, weight_version)
                  for c in self.clients]
        try:
            for t in tensors:
                broadcast(self.pg, t)
        finally:
            for p in posted:
                p.result()

    def close(self) -> None:
        for f in [self.pool.submit(c.destroy_weights_update_group, GROUP_NAME) for c in self.clients]:
            try:
                f.result()
            except Exception:  # noqa: BLE001 - an engine that is gone has no group left to destroy
                pass
        self.pg = None
