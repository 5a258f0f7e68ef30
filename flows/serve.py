"""`kimi serve`: a local Prefect server on loopback + deployment `kimi/full`, served from this process.

The deployment's settings (parameters, nightly schedule, concurrency limit, tags) come from
prefect.yaml, so the served deployment and the work-pool one (`prefect deploy`) are the same thing.
Serving (a Prefect Runner in this process) needs no work pool or worker; flow runs execute in child
processes. SIGTERM or Ctrl-C stops the runner, pauses the schedule and stops the server.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from flows.kimi import kimi
from flows.limits import ensure_cluster_limit
from flows.notify import WEBHOOK_ENV, ensure_failure_automation
from kimi_pipeline.util.lifetime import die_with_parent
from kimi_pipeline.util.net import LOOPBACK, free_port
from kimi_pipeline.util.paths import PROJECT_ROOT

PROJECT_FILE = PROJECT_ROOT / "prefect.yaml"
DEPLOYMENT = "full"
DEFAULT_PORT = 4200
SERVER_START_TIMEOUT_S = 180.0


class ServeError(RuntimeError):
    """The server could not be started (port taken, broken install): the message says why."""


def deployment_spec(name: str = DEPLOYMENT, project_file: Path = PROJECT_FILE) -> dict[str, Any]:
    """The `deployments:` entry `name` of prefect.yaml."""
    data = yaml.safe_load(project_file.read_text())
    for deployment in data.get("deployments") or []:
        if deployment.get("name") == name:
            return deployment
    raise ServeError(f"{project_file}: no deployment named {name!r} under `deployments:`")


def full_deployment(schedule: bool = True, name: str = DEPLOYMENT):
    """Deployment `kimi/<name>` as a RunnerDeployment (for serving), from its prefect.yaml entry."""
    from prefect.client.schemas.objects import ConcurrencyLimitConfig
    from prefect.deployments.runner import EntrypointType
    from prefect.schedules import Cron

    deployment = deployment_spec(name)
    schedules = [Cron(s["cron"], timezone=s.get("timezone"), active=schedule and s.get("active", True))
                 for s in deployment.get("schedules") or [] if "cron" in s]
    limit = deployment.get("concurrency_limit")
    return kimi.to_deployment(
        name=deployment["name"],
        description=" ".join(str(deployment.get("description", "")).split()) or None,
        tags=list(deployment.get("tags") or []),
        parameters=dict(deployment.get("parameters") or {}),
        schedules=schedules,
        concurrency_limit=ConcurrencyLimitConfig(**limit) if isinstance(limit, dict) else limit,
        entrypoint_type=EntrypointType.MODULE_PATH,  # `flows.kimi.kimi`: importable whatever the cwd
    )


# --------------------------------------------------------------------------- the server


def _child_setup() -> None:
    """In the server process before exec: default SIGINT/SIGTERM even when we were started with them ignored
    (`&`), and (Linux) a SIGTERM when we die, so that even a SIGKILLed `kimi serve` leaves no server behind."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    die_with_parent(signal.SIGTERM)


@dataclass
class PrefectServer:
    process: subprocess.Popen
    host: str
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def api_url(self) -> str:
        return f"{self.url}/api"

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.api_url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGTERM the server's process group, SIGKILL what is left after `grace_s`."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
            except ProcessLookupError:
                pass
        return self.process.returncode


def start_server(port: int = DEFAULT_PORT, host: str = LOOPBACK, home: Path | None = None,
                 timeout_s: float = SERVER_START_TIMEOUT_S) -> PrefectServer:
    """`prefect server start` (API, UI and services: the scheduler makes the nightly runs) as a child
    process with its own session; returns once /api/health answers. `port=0` picks a free port."""
    port = port or free_port(host)
    env = dict(os.environ)
    env.pop("PREFECT_API_URL", None)  # the server is not a client of another server
    if home is not None:
        env["PREFECT_HOME"] = str(home)
    # the UI asks the API at PREFECT_UI_API_URL, which otherwise defaults to the settings' port (4200)
    env.update(PREFECT_SERVER_API_HOST=host, PREFECT_SERVER_API_PORT=str(port),
               PREFECT_UI_API_URL=f"http://{host}:{port}/api")
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    env.setdefault("DO_NOT_TRACK", "1")
    log_dir = Path(env.get("PREFECT_HOME") or Path.home() / ".prefect")
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"server-{port}.log"
    with socket.socket() as s:
        if s.connect_ex((host, port)) == 0:
            raise ServeError(f"port {port} on {host} is already in use: pick another with --port (0 = any free port)")
    with open(log_path, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", str(port),
             "--analytics-off"],
            env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=_child_setup,
        )
    server = PrefectServer(proc, host, port, log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
            raise ServeError(f"the Prefect server exited with code {proc.returncode}; see {log_path}:\n{tail}")
        if server.healthy():
            return server
        time.sleep(0.5)
    server.stop()
    raise ServeError(f"the Prefect server did not answer {server.api_url}/health in {timeout_s:.0f} s; see {log_path}")


# --------------------------------------------------------------------------- serving


def serve_deployment(schedule: bool = True) -> None:
    """Serve `kimi/full` against the current PREFECT_API_URL until SIGTERM / Ctrl-C."""

    from prefect import serve

    # Prefect 3.8's SIGTERM handler calls an async stop without awaiting it; shutdown still completes
    warnings.filterwarnings("ignore", message="coroutine 'Runner.astop' was never awaited", category=RuntimeWarning)
    ensure_cluster_limit()
    if os.environ.get(WEBHOOK_ENV):  # crashed runs (no hook could run) are reported by the server
        ensure_failure_automation(os.environ[WEBHOOK_ENV])
    serve(full_deployment(schedule), print_starting_message=False)


def serve_local(port: int = DEFAULT_PORT, schedule: bool = True) -> int:
    """`kimi serve`: server on loopback + the served deployment; returns the exit code."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started in the background with `&`
    os.chdir(PROJECT_ROOT)  # the run dirs (runs/) and data/ the presets name are relative to the project
    server = start_server(port)
    try:
        os.environ["PREFECT_API_URL"] = server.api_url
        os.environ["PREFECT_UI_URL"] = server.url
        from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL, temporary_settings

        with temporary_settings(updates={PREFECT_API_URL: server.api_url, PREFECT_UI_URL: server.url}):
            cron = "nightly schedule active" if schedule else "schedule paused"
            print(f"Prefect UI:  {server.url}   (API {server.api_url}, server log {server.log_path})\n"
                  f"serving deployment kimi/{DEPLOYMENT} ({cron}); from another shell:\n"
                  f"  PREFECT_API_URL={server.api_url} prefect deployment run kimi/{DEPLOYMENT} --watch\n"
                  "stop with Ctrl-C or SIGTERM", flush=True)
            serve_deployment(schedule)
    except SystemExit as e:  # the runner's SIGTERM handler exits with 0
        return int(e.code or 0)
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()
    return 0
