"""The node side of `kimi preflight` (`preflight.py` is the driver's): a `NodeProbe` actor pinned to each node reports
that node's facts and takes part in the cross-node checks. Kept light (no torch, no plan): every node starts one
worker for it, at the same time.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import ray

from kimi_pipeline.util.net import free_port

GIB = 1024**3
PACKAGE_ROOT = Path(__file__).resolve().parents[1]


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def source_digest(root: Path = PACKAGE_ROOT) -> str:
    """12 hex digits over this package's .py files (path and bytes): two nodes on different code differ."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def _torch_cuda() -> str | None:
    """The CUDA version torch was built with, read from its installed `torch/version.py` (importing torch would cost
    every probe seconds): None for a CPU build or no torch."""
    found = importlib.util.find_spec("torch")
    if found is None or not found.submodule_search_locations:
        return None
    text = (Path(next(iter(found.submodule_search_locations))) / "version.py").read_text()
    m = re.search(r"^cuda(?:: \S+)? = '([^']+)'", text, re.M)
    return m.group(1) if m else None


def _sglang_version(python: str | None) -> str:
    """SGLang as its own interpreter sees it (it runs from its own environment), else this one's."""
    if python and Path(python).is_file():
        code = "import importlib.metadata as m; print(m.version('sglang'))"
        try:
            out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"error: {e}"
        return out.stdout.strip() if out.returncode == 0 else "absent"
    return _version("sglang")


def _gpus() -> dict[str, Any]:
    """GPUs as nvidia-smi reports them (none: an empty list)."""
    if not shutil.which("nvidia-smi"):
        return {"gpus": [], "driver": None}
    query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits"]
    try:
        lines = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return {"gpus": [], "driver": None}
    rows = [[p.strip() for p in line.split(",")] for line in lines if line.count(",") == 2]
    return {"gpus": [{"name": n, "memory_gib": round(float(m) / 1024, 1)} for n, m, _ in rows],
            "driver": rows[0][2] if rows else None}


class NodeProbe:
    """A node's side of the preflight (a Ray actor pinned to the node)."""

    def __init__(self) -> None:
        self._server: socket.socket | None = None

    def facts(self, sglang_python: str | None) -> dict[str, Any]:
        ram = psutil.virtual_memory().total
        shm = shutil.disk_usage("/dev/shm").total if Path("/dev/shm").is_dir() else 0
        software = {"python": platform.python_version(), "torch": _version("torch"),
                    "megatron-core": _version("megatron-core"), "transformer-engine": _version("transformer-engine"),
                    "sglang": _sglang_version(sglang_python),
                    "kimi-pipeline": f"{_version('kimi-pipeline')}+{source_digest()}"}
        return {"hostname": socket.gethostname(), "ip": ray.util.get_node_ip_address(), "software": software,
                "cuda": _torch_cuda(), "ram_gib": round(ram / GIB, 1), "shm_gib": round(shm / GIB, 1), **_gpus()}

    def write_file(self, path: str, nbytes: int) -> str:
        """Write `nbytes` of random data at `path` (fsync'd); its sha256."""
        data = os.urandom(nbytes)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return hashlib.sha256(data).hexdigest()

    def remove_file(self, path: str) -> None:
        """Remove `path` and its folder when no other preflight is using it."""
        Path(path).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            Path(path).parent.rmdir()

    def read_file(self, path: str) -> dict[str, Any]:
        """The sha256 of `path` as this node reads it and how fast; or why it cannot."""
        t0 = time.perf_counter()
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            return {"error": f"{type(e).__name__}: {e}"}
        seconds = time.perf_counter() - t0
        return {"sha256": hashlib.sha256(data).hexdigest(), "mb_s": round(len(data) / max(seconds, 1e-6) / 1e6, 1)}

    def disk_free(self, path: str) -> dict[str, Any]:
        p = Path(path)
        while not p.exists() and p != p.parent:  # the run dir may not exist yet: its filesystem is the parent's
            p = p.parent
        try:
            return {"free_gib": round(shutil.disk_usage(p).free / GIB, 1)}
        except OSError as e:
            return {"error": f"{type(e).__name__}: {e}"}

    def free_port(self) -> int:
        """A port free on every interface of this node (the collective's rendezvous binds it)."""
        return free_port("")

    def listen(self) -> int:
        """Open a port on this node (all interfaces, as a rendezvous does) and accept connections; the port."""
        self._server = socket.create_server(("0.0.0.0", 0))
        self._server.settimeout(1.0)

        def accept() -> None:
            while self._server is not None:
                try:
                    conn, _ = self._server.accept()
                    conn.close()
                except OSError:
                    continue

        threading.Thread(target=accept, daemon=True).start()
        return self._server.getsockname()[1]

    def reach(self, peers: dict[str, tuple[str, int]], timeout_s: float) -> dict[str, str | None]:
        """Connect to each peer's port: None where it answered, else why not."""
        out: dict[str, str | None] = {}
        for label, (ip, port) in peers.items():
            try:
                socket.create_connection((ip, port), timeout=timeout_s).close()
                out[label] = None
            except OSError as e:
                out[label] = f"{type(e).__name__}: {e}"
        return out

    def close(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            server.close()

    def collective(self, collective_spec: dict[str, Any]) -> list[dict[str, Any]]:
        """This node's ranks of the preflight collective (`preflight_rank`), each a process as a trainer rank is; their
        reports. A rank that outlives the timeout is killed and reported as such."""
        procs = []
        for local in range(collective_spec["ranks_per_node"]):
            env = {
                **os.environ,
                "MASTER_ADDR": collective_spec["master_addr"],
                "MASTER_PORT": str(collective_spec["master_port"]),
                "RANK": str(collective_spec["node_rank"] * collective_spec["ranks_per_node"] + local),
                "WORLD_SIZE": str(collective_spec["world"]),
                "LOCAL_RANK": str(local),
                "KIMI_PREFLIGHT_BYTES": str(collective_spec["bytes"]),
                "KIMI_PREFLIGHT_DEVICE": collective_spec["device"],
                "KIMI_PREFLIGHT_TIMEOUT_S": str(collective_spec["timeout_s"]),
                "OMP_NUM_THREADS": "1",
            }
            procs.append(subprocess.Popen([sys.executable, "-m", "kimi_pipeline.cluster.preflight_rank"], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        out = []
        deadline = time.monotonic() + collective_spec["timeout_s"] + 30
        for local, p in enumerate(procs):
            try:
                stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                stdout, stderr = p.communicate()
                out.append(
                    {
                        "local_rank": local,
                        "ok": False,
                        "error": f"still waiting after {collective_spec['timeout_s']:.0f} s",
                    }
                )
                continue
            lines = [line for line in stdout.splitlines() if line.startswith("{")]
            report = json.loads(lines[-1]) if lines else {
                "ok": False, "error": f"exited {p.returncode}: {(stderr.strip().splitlines() or [''])[-1][:300]}"}
            out.append({"local_rank": local, **report})
        return out
