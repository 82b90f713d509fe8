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
//
// A third kernel, varlen_attention_mma (f16/bf16, head sizes 32 and 64), puts both products
// on the tensor cores (CUDA's warp matrix functions, 16×16×16 tiles with f32 accumulators)
// for long sequences: see attention_mma below.
#include <mma.h>

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

// Tensor-core attention. Each warp owns MMA_ROWS = 16 query rows (one tile high), so a block
// of 4 warps covers 64; K and V stream through shared memory in tiles of MMA_KEYS = 32 keys.
// Per key tile a warp computes its scores S = Q·Kᵀ (16 × 32) on the tensor cores into shared
// memory, runs the online softmax there (lane j owns key j: running max and sum per row in
// f32, FlashAttention's recurrence as in attend_keys), writes the probabilities P in the
// storage type, rescales its f32 context O in shared memory, and adds P·V on the tensor cores.
// Fragments' element layout is unspecified, so every row-wise step goes through shared memory.
// The queries and the probabilities are rounded to the storage type for the products
// (FlashAttention does the same); the sums, the softmax and O stay in f32.
#define MMA_WARPS 4
#define MMA_ROWS 16
#define MMA_ROWS_PER_BLOCK (MMA_WARPS * MMA_ROWS)
#define MMA_KEYS 32
// Row padding in 16-bit elements: strides stay multiples of 8 elements (wmma's rule) and
// every tile a warp loads starts 32 bytes aligned, while rows shift banks.
#define MMA_PAD 8

namespace wmma = nvcuda::wmma;

// wmma loads and stores tiles at 32-byte aligned addresses: declared as an array of this, the
// block's dynamic shared memory starts so aligned (a float4 array promises only 16 bytes).
struct alignas(32) MmaChunk {
    float v[8];
};

// The block's shared memory, in this order (bytes; cuda.rs computes the same total):
// K and V tiles [MMA_KEYS][LD] in the storage type, which first hold the block's queries
// [MMA_ROWS_PER_BLOCK][LD]; then per warp its scores [MMA_ROWS][LDS] f32, its probabilities
// [MMA_ROWS][LDP] in the storage type and its context [MMA_ROWS][LDO] f32.
template <typename T, int D> struct MmaLayout {
    static constexpr int LD = D + MMA_PAD, LDS = MMA_KEYS + 4, LDP = MMA_KEYS + MMA_PAD,
                         LDO = D + 4;
    static constexpr int KV = 2 * MMA_KEYS * LD * (int)sizeof(T);
    static constexpr int S = MMA_WARPS * MMA_ROWS * LDS * 4;
    static constexpr int P = MMA_WARPS * MMA_ROWS * LDP * (int)sizeof(T);
    static constexpr int O = MMA_WARPS * MMA_ROWS * LDO * 4;
    static_assert(sizeof(T) == 2, "the tensor-core kernel takes f16 or bf16");
    static_assert(2 * MMA_KEYS >= MMA_ROWS_PER_BLOCK, "the queries are staged where K/V go");
    static_assert(KV % 32 == 0 && S % 32 == 0 && P % 32 == 0, "each region starts 32-byte aligned");
    static_assert((16 * LD * 2) % 32 == 0 && (16 * LDS * 4) % 32 == 0 &&
                      (16 * LDP * 2) % 32 == 0 && (16 * LDO * 4) % 32 == 0,
                  "every 16-row tile starts 32-byte aligned");
};

