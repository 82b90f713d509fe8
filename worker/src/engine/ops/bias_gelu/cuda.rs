//! `bias_gelu.cu`'s launch: one grid-stride pass over the `[rows, cols]` elements.

use super::BiasGelu;
use crate::engine::ops::cuda::launch::{cuda_module, float_kernel, operands};
use crate::engine::ops::cuda::{Arg, CudaKernel, Launch, Module, Operand, Plan};
use candle_core::{bail, CustomOp2, Result};

impl CudaKernel for BiasGelu {
    const MODULE: Module = cuda_module!("bias_gelu", probe: "bias_gelu_f32");

    fn plan(&self, inputs: &[Operand]) -> Result<Plan> {
        let op = self.name();
        let [x, bias] = operands(op, inputs)?;
        let (rows, cols) = x.rows_cols(op)?;
        if bias.shape.elem_count() != cols {
            bail!(
                "{op}: bias has {} values for {cols} columns",
                bias.shape.elem_count()
            );
        }
        bias.same_dtype_as(&x, op, "bias")?;
        let n = rows * cols;
        let args = vec![
            Arg::Input(0),
            Arg::Input(1),
            Arg::Output,
            Arg::U64(n as u64),
            Arg::I32(cols as i32),
        ];
        let launch = Launch::elementwise(float_kernel(op, "bias_gelu", x.dtype)?, n, args);
        Ok(Plan::single(op, x.dtype, (rows, cols), launch))
    }
}
