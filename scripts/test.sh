#!/usr/bin/env bash
# The whole test suite, as CI runs it: dependencies, demo model, a throwaway PostgreSQL,
# every Rust test (SQLite and PostgreSQL legs), the browser test of the dashboard, then the
# CUDA build (compiled, not run: no GPU here).
#
#   scripts/test.sh [ARGS...]    ARGS go to `cargo test` (e.g. a test name filter)
#
# Honours CARGO_TARGET_DIR. Exports for the tests:
#   TESSERA_TEST_POSTGRES_URL  the throwaway cluster (postgres://tessera@127.0.0.1:PORT/tessera_test)
#   TESSERA_REQUIRE_POSTGRES=1 so PostgreSQL tests fail instead of skipping
#   TESSERA_TEST_S3_ENDPOINT   a throwaway S3-compatible server (moto, scripts/s3-server.sh)
#   TESSERA_REQUIRE_S3=1       so the S3 blob-store tests fail instead of skipping
#   TESSERA_ASSETS             <repo>/.assets unless set (the demo model is in all-MiniLM-L6-v2/)
#   TESSERA_SERVER_BIN, TESSERA_WORKER_BIN   the debug binaries just built
#   TESSERA_CHROMIUM           the system Chromium, for tests/browser/run.mjs
#   TESSERA_TEST_PYTHON        a python with the openai and tritonclient packages
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

steps=()          # "name seconds" of finished steps, for the summary
current=""
started=0
pg_dir=""
s3_pid=""

step() {
    finish_step
    current="$1"
    started=$SECONDS
    printf '\n==> %s\n' "$current" >&2
}

finish_step() {
    [[ -n "$current" ]] && steps+=("$current|$((SECONDS - started))s")
    current=""
}

on_exit() {
    local rc=$?
    if [[ -n "$pg_dir" ]]; then
        bash "$repo/scripts/postgres-cluster.sh" stop "$pg_dir" || true
    fi
    if [[ -n "$s3_pid" ]]; then
        bash "$repo/scripts/s3-server.sh" stop "$s3_pid" || true
    fi
    printf '\n==> summary\n' >&2
    local s
    for s in ${steps[@]+"${steps[@]}"}; do
        printf '  ok      %-28s %s\n' "${s%|*}" "${s#*|}" >&2
    done
    if [[ $rc -ne 0 ]]; then
        printf '  FAILED  %-28s (exit %d)\n' "${current:-?}" "$rc" >&2
        printf '\nTEST SUITE FAILED\n' >&2
    else
        printf '\nALL TESTS PASSED (%ds)\n' "$SECONDS" >&2
    fi
    exit "$rc"
}
trap on_exit EXIT
# Stopped by a signal (a CI time-out, ^C) the run failed: without these the EXIT trap saw
# status 0 and printed ALL TESTS PASSED for a run killed halfway.
trap 'exit 129' HUP
trap 'exit 130' INT
trap 'exit 143' TERM

step "install dependencies"
bash scripts/install-deps.sh
# rustup may just have installed cargo into a shell that does not have it on PATH yet.
if ! command -v cargo >/dev/null && [[ -f "$HOME/.cargo/env" ]]; then
    # shellcheck source=/dev/null
    . "$HOME/.cargo/env"
fi

step "fetch assets"
export TESSERA_ASSETS="${TESSERA_ASSETS:-$repo/.assets}"
bash scripts/fetch-assets.sh

step "python clients"
TESSERA_TEST_PYTHON="$(bash scripts/python-clients.sh)"
export TESSERA_TEST_PYTHON

step "start PostgreSQL"
pg_env="$(bash scripts/postgres-cluster.sh start)"
eval "$pg_env"
pg_dir="$TESSERA_TEST_PG_DIR"
export TESSERA_TEST_POSTGRES_URL TESSERA_REQUIRE_POSTGRES=1 TESSERA_REQUIRE_ASSETS=1
echo "TESSERA_TEST_POSTGRES_URL=$TESSERA_TEST_POSTGRES_URL" >&2

step "start S3 server (moto)"
s3_env="$(bash scripts/s3-server.sh start)"
eval "$s3_env"
s3_pid="$TESSERA_TEST_S3_PID"
export TESSERA_TEST_S3_ENDPOINT TESSERA_REQUIRE_S3=1

step "cargo build"
cargo build --workspace --bins
target_dir="$(cargo metadata --format-version 1 --no-deps \
    | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')"
export TESSERA_SERVER_BIN="$target_dir/debug/tessera-server"
export TESSERA_WORKER_BIN="$target_dir/debug/tessera-worker"
TESSERA_CHROMIUM="$(command -v chromium || command -v chromium-browser || true)"
export TESSERA_CHROMIUM

step "cargo test"
# --no-fail-fast: every test binary runs and prints its "test result" line; the exit
# status still fails the script if any of them failed.
cargo test --workspace --no-fail-fast "$@"

step "browser test"
if [[ ! -f tests/browser/run.mjs ]]; then
    echo "tests/browser/run.mjs is missing: the browser test did not run" >&2
    exit 1
fi
node tests/browser/run.mjs

step "cargo build --features cuda,nccl"
# The GPU path compiles on every run so it never rots unseen: the CUDA worker binary (with
# NCCL for gangs of GPUs), the GPU test binaries (cuda_kernels, cuda_training,
# cuda_embeddings) and the GPU benchmark (gpu_serving) are built here and run on a GPU
# machine (scripts/gpu-bundle.sh, scripts/gpu-run.sh). nvcc, the CUDA libraries and NCCL
# come from pinned wheels (scripts/cuda-toolchain.sh). One build, in the target dir and with
# the feature resolution of `cargo test --workspace` above (the whole workspace selected,
# tests among the targets), so only what the cuda features change compiles again (candle
# and its users, cudarc, the kernels) rather than every dependency a second time.
(
    # Assigned first: `eval "$(…)"` alone would carry on past the script's failure.
    cuda_env="$(bash scripts/cuda-toolchain.sh)"
    eval "$cuda_env"
    export CUDA_COMPUTE_CAP=90
    # Compiled, never run here: device code unoptimised halves nvcc's time on candle's GGUF
    # kernels (about 14 of this step's minutes from nothing). gpu-bundle.sh builds what runs.
    export NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:-} -Xcicc -O0 -Xptxas -O0"
    cargo build --workspace --features tessera-worker/cuda,tessera-worker/nccl,tessera-bench/cuda \
        --bin tessera-worker --bin gpu_serving --test cuda_kernels --test cuda_training --test cuda_embeddings
    python3 -m py_compile bench/scripts/hf_transformers_gpu.py
)
# That replaced the debug tessera-worker with the CUDA one, which refuses to start without a
# GPU: put the CPU binaries back (nothing compiles, cargo links them again).
cargo build --workspace --bins
finish_step
