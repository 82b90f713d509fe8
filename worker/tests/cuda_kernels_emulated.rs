//! The CUDA kernels' own source, run on the CPU by the emulator in `cuda_emulator`, against
//! their CPU references (the cases are in `kernel_cases`, shared with the GPU test). Each op
//! runs through its own launch plan (`ops/<op>/cuda.rs`), the plan the GPU runner executes.
#![cfg(target_arch = "x86_64")]

mod cuda_emulator;
mod gpu_support;
mod kernel_cases;

use candle_core::{DType, Tensor};
use cuda_emulator::{emulator, run, Buffer};
use kernel_cases::Kernels;
use tessera_worker::engine::ops::{
    BiasGelu, BiasResidualLayerNorm, DequantizeInt8, DequantizeSums, Int8Scales, QuantizeInt8,
    SegmentedPool, VarlenAttention,
};

struct Emulated;

impl Kernels for Emulated {
    fn attention(&self, op: &VarlenAttention, qkv: &Tensor, bias: &Tensor, cu: &Tensor) -> Tensor {
        run(op, &[qkv, bias, cu])
    }

    fn layernorm(&self, op: &BiasResidualLayerNorm, x: &Tensor, r: &Tensor, p: &Tensor) -> Tensor {
        run(op, &[x, r, p])
    }

    fn bias_gelu(&self, x: &Tensor, b: &Tensor) -> Tensor {
        run(&BiasGelu, &[x, b])
    }

    fn pool(&self, op: &SegmentedPool, h: &Tensor, cu: &Tensor) -> Tensor {
        run(op, &[h, cu])
    }

    fn int8_scales(&self, op: &Int8Scales, x: &Tensor) -> Tensor {
        run(op, &[x])
    }

    fn quantize(&self, x: &Tensor, scales: &Tensor) -> Tensor {
        run(&QuantizeInt8, &[x, scales])
    }

    fn dequantize(&self, q: &Tensor, scales: &Tensor) -> Tensor {
        run(&DequantizeInt8, &[q, scales])
    }

    fn dequantize_sums(&self, sums: &Tensor, params: &Tensor) -> Tensor {
        run(&DequantizeSums, &[sums, params])
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
