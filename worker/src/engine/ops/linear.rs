//! `y = x Wᵀ + b`, optionally followed by GELU, for the encoder's four projections on CPU.
//!
//! The weights never change, so they are packed once at load into the panel layout a GEMM
//! micro-kernel streams (BLIS's "packed B"), and the bias and activation are applied while the
//! output tile is still in registers. On the 2-core AVX2 (Zen 3) development machine it
//! measured 84–91 GFLOP/s per core against a ~100 GFLOP/s FMA peak, where candle's matmul
//! (the `gemm` crate, which packs both operands on every call and leaves the bias to a
//! separate pass) measured 60–86; end to end the encoder got about 15% faster.
//!
//! Blocking follows BLIS (Van Zee & van de Geijn, "BLIS: A Framework for Rapidly Instantiating
//! BLAS Functionality", TOMS 2015, §3 and Fig. 2): a 6×16 register tile, a `KC × 16` weight
//! panel kept in L1, an `MC × KC` block of activations kept in L2. It departs from BLIS in
//! reading the activations in place rather than packing them (rows are short and contiguous;
//! packing cost more than it saved here), in parallelising over row blocks first (M is the
//! token count, large; N is at most a few thousand) and over column panels only where the
//! rows run short of the pool's threads ([`tasks`]), and in fusing the bias/GELU epilogue.
//!
//! On a CPU with AVX512F the same panels go through an 8×32-tile AVX-512 kernel
//! (`avx512.rs`), bit-identical to the AVX2 one. Without AVX2+FMA the op computes the same
//! result with plain loops; the model code uses candle's matmul there instead (see
//! `layer.rs`).

use super::vector_math::gelu_scalar;
use super::{contiguous_f32, has_avx2_fma, has_avx512_bf16, has_avx512_vnni, has_avx512f, SharedMut};
use candle_core::{bail, CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};
use rayon::prelude::*;
use std::sync::Arc;

#[cfg(target_arch = "x86_64")]
mod avx512;
mod bf16;
mod vnni;

/// Rows and columns of the register tile.
const MR: usize = 6;
const NR: usize = 16;
/// Upper bound on the depth of one packed block (24 KiB of weights per panel, in L1).
const KC_MAX: usize = 384;
/// Upper bound on rows per block of activations, which stays in L2 while every weight panel
/// passes over it (~180 KiB at KC_MAX).
const MC_MAX: usize = 120;

/// Activation applied in the epilogue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    None,
    /// Exact (erf) GELU.
    Gelu,
}

/// What the packed GEMM multiplies; it always accumulates in f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmInputs {
    F32,
    /// Weights and activations rounded to bf16 (see `bf16`); CPUs with AVX512-BF16 only.
    Bf16,
}

impl GemmInputs {
    /// `v` as these inputs hold it: as is, or rounded to bf16 (nearest even).
    fn round(self, v: f32) -> f32 {
        match self {
            GemmInputs::F32 => v,
            GemmInputs::Bf16 => round_bf16(v),
        }
    }

    /// bf16 where the CPU multiplies it natively and clearly faster, else f32. AVX512-BF16
    /// alone does not say which: on AMD Zen 4 the bf16 kernel ran 2.4× as fast as the AVX2
    /// f32 one end to end (bench/results/serving.md), while on an Intel Xeon (Sapphire Rapids
    /// class, no AMX exposed) the AVX-512 f32 kernel runs 1.5× as fast as bf16
    /// (bench/results/cpu_f32_avx512.md), and there bf16 would cost precision and speed. So
    /// the first call times both kernels on an encoder-sized GEMM ([`measure_bf16_speedup`])
    /// and the answer holds for the process.
    pub fn fastest() -> Self {
        static CHOICE: std::sync::OnceLock<GemmInputs> = std::sync::OnceLock::new();
        *CHOICE.get_or_init(|| {
            if !has_avx512_bf16() {
                return Self::F32;
            }
            match measure_bf16_speedup() {
                Ok(speedup) => {
                    let choice = Self::by_speedup(speedup);
                    tracing::info!("bf16 GEMMs run {speedup:.2}x as fast as f32 on this CPU: using {choice:?}");
                    choice
                }
                Err(err) => {
                    tracing::warn!("timing the bf16 GEMM failed ({err}): using f32");
                    Self::F32
                }
            }
        })
    }

    /// bf16 only where it is at least [`BF16_WORTH`] times as fast as f32.
    fn by_speedup(speedup: f64) -> Self {
        if speedup >= BF16_WORTH {
            Self::Bf16
        } else {
            Self::F32
        }
    }
}

/// How much faster the bf16 GEMM must be for `GemmInputs::fastest` to give up f32's
/// precision for it. The two kinds of CPU measured sit far on either side (0.6–0.7× on the
/// Intel Xeon; about 2× expected on Zen 4, whose 512-bit FMAs take two cycles), so a timing
/// disturbed by other work does not flip the choice.
const BF16_WORTH: f64 = 1.3;

/// f32 time over bf16 time of one GEMM the size of a MiniLM feed-forward layer over 128
/// tokens (`[128, 384] · [1536, 384]ᵀ`, ~0.15 GFLOP) on the current pool: the median of 5
/// timings of each, interleaved, after one untimed call of each. Errors on a CPU without
/// AVX512-BF16.
fn measure_bf16_speedup() -> Result<f64> {
    let (m, k, n) = (128, 384, 1536);
    // Any values do: the kernels' speed does not depend on them.
    let values = |len: usize, scale: f32| -> Vec<f32> {
        (0..len).map(|i| ((i * 7919 % 1009) as f32 / 1009.0 - 0.5) * scale).collect()
    };
    let device = candle_core::Device::Cpu;
    let x = Tensor::from_vec(values(m * k, 2.0), (m, k), &device)?;
    let weight = Tensor::from_vec(values(n * k, 0.1), (n, k), &device)?;
    let bias = Tensor::zeros(n, candle_core::DType::F32, &device)?;
    let op = |inputs| -> Result<Linear> {
        Ok(Linear { weight: Arc::new(PackedWeight::new(&weight, inputs)?), activation: Activation::None })
    };
    let (f32_op, bf16_op) = (op(GemmInputs::F32)?, op(GemmInputs::Bf16)?);
    let time = |op: &Linear| -> Result<f64> {
        let started = std::time::Instant::now();
        x.apply_op2_no_bwd(&bias, op)?;
        Ok(started.elapsed().as_secs_f64())
    };
    time(&f32_op)?;
    time(&bf16_op)?;
    let (mut f32_secs, mut bf16_secs) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        f32_secs.push(time(&f32_op)?);
        bf16_secs.push(time(&bf16_op)?);
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    Ok(median(f32_secs) / median(bf16_secs))
}

