"""Ports for one server that takes several are distinct (Ray refuses a head whose dashboard and client server
share one, which `free_port()` called twice can hand out)."""

from __future__ import annotations

import socket

from kimi_pipeline.util.net import free_ports


def test_free_ports_are_distinct_and_bindable():
    ports = free_ports(64)
    assert len(set(ports)) == 64
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))  # released once chosen
