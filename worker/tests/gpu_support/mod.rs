//! What the GPU tests share: finding the GPU (or saying why a test is skipped), random inputs
//! from a fixed seed, and tolerant comparison with a useful failure message.
#![allow(dead_code)] // each test binary uses its own part

use candle_core::{DType, Device, Tensor};

/// CUDA device 0, or `None` (after printing why) when there is none. With
/// TESSERA_REQUIRE_GPU set, a missing GPU fails the test instead.
pub fn gpu() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(device) => Some(device),
        Err(e) if std::env::var_os("TESSERA_REQUIRE_GPU").is_some() => {
            panic!("TESSERA_REQUIRE_GPU is set but CUDA device 0 cannot be opened: {e}")
        }
        Err(e) => {
            eprintln!("skipping: no CUDA GPU ({e})");
            None
        }
    }
}

/// Allowed difference `atol + rtol·|want|` per element.
#[derive(Debug, Clone, Copy)]
pub struct Tol {
    pub atol: f32,
    pub rtol: f32,
}

/// The storage types the kernels take, with tolerances of a few units in their last place
/// (f16 keeps 11 significant bits, bf16 8) on outputs of order one.
pub const FLOAT_TYPES: [(DType, Tol); 3] = [
    (
        DType::F32,
        Tol {
            atol: 1e-4,
            rtol: 1e-4,
        },
    ),
    (
        DType::F16,
        Tol {
            atol: 1e-2,
            rtol: 1e-2,
        },
    ),
    (
        DType::BF16,
        Tol {
            atol: 5e-2,
            rtol: 5e-2,
        },
    ),
];

fn host_f32(t: &Tensor) -> Vec<f32> {
    t.to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

/// Fails with the worst element when `got` and `want` differ by more than `tol` anywhere.
pub fn assert_close(what: &str, got: &Tensor, want: &Tensor, tol: Tol) {
    assert_eq!(got.dims(), want.dims(), "{what}: shapes differ");
    let (g, w) = (host_f32(got), host_f32(want));
    let mut worst: Option<(usize, f32)> = None;
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        let excess = (a - b).abs() - (tol.atol + tol.rtol * b.abs());
        if !(excess <= 0.0) && worst.is_none_or(|(_, e)| excess > e || e.is_nan()) {
            worst = Some((i, excess));
        }
    }
    if let Some((i, _)) = worst {
        panic!(
            "{what}: element {i} of {:?} is {} from the kernel, {} on the CPU (tolerance {tol:?})",
            got.dims(),
            g[i],
            w[i]
        );
    }
}

/// xorshift64*, so a failure reproduces from its seed.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next_u32(&mut self) -> u32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 32) as u32
    }

    /// Uniform in 0..n.
    pub fn below(&mut self, n: usize) -> usize {
        self.next_u32() as usize % n
    }

    /// Uniform in [-scale, scale).
    pub fn uniform(&mut self, scale: f32) -> f32 {
        (self.next_u32() as f32 / u32::MAX as f32 * 2.0 - 1.0) * scale
    }

    pub fn tensor(&mut self, shape: &[usize], scale: f32) -> Tensor {
        let n = shape.iter().product();
        let data: Vec<f32> = (0..n).map(|_| self.uniform(scale)).collect();
        Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
    }

    /// `count` lengths uniform in 1..=max; with two or more, the first is 1 and the last is
    /// `max`, so every batch has both extremes.
    pub fn lengths(&mut self, count: usize, max: usize) -> Vec<usize> {
        let mut lens: Vec<usize> = (0..count).map(|_| 1 + self.below(max)).collect();
        if count >= 2 {
            lens[0] = 1;
        }
        lens[count - 1] = max;
        lens
    }
}
