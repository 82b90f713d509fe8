//! The int8 GEMM with exact i32 accumulation, for CPUs with AVX512-VNNI (QSync's int8
//! layers on the CPU; `crate::train::precision` quantises and dequantises around it).
//!
//! `vpdpbusd` multiplies 4 unsigned bytes by 4 signed bytes and adds the 4 products to an
//! i32 lane: 64 multiply-adds per instruction, twice `vdpbf16ps` and four times the f32 FMA.
//! Both operands are signed here (symmetric quantisation, values in ±127), so the activations
//! go in offset by +128 (`a + 128` fits a u8) and each output subtracts `128 · Σ_p W[j, p]`,
//! which makes the result exactly `Σ_p A[i, p] · W[j, p]`. Nothing can overflow: a product is
//! at most 255 · 127, four of them 129 540, and a depth of 16 000 stays under 2³¹.
//!
//! Same blocking as the bf16 kernel (`bf16.rs`), with the depth taken in quads: an 8×32
//! register tile (16 zmm accumulators), weight panels of `kc/4` quads × 32 columns. Without
//! AVX512-VNNI the same sums come from the f32 kernel (`linear::gemm_i8_on_f32`).

use super::tasks;
use rayon::prelude::*;

/// Rows and columns of the register tile.
const MR: usize = 8;
const NR: usize = 32;
/// Rows per block of activations (a multiple of MR).
const MC_MAX: usize = 128;
/// Upper bound on the depth of one packed block: a panel is `kc × 32` bytes (24 KiB, in L1).
const KC_MAX: usize = 768;

/// A weight matrix packed for the kernel: for each depth block, for each group of 32 output
/// columns, for each quad of depths `p..p + 4`, the 32 columns' four values side by side
/// (zero-padded past `n` and past the depth); and each column's sum over the whole depth.
#[derive(Debug)]
pub(super) struct Panels {
    kc: usize,
    data: Vec<i8>,
    col_sums: Vec<i32>,
}

impl Panels {
    /// Packs `w`, `[n, k]` row-major.
    pub fn new(w: &[i8], n: usize, k: usize) -> Self {
        let blocks = k.div_ceil(KC_MAX).max(1);
        let kc = k.div_ceil(blocks).next_multiple_of(4);
        let panels = n.div_ceil(NR);
        let mut data = super::super::zeros(k.div_ceil(kc).max(1) * panels * kc * NR);
        // Training packs the weights on every call: in parallel.
        data.par_chunks_mut(kc * NR).enumerate().for_each(|(i, chunk)| {
            let (p0, panel) = (i / panels * kc, i % panels);
            for kk in 0..kc.min(k - p0) {
                for j in 0..NR.min(n - panel * NR) {
                    chunk[(kk / 4) * 4 * NR + 4 * j + kk % 4] = w[(panel * NR + j) * k + p0 + kk];
                }
            }
        });
        let col_sums = (0..n)
            .into_par_iter()
            .map(|j| w[j * k..(j + 1) * k].iter().map(|v| *v as i32).sum())
            .collect();
        Self { kc, data, col_sums }
    }

    fn panel(&self, n: usize, block: usize, panel: usize) -> *const i8 {
        let panels = n.div_ceil(NR);
        self.data[(block * panels + panel) * self.kc * NR..].as_ptr()
    }
}

/// The packed weights read by plain loops: tests the packing on any CPU.
#[cfg(test)]
pub(super) fn gemm_scalar(x: &[i8], (_, k, n): (usize, usize, usize), w: &Panels, out: &mut [i32]) {
    let panels = n.div_ceil(NR);
    out.par_chunks_mut(n.max(1))
        .enumerate()
        .for_each(|(i, row)| {
            row.fill(0);
            for (blk, p0) in (0..k).step_by(w.kc).enumerate() {
                for kk in 0..w.kc.min(k - p0) {
                    let a = x[i * k + p0 + kk] as i32;
                    for (j, o) in row.iter_mut().enumerate() {
                        let base = (blk * panels + j / NR) * w.kc * NR;
                        *o += a * w.data[base + (kk / 4) * 4 * NR + 4 * (j % NR) + kk % 4] as i32;
                    }
                }
            }
        });
}

