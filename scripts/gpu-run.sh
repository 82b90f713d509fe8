#!/usr/bin/env bash
# Runs, on the GPU machine, everything scripts/gpu-bundle.sh prepared (.gpu-bundle/, or the
# folder TESSERA_GPU_BUNDLE names, carried beside the tree), in the steps asked for, in this
# order:
#   tests      the worker's start-up GPU check first (quick, and it says at once whether the
#              build fits this GPU and driver), then the kernel and training tests
#              (cuda_kernels, cuda_training: each test in its own process, so one fault cannot
#              poison the rest) and the end-to-end GPU-vs-CPU embeddings test: all in tests.txt;
#   platform   the server and the cuda worker (tests/gpu_platform.rs): a short training job
#              (the digits MLP on CUDA device 0: loss falls, checkpoints written), and a MiniLM
#              replica served by an engine process bound to a slice of the GPU as it is
#              partitioned (embeddings against the CPU engine's; a burst's req/s): tests.txt;
#   bench      the GPU serving benchmark: gpu_serving.{txt,json,md};
#   qsync-cpu  the QSync hybrid throughput benchmark on this host's real unequal devices: CPU
#              ranks of 12 and 4 threads (the machine has 16 cores): qsync_throughput.{txt,md,json};
#   qsync-gpu  the same with the GPU as rank 0 and a 12-thread CPU rank. Each is a call of its
#              own: on the H200 (2026-11-28) a run of the GPU one took 17-29 s, so its 12 runs
#              need about 5 minutes, and it writes its section only when all have run;
#   all        tests and bench (the default).
# Every call also writes machine.txt (nvidia-smi, the CPU, the build, torch and transformers), so at
# most 8 files, what the device tool brings back. Steps run even when an earlier one fails;
# the exit status is the first failure's. Copy the .md and .json results into bench/results/.
#
#   bash scripts/gpu-run.sh [all|tests|bench|platform|qsync-cpu|qsync-gpu]...   (on the GPU machine; from the repo root)
#
# The device tool allows 10 minutes a command, and a lease may have less left: every step's
# limit is cut to what is left of GPU_RUN_SECONDS (default 570) since the script started, and
# a step with under 15 s left is not run, so the call ends inside it whatever hangs. Limits:
# start-up check 40 s, kernel and training tests 120 in all, end to end 90, the platform
# tests 180, the benchmark 240 (540 when nothing follows it), each qsync configuration 540. The
# benchmarks write their results as they go (gpu_serving after every config, qsync_throughput
# when its configuration ends), so a cut-short benchmark still brings back what it finished.
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"  # gpu_serving finds bench/scripts/hf_transformers_gpu.py relative to here
steps=" ${*:-all} "
steps="${steps// all / tests bench }"
for step in $steps; do
    [[ " tests bench platform qsync-cpu qsync-gpu " == *" $step "* ]] || { echo "unknown step $step: use all, tests, bench, platform, qsync-cpu or qsync-gpu" >&2; exit 2; }
done
wants() { [[ "$steps" == *" $1 "* ]]; }
deadline=$((SECONDS + ${GPU_RUN_SECONDS:-570}))
out="${OUT:?set OUT to the folder whose files come back}"
bundle="${TESSERA_GPU_BUNDLE:-.gpu-bundle}"
work=/tmp/tessera-gpu
bin="$work/bin"
[[ -d "$bundle/bin" ]] || { echo "no $bundle/bin: run scripts/gpu-bundle.sh here first and carry $bundle" >&2; exit 1; }

# candle links the CUDA 13 libraries dynamically, and the worker's `nccl` feature NCCL; the
# machine has them in PyTorch's nvidia wheels. Ask Python where those are (cheap), and search
# the disk once only for what that did not find.
needed=(libcublas.so.13 libcublasLt.so.13 libcudart.so.13 libnvrtc.so.13 libcurand.so.10 libnccl.so.2)
candidates="$(timeout 20 python3 - <<'PY' 2>/dev/null
import glob, importlib.util, os
dirs = []
spec = importlib.util.find_spec("nvidia")
for root in (spec.submodule_search_locations if spec else None) or []:
    dirs.append(os.path.join(root, "cu13", "lib"))          # CUDA 13 wheels: nvidia/cu13/lib
    dirs += sorted(glob.glob(os.path.join(root, "*", "lib")))  # older: nvidia/<name>/lib
spec = importlib.util.find_spec("torch")
for root in (spec.submodule_search_locations if spec else None) or []:
    dirs.append(os.path.join(root, "lib"))
for d in dict.fromkeys(dirs):
    if os.path.isdir(d):
        print(d)
