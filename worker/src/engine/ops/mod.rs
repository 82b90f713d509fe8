//! The engine's fused kernels, written as candle `CustomOp`s. Each op has one home,
//! `<op>/`: its CPU implementation (the reference) in `mod.rs`, its CUDA kernel in `<op>.cu`
//! and that kernel's launch in `cuda.rs`, run by a CUDA build's `cuda_fwd` with the same
//! inputs, so the model code does not change (`README.md` here describes the kernels). All
//! of them work on packed activations (`[total_tokens, hidden]`); the ones that need sequence
//! boundaries (attention, pooling) take the batch's `cu_seqlens` as a `u32` tensor on the
//! same device.

pub mod bias_gelu;
pub mod bias_residual_layernorm;
pub mod cuda;
pub mod int8;
pub mod linear;
pub mod pooling;
pub mod varlen_attention;
pub(crate) mod vector_math;

pub use bias_gelu::BiasGelu;
pub use bias_residual_layernorm::BiasResidualLayerNorm;
pub use int8::{DequantizeInt8, DequantizeSums, Granularity, Int8Scales, QuantizeInt8};
pub use linear::{gemm_nt_bf16, gemm_nt_f32, gemm_nt_i8, round_bf16, Activation, GemmInputs, Linear, MatRef, PackedWeight};
pub use pooling::{Pooling, SegmentedPool};
pub use varlen_attention::VarlenAttention;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, Layout, Result};
use rayon::iter::ParallelExtend;
use cuda::{CudaKernel, Module};

/// Every op's CUDA module, loaded at start (`cuda::compute_cap::probe`).
pub const CUDA_MODULES: [Module; 5] = [
    BiasGelu::MODULE,
    BiasResidualLayerNorm::MODULE,
    Int8Scales::MODULE,
    SegmentedPool::MODULE,
    VarlenAttention::MODULE,
];

/// The contiguous f32 data behind a CPU tensor. The kernels index rows directly, so a strided
/// view is refused rather than silently copied.
fn contiguous_f32<'a>(op: &str, what: &str, s: &'a CpuStorage, l: &Layout) -> Result<&'a [f32]> {
    let data = match s {
        CpuStorage::F32(data) => data.as_slice(),
        other => bail!("{op}: {what} must be f32, got {:?}", other.dtype()),
    };
    match l.contiguous_offsets() {
        Some((start, end)) => Ok(&data[start..end]),
        None => bail!("{op}: {what} must be contiguous"),
    }
}

/// The `cu_seqlens` prefix offsets as a host slice, checked to be a valid partition of
/// `total_tokens` rows: starts at 0, never decreases, ends at `total_tokens`.
fn cu_seqlens<'a>(
    op: &str,
    s: &'a CpuStorage,
    l: &Layout,
    total_tokens: usize,
) -> Result<&'a [u32]> {
    let data = match s {
        CpuStorage::U32(data) => data.as_slice(),
        other => bail!("{op}: cu_seqlens must be u32, got {:?}", other.dtype()),
    };
    let cu = match l.contiguous_offsets() {
        Some((start, end)) => &data[start..end],
        None => bail!("{op}: cu_seqlens must be contiguous"),
    };
    if cu.is_empty() || cu[0] != 0 || *cu.last().unwrap() as usize != total_tokens {
        bail!("{op}: cu_seqlens must run from 0 to {total_tokens}, got {cu:?}");
    }
    if cu.windows(2).any(|w| w[1] < w[0]) {
        bail!("{op}: cu_seqlens must not decrease");
    }
    Ok(cu)
}

/// A raw output pointer shared by workers that write disjoint parts of one buffer.
#[derive(Clone, Copy)]
struct SharedMut(*mut f32);
// SAFETY: every user writes only the rows/columns of its own work item, so no two threads
// touch the same element, and the buffer outlives the parallel loop that uses it.
unsafe impl Send for SharedMut {}
unsafe impl Sync for SharedMut {}

