#!/usr/bin/env bash
# A Prefect process worker for deployment kimi/full on this host; stops cleanly on SIGTERM / Ctrl-C,
# also when started in the background (`worker.sh &`, which would otherwise leave SIGINT ignored).
#   PREFECT_API_URL=http://prefect-host:4200/api bash infra/prefect/worker.sh [--limit 1] [--name host-a]
# Extra arguments go to `prefect worker start`. KIMI_WORK_POOL (kimi-process), KIMI_VENV as in setup.sh.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
KIMI_VENV="${KIMI_VENV:-$REPO_ROOT/.venv}"
: "${PREFECT_API_URL:?set PREFECT_API_URL to the shared Prefect server, e.g. http://prefect-host:4200/api}"
source "$(dirname "${BASH_SOURCE[0]}")/auth.sh"
kimi_prefect_client_auth   # PREFECT_API_AUTH_STRING from KIMI_PREFECT_AUTH_FILE; refused beyond this host without
export KIMI_PROJECT_DIR="${KIMI_PROJECT_DIR:-$REPO_ROOT}"   # prefect.yaml's pull step: where flows/ lives
cd "$KIMI_PROJECT_DIR"
exec "$KIMI_VENV/bin/python" -m flows.worker --pool "${KIMI_WORK_POOL:-kimi-process}" "$@"
