//! Multi-head self-attention over packed variable-length sequences: each sequence attends to
//! its own tokens only, so no padded position is ever scored (the packed layout of
//! ByteTransformer and TEI's `flash_attn_varlen`). The QKV bias is added here, while Q, K and V
//! are gathered per head, which saves a pass over the `[T, 3H]` projection.
//!
//! Inputs: `qkv` `[T, 3H]` from the fused projection (columns Q | K | V, each head-major),
//! `qkv_bias` `[3H]`, `cu_seqlens` `[n + 1]` u32. Output: the per-head contexts `[T, H]`.

pub mod cuda;

use super::vector_math::exp_scalar;
use super::{contiguous_f32, cu_seqlens, has_avx2_fma, SharedMut};
use candle_core::{bail, CpuStorage, CustomOp3, Layout, Result, Shape};
use rayon::prelude::*;
use std::cell::RefCell;

#[derive(Debug, Clone, Copy)]
pub struct VarlenAttention {
    pub num_heads: usize,
    pub head_dim: usize,
    /// The longest sequence in the batch; the CPU kernel sizes its scratch per sequence and
    /// ignores it, a GPU launch needs it for its grid.
    pub max_seqlen: usize,
    /// Whether a GPU launch may take the tensor-core kernel where it applies (`cuda.rs`);
    /// off, the CUDA-core kernels run. The engine leaves it on; benchmarks compare the two.
    pub tensor_cores: bool,
}

impl VarlenAttention {
    fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }

    /// `(tokens, hidden)` of a `[T, 3H]` projection, once its width and the bias's length
    /// are checked against the heads.
    fn shapes(&self, name: &str, qkv: &Shape, bias: &Shape) -> Result<(usize, usize)> {
        let hidden = self.num_heads * self.head_dim;
        let (tokens, width) = qkv.dims2()?;
        if width != 3 * hidden {
            bail!(
                "{name}: qkv is [{tokens}, {width}], expected [T, {}]",
                3 * hidden
            );
        }
        if bias.elem_count() != 3 * hidden {
            bail!(
                "{name}: qkv bias has {} values, expected {}",
                bias.elem_count(),
                3 * hidden
            );
        }
        Ok((tokens, hidden))
    }
}

/// One unit of parallel work: a range of heads of one sequence. Long sequences get one head
/// per item, for parallelism within the sequence; short ones get all their heads in one item,
/// so the gather reads each `[3H]` row once, front to back, and the per-item overhead is
/// paid once per sequence rather than once per head.
#[derive(Clone, Copy)]
struct Item {
    start: usize,
    len: usize,
    heads: (usize, usize),
}

/// Heads per item for a sequence of `len` tokens: about 16 × 12 query-key pairs' worth of
/// rows at least, so tiny sequences are batched per sequence.
fn heads_per_item(len: usize, num_heads: usize) -> usize {
    (num_heads * 16 / len.max(1)).clamp(1, num_heads.max(1))
}

/// Where an item reads from and writes to.
struct Problem<'a> {
    qkv: &'a [f32],
    bias: &'a [f32],
    out: SharedMut,
    hidden: usize,
    head_dim: usize,
    scale: f32,
}

