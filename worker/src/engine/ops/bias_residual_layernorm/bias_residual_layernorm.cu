// LayerNorm(x + bias + residual) over [rows, cols]: the epilogue of the attention-output and
// second feed-forward GEMMs (GPU side of ops/bias_residual_layernorm.rs). One block per row;
// the row is summed in f32 into shared memory, then mean and a two-pass variance, as the CPU
// reference and PyTorch compute them. `params` is [3, cols]: bias, gamma, beta.
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void bias_residual_layernorm(const T* __restrict__ x,
                                                        const T* __restrict__ residual,
                                                        const T* __restrict__ params,
                                                        T* __restrict__ out, int cols, float eps) {
    DYNAMIC_SHARED(float, row_s);  // cols values, then 32 for the reductions
    float* scratch = row_s + cols;
    const size_t base = (size_t)blockIdx.x * cols;
    const T* bias = params;
    const T* gamma = params + cols;
    const T* beta = params + 2 * cols;

    float sum = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float v = to_float(x[base + c]) + to_float(bias[c]) + to_float(residual[base + c]);
        row_s[c] = v;
        sum += v;
    }
    const float mean = block_sum(sum, scratch) / cols;
    float sq = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float d = row_s[c] - mean;
        sq += d * d;
    }
    const float inv_std = rsqrtf(block_sum(sq, scratch) / cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        out[base + c] =
            from_float<T>((row_s[c] - mean) * inv_std * to_float(gamma[c]) + to_float(beta[c]));
}

#define LAYERNORM_KERNEL(TYPE, SUFFIX)                                                          \
    extern "C" __global__ void bias_residual_layernorm_##SUFFIX(                                \
        const TYPE* x, const TYPE* residual, const TYPE* params, TYPE* out, int cols,           \
        float eps) {                                                                            \
        bias_residual_layernorm<TYPE>(x, residual, params, out, cols, eps);                     \
    }

FOR_EACH_STORAGE(LAYERNORM_KERNEL)
