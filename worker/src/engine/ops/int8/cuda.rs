//! `int8.cu`'s launches. Scales: a block per row takes its absmax into the zeroed scales with
//! `atomicMax` on the float's bits, then one thread per scale divides by 127. Quantise and
//! dequantise: one grid-stride pass, the scale indexed by row (per channel) or 0.

use super::{
    per_channel, sums_dims, DequantizeInt8, DequantizeSums, Granularity, Int8Scales, QuantizeInt8,
};
use crate::engine::ops::cuda::launch::{cuda_module, float_kernel, operands};
use crate::engine::ops::cuda::plan::{ELEMENTWISE_THREADS, ROW_THREADS};
use crate::engine::ops::cuda::{Arg, CudaKernel, Launch, Module, Operand, Output, Plan};
use candle_core::{bail, CustomOp1, CustomOp2, DType, Result, Shape};

const MODULE: Module = cuda_module!("int8", probe: "int8_dequantize");

impl CudaKernel for Int8Scales {
    const MODULE: Module = MODULE;

    fn plan(&self, inputs: &[Operand]) -> Result<Plan> {
        let op = self.name();
        let [x] = operands(op, inputs)?;
        let (rows, cols) = x.rows_cols(op)?;
        let per_channel = self.granularity == Granularity::PerChannel;
        let n = if per_channel { rows } else { 1 };
        let absmax = Launch {
            kernel: float_kernel(op, "int8_absmax", x.dtype)?,
            grid: (rows.min(1 << 16) as u32, 1, 1),
            threads: ROW_THREADS,
            shared_bytes: 0,
            args: vec![
                Arg::Input(0),
                Arg::Output,
                Arg::I32(rows as i32),
                Arg::I32(cols as i32),
                Arg::I32(per_channel as i32),
            ],
        };
        let finish = Launch {
            kernel: "int8_scales_finish".into(),
            grid: (n.div_ceil(ELEMENTWISE_THREADS as usize) as u32, 1, 1),
            threads: ELEMENTWISE_THREADS,
            shared_bytes: 0,
            args: vec![Arg::Output, Arg::I32(n as i32)],
        };
        Ok(Plan {
            op,
            // Zeroed: the maxima are accumulated into it with atomicMax.
            output: Output {
                dtype: DType::F32,
                shape: Shape::from(n),
                zeroed: true,
            },
            launches: vec![absmax, finish],
        })
    }
}

/// Checks the scales against a `[rows, _]` tensor and says whether they are per channel.
fn scales(op: &str, rows: usize, scales: &Operand) -> Result<bool> {
    scales.expect_dtype(DType::F32, op, "scales")?;
    per_channel(op, scales.shape.elem_count(), rows)
}

/// One grid-stride pass of `kernel` over `[rows, cols]` into an output of `dtype`.
fn elementwise(
    op: &'static str,
    kernel: String,
    (rows, cols): (usize, usize),
    per_channel: bool,
    dtype: DType,
) -> Plan {
    let n = rows * cols;
    let args = vec![
        Arg::Input(0),
        Arg::Input(1),
        Arg::Output,
        Arg::U64(n as u64),
        Arg::I32(cols as i32),
        Arg::I32(per_channel as i32),
    ];
    Plan::single(
        op,
        dtype,
        (rows, cols),
        Launch::elementwise(kernel, n, args),
    )
}

impl CudaKernel for QuantizeInt8 {
    const MODULE: Module = MODULE;

    fn plan(&self, inputs: &[Operand]) -> Result<Plan> {
        let op = self.name();
        let [x, s] = operands(op, inputs)?;
        let (rows, cols) = x.rows_cols(op)?;
        let per_channel = scales(op, rows, &s)?;
        let kernel = float_kernel(op, "int8_quantize", x.dtype)?;
        Ok(elementwise(
            op,
            kernel,
            (rows, cols),
            per_channel,
            DType::U8,
        ))
    }
}

impl CudaKernel for DequantizeInt8 {
    const MODULE: Module = MODULE;

    fn plan(&self, inputs: &[Operand]) -> Result<Plan> {
        let op = self.name();
        let [q, s] = operands(op, inputs)?;
        let (rows, cols) = q.rows_cols(op)?;
        if q.dtype != DType::U8 {
            bail!("{op}: q must be u8 (int8 bytes), got {:?}", q.dtype);
        }
        let per_channel = scales(op, rows, &s)?;
        Ok(elementwise(
            op,
            "int8_dequantize".into(),
            (rows, cols),
            per_channel,
            DType::F32,
        ))
    }
}

impl CudaKernel for DequantizeSums {
    const MODULE: Module = MODULE;

    fn plan(&self, inputs: &[Operand]) -> Result<Plan> {
        let op = self.name();
        let [sums, params] = operands(op, inputs)?;
        sums.expect_dtype(DType::U32, op, "the sums (i32 bits)")?;
        params.expect_dtype(DType::F32, op, "params")?;
        let (rows, ld, cols) = sums_dims(op, sums.shape, params.shape)?;
        let n = rows * cols;
        let args = vec![
            Arg::Input(0),
            Arg::Input(1),
            Arg::Output,
            Arg::U64(n as u64),
            Arg::I32(cols as i32),
            Arg::I32(ld as i32),
        ];
        Ok(Plan::single(
            op,
            DType::F32,
            (rows, cols),
            Launch::elementwise("int8_dequantize_sums".into(), n, args),
        ))
    }
}
