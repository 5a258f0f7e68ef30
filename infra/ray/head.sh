#!/usr/bin/env bash
# Start the Ray head on this node (also a training node with its GPUs, as in the seeds).
#   MASTER_ADDR=10.0.0.1 BASE_DIR=/shared bash infra/ray/head.sh
# Then run worker.sh on every other node, and point the pipeline at it:
#   kimi run --recipe kimi-k2.5 --set cluster.address=$MASTER_ADDR:6379
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

if [[ "$RAY_AUTH_MODE" == "token" && ! -s "$RAY_AUTH_TOKEN_PATH" ]]; then
  mkdir -p "$(dirname "$RAY_AUTH_TOKEN_PATH")"
  (umask 077 && "$KIMI_VENV/bin/python" -c 'import secrets; print(secrets.token_hex(32), end="")' > "$RAY_AUTH_TOKEN_PATH")
  echo "created the cluster token $RAY_AUTH_TOKEN_PATH (mode 600)"
fi

"$RAY_BIN" start --head \
  --node-ip-address "$MASTER_ADDR" --port "$RAY_PORT" \
  --num-gpus "$GPUS_PER_NODE" ${NUM_CPUS:+--num-cpus "$NUM_CPUS"} \
  --dashboard-host "$DASHBOARD_HOST" --dashboard-port "$DASHBOARD_PORT" \
  --temp-dir "$RAY_TMPDIR" --disable-usage-stats ${RAY_START_ARGS:-} "${BLOCK_ARGS[@]}"

echo "Ray head: $MASTER_ADDR:$RAY_PORT  dashboard: http://$DASHBOARD_HOST:$DASHBOARD_PORT  auth: $RAY_AUTH_MODE"
