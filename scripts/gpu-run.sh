#!/usr/bin/env bash
# Runs, on the GPU machine, everything scripts/gpu-bundle.sh prepared (.gpu-bundle/ carried
# beside the tree): the kernel tests, the end-to-end GPU-vs-CPU test, the worker's start-up
# GPU check and the GPU benchmark, each step's output to a file in $OUT (the device tool
# brings back at most 8 files). Steps run even when an earlier one fails; the exit status is
# the first failure's.
#
#   bash scripts/gpu-run.sh [all|tests|bench]   (on the GPU machine, from the repository root)
#
# The device tool allows 10 minutes a command: `all` is planned to fit (tests about 3
# minutes at most, the benchmark about 4); if it does not, run `tests` and `bench` as two
# calls.
set -uo pipefail

what="${1:-all}"
out="${OUT:?set OUT to the folder whose files come back}"
bundle=.gpu-bundle
bin=/tmp/tessera-gpu-bin
[[ -d "$bundle/bin" ]] || { echo "no $bundle/bin: run scripts/gpu-bundle.sh here first and carry .gpu-bundle" >&2; exit 1; }

# candle links the CUDA 13 libraries dynamically; the machine has them with PyTorch.
libdirs=""
for lib in libcublas.so.13 libcublasLt.so.13 libcudart.so.13 libnvrtc.so.13 libcurand.so.10; do
    found="$(find / -xdev -name "$lib*" -not -path '/proc/*' 2>/dev/null | head -n 1)"
    if [[ -z "$found" ]]; then
        echo "warning: $lib not found on this machine" >&2
    elif [[ ":$libdirs:" != *":$(dirname "$found"):"* ]]; then
        libdirs="$libdirs:$(dirname "$found")"
    fi
done
export LD_LIBRARY_PATH="${libdirs#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

mkdir -p "$bin"
for f in "$bundle"/bin/*.xz; do
    xz -dc "$f" >"$bin/$(basename "$f" .xz)" && chmod +x "$bin/$(basename "$f" .xz)"
done

status=0
run() { # run NAME TIMEOUT COMMAND... : output to $out/NAME.txt
    local name="$1" limit="$2"
    shift 2
    echo "==> $name: $*" | tee "$out/$name.txt"
    timeout "$limit" "$@" >>"$out/$name.txt" 2>&1
    local rc=$?
    echo "==> $name: exit $rc" | tee -a "$out/$name.txt"
    [[ $rc -ne 0 && $status -eq 0 ]] && status=$rc
}

{
    date -u
    nvidia-smi
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)'
} >"$out/machine.txt" 2>&1

export TESSERA_REQUIRE_GPU=1 TESSERA_REQUIRE_ASSETS=1 TESSERA_ASSETS="$PWD/$bundle/assets"
if [[ "$what" == all || "$what" == tests ]]; then
    run cuda_kernels 150 "$bin/cuda_kernels" --test-threads=1
    run cuda_embeddings 150 "$bin/cuda_embeddings" --test-threads=1 --nocapture
    # The start-up check logs the GPU (or refuses to start, naming the rebuild); the worker
    # then keeps trying to reach a server that is not there until `timeout` ends it.
    timeout 15 "$bin/tessera-worker" --server http://127.0.0.1:9 --worker-token gpu-run-check \
        >"$out/worker_start.txt" 2>&1
    if ! grep -q "CUDA kernels load on this GPU" "$out/worker_start.txt"; then
        echo "==> worker start-up GPU check did not pass" | tee -a "$out/worker_start.txt"
        [[ $status -eq 0 ]] && status=1
    fi
fi
if [[ "$what" == all || "$what" == bench ]]; then
    run gpu_serving 270 "$bin/gpu_serving" --minilm "$bundle/assets/all-MiniLM-L6-v2" \
        --python python3 --out "$out"
fi
exit "$status"
