//! The trainable linear layer `y = x Wᵀ + b` at f32, bf16 or int8, as candle custom ops with
//! a backward, so it composes with candle's autograd (`Tensor::backward`).
//!
//! - f32: forward `x·Wᵀ`, backward `dX = dY·W` and `dW = dYᵀ·x`, on the engine's f32 GEMM
//!   (`engine::ops::gemm_nt_f32`, AVX-512 or AVX2), which ran the training shapes' forward
//!   1.3–2.0× and backward up to 1.4× as fast as candle's matmul and autograd
//!   (bench/results/cpu_f32_avx512.md). On a CPU without
//!   AVX2 and FMA, and on other devices, candle's matmul and its autograd.
//! - bf16: the same products of `bf16(x)`, `bf16(W)`, `bf16(dY)`, all summed in f32, on the
//!   engine's bf16 GEMM (`engine::ops::gemm_nt_bf16`: the AVX512-BF16 kernel, or the AVX-512
//!   f32 one on the rounded values where that is faster): PyTorch AMP's recipe.
//! - int8 (QSync's `LpTorch` linear): x and W quantised per tensor (`s = absmax/127`, round
//!   half to even), an exact i32 GEMM (`engine::ops::gemm_nt_i8`: AVX512-VNNI, or the f32
//!   kernel in exact passes without it), the sums dequantised to f32
//!   (`acc · s_x · s_w + b`). The backward runs at 16 bits from the saved
//!   quantised input, as QSync's does at fp16: `dW = s_x · bf16(dY)ᵀ·q_x` (q_x is exact in
//!   bf16) and `dX = bf16(dY)·bf16(W)`. candle keeps the f32 `x` alive in its graph anyway, so
//!   unlike QSync this saves no memory; the numerics are QSync's.
//!
//! The bias gradient is `Σ_rows dY` in f32 at every precision. On a CUDA device (a `cuda`
//! build) the same numerics run on cuBLAS and cuBLASLt (`cuda.rs`), which also gives f16;
//! on the CPU f16 is refused.

use std::sync::OnceLock;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::Precision;
use crate::engine::ops::{gemm_nt_bf16, gemm_nt_f32, gemm_nt_i8, has_avx2_fma, zeros, GemmInputs, MatRef};

/// `x [.., k] Wᵀ + b` for `W` `[n, k]`, `b` `[n]`, at `precision`; f32 in and out. On the
/// CPU the op takes `x` with its leading dimensions as they are: a reshape to `[rows, k]`
/// and back would be two more graph nodes, each a zeroed gradient and an add in candle's
/// backward.
pub fn linear(x: &Tensor, weight: &Tensor, bias: &Tensor, precision: Precision) -> Result<Tensor> {
    let (n, k) = weight.dims2()?;
    let mut dims = x.dims().to_vec();
    if dims.last() != Some(&k) {
        bail!("linear: input {:?} does not end in the weight's {k} inputs", x.dims());
    }
    let on_cpu = x.device().is_cpu();
    let rows = || x.reshape((x.elem_count() / k.max(1), k));
    *dims.last_mut().expect("checked above") = n;
    match precision {
        Precision::F32 if on_cpu && has_avx2_fma() => cpu_op(x, weight, bias, GemmLinear(GemmInputs::F32)),
        Precision::F32 => rows()?.matmul(&weight.t()?)?.broadcast_add(bias)?.reshape(dims),
        #[cfg(feature = "cuda")]
        _ if x.device().is_cuda() => super::cuda::linear(&rows()?, weight, bias, precision)?.reshape(dims),
        _ if !on_cpu => {
            bail!("linear: {precision} runs on the CPU or a CUDA device; use f32 on {:?}", x.device().location())
        }
        Precision::F16 => bail!("linear: f16 is not implemented by the training operators; use bf16, int8 or f32"),
        Precision::Bf16 => cpu_op(x, weight, bias, GemmLinear(GemmInputs::Bf16)),
        Precision::Int8 => cpu_op(x, weight, bias, Int8Linear::default()),
    }
}

