//! Every CUDA kernel against its CPU reference (the same op's `cpu_fwd`), in f32, f16 and
//! bf16, over random shapes, ragged lengths from 1 to 512 and the edge cases (one token, one
//! sequence, the longest sequence, the short/tiled and tensor-core attention switches). Inputs are rounded to
//! the storage type first and the CPU computes on those very values, so a difference is the
//! kernel's arithmetic alone; the tolerances are a few units in the storage type's last place.
//!
//! The cases run wherever the kernels can: on a CUDA GPU (`cuda_kernels.rs`) and in the CPU
//! emulator (`cuda_kernels_emulated.rs`), each a [`Kernels`] and one `kernel_tests!` line.
#![allow(dead_code)] // each test binary uses its own part

use crate::gpu_support::{assert_close, Rng, FLOAT_TYPES};
use candle_core::{DType, Device, Tensor};
use tessera_worker::engine::ops::varlen_attention::cuda::{
    attention_plan, short_kernel_max_len, AttentionKernel, MMA_HEAD_SIZES, MMA_MIN_LEN,
};
use tessera_worker::engine::ops::{
    BiasGelu, BiasResidualLayerNorm, DequantizeInt8, DequantizeSums, Granularity, Int8Scales,
    Pooling, QuantizeInt8, SegmentedPool, VarlenAttention,
};

/// Where the kernels run. Inputs are CPU tensors already in the storage type (`cu_seqlens`
/// u32, `q` u8, scales f32); results come back as CPU tensors.
pub trait Kernels {
    fn attention(&self, op: &VarlenAttention, qkv: &Tensor, bias: &Tensor, cu: &Tensor) -> Tensor;
    fn layernorm(&self, op: &BiasResidualLayerNorm, x: &Tensor, r: &Tensor, p: &Tensor) -> Tensor;
    fn bias_gelu(&self, x: &Tensor, b: &Tensor) -> Tensor;
    fn pool(&self, op: &SegmentedPool, h: &Tensor, cu: &Tensor) -> Tensor;
    fn int8_scales(&self, op: &Int8Scales, x: &Tensor) -> Tensor;
    fn quantize(&self, x: &Tensor, scales: &Tensor) -> Tensor;
    fn dequantize(&self, q: &Tensor, scales: &Tensor) -> Tensor;
    fn dequantize_sums(&self, sums: &Tensor, params: &Tensor) -> Tensor;
}

/// One `#[test]` per case, each running on the [`Kernels`] that `$kernels` gives (an
/// `Option`: `None` after saying why the test is skipped).
#[macro_export]
macro_rules! kernel_tests {
    ($kernels:expr) => {
        #[test]
        fn attention_matches_the_cpu_on_ragged_batches_for_every_head_size() {
            if let Some(k) = $kernels {
                kernel_cases::attention_on_ragged_batches(&k);
            }
        }
        #[test]
        fn attention_matches_the_cpu_at_minilm_and_bert_base_shapes() {
            if let Some(k) = $kernels {
                kernel_cases::attention_on_model_shapes(&k);
            }
        }
        #[test]
        fn attention_edge_cases_one_token_one_sequence_and_the_longest() {
            if let Some(k) = $kernels {
                kernel_cases::attention_edge_cases(&k);
            }
        }
        #[test]
        fn attention_agrees_on_both_sides_of_the_short_to_tiled_switch() {
            if let Some(k) = $kernels {
                kernel_cases::attention_across_the_switch(&k);
            }
        }
        #[test]
        fn attention_on_the_tensor_cores_matches_the_cpu() {
            if let Some(k) = $kernels {
                kernel_cases::attention_on_the_tensor_cores(&k);
            }
        }
        #[test]
        fn layernorm_matches_the_cpu_on_model_and_odd_widths() {
            if let Some(k) = $kernels {
                kernel_cases::layernorm(&k);
            }
        }
        #[test]
        fn bias_gelu_matches_the_cpu() {
            if let Some(k) = $kernels {
                kernel_cases::bias_gelu(&k);
            }
        }
        #[test]
        fn pooling_matches_the_cpu_for_every_mode() {
            if let Some(k) = $kernels {
                kernel_cases::pooling(&k);
            }
        }
        #[test]
        fn int8_quantisation_matches_the_cpu_bit_for_bit() {
            if let Some(k) = $kernels {
                kernel_cases::int8_quantisation(&k);
            }
        }
        #[test]
        fn int8_gemm_sums_dequantise_like_the_cpu_bit_for_bit() {
            if let Some(k) = $kernels {
                kernel_cases::int8_sums(&k);
            }
        }
    };
}

