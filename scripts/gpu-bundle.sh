#!/usr/bin/env bash
# Builds, here, everything the GPU machine runs for the CUDA path (it has the NVIDIA driver,
# PyTorch and transformers, but no Rust toolchain and no network) into .gpu-bundle/ (ignored
# by git): release builds of the worker (with NCCL), the kernel tests
# (worker/tests/cuda_kernels.rs), the training tests (cuda_training.rs: precision ops, NCCL),
# the end-to-end test (cuda_embeddings.rs), the server and the platform's GPU tests
# (tests/gpu_platform.rs: the digits MLP trained by the cuda worker, MiniLM served from a
# slice of the GPU), the GPU benchmark (bench gpu_serving) and the
# QSync hybrid throughput benchmark (bench qsync_throughput: CPU ranks of 12 and 4 threads,
# and a GPU rank with a CPU rank), each stripped and xz-compressed; all-MiniLM-L6-v2 with its
# weights stored as f16 (both sides of every comparison load the same f16 weights), the
# digits (gpu_platform) and the rotten-tomatoes reviews (qsync_throughput's fine-tune), as one
# assets.tar.xz; and build-info.json
# (git commit, uncommitted changes, date, toolchain) for the results' provenance.
# The device tool carries at most 64 MiB, the tree included: the script fails, naming what
# to leave out, when the bundle passes 60 MiB or bundle and tree together pass 64. All of it
# is about 63 MiB, so a lease takes two bundles and two calls of scripts/gpu-run.sh
# (bench/README.md has the exact calls):
#
#   TESSERA_GPU_BUNDLE_SKIP='gpu_platform qsync_throughput' bash scripts/gpu-bundle.sh
#   TESSERA_GPU_BUNDLE=.gpu-bundle-2 \
#     TESSERA_GPU_BUNDLE_SKIP='cuda_kernels cuda_training cuda_embeddings gpu_serving' bash scripts/gpu-bundle.sh
#
# Environment: TESSERA_GPU_BUNDLE (the folder, default .gpu-bundle: two bundles for two calls
# can be ready at once, so the second call goes out while the machine is still warm),
# CUDA_COMPUTE_CAP (default 90), TESSERA_CUDA_TARGET_DIR (default
# $CARGO_TARGET_DIR/cuda or target/cuda: its own dir, so that the CUDA release binaries
# never replace the CPU ones),
# TESSERA_ASSETS, TESSERA_GPU_BUNDLE_SKIP (names of binaries to leave out, e.g.
# "gpu_serving qsync_throughput" for a tests-only bundle).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
bundle="$repo/${TESSERA_GPU_BUNDLE:-.gpu-bundle}"
assets="${TESSERA_ASSETS:-$repo/.assets}"
minilm="$assets/all-MiniLM-L6-v2"
skip=" ${TESSERA_GPU_BUNDLE_SKIP:-} "
limit_mib=60   # the bundle alone; the tree travels too, within 64 MiB in all
carry_mib=64
log() { printf 'gpu-bundle: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
wanted() { [[ "$skip" != *" $1 "* ]]; }

[[ -f "$minilm/model.safetensors" ]] || die "no $minilm/model.safetensors: run scripts/fetch-assets.sh"
reviews="$assets/datasets/rotten_tomatoes.csv"
if wanted qsync_throughput; then
    [[ -f "$reviews" ]] || die "no $reviews (qsync_throughput's data): run scripts/fetch-datasets.sh"
fi
digits="$assets/datasets/digits.csv"
if wanted gpu_platform; then
    [[ -f "$digits" ]] || die "no $digits (gpu_platform's data): run scripts/fetch-datasets.sh"
fi
for tool in xz strip tar; do
    command -v "$tool" >/dev/null || die "$tool is required"
done
export CARGO_TARGET_DIR="${TESSERA_CUDA_TARGET_DIR:-${CARGO_TARGET_DIR:-$repo/target}/cuda}"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
cuda_env="$(bash scripts/cuda-toolchain.sh)"
eval "$cuda_env"

rm -rf "$bundle"
mkdir -p "$bundle/bin" "$bundle/stage/all-MiniLM-L6-v2/1_Pooling" "$bundle/stage/datasets"

worker_targets=()
wanted tessera-worker && worker_targets+=(--bin tessera-worker)
wanted cuda_kernels && worker_targets+=(--test cuda_kernels)
wanted cuda_training && worker_targets+=(--test cuda_training)
wanted cuda_embeddings && worker_targets+=(--test cuda_embeddings)
# The server is a CPU program; it is built here only so the GPU machine has one to talk to.
end_to_end_targets=()
wanted gpu_platform && end_to_end_targets+=(-p tessera-server --bin tessera-server -p tessera-tests --test gpu_platform)
bench_targets=()
wanted gpu_serving && bench_targets+=(--bin gpu_serving)
wanted qsync_throughput && bench_targets+=(--bin qsync_throughput)
log "building ${worker_targets[*]:-no worker targets} ${end_to_end_targets[*]:-} ${bench_targets[*]:-and no benchmark} (release, compute capability $CUDA_COMPUTE_CAP, target dir $CARGO_TARGET_DIR)"
# Test binaries have hashed names: take them from cargo's own report of what it built.
# Diagnostics are rendered to stderr; stdout carries only the JSON messages.
built="$bundle/stage/built.txt"
{
    if ((${#worker_targets[@]})); then
        cargo build --release -p tessera-worker --features cuda,nccl "${worker_targets[@]}" \
            --message-format=json-render-diagnostics
    fi
    if ((${#end_to_end_targets[@]})); then
        # The test links the worker crate: with the worker's features, so the build is shared.
        cargo build --release "${end_to_end_targets[@]}" --features tessera-worker/cuda,tessera-worker/nccl \
            --message-format=json-render-diagnostics
    fi
    if ((${#bench_targets[@]})); then
        cargo build --release -p tessera-bench --features cuda,tessera-worker/nccl "${bench_targets[@]}" \
            --message-format=json-render-diagnostics
    fi
} | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["name"], m["executable"])
' >"$built"

while read -r name path; do
    stripped="$bundle/stage/$name"
    strip --strip-all -o "$stripped" "$path"
    xz -9e -T2 -c "$stripped" >"$bundle/bin/$name.xz"
    log "$name: $(mib "$(stat -c %s "$path")") → stripped $(mib "$(stat -c %s "$stripped")") → xz $(mib "$(stat -c %s "$bundle/bin/$name.xz")")"
    rm -f "$stripped"
done <"$built"

log "all-MiniLM-L6-v2 with f16 weights"
out_model="$bundle/stage/all-MiniLM-L6-v2"
for f in config.json tokenizer.json tokenizer_config.json special_tokens_map.json vocab.txt \
    modules.json sentence_bert_config.json config_sentence_transformers.json 1_Pooling/config.json; do
    [[ -f "$minilm/$f" ]] && cp "$minilm/$f" "$out_model/$f"
done
python="$(bash scripts/python-clients.sh)"  # a Python with numpy
"$python" - "$minilm/model.safetensors" "$out_model/model.safetensors" <<'PY'
# safetensors: u64 header length, JSON header (dtype, shape, data_offsets per tensor), data.
import json, struct, sys
import numpy as np
src, dst = sys.argv[1], sys.argv[2]
with open(src, "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    header = json.loads(f.read(n))
    data = f.read()
meta = header.pop("__metadata__", None)
out, parts, offset = {}, [], 0
for name, t in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
    raw = data[t["data_offsets"][0]:t["data_offsets"][1]]
    if t["dtype"] == "F32":
        raw = np.frombuffer(raw, dtype="<f4").astype("<f2").tobytes()
        t = dict(t, dtype="F16")
    out[name] = dict(t, data_offsets=[offset, offset + len(raw)])
    parts.append(raw)
    offset += len(raw)
if meta is not None:
    out["__metadata__"] = meta
head = json.dumps(out, separators=(",", ":")).encode()
head += b" " * (-len(head) % 8)
with open(dst, "wb") as f:
    f.write(struct.pack("<Q", len(head)) + head + b"".join(parts))
PY
staged=(all-MiniLM-L6-v2)
wanted qsync_throughput && cp "$reviews" "$bundle/stage/datasets/"
wanted gpu_platform && cp "$digits" "$bundle/stage/datasets/"
[[ -n "$(ls "$bundle/stage/datasets")" ]] && staged+=(datasets)
# f16 weights shrink only about 10% under xz, but every MiB counts here.
tar -C "$bundle/stage" -cf - "${staged[@]}" | xz -9e -T2 >"$bundle/assets.tar.xz"
log "assets.tar.xz: $(mib "$(stat -c %s "$bundle/assets.tar.xz")")"

# Provenance for the results (gpu_serving copies this file into gpu_serving.json).
GIT_COMMIT="$(git rev-parse HEAD 2>/dev/null || echo unknown)" \
GIT_STATUS="$(git status --porcelain 2>/dev/null || true)" \
NVCC="$(nvcc --version | grep -oE 'V[0-9.]+' | head -n 1)" \
RUSTC="$(rustc --version)" \
BUILT="$(cut -d' ' -f1 "$built")" \
    python3 - "$bundle/build-info.json" <<'PY'
import datetime, json, os, sys
dirty = os.environ["GIT_STATUS"].splitlines()
json.dump({
    "git_commit": os.environ["GIT_COMMIT"],
    "git_dirty": bool(dirty),
    "git_dirty_files": [line[3:] for line in dirty][:100],
    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    "compute_capability": os.environ["CUDA_COMPUTE_CAP"],
    "nvcc": os.environ["NVCC"],
    "rustc": os.environ["RUSTC"],
    "profile": "release",
    "binaries": os.environ["BUILT"].split(),
}, open(sys.argv[1], "w"), indent=1)
PY
rm -rf "$bundle/stage"

# What travels: the tree (tracked and untracked-not-ignored files) plus the bundle.
bundle_bytes="$(du -sb "$bundle" | cut -f1)"
tree_bytes="$(git ls-files -z --cached --others --exclude-standard | python3 -c '
import os, sys
print(sum(os.lstat(p).st_size for p in sys.stdin.read().split("\0") if os.path.lexists(p)))')"
log "bundle: $(mib "$bundle_bytes") in $bundle; with the tree ($(mib "$tree_bytes")): $(mib $((bundle_bytes + tree_bytes))) of the $carry_mib MiB the device tool carries"
if ((bundle_bytes > limit_mib * 1048576 || bundle_bytes + tree_bytes > carry_mib * 1048576)); then
    log "TOO BIG: the bundle must stay under $limit_mib MiB, and under $carry_mib MiB with the tree. What it holds:"
    (cd "$bundle" && du -b bin/*.xz assets.tar.xz | sort -rn | while read -r b f; do log "  $(mib "$b")  $f"; done)
    log "Leave out what this session's GPU run does not need, and rerun, e.g.:"
    log "  TESSERA_GPU_BUNDLE_SKIP='gpu_serving gpu_platform qsync_throughput' bash scripts/gpu-bundle.sh   (tests only: gpu-run.sh tests)"
    log "  TESSERA_GPU_BUNDLE_SKIP='cuda_kernels cuda_training cuda_embeddings gpu_platform qsync_throughput' bash scripts/gpu-bundle.sh   (gpu-run.sh bench)"
    log "  TESSERA_GPU_BUNDLE_SKIP='gpu_platform qsync_throughput' bash scripts/gpu-bundle.sh   (gpu-run.sh all)"
    log "  TESSERA_GPU_BUNDLE=.gpu-bundle-2 TESSERA_GPU_BUNDLE_SKIP='cuda_kernels cuda_training cuda_embeddings gpu_serving' bash scripts/gpu-bundle.sh   (gpu-run.sh platform qsync-gpu)"
    log "(gpu-run.sh's first step, the worker's start-up GPU check, needs tessera-worker)"
    exit 1
fi
