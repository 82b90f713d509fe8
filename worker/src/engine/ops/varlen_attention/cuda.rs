//! `varlen_attention.cu`'s launch, and which of its three kernels runs a batch: decided per
//! batch from the storage type, the head size and the longest sequence, on the host, so
//! nothing about lengths is read back from the GPU (`README.md` beside the ops says how the
//! kernels work).

use super::VarlenAttention;
use crate::engine::ops::cuda::launch::{cuda_module, float_kernel, operands, plan_error};
use crate::engine::ops::cuda::plan::SHARED_LIMIT;
use crate::engine::ops::cuda::{Arg, CudaKernel, Launch, Module, Operand, Plan};
use candle_core::{bail, CustomOp3, DType};

/// Warps per attention block, and query rows each warp owns (`WARPS`, `R` in the kernel).
const ATTENTION_WARPS: usize = 4;
const ROWS_PER_WARP: usize = 4;
/// Query rows per attention block.
pub const ATTENTION_ROWS_PER_BLOCK: usize = ATTENTION_WARPS * ROWS_PER_WARP;
pub const ATTENTION_THREADS: u32 = (ATTENTION_WARPS * 32) as u32;
/// Head sizes the attention kernels are instantiated for.
pub const HEAD_SIZES: [usize; 3] = [32, 64, 128];
/// Head sizes of the tensor-core kernel (f16/bf16 only): those of MiniLM and BERT-base. At
/// 128 its f32 context would not fit the shared memory beside K, V, scores and probabilities.
pub const MMA_HEAD_SIZES: [usize; 2] = [32, 64];
/// The tensor-core kernel takes batches whose longest sequence has at least this many tokens
/// (two of its 64-row query blocks). Chosen without a GPU measurement of the switch: on the
/// H200 run of 2026-11-28 the CUDA-core kernels already cost more than the GEMMs from max 128
/// up (bench/results/gpu_serving.md); the next GPU run should place it.
pub const MMA_MIN_LEN: usize = 128;
/// The tensor-core kernel's geometry (`MMA_*` in the kernel): query rows per warp and per
/// block, keys per tile, and the 16-bit elements of padding per shared row.
const MMA_ROWS: usize = 16;
const MMA_ROWS_PER_BLOCK: usize = ATTENTION_WARPS * MMA_ROWS;
const MMA_KEYS: usize = 32;
const MMA_PAD: usize = 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKernel {
    /// Each block holds its sequence's whole K/V in shared memory.
    Short,
    /// K/V stream through shared memory in tiles, with an online softmax.
    Tiled,
    /// Tiled too, with both products on the tensor cores (f16/bf16, head size 32 or 64).
    Mma,
}