/// `t` rounded to `dtype`: back in f32 for the CPU reference, and in `dtype` for the kernel.
fn rounded(t: &Tensor, dtype: DType) -> (Tensor, Tensor) {
    let r = t.to_dtype(dtype).unwrap();
    (r.to_dtype(DType::F32).unwrap(), r)
}

fn cu_seqlens(lens: &[usize]) -> Tensor {
    let mut cu = vec![0u32];
    for len in lens {
        cu.push(cu.last().unwrap() + *len as u32);
    }
    Tensor::new(cu.as_slice(), &Device::Cpu).unwrap()
}

fn attention_case(k: &impl Kernels, rng: &mut Rng, heads: usize, d: usize, lens: &[usize]) {
    attention_case_on(k, rng, heads, d, lens, true);
}

/// One attention case; `tensor_cores` off keeps the batch on the CUDA-core kernels.
fn attention_case_on(
    k: &impl Kernels,
    rng: &mut Rng,
    heads: usize,
    d: usize,
    lens: &[usize],
    tensor_cores: bool,
) {
    let cu = cu_seqlens(lens);
    let tokens: usize = lens.iter().sum();
    let qkv = rng.tensor(&[tokens, 3 * heads * d], 1.5);
    let bias = rng.tensor(&[3 * heads * d], 0.5);
    let op = VarlenAttention {
        num_heads: heads,
        head_dim: d,
        max_seqlen: *lens.iter().max().unwrap(),
        tensor_cores,
    };
    for (dtype, tol) in FLOAT_TYPES {
        let (qkv_c, qkv_k) = rounded(&qkv, dtype);
        let (bias_c, bias_k) = rounded(&bias, dtype);
        let want = qkv_c.apply_op3_no_bwd(&bias_c, &cu, &op).unwrap();
        let got = k.attention(&op, &qkv_k, &bias_k, &cu);
        assert_eq!(got.dtype(), dtype);
        let kernel = attention_plan(lens.len(), op.max_seqlen, heads, d, dtype.size_in_bytes())
            .unwrap()
            .kernel;
        let what = format!(
            "attention {dtype:?} {} heads {heads} × {d}, {} sequences, max {}",
            if tensor_cores { format!("{kernel:?}") } else { "on CUDA cores".into() },
            lens.len(),
            op.max_seqlen
        );
        assert_close(&what, &got, &want, tol);
    }
}

pub fn attention_on_ragged_batches(k: &impl Kernels) {
    let mut rng = Rng::new(1);
    for d in [32, 64, 128] {
        for round in 0..3 {
            let count = 1 + rng.below(12);
            let max = [64, 256, 512][round];
            let lens = rng.lengths(count, max);
            let heads = 1 + rng.below(4);
            attention_case(k, &mut rng, heads, d, &lens);
        }
    }
}

/// The shapes the engine serves: all-MiniLM-L6-v2 (12 heads of 32) and BERT-base (12 heads
/// of 64), sixteen ragged sequences each.
pub fn attention_on_model_shapes(k: &impl Kernels) {
    let mut rng = Rng::new(8);
    for (d, max) in [(32, 128), (64, 256)] {
        let lens = rng.lengths(16, max);
        attention_case(k, &mut rng, 12, d, &lens);
    }
}

pub fn attention_edge_cases(k: &impl Kernels) {
    let mut rng = Rng::new(2);
    for d in [32, 64, 128] {
        attention_case(k, &mut rng, 2, d, &[1]);
        attention_case(k, &mut rng, 2, d, &[512]);
        attention_case(k, &mut rng, 3, d, &[1, 1, 1, 1]);
        attention_case(k, &mut rng, 1, d, &[512, 1, 511, 2]);
    }
}