/// A weight matrix packed once, at load, for one of the micro-kernels.
#[derive(Debug)]
pub struct PackedWeight {
    k: usize,
    n: usize,
    panels: Panels,
}

#[derive(Debug)]
enum Panels {
    /// For each depth block, for each group of 16 output columns, `kc × 16` values
    /// (zero-padded past `n`).
    F32 {
        kc: usize,
        data: Vec<f32>,
    },
    Bf16(bf16::Panels),
}

impl PackedWeight {
    /// Packs a `[out, in]` weight (the checkpoint's `nn.Linear` layout). bf16 inputs need a
    /// CPU with AVX512-BF16.
    pub fn new(weight: &Tensor, inputs: GemmInputs) -> Result<Self> {
        let (n, k) = weight.dims2()?;
        let w = weight
            .to_dtype(candle_core::DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let panels = match inputs {
            GemmInputs::F32 => pack_f32(MatRef::row_major(&w, n, k)?, GemmInputs::F32),
            GemmInputs::Bf16 if has_avx512_bf16() => Panels::Bf16(bf16::Panels::pack(MatRef::row_major(&w, n, k)?)),
            GemmInputs::Bf16 => bail!("this CPU has no AVX512-BF16 for bf16 GEMMs; use f32"),
        };
        Ok(Self { k, n, panels })
    }

    pub fn inputs(&self) -> GemmInputs {
        match self.panels {
            Panels::F32 { .. } => GemmInputs::F32,
            Panels::Bf16(_) => GemmInputs::Bf16,
        }
    }
}

/// Packs the `[n, k]` matrix `b` into f32 panels, its values as `values` holds them, so
/// training packs a transposed view (`Wᵀ`, `Xᵀ`) or rounds while packing, without a copy
/// first. A panel row (`NR` values of one `p`) is contiguous in a transposed view of a
/// row-major matrix: that case copies slices, which vectorises (rounding included); the
/// others gather value by value.
fn pack_f32(b: MatRef<'_>, values: GemmInputs) -> Panels {
    let (n, k) = b.dims();
    let blocks = k.div_ceil(KC_MAX).max(1);
    let kc = k.div_ceil(blocks);
    let panels = n.div_ceil(NR);
    let mut data = super::zeros(blocks * panels * kc * NR);
    data.par_chunks_mut(kc * NR).enumerate().for_each(|(i, chunk)| {
        let (p0, panel) = (i / panels * kc, i % panels);
        let (j0, width) = (panel * NR, NR.min(n - panel * NR));
        for kk in 0..kc.min(k - p0) {
            let out = &mut chunk[kk * NR..kk * NR + width];
            match b.row_stride {
                1 => {
                    let start = (p0 + kk) * b.col_stride + j0;
                    let src = &b.data[start..start + width];
                    match (values, <&mut [f32; NR]>::try_from(&mut *out), <&[f32; NR]>::try_from(src)) {
                        // A whole panel row as an array: moved inline, not by a call to memmove.
                        (GemmInputs::F32, Ok(out), Ok(src)) => *out = *src,
                        (GemmInputs::F32, ..) => out.copy_from_slice(src),
                        (GemmInputs::Bf16, ..) => out.iter_mut().zip(src).for_each(|(o, v)| *o = round_bf16(*v)),
                    }
                }
                _ => out.iter_mut().enumerate().for_each(|(j, o)| *o = values.round(b.at(j0 + j, p0 + kk))),
            }
        }
    });
    Panels::F32 { kc, data }
}

/// One task of a parallel GEMM: `rows` rows from `first_row`, across the column panels
/// `panels`, over the whole depth.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Task {
    first_row: usize,
    rows: usize,
    panels: std::ops::Range<usize>,
}

/// Cuts a GEMM of `m` rows and `panels` column panels into about two tasks for each thread
/// of the current rayon pool, so that a pool of any size gets work (a cut into four row
/// blocks suited two cores, but kept a 12-thread training rank at 4 to 8 busy threads).
/// Rows are cut first, into blocks of at most `mc_max` (a multiple of `mr`), as a block
/// reuses every weight panel across its rows; where the rows run short, the panels are cut
/// too. Each output is still summed by one task over the whole depth in the same order, so
/// no cut changes a result.
fn tasks(m: usize, panels: usize, mr: usize, mc_max: usize) -> Vec<Task> {
    let wanted = 2 * rayon::current_num_threads().max(1);
    let mc = m.div_ceil(wanted).next_multiple_of(mr).clamp(mr, mc_max);
    let groups = wanted.div_ceil(m.div_ceil(mc).max(1)).clamp(1, panels.max(1));
    let per_task = panels.div_ceil(groups).max(1);
    (0..m)
        .step_by(mc)
        .flat_map(|first_row| {
            (0..panels).step_by(per_task).map(move |p| Task {
                first_row,
                rows: mc.min(m - first_row),
                panels: p..(p + per_task).min(panels),
            })
        })
        .collect()
}

/// The f32 weights' panel for one depth block and group of 16 columns.
fn f32_panel(data: &[f32], kc: usize, n: usize, block: usize, panel: usize) -> *const f32 {
    data[(block * n.div_ceil(NR) + panel) * kc * NR..].as_ptr()
}

/// A read-only `[rows, cols]` f32 matrix behind strides, so a transpose is a view rather than
/// a copy (training multiplies by `Wᵀ` and `Xᵀ`).
#[derive(Debug, Clone, Copy)]
pub struct MatRef<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

