//! The engine's CUDA path. The launch plans (which kernel, what grid, how much shared memory)
//! and the compute-capability check are pure and built everywhere, so their tests run in the
//! CPU suite; with the `cuda` feature, `kernels` launches `worker/kernels/*.cu` as the
//! `cuda_fwd` of the ops beside this module. GEMMs are not here: they are candle's cuBLAS
//! matmul.

pub mod compute_cap;
pub mod plan;

#[cfg(feature = "cuda")]
pub mod kernels;
