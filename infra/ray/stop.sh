#!/usr/bin/env bash
# Stop Ray on this node. `ray stop` ends EVERY Ray process of this user on the node: fine on a
# dedicated cluster node; on a shared machine use `kimi cluster down --run-dir DIR` instead, which
# stops only the processes a run started.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
"${RAY_BIN:-${KIMI_VENV:-$REPO_ROOT/.venv}/bin/ray}" stop "$@"