template <typename T, int D>
__device__ __forceinline__ void attention_mma(const T* __restrict__ qkv,
                                              const T* __restrict__ bias,
                                              const uint32_t* __restrict__ cu_seqlens,
                                              T* __restrict__ out, int hidden, float scale_log2) {
    using L = MmaLayout<T, D>;
    using Acc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
    DYNAMIC_SHARED(MmaChunk, smem_chunks);
    char* smem = reinterpret_cast<char*>(smem_chunks);
    const int seq = blockIdx.z, head = blockIdx.y;
    const int row0 = cu_seqlens[seq], len = cu_seqlens[seq + 1] - row0;
    const int tile0 = blockIdx.x * MMA_ROWS_PER_BLOCK;
    if (tile0 >= len) return;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int first = tile0 + warp * MMA_ROWS;
    const bool active = first < len;  // else this warp only helps load and keeps the barriers

    T* k_s = reinterpret_cast<T*>(smem);
    T* v_s = k_s + MMA_KEYS * L::LD;
    float* s_s = reinterpret_cast<float*>(smem + L::KV) + warp * MMA_ROWS * L::LDS;
    T* p_s = reinterpret_cast<T*>(smem + L::KV + L::S) + warp * MMA_ROWS * L::LDP;
    float* o_s = reinterpret_cast<float*>(smem + L::KV + L::S + L::P) + warp * MMA_ROWS * L::LDO;

    // The block's queries, bias added (rows past the end zero), staged where K/V will go.
    T* q_s = k_s;
    for (int idx = threadIdx.x; idx < MMA_ROWS_PER_BLOCK * D; idx += blockDim.x) {
        const int r = idx / D, c = idx % D, i = tile0 + r;
        float v = 0.0f;
        if (i < len) {
            const int col = head * D + c;
            v = to_float(qkv[(size_t)(row0 + i) * 3 * hidden + col]) + to_float(bias[col]);
        }
        q_s[r * L::LD + c] = from_float<T>(v);
    }
    for (int idx = lane; idx < MMA_ROWS * D; idx += 32) o_s[idx / D * L::LDO + idx % D] = 0.0f;
    __syncthreads();
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> q[D / 16];
#pragma unroll
    for (int c = 0; c < D / 16; ++c)
        wmma::load_matrix_sync(q[c], q_s + warp * MMA_ROWS * L::LD + c * 16, L::LD);

    float m[MMA_ROWS], l[MMA_ROWS];
#pragma unroll
    for (int r = 0; r < MMA_ROWS; ++r) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    const int k_col = hidden + head * D, v_col = 2 * hidden + head * D;
    for (int k0 = 0; k0 < len; k0 += MMA_KEYS) {
        const int n = min(MMA_KEYS, len - k0);
        __syncthreads();  // the queries, then the previous tile, are no longer read
        // Keys past the end are zero, so no stale value (NaN × 0) reaches P·V.
        for (int idx = threadIdx.x; idx < MMA_KEYS * D; idx += blockDim.x) {
            const int t = idx / D, c = idx % D;
            float kv = 0.0f, vv = 0.0f;
            if (t < n) {
                const T* row = qkv + (size_t)(row0 + k0 + t) * 3 * hidden;
                kv = to_float(row[k_col + c]) + to_float(bias[k_col + c]);
                vv = to_float(row[v_col + c]) + to_float(bias[v_col + c]);
            }
            k_s[t * L::LD + c] = from_float<T>(kv);
            v_s[t * L::LD + c] = from_float<T>(vv);
        }
        __syncthreads();
        if (!active) continue;

        // S = Q·Kᵀ: K's rows read as the columns of a col-major Kᵀ.
#pragma unroll
        for (int j = 0; j < MMA_KEYS / 16; ++j) {
            Acc s;
            wmma::fill_fragment(s, 0.0f);
#pragma unroll
            for (int c = 0; c < D / 16; ++c) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> kt;
                wmma::load_matrix_sync(kt, k_s + j * 16 * L::LD + c * 16, L::LD);
                wmma::mma_sync(s, q[c], kt, s);
            }
            wmma::store_matrix_sync(s_s + j * 16, s, L::LDS, wmma::mem_row_major);
        }
        __syncwarp();

        // Online softmax, lane = key; O rescaled by each row's correction.
#pragma unroll
        for (int r = 0; r < MMA_ROWS; ++r) {
            // Lane 0's key is always real (k0 < len), so the tile max is finite.
            const float s = lane < n ? s_s[r * L::LDS + lane] * scale_log2 : -INFINITY;
            const float m_new = fmaxf(m[r], warp_max(s));
            const float alpha = exp2f(m[r] - m_new);  // 0 on the first tile (m = -inf)
            const float p = exp2f(s - m_new);          // 0 for keys past the end
            l[r] = l[r] * alpha + warp_sum(p);
            m[r] = m_new;
            p_s[r * L::LDP + lane] = from_float<T>(p);
            for (int c = lane; c < D; c += 32) o_s[r * L::LDO + c] *= alpha;
        }
        __syncwarp();

        // O += P·V.
#pragma unroll
        for (int c = 0; c < D / 16; ++c) {
            Acc o;
            wmma::load_matrix_sync(o, o_s + c * 16, L::LDO, wmma::mem_row_major);
#pragma unroll
            for (int j = 0; j < MMA_KEYS / 16; ++j) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> p;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> v;
                wmma::load_matrix_sync(p, p_s + j * 16, L::LDP);
                wmma::load_matrix_sync(v, v_s + j * 16 * L::LD + c * 16, L::LD);
                wmma::mma_sync(o, p, v, o);
            }
            wmma::store_matrix_sync(o_s + c * 16, o, L::LDO, wmma::mem_row_major);
        }
        __syncwarp();
    }
    if (!active) return;
    for (int r = 0; r < MMA_ROWS; ++r) {
        const int i = first + r;
        if (i >= len) break;
        const float inv = 1.0f / l[r];
        for (int c = lane; c < D; c += 32)
            out[(size_t)(row0 + i) * hidden + head * D + c] = from_float<T>(o_s[r * L::LDO + c] * inv);
    }
}

#define MMA_ATTENTION_KERNEL(TYPE, SUFFIX, D)                                                   \
    extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32)                                \
        varlen_attention_mma_d##D##_##SUFFIX(const TYPE* qkv, const TYPE* bias,                 \
                                             const uint32_t* cu_seqlens, TYPE* out, int hidden, \
                                             float scale_log2) {                                \
        attention_mma<TYPE, D>(qkv, bias, cu_seqlens, out, hidden, scale_log2);                 \
    }

MMA_ATTENTION_KERNEL(__half, f16, 32)
MMA_ATTENTION_KERNEL(__half, f16, 64)
MMA_ATTENTION_KERNEL(__nv_bfloat16, bf16, 32)
MMA_ATTENTION_KERNEL(__nv_bfloat16, bf16, 64)

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
