# API auth of the shared Prefect server (sourced by server.sh, setup.sh and worker.sh, not run).
# Prefect 3's server takes HTTP basic auth "user:password" from PREFECT_SERVER_API_AUTH_STRING and its clients
# send PREFECT_API_AUTH_STRING (prefect/settings/models/server/api.py, settings/models/api.py; checked in
# prefect/server/api/server.py: every route but GET /api/health and /api/ready answers 401 without it).
# Without it anyone who reaches the server can start `kimi/full` with parameters of their choosing (a recipe
# file, a run dir): code run as the workers' user. One string for the server and every worker, kept in a 0600
# file on the shared filesystem (never on a command line): KIMI_PREFECT_AUTH_FILE, created by server.sh.
KIMI_PREFECT_AUTH_FILE="${KIMI_PREFECT_AUTH_FILE:-$HOME/.prefect/kimi-api-auth}"

kimi_prefect_auth_string() {   # the string in KIMI_PREFECT_AUTH_FILE; made (kimi:<random>, mode 600) when $1 = create
  if [[ ! -s "$KIMI_PREFECT_AUTH_FILE" && "${1:-}" == "create" ]]; then
    mkdir -p "$(dirname "$KIMI_PREFECT_AUTH_FILE")"
    (umask 077 && "$KIMI_VENV/bin/python" -c 'import secrets; print("kimi:" + secrets.token_hex(24), end="")' \
      > "$KIMI_PREFECT_AUTH_FILE")
    echo "created the Prefect API auth string $KIMI_PREFECT_AUTH_FILE (mode 600)" >&2
  fi
  [[ -s "$KIMI_PREFECT_AUTH_FILE" ]] && cat "$KIMI_PREFECT_AUTH_FILE"
}

kimi_prefect_client_auth() {   # a client of a server beyond this host must authenticate
  if [[ -z "${PREFECT_API_AUTH_STRING:-}" && -s "$KIMI_PREFECT_AUTH_FILE" ]]; then
    PREFECT_API_AUTH_STRING="$(kimi_prefect_auth_string)"
    export PREFECT_API_AUTH_STRING
  fi
  local host="${PREFECT_API_URL#*://}"; host="${host%%/*}"; host="${host%:*}"
  if [[ -z "${PREFECT_API_AUTH_STRING:-}" && -z "${PREFECT_API_KEY:-}" && "$host" != 127.* && "$host" != localhost \
        && "$host" != "[::1]" ]]; then
    echo "error: $PREFECT_API_URL is beyond this host and no API auth is set: start the server with" \
         "infra/prefect/server.sh (it writes $KIMI_PREFECT_AUTH_FILE; point KIMI_PREFECT_AUTH_FILE at that file on the" \
         "shared filesystem) or export PREFECT_API_AUTH_STRING (PREFECT_API_KEY for Prefect Cloud)" >&2
    exit 2
  fi
}