impl<'a> MatRef<'a> {
    /// `data` as a row-major `[rows, cols]` matrix.
    pub fn row_major(data: &'a [f32], rows: usize, cols: usize) -> Result<Self> {
        if data.len() != rows * cols {
            bail!("{} values for a [{rows}, {cols}] matrix", data.len());
        }
        Ok(Self {
            data,
            rows,
            cols,
            row_stride: cols,
            col_stride: 1,
        })
    }

    /// The transpose, as a view.
    pub fn t(self) -> Self {
        Self {
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
            ..self
        }
    }

    pub fn dims(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// The values behind the view, in storage order.
    pub fn data(&self) -> &'a [f32] {
        self.data
    }

    fn at(&self, i: usize, j: usize) -> f32 {
        self.data[i * self.row_stride + j * self.col_stride]
    }

    /// The values row after row: borrowed when already laid out so, else copied.
    fn to_row_major(self) -> std::borrow::Cow<'a, [f32]> {
        if self.col_stride == 1 && self.row_stride == self.cols {
            return std::borrow::Cow::Borrowed(&self.data[..self.rows * self.cols]);
        }
        let mut out = super::zeros(self.rows * self.cols);
        // Row-major writes, B rows to a task; a transposed read walks the source in B × B
        // blocks to stay in cache.
        const B: usize = 32;
        out.par_chunks_mut(B * self.cols.max(1)).enumerate().for_each(|(block, rows)| {
            let i0 = block * B;
            for j0 in (0..self.cols).step_by(B) {
                for (r, row) in rows.chunks_exact_mut(self.cols).enumerate() {
                    for j in j0..(j0 + B).min(self.cols) {
                        row[j] = self.at(i0 + r, j);
                    }
                }
            }
        });
        std::borrow::Cow::Owned(out)
    }
}

/// `a [m, k] · bᵀ (+ bias)` for `b` `[n, k]` in f32 on the engine's f32 kernel (AVX-512,
/// AVX2 or plain loops): the GEMMs of training's f32 layers on the CPU
/// (`crate::train::precision`), whose operands change every step, so `b` is packed on every
/// call. Each output is summed by one task in a fixed order, so the result does not depend on
/// the thread count.
pub fn gemm_nt_f32(a: MatRef<'_>, b: MatRef<'_>, bias: Option<&[f32]>) -> Result<Vec<f32>> {
    gemm_nt(a, b, bias, GemmInputs::F32, GemmInputs::F32)
}

/// `a [m, k] · bᵀ (+ bias)` for `b` `[n, k]`, both operands rounded to bf16 (nearest even)
/// and the sums in f32: the GEMMs of training's bf16 layers. They run on the bf16 kernel
/// where it is the faster one (`GemmInputs::fastest`); elsewhere (no AVX512-BF16, or an
/// Intel Xeon, where the AVX-512 f32 kernel is faster) the rounded values go through the
/// f32 kernel: the same products (exact in f32), summed in another order.
pub fn gemm_nt_bf16(a: MatRef<'_>, b: MatRef<'_>, bias: Option<&[f32]>) -> Result<Vec<f32>> {
    gemm_nt(a, b, bias, GemmInputs::Bf16, GemmInputs::fastest())
}

/// `a · bᵀ (+ bias)` of the operands as given (`values` F32) or rounded to bf16 (`values`
/// Bf16), on the f32 kernel or, for bf16 values on a CPU with AVX512-BF16, the bf16 one
/// (`kernel`).
fn gemm_nt(
    a: MatRef<'_>,
    b: MatRef<'_>,
    bias: Option<&[f32]>,
    values: GemmInputs,
    kernel: GemmInputs,
) -> Result<Vec<f32>> {
    let ((m, k), (n, kb)) = (a.dims(), b.dims());
    if k != kb {
        bail!("gemm: [{m}, {k}] times the transpose of [{n}, {kb}]");
    }
    let zeros;
    let bias = match bias {
        Some(bias) if bias.len() == n => bias,
        Some(bias) => bail!("gemm: {} bias values for {n} outputs", bias.len()),
        None => {
            zeros = vec![0f32; n];
            &zeros
        }
    };
    let mut out = super::zeros(m * n);
    if m == 0 || n == 0 {
        return Ok(out);
    }
    if k == 0 {
        out.chunks_exact_mut(n)
            .for_each(|row| row.copy_from_slice(bias));
        return Ok(out);
    }
    #[cfg(target_arch = "x86_64")]
    if values == GemmInputs::Bf16 && kernel == GemmInputs::Bf16 && has_avx512_bf16() {
        // SAFETY: the CPU has AVX512-BF16 (checked just above).
        unsafe { bf16::gemm(a, n, &bf16::Panels::pack(b), bias, Activation::None, &mut out) };
        return Ok(out);
    }
    let x = row_major_values(a, values);
    let Panels::F32 { kc, data } = pack_f32(b, values) else {
        unreachable!("pack_f32 packs f32 panels")
    };
    gemm_f32(&x, (m, k, n), (&data, kc), bias, Activation::None, &mut out);
    Ok(out)
}

/// `matrix` row after row, as given (`values` F32: borrowed where already so laid out) or
/// rounded to bf16 (`values` Bf16).
fn row_major_values(matrix: MatRef<'_>, values: GemmInputs) -> std::borrow::Cow<'_, [f32]> {
    let rows = matrix.to_row_major();
    match values {
        GemmInputs::F32 => rows,
        GemmInputs::Bf16 => rows.par_iter().map(|v| values.round(*v)).collect(),
    }
}

/// `v` rounded to the nearest bf16 (ties to even; NaN stays NaN, quiet), as an f32:
/// `bf16::to_bf16` without a branch, so loops of it vectorise.
pub fn round_bf16(v: f32) -> f32 {
    let bits = v.to_bits();
    let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) & 0xFFFF_0000;
    let quiet_nan = (bits | 0x0040_0000) & 0xFFFF_0000;
    f32::from_bits(if v.is_nan() { quiet_nan } else { rounded })
}

