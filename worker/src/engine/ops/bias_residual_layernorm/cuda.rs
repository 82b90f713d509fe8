//! `bias_residual_layernorm.cu`'s launch: one block per row, the row kept in shared memory
//! for the two-pass variance.

use super::{shapes, BiasResidualLayerNorm};
use crate::engine::ops::cuda::launch::{cuda_module, float_kernel, operands};
use crate::engine::ops::cuda::plan::ROW_THREADS;
use crate::engine::ops::cuda::{Arg, CudaKernel, Launch, Module, Operand, Plan};
use candle_core::{CustomOp3, Result};

impl CudaKernel for BiasResidualLayerNorm {
    const MODULE: Module =
        cuda_module!("bias_residual_layernorm", probe: "bias_residual_layernorm_f32");

    fn plan(&self, inputs: &[Operand]) -> Result<Plan> {
        let op = self.name();
        let [x, residual, params] = operands(op, inputs)?;
        x.rows_cols(op)?;
        let (rows, cols) = shapes(op, x.shape, residual.shape, params.shape)?;
        residual.same_dtype_as(&x, op, "residual")?;
        params.same_dtype_as(&x, op, "params")?;
        let kernel = float_kernel(op, "bias_residual_layernorm", x.dtype)?;
        let args = vec![
            Arg::Input(0),
            Arg::Input(1),
            Arg::Input(2),
            Arg::Output,
            Arg::I32(cols as i32),
            Arg::F32(self.eps),
        ];
        let launch = Launch::per_row(op, kernel, (rows, cols), ROW_THREADS, args)?;
        Ok(Plan::single(op, x.dtype, (rows, cols), launch))
    }
}
