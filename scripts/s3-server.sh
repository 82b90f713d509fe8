#!/usr/bin/env bash
# A throwaway S3-compatible server for the test suite: moto's server (the `moto[server]`
# PyPI package, pinned, in its own virtualenv cached under ~/.cache/tessera), listening on
# 127.0.0.1 only, state in memory. The S3 blob-store tests (server/tests/storage.rs) run
# against it.
#
#   eval "$(scripts/s3-server.sh start)"   # exports TESSERA_TEST_S3_ENDPOINT, TESSERA_TEST_S3_PID
#   scripts/s3-server.sh stop [PID]        # PID defaults to $TESSERA_TEST_S3_PID
#
# Only the export lines go to stdout; progress and errors go to stderr.
set -euo pipefail

venv="${TESSERA_CACHE_DIR:-$HOME/.cache/tessera}/venv-moto"
marker="$venv/.tessera-moto-5.2.5"

log() { printf 's3-server: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

install() {
    [[ -f "$marker" ]] && return 0
    log "installing moto[server] into $venv"
    rm -rf "$venv"
    python3 -m venv "$venv" >&2
    "$venv/bin/pip" install --quiet --disable-pip-version-check "moto[server]==5.2.5" >&2
    touch "$marker"
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

start() {
    install
    local port log_file pid attempt
    log_file="$(mktemp "${TMPDIR:-/tmp}/tessera-moto-XXXXXX.log")"
    for attempt in 1 2 3; do
        port="$(free_port)"
        # setsid: its own session, so the caller's job control and Ctrl-C leave it to `stop`.
        setsid "$venv/bin/moto_server" -H 127.0.0.1 -p "$port" >"$log_file" 2>&1 </dev/null &
        pid=$!
        for _ in $(seq 1 100); do
            if python3 -c "import urllib.request, sys; urllib.request.urlopen(sys.argv[1], timeout=2)" \
                "http://127.0.0.1:$port/moto-api/" 2>/dev/null; then
                log "moto listening on 127.0.0.1:$port (pid $pid, log $log_file)"
                echo "export TESSERA_TEST_S3_ENDPOINT=http://127.0.0.1:$port"
                echo "export TESSERA_TEST_S3_PID=$pid"
                return 0
            fi
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.2
        done
        kill "$pid" 2>/dev/null || true
        # Another process may have taken the free port between the probe and the bind.
        log "moto did not answer on port $port (attempt $attempt): $(tail -n 5 "$log_file" | tr '\n' ' ')"
    done
    die "moto_server did not start"
}

stop() {
    local pid="$1"
    [[ -n "$pid" ]] || { log "nothing to stop"; return 0; }
    # Only a moto_server this script started: never an unrelated process that reused the pid.
    if tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q "moto_server"; then
        kill "$pid"
        log "stopped moto (pid $pid)"
    else
        log "pid $pid is not a moto_server; nothing stopped"
    fi
}

case "${1:-}" in
    start) start ;;
    stop) stop "${2:-${TESSERA_TEST_S3_PID:-}}" ;;
    install) install ;;
    *) echo "usage: $0 start|stop [PID]|install" >&2; exit 2 ;;
esac
