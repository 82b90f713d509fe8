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

use super::{tasks, Activation, Dst, TileArgs, KC_MAX};
#[cfg(target_arch = "x86_64")]
use super::gelu_stored_tile;
use crate::engine::ops::SharedMut;
use rayon::prelude::*;

/// Rows and columns of the register tile.
const MR: usize = 8;
const NR: usize = 32;
/// Rows per block of activations (a multiple of MR).
const MC_MAX: usize = 128;

/// A weight matrix packed for the kernel: for each depth block, for each group of 32 output
/// columns, for each pair of depths `(p, p + 1)`, the 32 columns' two values side by side
/// (zero-padded past `n` and past an odd depth).
#[derive(Debug)]
pub(super) struct Panels {
    kc: usize,
    data: Vec<u16>,
}

impl Panels {
    /// Packs `w`, `[n, k]` row-major (the checkpoint's `nn.Linear` layout).
    pub fn new(w: &[f32], n: usize, k: usize) -> Self {
        Self::pack(n, k, |j, p| w[j * k + p])
    }

    /// Packs the `[n, k]` matrix whose element `(j, p)` is `at(j, p)`, so training can pack a
    /// transposed view (`Wᵀ`, `Xᵀ`) without copying it first.
    /// Training packs both operands on every call, so the panels are packed in parallel.
    pub fn pack(n: usize, k: usize, at: impl Fn(usize, usize) -> f32 + Sync) -> Self {
        let blocks = k.div_ceil(KC_MAX).max(1);
        let kc = k.div_ceil(blocks).next_multiple_of(2);
        let panels = n.div_ceil(NR);
        let mut data = super::super::zeros(k.div_ceil(kc).max(1) * panels * kc * NR);
        data.par_chunks_mut(kc * NR).enumerate().for_each(|(i, chunk)| {
            let (p0, panel) = (i / panels * kc, i % panels);
            for kk in 0..kc.min(k - p0) {
                for j in 0..NR.min(n - panel * NR) {
                    chunk[(kk / 2) * 2 * NR + 2 * j + kk % 2] = to_bf16(at(panel * NR + j, p0 + kk));
                }
            }
        });
        Self { kc, data }
    }

    fn panel(&self, n: usize, block: usize, panel: usize) -> *const u16 {
        let panels = n.div_ceil(NR);
        self.data[(block * panels + panel) * self.kc * NR..].as_ptr()
    }
}

/// Round to nearest even, as `vcvtne2ps2bf16` does (NaN stays NaN).
pub(super) fn to_bf16(v: f32) -> u16 {
    let bits = v.to_bits();
    if v.is_nan() {
        return ((bits >> 16) | 0x40) as u16;
    }
    (bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16) as u16
}

/// The reference `super::round_bf16` is tested against, with `to_bf16`.
#[cfg(test)]
pub(super) fn from_bf16(v: u16) -> f32 {
    f32::from_bits((v as u32) << 16)
}

#[cfg(target_arch = "x86_64")]
/// `out = act(x Wᵀ + bias)` for `x` `[m, k]`, `W` packed as `w`, `out` `[m, n]`.
///
/// # Safety
/// The CPU must have AVX512F and AVX512-BF16 (and AVX2+FMA, for the GELU).
pub(super) unsafe fn gemm(
    x: &[f32],
    (m, k, n): (usize, usize, usize),
    w: &Panels,
    bias: &[f32],
    act: Activation,
    out: &mut [f32],
) {
    let pairs = k.div_ceil(2);
    let out_ptr = SharedMut(out.as_mut_ptr());
    let block_count = k.div_ceil(w.kc);
    tasks(m, n.div_ceil(NR), MR, MC_MAX).par_iter().with_max_len(1).for_each(|task| {
        let (i0, rows) = (task.first_row, task.rows);
        // This block's activations as bf16 pairs, one row of `pairs` after another.
        let mut a = vec![0u32; rows * pairs];
        for (r, packed) in a.chunks_exact_mut(pairs).enumerate() {
            pack_row(&x[(i0 + r) * k..(i0 + r + 1) * k], packed);
        }
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
                        a[(ir + r.min(tile_rows - 1)) * pairs + p0 / 2..].as_ptr()
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
/// One row of activations to bf16 pairs (the last one padded with a zero if `k` is odd).
fn pack_row(x: &[f32], out: &mut [u32]) {
    let mut chunks = x.chunks_exact(32);
    let mut o = 0;
    for chunk in chunks.by_ref() {
        // SAFETY: `gemm`'s caller checked AVX512-BF16; 32 floats in, 16 pairs out.
        unsafe { pack_32(chunk, &mut out[o..o + 16]) };
        o += 16;
    }
    for pair in chunks.remainder().chunks(2) {
        let lo = to_bf16(pair[0]) as u32;
        let hi = pair.get(1).map_or(0, |v| to_bf16(*v) as u32);
        out[o] = lo | hi << 16;
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
unsafe fn kernel_8x32(t: &TileArgs, a: [*const u32; MR], b: *const u16, bias: &[f32], dst: Dst) {
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
        let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(kp * 2 * NR).cast()));
        let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(kp * 2 * NR + NR).cast()));
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
