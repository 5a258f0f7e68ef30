# Shared settings for head.sh / worker.sh (sourced, not run). Every value can be overridden from the
# environment; the seeds' variables are MASTER_ADDR (head node IP) and BASE_DIR (shared filesystem).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
KIMI_VENV="${KIMI_VENV:-$REPO_ROOT/.venv}"
RAY_BIN="${RAY_BIN:-$KIMI_VENV/bin/ray}"            # the venv's Ray, never whatever `ray` PATH finds

: "${MASTER_ADDR:?set MASTER_ADDR to the head node IP (reachable from every worker)}"
: "${BASE_DIR:?set BASE_DIR to the shared filesystem root (same path on every node)}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"                  # the Kimi recipes: 32 nodes x 8 GPUs
RAY_PORT="${RAY_PORT:-6379}"
DASHBOARD_HOST="${DASHBOARD_HOST:-127.0.0.1}"        # 0.0.0.0 to submit jobs from other machines
DASHBOARD_PORT="${DASHBOARD_PORT:-8265}"

# Ray 2.60 turns token auth on by itself once a token file exists; say what we want explicitly.
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
# One token for the whole cluster, on the shared filesystem (head.sh creates it, workers read it).
export RAY_AUTH_TOKEN_PATH="${RAY_AUTH_TOKEN_PATH:-$BASE_DIR/.ray/auth_token}"
export RAY_USAGE_STATS_ENABLED=0
# Node-local and short: Ray's unix sockets live under it (paths must stay under 107 bytes).
export RAY_TMPDIR="${RAY_TMPDIR:-/tmp/ray-kimi}"

# RAY_START_ARGS: extra `ray start` flags, word-split (e.g. "--ray-client-server-port 10002").
BLOCK_ARGS=()
if [[ "${RAY_BLOCK:-0}" == "1" ]]; then BLOCK_ARGS=(--block); fi   # foreground (k8s, slurm, systemd)

if [[ ! -x "$RAY_BIN" ]]; then
  echo "error: $RAY_BIN not found; create the venv (see README) or set KIMI_VENV / RAY_BIN" >&2
  exit 2
fi
mkdir -p "$RAY_TMPDIR"
