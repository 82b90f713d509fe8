// Multi-head self-attention over packed variable-length sequences (the GPU side of
// worker/src/engine/ops/varlen_attention.rs; see kernels/README.md).
//
// Input `qkv` is [T, 3H] from the fused projection, columns Q | K | V, each head-major; the
// QKV bias is added while the rows are loaded. `cu_seqlens` [n + 1] says which rows belong to
// which sequence; a sequence only ever attends to its own rows. Output: [T, H].
//
// Grid: x = tile of ROWS_PER_BLOCK query rows, y = head, z = sequence; tiles past the end of a
// shorter sequence exit at once, so the host sizes the grid from the longest sequence alone
// and never reads lengths back. Each warp owns R query rows; its lanes own keys (scores) and
// then head dimensions (context). Softmax runs online over chunks of 32 keys with f32 running
// max and sum (FlashAttention's recurrence, Dao et al. 2022, Alg. 1), so both kernels below
// share one inner loop and differ only in how K/V reach shared memory:
//   - varlen_attention_short: the whole sequence's K/V at once (ByteTransformer's
//     short-sequence kernel), one load per block;
//   - varlen_attention_tiled: K/V in tiles of KEY_TILE rows, for sequences whose K/V do not
//     fit in shared memory.
// Scores use exp2 with log2(e) folded into the query scale.
#include "common.cuh"

#define WARPS 4
#define R 4
#define ROWS_PER_BLOCK (WARPS * R)

// K rows in shared memory are padded so that 32 lanes reading 32 different keys at the same
// column hit 32 different banks: the row stride in 4-byte words is odd.
template <typename T> struct KeyPad { static constexpr int value = sizeof(T) == 4 ? 1 : 2; };

// Keys per tile in the tiled kernel: 32 KiB of K and V at most for head size 128.
template <typename T> struct KeyTile { static constexpr int value = 128 / sizeof(T); };

template <int D> struct RowState {
    float m[R];           // running max of the (log2-scaled) scores
    float l[R];           // running sum of exp2(score - m)
    float o[R][D / 32];   // unnormalised context, dims lane + 32·c
};

// Scores and context of this warp's R query rows against `n` keys held in shared memory.
template <typename T, int D>
__device__ __forceinline__ void attend_keys(const float* q, const T* k_s, const T* v_s, int n,
                                            RowState<D>& st, int lane) {
    constexpr int KS = D + KeyPad<T>::value;
    for (int j0 = 0; j0 < n; j0 += 32) {
        const int j = j0 + lane;
        float s[R];
        if (j < n) {
#pragma unroll
            for (int r = 0; r < R; ++r) s[r] = 0.0f;
            const T* k = k_s + j * KS;
#pragma unroll 8
            for (int c = 0; c < D; ++c) {
                const float kc = to_float(k[c]);
#pragma unroll
                for (int r = 0; r < R; ++r) s[r] = fmaf(q[r * D + c], kc, s[r]);
            }
        } else {
#pragma unroll
            for (int r = 0; r < R; ++r) s[r] = -INFINITY;
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            // Lane 0's key is always real (j0 < n), so the chunk max is finite.
            const float m_new = fmaxf(st.m[r], warp_max(s[r]));
            const float alpha = exp2f(st.m[r] - m_new);  // 0 on the first chunk (m = -inf)
            const float p = exp2f(s[r] - m_new);          // 0 for keys past n
            s[r] = p;
            st.l[r] = st.l[r] * alpha + warp_sum(p);
            st.m[r] = m_new;
#pragma unroll
            for (int c = 0; c < D / 32; ++c) st.o[r][c] *= alpha;
        }
        const int count = min(32, n - j0);
        for (int jj = 0; jj < count; ++jj) {
            const T* v = v_s + (j0 + jj) * D;
            float vv[D / 32];
#pragma unroll
            for (int c = 0; c < D / 32; ++c) vv[c] = to_float(v[lane + 32 * c]);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const float pj = __shfl_sync(FULL_MASK, s[r], jj);
#pragma unroll
                for (int c = 0; c < D / 32; ++c) st.o[r][c] = fmaf(pj, vv[c], st.o[r][c]);
            }
        }
    }
}

// Copies K and V rows [first, first + n) of one head of one sequence, bias added, into
// shared memory (K with the padded stride). Coalesced: consecutive threads, consecutive
// columns.
template <typename T, int D>
__device__ __forceinline__ void load_keys(const T* __restrict__ qkv, const T* __restrict__ bias,
                                          int row0, int first, int n, int hidden, int head,
                                          T* k_s, T* v_s) {
    constexpr int KS = D + KeyPad<T>::value;
    const int k_col = hidden + head * D, v_col = 2 * hidden + head * D;
    for (int idx = threadIdx.x; idx < n * D; idx += blockDim.x) {
        const int t = idx / D, c = idx % D;
        const T* row = qkv + (size_t)(row0 + first + t) * 3 * hidden;
        k_s[t * KS + c] = from_float<T>(to_float(row[k_col + c]) + to_float(bias[k_col + c]));
        v_s[t * D + c] = from_float<T>(to_float(row[v_col + c]) + to_float(bias[v_col + c]));
    }
}

// This warp's query rows, bias added and pre-scaled, into its f32 slot of shared memory.
// Rows past the sequence's end get zeros (their results are never stored).
template <typename T, int D>
__device__ __forceinline__ void load_queries(const T* __restrict__ qkv,
                                             const T* __restrict__ bias, int row0, int first,
                                             int len, int hidden, int head, float scale_log2,
                                             float* q, int lane) {
    for (int r = 0; r < R; ++r) {
        const int i = first + r;
        for (int c = lane; c < D; c += 32) {
            float v = 0.0f;
            if (i < len) {
                const int col = head * D + c;
                v = (to_float(qkv[(size_t)(row0 + i) * 3 * hidden + col]) + to_float(bias[col])) *
                    scale_log2;
            }
            q[r * D + c] = v;
        }
    }
    __syncwarp();
}

