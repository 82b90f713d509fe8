//! The training engine's GPU paths against their CPU references: the trainable linear at
//! bf16, f16 and int8 on cuBLAS/cuBLASLt (`train/precision/cuda.rs`) forward and backward,
//! and, with the `nccl` feature, the NCCL all-reduce of a gang's gradients
//! (`collective/nccl.rs`) and the choice between it and the TCP ring.
//!
//! Needs a CUDA GPU (two for the two-rank NCCL test): without one each test prints why and
//! passes, unless TESSERA_REQUIRE_GPU=1 (the GPU machine sets it; the two-GPU test still only
//! skips, saying so, on a one-GPU machine).
#![cfg(feature = "cuda")]

mod gpu_support;

use candle_core::{DType, Device, Tensor, Var};
use gpu_support::{gpu, Rng};
use tessera_worker::train::precision::{linear, Precision};

/// `‖a − b‖ / ‖b‖` over all elements, both brought to the CPU.
fn relative_error(a: &Tensor, b: &Tensor) -> f64 {
    let host = |t: &Tensor| -> Vec<f64> {
        let t = t
            .to_device(&Device::Cpu)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap();
        t.flatten_all().unwrap().to_vec1::<f64>().unwrap()
    };
    let (a, b) = (host(a), host(b));
    assert_eq!(a.len(), b.len(), "shapes differ");
    let diff: f64 = a.iter().zip(&b).map(|(x, y)| (x - y).powi(2)).sum();
    let norm: f64 = b.iter().map(|y| y * y).sum();
    (diff / norm.max(f64::MIN_POSITIVE)).sqrt()
}

/// The layer's output and its gradients with respect to x, W and b of `Σ y ⊙ probe`, on
/// `device`.
fn run(device: &Device, precision: Precision, inputs: &[Tensor; 4]) -> [Tensor; 4] {
    let on = |t: &Tensor| Var::from_tensor(&t.to_device(device).unwrap()).unwrap();
    let (x, w, b) = (on(&inputs[0]), on(&inputs[1]), on(&inputs[2]));
    let probe = inputs[3].to_device(device).unwrap();
    let y = linear(x.as_tensor(), w.as_tensor(), b.as_tensor(), precision).unwrap();
    let grads = (&y * &probe)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let grad = |v: &Var| {
        grads
            .get(v.as_tensor())
            .expect("a gradient")
            .to_device(&Device::Cpu)
            .unwrap()
    };
    [
        y.to_device(&Device::Cpu).unwrap(),
        grad(&x),
        grad(&w),
        grad(&b),
    ]
}

/// x at LayerNorm scale, W of 0.05, b of 0.1 and an upstream gradient of 1e-3 (MiniLM-like),
/// at model shapes and at one odd shape (no dimension a multiple of 4, so the int8 GEMM pads).
fn cases() -> Vec<((usize, usize, usize), [Tensor; 4])> {
    let mut rng = Rng::new(12);
    [(96, 384, 384), (64, 384, 1536), (64, 1536, 384), (7, 33, 5)]
        .into_iter()
        .map(|(m, k, n)| {
            let inputs = [
                rng.tensor(&[m, k], 2.0),
                rng.tensor(&[n, k], 0.05),
                rng.tensor(&[n], 0.1),
                rng.tensor(&[m, n], 1e-3),
            ];
            ((m, k, n), inputs)
        })
        .collect()
}

const WHAT: [&str; 4] = ["y", "dx", "dw", "db"];

/// bf16 on the GPU against the CPU's bf16 op: both round the same operands to bf16 and sum
/// in f32, so they differ only by summation order: ‖gpu − cpu‖/‖cpu‖ ≤ 1e-4 (f32 rounding
/// over k ≤ 1536 terms is ~√k·2⁻²⁴ ≈ 3e-6; 1e-4 leaves room for cuBLAS's tensor-core
/// accumulation). Each must also be more than 1e-4 from f32, so a layer that silently ran at
/// f32 fails.
#[test]
fn bf16_linear_matches_the_cpu_op_forward_and_backward() {
    let Some(device) = gpu() else { return };
    for ((m, k, n), inputs) in cases() {
        let cpu = run(&Device::Cpu, Precision::Bf16, &inputs);
        let f32 = run(&Device::Cpu, Precision::F32, &inputs);
        let got = run(&device, Precision::Bf16, &inputs);
        for i in 0..4 {
            let err = relative_error(&got[i], &cpu[i]);
            eprintln!(
                "bf16 [{m}, {k}, {n}] {}: {err:.2e} from the CPU op",
                WHAT[i]
            );
            assert!(
                err <= 1e-4,
                "bf16 [{m}, {k}, {n}] {}: relative error {err} against the CPU op",
                WHAT[i]
            );
        }
        for i in 0..3 {
            let from_f32 = relative_error(&got[i], &f32[i]);
            assert!(
                from_f32 > 1e-4,
                "bf16 [{m}, {k}, {n}] {}: {from_f32} from f32, as if computed at f32",
                WHAT[i]
            );
        }
    }
}

