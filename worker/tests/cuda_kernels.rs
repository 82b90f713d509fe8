//! Every CUDA kernel against its CPU reference (the same op's `cpu_fwd`), in f32, f16 and
//! bf16, over random shapes, ragged lengths from 1 to 512 and the edge cases (one token, one
//! sequence, the longest sequence, the short/tiled attention switch). Inputs are rounded to
//! the storage type first and the CPU computes on those very values, so a difference is the
//! kernel's arithmetic alone; the tolerances are a few units in the storage type's last place.
//!
//! Needs a CUDA GPU: without one each test prints why and passes, unless
//! TESSERA_REQUIRE_GPU=1 (set it on the GPU machine so a missing GPU fails loudly).
#![cfg(feature = "cuda")]

mod gpu_support;

use candle_core::{DType, Device, Tensor};
use gpu_support::{assert_close, gpu, Rng, FLOAT_TYPES};
use tessera_worker::engine::ops::cuda::plan::{
    attention_plan, short_kernel_max_len, AttentionKernel,
};
use tessera_worker::engine::ops::{
    BiasGelu, BiasResidualLayerNorm, DequantizeInt8, Granularity, Int8Scales, Pooling,
    QuantizeInt8, SegmentedPool, VarlenAttention,
};

/// `t` rounded to `dtype`: on the GPU in that type, on the CPU back in f32.
fn on_both(t: &Tensor, dtype: DType, gpu: &Device) -> (Tensor, Tensor) {
    let rounded = t.to_dtype(dtype).unwrap();
    (
        rounded.to_dtype(DType::F32).unwrap(),
        rounded.to_device(gpu).unwrap(),
    )
}

fn cu_seqlens(lens: &[usize]) -> Vec<u32> {
    let mut cu = vec![0u32];
    for len in lens {
        cu.push(cu.last().unwrap() + *len as u32);
    }
    cu
}

fn attention_case(gpu: &Device, rng: &mut Rng, heads: usize, d: usize, lens: &[usize]) {
    let cu = cu_seqlens(lens);
    let tokens = *cu.last().unwrap() as usize;
    let qkv = rng.tensor(&[tokens, 3 * heads * d], 1.5);
    let bias = rng.tensor(&[3 * heads * d], 0.5);
    let op = VarlenAttention {
        num_heads: heads,
        head_dim: d,
        max_seqlen: *lens.iter().max().unwrap(),
    };
    for (dtype, tol) in FLOAT_TYPES {
        let (qkv_c, qkv_g) = on_both(&qkv, dtype, gpu);
        let (bias_c, bias_g) = on_both(&bias, dtype, gpu);
        let cu_c = Tensor::new(cu.as_slice(), &Device::Cpu).unwrap();
        let cu_g = cu_c.to_device(gpu).unwrap();
        let want = qkv_c.apply_op3_no_bwd(&bias_c, &cu_c, &op).unwrap();
        let got = qkv_g.apply_op3_no_bwd(&bias_g, &cu_g, &op).unwrap();
        assert_eq!(got.dtype(), dtype);
        let kernel = attention_plan(lens.len(), op.max_seqlen, heads, d, dtype.size_in_bytes())
            .unwrap()
            .kernel;
        let what = format!(
            "attention {dtype:?} {kernel:?} heads {heads} × {d}, {} sequences, max {}",
            lens.len(),
            op.max_seqlen
        );
        assert_close(&what, &got, &want, tol);
    }
}

#[test]
fn attention_matches_the_cpu_on_ragged_batches_for_every_head_size() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::new(1);
    for d in [32, 64, 128] {
        for round in 0..3 {
            let count = 1 + rng.below(12);
            let max = [64, 256, 512][round];
            let lens = rng.lengths(count, max);
            let heads = 1 + rng.below(4);
            attention_case(&gpu, &mut rng, heads, d, &lens);
        }
    }
}

#[test]
fn attention_edge_cases_one_token_one_sequence_and_the_longest() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::new(2);
    for d in [32, 64, 128] {
        attention_case(&gpu, &mut rng, 2, d, &[1]);
        attention_case(&gpu, &mut rng, 2, d, &[512]);
        attention_case(&gpu, &mut rng, 3, d, &[1, 1, 1, 1]);
        attention_case(&gpu, &mut rng, 1, d, &[512, 1, 511, 2]);
    }
}

#[test]
fn attention_agrees_on_both_sides_of_the_short_to_tiled_switch() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::new(3);
    for d in [32, 64, 128] {
        for elem in [2, 4] {
            let edge = short_kernel_max_len(d, elem);
            assert_eq!(
                attention_plan(1, edge + 1, 1, d, elem).unwrap().kernel,
                AttentionKernel::Tiled
            );
            // Multiples of the 32-key chunk and the key tile, and one past, hit the loops'
            // remainders.
            attention_case(&gpu, &mut rng, 2, d, &[edge, 3, edge.min(33)]);
            attention_case(&gpu, &mut rng, 2, d, &[edge + 1, 64, 65]);
        }
    }
}

