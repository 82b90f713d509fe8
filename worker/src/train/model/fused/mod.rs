//! The encoder's GELU (erf), LayerNorm and multi-head self-attention as one-pass CPU ops
//! with one-pass backwards. candle differentiates its `gelu_erf` through about ten
//! elementwise tensor ops, a LayerNorm written with tensor ops through more, and attention
//! through head-splitting copies, batched matmuls and a softmax (max, subtract, exp, sum,
//! divide), each a full pass over a `[batch, tokens, intermediate]`, `[batch, tokens,
//! hidden]` or `[batch, heads, tokens, tokens]` tensor with a fresh output.
//! On a 2-core Xeon at MiniLM's shapes (16 × 128 tokens), against candle's autograd of its
//! expressions: GELU ~16× forward and ~6× backward, LayerNorm at parity forward and ~10×
//! backward. In an f32 encoder step, the LayerNorm made the backward ~1.3× faster, the
//! vector exp and erf the forward ~1.5× (`qsync_gemm`; bench/results/cpu_f32_avx512.md).
//! Attention: `attention.rs`. exp and erf are the serving engine's
//! (`engine::ops::vector_math`: 8 AVX2 lanes at a time, about 1 ulp and a few ulp), so
//! training's GELU is the function the engine serves the model with. The same functions as
//! candle's within float rounding (tested against candle's autograd); on other devices, and
//! for anything but f32, candle's expressions.
//!
//! The ops split their work into rayon tasks, so a CPU rank's own thread pool bounds them
//! (candle's barrier pool is one per process, whatever pool the caller installed).

mod attention;

pub use attention::{self_attention, self_attention_expression};

use candle_core::{bail, CpuStorage, CustomOp1, CustomOp3, DType, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

use crate::engine::ops::vector_math::{exp_in_place, gelu_in_place};
use crate::engine::ops::{round_bf16, zeros};

/// `1/√(2π)`, the standard normal density at 0.
const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;

/// `x·Φ(x)` with the exact (erf) normal CDF, as candle's `gelu_erf`.
pub fn gelu_erf(x: &Tensor) -> Result<Tensor> {
    match fused(x) {
        true => x.contiguous()?.apply_op1(Gelu),
        false => x.gelu_erf(),
    }
}

/// LayerNorm over the last dimension, `(x − mean)/√(variance + eps) · weight + bias` (the
/// biased variance, as candle-nn's).
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    if fused(x) && fused(weight) && fused(bias) {
        return x.contiguous()?.apply_op3(&weight.contiguous()?, &bias.contiguous()?, LayerNorm { eps: eps as f32 });
    }
    layer_norm_expression(x, weight, bias, eps)
}

/// [`layer_norm`] as candle tensor ops (candle-nn's unfused path), differentiable on every
/// device and dtype: what runs where the one-pass op does not, and the benchmark's baseline.
pub fn layer_norm_expression(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let hidden = x.dim(D::Minus1)? as f64;
    let centred = x.broadcast_sub(&(x.sum_keepdim(D::Minus1)? / hidden)?)?;
    let variance = (centred.sqr()?.sum_keepdim(D::Minus1)? / hidden)?;
    let normed = centred.broadcast_div(&(variance + eps)?.sqrt()?)?;
    normed.broadcast_mul(weight)?.broadcast_add(bias)
}

/// `x` rounded to bf16 (nearest even) and held in f32, as candle's
/// `x.to_dtype(BF16)?.to_dtype(F32)` computes it, with the gradient candle gives those casts
/// (the incoming gradient rounded to bf16): one pass each way, where candle's casts took two
/// forward and, in its backward, two casts, two zeroed gradients and two adds.
pub fn round_to_bf16(x: &Tensor) -> Result<Tensor> {
    match fused(x) {
        true => x.contiguous()?.apply_op1(RoundBf16),
        false => x.to_dtype(DType::BF16)?.to_dtype(x.dtype()),
    }
}

struct RoundBf16;