template <typename T, int D>
__device__ __forceinline__ void store_rows(const RowState<D>& st, T* __restrict__ out, int row0,
                                           int first, int len, int hidden, int head, int lane) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int i = first + r;
        if (i >= len) break;
        const float inv = 1.0f / st.l[r];
#pragma unroll
        for (int c = 0; c < D / 32; ++c)
            out[(size_t)(row0 + i) * hidden + head * D + lane + 32 * c] =
                from_float<T>(st.o[r][c] * inv);
    }
}

template <int D> __device__ __forceinline__ void init_state(RowState<D>& st) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
        st.m[r] = -INFINITY;
        st.l[r] = 0.0f;
#pragma unroll
        for (int c = 0; c < D / 32; ++c) st.o[r][c] = 0.0f;
    }
}

// Shared memory: per-warp queries (f32), then K [len][D + pad] and V [len][D] in storage type.
template <typename T, int D>
__device__ __forceinline__ void attention_short(const T* __restrict__ qkv,
                                                const T* __restrict__ bias,
                                                const uint32_t* __restrict__ cu_seqlens,
                                                T* __restrict__ out, int hidden,
                                                float scale_log2) {
    DYNAMIC_SHARED(float4, smem_f4);
    float* smem = reinterpret_cast<float*>(smem_f4);
    const int seq = blockIdx.z, head = blockIdx.y;
    const int row0 = cu_seqlens[seq], len = cu_seqlens[seq + 1] - row0;
    const int tile0 = blockIdx.x * ROWS_PER_BLOCK;
    if (tile0 >= len) return;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

    float* q = smem + warp * R * D;
    T* k_s = reinterpret_cast<T*>(smem + WARPS * R * D);
    T* v_s = k_s + len * (D + KeyPad<T>::value);
    load_keys<T, D>(qkv, bias, row0, 0, len, hidden, head, k_s, v_s);
    const int first = tile0 + warp * R;
    load_queries<T, D>(qkv, bias, row0, first, len, hidden, head, scale_log2, q, lane);
    __syncthreads();

    if (first >= len) return;  // this warp's rows are all past the end (no barrier follows)
    RowState<D> st;
    init_state(st);
    attend_keys<T, D>(q, k_s, v_s, len, st, lane);
    store_rows<T, D>(st, out, row0, first, len, hidden, head, lane);
}

// Shared memory: per-warp queries (f32), then a K tile [KEY_TILE][D + pad] and a V tile
// [KEY_TILE][D] in storage type.
template <typename T, int D>
__device__ __forceinline__ void attention_tiled(const T* __restrict__ qkv,
                                                const T* __restrict__ bias,
                                                const uint32_t* __restrict__ cu_seqlens,
                                                T* __restrict__ out, int hidden,
                                                float scale_log2) {
    constexpr int TILE = KeyTile<T>::value;
    DYNAMIC_SHARED(float4, smem_f4);
    float* smem = reinterpret_cast<float*>(smem_f4);
    const int seq = blockIdx.z, head = blockIdx.y;
    const int row0 = cu_seqlens[seq], len = cu_seqlens[seq + 1] - row0;
    const int tile0 = blockIdx.x * ROWS_PER_BLOCK;
    if (tile0 >= len) return;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

    float* q = smem + warp * R * D;
    T* k_s = reinterpret_cast<T*>(smem + WARPS * R * D);
    T* v_s = k_s + TILE * (D + KeyPad<T>::value);
    const int first = tile0 + warp * R;
    load_queries<T, D>(qkv, bias, row0, first, len, hidden, head, scale_log2, q, lane);

    RowState<D> st;
    init_state(st);
    for (int k0 = 0; k0 < len; k0 += TILE) {
        const int n = min(TILE, len - k0);
        __syncthreads();  // the previous tile is no longer read
        load_keys<T, D>(qkv, bias, row0, k0, n, hidden, head, k_s, v_s);
        __syncthreads();
        // Warps whose rows are all past the end still load tiles (the barriers need them).
        if (first < len) attend_keys<T, D>(q, k_s, v_s, n, st, lane);
    }
    store_rows<T, D>(st, out, row0, first, len, hidden, head, lane);
}

#define ATTENTION_KERNELS(TYPE, SUFFIX, D)                                                      \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                    \
        varlen_attention_short_d##D##_##SUFFIX(const TYPE* qkv, const TYPE* bias,               \
                                               const uint32_t* cu_seqlens, TYPE* out,           \
                                               int hidden, float scale_log2) {                  \
        attention_short<TYPE, D>(qkv, bias, cu_seqlens, out, hidden, scale_log2);               \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                    \
        varlen_attention_tiled_d##D##_##SUFFIX(const TYPE* qkv, const TYPE* bias,               \
                                               const uint32_t* cu_seqlens, TYPE* out,           \
                                               int hidden, float scale_log2) {                  \
        attention_tiled<TYPE, D>(qkv, bias, cu_seqlens, out, hidden, scale_log2);               \
    }

#define ATTENTION_ALL_HEAD_SIZES(TYPE, SUFFIX) \
    ATTENTION_KERNELS(TYPE, SUFFIX, 32)         \
    ATTENTION_KERNELS(TYPE, SUFFIX, 64)         \
    ATTENTION_KERNELS(TYPE, SUFFIX, 128)

FOR_EACH_STORAGE(ATTENTION_ALL_HEAD_SIZES)