#[test]
fn layernorm_matches_the_cpu_on_model_and_odd_widths() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::new(4);
    let op = BiasResidualLayerNorm { eps: 1e-12 };
    for (rows, cols) in [(1, 1), (3, 13), (517, 384), (64, 768), (9, 1024)] {
        // An offset checks the variance is computed around the mean.
        let x = (rng.tensor(&[rows, cols], 3.0) + 20.0).unwrap();
        let r = rng.tensor(&[rows, cols], 3.0);
        let p = rng.tensor(&[3, cols], 1.0);
        for (dtype, tol) in FLOAT_TYPES {
            let (x_c, x_g) = on_both(&x, dtype, &gpu);
            let (r_c, r_g) = on_both(&r, dtype, &gpu);
            let (p_c, p_g) = on_both(&p, dtype, &gpu);
            let want = x_c.apply_op3_no_bwd(&r_c, &p_c, &op).unwrap();
            let got = x_g.apply_op3_no_bwd(&r_g, &p_g, &op).unwrap();
            assert_close(
                &format!("layernorm {dtype:?} [{rows}, {cols}]"),
                &got,
                &want,
                tol,
            );
        }
    }
}

#[test]
fn bias_gelu_matches_the_cpu() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::new(5);
    for (rows, cols) in [(1, 1), (5, 13), (300, 1536), (33, 3072)] {
        let x = rng.tensor(&[rows, cols], 6.0);
        let b = rng.tensor(&[cols], 1.0);
        for (dtype, tol) in FLOAT_TYPES {
            let (x_c, x_g) = on_both(&x, dtype, &gpu);
            let (b_c, b_g) = on_both(&b, dtype, &gpu);
            let want = x_c.apply_op2_no_bwd(&b_c, &BiasGelu).unwrap();
            let got = x_g.apply_op2_no_bwd(&b_g, &BiasGelu).unwrap();
            assert_close(
                &format!("bias-gelu {dtype:?} [{rows}, {cols}]"),
                &got,
                &want,
                tol,
            );
        }
    }
}

#[test]
fn pooling_matches_the_cpu_for_every_mode() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::new(6);
    let batches = [vec![1], vec![512], rng.lengths(17, 512), rng.lengths(5, 64)];
    for lens in &batches {
        let cu = cu_seqlens(lens);
        let tokens = *cu.last().unwrap() as usize;
        for cols in [384, 768] {
            let h = rng.tensor(&[tokens, cols], 2.0);
            let cu_c = Tensor::new(cu.as_slice(), &Device::Cpu).unwrap();
            let cu_g = cu_c.to_device(&gpu).unwrap();
            for (dtype, tol) in FLOAT_TYPES {
                let (h_c, h_g) = on_both(&h, dtype, &gpu);
                for pooling in [Pooling::Mean, Pooling::Cls, Pooling::Max] {
                    for normalize in [false, true] {
                        let op = SegmentedPool { pooling, normalize };
                        let want = h_c.apply_op2_no_bwd(&cu_c, &op).unwrap();
                        let got = h_g.apply_op2_no_bwd(&cu_g, &op).unwrap();
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
/// even, one multiplication), so the GPU must agree bit for bit.
#[test]
fn int8_quantisation_matches_the_cpu_bit_for_bit() {
    let Some(gpu) = gpu() else { return };
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
            let (x_c, x_g) = on_both(&x, dtype, &gpu);
            for granularity in [Granularity::PerTensor, Granularity::PerChannel] {
                let what = format!("int8 {granularity:?} {dtype:?} [{rows}, {cols}]");
                let op = Int8Scales { granularity };
                let s_c = x_c.apply_op1_no_bwd(&op).unwrap();
                let s_g = x_g.apply_op1_no_bwd(&op).unwrap();
                assert_eq!(
                    s_g.to_vec1::<f32>().unwrap(),
                    s_c.to_vec1::<f32>().unwrap(),
                    "{what}: scales"
                );
                let q_c = x_c.apply_op2_no_bwd(&s_c, &QuantizeInt8).unwrap();
                let q_g = x_g.apply_op2_no_bwd(&s_g, &QuantizeInt8).unwrap();
                assert_eq!(
                    q_g.to_vec2::<u8>().unwrap(),
                    q_c.to_vec2::<u8>().unwrap(),
                    "{what}: q"
                );
                let back_c = q_c.apply_op2_no_bwd(&s_c, &DequantizeInt8).unwrap();
                let back_g = q_g.apply_op2_no_bwd(&s_g, &DequantizeInt8).unwrap();
                assert_eq!(
                    back_g.to_vec2::<f32>().unwrap(),
                    back_c.to_vec2::<f32>().unwrap(),
                    "{what}: dequantised"
                );
            }
        }
    }
}

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
