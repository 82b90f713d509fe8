//! `pooling.cu`'s launch: one block per sequence, whose rows `cu_seqlens` gives.

use super::{Pooling, SegmentedPool};
use crate::engine::ops::cuda::launch::{cuda_module, float_kernel, operands};
use crate::engine::ops::cuda::plan::POOL_THREADS;
use crate::engine::ops::cuda::{Arg, CudaKernel, Launch, Module, Operand, Plan};
use candle_core::{bail, CustomOp2, DType, Result};

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
        let kernel = float_kernel(op, "segmented_pool", hidden.dtype)?;
        // POOL_MEAN / POOL_CLS / POOL_MAX in pooling.cu.
        let mode = match self.pooling {
            Pooling::Mean => 0,
            Pooling::Cls => 1,
            Pooling::Max => 2,
        };
        let args = vec![
            Arg::Input(0),
            Arg::Input(1),
            Arg::Output,
            Arg::I32(cols as i32),
            Arg::I32(mode),
            Arg::I32(self.normalize as i32),
        ];
        let launch = Launch::per_row(op, kernel, (sequences, cols), POOL_THREADS, args)?;
        Ok(Plan::single(op, hidden.dtype, (sequences, cols), launch))
    }
}