/// `a [m, k] · bᵀ` for `b` `[n, k]`, both row-major int8, exact in i32: the GEMM of
/// training's int8 layers, on AVX512-VNNI (`vnni`) where the CPU has it, else on the f32
/// kernel ([`gemm_i8_on_f32`]).
pub fn gemm_nt_i8(a: &[i8], b: &[i8], (m, k, n): (usize, usize, usize)) -> Result<Vec<i32>> {
    if a.len() != m * k || b.len() != n * k {
        bail!(
            "gemm: {} and {} values for [{m}, {k}] times the transpose of [{n}, {k}]",
            a.len(),
            b.len()
        );
    }
    let mut out = super::zeros(m * n);
    if m == 0 || n == 0 || k == 0 {
        return Ok(out);
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx512_vnni() {
        // SAFETY: the CPU has AVX512F and AVX512-VNNI (checked just above).
        unsafe { vnni::gemm(a, (m, k, n), &vnni::Panels::new(b, n, k), &mut out) };
        return Ok(out);
    }
    gemm_i8_on_f32(a, b, (m, k, n), &mut out)?;
    Ok(out)
}

/// Depth of one f32 pass of [`gemm_i8_on_f32`]: a product of two int8 values is at most 2¹⁴
/// in magnitude, so every partial sum of 1024 of them is an integer of at most 2²⁴, and f32
/// holds each of those exactly, whatever the order of the additions.
const I8_DEPTH_PER_F32_PASS: usize = 1024;

/// `out = a · bᵀ` (int8, exact in i32) on the f32 kernel, for CPUs without AVX512-VNNI: the
/// values converted to f32, the depth taken [`I8_DEPTH_PER_F32_PASS`] at a time (each pass
/// exact in f32) and the passes added in i32: 0.7–1.1× the f32 GEMM's speed on the same
/// shapes, where plain loops ran at 0.01–0.02× (bench/results/qsync.md); as `gemm_nt_bf16`
/// does without AVX512-BF16.
fn gemm_i8_on_f32(a: &[i8], b: &[i8], (m, k, n): (usize, usize, usize), out: &mut [i32]) -> Result<()> {
    let slice = |values: &[i8], p0: usize, depth: usize| -> Vec<f32> {
        values.par_chunks_exact(k).flat_map_iter(|row| row[p0..p0 + depth].iter().map(|v| *v as f32)).collect()
    };
    for p0 in (0..k).step_by(I8_DEPTH_PER_F32_PASS) {
        let depth = I8_DEPTH_PER_F32_PASS.min(k - p0);
        let (x, w) = (slice(a, p0, depth), slice(b, p0, depth));
        let part = gemm_nt_f32(MatRef::row_major(&x, m, depth)?, MatRef::row_major(&w, n, depth)?, None)?;
        out.par_iter_mut().zip(&part).for_each(|(o, p)| *o += *p as i32);
    }
    Ok(())
}

/// `x [M, K] → x Wᵀ + bias [M, N]`, then the activation. Inputs: `x`, `bias [N]`.
#[derive(Debug, Clone)]
pub struct Linear {
    pub weight: Arc<PackedWeight>,
    pub activation: Activation,
}

impl CustomOp2 for Linear {
    fn name(&self) -> &'static str {
        "linear"
    }

    fn cpu_fwd(
        &self,
        x_s: &CpuStorage,
        x_l: &Layout,
        b_s: &CpuStorage,
        b_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let name = self.name();
        let w = &*self.weight;
        let (m, k) = x_l.shape().dims2()?;
        if k != w.k {
            bail!("{name}: input has {k} columns, the weight expects {}", w.k);
        }
        let x = contiguous_f32(name, "input", x_s, x_l)?;
        let bias = contiguous_f32(name, "bias", b_s, b_l)?;
        if bias.len() != w.n {
            bail!("{name}: bias has {} values for {} outputs", bias.len(), w.n);
        }
        let mut out = super::zeros(m * w.n);
        if m == 0 || w.n == 0 {
            return Ok((CpuStorage::F32(out), Shape::from((m, w.n))));
        }
        match &w.panels {
            Panels::F32 { kc, data } => gemm_f32(x, (m, k, w.n), (data, *kc), bias, self.activation, &mut out),
            // SAFETY: bf16 panels are only packed on a CPU with AVX512-BF16.
            #[cfg(target_arch = "x86_64")]
            Panels::Bf16(panels) => unsafe {
                bf16::gemm(MatRef::row_major(x, m, k)?, w.n, panels, bias, self.activation, &mut out)
            },
            #[cfg(not(target_arch = "x86_64"))]
            Panels::Bf16(_) => unreachable!("bf16 panels need AVX512-BF16"),
        }
        Ok((CpuStorage::F32(out), Shape::from((m, w.n))))
    }
}

