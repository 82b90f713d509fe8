//! Sentence pooling over packed tokens: one pass that reduces each sequence's rows (segments
//! given by `cu_seqlens`) to a vector, optionally L2-normalised. This replaces TEI's loop of
//! narrow+sum per sequence with a single kernel.
//!
//! Inputs: hidden states `[T, H]`, `cu_seqlens` `[n + 1]` u32. Output: `[n, H]`.

mod cuda;

use super::{contiguous_f32, cu_seqlens};
use candle_core::{bail, CpuStorage, CustomOp2, Layout, Result, Shape};
use rayon::prelude::*;

/// How token vectors become one sentence vector (sentence-transformers' `Pooling` modes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// Average over the sequence's tokens (`pooling_mode_mean_tokens`).
    Mean,
    /// The first token, `[CLS]` (`pooling_mode_cls_token`).
    Cls,
    /// Element-wise maximum over the tokens (`pooling_mode_max_tokens`).
    Max,
}

#[derive(Debug, Clone, Copy)]
pub struct SegmentedPool {
    pub pooling: Pooling,
    /// Divide each pooled vector by its L2 norm (sentence-transformers' `Normalize`, which
    /// uses `F.normalize` with eps 1e-12).
    pub normalize: bool,
}

impl CustomOp2 for SegmentedPool {
    fn name(&self) -> &'static str {
        "segmented-pool"
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        h_s: &candle_core::CudaStorage,
        h_l: &Layout,
        cu_s: &candle_core::CudaStorage,
        cu_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::run(self, &[(h_s, h_l), (cu_s, cu_l)])
    }

    fn cpu_fwd(
        &self,
        h_s: &CpuStorage,
        h_l: &Layout,
        cu_s: &CpuStorage,
        cu_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let name = self.name();
        let (tokens, hidden) = h_l.shape().dims2()?;
        let h = contiguous_f32(name, "hidden states", h_s, h_l)?;
        let cu = cu_seqlens(name, cu_s, cu_l, tokens)?;
        let n = cu.len() - 1;
        if let Some(i) = cu.windows(2).position(|w| w[0] == w[1]) {
            bail!("{name}: sequence {i} is empty");
        }
        let mut out = vec![0f32; n * hidden];
        if hidden > 0 {
            out.par_chunks_mut(hidden).enumerate().for_each(|(i, o)| {
                let (start, end) = (cu[i] as usize, cu[i + 1] as usize);
                let rows = h[start * hidden..end * hidden].chunks_exact(hidden);
                match self.pooling {
                    Pooling::Cls => o.copy_from_slice(&h[start * hidden..(start + 1) * hidden]),
                    Pooling::Mean => {
                        for row in rows {
                            for (o, v) in o.iter_mut().zip(row) {
                                *o += v;
                            }
                        }
                        let inv = 1.0 / (end - start) as f32;
                        o.iter_mut().for_each(|v| *v *= inv);
                    }
                    Pooling::Max => {
                        o.fill(f32::NEG_INFINITY);
                        for row in rows {
                            for (o, v) in o.iter_mut().zip(row) {
                                *o = o.max(*v);
                            }
                        }
                    }
                }
                if self.normalize {
                    let norm = o.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-12);
                    o.iter_mut().for_each(|v| *v /= norm);
                }
            });
        }
        Ok((CpuStorage::F32(out), Shape::from((n, hidden))))
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_inputs::{cu_seqlens, max_abs_diff, Rng};
    use super::*;

    fn reference(
        h: &[f32],
        cu: &[u32],
        cols: usize,
        pooling: Pooling,
        normalize: bool,
    ) -> Vec<f64> {
        let mut out = Vec::new();
        for w in cu.windows(2) {
            let rows: Vec<&[f32]> = (w[0] as usize..w[1] as usize)
                .map(|t| &h[t * cols..(t + 1) * cols])
                .collect();
            let mut v: Vec<f64> = (0..cols)
                .map(|c| {
                    let column = rows.iter().map(|r| r[c] as f64);
                    match pooling {
                        Pooling::Mean => column.sum::<f64>() / rows.len() as f64,
                        Pooling::Cls => rows[0][c] as f64,
                        Pooling::Max => column.fold(f64::NEG_INFINITY, f64::max),
                    }
                })
                .collect();
            if normalize {
                let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
                v.iter_mut().for_each(|x| *x /= norm);
            }
            out.extend(v);
        }
        out
    }

    #[test]
    fn pools_each_sequence_over_its_own_tokens_only() {
        let mut rng = Rng::new(31);
        let lens = rng.lengths(11, 64);
        let (cu, cu_t) = cu_seqlens(&lens);
        let cols = 40;
        let h = rng.tensor(&[*cu.last().unwrap() as usize, cols], 2.0);
        let flat = h.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for pooling in [Pooling::Mean, Pooling::Cls, Pooling::Max] {
            for normalize in [false, true] {
                let got = h
                    .apply_op2_no_bwd(&cu_t, &SegmentedPool { pooling, normalize })
                    .unwrap();
                assert_eq!(got.dims(), &[lens.len(), cols]);
                let want = reference(&flat, &cu, cols, pooling, normalize);
                let diff =
                    max_abs_diff(&got.flatten_all().unwrap().to_vec1::<f32>().unwrap(), &want);
                assert!(
                    diff < 1e-5,
                    "{pooling:?} normalize={normalize}: max diff {diff}"
                );
            }
        }
    }

    #[test]
    fn refuses_an_empty_sequence() {
        let mut rng = Rng::new(32);
        let h = rng.tensor(&[3, 4], 1.0);
        let (_, cu) = cu_seqlens(&[3, 0]);
        let op = SegmentedPool {
            pooling: Pooling::Mean,
            normalize: false,
        };
        assert!(h.apply_op2_no_bwd(&cu, &op).is_err());
    }
}
