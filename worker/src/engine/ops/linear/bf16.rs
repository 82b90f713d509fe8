//! The packed GEMM with bf16 inputs and f32 accumulation, for CPUs with AVX512-BF16.
//!
//! `vdpbf16ps` multiplies pairs of bf16 values and adds both products to an f32 lane: 32
//! multiply-adds per instruction, about twice the f32 FMA rate of the same core on AMD Zen 4.
//! An Intel Xeon runs 512-bit f32 FMAs at full rate, and there this kernel runs at about
//! 0.6 of the AVX-512 f32 kernel's speed (`avx512.rs`; bench/results/cpu_f32_avx512.md), so
//! `GemmInputs::fastest` keeps f32 on such CPUs. The weights are rounded to bf16 once, when
//! packed; each call rounds its rows of activations as it packs them. Rounding is to nearest even, as PyTorch's
//! `.to(torch.bfloat16)`. The bias, the epilogue's GELU and every op outside the GEMMs stay
//! f32, which is what OpenVINO's CPU plugin does by default on such CPUs (its bf16 "inference
//! precision hint"). On all-MiniLM-L6-v2 the embeddings stay within cosine 0.99997 of
//! sentence-transformers' f32 ones (worker/tests/engine_exactness.rs checks ≥ 0.9999).
//!
//! Same blocking as the f32 kernel (see the parent module), with the depth taken in pairs:
//! an 8×32 register tile (16 zmm accumulators), weight panels of `kc/2` pairs × 32 columns.

use super::{round_bf16, tasks, Activation, Dst, MatRef, TileArgs, KC_MAX};
#[cfg(target_arch = "x86_64")]
use super::gelu_stored_tile;
use crate::engine::ops::SharedMut;
use rayon::prelude::*;

/// Rows and columns of the register tile.
const MR: usize = 8;
const NR: usize = 32;
/// Rows per block of activations (a multiple of MR).
const MC_MAX: usize = 128;

/// A matrix packed for the kernel: for each depth block, for each group of 32 output
/// columns, for each pair of depths `(p, p + 1)`, the 32 columns' pairs ([`pair`];
/// zero-padded past `n` and past an odd depth).
#[derive(Debug)]
pub(super) struct Panels {
    kc: usize,
    data: Vec<u32>,
}

impl Panels {
    /// Packs `b`, `[n, k]`: the checkpoint's `nn.Linear` weight, or in training a transposed
    /// view (`Wᵀ`, `Xᵀ`), packed without a copy first. Training packs both operands on every
    /// call, so the panels are packed in parallel.
    pub fn pack(b: MatRef<'_>) -> Self {
        let (n, k) = b.dims();
        let blocks = k.div_ceil(KC_MAX).max(1);
        let kc = k.div_ceil(blocks).next_multiple_of(2);
        let panels = n.div_ceil(NR);
        let mut data = super::super::zeros(k.div_ceil(kc).max(1) * panels * kc / 2 * NR);
        data.par_chunks_mut(kc / 2 * NR).enumerate().for_each(|(i, chunk)| {
            let (p0, panel) = (i / panels * kc, i % panels);
            let (j0, width) = (panel * NR, NR.min(n - panel * NR));
            let pairs = kc.min(k - p0).div_ceil(2);
            // A `MatRef` is row-major or the transpose of one: one of its strides is 1.
            if b.row_stride == 1 {
                // The panel's columns lie side by side at each depth: two slices make a row of pairs.
                let row = |p: usize| &b.data[p * b.col_stride + j0..][..width];
                for (kp, out) in chunk.chunks_exact_mut(NR).take(pairs).enumerate() {
                    pair_slices(row(p0 + 2 * kp), (p0 + 2 * kp + 1 < k).then(|| row(p0 + 2 * kp + 1)), out);
                }
            } else {
                // Each column's depths lie side by side.
                for j in 0..width {
                    let column = &b.data[(j0 + j) * b.row_stride + p0..][..kc.min(k - p0)];
                    for (kp, two) in column.chunks(2).enumerate() {
                        chunk[kp * NR + j] = pair(two[0], two.get(1).copied().unwrap_or(0.0));
                    }
                }
            }
        });
        Self { kc, data }
    }

