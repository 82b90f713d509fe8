//! The encoder's GELU (erf) and attention softmax as one-pass CPU ops with one-pass
//! backwards. candle differentiates its `gelu_erf` through about ten elementwise tensor ops
//! and its softmax (max, subtract, exp, sum, divide) through more, each a full pass over
//! a `[batch, heads, tokens, tokens]` or `[batch, tokens, intermediate]` tensor with a fresh
//! output: together about a quarter of an f32 MiniLM training step on a 2-core Xeon (16 ×
//! 128 tokens). There, per layer, the softmax's backward went from ~40 to ~5 ms and the
//! GELU's from ~40 to ~30 (its erf dominates); the step's backward 1.17× faster, its forward
//! 0.89× (not explained), the whole f32 step 1.08× (bench/results/cpu_f32_avx512.md, last
//! section). Same functions: the GELU
//! forward is candle's own formula and erf (bit-identical), its derivative and the softmax
//! within float rounding of candle's (tested against candle's autograd). On other devices,
//! and for anything but f32, candle's expressions.

use std::f32::consts::FRAC_1_SQRT_2;

use candle_core::cpu::erf::erf_f32;
use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

/// `x·Φ(x)` with the exact (erf) normal CDF, as candle's `gelu_erf`.
pub fn gelu_erf(x: &Tensor) -> Result<Tensor> {
    match fused(x) {
        true => x.contiguous()?.apply_op1(Gelu),
        false => x.gelu_erf(),
    }
}

/// Softmax over the last dimension, as `candle_nn::ops::softmax(x, D::Minus1)`.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    match fused(x) {
        true => x.contiguous()?.apply_op1(Softmax),
        false => candle_nn::ops::softmax(x, D::Minus1),
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
        let x = values(self.name(), s, l)?;
        let mut y = vec![0f32; x.len()];
        y.par_chunks_mut(CHUNK).zip(x.par_chunks(CHUNK)).for_each(|(y, x)| {
            for (y, &v) in y.iter_mut().zip(x) {
                *y = (erf_f32(v * FRAC_1_SQRT_2) + 1.) * 0.5 * v;
            }
        });
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(arg.apply_op2_no_bwd(&grad.contiguous()?, &GeluGrad)?))
    }
}

/// `(x, dy) → dy · gelu'(x)`, `gelu'(x) = ½ + x·e^(−x²/2)/√(2π) + ½·erf(x/√2)` (candle's
/// formula and constant).
struct GeluGrad;

impl CustomOp2 for GeluGrad {
    fn name(&self) -> &'static str {
        "gelu-erf-grad"
    }

    fn cpu_fwd(&self, x_s: &CpuStorage, x_l: &Layout, g_s: &CpuStorage, g_l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (x, g) = with_gradient(self.name(), (x_s, x_l), (g_s, g_l))?;
        let mut dx = vec![0f32; x.len()];
        dx.par_chunks_mut(CHUNK).zip(x.par_chunks(CHUNK).zip(g.par_chunks(CHUNK))).for_each(|(dx, (x, g))| {
            for ((dx, &v), &g) in dx.iter_mut().zip(x).zip(g) {
                let slope = 0.5 + 0.398942 * (-(v * v) / 2.).exp() * v + 0.5 * erf_f32(v * FRAC_1_SQRT_2);
                *dx = g * slope;
            }
        });
        Ok((CpuStorage::F32(dx), x_l.shape().clone()))
    }
}

struct Softmax;

impl CustomOp1 for Softmax {
    fn name(&self) -> &'static str {
        "softmax-last-dim"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = values(self.name(), s, l)?;
        let row = l.dims().last().copied().unwrap_or(1).max(1);
        let mut y = vec![0f32; x.len()];
        let task = rows_per_task(row) * row;
        y.par_chunks_mut(task).zip(x.par_chunks(task)).for_each(|(y, x)| {
            for (y, x) in y.chunks_exact_mut(row).zip(x.chunks_exact(row)) {
                let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0f32;
                for (y, &v) in y.iter_mut().zip(x) {
                    *y = (v - max).exp();
                    sum += *y;
                }
                for y in y.iter_mut() {
                    *y /= sum;
                }
            }
        });
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(res.apply_op2_no_bwd(&grad.contiguous()?, &SoftmaxGrad)?))
    }
}

