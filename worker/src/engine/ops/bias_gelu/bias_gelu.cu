// gelu(x + bias) over [rows, cols], exact erf GELU (GPU side of ops/bias_gelu.rs): the
// epilogue of the first feed-forward GEMM. Element-wise, grid-stride.
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void bias_gelu(const T* __restrict__ x, const T* __restrict__ bias,
                                          T* __restrict__ out, size_t n, int cols) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        out[i] = from_float<T>(gelu_erf(to_float(x[i]) + to_float(bias[i % cols])));
}

#define BIAS_GELU_KERNEL(TYPE, SUFFIX)                                                          \
    extern "C" __global__ void bias_gelu_##SUFFIX(const TYPE* x, const TYPE* bias, TYPE* out,   \
                                                  size_t n, int cols) {                         \
        bias_gelu<TYPE>(x, bias, out, n, cols);                                                 \
    }

FOR_EACH_STORAGE(BIAS_GELU_KERNEL)