    fn panel(&self, n: usize, block: usize, panel: usize) -> *const u32 {
        let panels = n.div_ceil(NR);
        self.data[(block * panels + panel) * self.kc / 2 * NR..].as_ptr()
    }
}

/// `lo` and `hi` rounded to bf16 (nearest even, as `vcvtne2ps2bf16`) side by side, `lo` first
/// in memory: the two values `vdpbf16ps` multiplies in one lane.
fn pair(lo: f32, hi: f32) -> u32 {
    (round_bf16(hi).to_bits() & 0xFFFF_0000) | round_bf16(lo).to_bits() >> 16
}

/// `out[j] = pair(lo[j], hi[j])` (`hi` zeros where absent), in a loop that vectorises.
fn pair_slices(lo: &[f32], hi: Option<&[f32]>, out: &mut [u32]) {
    match hi {
        Some(hi) => out.iter_mut().zip(lo).zip(hi).for_each(|((o, lo), hi)| *o = pair(*lo, *hi)),
        None => out.iter_mut().zip(lo).for_each(|(o, lo)| *o = pair(*lo, 0.0)),
    }
}

/// Round to nearest even, as `vcvtne2ps2bf16` does (NaN stays NaN): the reference
/// `super::round_bf16` is tested against.
#[cfg(test)]
pub(super) fn to_bf16(v: f32) -> u16 {
    let bits = v.to_bits();
    if v.is_nan() {
        return ((bits >> 16) | 0x40) as u16;
    }
    (bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16) as u16
}

/// `to_bf16`'s inverse, exact.
#[cfg(test)]
pub(super) fn from_bf16(v: u16) -> f32 {
    f32::from_bits((v as u32) << 16)
}

#[cfg(target_arch = "x86_64")]
/// `out = act(x Wᵀ + bias)` for `x` `[m, k]` (row-major, or in training a transposed view),
/// `W` `[n, k]` packed as `w`, `out` `[m, n]`.
///
/// # Safety
/// The CPU must have AVX512F and AVX512-BF16 (and AVX2+FMA, for the GELU).
pub(super) unsafe fn gemm(x: MatRef<'_>, n: usize, w: &Panels, bias: &[f32], act: Activation, out: &mut [f32]) {
    let (m, k) = x.dims();
    // Each task's activations as bf16 pairs, rows `stride` pairs apart: whole cache lines and
    // one more, so that rows a power of two apart do not all fall in one cache set.
    let stride = k.div_ceil(2).next_multiple_of(16) + 16;
    let out_ptr = SharedMut(out.as_mut_ptr());
    let block_count = k.div_ceil(w.kc);
    tasks(m, n.div_ceil(NR), MR, MC_MAX).par_iter().with_max_len(1).for_each(|task| {
        let (i0, rows) = (task.first_row, task.rows);
        let a = pack_rows(x, i0..i0 + rows, stride);
        for (blk, p0) in (0..k).step_by(w.kc).enumerate() {
            let tile = TileArgs {
                first: blk == 0,
                last: blk + 1 == block_count,
                act,
                depth: w.kc.min(k - p0).div_ceil(2),
            };
            for panel in task.panels.clone() {
                let b = w.panel(n, blk, panel);
                let cols = NR.min(n - panel * NR);
                for ir in (0..rows).step_by(MR) {
                    let tile_rows = MR.min(rows - ir);
                    // Rows past the end repeat the last one (their results are never stored).
                    let a_rows: [*const u32; MR] = std::array::from_fn(|r| {
                        a[(ir + r.min(tile_rows - 1)) * stride + p0 / 2..].as_ptr()
                    });
                    let dst = Dst {
                        c: out_ptr.at((i0 + ir) * n + panel * NR),
                        ldc: n,
                        rows: tile_rows,
                        cols,
                    };
                    // SAFETY: the caller checked the CPU; the tile belongs to this task alone;
                    // each `a` row has `depth` pairs from p0 / 2.
                    kernel_8x32(&tile, a_rows, b, &bias[panel * NR..], dst);
                }
            }
        }
    });
}

