// CUDA's warp matrix functions (nvcuda::wmma, <mma.h>) on the CPU for the kernel emulator
// (see cuda_runtime.hpp), for 16×16×16 tiles of f16 or bf16 with f32 accumulators.
//
// On a GPU a fragment is spread over the warp's 32 lanes in a layout CUDA leaves unspecified,
// so a kernel may only move whole tiles through load/store/mma/fill. Here every lane holds
// the whole tile, which gives any such kernel the same results; a kernel that peeked at a
// fragment's elements would not compile here (there is no `x`). Loads and stores are warp
// collectives, as on a GPU (every lane must reach them): each waits for the whole warp first,
// so no lane stores a tile while another still has to load what it replaces (a kernel's
// load-mma-store of an accumulator in memory), and a load sees every lane's earlier stores.
// So the emulator cannot tell whether a kernel's own __syncwarp before such a load is
// missing. Products are exact in f32 and summed in k order; a tensor core sums in its own
// order, so results agree to f32 rounding.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K> struct shape;
template <int M, int N, int K> struct shape<matrix_a, M, N, K> {
    static constexpr int rows = M, cols = K;
};
template <int M, int N, int K> struct shape<matrix_b, M, N, K> {
    static constexpr int rows = K, cols = N;
};
template <int M, int N, int K> struct shape<accumulator, M, N, K> {
    static constexpr int rows = M, cols = N;
};

template <typename Use, int M, int N, int K, typename T, typename Layout = void> struct fragment {
    static_assert(M == 16 && N == 16 && K == 16, "the emulator has the 16x16x16 shape only");
    static constexpr int rows = shape<Use, M, N, K>::rows, cols = shape<Use, M, N, K>::cols;
    float tile[rows][cols];  // [row][column] of the matrix, whatever its memory layout
};

inline float value(float x) { return x; }
inline float value(__half x) { return __half2float(x); }
inline float value(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename F, typename T> void load_tile(F& f, const T* p, unsigned ldm, bool row_major) {
    emu::sync_warp();
    for (int r = 0; r < F::rows; ++r)
        for (int c = 0; c < F::cols; ++c)
            f.tile[r][c] = value(row_major ? p[r * ldm + c] : p[r + c * ldm]);
}

template <typename Use, typename T>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, row_major>& f, const T* p, unsigned ldm) {
    load_tile(f, p, ldm, true);
}

template <typename Use, typename T>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, col_major>& f, const T* p, unsigned ldm) {
    load_tile(f, p, ldm, false);
}

inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p,
                             unsigned ldm, layout_t layout) {
    load_tile(f, p, ldm, layout == mem_row_major);
}

inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f,
                              unsigned ldm, layout_t layout) {
    emu::sync_warp();
    for (int r = 0; r < 16; ++r)
        for (int c = 0; c < 16; ++c)
            (layout == mem_row_major ? p[r * ldm + c] : p[r + c * ldm]) = f.tile[r][c];
}

template <typename Use, typename T, typename Layout>
void fill_fragment(fragment<Use, 16, 16, 16, T, Layout>& f, float v) {
    for (auto& row : f.tile)
        for (float& x : row) x = v;
}

// d = a·b + c; d may be c.
template <typename T, typename LayoutA, typename LayoutB>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
              const fragment<matrix_a, 16, 16, 16, T, LayoutA>& a,
              const fragment<matrix_b, 16, 16, 16, T, LayoutB>& b,
              const fragment<accumulator, 16, 16, 16, float>& c) {
    float out[16][16];
    for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 16; ++j) {
            float sum = c.tile[i][j];
            for (int k = 0; k < 16; ++k) sum += a.tile[i][k] * b.tile[k][j];
            out[i][j] = sum;
        }
    for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 16; ++j) d.tile[i][j] = out[i][j];
}

}  // namespace wmma
}  // namespace nvcuda
