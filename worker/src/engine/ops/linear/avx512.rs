//! The f32 packed GEMM on AVX-512: the AVX2 kernel's weights, blocking and order of sums at
//! twice the width. It reads the same 16-column f32 panels (two side by side make an 8×32
//! register tile, 16 zmm accumulators; an odd last panel an 8×16 one) and adds every
//! product with the same FMA in the same order from the same bias, so its results are
//! bit-identical to the AVX2 kernel's. Where a core runs 512-bit FMAs at full rate (Intel
//! Xeons since Skylake-SP) this doubles the multiply-adds per instruction: on a Sapphire
//! Rapids class Xeon it made the engine's f32 1.5× faster end to end, past its bf16
//! (bench/results/cpu_f32_avx512.md). On AMD Zen 4, which splits a 512-bit FMA in two, it
//! issues half the instructions for the same work.

use super::{drive_f32, gelu_stored_tile, Activation, Dst, TileArgs, NR};

/// Rows of the register tile; it is one or two panels (16 or 32 columns) wide.
const MR: usize = 8;
/// Rows per block of activations (a multiple of MR).
const MC_MAX: usize = 128;

/// `out = act(x Wᵀ + bias)` for `x` `[m, k]`, `W` packed as f32 panels (`data`, depth blocks
/// of `kc`), `out` `[m, n]`.
///
/// # Safety
/// The CPU must have AVX512F, and AVX2+FMA for the GELU.
pub(super) unsafe fn gemm(
    x: &[f32],
    shape: (usize, usize, usize),
    (data, kc): (&[f32], usize),
    bias: &[f32],
    act: Activation,
    out: &mut [f32],
) {
    // Groups of two panels: one 8×32 tile's columns.
    drive_f32::<MR>(x, shape, (data, kc), bias, act, out, (2, MC_MAX), |tile, a, b, bias, dst| {
        // SAFETY: the caller checked the CPU; `drive_f32`'s tiles are as it says, and a second
        // panel exists when the tile is wider than one.
        unsafe {
            if dst.cols > NR {
                kernel::<2>(tile, a, [b, b.add(kc * NR)], bias, dst)
            } else {
                kernel::<1>(tile, a, [b], bias, dst)
            }
        }
    });
}

/// C[0..8, 0..16·W] (+)= A[0..8, 0..depth] · the W panels `b`, 8·W accumulators in zmm
/// registers.
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn kernel<const W: usize>(
    t: &TileArgs,
    a: [*const f32; MR],
    b: [*const f32; W],
    bias: &[f32],
    dst: Dst,
) {
    use std::arch::x86_64::*;

    let width = W * NR;
    let full = dst.rows == MR && dst.cols == width;
    // A partial tile goes through a whole-tile buffer so the loads and stores stay whole.
    let mut buf = [0f32; MR * 2 * NR];
    let (c, ldc) = if full {
        (dst.c, dst.ldc)
    } else {
        (buf.as_mut_ptr(), width)
    };

    let mut acc = [[_mm512_setzero_ps(); W]; MR];
    if t.first {
        let mut bias_tile = [0f32; 2 * NR];
        bias_tile[..dst.cols].copy_from_slice(&bias[..dst.cols]);
        for row in acc.iter_mut() {
            for (w, v) in row.iter_mut().enumerate() {
                *v = _mm512_loadu_ps(bias_tile.as_ptr().add(w * NR));
            }
        }
    } else {
        if !full {
            dst.copy_to(c, width);
        }
        for (r, row) in acc.iter_mut().enumerate() {
            for (w, v) in row.iter_mut().enumerate() {
                *v = _mm512_loadu_ps(c.add(r * ldc + w * NR));
            }
        }
    }

    for kk in 0..t.depth {
        let mut bv = [_mm512_setzero_ps(); W];
        for (w, v) in bv.iter_mut().enumerate() {
            *v = _mm512_loadu_ps(b[w].add(kk * NR));
        }
        for (r, row) in acc.iter_mut().enumerate() {
            let av = _mm512_set1_ps(*a[r].add(kk));
            for (w, v) in row.iter_mut().enumerate() {
                *v = _mm512_fmadd_ps(av, bv[w], *v);
            }
        }
    }

    for (r, row) in acc.iter().enumerate() {
        for (w, v) in row.iter().enumerate() {
            _mm512_storeu_ps(c.add(r * ldc + w * NR), *v);
        }
    }
    if t.last && t.act == Activation::Gelu {
        gelu_stored_tile(c, ldc, MR, width);
    }
    if !full {
        dst.copy_from(c, width);
    }
}