pub fn attention_across_the_switch(k: &impl Kernels) {
    let mut rng = Rng::new(3);
    for d in [32, 64, 128] {
        for elem in [2, 4] {
            let edge = short_kernel_max_len(d, elem);
            let tensor_cores = elem == 2 && MMA_HEAD_SIZES.contains(&d);
            assert_eq!(
                attention_plan(1, edge + 1, 1, d, elem).unwrap().kernel,
                if tensor_cores && edge + 1 >= MMA_MIN_LEN {
                    AttentionKernel::Mma
                } else {
                    AttentionKernel::Tiled
                }
            );
            // Multiples of the 32-key chunk and the key tile, and one past, hit the loops'
            // remainders.
            attention_case(k, &mut rng, 2, d, &[edge, 3, edge.min(33)]);
            attention_case(k, &mut rng, 2, d, &[edge + 1, 64, 65]);
        }
    }
}

/// Both sides of the switch to the tensor-core kernel, and its remainders: a last key tile of
/// one key, query blocks of 64 rows with one row past a block, sequences much shorter than
/// the longest (whole blocks and warps past their end).
pub fn attention_on_the_tensor_cores(k: &impl Kernels) {
    let mut rng = Rng::new(7);
    for d in MMA_HEAD_SIZES {
        assert_eq!(
            attention_plan(1, MMA_MIN_LEN - 1, 1, d, 2).unwrap().kernel,
            AttentionKernel::Short
        );
        assert_eq!(
            attention_plan(1, MMA_MIN_LEN, 1, d, 2).unwrap().kernel,
            AttentionKernel::Mma
        );
        attention_case(k, &mut rng, 2, d, &[MMA_MIN_LEN - 1, 17]);
        attention_case(k, &mut rng, 2, d, &[MMA_MIN_LEN, 1, 16, 64]);
        attention_case(k, &mut rng, 3, d, &[193, 65, 33, 2]);
        // The same long batches kept off the tensor cores (benchmarks compare the two).
        attention_case_on(k, &mut rng, 2, d, &[MMA_MIN_LEN, 1, 16, 64], false);
        attention_case_on(k, &mut rng, 3, d, &[400, 65, 33, 2], false);
    }
}

pub fn layernorm(k: &impl Kernels) {
    let mut rng = Rng::new(4);
    let op = BiasResidualLayerNorm { eps: 1e-12 };
    for (rows, cols) in [(1, 1), (3, 13), (517, 384), (64, 768), (9, 1024)] {
        // An offset checks the variance is computed around the mean.
        let x = (rng.tensor(&[rows, cols], 3.0) + 20.0).unwrap();
        let r = rng.tensor(&[rows, cols], 3.0);
        let p = rng.tensor(&[3, cols], 1.0);
        for (dtype, tol) in FLOAT_TYPES {
            let (x_c, x_k) = rounded(&x, dtype);
            let (r_c, r_k) = rounded(&r, dtype);
            let (p_c, p_k) = rounded(&p, dtype);
            let want = x_c.apply_op3_no_bwd(&r_c, &p_c, &op).unwrap();
            let got = k.layernorm(&op, &x_k, &r_k, &p_k);
            assert_close(
                &format!("layernorm {dtype:?} [{rows}, {cols}]"),
                &got,
                &want,
                tol,
            );
        }
    }
}

pub fn bias_gelu(k: &impl Kernels) {
    let mut rng = Rng::new(5);
    for (rows, cols) in [(1, 1), (5, 13), (300, 1536), (33, 3072)] {
        let x = rng.tensor(&[rows, cols], 6.0);
        let b = rng.tensor(&[cols], 1.0);
        for (dtype, tol) in FLOAT_TYPES {
            let (x_c, x_k) = rounded(&x, dtype);
            let (b_c, b_k) = rounded(&b, dtype);
            let want = x_c.apply_op2_no_bwd(&b_c, &BiasGelu).unwrap();
            let got = k.bias_gelu(&x_k, &b_k);
            assert_close(
                &format!("bias-gelu {dtype:?} [{rows}, {cols}]"),
                &got,
                &want,
                tol,
            );
        }
    }
}

