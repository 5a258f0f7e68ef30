"""The one free-port helper: rendezvous, Ray, SGLang and Prefect servers all pick their port here."""

from __future__ import annotations

import socket
import sys

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """An unused TCP port on `host` ("" = every interface). There is a short race until the caller binds it;
    every caller's server fails loudly if it loses."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = LOOPBACK) -> list[int]:
    """`n` distinct unused TCP ports on `host`, for one server that takes several (a Ray head: dashboard, client
    server, agent). All n are held open until each is chosen: `free_port()` n times can hand the same port twice
    (seen: Ray refused a head whose dashboard and client server got one port)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


NODE_ADDRESS = "<node-ip>"  # a bind host meaning "this node's cluster address", resolved where the server starts


def is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


def node_address() -> str:
    """The address other nodes reach this one at: Ray's node IP inside a cluster, else the host name's address.
    A process that never imported Ray is not a Ray worker, so Ray is not imported here (light processes such as
    the cluster watchdog and weight-job ranks import this module)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    return socket.gethostbyname(socket.gethostname())


def bind_host(host: str) -> str:
    """`host` as a server binds it: NODE_ADDRESS resolved to this node's address."""
    return node_address() if host == NODE_ADDRESS else host