/// `op` on `(x, weight, bias)`, made contiguous.
fn cpu_op(x: &Tensor, weight: &Tensor, bias: &Tensor, op: impl CustomOp3 + Send + Sync + 'static) -> Result<Tensor> {
    x.contiguous()?.apply_op3(&weight.contiguous()?, &bias.contiguous()?, op)
}

/// The data of a contiguous f32 CPU tensor as a matrix, its last dimension against all the
/// others: `(data, rows, columns)`.
fn matrix<'a>(op: &str, what: &str, s: &'a CpuStorage, l: &Layout) -> Result<(&'a [f32], usize, usize)> {
    let Some(&cols) = l.dims().last() else { bail!("{op}: {what} must have at least one dimension") };
    let rows = l.shape().elem_count() / cols.max(1);
    let data = match s {
        CpuStorage::F32(data) => data.as_slice(),
        other => bail!("{op}: {what} must be f32, got {:?}", other.dtype()),
    };
    match l.contiguous_offsets() {
        Some((start, end)) => Ok((&data[start..end], rows, cols)),
        None => bail!("{op}: {what} must be contiguous"),
    }
}

/// `x`'s dimensions with the last one `n`: the layer's output shape.
fn output_shape(x: &Layout, n: usize) -> Shape {
    let mut dims = x.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = n;
    }
    Shape::from(dims)
}

/// `(x [m, k], W [n, k], b [n])` checked against each other.
fn operands<'a>(
    op: &str,
    (x_s, x_l): (&'a CpuStorage, &Layout),
    (w_s, w_l): (&'a CpuStorage, &Layout),
    (b_s, b_l): (&'a CpuStorage, &Layout),
) -> Result<(MatRef<'a>, MatRef<'a>, &'a [f32])> {
    let (x, m, k) = matrix(op, "input", x_s, x_l)?;
    let (w, n, kw) = matrix(op, "weight", w_s, w_l)?;
    let bias = match (b_s, b_l.contiguous_offsets()) {
        (CpuStorage::F32(data), Some((start, end))) if b_l.dims().len() == 1 => &data[start..end],
        _ => bail!("{op}: the bias must be a contiguous f32 vector"),
    };
    if kw != k || bias.len() != n {
        bail!("{op}: input [{m}, {k}], weight [{n}, {kw}] and bias [{}] do not fit", bias.len());
    }
    Ok((MatRef::row_major(x, m, k)?, MatRef::row_major(w, n, k)?, bias))
}

/// `Σ_rows dY` for a `[rows, cols]` f32 CPU gradient: the bias gradient of every precision.
/// candle's `sum(0)` takes a strided walk per output and on MiniLM's `[2048, 1536]` gradient
/// took about as long as the layer's dX GEMM; this adds whole rows, blocks of 64 in parallel,
/// then the blocks' sums in order, so the result does not depend on the thread count.
fn bias_gradient(grad: &Tensor) -> Result<Tensor> {
    const BLOCK: usize = 64;
    let grad = grad.contiguous()?;
    let (storage, layout) = grad.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else { bail!("bias gradient: the gradient must be on the CPU") };
    let (data, _, cols) = matrix("bias gradient", "gradient", cpu, layout)?;
    let mut sums = vec![0f32; cols];
    if cols > 0 {
        let blocks: Vec<Vec<f32>> = data
            .par_chunks(BLOCK * cols)
            .map(|block| {
                let mut sums = vec![0f32; cols];
                for row in block.chunks_exact(cols) {
                    sums.iter_mut().zip(row).for_each(|(s, v)| *s += v);
                }
                sums
            })
            .collect();
        for block in blocks {
            sums.iter_mut().zip(block).for_each(|(s, v)| *s += v);
        }
    }
    Tensor::from_vec(sums, cols, grad.device())
}

/// `a · bᵀ (+ bias)` on the engine's GEMM of `values`: `gemm_nt_f32` or `gemm_nt_bf16`.
fn gemm_nt(values: GemmInputs, a: MatRef<'_>, b: MatRef<'_>, bias: Option<&[f32]>) -> Result<Vec<f32>> {
    match values {
        GemmInputs::F32 => gemm_nt_f32(a, b, bias),
        GemmInputs::Bf16 => gemm_nt_bf16(a, b, bias),
    }
}

/// The f32 or bf16 linear: `(x, W, b) → x·Wᵀ + b` on the engine's GEMM of those values.
struct GemmLinear(GemmInputs);

impl CustomOp3 for GemmLinear {
    fn name(&self) -> &'static str {
        match self.0 {
            GemmInputs::F32 => "linear-f32",
            GemmInputs::Bf16 => "linear-bf16",
        }
    }

    fn cpu_fwd(
        &self,
        x_s: &CpuStorage,
        x_l: &Layout,
        w_s: &CpuStorage,
        w_l: &Layout,
        b_s: &CpuStorage,
        b_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, w, bias) = operands(self.name(), (x_s, x_l), (w_s, w_l), (b_s, b_l))?;
        let shape = output_shape(x_l, w.dims().0);
        Ok((CpuStorage::F32(gemm_nt(self.0, x, w, Some(bias))?), shape))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let dx = grad.apply_op2_no_bwd(w, &Product::new(Form::Nn, self.0))?.reshape(x.shape())?;
        let dw = grad.apply_op2_no_bwd(x, &Product::new(Form::Tn, self.0))?;
        Ok((Some(dx), Some(dw), Some(bias_gradient(&grad)?)))
    }
}

