//! `gelu(x + bias)` over `[T, I]`, the epilogue of the first feed-forward GEMM. GELU is the
//! exact erf form that BERT and sentence-transformers use, not the tanh approximation TEI
//! falls back to for cuBLASLt.

mod cuda;

use super::vector_math::gelu_scalar;
use super::{contiguous_f32, has_avx2_fma, rows_per_task};
use candle_core::{bail, CpuStorage, CustomOp2, Layout, Result, Shape};
use rayon::prelude::*;

#[derive(Debug, Clone, Copy, Default)]
pub struct BiasGelu;

impl CustomOp2 for BiasGelu {
    fn name(&self) -> &'static str {
        "bias-gelu"
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x_s: &candle_core::CudaStorage,
        x_l: &Layout,
        b_s: &candle_core::CudaStorage,
        b_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::run(self, &[(x_s, x_l), (b_s, b_l)])
    }

    fn cpu_fwd(
        &self,
        x_s: &CpuStorage,
        x_l: &Layout,
        b_s: &CpuStorage,
        b_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let name = self.name();
        let (rows, cols) = x_l.shape().dims2()?;
        let x = contiguous_f32(name, "input", x_s, x_l)?;
        let bias = contiguous_f32(name, "bias", b_s, b_l)?;
        if bias.len() != cols {
            bail!("{name}: bias has {} values for {cols} columns", bias.len());
        }
        let mut out = vec![0f32; rows * cols];
        if cols > 0 {
            let chunk = rows_per_task(rows, cols) * cols;
            let fast = has_avx2_fma();
            out.par_chunks_mut(chunk)
                .zip(x.par_chunks(chunk))
                .for_each(|(o, x)| {
                    for (o_row, x_row) in o.chunks_exact_mut(cols).zip(x.chunks_exact(cols)) {
                        if fast {
                            #[cfg(target_arch = "x86_64")]
                            // SAFETY: AVX2+FMA detected; rows have equal length.
                            unsafe {
                                row_avx2(x_row, bias, o_row)
                            }
                        } else {
                            row_scalar(x_row, bias, o_row)
                        }
                    }
                });
        }
        Ok((CpuStorage::F32(out), Shape::from((rows, cols))))
    }
}

fn row_scalar(x: &[f32], bias: &[f32], out: &mut [f32]) {
    for ((o, x), b) in out.iter_mut().zip(x).zip(bias) {
        *o = gelu_scalar(x + b);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn row_avx2(x: &[f32], bias: &[f32], out: &mut [f32]) {
    use super::vector_math::avx2::gelu;
    use std::arch::x86_64::*;
    let n = x.len() / 8 * 8;
    for i in (0..n).step_by(8) {
        let v = _mm256_add_ps(
            _mm256_loadu_ps(x.as_ptr().add(i)),
            _mm256_loadu_ps(bias.as_ptr().add(i)),
        );
        _mm256_storeu_ps(out.as_mut_ptr().add(i), gelu(v));
    }
    row_scalar(&x[n..], &bias[n..], &mut out[n..]);
}

#[cfg(test)]
mod tests {
    use super::super::test_inputs::{max_abs_diff, Rng};
    use super::*;

    #[test]
    fn matches_candle_gelu_erf_after_the_bias() {
        let mut rng = Rng::new(11);
        // An odd width exercises the scalar tail after the 8-lane loop.
        for (rows, cols) in [(37, 1536), (5, 13), (1, 1)] {
            let x = rng.tensor(&[rows, cols], 6.0);
            let b = rng.tensor(&[cols], 1.0);
            let got = x.apply_op2_no_bwd(&b, &BiasGelu).unwrap();
            let want = x
                .to_dtype(candle_core::DType::F64)
                .unwrap()
                .broadcast_add(&b.to_dtype(candle_core::DType::F64).unwrap())
                .unwrap()
                .gelu_erf()
                .unwrap();
            let diff = max_abs_diff(
                &got.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                &want.flatten_all().unwrap().to_vec1::<f64>().unwrap(),
            );
            assert!(diff < 2e-6, "[{rows}, {cols}]: max diff {diff}");
        }
    }
}