/// The f32 GEMM on the widest kernel the CPU has: AVX-512, AVX2 (the two bit-identical), or
/// plain loops.
fn gemm_f32(
    x: &[f32],
    shape: (usize, usize, usize),
    weights: (&[f32], usize),
    bias: &[f32],
    act: Activation,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if has_avx512f() {
        // SAFETY: AVX512F and AVX2+FMA detected just above.
        unsafe { avx512::gemm(x, shape, weights, bias, act, out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        gemm_avx2(x, shape, weights, bias, act, out);
        return;
    }
    gemm_scalar(x, shape, weights, bias, act, out);
}

/// Reference path: the same packed weights, plain loops.
fn gemm_scalar(
    x: &[f32],
    (_, k, n): (usize, usize, usize),
    (data, kc): (&[f32], usize),
    bias: &[f32],
    act: Activation,
    out: &mut [f32],
) {
    out.par_chunks_mut(n).enumerate().for_each(|(i, row)| {
        row.copy_from_slice(bias);
        for (blk, p0) in (0..k).step_by(kc).enumerate() {
            for kk in 0..kc.min(k - p0) {
                let a = x[i * k + p0 + kk];
                for (j, o) in row.iter_mut().enumerate() {
                    let b = f32_panel(data, kc, n, blk, j / NR);
                    // SAFETY: panel pointers stay inside `data` for kk < kc, j % NR < NR.
                    *o += a * unsafe { *b.add(kk * NR + j % NR) };
                }
            }
        }
        if act == Activation::Gelu {
            row.iter_mut().for_each(|v| *v = gelu_scalar(*v));
        }
    });
}

#[cfg(target_arch = "x86_64")]
fn gemm_avx2(
    x: &[f32],
    shape: (usize, usize, usize),
    weights: (&[f32], usize),
    bias: &[f32],
    act: Activation,
    out: &mut [f32],
) {
    drive_f32::<MR>(x, shape, weights, bias, act, out, (1, MC_MAX), |tile, a, b, bias, dst| {
        // SAFETY: AVX2+FMA detected by the caller; `drive_f32`'s tiles are as it says.
        unsafe { kernel_6x16(tile, a, b, bias, dst) }
    });
}

/// Runs an f32 micro-kernel over weights packed by `pack_f32` (`data`, depth blocks of
/// `kc`): the GEMM cut into tasks ([`tasks`]) over groups of `group` panels (one tile's
/// columns, `group × NR`) and `mc_max` rows, each task over its depth blocks, groups and
/// rows, `MR` at a time. `tile` gets the depth block's arguments, the tile's rows of
/// activations (read in place, each `depth` values from the block's start; rows past the
/// end repeat the last one, whose results are never stored), the group's first panel (the
/// next follows `kc × NR` values on), the group's bias and where the tile goes, which
/// belongs to this task alone.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn drive_f32<const MR: usize>(
    x: &[f32],
    (m, k, n): (usize, usize, usize),
    (data, kc): (&[f32], usize),
    bias: &[f32],
    act: Activation,
    out: &mut [f32],
    (group, mc_max): (usize, usize),
    tile: impl Fn(&TileArgs, [*const f32; MR], *const f32, &[f32], Dst) + Sync,
) {
    let out_ptr = SharedMut(out.as_mut_ptr());
    let block_count = k.div_ceil(kc);
    tasks(m, n.div_ceil(NR).div_ceil(group), MR, mc_max).par_iter().with_max_len(1).for_each(|task| {
        let (i0, rows) = (task.first_row, task.rows);
        for (blk, p0) in (0..k).step_by(kc).enumerate() {
            let args = TileArgs {
                first: blk == 0,
                last: blk + 1 == block_count,
                act,
                depth: kc.min(k - p0),
            };
            for panel in task.panels.clone().map(|g| g * group) {
                let b = f32_panel(data, kc, n, blk, panel);
                let cols = (group * NR).min(n - panel * NR);
                for ir in (0..rows).step_by(MR) {
                    let tile_rows = MR.min(rows - ir);
                    let a: [*const f32; MR] = std::array::from_fn(|r| {
                        x[(i0 + ir + r.min(tile_rows - 1)) * k + p0..].as_ptr()
                    });
                    let dst = Dst {
                        // SAFETY: the tile lies inside `out`.
                        c: unsafe { out_ptr.at((i0 + ir) * n + panel * NR) },
                        ldc: n,
                        rows: tile_rows,
                        cols,
                    };
                    tile(&args, a, b, &bias[panel * NR..], dst);
                }
            }
        }
    });
}

/// Applies GELU in place to a stored tile: `rows` rows of `width` (a multiple of 8) at `c`,
/// row stride `ldc`.
///
/// # Safety
/// AVX2+FMA; the tile is valid, writable memory.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gelu_stored_tile(c: *mut f32, ldc: usize, rows: usize, width: usize) {
    use super::vector_math::avx2::gelu;
    use std::arch::x86_64::*;
    for r in 0..rows {
        for q in (0..width).step_by(8) {
            let v = c.add(r * ldc + q);
            _mm256_storeu_ps(v, gelu(_mm256_loadu_ps(v)));
        }
    }
}

struct TileArgs {
    /// First depth block: start from the bias rather than from the output.
    first: bool,
    /// Last depth block: apply the activation before storing.
    last: bool,
    act: Activation,
    depth: usize,
}

/// Where a tile goes: `rows × cols` (at most 6 × 16) at `c`, row stride `ldc`.
struct Dst {
    c: *mut f32,
    ldc: usize,
    rows: usize,
    cols: usize,
}

impl Dst {
    /// Copies the tile into `buf`, a whole tile with rows of `nr` (a partial tile's kernel
    /// accumulates there).
    ///
    /// # Safety
    /// `buf` holds at least `rows × nr` floats and `c` the tile.
    unsafe fn copy_to(&self, buf: *mut f32, nr: usize) {
        for r in 0..self.rows {
            std::ptr::copy_nonoverlapping(self.c.add(r * self.ldc), buf.add(r * nr), self.cols);
        }
    }

    /// Copies the tile's part of `buf` back (the inverse of `copy_to`).
    ///
    /// # Safety
    /// As `copy_to`.
    unsafe fn copy_from(&self, buf: *const f32, nr: usize) {
        for r in 0..self.rows {
            std::ptr::copy_nonoverlapping(buf.add(r * nr), self.c.add(r * self.ldc), self.cols);
        }
    }
}