impl CustomOp3 for VarlenAttention {
    fn name(&self) -> &'static str {
        "varlen-attention"
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        qkv_s: &candle_core::CudaStorage,
        qkv_l: &Layout,
        bias_s: &candle_core::CudaStorage,
        bias_l: &Layout,
        cu_s: &candle_core::CudaStorage,
        cu_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::run(self, &[(qkv_s, qkv_l), (bias_s, bias_l), (cu_s, cu_l)])
    }

    fn cpu_fwd(
        &self,
        qkv_s: &CpuStorage,
        qkv_l: &Layout,
        bias_s: &CpuStorage,
        bias_l: &Layout,
        cu_s: &CpuStorage,
        cu_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let name = self.name();
        let (tokens, hidden) = self.shapes(name, qkv_l.shape(), bias_l.shape())?;
        let qkv = contiguous_f32(name, "qkv", qkv_s, qkv_l)?;
        let bias = contiguous_f32(name, "qkv bias", bias_s, bias_l)?;
        let cu = cu_seqlens(name, cu_s, cu_l, tokens)?;

        let mut out = vec![0f32; tokens * hidden];
        let problem = Problem {
            qkv,
            bias,
            out: SharedMut(out.as_mut_ptr()),
            hidden,
            head_dim: self.head_dim,
            scale: self.scale(),
        };
        // Longest first, so the big items start early and the short ones fill the gaps.
        let num_heads = self.num_heads;
        let mut items: Vec<Item> = cu
            .windows(2)
            .filter(|w| w[1] > w[0])
            .flat_map(|w| {
                let (start, len) = (w[0] as usize, (w[1] - w[0]) as usize);
                let step = heads_per_item(len, num_heads);
                (0..num_heads).step_by(step).map(move |h0| Item {
                    start,
                    len,
                    heads: (h0, (h0 + step).min(num_heads)),
                })
            })
            .collect();
        items.sort_by_key(|item| std::cmp::Reverse(item.len));

        let fast = has_avx2_fma() && self.head_dim.is_multiple_of(16);
        items.par_iter().with_max_len(1).for_each(|item| {
            SCRATCH.with(|scratch| {
                let scratch = &mut scratch.borrow_mut();
                if fast {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: AVX2+FMA were detected; the item's output rows/columns belong to
                    // this item alone.
                    unsafe {
                        avx2::attend(&problem, *item, scratch)
                    }
                } else {
                    // SAFETY: as above, the item writes only its own output elements.
                    unsafe { attend_scalar(&problem, *item, scratch) }
                }
            })
        });
        Ok((CpuStorage::F32(out), Shape::from((tokens, hidden))))
    }
}