#[cfg(target_arch = "x86_64")]
/// The rows `rows` of `x` as bf16 pairs (the last one padded with a zero if `k` is odd), one
/// row after another, `stride` pairs apart.
fn pack_rows(x: MatRef<'_>, rows: std::ops::Range<usize>, stride: usize) -> Vec<u32> {
    let k = x.dims().1;
    let mut a = vec![0u32; rows.len() * stride];
    // A `MatRef` is row-major or the transpose of one: one of its strides is 1.
    if x.col_stride == 1 {
        for (i, packed) in rows.zip(a.chunks_exact_mut(stride)) {
            pack_row(&x.data[i * x.row_stride..][..k], packed);
        }
        return a;
    }
    // A transposed view: each depth's values of these rows lie side by side. Pair two depths'
    // slices, then spread the pairs across the packed rows.
    let column = |p: usize| &x.data[p * x.col_stride + rows.start..][..rows.len()];
    let mut pairs = vec![0u32; rows.len()];
    for kp in 0..k.div_ceil(2) {
        pair_slices(column(2 * kp), (2 * kp + 1 < k).then(|| column(2 * kp + 1)), &mut pairs);
        for (r, pair) in pairs.iter().enumerate() {
            a[r * stride + kp] = *pair;
        }
    }
    a
}