/// `out [m, n] = x [m, k] · Wᵀ`, exact in i32.
///
/// # Safety
/// The CPU must have AVX512F and AVX512-VNNI.
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn gemm(x: &[i8], (m, k, n): (usize, usize, usize), w: &Panels, out: &mut [i32]) {
    let quads = k.div_ceil(4);
    let out_ptr = SharedMutI32(out.as_mut_ptr());
    tasks(m, n.div_ceil(NR), MR, MC_MAX).par_iter().with_max_len(1).for_each(|task| {
        let (i0, rows) = (task.first_row, task.rows);
        // This block's activations offset to u8, four to an i32, a row of `quads` after
        // another; the padding past `k` meets zero weights.
        let mut a = vec![0u32; rows * quads];
        for (r, packed) in a.chunks_exact_mut(quads).enumerate() {
            let row = &x[(i0 + r) * k..(i0 + r + 1) * k];
            let mut quads_in = row.chunks_exact(4);
            for (slot, quad) in packed.iter_mut().zip(quads_in.by_ref()) {
                let bytes = [quad[0] as u8, quad[1] as u8, quad[2] as u8, quad[3] as u8];
                *slot = u32::from_le_bytes(bytes) ^ 0x8080_8080;
            }
            let tail = quads_in.remainder();
            if !tail.is_empty() {
                let mut bytes = [0u8; 4];
                for (b, v) in bytes.iter_mut().zip(tail) {
                    *b = *v as u8;
                }
                packed[quads - 1] = u32::from_le_bytes(bytes) ^ 0x8080_8080;
            }
        }
        for (blk, p0) in (0..k).step_by(w.kc).enumerate() {
            let depth = w.kc.min(k - p0).div_ceil(4);
            for panel in task.panels.clone() {
                let b = w.panel(n, blk, panel);
                let cols = NR.min(n - panel * NR);
                for ir in (0..rows).step_by(MR) {
                    let tile_rows = MR.min(rows - ir);
                    // Rows past the end repeat the last one (their results are never stored).
                    let a_rows: [*const u32; MR] = std::array::from_fn(|r| {
                        a[(ir + r.min(tile_rows - 1)) * quads + p0 / 4..].as_ptr()
                    });
                    let tile = Tile {
                        c: out_ptr.at((i0 + ir) * n + panel * NR),
                        ldc: n,
                        rows: tile_rows,
                        cols,
                        first: blk == 0,
                        depth,
                    };
                    // SAFETY: the caller checked the CPU; the tile belongs to this task alone;
                    // each `a` row has `depth` quads from p0 / 4.
                    kernel_8x32(&tile, a_rows, b);
                }
            }
        }
        // The +128 offset, taken back from this task's columns: Σ (a + 128)·w − 128·Σ w.
        let first = task.panels.start * NR;
        let sums = &w.col_sums[first..(task.panels.end * NR).min(n)];
        for r in 0..rows {
            let row = out_ptr.at((i0 + r) * n + first);
            for (j, sum) in sums.iter().enumerate() {
                *row.add(j) -= 128 * sum;
            }
        }
    });
}

/// Where a tile goes and how deep it runs.
struct Tile {
    c: *mut i32,
    ldc: usize,
    rows: usize,
    cols: usize,
    /// First depth block: start from zero rather than from the output.
    first: bool,
    /// Quads of depth in this block.
    depth: usize,
}

#[cfg(target_arch = "x86_64")]
/// C[0..8, 0..32] (+)= A[0..8, quads] · B_panel, 16 accumulators in zmm registers.
#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn kernel_8x32(t: &Tile, a: [*const u32; MR], b: *const i8) {
    use std::arch::x86_64::*;

    let full = t.rows == MR && t.cols == NR;
    // A partial tile goes through an 8×32 buffer so the kernel's loads and stores stay whole.
    let mut buf = [0i32; MR * NR];
    let (c, ldc) = if full {
        (t.c, t.ldc)
    } else {
        (buf.as_mut_ptr(), NR)
    };
    if !full && !t.first {
        for r in 0..t.rows {
            std::ptr::copy_nonoverlapping(t.c.add(r * t.ldc), c.add(r * NR), t.cols);
        }
    }

    let mut acc = [_mm512_setzero_si512(); 2 * MR];
    if !t.first {
        for r in 0..MR {
            acc[2 * r] = _mm512_loadu_si512(c.add(r * ldc).cast());
            acc[2 * r + 1] = _mm512_loadu_si512(c.add(r * ldc + 16).cast());
        }
    }
    for kq in 0..t.depth {
        let b0 = _mm512_loadu_si512(b.add(kq * 4 * NR).cast());
        let b1 = _mm512_loadu_si512(b.add(kq * 4 * NR + 64).cast());
        for r in 0..MR {
            let av = _mm512_set1_epi32(*a[r].add(kq) as i32);
            acc[2 * r] = _mm512_dpbusd_epi32(acc[2 * r], av, b0);
            acc[2 * r + 1] = _mm512_dpbusd_epi32(acc[2 * r + 1], av, b1);
        }
    }
    for r in 0..MR {
        _mm512_storeu_si512(c.add(r * ldc).cast(), acc[2 * r]);
        _mm512_storeu_si512(c.add(r * ldc + 16).cast(), acc[2 * r + 1]);
    }
    if !full {
        for r in 0..t.rows {
            std::ptr::copy_nonoverlapping(c.add(r * NR), t.c.add(r * t.ldc), t.cols);
        }
    }
}

/// A raw i32 output pointer shared by tasks that write disjoint tiles of one buffer.
#[derive(Clone, Copy)]
struct SharedMutI32(*mut i32);
// SAFETY: every task writes only its own rows × columns, and the buffer outlives the loop.
unsafe impl Send for SharedMutI32 {}
unsafe impl Sync for SharedMutI32 {}

impl SharedMutI32 {
    /// # Safety
    /// `offset` must stay inside the buffer.
    unsafe fn at(self, offset: usize) -> *mut i32 {
        self.0.add(offset)
    }
}
