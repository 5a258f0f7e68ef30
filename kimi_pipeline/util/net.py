"""The one free-port helper: rendezvous, Ray, SGLang and Prefect servers all pick their port here."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """An unused TCP port on `host` ("" = every interface). There is a short race until the caller binds it;
    every caller's server fails loudly if it loses."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