/// The int8 linear; its forward keeps the quantised input for the backward.
#[derive(Default)]
struct Int8Linear {
    saved: OnceLock<QuantisedInput>,
}

struct QuantisedInput {
    values: Vec<i8>,
    scale: f32,
    rows: usize,
    cols: usize,
}

impl CustomOp3 for Int8Linear {
    fn name(&self) -> &'static str {
        "linear-int8"
    }

    fn cpu_fwd(
        &self,
        x_s: &CpuStorage,
        x_l: &Layout,
        w_s: &CpuStorage,
        w_l: &Layout,
        b_s: &CpuStorage,
        b_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, w, bias) = operands(self.name(), (x_s, x_l), (w_s, w_l), (b_s, b_l))?;
        let ((m, k), (n, _)) = (x.dims(), w.dims());
        let (x, w) = (x.data(), w.data());
        let (x_scale, w_scale) = (absmax(x) / 127.0, absmax(w) / 127.0);
        let (qx, qw) = (quantise(x, x_scale), quantise(w, w_scale));
        let sums = gemm_nt_i8(&qx, &qw, (m, k, n))?;
        let scale = x_scale * w_scale;
        let mut out = zeros(m * n);
        out.par_chunks_mut(n.max(1)).zip(sums.par_chunks(n.max(1))).for_each(|(row, acc)| {
            for ((o, a), b) in row.iter_mut().zip(acc).zip(bias) {
                *o = *a as f32 * scale + b;
            }
        });
        // A second forward of the same op value cannot happen (each `linear` call makes one).
        let _ = self.saved.set(QuantisedInput { values: qx, scale: x_scale, rows: m, cols: k });
        Ok((CpuStorage::F32(out), output_shape(x_l, n)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let Some(saved) = self.saved.get() else { bail!("linear-int8: backward before forward") };
        let grad = grad.contiguous()?;
        // q_x as f32 holds small integers, exact in bf16: the GEMM sees the quantised input.
        let qx: Vec<f32> = saved.values.par_iter().map(|v| *v as f32).collect();
        let qx = Tensor::from_vec(qx, (saved.rows, saved.cols), grad.device())?;
        let dw_of_qx = Product { scale: saved.scale, ..Product::new(Form::Tn, GemmInputs::Bf16) };
        let dw = grad.apply_op2_no_bwd(&qx, &dw_of_qx)?;
        let dx = grad.apply_op2_no_bwd(w, &Product::new(Form::Nn, GemmInputs::Bf16))?.reshape(x.shape())?;
        Ok((Some(dx), Some(dw), Some(bias_gradient(&grad)?)))
    }
}