/// `(y, dy) → y ⊙ (dy − Σ_row y ⊙ dy)` for `y` a softmax over rows.
struct SoftmaxGrad;

impl CustomOp2 for SoftmaxGrad {
    fn name(&self) -> &'static str {
        "softmax-last-dim-grad"
    }

    fn cpu_fwd(&self, y_s: &CpuStorage, y_l: &Layout, g_s: &CpuStorage, g_l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (y, g) = with_gradient(self.name(), (y_s, y_l), (g_s, g_l))?;
        let row = y_l.dims().last().copied().unwrap_or(1).max(1);
        let task = rows_per_task(row) * row;
        let mut dx = vec![0f32; y.len()];
        dx.par_chunks_mut(task).zip(y.par_chunks(task).zip(g.par_chunks(task))).for_each(|(dx, (y, g))| {
            for ((dx, y), g) in dx.chunks_exact_mut(row).zip(y.chunks_exact(row)).zip(g.chunks_exact(row)) {
                let dot: f32 = y.iter().zip(g).map(|(y, g)| y * g).sum();
                for ((dx, &y), &g) in dx.iter_mut().zip(y).zip(g) {
                    *dx = y * (g - dot);
                }
            }
        });
        Ok((CpuStorage::F32(dx), y_l.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

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
    fn gelu_matches_candle_forward_exactly_and_backward_closely() {
        let x = (Tensor::randn(0f32, 2.0, (3, 70, 33), &Device::Cpu).unwrap() * 1.5).unwrap();
        let w = Tensor::randn(0f32, 1.0, (3, 70, 33), &Device::Cpu).unwrap();
        let (y, dx) = output_and_gradient(&x, &w, gelu_erf);
        let (candle_y, candle_dx) = output_and_gradient(&x, &w, |x| x.gelu_erf());
        assert_eq!(y, candle_y);
        assert_close(&dx, &candle_dx, 1e-6, "dx");
        // A derivative that dropped a term would sit far off: gelu'(1) = 1.0833.
        let one = Tensor::new(&[1f32], &Device::Cpu).unwrap();
        let (_, slope) = output_and_gradient(&one, &one.ones_like().unwrap(), gelu_erf);
        assert!((slope[0] - 1.0833).abs() < 1e-3, "gelu'(1) = {}", slope[0]);
    }

    #[test]
    fn softmax_matches_candle_with_masked_rows() {
        let mut x = Tensor::randn(0f32, 3.0, (2, 3, 17, 29), &Device::Cpu).unwrap();
        // The encoder's padding mask adds the most negative f32 to some scores.
        let mask: Vec<f32> = (0..29).map(|j| if j % 5 == 4 { f32::MIN } else { 0.0 }).collect();
        x = x.broadcast_add(&Tensor::new(mask.as_slice(), &Device::Cpu).unwrap()).unwrap();
        let w = Tensor::randn(0f32, 1.0, (2, 3, 17, 29), &Device::Cpu).unwrap();
        let (y, dx) = output_and_gradient(&x, &w, softmax_last_dim);
        let (candle_y, candle_dx) = output_and_gradient(&x, &w, |x| candle_nn::ops::softmax(x, D::Minus1));
        assert_close(&y, &candle_y, 1e-6, "y");
        assert_close(&dx, &candle_dx, 1e-6, "dx");
        for row in y.chunks(29) {
            assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-5);
            assert!(row.iter().skip(4).step_by(5).all(|&p| p == 0.0), "masked scores get no weight");
        }
    }

    #[test]
    fn other_dtypes_take_candles_expressions() {
        let x = Tensor::randn(0f32, 1.0, (4, 8), &Device::Cpu).unwrap().to_dtype(DType::F64).unwrap();
        let ours = softmax_last_dim(&x).unwrap().to_vec2::<f64>().unwrap();
        let candle = candle_nn::ops::softmax(&x, D::Minus1).unwrap().to_vec2::<f64>().unwrap();
        assert_eq!(ours, candle);
        assert_eq!(gelu_erf(&x).unwrap().to_vec2::<f64>().unwrap(), x.gelu_erf().unwrap().to_vec2::<f64>().unwrap());
    }
}
