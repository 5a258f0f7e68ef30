"""The environment every Ray process of a run gets: explicit auth mode, temp dir, no usage stats.

Ray 2.60 turns token auth on for a new local cluster once `~/.ray/auth_token` exists (the first plain
`ray.init()` writes it), so leaving RAY_AUTH_MODE unset makes the cluster's behaviour depend on the
machine's history. We always set it: `token` unless the user exported RAY_AUTH_MODE=disabled.
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
import tempfile
from pathlib import Path

from kimi_pipeline.cluster.cluster_errors import ClusterConfigError
from kimi_pipeline.util.net import is_loopback

AUTH_MODES = ("token", "disabled")
DEFAULT_TOKEN_PATH = Path.home() / ".ray" / "auth_token"

# AF_UNIX socket paths are limited to 107 bytes on Linux. Ray puts its sockets at
# <temp_dir>/session_<date>_<time>_<usec>_<pid>/sockets/plasma_store[.N] (one suffix per extra raylet).
SOCKET_PATH_MAX = 107
SOCKET_PATH_TAIL = "/session_2026-01-01_00-00-00_000000_4194304/sockets/plasma_store.99"


def auth_mode() -> str:
    """RAY_AUTH_MODE for clusters we start: the user's explicit choice, else `token`."""
    mode = os.environ.get("RAY_AUTH_MODE", "token").strip().lower()
    if mode not in AUTH_MODES:
        raise ClusterConfigError(f"RAY_AUTH_MODE={mode!r} is not one of {', '.join(AUTH_MODES)}: fix or unset it")
    return mode


def token_source() -> str:
    """Where Ray reads the token from (same precedence as Ray): env, env-named file, default file."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "RAY_AUTH_TOKEN"
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return os.environ["RAY_AUTH_TOKEN_PATH"]
    return str(DEFAULT_TOKEN_PATH)


# One-host Ray on loopback. Ray 2.60 binds every server of a node to loopback only when the node's IP is 127.0.0.1:
# its C++ gRPC servers (GCS, raylet, every worker: measured with /proc/net/tcp, no option binds them otherwise) and
# its Python ones (dashboard agent dashboard/agent.py:164-169 and dashboard/http_server_agent.py:60-63, metrics
# exporters dashboard/modules/reporter/reporter_agent.py:534, dashboard/head.py:361, autoscaler/_private/monitor.py:205,
# the Ray Client server's --host). Elsewhere they listen on every interface. And Ray takes 127.0.0.1 as a node IP
# only in its single-host (Windows/macOS) mode: otherwise `ray start --node-ip-address 127.0.0.1` and
# `ray.init(address="127.0.0.1:…")` swap in the host's routable address (_private/services.py:716, 786-803) unless
# RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (services.py:815-819, _private/ray_constants.py:657-661). That mode refuses a
# second raylet (`ray start --address`, scripts/scripts.py:1169-1180): only a cluster of one node can be on loopback.
SINGLE_HOST_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def loopback_env() -> dict[str, str]:
    """What the processes of a one-node cluster on 127.0.0.1 (its `ray start`, its drivers) run with."""
    return {SINGLE_HOST_VAR: "0"}


def use_loopback_ray(on: bool) -> None:
    """Make this process's Ray take 127.0.0.1 as its node's address (a driver of a loopback cluster, or of a
    `ray.init()` local cluster it starts) or not (any other cluster). Ray reads the variable once, at import
    (ray_constants.py:658), so in a process that has imported Ray the constant follows as well."""
    if on:
        os.environ.update(loopback_env())
    else:
        os.environ.pop(SINGLE_HOST_VAR, None)
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = constants.env_bool(SINGLE_HOST_VAR, not constants.IS_WINDOWS_OR_OSX)


def require_auth(mode: str, nodes: int, allow_insecure: bool) -> None:
    """Refuse a Ray cluster of several nodes without token auth, unless the recipe accepts it
    (`cluster.allow_insecure`): its GCS, raylets and workers listen beyond this host, and without auth anyone who
    reaches them can run code as the run's user (one node runs on loopback: `use_loopback_ray`)."""
    if mode == "disabled" and nodes > 1 and not allow_insecure:
        raise ClusterConfigError(
            f"RAY_AUTH_MODE=disabled on a Ray cluster of {nodes} nodes: anyone who reaches a node can run code as this "
            "run's user. Use token auth (unset RAY_AUTH_MODE, or RAY_AUTH_MODE=token with the cluster's token: "
            "infra/ray/env.sh, KubeRay's authOptions), or accept the risk with --set cluster.allow_insecure=true")


