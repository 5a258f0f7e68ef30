"""The rollout engines' key: every engine, embedded or SGLang, loopback or not, requires it as `Authorization:
Bearer` on every endpoint but /health* (SGLang's `--api-key` rule, sglang/srt/utils/auth.py), and every client
sends it. Without it any local user could `POST /update_weights_from_disk` with a path of their choosing (swapping
the policy), push tensors, release memory or abort requests.

One random key per run, never on a command line (`ps` shows those to every user):

- the run keeps it in `<run_dir>/engine.key` (0600): processes on other nodes read it from the shared run dir,
  and a resumed run finds the engines of its kept cluster still answering to it;
- a process learns it from `$KIMI_ENGINE_KEY_FILE` (the file; what Ray actors get, in their runtime_env) or
  `$KIMI_ENGINE_API_KEY` (the key itself: this process and the processes it starts). The key itself never goes
  into a runtime_env: Ray 2.60's runtime-env agent logs every runtime_env it creates, env_vars included, to the
  world-readable `session_*/logs/runtime_env_agent.log` (ray/_private/runtime_env/agent/runtime_env_agent.py:543);
- a process with neither (a `kimi eval` engine and its client in one process, a test) draws a key and exports it
  to its own environment, so the engines and clients it makes agree.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path

KEY_VAR = "KIMI_ENGINE_API_KEY"
KEY_FILE_VAR = "KIMI_ENGINE_KEY_FILE"
KEY_FILE_NAME = "engine.key"


class EngineKeyError(RuntimeError):
    """The key file a process was pointed at is missing, empty or readable by others."""


def read_key_file(path: Path) -> str:
    """The key in `path`, which only its owner may read (a key others can read protects nothing)."""
    try:
        mode = path.stat().st_mode
        key = path.read_text().strip()
    except OSError as exc:
        raise EngineKeyError(f"${KEY_FILE_VAR}={path}: {exc}") from exc
    if mode & 0o077:
        raise EngineKeyError(f"{path} is readable by others (mode {mode & 0o777:o}): `chmod 600 {path}`")
    if not key:
        raise EngineKeyError(f"{path} holds no key: delete it (the run writes a new one) or write one")
    return key


def engine_api_key() -> str:
    """The key of this process's run: the file named by $KIMI_ENGINE_KEY_FILE, else $KIMI_ENGINE_API_KEY, else a new
    random key exported to this process's environment (inherited by the processes it starts)."""
    path = os.environ.get(KEY_FILE_VAR)
    if path:
        return read_key_file(Path(path))
    key = os.environ.get(KEY_VAR, "").strip()
    if not key:
        key = os.environ[KEY_VAR] = secrets.token_hex(32)
    return key


def use_run_key(run_dir: Path) -> Path:
    """Make `<run_dir>/engine.key` this process's engine key (written 0600 when the run has none yet) and point
    $KIMI_ENGINE_KEY_FILE at it, so the actors this process starts (`key_env`) use it too. Returns the file."""
    path = Path(run_dir).resolve() / KEY_FILE_NAME
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{KEY_FILE_NAME}.")  # mkstemp: 0600, ours
        try:
            os.write(fd, secrets.token_hex(32).encode())
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # never replace a key another process of the run just wrote
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    os.environ[KEY_VAR] = read_key_file(path)
    os.environ[KEY_FILE_VAR] = str(path)
    return path


def key_env() -> dict[str, str]:
    """What an actor's runtime_env carries so it finds the run's key: the key file's path (not a secret), when the
    run has one; else nothing (the actor inherits $KIMI_ENGINE_API_KEY from its raylet, as a test cluster does)."""
    path = os.environ.get(KEY_FILE_VAR)
    return {KEY_FILE_VAR: path} if path else {}


def auth_headers() -> dict[str, str]:
    """The header every request to an engine carries."""
    return {"Authorization": f"Bearer {engine_api_key()}"}
