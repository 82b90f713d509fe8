//! `pooling.cu`'s launch: one block per sequence, whose rows `cu_seqlens` gives.

use super::{Pooling, SegmentedPool};
use crate::engine::ops::cuda::launch::{cuda_module, float_kernel, operands, plan_error};
use crate::engine::ops::cuda::plan::{row_shared_bytes, POOL_THREADS};
use crate::engine::ops::cuda::{Arg, CudaKernel, Launch, Module, Operand, Output, Plan};
use candle_core::{bail, CustomOp2, DType, Result, Shape};

impl CudaKernel for SegmentedPool {
    const MODULE: Module = cuda_module!("pooling", probe: "segmented_pool_f32");

    fn plan(&self, inputs: &[Operand]) -> Result<Plan> {
        let op = self.name();
        let [hidden, cu_seqlens] = operands(op, inputs)?;
        let (_, cols) = hidden.rows_cols(op)?;
        cu_seqlens.expect_dtype(DType::U32, op, "cu_seqlens")?;
        let sequences = cu_seqlens.shape.elem_count().saturating_sub(1);
        if sequences == 0 {
            bail!("{op}: cu_seqlens names no sequence");
        }
        let shared_bytes = row_shared_bytes(cols).map_err(plan_error(op))?;
        let kernel = float_kernel(op, "segmented_pool", hidden.dtype)?;
        // POOL_MEAN / POOL_CLS / POOL_MAX in pooling.cu.
        let mode = match self.pooling {
            Pooling::Mean => 0,
            Pooling::Cls => 1,
            Pooling::Max => 2,
        };
        Ok(Plan {
            op,
            output: Output {
                dtype: hidden.dtype,
                shape: Shape::from((sequences, cols)),
                zeroed: false,
            },
            launches: vec![Launch {
                kernel,
                grid: (sequences as u32, 1, 1),
                threads: POOL_THREADS,
                shared_bytes,
                args: vec![
                    Arg::Input(0),
                    Arg::Input(1),
                    Arg::Output,
                    Arg::I32(cols as i32),
                    Arg::I32(mode),
                    Arg::I32(self.normalize as i32),
                ],
            }],
        })
    }
}
