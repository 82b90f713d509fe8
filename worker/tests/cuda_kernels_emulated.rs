//! The CUDA kernels' own source, run on the CPU by the emulator in `cuda_emulator`, against
//! their CPU references (the cases are in `kernel_cases`, shared with the GPU test). Each
//! launch below mirrors the op's in `ops/cuda/kernels.rs`: kernel name, launch plan and
//! argument order.
#![cfg(target_arch = "x86_64")]

mod cuda_emulator;
mod gpu_support;
mod kernel_cases;

use candle_core::{DType, Tensor};
use cuda_emulator::{emulator, Arg, Buffer};
use kernel_cases::Kernels;
use tessera_worker::engine::ops::cuda::plan::{self, attention_plan};
use tessera_worker::engine::ops::{
    BiasResidualLayerNorm, Granularity, Int8Scales, Pooling, SegmentedPool, VarlenAttention,
};

struct Emulated;

fn launch(kernel: &str, grid: (u32, u32, u32), threads: u32, shared_bytes: u32, args: &[Arg]) {
    emulator()
        .launch(kernel, grid, threads, shared_bytes, args)
        .unwrap_or_else(|e| panic!("{e}"));
}

/// `root_f32`, `root_f16` or `root_bf16`, as `FOR_EACH_STORAGE` exports them.
fn kernel_name(root: &str, dtype: DType) -> String {
    format!("{root}_{}", dtype.as_str())
}

fn dims2(t: &Tensor) -> (usize, usize) {
    t.dims2().unwrap()
}

fn per_channel(rows: usize, scales: &Tensor) -> bool {
    scales.elem_count() == rows
}

impl Kernels for Emulated {
    fn attention(&self, op: &VarlenAttention, qkv: &Tensor, bias: &Tensor, cu: &Tensor) -> Tensor {
        let (tokens, _) = dims2(qkv);
        let hidden = op.num_heads * op.head_dim;
        let dtype = qkv.dtype();
        let sequences = cu.elem_count() - 1;
        let plan = attention_plan(
            sequences,
            op.max_seqlen,
            op.num_heads,
            op.head_dim,
            dtype.size_in_bytes(),
        )
        .unwrap();
        let name = format!("varlen_attention_{}_d{}", plan.kernel.name(), op.head_dim);
        let (qkv, bias, cu) = (
            Buffer::from_tensor(qkv),
            Buffer::from_tensor(bias),
            Buffer::from_tensor(cu),
        );
        let out = Buffer::output(dtype, tokens * hidden);
        let scale_log2 = std::f32::consts::LOG2_E / (op.head_dim as f32).sqrt();
        launch(
            &kernel_name(&name, dtype),
            plan.grid,
            plan::ATTENTION_THREADS,
            plan.shared_bytes,
            &[
                qkv.arg(),
                bias.arg(),
                cu.arg(),
                out.arg(),
                Arg::I32(hidden as i32),
                Arg::F32(scale_log2),
            ],
        );
        out.to_tensor(dtype, &[tokens, hidden])
    }

    fn layernorm(&self, op: &BiasResidualLayerNorm, x: &Tensor, r: &Tensor, p: &Tensor) -> Tensor {
        let (rows, cols) = dims2(x);
        let dtype = x.dtype();
        let (x, r, p) = (
            Buffer::from_tensor(x),
            Buffer::from_tensor(r),
            Buffer::from_tensor(p),
        );
        let out = Buffer::output(dtype, rows * cols);
        launch(
            &kernel_name("bias_residual_layernorm", dtype),
            (rows as u32, 1, 1),
            plan::ROW_THREADS,
            plan::row_shared_bytes(cols).unwrap(),
            &[
                x.arg(),
                r.arg(),
                p.arg(),
                out.arg(),
                Arg::I32(cols as i32),
                Arg::F32(op.eps),
            ],
        );
        out.to_tensor(dtype, &[rows, cols])
    }

    fn bias_gelu(&self, x: &Tensor, b: &Tensor) -> Tensor {
        let (rows, cols) = dims2(x);
        let (dtype, n) = (x.dtype(), rows * cols);
        let (x, b) = (Buffer::from_tensor(x), Buffer::from_tensor(b));
        let out = Buffer::output(dtype, n);
        launch(
            &kernel_name("bias_gelu", dtype),
            (plan::elementwise_blocks(n), 1, 1),
            plan::ELEMENTWISE_THREADS,
            0,
            &[
                x.arg(),
                b.arg(),
                out.arg(),
                Arg::U64(n as u64),
                Arg::I32(cols as i32),
            ],
        );
        out.to_tensor(dtype, &[rows, cols])
    }

