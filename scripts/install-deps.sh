#!/usr/bin/env bash
# Installs what the test suite needs on a Debian 12 machine: PostgreSQL 15 server
# binaries (for the PostgreSQL leg of the tests), Chromium (browser test), Python with pip
# (scripts/fetch-assets.sh), Node with npm and tests/browser's node_modules, a C compiler
# (bundled SQLite and Oniguruma); it checks that a Rust toolchain is there.
# `--runtime` installs only what scripts/start.sh needs: Python with pip and a C compiler.
# Only what is missing is installed; on a machine that has it all this is a no-op.
set -euo pipefail

runtime=false
[[ "${1:-}" == "--runtime" ]] && runtime=true

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export DEBIAN_FRONTEND=noninteractive

log() { printf 'install-deps: %s\n' "$*" >&2; }

have() { command -v "$1" >/dev/null 2>&1; }

have_postgres15() {
    [[ -x /usr/lib/postgresql/15/bin/initdb && -x /usr/lib/postgresql/15/bin/pg_ctl ]] && return 0
    have initdb && have pg_ctl && pg_ctl --version | grep -q ' 15\.'
}

have_node() {
    # playwright-core (tests/browser) needs Node 18 or newer.
    have node && [[ "$(node -p 'process.versions.node.split(".")[0]')" -ge 18 ]]
}

as_root() {
    if [[ $EUID -eq 0 ]]; then
        "$@"
    elif have sudo && sudo -n true 2>/dev/null; then
        sudo -n env DEBIAN_FRONTEND=noninteractive "$@"
    else
        log "need root to run: $*"
        exit 1
    fi
}

apt_pkgs=()
have python3 || apt_pkgs+=(python3)
python3 -m pip --version >/dev/null 2>&1 || apt_pkgs+=(python3-pip)
# cc for crates that build C; c++ for the CUDA emulator test (worker/tests/cuda_emulator)
{ have cc && have c++; } || apt_pkgs+=(build-essential)
have pkg-config || apt_pkgs+=(pkg-config)
if ! $runtime; then
    have_postgres15 || apt_pkgs+=(postgresql-15)
    have chromium || have chromium-browser || apt_pkgs+=(chromium)
    # scripts/cuda-toolchain.sh puts nvcc's wheels in a venv.
    python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || apt_pkgs+=(python3-venv)
    have_node || apt_pkgs+=(nodejs)
    # Debian's nodejs comes without npm; a NodeSource nodejs bundles it (and conflicts with
    # Debian's npm package), so ask for npm only when there is none.
    have npm || apt_pkgs+=(npm)
fi

if ((${#apt_pkgs[@]})); then
    log "installing: ${apt_pkgs[*]}"
    apt_log="$(mktemp)"
    if ! { as_root apt-get update -q && as_root apt-get install -y -q --no-install-recommends "${apt_pkgs[@]}"; } >"$apt_log" 2>&1; then
        tail -n 40 "$apt_log" >&2
        log "apt-get failed (full log: $apt_log)"
        exit 1
    fi
    rm -f "$apt_log"
else
    log "system packages already present"
fi

# Debian's rustc is older than the workspace's rust-version; the toolchain comes from
# rustup, which this script does not download.
rust_version="$(sed -n 's/^rust-version = "\(.*\)"$/\1/p' "$repo/Cargo.toml")"
if ! have rustc && [[ -x "$HOME/.cargo/bin/rustc" ]]; then
    PATH="$HOME/.cargo/bin:$PATH"
fi
if ! have cargo || ! have rustc; then
    log "a Rust toolchain (cargo, rustc >= $rust_version) is needed; install it with rustup"
    exit 1
fi
rustc_version="$(rustc --version | cut -d' ' -f2)"
if [[ "$(printf '%s\n%s\n' "$rust_version" "${rustc_version%%-*}" | sort -V | head -n1)" != "$rust_version" ]]; then
    log "rustc $rustc_version is older than the workspace's rust-version $rust_version; update it with rustup"
    exit 1
fi
$runtime && exit 0

# tests/browser: install exactly what package-lock.json pins, unless it is already there.
browser="$repo/tests/browser"
if [[ -f "$browser/package-lock.json" ]]; then
    want="$(cd "$browser" && node -p 'require("./package-lock.json").packages["node_modules/playwright-core"].version')"
    got="$(cd "$browser" && node -p 'try { require("./node_modules/playwright-core/package.json").version } catch { "" }')"
    if [[ "$want" != "$got" ]]; then
        log "npm ci in tests/browser (playwright-core $want)"
        (cd "$browser" && npm ci --no-audit --no-fund --loglevel=error)
    else
        log "tests/browser has playwright-core $got"
    fi
else
    log "tests/browser/package-lock.json is missing"
    exit 1
fi
