// Kernels that break CUDA's rules on purpose, so the emulator's tests can show it refuses
// them (worker/tests/cuda_kernels_emulated.rs) instead of hanging or passing.
#include "common.cuh"

// Half of warp 0 shuffles while the other half goes on to the block barrier.
extern "C" __global__ void misaligned_barriers(float* out) {
    float v = (float)threadIdx.x;
    if (threadIdx.x < 16) v = __shfl_xor_sync(FULL_MASK, v, 1);
    __syncthreads();
    out[threadIdx.x] = v;
}

// Each thread writes one float of dynamic shared memory, however little the launch gave.
extern "C" __global__ void one_float_per_thread(float* out) {
    DYNAMIC_SHARED(float, s);
    s[threadIdx.x] = 1.0f;
    __syncthreads();
    out[threadIdx.x] = s[blockDim.x - 1 - threadIdx.x];
}
