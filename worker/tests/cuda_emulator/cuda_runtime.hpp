// The CUDA built-ins worker/kernels/*.cu use, on the CPU, so the kernels' own source runs in
// the CPU test suite (worker/tests/cuda_kernels_emulated.rs) where no GPU is lent.
//
// Each CUDA thread of a block is a fiber with its own stack; the fibers of a block take turns
// on the calling OS thread and switch only at the block's and the warps' barriers
// (__syncthreads, __syncwarp and the shuffles), which is exactly where CUDA threads exchange
// data. So shared memory, warp shuffles and atomics behave as on a GPU whose threads run in
// lock step between barriers; what the emulator cannot show is timing (races between
// barriers, which it serialises) and the GPU's approximate intrinsics (rsqrtf here is exact).
// It refuses what a GPU refuses (more than 1024 threads or 48 KiB of shared memory) and fails
// a launch whose barriers do not line up, instead of hanging.
//
// Force-included into every kernel source (`-include cuda_runtime.hpp`); runtime.cpp holds
// the scheduler and the C entry points the Rust side calls.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

struct uint3 {
    unsigned int x, y, z;
};
using dim3 = uint3;
struct alignas(16) float4 {
    float x, y, z, w;
};

namespace emu {

// What the running CUDA thread sees of itself.
struct ThreadView {
    uint3 thread_idx, block_idx, block_dim, grid_dim;
};

// Set by the scheduler before it switches to a fiber.
extern thread_local const ThreadView* current;
// The launch's dynamic shared memory (its shared_mem_bytes), shared by the running block.
extern thread_local void* dynamic_shared_base;

void sync_block();
// Exchanges `bits` across the warp: every lane publishes its value and gets lane `src`'s.
uint64_t warp_exchange(uint64_t bits, unsigned src_lane);
void sync_warp();
unsigned lane_id();

template <typename T> T* dynamic_shared() { return static_cast<T*>(dynamic_shared_base); }

template <typename T> uint64_t to_bits(T v) {
    static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    return bits;
}

template <typename T> T from_bits(uint64_t bits) {
    T v;
    std::memcpy(&v, &bits, sizeof(T));
    return v;
}

}  // namespace emu

#define threadIdx (::emu::current->thread_idx)
#define blockIdx (::emu::current->block_idx)
#define blockDim (::emu::current->block_dim)
#define gridDim (::emu::current->grid_dim)

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// Block-scope `thread_local` is static: one copy per OS thread, so the fibers of the block
// running on it share it, as a block shares its static shared memory.
#define __shared__ thread_local

inline void __syncthreads() { emu::sync_block(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::sync_warp(); }

template <typename T> T __shfl_sync(unsigned, T v, int src_lane, int width = 32) {
    const unsigned lane = emu::lane_id();
    const unsigned base = lane / width * width;
    return emu::from_bits<T>(emu::warp_exchange(emu::to_bits(v), base + src_lane % width));
}

template <typename T> T __shfl_xor_sync(unsigned, T v, int lane_mask, int width = 32) {
    const unsigned lane = emu::lane_id();
    unsigned src = lane ^ lane_mask;
    if (src / width != lane / width) src = lane;  // CUDA: outside the segment, keep your own
    return emu::from_bits<T>(emu::warp_exchange(emu::to_bits(v), src));
}

// The fibers of a block never run at the same time, so a plain read-modify-write is atomic.
inline unsigned int atomicMax(unsigned int* address, unsigned int value) {
    const unsigned int old = *address;
    if (value > old) *address = value;
    return old;
}

inline unsigned int __float_as_uint(float x) { return emu::from_bits<unsigned int>(emu::to_bits(x)); }
inline int __float2int_rn(float x) { return (int)std::nearbyint(x); }  // ties to even
// Rounded products and sums, never fused (-std=c++20 keeps GCC from contracting them).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