/// f16 has no CPU op (the CPU refuses it); its reference is the same products in f64 over
/// operands rounded to f16: within 1e-4 relative, as bf16 above. The bias gradient is f32.
#[test]
fn f16_linear_matches_f16_rounded_operands_summed_in_f64() {
    let Some(device) = gpu() else { return };
    let f16 = |t: &Tensor| {
        t.to_dtype(DType::F16)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
    };
    for ((m, k, n), inputs) in cases() {
        let [x, w, b, probe] = &inputs;
        let want = [
            f16(x)
                .matmul(&f16(w).t().unwrap())
                .unwrap()
                .broadcast_add(&b.to_dtype(DType::F64).unwrap())
                .unwrap(),
            f16(probe).matmul(&f16(w)).unwrap(),
            f16(probe).t().unwrap().matmul(&f16(x)).unwrap(),
            probe.to_dtype(DType::F64).unwrap().sum(0).unwrap(),
        ];
        let got = run(&device, Precision::F16, &inputs);
        for i in 0..4 {
            let err = relative_error(&got[i], &want[i]);
            eprintln!(
                "f16 [{m}, {k}, {n}] {}: {err:.2e} from the f64 reference",
                WHAT[i]
            );
            assert!(
                err <= 1e-4,
                "f16 [{m}, {k}, {n}] {}: relative error {err}",
                WHAT[i]
            );
        }
    }
}

/// int8 on the GPU against the CPU's int8 op. The forward is exact on both sides up to the
/// same f32 roundings (absmax/127 scales, q rounded half to even, exact i32 sums, then
/// `sum · (s_x·s_w) + b` rounded step by step), so it must agree bit for bit. The backward is
/// bf16 GEMMs from the same q_x and W: ≤ 1e-4 relative, as bf16 above.
#[test]
fn int8_linear_forward_is_bit_exact_and_backward_matches_the_cpu_op() {
    let Some(device) = gpu() else { return };
    for ((m, k, n), inputs) in cases() {
        let cpu = run(&Device::Cpu, Precision::Int8, &inputs);
        let got = run(&device, Precision::Int8, &inputs);
        assert_eq!(
            got[0].to_vec2::<f32>().unwrap(),
            cpu[0].to_vec2::<f32>().unwrap(),
            "int8 [{m}, {k}, {n}] y: not bit-identical to the CPU op"
        );
        for i in 1..4 {
            let err = relative_error(&got[i], &cpu[i]);
            eprintln!(
                "int8 [{m}, {k}, {n}] {}: {err:.2e} from the CPU op",
                WHAT[i]
            );
            assert!(
                err <= 1e-4,
                "int8 [{m}, {k}, {n}] {}: relative error {err} against the CPU op",
                WHAT[i]
            );
        }
    }
}

/// Leading dims are kept and a weight that does not fit is refused, at every precision.
#[test]
fn cuda_linear_keeps_leading_dims_and_refuses_mismatched_shapes() {
    let Some(device) = gpu() else { return };
    let mut rng = Rng::new(13);
    let x = rng.tensor(&[2, 3, 8], 1.0).to_device(&device).unwrap();
    let w = rng.tensor(&[5, 8], 0.1).to_device(&device).unwrap();
    let b = Tensor::zeros(5, DType::F32, &device).unwrap();
    for precision in [
        Precision::Int8,
        Precision::F16,
        Precision::Bf16,
        Precision::F32,
    ] {
        assert_eq!(
            linear(&x, &w, &b, precision).unwrap().dims(),
            [2, 3, 5],
            "{precision}"
        );
        assert!(
            linear(&x, &w.t().unwrap(), &b, precision).is_err(),
            "{precision}"
        );
    }
}

#[cfg(feature = "nccl")]
mod nccl {
    use std::time::Duration;

    use candle_core::backprop::GradStore;
    use candle_core::{DType, Device, Tensor, Var};
    use tessera_worker::collective::nccl::NcclSync;
    use tessera_worker::collective::ring::{loopback, Ring};
    use tessera_worker::collective::{for_gang, Transport};
    use tessera_worker::train::trainer::GradientSync;
    use uuid::Uuid;

    use super::gpu;

    const TIMEOUT: Duration = Duration::from_secs(60);

    /// Three parameters on `device`, and the gradients of a loss in which the first two take
    /// part with rank-dependent weights and the third not at all (a zero gradient).
    fn step(device: &Device, rank: usize) -> (Vec<(String, Var)>, GradStore, Vec<Vec<f32>>) {
        let var = |shape: &[usize]| {
            Var::from_tensor(&Tensor::ones(shape, DType::F32, device).unwrap()).unwrap()
        };
        let parameters = vec![
            ("w".to_string(), var(&[3, 4])),
            ("b".to_string(), var(&[4])),
            ("unused".to_string(), var(&[2])),
        ];
        let weights: Vec<Vec<f32>> = [12usize, 4]
            .iter()
            .enumerate()
            .map(|(p, n)| {
                (0..*n)
                    .map(|i| (rank * 100 + p * 10 + i) as f32 * 0.37 - 3.1)
                    .collect()
            })
            .collect();
        let mut loss = Tensor::zeros((), DType::F32, device).unwrap();
        for ((_, var), w) in parameters.iter().zip(&weights) {
            let w = Tensor::from_slice(w, var.shape(), device).unwrap();
            loss = (loss + (var.as_tensor() * w).unwrap().sum_all().unwrap()).unwrap();
        }
        let grads = loss.backward().unwrap();
        (parameters, grads, weights)
    }