impl CustomOp1 for RoundBf16 {
    fn name(&self) -> &'static str {
        "round-bf16"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let y = values(self.name(), s, l)?.par_iter().map(|v| round_bf16(*v)).collect();
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(grad.contiguous()?.apply_op1_no_bwd(&RoundBf16)?))
    }
}

fn fused(x: &Tensor) -> bool {
    x.device().is_cpu() && x.dtype() == DType::F32 && x.rank() > 0
}

/// Values per rayon task: enough that a task outweighs its scheduling.
const CHUNK: usize = 4096;

/// Rows per rayon task: about `CHUNK` values, whole rows.
fn rows_per_task(row: usize) -> usize {
    (CHUNK / row.max(1)).max(1)
}

/// The contiguous f32 values of a CPU operand.
fn values<'a>(op: &str, s: &'a CpuStorage, l: &Layout) -> Result<&'a [f32]> {
    match l.contiguous_offsets() {
        Some((start, end)) => Ok(&s.as_slice::<f32>()?[start..end]),
        None => bail!("{op}: the operand must be contiguous"),
    }
}

/// A gradient op's saved operand and incoming gradient, of one length.
fn with_gradient<'a>(
    op: &str,
    (s, l): (&'a CpuStorage, &Layout),
    (g_s, g_l): (&'a CpuStorage, &Layout),
) -> Result<(&'a [f32], &'a [f32])> {
    let (saved, gradient) = (values(op, s, l)?, values(op, g_s, g_l)?);
    if saved.len() != gradient.len() {
        bail!("{op}: {} values against a gradient of {}", saved.len(), gradient.len());
    }
    Ok((saved, gradient))
}

struct Gelu;

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "gelu-erf"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let mut y: Vec<f32> = values(self.name(), s, l)?.par_iter().copied().collect();
        y.par_chunks_mut(CHUNK).for_each(gelu_in_place);
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(arg.apply_op3_no_bwd(res, &grad.contiguous()?, &GeluGrad)?))
    }
}

/// `(x, y, dy) → dy · gelu'(x)` for `y = gelu(x)`: `gelu'(x) = Φ(x) + x·φ(x)` with
/// `φ(x) = e^(−x²/2)/√(2π)` and `Φ(x)` read off the forward's output as `y/x` instead of a
/// second erf; ½ where `x` is too near 0 to divide by.
struct GeluGrad;

impl CustomOp3 for GeluGrad {
    fn name(&self) -> &'static str {
        "gelu-erf-grad"
    }

    fn cpu_fwd(
        &self,
        x_s: &CpuStorage,
        x_l: &Layout,
        y_s: &CpuStorage,
        y_l: &Layout,
        g_s: &CpuStorage,
        g_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, g) = with_gradient(self.name(), (x_s, x_l), (g_s, g_l))?;
        let (y, _) = with_gradient(self.name(), (y_s, y_l), (g_s, g_l))?;
        let mut dx = zeros(x.len());
        dx.par_chunks_mut(CHUNK).zip(x.par_chunks(CHUNK).zip(y.par_chunks(CHUNK).zip(g.par_chunks(CHUNK)))).for_each(
            |(dx, (x, (y, g)))| {
                // e^(−x²/2) first, 8 lanes at a time.
                dx.iter_mut().zip(x).for_each(|(d, v)| *d = -(v * v) / 2.);
                exp_in_place(dx);
                for (((dx, &v), &y), &g) in dx.iter_mut().zip(x).zip(y).zip(g) {
                    let cdf = if v.abs() < f32::MIN_POSITIVE { 0.5 } else { y / v };
                    *dx = g * (cdf + FRAC_1_SQRT_2PI * *dx * v);
                }
            },
        );
        Ok((CpuStorage::F32(dx), x_l.shape().clone()))
    }
}