    fn pool(&self, op: &SegmentedPool, h: &Tensor, cu: &Tensor) -> Tensor {
        let (_, cols) = dims2(h);
        let dtype = h.dtype();
        let sequences = cu.elem_count() - 1;
        let mode = match op.pooling {
            Pooling::Mean => 0,
            Pooling::Cls => 1,
            Pooling::Max => 2,
        };
        let (h, cu) = (Buffer::from_tensor(h), Buffer::from_tensor(cu));
        let out = Buffer::output(dtype, sequences * cols);
        launch(
            &kernel_name("segmented_pool", dtype),
            (sequences as u32, 1, 1),
            plan::POOL_THREADS,
            plan::row_shared_bytes(cols).unwrap(),
            &[
                h.arg(),
                cu.arg(),
                out.arg(),
                Arg::I32(cols as i32),
                Arg::I32(mode),
                Arg::I32(op.normalize as i32),
            ],
        );
        out.to_tensor(dtype, &[sequences, cols])
    }

    fn int8_scales(&self, op: &Int8Scales, x: &Tensor) -> Tensor {
        let (rows, cols) = dims2(x);
        let dtype = x.dtype();
        let per_channel = op.granularity == Granularity::PerChannel;
        let n = if per_channel { rows } else { 1 };
        let x = Buffer::from_tensor(x);
        let scales = Buffer::zeros(DType::F32, n);
        launch(
            &kernel_name("int8_absmax", dtype),
            (rows.min(1 << 16) as u32, 1, 1),
            plan::ROW_THREADS,
            0,
            &[
                x.arg(),
                scales.arg(),
                Arg::I32(rows as i32),
                Arg::I32(cols as i32),
                Arg::I32(per_channel as i32),
            ],
        );
        launch(
            "int8_scales_finish",
            (n.div_ceil(plan::ELEMENTWISE_THREADS as usize) as u32, 1, 1),
            plan::ELEMENTWISE_THREADS,
            0,
            &[scales.arg(), Arg::I32(n as i32)],
        );
        scales.to_tensor(DType::F32, &[n])
    }

    fn quantize(&self, x: &Tensor, scales: &Tensor) -> Tensor {
        let (rows, cols) = dims2(x);
        let (dtype, n) = (x.dtype(), rows * cols);
        let per_channel = per_channel(rows, scales);
        let (x, scales) = (Buffer::from_tensor(x), Buffer::from_tensor(scales));
        let q = Buffer::output(DType::U8, n);
        launch(
            &kernel_name("int8_quantize", dtype),
            (plan::elementwise_blocks(n), 1, 1),
            plan::ELEMENTWISE_THREADS,
            0,
            &[
                x.arg(),
                scales.arg(),
                q.arg(),
                Arg::U64(n as u64),
                Arg::I32(cols as i32),
                Arg::I32(per_channel as i32),
            ],
        );
        q.to_tensor(DType::U8, &[rows, cols])
    }

    fn dequantize(&self, q: &Tensor, scales: &Tensor) -> Tensor {
        let (rows, cols) = dims2(q);
        let n = rows * cols;
        let per_channel = per_channel(rows, scales);
        let (q, scales) = (Buffer::from_tensor(q), Buffer::from_tensor(scales));
        let out = Buffer::output(DType::F32, n);
        launch(
            "int8_dequantize",
            (plan::elementwise_blocks(n), 1, 1),
            plan::ELEMENTWISE_THREADS,
            0,
            &[
                q.arg(),
                scales.arg(),
                out.arg(),
                Arg::U64(n as u64),
                Arg::I32(cols as i32),
                Arg::I32(per_channel as i32),
            ],
        );
        out.to_tensor(DType::F32, &[rows, cols])
    }
}

kernel_tests!(Some(Emulated));

#[test]
fn the_emulator_refuses_what_a_gpu_would_not_run() {
    let e = emulator();
    let out = Buffer::output(DType::F32, 64);
    e.launch("one_float_per_thread", (2, 1, 1), 64, 256, &[out.arg()])
        .expect("64 floats fit 256 bytes");
    assert_eq!(
        out.to_tensor(DType::F32, &[64]).to_vec1::<f32>().unwrap(),
        vec![1.0; 64]
    );

    let refusals = [
        ("misaligned_barriers", 64, 0, "never line up"),
        ("one_float_per_thread", 64, 128, "past the 128 bytes"),
        ("one_float_per_thread", 64, 48 * 1024 + 4, "48 KiB"),
        ("one_float_per_thread", 2048, 0, "1 to 1024"),
    ];
    for (kernel, threads, shared, why) in refusals {
        let err = e
            .launch(kernel, (1, 1, 1), threads, shared, &[out.arg()])
            .expect_err(kernel);
        assert!(err.contains(why), "{kernel}: {err}");
    }
}