    fn values(grads: &GradStore, var: &Var) -> Vec<f32> {
        let grad = grads
            .get(var.as_tensor())
            .expect("a gradient after synchronising");
        grad.to_device(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    }

    /// One GPU: NCCL initialises a communicator of one rank and its all-reduce returns each
    /// gradient unchanged (zeros for the unused parameter) and the loss.
    #[test]
    fn nccl_initialises_and_all_reduces_a_world_of_one() {
        let Some(device) = gpu() else { return };
        let mut sync = NcclSync::new(Ring::alone(), &device, TIMEOUT)
            .expect("NCCL initialises a world of one");
        let (parameters, mut grads, weights) = step(&device, 0);
        let loss = sync.synchronise(&parameters, &mut grads, 2.5).unwrap();
        assert_eq!(loss, 2.5);
        assert_eq!(values(&grads, &parameters[0].1), weights[0]);
        assert_eq!(values(&grads, &parameters[1].1), weights[1]);
        assert_eq!(values(&grads, &parameters[2].1), vec![0.0; 2]);
        assert!(sync.last_timing().is_some());
    }

    /// The transports two ranks on `devices` pick.
    fn transports(devices: [Device; 2]) -> Vec<Transport> {
        let rings = loopback(2, Uuid::new_v4(), TIMEOUT).unwrap();
        std::thread::scope(|scope| {
            let handles: Vec<_> = rings
                .into_iter()
                .zip(devices)
                .map(|(ring, device)| {
                    scope
                        .spawn(move || for_gang(ring, &device, TIMEOUT, Default::default()).map(|(_, _, t)| t).unwrap())
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// A gang with a CPU rank keeps the host-staged ring on every rank, even when the other
    /// rank is a CUDA GPU in an NCCL build.
    #[test]
    fn a_gang_with_a_cpu_rank_keeps_the_ring() {
        let Some(device) = gpu() else { return };
        assert_eq!(
            transports([device, Device::Cpu]),
            [Transport::Ring, Transport::Ring]
        );
    }

    /// Two ranks on one GPU keep the ring: NCCL refuses a GPU twice in one communicator.
    #[test]
    fn two_ranks_on_one_gpu_keep_the_ring() {
        let Some(device) = gpu() else { return };
        assert_eq!(
            transports([device.clone(), device]),
            [Transport::Ring, Transport::Ring]
        );
    }

    /// Two GPUs, two ranks: both pick NCCL, and each ends with the sum of both ranks'
    /// gradients and losses, bit for bit what the CPU adds (a sum of two is exact in any
    /// order). Skips, saying so, with fewer than two GPUs.
    #[test]
    fn nccl_two_ranks_sum_their_gradients_on_two_gpus() {
        let Some(_) = gpu() else { return };
        let count =
            candle_core::cuda_backend::cudarc::driver::CudaContext::device_count().unwrap_or(0);
        if count < 2 {
            eprintln!("skipping: the two-rank NCCL test needs two GPUs, this machine has {count}");
            return;
        }
        let rings = loopback(2, Uuid::new_v4(), TIMEOUT).unwrap();
        let results: Vec<(Transport, f64, Vec<Vec<f32>>, Vec<Vec<f32>>)> =
            std::thread::scope(|scope| {
                let handles: Vec<_> = rings
                    .into_iter()
                    .enumerate()
                    .map(|(rank, ring)| {
                        scope.spawn(move || {
                            let device = Device::new_cuda(rank).unwrap();
                            let (mut sync, _, transport) =
                                for_gang(ring, &device, TIMEOUT, Default::default()).unwrap();
                            let (parameters, mut grads, weights) = step(&device, rank);
                            let loss = sync
                                .synchronise(&parameters, &mut grads, 1.25 + rank as f64)
                                .unwrap();
                            let summed =
                                parameters.iter().map(|(_, v)| values(&grads, v)).collect();
                            (transport, loss, weights, summed)
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
        for (rank, (transport, loss, _, summed)) in results.iter().enumerate() {
            assert_eq!(*transport, Transport::Nccl, "rank {rank}");
            assert_eq!(*loss, 3.5, "rank {rank}: the summed loss");
            for p in 0..2 {
                let want: Vec<f32> = results[0].2[p]
                    .iter()
                    .zip(&results[1].2[p])
                    .map(|(a, b)| a + b)
                    .collect();
                assert_eq!(summed[p], want, "rank {rank}, parameter {p}");
            }
            assert_eq!(summed[2], vec![0.0; 2], "rank {rank}: the unused parameter");
        }
    }
}