/// The length of `x`'s rows, which every one of `params` must have.
fn row_length(op: &str, x: &Layout, params: &[&[f32]]) -> Result<usize> {
    let hidden = x.dims().last().copied().unwrap_or(0);
    if hidden == 0 || params.iter().any(|p| p.len() != hidden) {
        let lengths: Vec<usize> = params.iter().map(|p| p.len()).collect();
        bail!("{op}: rows of {hidden} values against parameters of {lengths:?}");
    }
    Ok(hidden)
}

/// A row's mean and `1/√(variance + eps)`.
fn moments(x: &[f32], eps: f32) -> (f32, f32) {
    let n = x.len() as f32;
    let mean = x.iter().sum::<f32>() / n;
    let variance = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    (mean, 1. / (variance + eps).sqrt())
}

struct LayerNorm {
    eps: f32,
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "layer-norm"
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
        let (x, w, b) = (values(self.name(), x_s, x_l)?, values(self.name(), w_s, w_l)?, values(self.name(), b_s, b_l)?);
        let hidden = row_length(self.name(), x_l, &[w, b])?;
        let task = rows_per_task(hidden) * hidden;
        let mut y = zeros(x.len());
        y.par_chunks_mut(task).zip(x.par_chunks(task)).for_each(|(y, x)| {
            for (y, x) in y.chunks_exact_mut(hidden).zip(x.chunks_exact(hidden)) {
                let (mean, scale) = moments(x, self.eps);
                for (((y, &v), &w), &b) in y.iter_mut().zip(x).zip(w).zip(b) {
                    *y = (v - mean) * scale * w + b;
                }
            }
        });
        Ok((CpuStorage::F32(y), x_l.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        _bias: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let hidden = weight.elem_count();
        let all = x.apply_op3_no_bwd(weight, &grad.contiguous()?, &LayerNormGrad { eps: self.eps })?;
        let rows = x.elem_count() / hidden;
        let dx = all.narrow(0, 0, rows)?.reshape(x.shape())?;
        let (dw, db) = (all.get(rows)?, all.get(rows + 1)?);
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

/// `(x, weight, dy) → [dx; dweight; dbias]`, `[rows + 2, hidden]`: one pass makes all three.
/// With `x̂ = (x − mean)·s`, `s = 1/√(variance + eps)` and `g = dy ⊙ weight` per row,
/// `dx = s·(g − mean(g) − x̂·mean(g ⊙ x̂))`; `dweight = Σ_rows dy ⊙ x̂`, `dbias = Σ_rows dy`.
/// Each task sums its rows' share of those two, and the shares add up in task order, so the
/// result does not depend on how many threads ran.
struct LayerNormGrad {
    eps: f32,
}

impl CustomOp3 for LayerNormGrad {
    fn name(&self) -> &'static str {
        "layer-norm-grad"
    }

    fn cpu_fwd(
        &self,
        x_s: &CpuStorage,
        x_l: &Layout,
        w_s: &CpuStorage,
        w_l: &Layout,
        g_s: &CpuStorage,
        g_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, g) = with_gradient(self.name(), (x_s, x_l), (g_s, g_l))?;
        let w = values(self.name(), w_s, w_l)?;
        let hidden = row_length(self.name(), x_l, &[w])?;
        let task = rows_per_task(hidden) * hidden;
        let mut dx = zeros(x.len() + 2 * hidden);
        let shares: Vec<Vec<f32>> = dx[..x.len()]
            .par_chunks_mut(task)
            .zip(x.par_chunks(task).zip(g.par_chunks(task)))
            .map(|(dx, (x, dy))| {
                // This task's Σ dy ⊙ x̂, then its Σ dy.
                let mut share = vec![0f32; 2 * hidden];
                let (dw, db) = share.split_at_mut(hidden);
                let mut normed = vec![0f32; hidden];
                for ((dx, x), dy) in dx.chunks_exact_mut(hidden).zip(x.chunks_exact(hidden)).zip(dy.chunks_exact(hidden)) {
                    let (mean, scale) = moments(x, self.eps);
                    let (mut g_sum, mut g_dot) = (0f32, 0f32);
                    for i in 0..hidden {
                        normed[i] = (x[i] - mean) * scale;
                        dw[i] += dy[i] * normed[i];
                        db[i] += dy[i];
                        let g = dy[i] * w[i];
                        g_sum += g;
                        g_dot += g * normed[i];
                    }
                    let (g_mean, g_dot_mean) = (g_sum / hidden as f32, g_dot / hidden as f32);
                    for i in 0..hidden {
                        dx[i] = scale * (dy[i] * w[i] - g_mean - normed[i] * g_dot_mean);
                    }
                }
                share
            })
            .collect();
        let sums = &mut dx[x.len()..];
        for share in &shares {
            for (sum, v) in sums.iter_mut().zip(share) {
                *sum += v;
            }
        }
        let rows = x.len() / hidden;
        Ok((CpuStorage::F32(dx), Shape::from((rows + 2, hidden))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// Normal values from a fixed seed (a test's inputs must not change from run to run).
    pub(super) fn normal(seed: u64, mean: f32, std: f32, shape: impl Into<Shape>) -> Tensor {
        let shape = shape.into();
        let mut rng = crate::train::rng::Rng::derive(seed, "fused-test");
        let values: Vec<f32> = (0..shape.elem_count()).map(|_| mean + std * rng.next_gaussian() as f32).collect();
        Tensor::from_vec(values, shape, &Device::Cpu).unwrap()
    }

    /// `f`'s output and its input gradient under the loss `Σ f(x) ⊙ w`.
    fn output_and_gradient(x: &Tensor, w: &Tensor, f: impl Fn(&Tensor) -> Result<Tensor>) -> (Vec<f32>, Vec<f32>) {
        let x = Var::from_tensor(x).unwrap();
        let y = f(x.as_tensor()).unwrap();
        let grads = (&y * w).unwrap().sum_all().unwrap().backward().unwrap();
        let dx = grads.get(x.as_tensor()).expect("a gradient reaches x");
        (y.flatten_all().unwrap().to_vec1().unwrap(), dx.flatten_all().unwrap().to_vec1().unwrap())
    }

    fn assert_close(ours: &[f32], candle: &[f32], tolerance: f32, what: &str) {
        assert_eq!(ours.len(), candle.len());
        for (i, (a, b)) in ours.iter().zip(candle).enumerate() {
            assert!((a - b).abs() <= tolerance * (1.0 + b.abs()), "{what}[{i}]: {a} against candle's {b}");
        }
    }

    #[test]
    fn gelu_matches_candles_forward_and_autograd() {
        let x = (normal(1, 0.0, 2.0, (3, 70, 33)) * 1.5).unwrap();
        let w = normal(2, 0.0, 1.0, (3, 70, 33));
        let (y, dx) = output_and_gradient(&x, &w, gelu_erf);
        let (candle_y, candle_dx) = output_and_gradient(&x, &w, |x| x.gelu_erf());
        // Below about −5 candle's f32 erf reaches −1 and its GELU gives exactly 0 where the
        // true value (x·Φ(x), ours) is up to ~1.5e-6; the inputs reach there, so allow that.
        assert_close(&y, &candle_y, 5e-6, "y");
        assert_close(&dx, &candle_dx, 5e-6, "dx");
        // A derivative that dropped a term would sit far off: gelu'(1) = 1.0833.
        let one = Tensor::new(&[1f32], &Device::Cpu).unwrap();
        let (_, slope) = output_and_gradient(&one, &one.ones_like().unwrap(), gelu_erf);
        assert!((slope[0] - 1.0833).abs() < 1e-3, "gelu'(1) = {}", slope[0]);
    }

    #[test]
    fn layer_norm_matches_candle_nn_and_candles_autograd_at_f64() {
        // 280 rows of 33: three tasks of rows, so the weight and bias gradients add shares.
        let x = (normal(3, 0.5, 2.0, (4, 70, 33)) * 3.0).unwrap();
        let weight = normal(4, 1.0, 0.5, 33);
        let bias = normal(5, 0.0, 0.5, 33);
        let w = normal(6, 0.0, 1.0, (4, 70, 33));
        let run = |dtype| {
            let vars: Vec<Var> = [&x, &weight, &bias].iter().map(|t| Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap()).collect();
            let y = layer_norm(vars[0].as_tensor(), vars[1].as_tensor(), vars[2].as_tensor(), 1e-12).unwrap();
            let grads = (&y * w.to_dtype(dtype).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
            let as_f32 = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let mut out = vec![as_f32(&y)];
            out.extend(vars.iter().map(|v| as_f32(grads.get(v.as_tensor()).expect("a gradient reaches each input"))));
            out
        };
        let (ours, reference) = (run(DType::F32), run(DType::F64));
        let candle_nn = candle_nn::ops::layer_norm(&x, &weight, &bias, 1e-12).unwrap();
        assert_close(&ours[0], &candle_nn.flatten_all().unwrap().to_vec1().unwrap(), 1e-5, "y against candle-nn's");
        for (what, (a, b)) in ["y", "dx", "dweight", "dbias"].iter().zip(ours.iter().zip(&reference)) {
            assert_close(a, b, 2e-5, what);
        }
    }

    #[test]
    fn layer_norm_gradients_do_not_depend_on_the_thread_count() {
        let x = normal(7, 0.0, 1.0, (300, 64));
        let weight = normal(8, 1.0, 0.2, 64);
        let grad = normal(9, 0.0, 1.0, (300, 64));
        let with_threads = |n| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(n).build().unwrap();
            let all = pool.install(|| x.apply_op3_no_bwd(&weight, &grad, &LayerNormGrad { eps: 1e-12 })).unwrap();
            assert_eq!(all.dims(), &[302, 64]);
            all.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        };
        assert_eq!(with_threads(1), with_threads(3));
    }

    /// The same bits as candle's two casts, forward and backward, on normal values, exact
    /// ties (both ways to even), subnormals, infinities and the largest finite values; NaN
    /// stays NaN.
    #[test]
    fn bf16_rounding_matches_candles_casts_and_their_gradient() {
        let mut special = vec![1.0 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-8), -1.0 - 2f32.powi(-8), 1e-40, -3e-39];
        special.extend([f32::INFINITY, f32::NEG_INFINITY, f32::MAX, f32::MIN, f32::MIN_POSITIVE, 0.0, -0.0]);
        let tail = normal(11, 0.0, 1.0, 300 - special.len()).to_vec1::<f32>().unwrap();
        let x = Tensor::from_vec([special, tail].concat(), (3, 100), &Device::Cpu).unwrap();
        let probe = (normal(12, 0.0, 1.0, (3, 100)) * 1e-3).unwrap();
        let run = |f: &dyn Fn(&Tensor) -> Result<Tensor>| {
            let x = Var::from_tensor(&x).unwrap();
            let y = f(x.as_tensor()).unwrap();
            let dx = (&y * &probe).unwrap().sum_all().unwrap().backward().unwrap().get(x.as_tensor()).unwrap().clone();
            let bits = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            (bits(&y), bits(&dx))
        };
        let (ours, candle) = (run(&round_to_bf16), run(&|x| x.to_dtype(DType::BF16)?.to_dtype(DType::F32)));
        assert_eq!(ours, candle);
        assert_ne!(ours.0, run(&|x| Ok(x.clone())).0, "the values were rounded");
        let nan = round_to_bf16(&Tensor::new(&[f32::NAN], &Device::Cpu).unwrap()).unwrap();
        assert!(nan.to_vec1::<f32>().unwrap()[0].is_nan());
    }

    #[test]
    fn other_dtypes_take_candles_expressions() {
        let x = normal(10, 0.0, 1.0, (4, 8)).to_dtype(DType::F64).unwrap();
        assert_eq!(gelu_erf(&x).unwrap().to_vec2::<f64>().unwrap(), x.gelu_erf().unwrap().to_vec2::<f64>().unwrap());
    }
}
