//! The CUDA kernels on a GPU against their CPU references (the cases are in `kernel_cases`),
//! through the engine's own launches (each op's `cuda_fwd`: its plan in `ops/<op>/cuda.rs`, run
//! by `ops/cuda/run.rs`), plus what those launches refuse.
//!
//! Needs a CUDA GPU: without one each test prints why and passes, unless
//! TESSERA_REQUIRE_GPU=1 (set it on the GPU machine so a missing GPU fails loudly).
#![cfg(feature = "cuda")]

mod gpu_support;
mod kernel_cases;

use candle_core::{CustomOp1, CustomOp2, CustomOp3, DType, Device, Tensor};
use gpu_support::gpu;
use kernel_cases::Kernels;
use tessera_worker::engine::ops::{
    BiasGelu, BiasResidualLayerNorm, DequantizeInt8, DequantizeSums, Int8Scales, QuantizeInt8,
    SegmentedPool, VarlenAttention,
};

/// Runs each op's `cuda_fwd` on CUDA device 0.
struct Gpu(Device);

impl Gpu {
    fn put(&self, t: &Tensor) -> Tensor {
        t.to_device(&self.0).unwrap()
    }

    fn back(t: Tensor) -> Tensor {
        t.to_device(&Device::Cpu).unwrap()
    }

    fn op1(&self, a: &Tensor, op: &impl CustomOp1) -> Tensor {
        Self::back(self.put(a).apply_op1_no_bwd(op).unwrap())
    }

    fn op2(&self, a: &Tensor, b: &Tensor, op: &impl CustomOp2) -> Tensor {
        Self::back(self.put(a).apply_op2_no_bwd(&self.put(b), op).unwrap())
    }

    fn op3(&self, a: &Tensor, b: &Tensor, c: &Tensor, op: &impl CustomOp3) -> Tensor {
        let (b, c) = (self.put(b), self.put(c));
        Self::back(self.put(a).apply_op3_no_bwd(&b, &c, op).unwrap())
    }
}

impl Kernels for Gpu {
    fn attention(&self, op: &VarlenAttention, qkv: &Tensor, bias: &Tensor, cu: &Tensor) -> Tensor {
        self.op3(qkv, bias, cu, op)
    }

    fn layernorm(&self, op: &BiasResidualLayerNorm, x: &Tensor, r: &Tensor, p: &Tensor) -> Tensor {
        self.op3(x, r, p, op)
    }

    fn bias_gelu(&self, x: &Tensor, b: &Tensor) -> Tensor {
        self.op2(x, b, &BiasGelu)
    }

    fn pool(&self, op: &SegmentedPool, h: &Tensor, cu: &Tensor) -> Tensor {
        self.op2(h, cu, op)
    }

    fn int8_scales(&self, op: &Int8Scales, x: &Tensor) -> Tensor {
        self.op1(x, op)
    }

    fn quantize(&self, x: &Tensor, scales: &Tensor) -> Tensor {
        self.op2(x, scales, &QuantizeInt8)
    }

    fn dequantize(&self, q: &Tensor, scales: &Tensor) -> Tensor {
        self.op2(q, scales, &DequantizeInt8)
    }

    fn dequantize_sums(&self, sums: &Tensor, params: &Tensor) -> Tensor {
        self.op2(sums, params, &DequantizeSums)
    }
}

kernel_tests!(gpu().map(Gpu));

#[test]
fn kernels_refuse_what_they_have_no_code_for() {
    let Some(gpu) = gpu() else { return };
    let qkv = Tensor::zeros((4, 3 * 48), DType::F16, &gpu).unwrap();
    let bias = Tensor::zeros(3 * 48, DType::F16, &gpu).unwrap();
    let cu = Tensor::new(&[0u32, 4], &gpu).unwrap();
    let op = VarlenAttention {
        num_heads: 1,
        head_dim: 48,
        max_seqlen: 4,
        tensor_cores: true,
    };
    let err = qkv
        .apply_op3_no_bwd(&bias, &cu, &op)
        .unwrap_err()
        .to_string();
    assert!(err.contains("head size 48"), "{err}");
    let x = Tensor::zeros((2, 4), DType::F64, &gpu).unwrap();
    let b = Tensor::zeros(4, DType::F64, &gpu).unwrap();
    let err = x.apply_op2_no_bwd(&b, &BiasGelu).unwrap_err().to_string();
    assert!(err.contains("F64 has no CUDA kernel"), "{err}");
}
