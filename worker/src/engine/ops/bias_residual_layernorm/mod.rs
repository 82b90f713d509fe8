//! `LayerNorm(x + bias + residual)` over `[T, H]`: the epilogue of the attention-output and
//! second feed-forward GEMMs (ByteTransformer's `add_bias_input_layernorm`). Statistics are
//! kept in f32 with a two-pass variance, as PyTorch's LayerNorm computes them.
//!
//! The per-row vectors are packed at load time into one `[3, H]` tensor (bias, gamma, beta),
//! so the op stays a `CustomOp3`: `(x, residual, params)`.

mod cuda;

use super::{contiguous_f32, has_avx2_fma, rows_per_task};
use candle_core::{bail, CpuStorage, CustomOp3, Layout, Result, Shape};
use rayon::prelude::*;

#[derive(Debug, Clone, Copy)]
pub struct BiasResidualLayerNorm {
    pub eps: f32,
}

impl CustomOp3 for BiasResidualLayerNorm {
    fn name(&self) -> &'static str {
        "bias-residual-layernorm"
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x_s: &candle_core::CudaStorage,
        x_l: &Layout,
        r_s: &candle_core::CudaStorage,
        r_l: &Layout,
        p_s: &candle_core::CudaStorage,
        p_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::run(self, &[(x_s, x_l), (r_s, r_l), (p_s, p_l)])
    }

    fn cpu_fwd(
        &self,
        x_s: &CpuStorage,
        x_l: &Layout,
        r_s: &CpuStorage,
        r_l: &Layout,
        p_s: &CpuStorage,
        p_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let name = self.name();
        let (rows, cols) = shapes(name, x_l.shape(), r_l.shape(), p_l.shape())?;
        let x = contiguous_f32(name, "input", x_s, x_l)?;
        let residual = contiguous_f32(name, "residual", r_s, r_l)?;
        let params = contiguous_f32(name, "params", p_s, p_l)?;
        let (bias, rest) = params.split_at(cols);
        let (gamma, beta) = rest.split_at(cols);

        let mut out = vec![0f32; rows * cols];
        if cols > 0 {
            let chunk = rows_per_task(rows, cols) * cols;
            let fast = has_avx2_fma();
            let eps = self.eps;
            out.par_chunks_mut(chunk)
                .zip(x.par_chunks(chunk).zip(residual.par_chunks(chunk)))
                .for_each(|(o, (x, r))| {
                    let rows = o
                        .chunks_exact_mut(cols)
                        .zip(x.chunks_exact(cols).zip(r.chunks_exact(cols)));
                    for (o, (x, r)) in rows {
                        let row = Row {
                            x,
                            residual: r,
                            bias,
                            gamma,
                            beta,
                            eps,
                        };
                        if fast {
                            #[cfg(target_arch = "x86_64")]
                            // SAFETY: AVX2+FMA detected.
                            unsafe {
                                row_avx2(&row, o)
                            }
                        } else {
                            row_generic(&row, o)
                        }
                    }
                });
        }
        Ok((CpuStorage::F32(out), Shape::from((rows, cols))))
    }
}

/// The input's `[rows, cols]`, once the residual is checked to match it and the params to be
/// `[3, cols]`.
fn shapes(name: &str, x: &Shape, residual: &Shape, params: &Shape) -> Result<(usize, usize)> {
    let (rows, cols) = x.dims2()?;
    if residual.dims() != [rows, cols] {
        bail!("{name}: residual is {residual:?}, input is [{rows}, {cols}]");
    }
    if params.dims() != [3, cols] {
        bail!("{name}: params must be [3, {cols}] (bias, gamma, beta), got {params:?}");
    }
    Ok((rows, cols))
}

struct Row<'a> {
    x: &'a [f32],
    residual: &'a [f32],
    bias: &'a [f32],
    gamma: &'a [f32],
    beta: &'a [f32],
    eps: f32,
}

/// Eight running partial sums, so the reductions vectorise without reassociating one chain.
#[inline(always)]
fn lane_sum(values: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0f32; 8];
    let mut chunks = values.chunks_exact(8);
    for c in &mut chunks {
        for k in 0..8 {
            acc[k] += f(c[k]);
        }
    }
    let tail: f32 = chunks.remainder().iter().map(|&v| f(v)).sum();
    acc.iter().sum::<f32>() + tail
}

#[inline(always)]
fn row_body(row: &Row, out: &mut [f32]) {
    for (((o, x), r), b) in out.iter_mut().zip(row.x).zip(row.residual).zip(row.bias) {
        *o = x + b + r;
    }
    let n = out.len() as f32;
    let mean = lane_sum(out, |v| v) / n;
    let var = lane_sum(out, |v| (v - mean) * (v - mean)) / n;
    let inv_std = 1.0 / (var + row.eps).sqrt();
    for ((o, g), b) in out.iter_mut().zip(row.gamma).zip(row.beta) {
        *o = (*o - mean) * inv_std * g + b;
    }
}

fn row_generic(row: &Row, out: &mut [f32]) {
    row_body(row, out)
}

/// The same body compiled for AVX2, so the element loops use 8-wide vectors.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn row_avx2(row: &Row, out: &mut [f32]) {
    row_body(row, out)
}

#[cfg(test)]
mod tests {
    use super::super::test_inputs::{max_abs_diff, Rng};
    use super::*;

    fn reference(x: &[f32], r: &[f32], p: &[f32], cols: usize, eps: f64) -> Vec<f64> {
        let mut out = Vec::with_capacity(x.len());
        for (x, r) in x.chunks(cols).zip(r.chunks(cols)) {
            let y: Vec<f64> = (0..cols)
                .map(|c| x[c] as f64 + r[c] as f64 + p[c] as f64)
                .collect();
            let mean = y.iter().sum::<f64>() / cols as f64;
            let var = y.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / cols as f64;
            for c in 0..cols {
                out.push(
                    (y[c] - mean) / (var + eps).sqrt() * p[cols + c] as f64
                        + p[2 * cols + c] as f64,
                );
            }
        }
        out
    }

    #[test]
    fn matches_a_naive_layernorm_of_input_plus_bias_plus_residual() {
        let mut rng = Rng::new(21);
        for (rows, cols) in [(64, 384), (3, 13), (1, 1)] {
            // An offset in the input checks the variance is not computed as E[x²] - E[x]².
            let x = (rng.tensor(&[rows, cols], 3.0) + 100.0).unwrap();
            let r = rng.tensor(&[rows, cols], 3.0);
            let p = rng.tensor(&[3, cols], 1.0);
            let op = BiasResidualLayerNorm { eps: 1e-12 };
            let got = x.apply_op3_no_bwd(&r, &p, &op).unwrap();
            let flat = |t: &candle_core::Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let want = reference(&flat(&x), &flat(&r), &flat(&p), cols, 1e-12);
            let diff = max_abs_diff(&flat(&got), &want);
            // A single column normalises to exactly beta; otherwise f32 rounding of ~100.
            assert!(diff < 1e-3, "[{rows}, {cols}]: max diff {diff}");
        }
    }

    #[test]
    fn rejects_params_that_are_not_bias_gamma_beta() {
        let mut rng = Rng::new(22);
        let x = rng.tensor(&[2, 4], 1.0);
        let p = rng.tensor(&[2, 4], 1.0);
        assert!(x
            .apply_op3_no_bwd(&x, &p, &BiasResidualLayerNorm { eps: 1e-5 })
            .is_err());
    }
}
