// Shared helpers for Tessera's kernels: storage-type conversions (every kernel stores f32,
// f16 or bf16 and computes in f32), warp/block reductions, and the macro that exports one
// `extern "C"` entry point per storage type with the suffix the Rust side asks for.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define FULL_MASK 0xffffffffu

// The launch's dynamic shared memory (its shared_mem_bytes) as an array of T named NAME. The
// CPU emulator of worker/tests/cuda_emulator cannot declare an extern array per kernel, so it
// hands out a pointer instead.
#ifdef __CUDACC__
#define DYNAMIC_SHARED(T, NAME) extern __shared__ T NAME[]
#else
#define DYNAMIC_SHARED(T, NAME) T* const NAME = emu::dynamic_shared<T>()
#endif

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) {
    return __float2half_rn(x);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Sum over the whole block, returned to every thread. `scratch` holds 32 floats of shared
// memory; it may be reused right after the call returns (the trailing barrier sees to it).
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int warps = (blockDim.x + 31) / 32;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0f;
    v = warp_sum(v);
    __syncthreads();
    return v;
}

// Exact GELU, x·Φ(x), as PyTorch's default `gelu` (and BERT, sentence-transformers).
__device__ __forceinline__ float gelu_erf(float x) {
    return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
}

// One exported kernel per storage type: NAME_f32, NAME_f16, NAME_bf16 (the names
// `candle_core::DType::as_str` gives, so the Rust side builds them from the tensor's dtype).
#define FOR_EACH_STORAGE(MACRO) \
    MACRO(float, f32)           \
    MACRO(__half, f16)          \
    MACRO(__nv_bfloat16, bf16)
