//! `bias_residual_layernorm.cu`'s launch: one block per row, the row kept in shared memory
//! for the two-pass variance.

use super::{shapes, BiasResidualLayerNorm};
use crate::engine::ops::cuda::launch::{cuda_module, float_kernel, operands, plan_error};
use crate::engine::ops::cuda::plan::{row_shared_bytes, ROW_THREADS};
use crate::engine::ops::cuda::{Arg, CudaKernel, Launch, Module, Operand, Output, Plan};
use candle_core::{CustomOp3, Result, Shape};

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
        let shared_bytes = row_shared_bytes(cols).map_err(plan_error(op))?;
        let kernel = float_kernel(op, "bias_residual_layernorm", x.dtype)?;
        Ok(Plan {
            op,
            output: Output {
                dtype: x.dtype,
                shape: Shape::from((rows, cols)),
                zeroed: false,
            },
            launches: vec![Launch {
                kernel,
                grid: (rows as u32, 1, 1),
                threads: ROW_THREADS,
                shared_bytes,
                args: vec![
                    Arg::Input(0),
                    Arg::Input(1),
                    Arg::Input(2),
                    Arg::Output,
                    Arg::I32(cols as i32),
                    Arg::F32(self.eps),
                ],
            }],
        })
    }
}