PY
)"
libdirs=""
missing=()
add_dir() { [[ ":$libdirs:" == *":$1:"* ]] || libdirs="$libdirs:$1"; }
for lib in "${needed[@]}"; do
    dir=""
    while IFS= read -r d; do
        [[ -n "$d" && -e "$d/$lib" ]] && { dir="$d"; break; }
    done <<<"$candidates"
    if [[ -n "$dir" ]]; then add_dir "$dir"; else missing+=("$lib"); fi
done
if ((${#missing[@]})); then
    echo "searching the disk for ${missing[*]} (python3 did not point at them)" >&2
    names=()
    for lib in "${missing[@]}"; do names+=(-o -name "$lib*"); done
    while IFS= read -r found; do
        for lib in "${missing[@]}"; do
            [[ "$(basename "$found")" == "$lib"* ]] && add_dir "$(dirname "$found")"
        done
    done < <(timeout 30 find / \( -path /proc -o -path /sys -o -path /dev \) -prune \
        -o \( "${names[@]:1}" \) -print 2>/dev/null)
fi
export LD_LIBRARY_PATH="${libdirs#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# Our kernels and candle's are PTX for compute_90: the driver JIT-compiles them in every
# process that loads them, unless its cache (default 256 MiB, too small for candle's
# kernels) already holds them. One large cache shared by all the steps' processes.
export CUDA_CACHE_PATH="$work/cuda-cache" CUDA_CACHE_MAXSIZE=4294967296

mkdir -p "$bin" "$work/assets"
for f in "$bundle"/bin/*.xz; do
    name="$(basename "$f" .xz)"
    xz -dc "$f" >"$bin/$name" && chmod +x "$bin/$name"
done
if [[ -f "$bundle/assets.tar.xz" ]]; then
    tar -C "$work/assets" -xJf "$bundle/assets.tar.xz"
fi

status=0
fail() { [[ $status -eq 0 ]] && status="$1"; }
# have NAME: the bundle holds that binary (gpu-bundle.sh can leave some out to fit).
have() {
    [[ -x "$bin/$1" ]] && return 0
    echo "==> $1: not in the bundle, skipped" | tee -a "$out/machine.txt"
    fail 1
    return 1
}
# left: seconds before the call's deadline, less a margin for what follows the last step.
left() { echo $((deadline - SECONDS - 5)); }
# run NAME FILE LIMIT COMMAND... : appends to $out/FILE.txt; a limit-killed step reads 124.
run() {
    local name="$1" file="$2" limit="$3"
    shift 3
    if (($(left) < 15)); then
        echo "==> $name: not run (the call's ${GPU_RUN_SECONDS:-570} s are spent)" | tee -a "$out/$file.txt"
        fail 124
        return 124
    fi
    ((limit > $(left))) && limit=$(left)
    echo "==> $name (limit ${limit}s): $*" | tee -a "$out/$file.txt"
    timeout -k 5 "$limit" "$@" >>"$out/$file.txt" 2>&1
    local rc=$?
    echo "==> $name: exit $rc$( ((rc == 124 || rc == 137)) && echo ' (time limit)')" | tee -a "$out/$file.txt"
    ((rc != 0)) && fail "$rc"
    return "$rc"
}

{
    date -u
    echo "command: bash scripts/gpu-run.sh$steps(in $PWD)"
    echo "build: $(cat "$bundle/build-info.json" 2>/dev/null || echo 'no build-info.json')"
    nvidia-smi
    nvidia-smi -L
    # The host CPU decides what a CPU rank gains from bf16 and int8 (AMX, AVX512-BF16, VNNI).
    grep -m1 'model name' /proc/cpuinfo
    echo "cores: $(nproc); flags of note: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -xE 'avx2|fma|avx512f|avx512_bf16|avx512_vnni|amx_bf16|amx_int8' | tr '\n' ' ')"
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    echo "CUDA_CACHE_PATH=$CUDA_CACHE_PATH CUDA_CACHE_MAXSIZE=$CUDA_CACHE_MAXSIZE"
    ls -l "$bin"
    timeout 20 python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)'
} >"$out/machine.txt" 2>&1

export TESSERA_REQUIRE_GPU=1 TESSERA_REQUIRE_ASSETS=1 TESSERA_ASSETS="$work/assets" PYTHONUNBUFFERED=1
if wants tests; then
    # 1. Start-up check (at most 40 s, usually seconds): the worker probes the GPU, loads our
    # kernels and logs the outcome (or refuses to start, naming the rebuild); it then keeps
    # trying to reach a server that is not there, so it is ended once the line shows.
    if have tessera-worker; then
        log="$out/tests.txt"
        echo "==> worker start-up GPU check" >"$log"
        "$bin/tessera-worker" --server http://127.0.0.1:9 --worker-token gpu-run-check >>"$log" 2>&1 &
        worker=$!
        for _ in $(seq 40); do
            grep -q "CUDA kernels load on this GPU" "$log" && break
            kill -0 "$worker" 2>/dev/null || break
            sleep 1
        done
        kill "$worker" 2>/dev/null
        wait "$worker" 2>/dev/null
        if grep -q "CUDA kernels load on this GPU" "$log"; then
            echo "==> worker start-up GPU check passed" | tee -a "$log"
        else
            echo "==> worker start-up GPU check did not pass" | tee -a "$log"
            fail 1
        fi
    fi

    # 2. Kernel tests, then the training tests (precision ops, NCCL), one process each (at
    # most 120 s in all, 60 s each).
    tests_end=$((SECONDS + 120))
    results=()
    for binary in cuda_kernels cuda_training; do
        have "$binary" || continue
        mapfile -t tests < <("$bin/$binary" --list --format=terse 2>>"$out/tests.txt" | sed -n 's/: test$//p')
        ((${#tests[@]})) || { echo "==> $binary lists no tests" | tee -a "$out/tests.txt"; fail 1; }
        for t in "${tests[@]}"; do
            spare=$((tests_end - SECONDS))
            if ((spare < 10)); then
                results+=("not run (the tests' 120 s spent)  $binary $t")
                fail 124
                continue
            fi
            run "$binary $t" tests $((spare < 60 ? spare : 60)) "$bin/$binary" --exact "$t" --nocapture
            rc=$?
            results+=("$( ((rc == 0)) && echo ok || echo "FAILED (exit $rc)")  $binary $t")
        done
    done
    printf '%s\n' "==> kernel and training tests:" "${results[@]}" | tee -a "$out/tests.txt"

    # 3. End to end: MiniLM and BERT-base embeddings on the GPU against the CPU (90 s).
    if have cuda_embeddings; then
        run cuda_embeddings tests 90 "$bin/cuda_embeddings" --test-threads=1 --nocapture
    fi
fi
if wants platform; then
    # 4. The tests start the server (a CPU program) and the cuda worker, which trains the
    # digits MLP on CUDA device 0, then serves MiniLM from a slice of the GPU (180 s).
    if have gpu_platform && have tessera-server && have tessera-worker; then
        export TESSERA_SERVER_BIN="$bin/tessera-server" TESSERA_WORKER_BIN="$bin/tessera-worker"
        run gpu_platform tests 180 "$bin/gpu_platform" --test-threads=1 --nocapture
    fi
fi
if wants bench; then
    # 5. The benchmark (240 s, 540 s when nothing follows); it writes gpu_serving.{json,md}
    # into $OUT after every config.
    if have gpu_serving; then
        run gpu_serving gpu_serving "$(wants qsync-cpu || wants qsync-gpu && echo 240 || echo 540)" "$bin/gpu_serving" \
            --minilm "$work/assets/all-MiniLM-L6-v2" --python python3 \
            --hf-script bench/scripts/hf_transformers_gpu.py \
            --build-info "$bundle/build-info.json" --out "$out"
    fi
fi
if wants qsync-cpu || wants qsync-gpu; then
    # 6. QSync hybrid throughput: steps/s with the slow rank at f32, uniform bf16, uniform
    # int8 and QSync's plan, 3 runs each; each configuration writes its section when done.
    if have qsync_throughput; then
        # 12 runs of 13 steps (3 profiled, 2 warm-up, 8 timed), 16 reviews a rank: 17-29 s a
        # run with the GPU and a 12-thread rank (H200 host, 2026-11-28); the 4-thread rank is
        # not yet timed there. 3 profiled steps, not the job's default of 8, keep each
        # configuration inside its limit (the operators are timed once per profiled step). A
        # step that reaches its limit writes nothing: lower --steps or --batch.
        common=(--assets "$work/assets" --out "$out" --build-info "$bundle/build-info.json" --profile-steps 3)
        if wants qsync-cpu; then
            run "qsync_throughput CPU 12 + 4 threads" qsync_throughput 540 "$bin/qsync_throughput" \
                --threads 12,4 "${common[@]}"
        fi
        if wants qsync-gpu; then
            run "qsync_throughput GPU + CPU 12 threads" qsync_throughput 540 "$bin/qsync_throughput" \
                --device cuda --threads 4,12 "${common[@]}"
        fi
    fi
fi
exit "$status"