impl SharedMut {
    /// The pointer `offset` floats in (a method, so closures capture the whole wrapper).
    ///
    /// # Safety
    /// `offset` must stay inside the buffer.
    unsafe fn at(self, offset: usize) -> *mut f32 {
        self.0.add(offset)
    }
}

/// `n` zeros for an op's output or scratch, cleared by the current rayon pool's threads when
/// `n` is large. `vec![0; n]` clears on the calling thread alone (glibc's calloc clears reused
/// heap memory), a serial pass over the whole buffer that every thread of a many-threaded
/// CPU rank waits for; in a 2-thread training step those passes were ~5% of all CPU time.
pub(crate) fn zeros<T: Copy + Default + Send + Sync>(n: usize) -> Vec<T> {
    const SERIAL: usize = 1 << 16;
    if n < SERIAL {
        return vec![T::default(); n];
    }
    let mut out = Vec::with_capacity(n);
    out.par_extend(rayon::iter::repeat_n(T::default(), n));
    out
}

/// Whether the AVX2+FMA kernels may run on this CPU (checked once; std caches the cpuid).
#[inline]
pub(crate) fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the AVX-512 f32 GEMM kernel may run on this CPU (AVX512F, and AVX2+FMA for its
/// epilogue).
#[inline]
pub(crate) fn has_avx512f() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        has_avx2_fma() && std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the bf16 GEMM kernel may run on this CPU (AVX512F with AVX512-BF16, and AVX2+FMA
/// for its epilogue).
#[inline]
pub(crate) fn has_avx512_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        has_avx2_fma()
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the int8 GEMM may use AVX512-VNNI (`vpdpbusd` on 512-bit registers); without it
/// `gemm_nt_i8` runs on the f32 kernel, exact, at 0.7–1.1× f32's speed
/// (bench/results/qsync_gemm-avx2.md).
#[inline]
pub fn has_avx512_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Rows per parallel work item for row-wise kernels: large enough to amortise scheduling,
/// small enough that two cores split even a short batch.
fn rows_per_task(rows: usize, row_len: usize) -> usize {
    let target_elems = 16 * 1024;
    (target_elems / row_len.max(1)).clamp(1, rows.div_ceil(2).max(1))
}

/// Random ragged batches for the kernels' tests, from a fixed-seed generator so a failure
/// reproduces.
#[cfg(test)]
mod test_inputs {
    use candle_core::{Device, Tensor};

    pub struct Rng(u64);

    impl Rng {
        pub fn new(seed: u64) -> Self {
            Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
        }

        pub fn next_u32(&mut self) -> u32 {
            // xorshift64*
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 32) as u32
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

        /// `count` sequence lengths in 1..=max, with 1 and max always present.
        pub fn lengths(&mut self, count: usize, max: usize) -> Vec<usize> {
            let mut lens: Vec<usize> = (0..count)
                .map(|_| 1 + self.next_u32() as usize % max)
                .collect();
            lens[0] = 1;
            lens[count - 1] = max;
            lens
        }
    }

    pub fn cu_seqlens(lens: &[usize]) -> (Vec<u32>, Tensor) {
        let mut cu = vec![0u32];
        for len in lens {
            cu.push(cu.last().unwrap() + *len as u32);
        }
        let t = Tensor::from_slice(&cu, cu.len(), &Device::Cpu).unwrap();
        (cu, t)
    }

    pub fn max_abs_diff(a: &[f32], b: &[f64]) -> f64 {
        a.iter()
            .zip(b)
            .map(|(x, y)| (*x as f64 - y).abs())
            .fold(0.0, f64::max)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn zeros_are_zeros_at_every_size() {
        for n in [0, 7, (1 << 16) - 1, 1 << 16, 3 << 20] {
            // Dirty heap memory the next allocation may reuse.
            drop(std::hint::black_box(vec![1f32; n]));
            let zeros = super::zeros::<f32>(n);
            assert_eq!(zeros.len(), n);
            assert!(zeros.iter().all(|v| *v == 0.0), "{n} values");
        }
    }
}
