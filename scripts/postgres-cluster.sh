#!/usr/bin/env bash
# A throwaway PostgreSQL 15 cluster for the test suite: its own data dir under $TMPDIR,
# listening on 127.0.0.1 only (unix sockets inside that dir), trust auth, fsync off.
#
#   eval "$(scripts/postgres-cluster.sh start)"   # exports TESSERA_TEST_POSTGRES_URL, TESSERA_TEST_PG_DIR
#   scripts/postgres-cluster.sh stop [DIR]        # DIR defaults to $TESSERA_TEST_PG_DIR
#
# Only the export lines go to stdout; progress and errors go to stderr.
# Environment: TESSERA_TEST_PG_PORT picks the port (default: a free one).
# initdb refuses to run as root, so as root the cluster belongs to the `postgres` user.
set -euo pipefail

pg_user="tessera"     # bootstrap superuser inside the cluster (not an OS user)
pg_db="tessera_test"
run_as=()             # prefix that runs the server binaries as the cluster owner

log() { printf 'postgres-cluster: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

find_bindir() {
    local d=/usr/lib/postgresql/15/bin   # Debian/Ubuntu layout
    if [[ -x "$d/pg_ctl" && -x "$d/initdb" ]]; then
        echo "$d"
        return 0
    fi
    if command -v pg_ctl >/dev/null && command -v initdb >/dev/null; then
        dirname "$(readlink -f "$(command -v pg_ctl)")"
        return 0
    fi
    return 1
}

install_postgres() {
    [[ $EUID -eq 0 ]] || die "PostgreSQL 15 server binaries not found; install postgresql-15 (scripts/install-deps.sh does)"
    log "installing postgresql-15"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq postgresql-15 >&2
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

as_owner() { (cd "$dir" && "${run_as[@]}" "$@"); }

start() {
    local bindir
    bindir="$(find_bindir)" || { install_postgres; bindir="$(find_bindir)" || die "no pg_ctl after installing"; }
    "$bindir/pg_ctl" --version | grep -q ' 15\.' || log "warning: $("$bindir/pg_ctl" --version) is not PostgreSQL 15"

    local parent="${TMPDIR:-/tmp}"
    dir="$(mktemp -d "$parent/tessera-pg-XXXXXX")"
    if [[ $EUID -eq 0 ]]; then
        id postgres >/dev/null 2>&1 || die "running as root needs the 'postgres' system user (the postgresql package creates it)"
        chown postgres: "$dir"
        run_as=(runuser -u postgres --)
        # $TMPDIR may sit under a directory the postgres user cannot enter (e.g. /root).
        if ! runuser -u postgres -- test -w "$dir"; then
            rm -rf "$dir"
            dir="$(mktemp -d /tmp/tessera-pg-XXXXXX)"
            chown postgres: "$dir"
        fi
    fi
    : >"$dir/.tessera-pg"   # marks the dir as ours, so stop never removes anything else

    log "initdb in $dir/data"
    as_owner "$bindir/initdb" -D "$dir/data" -U "$pg_user" --auth=trust \
        --encoding=UTF8 --locale=C --no-sync >"$dir/initdb.log" 2>&1 \
        || { cat "$dir/initdb.log" >&2; die "initdb failed"; }

    # Loopback only, so trust auth (which initdb set for local, 127.0.0.1 and ::1) is safe.
    # Durability is irrelevant for a throwaway cluster; speed is not.
    as_owner tee -a "$dir/data/postgresql.conf" >/dev/null <<EOF

# tessera throwaway test cluster
listen_addresses = '127.0.0.1'
unix_socket_directories = '$dir'
fsync = off
synchronous_commit = off
full_page_writes = off
max_connections = 200
EOF

    local port attempt
    for attempt in 1 2 3; do
        port="${TESSERA_TEST_PG_PORT:-$(free_port)}"
        if as_owner "$bindir/pg_ctl" -D "$dir/data" -o "-p $port" -l "$dir/server.log" -w -t 60 start >&2; then
            break
        fi
        # Another process may have taken the free port between the probe and the bind.
        [[ -z "${TESSERA_TEST_PG_PORT:-}" && $attempt -lt 3 ]] || { tail -n 20 "$dir/server.log" >&2 || true; stop_dir "$dir"; die "pg_ctl start failed"; }
        log "start on port $port failed, retrying on another port"
    done

    "$bindir/createdb" -h 127.0.0.1 -p "$port" -U "$pg_user" "$pg_db" >&2 \
        || { stop_dir "$dir"; die "createdb failed"; }

    log "PostgreSQL listening on 127.0.0.1:$port (data: $dir)"
    echo "export TESSERA_TEST_POSTGRES_URL=postgres://$pg_user@127.0.0.1:$port/$pg_db"
    echo "export TESSERA_TEST_PG_DIR=$dir"
}

stop_dir() {
    local d="$1" bindir
    [[ -n "$d" && -d "$d" ]] || { log "nothing to stop at '${d}'"; return 0; }
    [[ -f "$d/.tessera-pg" ]] || die "$d was not made by this script; refusing to remove it"
    if [[ -f "$d/data/postmaster.pid" ]] && bindir="$(find_bindir)"; then
        local owner=()
        [[ $EUID -eq 0 ]] && owner=(runuser -u postgres --)
        (cd "$d" && "${owner[@]}" "$bindir/pg_ctl" -D "$d/data" -m immediate -w stop >&2) \
            || log "pg_ctl stop failed; removing the dir anyway"
    fi
    rm -rf "$d"
    log "stopped and removed $d"
}

case "${1:-}" in
    start) start ;;
    stop) stop_dir "${2:-${TESSERA_TEST_PG_DIR:-}}" ;;
    *) echo "usage: $0 start|stop [DIR]" >&2; exit 2 ;;
esac
