"""torch.distributed rendezvous that listen only on the address they are given.

Two kinds of listening socket come with every process group: the rendezvous store's server (rank 0's, or the
torchrun agent's of node 0) and gloo's pair listener in every member.

- torch 2.13's TCPStore server listens on every interface (`::`, dual stack; measured with /proc/net/tcp6)
  whatever host it is given, unless it is handed a socket that already listens (`master_listen_fd`,
  torch/_C/_distributed_c10d.pyi:246, which it then owns and closes). `tcp_store` binds that socket on the host.
- gloo's device listens on the address the host name resolves to unless GLOO_SOCKET_IFNAME names an interface,
  read each time a ProcessGroupGloo is constructed (measured: set after torch's import, `eth0` moved the next
  group's listener to the host's address): a group whose rendezvous is on loopback has every member on this
  host, so `gloo_on(address)` makes the gloo groups created inside it listen on `lo`.

NCCL's own bootstrap sockets (GPU groups) follow NCCL_SOCKET_IFNAME and are not changed here.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from kimi_pipeline.util.net import is_loopback

GLOO_IFNAME_VAR = "GLOO_SOCKET_IFNAME"
LOOPBACK_INTERFACE = "lo"
LISTEN_BACKLOG = 2048  # every rank of a 256-GPU group connects at once


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on `host`:`port` alone (port 0: the OS picks a free one, no race)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def tcp_store(host: str, port: int, world_size: int | None, is_master: bool, timeout: datetime.timedelta, *,
              multi_tenant: bool = False, wait_for_workers: bool = True) -> dist.TCPStore:
    """A TCPStore at `host`:`port`; the master's server listens on `host` only (port 0: a free port, read back
    from `.port`). Clients connect as usual."""
    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout, wait_for_workers=wait_for_workers,
                             multi_tenant=multi_tenant)
    sock = listening_socket(host, port)
    port = sock.getsockname()[1]
    # detach: the store owns the descriptor from here on (it closes it when it is destroyed)
    return dist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=wait_for_workers,
                         multi_tenant=multi_tenant, master_listen_fd=sock.detach())


@contextmanager
def gloo_on(address: str) -> Iterator[None]:
    """Gloo groups constructed inside listen on loopback when `address` (the group's rendezvous) is loopback;
    otherwise as configured. The variable is restored after: it is read only when a group is constructed."""
    if not is_loopback(address) or os.environ.get(GLOO_IFNAME_VAR):
        yield
        return
    os.environ[GLOO_IFNAME_VAR] = LOOPBACK_INTERFACE
    try:
        yield
    finally:
        os.environ.pop(GLOO_IFNAME_VAR, None)
