#!/usr/bin/env bash
# One-time set-up of the multi-host variant, against a Prefect server every host can reach (server.sh: with API
# auth, whose string this script and worker.sh read from KIMI_PREFECT_AUTH_FILE, see auth.sh):
#   the process work pool, the one-run-per-cluster concurrency limit, and deployment `full` (prefect.yaml).
#   PREFECT_API_URL=http://prefect-host:4200/api bash infra/prefect/setup.sh
# Then on every worker host (same repo path on the shared filesystem, or KIMI_PROJECT_DIR set):
#   PREFECT_API_URL=http://prefect-host:4200/api bash infra/prefect/worker.sh
# Overridable: KIMI_WORK_POOL (kimi-process), KIMI_CLUSTER_LIMITS (kimi-cluster-local; space-separated,
# one per Ray cluster: kimi-cluster-<cluster.address with non [A-Za-z0-9_.-] as '-'>), KIMI_VENV;
# KIMI_NOTIFY_WEBHOOK (+ KIMI_NOTIFY_STATES, default "Crashed") also creates the failure Automation.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
KIMI_VENV="${KIMI_VENV:-$REPO_ROOT/.venv}"
PY="$KIMI_VENV/bin/python"
POOL="${KIMI_WORK_POOL:-kimi-process}"
LIMITS="${KIMI_CLUSTER_LIMITS:-kimi-cluster-local}"
: "${PREFECT_API_URL:?set PREFECT_API_URL to the shared Prefect server, e.g. http://prefect-host:4200/api}"
[[ -x "$PY" ]] || { echo "error: $PY not found; create the venv (make install) or set KIMI_VENV" >&2; exit 2; }
source "$(dirname "${BASH_SOURCE[0]}")/auth.sh"
kimi_prefect_client_auth   # PREFECT_API_AUTH_STRING from KIMI_PREFECT_AUTH_FILE; refused beyond this host without

cd "$REPO_ROOT"
"$PY" -m prefect work-pool create "$POOL" --type process --overwrite
for name in $LIMITS; do
  "$PY" -c 'import sys; from flows.limits import ensure_cluster_limit; ensure_cluster_limit(sys.argv[1])' "$name"
  echo "global concurrency limit $name = 1"
done
if [[ -n "${KIMI_NOTIFY_WEBHOOK:-}" ]]; then   # server-side notice of crashed runs (the flow's hook reports failures)
  "$PY" -c 'import os, sys; from flows.notify import ensure_failure_automation as f
f(os.environ["KIMI_NOTIFY_WEBHOOK"], tuple(sys.argv[1:]))' \
    ${KIMI_NOTIFY_STATES:-Crashed}
  echo "automation kimi-run-failed: flow kimi ${KIMI_NOTIFY_STATES:-Crashed} -> KIMI_NOTIFY_WEBHOOK"
fi
"$PY" -m prefect --no-prompt deploy --prefect-file prefect.yaml --name full --pool "$POOL"
echo "deployment kimi/full -> work pool $POOL; start workers with infra/prefect/worker.sh"