/// Per-thread buffers, reused across items and calls so attention allocates nothing per token.
#[derive(Default)]
struct Scratch {
    q: Vec<f32>,
    kt: Vec<f32>,
    v: Vec<f32>,
    p: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

fn resize(buf: &mut Vec<f32>, len: usize) {
    buf.clear();
    buf.resize(len, 0.0);
}

/// Portable path (any head size): one query row at a time.
///
/// # Safety
/// `problem.out` must point to `T * hidden` floats, and no other thread may write this item's
/// head columns of its sequence's rows.
unsafe fn attend_scalar(problem: &Problem, item: Item, scratch: &mut Scratch) {
    for head in item.heads.0..item.heads.1 {
        attend_scalar_head(problem, item.start, item.len, head, scratch);
    }
}

unsafe fn attend_scalar_head(
    problem: &Problem,
    start: usize,
    len: usize,
    head: usize,
    scratch: &mut Scratch,
) {
    let Problem {
        qkv,
        bias,
        hidden,
        head_dim: d,
        scale,
        ..
    } = *problem;
    let (q_off, k_off, v_off) = (head * d, hidden + head * d, 2 * hidden + head * d);
    resize(&mut scratch.p, len);
    let p = &mut scratch.p;
    for i in 0..len {
        let q_row = &qkv[(start + i) * 3 * hidden..];
        let mut max = f32::NEG_INFINITY;
        for (j, pj) in p.iter_mut().enumerate() {
            let k_row = &qkv[(start + j) * 3 * hidden..];
            let mut dot = 0f32;
            for c in 0..d {
                dot += (q_row[q_off + c] + bias[q_off + c]) * (k_row[k_off + c] + bias[k_off + c]);
            }
            *pj = dot * scale;
            max = max.max(*pj);
        }
        let mut sum = 0f32;
        for pj in p.iter_mut() {
            *pj = exp_scalar(*pj - max);
            sum += *pj;
        }
        let out_row = problem.out.0.add((start + i) * hidden + head * d);
        for c in 0..d {
            let mut acc = 0f32;
            for (j, pj) in p.iter().enumerate() {
                acc += pj * (qkv[(start + j) * 3 * hidden + v_off + c] + bias[v_off + c]);
            }
            *out_row.add(c) = acc / sum;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::vector_math::avx2::exp;
    use super::*;
    use std::arch::x86_64::*;

    /// Query rows per register tile.
    const QR: usize = 4;
    /// How many tokens ahead the gather prefetches.
    const PREFETCH_AHEAD: usize = 4;

    /// Register-tiled path for head sizes that are multiples of 16: scores are computed 4
    /// queries × 16 keys at a time and the context 4 queries × 16 dims at a time, eight
    /// independent FMA chains each, which keeps both FMA pipes busy.
    ///
    /// # Safety
    /// AVX2 and FMA must be available; otherwise as [`attend_scalar`].
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn attend(problem: &Problem, item: Item, scratch: &mut Scratch) {
        let Problem {
            qkv,
            bias,
            hidden,
            head_dim: d,
            scale,
            ..
        } = *problem;
        let Item {
            start,
            len,
            heads: (h0, h1),
        } = item;
        let nh = h1 - h0;
        // Keys padded to a multiple of 16 and queries to a multiple of 4 inside the scratch
        // tiles only; padded keys get probability 0 and padded query rows are not stored.
        let lk = len.next_multiple_of(16);
        let lq = len.next_multiple_of(QR);
        // Per head: Q [lq, d] (pre-scaled), Kᵀ [d, lk], V [len, d], all with the bias added.
        let (q_size, k_size, v_size) = (lq * d, d * lk, len * d);
        resize(&mut scratch.q, nh * q_size);
        resize(&mut scratch.kt, nh * k_size);
        resize(&mut scratch.v, nh * v_size);
        resize(&mut scratch.p, QR * lk);
        let q = scratch.q.as_mut_ptr();
        let kt = scratch.kt.as_mut_ptr();
        let v = scratch.v.as_mut_ptr();
        let p = scratch.p.as_mut_ptr();

        // The item's rows lie inside `qkv` (the caller checked cu_seqlens against T).
        let b = bias.as_ptr();
        let scale_v = _mm256_set1_ps(scale);
        let mut k_lanes = [0f32; 8];
        let whole_rows = nh * d == hidden;
        for t in 0..len {
            let row = qkv.as_ptr().add((start + t) * 3 * hidden);
            // A slice of a row is too short for the hardware prefetcher to pick up the 3H
            // stride between rows: fetch a few tokens ahead by hand. Whole rows stream.
            if !whole_rows && t + PREFETCH_AHEAD < len {
                let ahead = row.add(PREFETCH_AHEAD * 3 * hidden + h0 * d);
                for part in 0..3 {
                    for c in (0..nh * d).step_by(16) {
                        _mm_prefetch::<_MM_HINT_T0>(ahead.add(part * hidden + c) as *const i8);
                    }
                }
            }
            for h in 0..nh {
                let col = (h0 + h) * d;
                let (qh, kh, vh) = (q.add(h * q_size), kt.add(h * k_size), v.add(h * v_size));
                for c0 in (0..d).step_by(8) {
                    let at = |part: usize| {
                        _mm256_add_ps(
                            _mm256_loadu_ps(row.add(part * hidden + col + c0)),
                            _mm256_loadu_ps(b.add(part * hidden + col + c0)),
                        )
                    };
                    _mm256_storeu_ps(qh.add(t * d + c0), _mm256_mul_ps(at(0), scale_v));
                    _mm256_storeu_ps(vh.add(t * d + c0), at(2));
                    _mm256_storeu_ps(k_lanes.as_mut_ptr(), at(1));
                    for (e, k) in k_lanes.iter().enumerate() {
                        *kh.add((c0 + e) * lk + t) = *k;
                    }
                }
            }
        }

        for h in 0..nh {
            let out = problem.out.0.add(start * hidden + (h0 + h) * d);
            let tile = Tile {
                q: q.add(h * q_size),
                kt: kt.add(h * k_size),
                v: v.add(h * v_size),
                p,
            };
            head(tile, len, lk, d, out, hidden);
        }
    }

    /// One head's scratch: Q `[lq, d]`, Kᵀ `[d, lk]`, V `[len, d]`, and a `[4, lk]` buffer for
    /// a block of score rows.
    struct Tile {
        q: *const f32,
        kt: *const f32,
        v: *const f32,
        p: *mut f32,
    }

    /// softmax(Q Kᵀ) V for one head, written to `out` (row stride `hidden`).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn head(tile: Tile, len: usize, lk: usize, d: usize, out: *mut f32, hidden: usize) {
        let Tile { q, kt, v, p } = tile;
        for i0 in (0..len).step_by(QR) {
            // Scores S[i0..i0+4, 0..lk] = Q Kᵀ.
            for j0 in (0..lk).step_by(16) {
                let mut acc = [_mm256_setzero_ps(); 2 * QR];
                for c in 0..d {
                    let k0 = _mm256_loadu_ps(kt.add(c * lk + j0));
                    let k1 = _mm256_loadu_ps(kt.add(c * lk + j0 + 8));
                    for r in 0..QR {
                        let qv = _mm256_broadcast_ss(&*q.add((i0 + r) * d + c));
                        acc[2 * r] = _mm256_fmadd_ps(qv, k0, acc[2 * r]);
                        acc[2 * r + 1] = _mm256_fmadd_ps(qv, k1, acc[2 * r + 1]);
                    }
                }
                for r in 0..QR {
                    _mm256_storeu_ps(p.add(r * lk + j0), acc[2 * r]);
                    _mm256_storeu_ps(p.add(r * lk + j0 + 8), acc[2 * r + 1]);
                }
            }
            // Softmax numerators in place; the 1/sum is applied to the context row instead.
            let rows = QR.min(len - i0);
            let mut inv_sum = [0f32; QR];
            for (r, inv) in inv_sum.iter_mut().enumerate().take(rows) {
                let row = p.add(r * lk);
                for j in len..lk {
                    *row.add(j) = f32::NEG_INFINITY;
                }
                let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
                for j in (0..lk).step_by(8) {
                    m = _mm256_max_ps(m, _mm256_loadu_ps(row.add(j)));
                }
                let max = _mm256_set1_ps(hmax(m));
                let mut s = _mm256_setzero_ps();
                for j in (0..lk).step_by(8) {
                    let e = exp(_mm256_sub_ps(_mm256_loadu_ps(row.add(j)), max));
                    _mm256_storeu_ps(row.add(j), e);
                    s = _mm256_add_ps(s, e);
                }
                // The padded keys' exp(-inf) is clamped, not zero: drop them from the sum.
                let mut sum = hsum(s);
                for j in len..lk {
                    sum -= *row.add(j);
                }
                *inv = 1.0 / sum;
            }
            // Context O[i0..i0+4, :] = P V over the real keys only.
            for c0 in (0..d).step_by(16) {
                let mut acc = [_mm256_setzero_ps(); 2 * QR];
                for j in 0..len {
                    let v0 = _mm256_loadu_ps(v.add(j * d + c0));
                    let v1 = _mm256_loadu_ps(v.add(j * d + c0 + 8));
                    for r in 0..QR {
                        let pv = _mm256_broadcast_ss(&*p.add(r * lk + j));
                        acc[2 * r] = _mm256_fmadd_ps(pv, v0, acc[2 * r]);
                        acc[2 * r + 1] = _mm256_fmadd_ps(pv, v1, acc[2 * r + 1]);
                    }
                }
                for r in 0..rows {
                    let inv = _mm256_set1_ps(inv_sum[r]);
                    let dst = out.add((i0 + r) * hidden + c0);
                    _mm256_storeu_ps(dst, _mm256_mul_ps(acc[2 * r], inv));
                    _mm256_storeu_ps(dst.add(8), _mm256_mul_ps(acc[2 * r + 1], inv));
                }
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hmax(v: __m256) -> f32 {
        let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let m = _mm_max_ss(m, _mm_shuffle_ps::<0b01>(m, m));
        _mm_cvtss_f32(m)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
        _mm_cvtss_f32(s)
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_inputs::{cu_seqlens, max_abs_diff, Rng};
    use super::*;
    use candle_core::Tensor;

    /// Attention computed the textbook way, in f64, one sequence and head at a time.
    fn reference(qkv: &[f32], bias: &[f32], cu: &[u32], heads: usize, d: usize) -> Vec<f64> {
        let h = heads * d;
        let at = |t: usize, c: usize| qkv[t * 3 * h + c] as f64 + bias[c] as f64;
        let tokens = *cu.last().unwrap() as usize;
        let mut out = vec![0f64; tokens * h];
        for w in cu.windows(2) {
            let (s, e) = (w[0] as usize, w[1] as usize);
            for head in 0..heads {
                for i in s..e {
                    let scores: Vec<f64> = (s..e)
                        .map(|j| {
                            (0..d)
                                .map(|c| at(i, head * d + c) * at(j, h + head * d + c))
                                .sum::<f64>()
                                / (d as f64).sqrt()
                        })
                        .collect();
                    let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let exps: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
                    let sum: f64 = exps.iter().sum();
                    for c in 0..d {
                        out[i * h + head * d + c] = (s..e)
                            .map(|j| exps[j - s] * at(j, 2 * h + head * d + c))
                            .sum::<f64>()
                            / sum;
                    }
                }
            }
        }
        out
    }

    fn check(seed: u64, heads: usize, d: usize, lens: Vec<usize>) {
        let mut rng = Rng::new(seed);
        let (cu, cu_t) = cu_seqlens(&lens);
        let tokens = *cu.last().unwrap() as usize;
        let qkv = rng.tensor(&[tokens, 3 * heads * d], 2.0);
        let bias = rng.tensor(&[3 * heads * d], 0.5);
        let op = VarlenAttention {
            num_heads: heads,
            head_dim: d,
            max_seqlen: 64,
            tensor_cores: true,
        };
        let out = qkv.apply_op3_no_bwd(&bias, &cu_t, &op).unwrap();
        assert_eq!(out.dims(), &[tokens, heads * d]);
        let want = reference(
            &qkv.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            &bias.to_vec1::<f32>().unwrap(),
            &cu,
            heads,
            d,
        );
        let got = out.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let diff = max_abs_diff(&got, &want);
        assert!(
            diff < 2e-5,
            "heads {heads} × {d}, lengths {lens:?}: max diff {diff}"
        );
    }

    #[test]
    fn matches_reference_on_ragged_batches_with_the_tiled_kernel() {
        for (seed, d) in [(1, 32), (2, 64), (3, 16)] {
            let lens = Rng::new(seed).lengths(9, 64);
            check(seed, 3, d, lens);
        }
    }

    #[test]
    fn matches_reference_with_head_sizes_the_tiled_kernel_does_not_take() {
        for (seed, d) in [(4, 8), (5, 24), (6, 1)] {
            let lens = Rng::new(seed).lengths(7, 64);
            check(seed, 2, d, lens);
        }
    }

    #[test]
    fn a_sequence_never_attends_to_its_neighbours() {
        // Two copies of one sequence, with a different sequence between them, must give
        // identical outputs: nothing leaks across the packed boundaries.
        let mut rng = Rng::new(7);
        let (heads, d, len) = (2, 32, 13);
        let a = rng.tensor(&[len, 3 * heads * d], 2.0);
        let b = rng.tensor(&[5, 3 * heads * d], 2.0);
        let qkv = Tensor::cat(&[&a, &b, &a], 0).unwrap();
        let bias = rng.tensor(&[3 * heads * d], 0.5);
        let (_, cu) = cu_seqlens(&[len, 5, len]);
        let op = VarlenAttention {
            num_heads: heads,
            head_dim: d,
            max_seqlen: len,
            tensor_cores: true,
        };
        let out = qkv.apply_op3_no_bwd(&bias, &cu, &op).unwrap();
        let first = out
            .narrow(0, 0, len)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let last = out
            .narrow(0, len + 5, len)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(first, last);
    }

    #[test]
    fn rejects_offsets_that_do_not_cover_the_tokens() {
        let qkv =
            Tensor::zeros((4, 6), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
        let bias = Tensor::zeros(6, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
        let (_, cu) = cu_seqlens(&[1, 2]);
        let op = VarlenAttention {
            num_heads: 1,
            head_dim: 2,
            max_seqlen: 2,
            tensor_cores: true,
        };
        assert!(qkv.apply_op3_no_bwd(&bias, &cu, &op).is_err());
    }
}