/// One of the backward's GEMMs, on the engine's GEMM of `values` (sums in f32), its
/// result times `scale` (int8's dW: the input's quantisation scale).
struct Product {
    form: Form,
    values: GemmInputs,
    scale: f32,
}

impl Product {
    fn new(form: Form, values: GemmInputs) -> Product {
        Product { form, values, scale: 1.0 }
    }
}

#[derive(Debug, Clone, Copy)]
enum Form {
    /// `a [m, n] · b [n, k]` (dX = dY·W).
    Nn,
    /// `aᵀ · b` for `a [m, n]`, `b [m, k]` (dW = dYᵀ·x).
    Tn,
}

impl CustomOp2 for Product {
    fn name(&self) -> &'static str {
        match (self.form, self.values) {
            (Form::Nn, GemmInputs::F32) => "matmul-nn-f32",
            (Form::Tn, GemmInputs::F32) => "matmul-tn-f32",
            (Form::Nn, GemmInputs::Bf16) => "matmul-nn-bf16",
            (Form::Tn, GemmInputs::Bf16) => "matmul-tn-bf16",
        }
    }

    fn cpu_fwd(&self, a_s: &CpuStorage, a_l: &Layout, b_s: &CpuStorage, b_l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (a, m, n) = matrix(self.name(), "left operand", a_s, a_l)?;
        let (b, rows, k) = matrix(self.name(), "right operand", b_s, b_l)?;
        let (a, b) = (MatRef::row_major(a, m, n)?, MatRef::row_major(b, rows, k)?);
        // Both as `left · rightᵀ`, the form the GEMM takes.
        let (left, right) = match self.form {
            Form::Nn if rows == n => (a, b.t()),
            Form::Tn if rows == m => (a.t(), b.t()),
            _ => bail!("{}: [{m}, {n}] and [{rows}, {k}] do not fit", self.name()),
        };
        let shape = Shape::from((left.dims().0, k));
        let mut product = gemm_nt(self.values, left, right, None)?;
        if self.scale != 1.0 {
            product.par_iter_mut().for_each(|v| *v *= self.scale);
        }
        Ok((CpuStorage::F32(product), shape))
    }
}

/// The largest magnitude in `x` (NaNs ignored), over both cores.
fn absmax(x: &[f32]) -> f32 {
    x.par_chunks(1 << 14).map(|c| c.iter().fold(0f32, |m, v| m.max(v.abs()))).reduce(|| 0.0, f32::max)
}

