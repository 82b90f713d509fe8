//! Symmetric int8 quantisation of a 2-D tensor, per tensor or per channel, for mixed-precision
//! training (QSync's int8 layers) and int8 weights:
//! `scale = absmax / 127`, `q = clamp(round_half_even(x / scale), -127, 127)`, `x' = q · scale`.
//! A channel is a row of `[channels, k]`: the output channel of an `[out, in]` weight.
//!
//! Three ops, so the scales stay a tensor on the input's device and a GPU never syncs to
//! read them: [`Int8Scales`] (x → scales), [`QuantizeInt8`] (x, scales → q) and
//! [`DequantizeInt8`] (q, scales → f32). candle has no i8 dtype: `q` is a `u8` tensor holding
//! each value's two's-complement byte (`q as i8` reads it back). Whether scales are per tensor
//! or per channel follows from their length (1 or `channels`).

mod cuda;

use super::contiguous_f32;
use candle_core::backend::BackendStorage as _;
use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape};

/// How many scales a tensor gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Granularity {
    /// One scale for the whole tensor.
    PerTensor,
    /// One scale per row (output channel).
    PerChannel,
}

/// `x [rows, cols]` → f32 scales `[1]` or `[rows]`. An all-zero tensor (or row) gets scale 0
/// and quantises to zeros.
#[derive(Debug, Clone, Copy)]
pub struct Int8Scales {
    pub granularity: Granularity,
}

/// `(x [rows, cols], scales)` → `q [rows, cols]` as `u8` holding `i8` bytes.
#[derive(Debug, Clone, Copy, Default)]
pub struct QuantizeInt8;

/// `(q [rows, cols] u8, scales)` → f32 `[rows, cols]`.
#[derive(Debug, Clone, Copy, Default)]
pub struct DequantizeInt8;

/// `(sums [rows, ld] u32, params [2 + cols] f32)` → f32 `[rows, cols]`:
/// `sums[r, c] as i32 · (params[0] · params[1]) + params[2 + c]`, each product and the sum
/// rounded on its own. The i32 sums of an int8 GEMM (`u32` holding each sum's bits, as `q`
/// holds i8 bytes in `u8`) dequantised with the two operands' per-tensor scales (`params[..2]`)
/// plus the bias (the rest: one buffer, so the kernel's arguments stay few); `ld ≥ cols` lets
/// the GEMM pad its rows.
#[derive(Debug, Clone, Copy, Default)]
pub struct DequantizeSums;

/// Round to nearest, ties to even, clamped to the symmetric int8 range; scale 0 gives 0.
pub(crate) fn quantize_value(x: f32, scale: f32) -> i8 {
    if scale > 0.0 {
        (x / scale).round_ties_even().clamp(-127.0, 127.0) as i8
    } else {
        0
    }
}

/// Whether `scales` (of length `len`) are per row of a `[rows, _]` tensor, or else per
/// tensor; anything else is refused.
pub(crate) fn per_channel(op: &str, len: usize, rows: usize) -> Result<bool> {
    match len {
        1 => Ok(false),
        n if n == rows => Ok(true),
        n => bail!(
            "{op}: {n} scales for {rows} rows; expected 1 (per tensor) or {rows} (per channel)"
        ),
    }
}

impl CustomOp1 for Int8Scales {
    fn name(&self) -> &'static str {
        "int8-scales"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (rows, cols) = l.shape().dims2()?;
        let x = contiguous_f32(self.name(), "input", s, l)?;
        let absmax = |values: &[f32]| values.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scales: Vec<f32> = match self.granularity {
            Granularity::PerTensor => vec![absmax(x) / 127.0],
            Granularity::PerChannel if cols == 0 => vec![0.0; rows],
            Granularity::PerChannel => x.chunks_exact(cols).map(|r| absmax(r) / 127.0).collect(),
        };
        let n = scales.len();
        Ok((CpuStorage::F32(scales), Shape::from(n)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::run(self, &[(s, l)])
    }
}

impl CustomOp2 for QuantizeInt8 {
    fn name(&self) -> &'static str {
        "quantize-int8"
    }

