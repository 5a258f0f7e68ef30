"""Which TCP sockets a set of processes listens on, read from /proc (no `ss` or `lsof` needed): /proc/net/tcp and
tcp6 list every socket in LISTEN state (st 0A) with its local address and inode; /proc/<pid>/fd maps inodes to the
processes holding them. The socket tables are those of this network namespace: the host's, in the tests."""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass

import psutil

LISTEN = "0A"


@dataclass(frozen=True)
class Listener:
    address: str
    port: int
    pid: int
    command: str

    @property
    def loopback(self) -> bool:
        ip = ipaddress.ip_address(self.address)
        mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is the IPv4 loopback seen by an IPv6 socket
        return (mapped or ip).is_loopback


def _address(hex_address: str, family: int) -> str:
    """/proc/net/tcp* print addresses as 32-bit words in host byte order (little endian here)."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(family, words)


def listening_inodes() -> dict[str, tuple[str, int]]:
    """inode -> (address, port) of every listening TCP socket of this namespace."""
    out: dict[str, tuple[str, int]] = {}
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(table) as f:
            next(f)  # header
            for line in f:
                fields = line.split()
                if fields[3] != LISTEN:
                    continue
                address, port = fields[1].split(":")
                out[fields[9]] = (_address(address, family), int(port, 16))
    return out


def _command(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())[:160]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "?"


def listeners(pids: Iterable[int]) -> list[Listener]:
    """The listening sockets held by `pids` (a socket shared by several of them is listed for each)."""
    inodes = listening_inodes()
    found = []
    for pid in set(pids):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # exited, or not ours
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                address, port = inodes[target[8:-1]]
                found.append(Listener(address, port, pid, _command(pid)))
    return found


def with_descendants(pids: Iterable[int]) -> set[int]:
    """`pids` and every live descendant of them."""
    out = set()
    for pid in pids:
        try:
            p = psutil.Process(pid)
            out |= {pid, *(c.pid for c in p.children(recursive=True))}
        except psutil.NoSuchProcess:
            continue
    return out


def session_members(sids: Iterable[int]) -> set[int]:
    """Every live process in one of the sessions `sids` (the `ray start` sessions of an embedded cluster)."""
    sids = set(sids)
    out = set()
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getsid(p.pid) in sids:
                out.add(p.pid)
        except (ProcessLookupError, PermissionError):
            continue
    return out
