// Symmetric int8 quantisation (GPU side of ops/int8.rs), per tensor or per channel (a row of
// a 2-D [channels, k] tensor, the output channel of an [out, in] weight):
//   scale = absmax / 127,  q = clamp(round_half_even(x / scale), -127, 127),  x' = q · scale.
// The scales never leave the device: `int8_absmax_*` reduces |x| straight into the scale
// buffer (as the bit pattern of a non-negative float, whose unsigned order is the float
// order, so atomicMax works), `int8_scales_finish` turns those maxima into scales, and the
// quantise/dequantise kernels read them from there.
#include "common.cuh"

// Grid-stride over rows, one block per row at a time; one atomic per row.
template <typename T>
__device__ __forceinline__ void absmax(const T* __restrict__ x, unsigned int* __restrict__ bits,
                                       int rows, int cols, int per_channel) {
    __shared__ float scratch[32];
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        float m = 0.0f;
        for (int c = threadIdx.x; c < cols; c += blockDim.x)
            m = fmaxf(m, fabsf(to_float(x[(size_t)row * cols + c])));
        m = warp_max(m);
        const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
        if (lane == 0) scratch[warp] = m;
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int w = 1; w < (int)(blockDim.x + 31) / 32; ++w) m = fmaxf(m, scratch[w]);
            atomicMax(bits + (per_channel ? row : 0), __float_as_uint(m));
        }
        __syncthreads();
    }
}

template <typename T>
__device__ __forceinline__ void quantize(const T* __restrict__ x, const float* __restrict__ scales,
                                         int8_t* __restrict__ q, size_t n, int cols,
                                         int per_channel) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float scale = scales[per_channel ? i / cols : 0];
        int v = 0;
        if (scale > 0.0f) v = max(-127, min(127, __float2int_rn(to_float(x[i]) / scale)));
        q[i] = (int8_t)v;
    }
}

extern "C" __global__ void int8_scales_finish(float* scales, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    // The buffer holds the maxima's bit patterns, which read back as the maxima themselves.
    if (i < n) scales[i] = scales[i] / 127.0f;
}

extern "C" __global__ void int8_dequantize(const int8_t* __restrict__ q,
                                           const float* __restrict__ scales,
                                           float* __restrict__ out, size_t n, int cols,
                                           int per_channel) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        out[i] = (float)q[i] * scales[per_channel ? i / cols : 0];
}

#define INT8_KERNELS(TYPE, SUFFIX)                                                              \
    extern "C" __global__ void int8_absmax_##SUFFIX(const TYPE* x, unsigned int* bits,          \
                                                    int rows, int cols, int per_channel) {      \
        absmax<TYPE>(x, bits, rows, cols, per_channel);                                         \
    }                                                                                           \
    extern "C" __global__ void int8_quantize_##SUFFIX(const TYPE* x, const float* scales,       \
                                                      int8_t* q, size_t n, int cols,            \
                                                      int per_channel) {                        \
        quantize<TYPE>(x, scales, q, n, cols, per_channel);                                     \
    }

FOR_EACH_STORAGE(INT8_KERNELS)

// The int8 GEMM's i32 sums back to f32, for the CUDA int8 linear of train/precision:
//   out[r, c] = float(sums[r, c]) * (params[0] * params[1]) + params[2 + c]
// (the two per-tensor scales, then the bias) over the first `cols` columns of each `ld`-wide
// row (the GEMM pads its rows to a multiple of 4). Each product and the sum are rounded on
// their own (__fmul_rn and __fadd_rn are never fused into an FMA), as the CPU computes them,
// so the two agree bit for bit.
extern "C" __global__ void int8_dequantize_sums(const int32_t* __restrict__ sums,
                                                const float* __restrict__ params,
                                                float* __restrict__ out, size_t n, int cols,
                                                int ld) {
    const float scale = __fmul_rn(params[0], params[1]);
    const float* bias = params + 2;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t row = i / cols;
        const int col = (int)(i % cols);
        out[i] = __fadd_rn(__fmul_rn((float)sums[row * ld + col], scale), bias[col]);
    }
}
