#!/usr/bin/env bash
# Join this node to the head at $MASTER_ADDR (run on every node but the head).
#   MASTER_ADDR=10.0.0.1 BASE_DIR=/shared bash infra/ray/worker.sh
# WORKER_IP: this node's address as the others reach it (default: Ray picks the route to the head).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

if [[ "$RAY_AUTH_MODE" == "token" && ! -s "$RAY_AUTH_TOKEN_PATH" ]]; then
  echo "error: token auth is on but $RAY_AUTH_TOKEN_PATH is missing: run head.sh first (BASE_DIR must be shared)" >&2
  exit 2
fi

"$RAY_BIN" start --address "$MASTER_ADDR:$RAY_PORT" \
  ${WORKER_IP:+--node-ip-address "$WORKER_IP"} \
  --num-gpus "$GPUS_PER_NODE" ${NUM_CPUS:+--num-cpus "$NUM_CPUS"} \
  --temp-dir "$RAY_TMPDIR" --disable-usage-stats ${RAY_START_ARGS:-} "${BLOCK_ARGS[@]}"
