#!/usr/bin/env bash
# Builds, here, everything the GPU machine runs for the CUDA path (it has the NVIDIA driver,
# PyTorch and transformers, but no Rust toolchain and no network) into .gpu-bundle/ (ignored
# by git): release builds of the kernel tests (worker/tests/cuda_kernels.rs), the end-to-end
# test (cuda_embeddings.rs), the GPU benchmark (bench gpu_serving) and the worker, each
# xz-compressed, and all-MiniLM-L6-v2 with its weights stored as f16 so the bundle fits the
# 64 MiB the device tool carries (both sides of every comparison load the same f16 weights).
# scripts/gpu-run.sh runs it all there in one call; bench/README.md has the exact call.
#
#   bash scripts/gpu-bundle.sh
#
# Environment: CUDA_COMPUTE_CAP (default 90), TESSERA_CUDA_TARGET_DIR (else CARGO_TARGET_DIR),
# TESSERA_ASSETS.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
bundle="$repo/.gpu-bundle"
assets="${TESSERA_ASSETS:-$repo/.assets}"
minilm="$assets/all-MiniLM-L6-v2"
log() { printf 'gpu-bundle: %s\n' "$*" >&2; }

[[ -f "$minilm/model.safetensors" ]] || { log "no $minilm/model.safetensors: run scripts/fetch-assets.sh"; exit 1; }
eval "$(bash scripts/cuda-toolchain.sh)"
export CARGO_TARGET_DIR="${TESSERA_CUDA_TARGET_DIR:-${CARGO_TARGET_DIR:-$repo/target}}"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"

rm -rf "$bundle"
mkdir -p "$bundle/bin" "$bundle/assets"
# Test binaries have hashed names: take them from cargo's own report of what it built.
executables() {
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["name"], m["executable"])
'
}
log "building the worker, its GPU tests and the GPU benchmark (release, compute capability $CUDA_COMPUTE_CAP)"
{
    cargo build --release -p tessera-worker --features cuda --bin tessera-worker \
        --test cuda_kernels --test cuda_embeddings --message-format=json
    cargo build --release -p tessera-bench --features cuda --bin gpu_serving --message-format=json
} | executables | while read -r name path; do
    xz -T2 -6 -c "$path" >"$bundle/bin/$name.xz"
    log "$name: $(du -h "$path" | cut -f1) → $(du -h "$bundle/bin/$name.xz" | cut -f1)"
done

log "all-MiniLM-L6-v2 with f16 weights"
mkdir -p "$bundle/assets/all-MiniLM-L6-v2/1_Pooling"
for f in config.json tokenizer.json tokenizer_config.json special_tokens_map.json vocab.txt \
    modules.json sentence_bert_config.json config_sentence_transformers.json 1_Pooling/config.json; do
    [[ -f "$minilm/$f" ]] && cp "$minilm/$f" "$bundle/assets/all-MiniLM-L6-v2/$f"
done
python="$(bash scripts/python-clients.sh)"  # a Python with numpy
"$python" - "$minilm/model.safetensors" "$bundle/assets/all-MiniLM-L6-v2/model.safetensors" <<'PY'
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
log "bundle: $(du -sh "$bundle" | cut -f1) in $bundle (the device tool carries at most 64 MiB with the tree)"