/// `clamp(round_half_even(x / scale), ±127)`, as `engine::ops::QuantizeInt8`; scale 0 gives 0.
fn quantise(x: &[f32], scale: f32) -> Vec<i8> {
    let mut out = zeros(x.len());
    if scale > 0.0 {
        // Adding and taking back 1.5·2²³ rounds half to even for |v| < 2²², here ≤ 127, and
        // unlike `round_ties_even` it vectorises on baseline x86-64.
        const MAGIC: f32 = 12_582_912.0;
        out.par_chunks_mut(1 << 14).zip(x.par_chunks(1 << 14)).for_each(|(q, x)| {
            for (q, v) in q.iter_mut().zip(x) {
                *q = (((v / scale).clamp(-127.0, 127.0) + MAGIC) - MAGIC) as i8;
            }
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Var};

    use super::*;
    use crate::engine::ops::{Granularity, Int8Scales, QuantizeInt8};

    /// Uniform values in ±scale from a fixed seed.
    fn tensor(seed: u64, dims: (usize, usize), scale: f32) -> Tensor {
        let mut rng = crate::train::rng::Rng::derive(seed, "precision-test");
        let data: Vec<f32> = (0..dims.0 * dims.1).map(|_| ((rng.next_f64() * 2.0 - 1.0) as f32) * scale).collect();
        Tensor::from_vec(data, dims, &Device::Cpu).unwrap()
    }

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    /// ‖a − b‖ / ‖b‖.
    fn relative_error(a: &Tensor, b: &Tensor) -> f64 {
        let (a, b) = (values(a), values(b));
        let diff: f64 = a.iter().zip(&b).map(|(x, y)| (*x as f64 - *y as f64).powi(2)).sum();
        let norm: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
        (diff / norm).sqrt()
    }

    /// Output, and the gradients of `Σ y ⊙ probe` with respect to x, W and b.
    fn run(precision: Precision, x: &Var, w: &Var, b: &Var, probe: &Tensor) -> [Tensor; 4] {
        let y = linear(x.as_tensor(), w.as_tensor(), b.as_tensor(), precision).unwrap();
        let grads = (&y * probe).unwrap().sum_all().unwrap().backward().unwrap();
        let grad = |v: &Var| grads.get(v.as_tensor()).unwrap().clone();
        [y, grad(x), grad(w), grad(b)]
    }

    /// The bf16 and int8 layers against f32 autograd on MiniLM-like shapes (activations of
    /// LayerNorm scale, weights of 0.05, the upstream gradient of 1e-3), forward and every
    /// gradient, as ‖low − f32‖ / ‖f32‖:
    /// - bf16 ≤ 1e-2: each operand is rounded with a relative error of at most 2⁻⁹ (≈ 0.2 %,
    ///   ≈ 0.1 % on average); two of them in each product and independent errors across the
    ///   depth give ≈ 0.2–0.3 % relative error; 1e-2 leaves 3× margin.
    /// - int8 forward ≤ 3e-2: per-tensor steps of absmax/127 give a uniform error of rms
    ///   step/√12 on each operand, ≈ 0.45 % of a uniform operand's rms, ≈ 0.65 % for two;
    ///   heavier-tailed real activations lose more, hence the 4× margin. Its dW (from q_x and a
    ///   bf16 gradient) has the same bound; dX is the bf16 product, so 1e-2.
    /// Each must also differ from f32 by more than 1e-4, so a layer silently running f32
    /// fails.
    #[test]
    fn low_precision_forward_and_backward_stay_within_tolerance_of_f32_autograd() {
        for (m, k, n) in [(96, 384, 384), (64, 384, 1536), (64, 1536, 384), (7, 33, 5)] {
            let x = Var::from_tensor(&tensor(1, (m, k), 2.0)).unwrap();
            let w = Var::from_tensor(&tensor(2, (n, k), 0.05)).unwrap();
            let b = Var::from_tensor(&tensor(3, (1, n), 0.1).flatten_all().unwrap()).unwrap();
            let probe = tensor(4, (m, n), 1e-3);
            let want = run(Precision::F32, &x, &w, &b, &probe);
            for (precision, bounds) in [(Precision::Bf16, [1e-2; 3]), (Precision::Int8, [3e-2, 1e-2, 3e-2])] {
                let got = run(precision, &x, &w, &b, &probe);
                for (i, what) in ["y", "dx", "dw"].iter().enumerate() {
                    let err = relative_error(&got[i], &want[i]);
                    eprintln!("{precision} [{m}, {k}, {n}] {what}: relative error {err:.2e}");
                    assert!(err <= bounds[i], "{precision} [{m}, {k}, {n}] {what}: relative error {err}");
                    assert!(err > 1e-4, "{precision} [{m}, {k}, {n}] {what}: {err}, as if computed at f32");
                }
                assert!(relative_error(&got[3], &want[3]) < 1e-5, "{precision}: the bias gradient is f32");
            }
        }
    }

    /// The f32 layer on the CPU (the engine's f32 GEMM) against candle's autograd in f64: the
    /// output and every gradient within f32 rounding, the same bits on any thread pool; and
    /// `bias_gradient` is the column sums whatever the thread pool.
    #[test]
    fn the_f32_layer_matches_f64_autograd_and_gives_the_same_bits_on_any_pool() {
        for (m, k, n) in [(2048, 16, 1536), (7, 33, 5), (130, 8, 1), (64, 384, 96)] {
            let x = Var::from_tensor(&tensor(1, (m, k), 2.0)).unwrap();
            let w = Var::from_tensor(&tensor(2, (n, k), 0.05)).unwrap();
            let b = Var::from_tensor(&tensor(3, (1, n), 0.1).flatten_all().unwrap()).unwrap();
            let probe = tensor(4, (m, n), 1.0);
            let f64_var = |v: &Var| Var::from_tensor(&v.as_tensor().to_dtype(DType::F64).unwrap()).unwrap();
            let (x64, w64, b64) = (f64_var(&x), f64_var(&w), f64_var(&b));
            let y = x64.as_tensor().matmul(&w64.as_tensor().t().unwrap()).unwrap().broadcast_add(b64.as_tensor()).unwrap();
            let grads = (&y * &probe.to_dtype(DType::F64).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
            let want: Vec<Tensor> = [&y, grads.get(&x64).unwrap(), grads.get(&w64).unwrap(), grads.get(&b64).unwrap()]
                .iter()
                .map(|t| t.to_dtype(DType::F32).unwrap())
                .collect();
            let on = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                pool.install(|| run(Precision::F32, &x, &w, &b, &probe))
            };
            let got = on(1);
            for (i, what) in ["y", "dx", "dw", "db"].iter().enumerate() {
                let err = relative_error(&got[i], &want[i]);
                assert!(err < 1e-5, "[{m}, {k}, {n}] {what}: relative error {err}");
            }
            for threads in [2, 7] {
                let again = on(threads);
                for (i, what) in ["y", "dx", "dw", "db"].iter().enumerate() {
                    assert_eq!(values(&again[i]), values(&got[i]), "[{m}, {k}, {n}] {what} on {threads} threads");
                }
            }

            let sums = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                values(&pool.install(|| bias_gradient(&probe)).unwrap())
            };
            let probe_values = values(&probe);
            let columns: Vec<f64> = (0..n).map(|j| (0..m).map(|i| probe_values[i * n + j] as f64).sum()).collect();
            let one = sums(1);
            assert!(one.iter().zip(&columns).all(|(g, c)| (*g as f64 - c).abs() < 1e-3), "[{m}, {n}] column sums");
            for threads in [2, 7] {
                assert_eq!(sums(threads), one, "[{m}, {n}] on {threads} threads");
            }
        }
    }

    /// f16 is refused with an error, not a panic nor a silent other precision.
    #[test]
    fn f16_is_an_error() {
        let (x, w, b) = (tensor(1, (4, 8), 1.0), tensor(2, (3, 8), 0.1), Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap());
        let err = linear(&x, &w, &b, Precision::F16).unwrap_err();
        assert!(err.to_string().contains("f16 is not implemented"), "{err}");
    }

    /// Exactness against references that apply the same rounding and then sum in f64: the
    /// layers' plumbing (transposes, scales, the saved input) is right, not merely close.
    #[test]
    fn bf16_and_int8_layers_match_their_rounded_references() {
        let (m, k, n) = (37, 300, 50);
        let x = Var::from_tensor(&tensor(5, (m, k), 1.5)).unwrap();
        let w = Var::from_tensor(&tensor(6, (n, k), 0.1)).unwrap();
        let b = Var::from_tensor(&tensor(7, (1, n), 0.1).flatten_all().unwrap()).unwrap();
        let probe = tensor(8, (m, n), 1.0);
        let bf16 = |t: &Tensor| t.to_dtype(DType::BF16).unwrap().to_dtype(DType::F64).unwrap();
        let f64 = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
        let close = |got: &Tensor, want: Tensor, what: &str| {
            let diff = (f64(got) - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap();
            assert!(diff < 2e-4, "{what}: max diff {diff}");
        };
        let (xt, wt, bt) = (x.as_tensor(), w.as_tensor(), b.as_tensor());

        let [y, dx, dw, db] = run(Precision::Bf16, &x, &w, &b, &probe);
        close(&y, bf16(xt).matmul(&bf16(wt).t().unwrap()).unwrap().broadcast_add(&f64(bt)).unwrap(), "bf16 y");
        close(&dx, bf16(&probe).matmul(&bf16(wt)).unwrap(), "bf16 dx");
        close(&dw, bf16(&probe).t().unwrap().matmul(&bf16(xt)).unwrap(), "bf16 dw");
        close(&db, f64(&probe).sum(0).unwrap(), "bf16 db");

        // The engine's quantisation ops are the int8 reference (scales absmax/127, ties to even).
        let quantised = |t: &Tensor| {
            let scale = t.apply_op1_no_bwd(&Int8Scales { granularity: Granularity::PerTensor }).unwrap();
            let q = t.apply_op2_no_bwd(&scale, &QuantizeInt8).unwrap().to_vec2::<u8>().unwrap();
            let q: Vec<f64> = q.into_iter().flatten().map(|v| v as i8 as f64).collect();
            (Tensor::from_vec(q, t.dims2().unwrap(), &Device::Cpu).unwrap(), scale.to_vec1::<f32>().unwrap()[0] as f64)
        };
        let ((qx, sx), (qw, sw)) = (quantised(xt), quantised(wt));
        let [y, dx, dw, _] = run(Precision::Int8, &x, &w, &b, &probe);
        let want = (qx.matmul(&qw.t().unwrap()).unwrap() * (sx * sw)).unwrap().broadcast_add(&f64(bt)).unwrap();
        close(&y, want, "int8 y");
        close(&dx, bf16(&probe).matmul(&bf16(wt)).unwrap(), "int8 dx");
        close(&dw, (bf16(&probe).t().unwrap().matmul(&qx).unwrap() * sx).unwrap(), "int8 dw");
    }

    #[test]
    fn keeps_leading_dims_and_refuses_mismatched_shapes() {
        let flat = Var::from_tensor(&tensor(9, (6, 8), 1.0)).unwrap();
        let x = Var::from_tensor(&flat.as_tensor().reshape((2, 3, 8)).unwrap()).unwrap();
        let (w, b) = (Var::from_tensor(&tensor(10, (5, 8), 0.1)).unwrap(), Var::zeros(5, DType::F32, &Device::Cpu).unwrap());
        let probe = tensor(11, (6, 5), 1.0);
        for precision in crate::train::precision::IMPLEMENTED {
            // The same layer on [2, 3, 8] as on [6, 8]: output, dx in x's shape, dw, db.
            let [y, dx, dw, db] = run(precision, &x, &w, &b, &probe.reshape((2, 3, 5)).unwrap());
            let want = run(precision, &flat, &w, &b, &probe);
            assert_eq!((y.dims(), dx.dims()), ([2, 3, 5].as_slice(), [2, 3, 8].as_slice()));
            for (got, want) in [y, dx, dw, db].iter().zip(&want) {
                assert_eq!(values(got), values(want), "{precision}");
            }
            assert!(linear(x.as_tensor(), &w.t().unwrap(), &b, precision).is_err());
        }
        let (x, w) = (x.as_tensor(), w.as_tensor());
        let short = Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap();
        assert!(linear(&x, &w, &short, Precision::Int8).is_err());
    }
}
