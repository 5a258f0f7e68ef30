"""On each Ray node of a weight job, the actor that runs the node's torchrun agent (`NodeAgent`), and the driver's
watch over them (`watch_agents`): every agent's log streamed into the stage log (prefixed with its node) and into
`<work_dir>/logs/<name>.node<i>.log`, until all exit, one fails (then a grace period for the rest) or the job times
out. Agents die with their actor (PDEATHSIG). `ray_agents.launch_ray` places and starts them."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ray

from kimi_pipeline.util.lifetime import bound_env
from kimi_pipeline.util.net import free_port

log = logging.getLogger(__name__)


class NodeAgent:
    """Runs one node's torchrun agent and hands its log over in pieces (a Ray actor)."""

    def __init__(self, node: int):
        self.node = node
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(tempfile.mkdtemp(prefix=f"kimi-node{node}-")) / "agent.log"

    def address(self) -> tuple[str, str]:
        """(IP, Ray node id) of the node this agent landed on."""

        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()

    def free_port(self) -> int:
        """A port free on this node's address, where node 0's rendezvous store will listen (`weightjobs.agent`)."""
        return free_port(ray.util.get_node_ip_address())

    def start(self, cmd: list[str], env: dict[str, str]) -> int:
        """Start the node's agent with this node's Python (the cluster's environment, not the driver's)."""

        cmd = [sys.executable, *cmd[1:]]
        with open(self.log_path, "wb") as fh:
            self.proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=bound_env({**os.environ, **env}),
                                         start_new_session=True)  # the agent dies with this actor: it binds itself
        return self.proc.pid

    def poll(self, offset: int) -> tuple[int | None, bytes]:
        """(exit code or None while running, log bytes from `offset`)."""
        code = self.proc.poll() if self.proc else None
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(offset)
                data = fh.read(1 << 20)
        except OSError:
            data = b""
        return code, data

    def stop(self, grace_s: float = 10.0) -> int | None:
        """Stop the agent's process group if it still runs (SIGTERM, then SIGKILL); remove the node-local log."""
        try:
            if self.proc is None or self.proc.poll() is not None:
                return self.proc.returncode if self.proc else None
            for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            return self.proc.returncode
        finally:
            shutil.rmtree(self.log_path.parent, ignore_errors=True)


def watch_agents(agents: list[Any], name: str, log_dir: Path, timeout: float | None, grace: float
                 ) -> tuple[list[int | None], float, bool]:
    """Stream logs and wait: all agents exit, or one fails (then `grace` for the rest), or the timeout."""

    n = len(agents)
    offsets, partial = [0] * n, [b""] * n
    codes: list[int | None] = [None] * n
    files = [open(log_dir / f"{name}.node{i}.log", "wb") for i in range(n)]
    t0, failed_at, timed_out = time.monotonic(), None, False
    def pump() -> bool:
        """One round of polls; True if any log bytes came."""
        got = False
        for i, (code, data) in enumerate(ray.get([a.poll.remote(o) for a, o in zip(agents, offsets)])):
            codes[i] = code
            if data:
                got = True
                offsets[i] += len(data)
                files[i].write(data)
                files[i].flush()
                *lines, partial[i] = (partial[i] + data).split(b"\n")
                for line in lines:
                    text = line.decode(errors="replace")
                    if text and "Warning" not in text and "warnings.warn" not in text:
                        log.info("[%s node %d] %s", name, i, text)
        return got

    try:
        while True:
            pump()
            if all(c is not None for c in codes):
                while pump():  # the log tails written just before the agents exited
                    pass
                break
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > grace:
                break
            if timeout is not None and time.monotonic() - t0 > timeout:
                timed_out = True
                break
            time.sleep(0.3)
    finally:
        for f in files:
            f.close()
    return codes, time.monotonic() - t0, timed_out