impl AttentionKernel {
    pub fn name(self) -> &'static str {
        match self {
            Self::Short => "short",
            Self::Tiled => "tiled",
            Self::Mma => "mma",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionPlan {
    pub kernel: AttentionKernel,
    /// (query tiles of the longest sequence, heads, sequences).
    pub grid: (u32, u32, u32),
    pub shared_bytes: u32,
}

/// K rows are padded by one 4-byte word so 32 lanes reading 32 keys hit 32 banks.
fn key_pad(elem_size: usize) -> usize {
    if elem_size == 4 {
        1
    } else {
        2
    }
}

fn query_bytes(head_dim: usize) -> usize {
    ATTENTION_WARPS * ROWS_PER_WARP * head_dim * 4
}

/// Shared memory for K and V of `keys` rows plus the warps' f32 queries.
fn attention_shared(keys: usize, head_dim: usize, elem_size: usize) -> usize {
    query_bytes(head_dim) + keys * (2 * head_dim + key_pad(elem_size)) * elem_size
}

/// Shared memory of the tensor-core kernel (`MmaLayout` in the kernel): K and V tiles (which
/// first hold the block's queries), then per warp its f32 scores, its 16-bit probabilities
/// and its f32 context.
fn mma_shared(head_dim: usize) -> usize {
    let (ld, lds, ldp, ldo) = (head_dim + MMA_PAD, MMA_KEYS + 4, MMA_KEYS + MMA_PAD, head_dim + 4);
    2 * MMA_KEYS * ld * 2 + ATTENTION_WARPS * MMA_ROWS * (lds * 4 + ldp * 2 + ldo * 4)
}

/// Keys per tile of the tiled kernel (`KeyTile` in the kernel).
pub fn key_tile(elem_size: usize) -> usize {
    128 / elem_size
}

/// The longest sequence whose K/V the short kernel holds at once within [`SHARED_LIMIT`]:
/// 173 tokens for f16/bf16 at head size 64, 356 at 32, 79 at 128; about half that in f32.
pub fn short_kernel_max_len(head_dim: usize, elem_size: usize) -> usize {
    (SHARED_LIMIT - query_bytes(head_dim)) / ((2 * head_dim + key_pad(elem_size)) * elem_size)
}

/// Which attention kernel runs a batch, and its launch shape. f16/bf16 batches at head size
/// 32 or 64 whose longest sequence has [`MMA_MIN_LEN`] tokens or more go to the tensor-core
/// kernel. Otherwise the short kernel is chosen whenever the longest sequence fits it: it
/// loads K/V once per block and skips the per-tile barriers; longer batches go to the tiled
/// kernel.
pub fn attention_plan(
    sequences: usize,
    max_len: usize,
    num_heads: usize,
    head_dim: usize,
    elem_size: usize,
) -> Result<AttentionPlan, String> {
    choose_kernel(sequences, max_len, num_heads, head_dim, elem_size, true)
}

/// [`attention_plan`], or with `tensor_cores` off the CUDA-core kernels whatever the batch.
fn choose_kernel(
    sequences: usize,
    max_len: usize,
    num_heads: usize,
    head_dim: usize,
    elem_size: usize,
    tensor_cores: bool,
) -> Result<AttentionPlan, String> {
    if !HEAD_SIZES.contains(&head_dim) {
        return Err(format!(
            "head size {head_dim} has no CUDA attention kernel (built for {HEAD_SIZES:?})"
        ));
    }
    if !matches!(elem_size, 2 | 4) {
        return Err(format!(
            "{elem_size}-byte elements: expected f32, f16 or bf16"
        ));
    }
    if sequences == 0 || sequences > u16::MAX as usize || num_heads > u16::MAX as usize {
        return Err(format!(
            "{sequences} sequences × {num_heads} heads: the grid takes 1 to 65535 of each; \
             split the batch"
        ));
    }
    let on_tensor_cores = tensor_cores
        && elem_size == 2
        && MMA_HEAD_SIZES.contains(&head_dim)
        && max_len >= MMA_MIN_LEN;
    let (kernel, shared, rows_per_block) = if on_tensor_cores {
        (AttentionKernel::Mma, mma_shared(head_dim), MMA_ROWS_PER_BLOCK)
    } else if max_len <= short_kernel_max_len(head_dim, elem_size) {
        (
            AttentionKernel::Short,
            attention_shared(max_len, head_dim, elem_size),
            ATTENTION_ROWS_PER_BLOCK,
        )
    } else {
        (
            AttentionKernel::Tiled,
            attention_shared(key_tile(elem_size), head_dim, elem_size),
            ATTENTION_ROWS_PER_BLOCK,
        )
    };
    Ok(AttentionPlan {
        kernel,
        grid: (
            max_len.div_ceil(rows_per_block).max(1) as u32,
            num_heads as u32,
            sequences as u32,
        ),
        shared_bytes: shared as u32,
    })
}

impl CudaKernel for VarlenAttention {
    const MODULE: Module =
        cuda_module!("varlen_attention", probe: "varlen_attention_short_d64_f16");

    fn plan(&self, inputs: &[Operand]) -> candle_core::Result<Plan> {
        let op = self.name();
        let [qkv, bias, cu_seqlens] = operands(op, inputs)?;
        qkv.rows_cols(op)?;
        let (tokens, hidden) = self.shapes(op, qkv.shape, bias.shape)?;
        bias.same_dtype_as(&qkv, op, "qkv bias")?;
        cu_seqlens.expect_dtype(DType::U32, op, "cu_seqlens")?;
        if self.max_seqlen == 0 || self.max_seqlen > tokens {
            bail!(
                "{op}: max_seqlen {} must be the longest sequence's length (1..={tokens}): the \
                 grid is sized from it",
                self.max_seqlen
            );
        }
        let sequences = cu_seqlens.shape.elem_count().saturating_sub(1);
        let plan = choose_kernel(
            sequences,
            self.max_seqlen,
            self.num_heads,
            self.head_dim,
            qkv.dtype.size_in_bytes(),
            self.tensor_cores,
        )
        .map_err(plan_error(op))?;
        let root = format!("varlen_attention_{}_d{}", plan.kernel.name(), self.head_dim);
        // exp2 in the kernel: fold log2(e) into the 1/√d scale.
        let scale_log2 = std::f32::consts::LOG2_E / (self.head_dim as f32).sqrt();
        let args = vec![
            Arg::Input(0),
            Arg::Input(1),
            Arg::Input(2),
            Arg::Output,
            Arg::I32(hidden as i32),
            Arg::F32(scale_log2),
        ];
        let launch = Launch {
            kernel: float_kernel(op, &root, qkv.dtype)?,
            grid: plan.grid,
            threads: ATTENTION_THREADS,
            shared_bytes: plan.shared_bytes,
            args,
        };
        Ok(Plan::single(op, qkv.dtype, (tokens, hidden), launch))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_sequences_take_the_short_kernel_and_long_ones_the_tiled() {
        let short = attention_plan(3, 127, 12, 64, 2).unwrap();
        assert_eq!(short.kernel, AttentionKernel::Short);
        assert_eq!(short.grid, (8, 12, 3));
        let long = attention_plan(3, 512, 12, 64, 4).unwrap();
        assert_eq!(long.kernel, AttentionKernel::Tiled);
        assert_eq!(long.grid, (32, 12, 3));
        // 16-bit storage at the head sizes of MiniLM and BERT-base: the tensor cores, 64
        // query rows a block.
        let mma = attention_plan(3, 512, 12, 64, 2).unwrap();
        assert_eq!(mma.kernel, AttentionKernel::Mma);
        assert_eq!(mma.grid, (8, 12, 3));
        assert_eq!(mma.shared_bytes, 40_960);
        assert_eq!(attention_plan(1, MMA_MIN_LEN - 1, 1, 32, 2).unwrap().kernel, AttentionKernel::Short);
        assert_eq!(attention_plan(1, MMA_MIN_LEN, 1, 32, 2).unwrap().kernel, AttentionKernel::Mma);
        assert_eq!(attention_plan(1, 512, 1, 128, 2).unwrap().kernel, AttentionKernel::Tiled);
        // The short/tiled switch sits exactly where K/V stop fitting.
        let edge = short_kernel_max_len(128, 2);
        assert_eq!(edge, 79);
        assert_eq!(
            attention_plan(1, edge, 1, 128, 2).unwrap().kernel,
            AttentionKernel::Short
        );
        assert_eq!(
            attention_plan(1, edge + 1, 1, 128, 2).unwrap().kernel,
            AttentionKernel::Tiled
        );
    }

    #[test]
    fn every_plan_fits_the_shared_memory_limit() {
        for head_dim in HEAD_SIZES {
            for elem in [2, 4] {
                for max_len in [1, 16, 17, 64, 100, 173, 174, 256, 512, 4096] {
                    let plan = attention_plan(5, max_len, 12, head_dim, elem).unwrap();
                    assert!(
                        plan.shared_bytes as usize <= SHARED_LIMIT,
                        "d {head_dim}, {elem}-byte, len {max_len}: {plan:?}"
                    );
                    let rows = if plan.kernel == AttentionKernel::Mma {
                        MMA_ROWS_PER_BLOCK
                    } else {
                        ATTENTION_ROWS_PER_BLOCK
                    };
                    assert!(plan.grid.0 as usize * rows >= max_len);
                }
            }
        }
    }

    #[test]
    fn refuses_head_sizes_and_grids_it_has_no_kernel_for() {
        let err = attention_plan(1, 8, 1, 48, 2).unwrap_err();
        assert!(err.contains("head size 48"), "{err}");
        assert!(attention_plan(0, 8, 1, 64, 2).is_err());
        assert!(attention_plan(70_000, 8, 1, 64, 2).is_err());
        assert!(attention_plan(1, 8, 1, 64, 8).is_err());
    }
}