pub fn pooling(k: &impl Kernels) {
    let mut rng = Rng::new(6);
    let batches = [vec![1], vec![512], rng.lengths(17, 512), rng.lengths(5, 64)];
    for lens in &batches {
        let cu = cu_seqlens(lens);
        let tokens: usize = lens.iter().sum();
        for cols in [384, 768] {
            let h = rng.tensor(&[tokens, cols], 2.0);
            for (dtype, tol) in FLOAT_TYPES {
                let (h_c, h_k) = rounded(&h, dtype);
                for pooling in [Pooling::Mean, Pooling::Cls, Pooling::Max] {
                    for normalize in [false, true] {
                        let op = SegmentedPool { pooling, normalize };
                        let want = h_c.apply_op2_no_bwd(&cu, &op).unwrap();
                        let got = k.pool(&op, &h_k, &cu);
                        let what = format!(
                            "pool {pooling:?} normalize={normalize} {dtype:?}, {} sequences \
                             × {cols}",
                            lens.len()
                        );
                        assert_close(&what, &got, &want, tol);
                    }
                }
            }
        }
    }
}

/// Quantisation is exact arithmetic on both sides (a max, one IEEE division, round half to
/// even, one multiplication), so the kernels must agree bit for bit.
pub fn int8_quantisation(k: &impl Kernels) {
    let mut rng = Rng::new(7);
    for (rows, cols) in [(1, 1), (7, 33), (384, 1536), (1000, 3)] {
        let mut x = rng.tensor(&[rows, cols], 4.0);
        if rows > 1 {
            // An all-zero channel gets scale 0 and quantises to zeros.
            x = x
                .slice_assign(
                    &[0..1, 0..cols],
                    &Tensor::zeros((1, cols), DType::F32, &Device::Cpu).unwrap(),
                )
                .unwrap();
        }
        for (dtype, _) in FLOAT_TYPES {
            let (x_c, x_k) = rounded(&x, dtype);
            for granularity in [Granularity::PerTensor, Granularity::PerChannel] {
                let what = format!("int8 {granularity:?} {dtype:?} [{rows}, {cols}]");
                let op = Int8Scales { granularity };
                let s_c = x_c.apply_op1_no_bwd(&op).unwrap();
                let s_k = k.int8_scales(&op, &x_k);
                assert_eq!(
                    s_k.to_vec1::<f32>().unwrap(),
                    s_c.to_vec1::<f32>().unwrap(),
                    "{what}: scales"
                );
                let q_c = x_c.apply_op2_no_bwd(&s_c, &QuantizeInt8).unwrap();
                let q_k = k.quantize(&x_k, &s_k);
                assert_eq!(
                    q_k.to_vec2::<u8>().unwrap(),
                    q_c.to_vec2::<u8>().unwrap(),
                    "{what}: q"
                );
                let back_c = q_c.apply_op2_no_bwd(&s_c, &DequantizeInt8).unwrap();
                let back_k = k.dequantize(&q_k, &s_k);
                assert_eq!(
                    back_k.to_vec2::<f32>().unwrap(),
                    back_c.to_vec2::<f32>().unwrap(),
                    "{what}: dequantised"
                );
            }
        }
    }
}

/// The i32 sums of an int8 GEMM (as u32 bits, rows padded to `ld`) back to f32 with two
/// per-tensor scales and a bias: bit for bit, since both sides round each step alike. Sums
/// up to ±127²·1536 (a K of 1536), negative ones included.
pub fn int8_sums(k: &impl Kernels) {
    let mut rng = Rng::new(11);
    for (rows, ld, cols) in [(1, 4, 1), (7, 8, 5), (96, 384, 384), (33, 1540, 1537)] {
        let sums: Vec<u32> = (0..rows * ld)
            .map(|_| (rng.uniform(127.0 * 127.0 * 1536.0) as i32) as u32)
            .collect();
        let sums = Tensor::from_vec(sums, (rows, ld), &Device::Cpu).unwrap();
        let mut params = vec![
            rng.uniform(0.05).abs() + 1e-4,
            rng.uniform(0.01).abs() + 1e-5,
        ];
        params.extend((0..cols).map(|_| rng.uniform(0.1)));
        let params = Tensor::new(params.as_slice(), &Device::Cpu).unwrap();
        let want = sums.apply_op2_no_bwd(&params, &DequantizeSums).unwrap();
        let got = k.dequantize_sums(&sums, &params);
        assert_eq!(
            got.to_vec2::<f32>().unwrap(),
            want.to_vec2::<f32>().unwrap(),
            "int8 sums [{rows}, {ld}] → [{rows}, {cols}]"
        );
    }
}
