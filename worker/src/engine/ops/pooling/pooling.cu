// Segmented pooling over packed tokens (GPU side of ops/pooling.rs): one block per sequence
// reduces that sequence's rows cu_seqlens[i]..cu_seqlens[i+1] of [T, H] to one [H] vector
// (mean, CLS = first row, or max), then optionally divides it by its L2 norm (eps 1e-12, as
// torch's F.normalize). A single launch replaces TEI's per-sequence narrow+sum loop.
#include "common.cuh"

#define POOL_MEAN 0
#define POOL_CLS 1
#define POOL_MAX 2

template <typename T>
__device__ __forceinline__ void segmented_pool(const T* __restrict__ hidden,
                                               const uint32_t* __restrict__ cu_seqlens,
                                               T* __restrict__ out, int cols, int mode,
                                               int normalize) {
    DYNAMIC_SHARED(float, pooled_s);  // cols values, then 32 for the reduction
    float* scratch = pooled_s + cols;
    const int seq = blockIdx.x;
    const int start = cu_seqlens[seq], end = cu_seqlens[seq + 1];

    float sq = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v;
        if (mode == POOL_CLS) {
            v = to_float(hidden[(size_t)start * cols + c]);
        } else if (mode == POOL_MAX) {
            v = -INFINITY;
            for (int t = start; t < end; ++t) v = fmaxf(v, to_float(hidden[(size_t)t * cols + c]));
        } else {
            v = 0.0f;
            for (int t = start; t < end; ++t) v += to_float(hidden[(size_t)t * cols + c]);
            v /= (float)(end - start);
        }
        pooled_s[c] = v;
        sq += v * v;
    }
    float scale = 1.0f;
    if (normalize) scale = 1.0f / fmaxf(sqrtf(block_sum(sq, scratch)), 1e-12f);
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        out[(size_t)seq * cols + c] = from_float<T>(pooled_s[c] * scale);
}

#define POOL_KERNEL(TYPE, SUFFIX)                                                               \
    extern "C" __global__ void segmented_pool_##SUFFIX(const TYPE* hidden,                      \
                                                       const uint32_t* cu_seqlens, TYPE* out,   \
                                                       int cols, int mode, int normalize) {     \
        segmented_pool<TYPE>(hidden, cu_seqlens, out, cols, mode, normalize);                   \
    }

FOR_EACH_STORAGE(POOL_KERNEL)
