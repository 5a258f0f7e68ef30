"""Issue 40 item 4: the shared Prefect server of the multi-host variant requires API auth (infra/prefect/server.sh,
auth.sh), and the scripts that talk to it send it or refuse to talk to a server beyond this host without it."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from kimi_pipeline.util.net import free_port
from support.prefect_home import migrated_home

pytestmark = pytest.mark.slow  # a Prefect server started and stopped (~30 s)

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra" / "prefect"
CLEAN = ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING", "PREFECT_SERVER_API_AUTH_STRING", "PREFECT_API_KEY")


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLEAN}
    return {**env, "PREFECT_HOME": str(tmp_path / "home"), "KIMI_PREFECT_AUTH_FILE": str(tmp_path / "auth"), **extra}


def test_the_shared_server_answers_only_with_the_api_auth_string(tmp_path):
    """server.sh writes a random auth string to a 0600 file (never on a command line) and starts the server with
    it: every API route but /health answers 401 without it or with another; the `prefect` CLI with
    PREFECT_API_AUTH_STRING works."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = _env(tmp_path, KIMI_PREFECT_HOST="127.0.0.1", KIMI_PREFECT_PORT=str(port))
    migrated_home(Path(env["PREFECT_HOME"]))  # its database at the schema already (support/prefect_home.py)
    with open(tmp_path / "server.log", "wb") as log:
        server = subprocess.Popen(["bash", str(INFRA / "server.sh")], env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:  # open, for probes
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        auth_file = tmp_path / "auth"
        secret = auth_file.read_text()
        assert stat.S_IMODE(auth_file.stat().st_mode) == 0o600 and secret.startswith("kimi:") and len(secret) > 40
        user, password = secret.split(":", 1)
        processes = [psutil.Process(server.pid), *psutil.Process(server.pid).children(recursive=True)]
        assert not any(password in " ".join(p.cmdline()) for p in processes)
        assert httpx.post(f"{url}/flows/filter", json={}, timeout=30).status_code == 401
        assert httpx.post(f"{url}/flows/filter", json={}, auth=(user, "wrong"), timeout=30).status_code == 401
        assert httpx.post(f"{url}/flows/filter", json={}, auth=(user, password), timeout=30).status_code == 200
        cli = [sys.executable, "-m", "prefect", "work-pool", "ls"]
        denied = subprocess.run(cli, env={**env, "PREFECT_API_URL": url}, capture_output=True, text=True, timeout=120)
        assert denied.returncode != 0
        ok = subprocess.run(cli, env={**env, "PREFECT_API_URL": url, "PREFECT_API_AUTH_STRING": secret},
                            capture_output=True, text=True, timeout=120)
        assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


@pytest.mark.parametrize("script", ["setup.sh", "worker.sh"])
def test_the_scripts_refuse_a_server_beyond_this_host_without_api_auth(tmp_path, script):
    env = _env(tmp_path, PREFECT_API_URL="http://10.255.255.1:4200/api")
    done = subprocess.run(["bash", str(INFRA / script)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "no API auth is set" in done.stderr and "server.sh" in done.stderr, done.stderr
