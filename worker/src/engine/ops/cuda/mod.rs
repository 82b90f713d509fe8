//! What every op's CUDA path shares: the launch as plain data ([`Plan`], which each op
//! makes in its own `cuda.rs` beside its `.cu` file), the shared launch geometry (`plan`),
//! the compute-capability check, and with the `cuda` feature the one runner that executes a
//! plan on a GPU ([`run`]). Everything but the runner is pure and built everywhere, so the
//! CPU suite tests it and the CPU emulator runs the same plans. GEMMs are not here: they
//! are candle's cuBLAS matmul.

pub mod compute_cap;
pub mod launch;
pub mod plan;
#[cfg(feature = "cuda")]
mod run;

pub use launch::{Arg, CudaKernel, Launch, Module, Operand, Output, Plan};
#[cfg(feature = "cuda")]
pub use run::{load_all, run};