/// C[0..6, 0..16] (+)= A[0..6, 0..depth] · B_panel, 12 accumulators in registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn kernel_6x16(t: &TileArgs, a: [*const f32; MR], b: *const f32, bias: &[f32], dst: Dst) {
    use super::vector_math::avx2::gelu;
    use std::arch::x86_64::*;

    let full = dst.rows == MR && dst.cols == NR;
    // A partial tile goes through a 6×16 buffer so the kernel's loads and stores stay whole.
    let mut buf = std::mem::MaybeUninit::<[f32; MR * NR]>::uninit();
    let (c, ldc) = if full {
        (dst.c, dst.ldc)
    } else {
        (buf.as_mut_ptr().cast::<f32>(), NR)
    };

    let mut acc = [_mm256_setzero_ps(); 2 * MR];
    if t.first {
        let (b0, b1) = if dst.cols == NR {
            (
                _mm256_loadu_ps(bias.as_ptr()),
                _mm256_loadu_ps(bias.as_ptr().add(8)),
            )
        } else {
            let mut bias_tile = [0f32; NR];
            bias_tile[..dst.cols].copy_from_slice(&bias[..dst.cols]);
            (
                _mm256_loadu_ps(bias_tile.as_ptr()),
                _mm256_loadu_ps(bias_tile.as_ptr().add(8)),
            )
        };
        for r in 0..MR {
            acc[2 * r] = b0;
            acc[2 * r + 1] = b1;
        }
    } else {
        if !full {
            // Rows and columns past the tile's edge are never stored back; zero them so no
            // uninitialised value is read.
            std::ptr::write_bytes(c, 0, MR * NR);
            dst.copy_to(c, NR);
        }
        for r in 0..MR {
            acc[2 * r] = _mm256_loadu_ps(c.add(r * ldc));
            acc[2 * r + 1] = _mm256_loadu_ps(c.add(r * ldc + 8));
        }
    }

    for kk in 0..t.depth {
        let b0 = _mm256_loadu_ps(b.add(kk * NR));
        let b1 = _mm256_loadu_ps(b.add(kk * NR + 8));
        for r in 0..MR {
            let av = _mm256_broadcast_ss(&*a[r].add(kk));
            acc[2 * r] = _mm256_fmadd_ps(av, b0, acc[2 * r]);
            acc[2 * r + 1] = _mm256_fmadd_ps(av, b1, acc[2 * r + 1]);
        }
    }

    if t.last && t.act == Activation::Gelu {
        for v in acc.iter_mut() {
            *v = gelu(*v);
        }
    }
    for r in 0..MR {
        _mm256_storeu_ps(c.add(r * ldc), acc[2 * r]);
        _mm256_storeu_ps(c.add(r * ldc + 8), acc[2 * r + 1]);
    }
    if !full {
        dst.copy_from(c, NR);
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_inputs::{max_abs_diff, Rng};
    use super::*;

    fn reference(
        x: &[f32],
        w: &[f32],
        b: &[f32],
        m: usize,
        k: usize,
        n: usize,
        gelu: bool,
    ) -> Vec<f64> {
        let mut out = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = b[j] as f64;
                for p in 0..k {
                    s += x[i * k + p] as f64 * w[j * k + p] as f64;
                }
                if gelu {
                    s = gelu_scalar(s as f32) as f64;
                }
                out[i * n + j] = s;
            }
        }
        out
    }

    /// The inputs this CPU can multiply in, each with what it does to an input value.
    fn available_inputs() -> Vec<(GemmInputs, fn(f32) -> f32)> {
        let mut inputs: Vec<(GemmInputs, fn(f32) -> f32)> = vec![(GemmInputs::F32, |v| v)];
        if has_avx512_bf16() {
            inputs.push((GemmInputs::Bf16, round_bf16));
        } else {
            eprintln!("no AVX512-BF16 on this CPU: the bf16 kernel is not tested");
        }
        inputs
    }

    #[test]
    fn bf16_is_chosen_only_where_it_is_clearly_faster() {
        assert_eq!(GemmInputs::by_speedup(1.0), GemmInputs::F32);
        assert_eq!(GemmInputs::by_speedup(1.29), GemmInputs::F32);
        assert_eq!(GemmInputs::by_speedup(BF16_WORTH), GemmInputs::Bf16);
        assert_eq!(GemmInputs::by_speedup(2.4), GemmInputs::Bf16);
        if !has_avx512_bf16() {
            assert_eq!(GemmInputs::fastest(), GemmInputs::F32);
            assert!(measure_bf16_speedup().is_err(), "no bf16 kernel to time without AVX512-BF16");
            return;
        }
        let speedup = measure_bf16_speedup().unwrap();
        eprintln!("bf16 GEMM speed-up on this CPU: {speedup:.2}x");
        assert!(speedup.is_finite() && speedup > 0.1 && speedup < 20.0, "{speedup}");
    }

    #[test]
    fn matches_a_naive_matmul_on_ragged_shapes() {
        let mut rng = Rng::new(41);
        // Rows not a multiple of the tile's, columns not a multiple of 16 or 32, odd depths,
        // depth split into blocks with a remainder, and the model's real shapes.
        for (m, k, n) in [
            (1, 1, 1),
            (7, 300, 20),
            (9, 301, 45),
            (13, 600, 33),
            (17, 769, 70),
            (130, 384, 1152),
            (64, 1536, 384),
        ] {
            let x = rng.tensor(&[m, k], 1.0);
            let w = rng.tensor(&[n, k], 0.1);
            let b = rng.tensor(&[n], 0.5);
            let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            for (inputs, round) in available_inputs() {
                let rounded = |t: &Tensor| flat(t).into_iter().map(round).collect::<Vec<_>>();
                for act in [Activation::None, Activation::Gelu] {
                    let op = Linear {
                        weight: Arc::new(PackedWeight::new(&w, inputs).unwrap()),
                        activation: act,
                    };
                    let got = x.apply_op2_no_bwd(&b, &op).unwrap();
                    assert_eq!(got.dims(), &[m, n]);
                    let gelu = act == Activation::Gelu;
                    let want = reference(&rounded(&x), &rounded(&w), &flat(&b), m, k, n, gelu);
                    let diff = max_abs_diff(&flat(&got), &want);
                    assert!(
                        diff < 1e-4,
                        "{inputs:?} [{m}, {k}] × [{k}, {n}] {act:?}: max diff {diff}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_portable_path_agrees_with_the_kernel() {
        let mut rng = Rng::new(42);
        let (m, k, n) = (11, 520, 40);
        let x = rng.tensor(&[m, k], 1.0);
        let w = PackedWeight::new(&rng.tensor(&[n, k], 0.1), GemmInputs::F32).unwrap();
        let b = rng.tensor(&[n], 0.5).to_vec1::<f32>().unwrap();
        let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let mut scalar = vec![0f32; m * n];
        let Panels::F32 { kc, data } = &w.panels else {
            unreachable!("packed as f32")
        };
        gemm_scalar(
            &xs,
            (m, k, n),
            (data, *kc),
            &b,
            Activation::Gelu,
            &mut scalar,
        );
        let op = Linear {
            weight: Arc::new(w),
            activation: Activation::Gelu,
        };
        let bias = Tensor::new(b.as_slice(), &candle_core::Device::Cpu).unwrap();
        let fast = x
            .apply_op2_no_bwd(&bias, &op)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let want: Vec<f64> = scalar.iter().map(|v| *v as f64).collect();
        assert!(max_abs_diff(&fast, &want) < 1e-4);
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_avx512_kernel_is_bit_identical_to_the_avx2_kernel() {
        if !has_avx512f() {
            eprintln!("no AVX512F on this CPU: the AVX-512 f32 kernel is not tested");
            return;
        }
        let mut rng = Rng::new(43);
        // Odd panel counts (a last tile 16 or fewer columns wide), partial tiles in both
        // directions, several depth blocks (partial tiles then accumulate in a buffer), and
        // the model's shapes.
        for (m, k, n) in [(1, 1, 1), (9, 301, 45), (13, 769, 70), (17, 600, 33), (130, 384, 1536), (64, 1536, 384)] {
            let xs = rng.tensor(&[m, k], 1.0).flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let w = PackedWeight::new(&rng.tensor(&[n, k], 0.1), GemmInputs::F32).unwrap();
            let b = rng.tensor(&[n], 0.5).to_vec1::<f32>().unwrap();
            let Panels::F32 { kc, data } = &w.panels else {
                unreachable!("packed as f32")
            };
            for act in [Activation::None, Activation::Gelu] {
                let (mut avx2, mut avx512) = (vec![0f32; m * n], vec![0f32; m * n]);
                gemm_avx2(&xs, (m, k, n), (data, *kc), &b, act, &mut avx2);
                // SAFETY: AVX512F (and AVX2+FMA) checked above.
                unsafe { avx512::gemm(&xs, (m, k, n), (data, *kc), &b, act, &mut avx512) };
                let same = avx2.iter().zip(&avx512).all(|(p, q)| p.to_bits() == q.to_bits());
                assert!(same, "[{m}, {k}] × [{k}, {n}] {act:?}: the kernels differ");
            }
        }
    }

    /// `Σ_p a[i, p] · b[j, p]` in i32, the plainest way.
    fn i32_reference(a: &[i8], b: &[i8], (m, k, n): (usize, usize, usize)) -> Vec<i32> {
        let mut out = vec![0i32; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k)
                    .map(|p| a[i * k + p] as i32 * b[j * k + p] as i32)
                    .sum();
            }
        }
        out
    }

    #[test]
    fn int8_gemm_is_bit_exact_against_an_i32_gemm() {
        let mut rng = Rng::new(43);
        let mut bytes = |len: usize| -> Vec<i8> {
            (0..len)
                .map(|_| (rng.next_u32() % 255) as i32 - 127)
                .map(|v| v as i8)
                .collect()
        };
        if !has_avx512_vnni() {
            eprintln!("no AVX512-VNNI on this CPU: the int8 GEMM runs on the f32 kernel alone");
        }
        // Ragged tiles, depths that are not a multiple of 4 or split into blocks with a
        // remainder, the extremes ±127 everywhere, and MiniLM's shapes at a training batch.
        for (m, k, n) in [
            (1, 1, 1),
            (7, 3, 20),
            (9, 301, 45),
            (13, 770, 33),
            (17, 1537, 70),
            (130, 384, 1536),
            (64, 1536, 384),
        ] {
            let (a, b) = (bytes(m * k), bytes(n * k));
            let want = i32_reference(&a, &b, (m, k, n));
            assert_eq!(
                gemm_nt_i8(&a, &b, (m, k, n)).unwrap(),
                want,
                "[{m}, {k}, {n}]"
            );
            let mut on_f32 = vec![0i32; m * n];
            gemm_i8_on_f32(&a, &b, (m, k, n), &mut on_f32).unwrap();
            assert_eq!(on_f32, want, "on the f32 kernel [{m}, {k}, {n}]");
            let mut packed = vec![0i32; m * n];
            vnni::gemm_scalar(&a, (m, k, n), &vnni::Panels::new(&b, n, k), &mut packed);
            assert_eq!(packed, want, "VNNI panels [{m}, {k}, {n}]");
        }
        // The extremes: past 1024 of them, sums of ±2¹⁴ leave the integers f32 holds exactly,
        // so one f32 pass over the whole depth would round.
        let (m, k, n) = (9, 2500, 40);
        for (x, w) in [(127i8, 127i8), (-127, 127), (-128, -128), (-128, 127)] {
            let (a, b) = (vec![x; m * k], vec![w; n * k]);
            let want = x as i32 * w as i32 * k as i32;
            assert!(gemm_nt_i8(&a, &b, (m, k, n)).unwrap().iter().all(|v| *v == want), "{x} · {w}");
            let mut on_f32 = vec![0i32; m * n];
            gemm_i8_on_f32(&a, &b, (m, k, n), &mut on_f32).unwrap();
            assert!(on_f32.iter().all(|v| *v == want), "on the f32 kernel: {x} · {w}");
        }
        assert!(gemm_nt_i8(&[1, 2], &[1], (1, 2, 1)).is_err());
    }

    /// The training GEMMs (`gemm_nt_f32`, and `gemm_nt_bf16` on each kernel) against an f64
    /// reference on the values they multiply, with transposed views for operands; the f32 one
    /// gives the same bits on any thread pool.
    #[test]
    fn nt_gemms_multiply_transposed_views() {
        let mut rng = Rng::new(44);
        let mut cases: Vec<(GemmInputs, GemmInputs, fn(f32) -> f32)> = vec![(GemmInputs::F32, GemmInputs::F32, |v| v)];
        // bf16 values on both kernels: the bf16 one and the f32 one on rounded copies.
        cases.extend(available_inputs().into_iter().map(|(kernel, _)| (GemmInputs::Bf16, kernel, round_bf16 as fn(f32) -> f32)));
        for (m, k, n) in [(1, 1, 1), (9, 301, 45), (70, 384, 130), (33, 1100, 17)] {
            let a = rng.tensor(&[m, k], 1.0).flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let b = rng.tensor(&[k, n], 0.1).flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let bias: Vec<f32> = (0..n).map(|j| j as f32 * 0.01).collect();
            // `b` is stored [k, n]: its transpose view is the [n, k] operand.
            let b_t = MatRef::row_major(&b, k, n).unwrap().t();
            let a_m = MatRef::row_major(&a, m, k).unwrap();
            for (values, kernel, round) in &cases {
                let mut want = vec![0f64; m * n];
                for i in 0..m {
                    for j in 0..n {
                        want[i * n + j] = bias[j] as f64
                            + (0..k).map(|p| round(a[i * k + p]) as f64 * round(b[p * n + j]) as f64).sum::<f64>();
                    }
                }
                let got = gemm_nt(a_m, b_t, Some(&bias), *values, *kernel).unwrap();
                let diff = max_abs_diff(&got, &want);
                assert!(diff < 1e-4, "{values:?} on the {kernel:?} kernel, [{m}, {k}, {n}]: max diff {diff}");
                // And with the left operand a transposed view too: (aᵀ)ᵀ = a.
                let a_tt = a_m.t().to_row_major().into_owned();
                let again = MatRef::row_major(&a_tt, k, m).unwrap().t();
                assert_eq!(gemm_nt(again, b_t, Some(&bias), *values, *kernel).unwrap(), got);
            }
            let f32_on = |threads| in_pool(threads, || gemm_nt_f32(a_m, b_t, Some(&bias)).unwrap());
            assert_eq!(f32_on(1), f32_on(3), "[{m}, {k}, {n}] on 1 and 3 threads");
        }
    }

    fn in_pool<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
        rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap().install(f)
    }

    #[test]
    fn tasks_cover_every_output_once_and_feed_every_thread() {
        let (mr, mc_max) = (8, 128);
        for threads in [1, 2, 3, 12, 16] {
            for m in [1, 5, 8, 100, 300, 2048, 5000] {
                for panels in [1, 3, 24, 96] {
                    let tasks = in_pool(threads, || tasks(m, panels, mr, mc_max));
                    let mut covered = vec![0u8; m * panels];
                    for t in &tasks {
                        assert!(t.rows <= mc_max && !t.panels.is_empty(), "{t:?}");
                        assert!(t.rows % mr == 0 || t.first_row + t.rows == m, "a ragged block ends the rows: {t:?}");
                        for row in t.first_row..t.first_row + t.rows {
                            for panel in t.panels.clone() {
                                covered[row * panels + panel] += 1;
                            }
                        }
                    }
                    assert!(covered.iter().all(|c| *c == 1), "{threads} threads, m {m}, {panels} panels: {tasks:?}");
                    // Every thread gets work wherever the tiles allow it.
                    let tiles = m.div_ceil(mr) * panels;
                    assert!(tasks.len() >= threads.min(tiles), "{threads} threads, m {m}, {panels} panels: {} tasks", tasks.len());
                }
            }
        }
    }

    #[test]
    fn results_do_not_depend_on_the_number_of_threads() {
        let mut rng = Rng::new(45);
        // A few rows (the panels are cut too) and many (only the rows are).
        for (m, k, n) in [(9, 301, 150), (300, 384, 96)] {
            let x = rng.tensor(&[m, k], 1.0);
            let w = rng.tensor(&[n, k], 0.1);
            let b = rng.tensor(&[n], 0.5);
            let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let ws = w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let quantised = |v: &[f32]| -> Vec<i8> { v.iter().map(|v| (v * 100.0).round().clamp(-127.0, 127.0) as i8).collect() };
            let (xq, wq) = (quantised(&xs), quantised(&ws));
            let run = |threads: usize| {
                in_pool(threads, || {
                    let linear: Vec<Vec<f32>> = available_inputs()
                        .into_iter()
                        .map(|(inputs, _)| {
                            let op = Linear { weight: Arc::new(PackedWeight::new(&w, inputs).unwrap()), activation: Activation::Gelu };
                            x.apply_op2_no_bwd(&b, &op).unwrap().flatten_all().unwrap().to_vec1().unwrap()
                        })
                        .collect();
                    let a = MatRef::row_major(&xs, m, k).unwrap();
                    let bf16 = gemm_nt_bf16(a, MatRef::row_major(&ws, n, k).unwrap(), None).unwrap();
                    let transposed = MatRef::row_major(&xs, m, k).unwrap().t().to_row_major().into_owned();
                    (linear, bf16, gemm_nt_i8(&xq, &wq, (m, k, n)).unwrap(), transposed)
                })
            };
            let one = run(1);
            for threads in [2, 7] {
                assert!(run(threads) == one, "[{m}, {k}, {n}] on {threads} threads differs from one thread");
            }
        }
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        let ulp = 2f32.powi(-7);
        assert_eq!(
            bf16::to_bf16(1.0 + ulp / 2.0),
            bf16::to_bf16(1.0),
            "tie to even, down"
        );
        let odd = 1.0 + ulp;
        assert_eq!(
            bf16::from_bf16(bf16::to_bf16(odd + ulp / 2.0)),
            1.0 + 2.0 * ulp,
            "tie to even, up"
        );
        assert_eq!(bf16::from_bf16(bf16::to_bf16(1.0 + ulp * 0.6)), odd);
        assert!(bf16::from_bf16(bf16::to_bf16(f32::NAN)).is_nan());
        assert_eq!(bf16::from_bf16(bf16::to_bf16(f32::INFINITY)), f32::INFINITY);
        // The branch-free rounding gives to_bf16's bits on a million patterns spread over
        // all of f32 (NaNs, infinities and subnormals among them) and on every exact tie.
        let patterns = (0..1u32 << 20).map(|i| i.wrapping_mul(0x9E37_79B1)).chain((0..1 << 16).map(|i| 0x3F80_8000 | i << 16));
        for bits in patterns {
            let v = f32::from_bits(bits);
            assert_eq!(round_bf16(v).to_bits(), bf16::from_bf16(bf16::to_bf16(v)).to_bits(), "{bits:#x}");
        }
    }
}