#[cfg(target_arch = "x86_64")]
/// One row of activations to bf16 pairs (the last one padded with a zero if `k` is odd).
fn pack_row(x: &[f32], out: &mut [u32]) {
    let mut chunks = x.chunks_exact(32);
    let mut o = 0;
    for chunk in chunks.by_ref() {
        // SAFETY: `gemm`'s caller checked AVX512-BF16; 32 floats in, 16 pairs out.
        unsafe { pack_32(chunk, &mut out[o..o + 16]) };
        o += 16;
    }
    for two in chunks.remainder().chunks(2) {
        out[o] = pair(two[0], two.get(1).copied().unwrap_or(0.0));
        o += 1;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn pack_32(x: &[f32], out: &mut [u32]) {
    use std::arch::x86_64::*;
    let lo = _mm512_loadu_ps(x.as_ptr());
    let hi = _mm512_loadu_ps(x.as_ptr().add(16));
    // Element i of the result is lo[i] for i < 16, hi[i - 16] after: x in order.
    let packed: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
    _mm512_storeu_si512(out.as_mut_ptr().cast(), packed);
}

#[cfg(target_arch = "x86_64")]
/// C[0..8, 0..32] (+)= A[0..8, pairs] · B_panel, 16 accumulators in zmm registers.
#[target_feature(enable = "avx512f,avx512bf16,avx2,fma")]
unsafe fn kernel_8x32(t: &TileArgs, a: [*const u32; MR], b: *const u32, bias: &[f32], dst: Dst) {
    use std::arch::x86_64::*;

    let full = dst.rows == MR && dst.cols == NR;
    // A partial tile goes through an 8×32 buffer so the kernel's loads and stores stay whole.
    let mut buf = [0f32; MR * NR];
    let (c, ldc) = if full {
        (dst.c, dst.ldc)
    } else {
        (buf.as_mut_ptr(), NR)
    };

    let mut acc = [_mm512_setzero_ps(); 2 * MR];
    if t.first {
        let mut bias_tile = [0f32; NR];
        bias_tile[..dst.cols].copy_from_slice(&bias[..dst.cols]);
        let b0 = _mm512_loadu_ps(bias_tile.as_ptr());
        let b1 = _mm512_loadu_ps(bias_tile.as_ptr().add(16));
        for r in 0..MR {
            acc[2 * r] = b0;
            acc[2 * r + 1] = b1;
        }
    } else {
        if !full {
            dst.copy_to(c, NR);
        }
        for r in 0..MR {
            acc[2 * r] = _mm512_loadu_ps(c.add(r * ldc));
            acc[2 * r + 1] = _mm512_loadu_ps(c.add(r * ldc + 16));
        }
    }

    for kp in 0..t.depth {
        let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(kp * NR).cast()));
        let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(kp * NR + 16).cast()));
        for r in 0..MR {
            let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(*a[r].add(kp) as i32));
            acc[2 * r] = _mm512_dpbf16_ps(acc[2 * r], av, b0);
            acc[2 * r + 1] = _mm512_dpbf16_ps(acc[2 * r + 1], av, b1);
        }
    }

    for r in 0..MR {
        _mm512_storeu_ps(c.add(r * ldc), acc[2 * r]);
        _mm512_storeu_ps(c.add(r * ldc + 16), acc[2 * r + 1]);
    }
    if t.last && t.act == Activation::Gelu {
        gelu_stored_tile(c, ldc, MR, NR);
    }
    if !full {
        dst.copy_from(c, NR);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::ops::has_avx512_bf16;
    use crate::engine::ops::test_inputs::Rng;

    /// `to_bf16(lo) | to_bf16(hi) << 16`: a pair as `vdpbf16ps` reads it, from the reference
    /// rounding.
    fn reference_pair(lo: f32, hi: f32) -> u32 {
        to_bf16(lo) as u32 | (to_bf16(hi) as u32) << 16
    }

    /// A `[rows, cols]` matrix stored row-major, and the same values stored transposed, so
    /// that the transpose's view reads them: the two layouts a `MatRef` takes.
    fn both_layouts(rng: &mut Rng, rows: usize, cols: usize) -> (Vec<f32>, Vec<f32>) {
        let values: Vec<f32> = (0..rows * cols).map(|_| rng.uniform(3.0)).collect();
        let transposed = (0..cols * rows).map(|i| values[(i % rows) * cols + i / rows]).collect();
        (values, transposed)
    }

    /// Packing reads a row-major matrix and a transposed view by different loops; both give
    /// the panels the kernel reads: pair `(p, p + 1)` of column `j` at `kp · 32 + j` of its
    /// block and panel, bf16 to nearest even, zeros past `n` and past an odd depth.
    #[test]
    fn panels_hold_the_pairs_the_kernel_reads_from_either_layout() {
        let mut rng = Rng::new(46);
        for (n, k) in [(1, 1), (45, 301), (70, 800), (33, 1101)] {
            let (b, b_stored_t) = both_layouts(&mut rng, n, k);
            let row_major = Panels::pack(MatRef::row_major(&b, n, k).unwrap());
            let view = Panels::pack(MatRef::row_major(&b_stored_t, k, n).unwrap().t());
            assert_eq!(row_major.data, view.data, "[{n}, {k}]");
            let kc = row_major.kc;
            assert!(kc % 2 == 0 && kc <= KC_MAX.next_multiple_of(2), "{kc}");
            let at = |j: usize, p: usize| if j < n && p < k { b[j * k + p] } else { 0.0 };
            for (blk, p0) in (0..k).step_by(kc).enumerate() {
                for panel in 0..n.div_ceil(NR) {
                    let packed = &row_major.data[(blk * n.div_ceil(NR) + panel) * kc / 2 * NR..][..kc / 2 * NR];
                    for (i, got) in packed.iter().enumerate() {
                        let (p, j) = (p0 + 2 * (i / NR), panel * NR + i % NR);
                        let want = reference_pair(at(j, p), at(j, p + 1));
                        assert_eq!(*got, want, "[{n}, {k}] block {blk}, panel {panel}, pair {}, column {j}", i / NR);
                    }
                }
            }
        }
    }

    /// A task's rows of activations packed from a transposed view hold the same pairs as from
    /// a row-major matrix (that path's 32-value conversion needs AVX512-BF16), `stride` apart.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn activations_pack_alike_from_either_layout() {
        let mut rng = Rng::new(47);
        for (m, k) in [(1, 1), (9, 301), (130, 64), (20, 1101)] {
            let (x, x_stored_t) = both_layouts(&mut rng, m, k);
            let stride = k.div_ceil(2).next_multiple_of(16) + 16;
            for rows in [0..m, m / 2..m] {
                let view = pack_rows(MatRef::row_major(&x_stored_t, k, m).unwrap().t(), rows.clone(), stride);
                for (r, packed) in view.chunks_exact(stride).enumerate() {
                    let i = rows.start + r;
                    let want: Vec<u32> = (0..stride)
                        .map(|kp| match 2 * kp {
                            p if p + 1 < k => reference_pair(x[i * k + p], x[i * k + p + 1]),
                            p if p < k => reference_pair(x[i * k + p], 0.0),
                            _ => 0,
                        })
                        .collect();
                    assert_eq!(packed, want, "[{m}, {k}], row {i}");
                }
                if has_avx512_bf16() {
                    assert_eq!(view, pack_rows(MatRef::row_major(&x, m, k).unwrap(), rows, stride), "[{m}, {k}]");
                }
            }
        }
    }
}
