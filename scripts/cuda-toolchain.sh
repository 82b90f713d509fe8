#!/usr/bin/env bash
# A CUDA 13.0 build toolchain without a system CUDA install (see shared/GPU.md): nvcc and
# the CUDA libraries from pinned PyPI wheels in a venv outside the repository
# ($TESSERA_CUDA_HOME, default ~/.cache/tessera-cuda), unversioned link names and a stub
# libcuda.so (the real one comes with the driver on the GPU machine) in the toolkit's
# lib/stubs, where cudarc's build script looks for link-time libraries under $CUDA_ROOT
# (NCCL's too, for the worker's `nccl` feature).
# Prints the environment for the build; progress goes to stderr.
#
#   cuda_env="$(scripts/cuda-toolchain.sh)" && eval "$cuda_env"
#   cargo build --release -p tessera-worker --features cuda
#
# No RUSTFLAGS are set, so a cuda build shares the plain build's compiled dependencies in
# the same target dir and compiles only what the feature changes (cudarc, candle's CUDA
# backend and kernels, the worker).
#
# Environment: CUDA_COMPUTE_CAP (default 90: H100/H200), TESSERA_CUDA_HOME (the venv).
# Needs python3 with venv, gcc and nm (binutils), cargo.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${TESSERA_CUDA_HOME:-$HOME/.cache/tessera-cuda}"

# The GPU machine's driver is CUDA 13.0: PTX from a newer nvcc does not load there
# ("Unsupported .version"), so every component stays on the 13.0 line, nvvm and crt
# included (pip would otherwise pull the newest ones).
pins=(
    nvidia-cuda-nvcc==13.0.88
    nvidia-nvvm==13.0.88
    nvidia-cuda-crt==13.0.88
    nvidia-cuda-runtime==13.0.96
    nvidia-cuda-cccl==13.0.85
    nvidia-cuda-nvrtc==13.0.88
    nvidia-cublas==13.0.2.14
    nvidia-curand==10.4.0.35
    # NCCL for the worker's `nccl` feature (GPU-to-GPU all-reduce). 2.27.7 is the oldest
    # CUDA 13 build, the one PyTorch 2.9 ships: linking against it keeps the binary to
    # symbols every newer NCCL 2 has, so it runs on the GPU machine's PyTorch copy.
    nvidia-nccl-cu13==2.27.7
)

log() { printf 'cuda-toolchain: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

for tool in python3 gcc nm cargo; do
    command -v "$tool" >/dev/null || die "$tool is required"
done

# 1. The wheels. A marker with the pin list makes a second run free.
if [[ "$(cat "$venv/.pins" 2>/dev/null)" != "${pins[*]}" ]]; then
    if [[ ! -x "$venv/bin/python" ]]; then
        python3 -m venv "$venv" || die "python3 -m venv failed (on Debian: apt-get install -y python3-venv)"
    fi
    log "installing the CUDA 13.0 wheels into $venv (about 1 GB)"
    "$venv/bin/python" -m pip install --disable-pip-version-check --no-input -q "${pins[@]}" >&2
    printf '%s' "${pins[*]}" >"$venv/.pins"
else
    log "CUDA wheels already in $venv"
fi

site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cu="$site/nvidia/cu13"
[[ -x "$cu/bin/nvcc" ]] || die "no nvcc at $cu/bin/nvcc after installing the wheels"
"$cu/bin/nvcc" --version | grep -q 'release 13\.0' || die "nvcc is not CUDA 13.0: $("$cu/bin/nvcc" --version | tail -n 2)"

# 2. Link-time names. The wheels ship only versioned sonames; the linker wants libX.so.
stubs="$cu/lib/stubs"
mkdir -p "$stubs"
link_name() {
    local target="$cu/lib/$1"
    [[ -e "$target" ]] || die "missing $target"
    ln -sfn "$target" "$stubs/$2"
}
for n in cublas cublasLt cudart nvrtc; do
    link_name "lib$n.so.13" "lib$n.so"
done
link_name libcurand.so.10 libcurand.so
# NCCL's wheel keeps its library in a folder of its own.
nccl_lib="$(find "$site/nvidia" -name 'libnccl.so.2' -print -quit)"
[[ -n "$nccl_lib" ]] || die "no libnccl.so.2 under $site/nvidia after installing the wheels"
ln -sfn "$nccl_lib" "$stubs/libnccl.so"

# 3. A stub libcuda.so with soname libcuda.so.1: every CUDA driver API function (cu +
# capital letter; cublas*/curand*/cuda* belong to other libraries) as an empty function.
# It only satisfies the linker; at run time the driver's libcuda.so.1 is loaded instead.
# The names come from cudarc's driver bindings (all CUDA versions, a harmless superset)
# and, when a cuda build has already run, from the undefined symbols of its rlibs.
symbols="$(mktemp)"
trap 'rm -f "$symbols" "$symbols.c"' EXIT
cudarc_dirs="$(cargo metadata --format-version 1 --all-features --manifest-path "$repo/Cargo.toml" 2>/dev/null \
    | python3 -c '
import json, os, sys
for p in json.load(sys.stdin)["packages"]:
    if p["name"] == "cudarc":
        print(os.path.dirname(p["manifest_path"]))
' || true)"
while IFS= read -r dir; do
    [[ -n "$dir" && -d "$dir/src/driver" ]] || continue
    log "driver API names from $dir"
    grep -rhoE '\bfn[[:space:]]+cu[A-Z][A-Za-z0-9_]*[[:space:]]*[(<]' "$dir/src/driver" \
        | sed -E 's/^fn[[:space:]]+//; s/[[:space:]]*[(<]$//' >>"$symbols" || true
done <<<"$cudarc_dirs"
target_dir="${CARGO_TARGET_DIR:-$repo/target}"
while IFS= read -r rlib; do
    nm -u --format=just-symbols "$rlib" 2>/dev/null | grep -E '^cu[A-Z]' >>"$symbols" || true
done < <(find "$target_dir" -path '*/deps/*' \( -name 'libcudarc-*.rlib' -o -name 'libcandle_core-*.rlib' \) 2>/dev/null)
sort -u -o "$symbols" "$symbols"
[[ -s "$symbols" ]] || die "found no CUDA driver symbols: is cudarc in the dependency graph (the worker's cuda feature)? Run 'cargo fetch' first."

if ! cmp -s "$symbols" "$stubs/libcuda.symbols" || [[ ! -f "$stubs/libcuda.so" ]]; then
    log "building the stub libcuda.so ($(wc -l <"$symbols") symbols)"
    {
        echo '/* Generated by scripts/cuda-toolchain.sh: link-time stand-in for the driver. */'
        sed -E 's/.*/void &(void) {}/' "$symbols"
    } >"$symbols.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$stubs/libcuda.so" "$symbols.c"
    install -m 644 "$symbols" "$stubs/libcuda.symbols"
else
    log "stub libcuda.so is up to date"
fi

compute_cap="${CUDA_COMPUTE_CAP:-90}"
cat <<EOF
export CUDA_ROOT='$cu'
export CUDA_PATH='$cu'
export PATH='$cu/bin':"\$PATH"
export CUDA_COMPUTE_CAP='$compute_cap'
EOF
log "toolchain ready: nvcc $("$cu/bin/nvcc" --version | grep -oE 'V[0-9.]+'), compute capability $compute_cap"