def is_loopback_address(address: str) -> bool:
    """Whether a GCS address HOST:PORT is on loopback: its drivers must `use_loopback_ray(True)`."""
    return is_loopback(address.rpartition(":")[0].strip("[]"))


def ensure_token() -> str:
    """Make sure token auth has a token: create Ray's default token file (0600) if none is configured.

    One stable per-user token (Ray's own default location), not one per run: Ray caches the token per
    process, so a per-run token would go stale in a process that runs several flows.
    """
    source = token_source()
    if source == "RAY_AUTH_TOKEN":
        return source
    path = Path(source)
    if path.is_file() and path.read_text().strip():
        return source
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        raise ClusterConfigError(f"RAY_AUTH_TOKEN_PATH={path} is missing or empty: write a token there or unset it")
    if path.exists():
        raise ClusterConfigError(f"{path} exists but holds no token: delete it (a new one is made) or write one")
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".auth_token.")
    try:
        os.write(fd, secrets.token_hex(32).encode())
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # never overwrite a token another process just created
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    return source


# Ray's own metrics, off on the clusters a run starts itself and in their drivers. Every Ray process records them and
# its node's dashboard agent serves them to a Prometheus, which nothing points at an embedded cluster (a run's own
# metrics are its metrics.jsonl, TensorBoard and W&B). And a driver flushes them in `ray.shutdown()`: with the Ray head
# gone, that flush waits on the dead node's agent for 30 s (py-spy on the head-lost test's `kimi run`: shutdown_driver
# → ~CoreWorkerProcessImpl → OpenTelemetryMetricRecorder::Shutdown → MetricReader::ForceFlush; its flow run ended
# 34-37 s after the train task failed, 8 s with this off). A cluster we only connect to keeps its own setting.
RAY_METRICS_VAR = "RAY_enable_metrics_collection"
RAY_METRICS_OFF = {RAY_METRICS_VAR: "0"}

# No idle workers started ahead of a run's drivers. When its first driver registers, a raylet starts as many Python
# workers as it has CPUs (`--num_prestart_python_workers`, _private/services.py:2019-2021; Ray's
# prestart_worker_first_driver, on by default: `strings .../ray/core/src/ray/raylet/raylet | grep prestart`). They
# start without a runtime_env, and every actor and task of a run's drivers has one (`util.redact.ray_worker_setup`,
# the actors' env_vars), so Ray never hands them work: measured on a one-node embedded cluster (2 CPUs, one driver,
# two actors), two `ray::IDLE` processes of ~0.6 CPU-s each that lived as long as the cluster; the suite of
# 2026-11-29 had 47 of them. Actors start their own workers either way.
RAY_PRESTART_OFF = {"RAY_prestart_worker_first_driver": "0"}


def ray_env(temp_dir: Path | None, mode: str | None = None) -> dict[str, str]:
    """Variables for the Ray processes we start and for drivers that connect to them."""
    mode = mode or auth_mode()
    env = {"RAY_AUTH_MODE": mode, "RAY_USAGE_STATS_ENABLED": "0", **RAY_METRICS_OFF, **RAY_PRESTART_OFF}
    if temp_dir is not None:
        env["RAY_TMPDIR"] = str(temp_dir)
    return env


def socket_safe(temp_dir: Path) -> bool:
    return len(str(temp_dir)) + len(SOCKET_PATH_TAIL) <= SOCKET_PATH_MAX


def choose_temp_dir(run_dir: Path) -> tuple[Path, str | None]:
    """`<run_dir>/ray` if Ray's socket paths fit under it, else a short /tmp dir linked from there.

    Returns (temp dir, note) where note explains a fallback (None when the run dir is used).
    """
    preferred = Path(run_dir).resolve() / "ray"
    if socket_safe(preferred):
        if preferred.is_symlink():
            preferred.unlink()
        preferred.mkdir(parents=True, exist_ok=True)
        return preferred, None
    short = Path(tempfile.mkdtemp(prefix="kimi-ray-", dir="/tmp"))
    if preferred.is_symlink() or not preferred.exists():
        preferred.unlink(missing_ok=True)
        preferred.symlink_to(short, target_is_directory=True)
    note = (
        f"{preferred} ({len(str(preferred))} chars) is too long for Ray's unix socket paths "
        f"(limit {SOCKET_PATH_MAX} bytes incl. ~{len(SOCKET_PATH_TAIL)} of session/socket names); "
        f"using {short} (linked from the run dir; logs are moved back at teardown)"
    )
    return short, note


def gcs_reachable(address: str, timeout_s: float = 2.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False