    fn cpu_fwd(
        &self,
        x_s: &CpuStorage,
        x_l: &Layout,
        s_s: &CpuStorage,
        s_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let name = self.name();
        let (rows, cols) = x_l.shape().dims2()?;
        let x = contiguous_f32(name, "input", x_s, x_l)?;
        let scales = contiguous_f32(name, "scales", s_s, s_l)?;
        let per_row = per_channel(name, scales.len(), rows)?;
        let q: Vec<u8> = x
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let scale = scales[if per_row { i / cols } else { 0 }];
                quantize_value(*v, scale) as u8
            })
            .collect();
        Ok((CpuStorage::U8(q), Shape::from((rows, cols))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x_s: &candle_core::CudaStorage,
        x_l: &Layout,
        s_s: &candle_core::CudaStorage,
        s_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::run(self, &[(x_s, x_l), (s_s, s_l)])
    }
}

impl CustomOp2 for DequantizeInt8 {
    fn name(&self) -> &'static str {
        "dequantize-int8"
    }

    fn cpu_fwd(
        &self,
        q_s: &CpuStorage,
        q_l: &Layout,
        s_s: &CpuStorage,
        s_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let name = self.name();
        let (rows, cols) = q_l.shape().dims2()?;
        let q = match (q_s, q_l.contiguous_offsets()) {
            (CpuStorage::U8(data), Some((start, end))) => &data[start..end],
            (CpuStorage::U8(_), None) => bail!("{name}: q must be contiguous"),
            (other, _) => bail!("{name}: q must be u8 (int8 bytes), got {:?}", other.dtype()),
        };
        let scales = contiguous_f32(name, "scales", s_s, s_l)?;
        let per_row = per_channel(name, scales.len(), rows)?;
        let out: Vec<f32> = q
            .iter()
            .enumerate()
            .map(|(i, v)| *v as i8 as f32 * scales[if per_row { i / cols } else { 0 }])
            .collect();
        Ok((CpuStorage::F32(out), Shape::from((rows, cols))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q_s: &candle_core::CudaStorage,
        q_l: &Layout,
        s_s: &candle_core::CudaStorage,
        s_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::run(self, &[(q_s, q_l), (s_s, s_l)])
    }
}

/// The dims `(rows, ld, cols)` of a [`DequantizeSums`], checked as its CPU and CUDA paths
/// both need them.
pub(crate) fn sums_dims(op: &str, sums: &Shape, params: &Shape) -> Result<(usize, usize, usize)> {
    let (rows, ld) = sums.dims2()?;
    let len = params.dims1()?;
    if len < 3 || len - 2 > ld {
        bail!("{op}: {len} parameters (the two scales, then the bias) for sums of {ld} columns; expected 3..={}", ld + 2);
    }
    Ok((rows, ld, len - 2))
}

impl CustomOp2 for DequantizeSums {
    fn name(&self) -> &'static str {
        "int8-dequantize-sums"
    }

    fn cpu_fwd(
        &self,
        a_s: &CpuStorage,
        a_l: &Layout,
        p_s: &CpuStorage,
        p_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let name = self.name();
        let (rows, ld, cols) = sums_dims(name, a_l.shape(), p_l.shape())?;
        let sums = match (a_s, a_l.contiguous_offsets()) {
            (CpuStorage::U32(data), Some((start, end))) => &data[start..end],
            (CpuStorage::U32(_), None) => bail!("{name}: the sums must be contiguous"),
            (other, _) => bail!(
                "{name}: the sums must be u32 (i32 bits), got {:?}",
                other.dtype()
            ),
        };
        let params = contiguous_f32(name, "params", p_s, p_l)?;
        let (scale, bias) = (params[0] * params[1], &params[2..]);
        let mut out = Vec::with_capacity(rows * cols);
        for row in sums.chunks_exact(ld) {
            out.extend(
                row[..cols]
                    .iter()
                    .zip(bias)
                    .map(|(a, b)| *a as i32 as f32 * scale + b),
            );
        }
        Ok((CpuStorage::F32(out), Shape::from((rows, cols))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        a_s: &candle_core::CudaStorage,
        a_l: &Layout,
        p_s: &candle_core::CudaStorage,
        p_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::run(self, &[(a_s, a_l), (p_s, p_l)])
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_inputs::Rng;
    use super::*;
    use candle_core::{DType, Device, Tensor};

    #[test]
    fn rounds_half_to_even_and_clamps_to_the_symmetric_range() {
        assert_eq!(quantize_value(2.5, 1.0), 2);
        assert_eq!(quantize_value(3.5, 1.0), 4);
        assert_eq!(quantize_value(-2.5, 1.0), -2);
        assert_eq!(quantize_value(1000.0, 1.0), 127);
        assert_eq!(quantize_value(-1000.0, 1.0), -127);
        assert_eq!(quantize_value(5.0, 0.0), 0);
    }

    #[test]
    fn round_trip_error_is_at_most_half_a_step() {
        let mut rng = Rng::new(51);
        let x = rng.tensor(&[7, 33], 3.0);
        let flat = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for granularity in [Granularity::PerTensor, Granularity::PerChannel] {
            let scales = x.apply_op1_no_bwd(&Int8Scales { granularity }).unwrap();
            let q = x.apply_op2_no_bwd(&scales, &QuantizeInt8).unwrap();
            assert_eq!(q.dtype(), DType::U8);
            let back = q.apply_op2_no_bwd(&scales, &DequantizeInt8).unwrap();
            let s = scales.to_vec1::<f32>().unwrap();
            let back = back.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            // The largest magnitude maps to ±127 exactly, so no value is clamped.
            let q = q.flatten_all().unwrap().to_vec1::<u8>().unwrap();
            assert!(q.iter().any(|v| (*v as i8).unsigned_abs() == 127));
            for (i, (a, b)) in flat.iter().zip(&back).enumerate() {
                let step = s[if granularity == Granularity::PerChannel {
                    i / 33
                } else {
                    0
                }];
                assert!(
                    (a - b).abs() <= step / 2.0 + 1e-6,
                    "{granularity:?} [{i}]: {a} vs {b}"
                );
            }
        }
    }

    #[test]
    fn per_channel_scales_follow_each_rows_absmax() {
        let x = Tensor::new(
            &[[1f32, -4.0, 2.1], [0.0, 0.0, 0.0], [0.5, 0.25, -0.127]],
            &Device::Cpu,
        )
        .unwrap();
        let per_row = x
            .apply_op1_no_bwd(&Int8Scales {
                granularity: Granularity::PerChannel,
            })
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(per_row, vec![4.0 / 127.0, 0.0, 0.5 / 127.0]);
        let q = x
            .apply_op2_no_bwd(
                &Tensor::new(per_row.as_slice(), &Device::Cpu).unwrap(),
                &QuantizeInt8,
            )
            .unwrap()
            .to_vec2::<u8>()
            .unwrap();
        assert_eq!(
            q[0].iter().map(|v| *v as i8).collect::<Vec<_>>(),
            [32, -127, 67]
        );
        assert_eq!(q[1], [0, 0, 0]);
    }

    #[test]
    fn dequantises_i32_sums_of_a_padded_gemm() {
        // Rows of 4 sums of which the first 3 are the output's columns; -5 as i32 bits.
        let sums = Tensor::new(
            &[[7u32, (-5i32) as u32, 0, 99], [1, 2, 3, 99]],
            &Device::Cpu,
        )
        .unwrap();
        // Scales 0.5 and 0.25, then the bias.
        let params = Tensor::new(&[0.5f32, 0.25, 1.0, 0.0, -1.0], &Device::Cpu).unwrap();
        let out = sums.apply_op2_no_bwd(&params, &DequantizeSums).unwrap();
        assert_eq!(
            out.to_vec2::<f32>().unwrap(),
            [[1.875, -0.625, -1.0], [1.125, 0.25, -0.625]]
        );
        for len in [2, 7] {
            let wrong = Tensor::zeros(len, DType::F32, &Device::Cpu).unwrap();
            assert!(
                sums.apply_op2_no_bwd(&wrong, &DequantizeSums).is_err(),
                "{len} parameters"
            );
        }
    }

    #[test]
    fn refuses_scales_that_match_neither_granularity() {
        let x = Tensor::zeros((4, 2), DType::F32, &Device::Cpu).unwrap();
        let scales = Tensor::ones(3, DType::F32, &Device::Cpu).unwrap();
        let err = x.apply_op2_no_bwd(&scales, &QuantizeInt8).unwrap_err();
        assert!(err.to_string().contains("3 scales for 4 rows"), "{err}");
    }
}
