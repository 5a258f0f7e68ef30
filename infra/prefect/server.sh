#!/usr/bin/env bash
# The shared Prefect server of the multi-host variant, with API auth (basic auth, infra/prefect/auth.sh).
#   bash infra/prefect/server.sh            # KIMI_PREFECT_HOST (0.0.0.0), KIMI_PREFECT_PORT (4200), KIMI_VENV
# Extra arguments go to `prefect server start`. The auth string comes from PREFECT_SERVER_API_AUTH_STRING, else
# KIMI_PREFECT_AUTH_FILE (created with a random one when missing); setup.sh and worker.sh read the same file.
# Foreground: stop it with SIGTERM / Ctrl-C (run it under systemd or tmux). Put TLS in front of it (a reverse
# proxy) when the network between the hosts is not trusted: basic auth travels in the clear over plain HTTP.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
KIMI_VENV="${KIMI_VENV:-$REPO_ROOT/.venv}"
source "$(dirname "${BASH_SOURCE[0]}")/auth.sh"
[[ -x "$KIMI_VENV/bin/python" ]] || { echo "error: $KIMI_VENV/bin/python not found; make install or set KIMI_VENV" >&2; exit 2; }

if [[ -z "${PREFECT_SERVER_API_AUTH_STRING:-}" ]]; then
  PREFECT_SERVER_API_AUTH_STRING="$(kimi_prefect_auth_string create)"
fi
export PREFECT_SERVER_API_AUTH_STRING   # the environment, never argv (`ps` shows argv to every user)
export PREFECT_SERVER_ANALYTICS_ENABLED="${PREFECT_SERVER_ANALYTICS_ENABLED:-false}"
HOST="${KIMI_PREFECT_HOST:-0.0.0.0}"
PORT="${KIMI_PREFECT_PORT:-4200}"
echo "Prefect server on $HOST:$PORT with API auth (clients: PREFECT_API_AUTH_STRING, from $KIMI_PREFECT_AUTH_FILE)"
exec "$KIMI_VENV/bin/python" -m prefect server start --host "$HOST" --port "$PORT" "$@"
