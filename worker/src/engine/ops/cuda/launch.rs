//! A kernel launch as plain data: which kernel, what grid, how much shared memory, and the
//! arguments in order. Each op plans its own launches from its inputs' dtypes and shapes
//! ([`CudaKernel::plan`], in `ops/<op>/cuda.rs`), checked as its CPU path checks them; one
//! runner executes a plan on a GPU (`run.rs`, with the `cuda` feature) and the CPU emulator
//! of the tests executes the very same plan, so what the tests launch is what the GPU runs.

use super::plan::{elementwise_blocks, row_shared_bytes, ELEMENTWISE_THREADS};
use candle_core::{bail, DType, Result, Shape};

/// One `.cu` file beside an op: its PTX (with the `cuda` feature, compiled by build.rs) and a
/// kernel it exports, loaded at start to prove the PTX loads on this GPU.
#[derive(Debug, Clone, Copy)]
pub struct Module {
    pub name: &'static str,
    pub probe: &'static str,
    #[cfg(feature = "cuda")]
    pub ptx: &'static str,
}

/// The [`Module`] compiled from `<name>.cu`, exporting `probe`.
macro_rules! cuda_module {
    ($name:literal, probe: $probe:literal) => {
        $crate::engine::ops::cuda::Module {
            name: $name,
            probe: $probe,
            #[cfg(feature = "cuda")]
            ptx: include_str!(concat!(env!("OUT_DIR"), "/", $name, ".ptx")),
        }
    };
}
pub(crate) use cuda_module;

/// An op whose forward pass runs as CUDA kernels.
pub trait CudaKernel {
    /// The module its kernels live in.
    const MODULE: Module;

    /// The launches for these inputs (in the op's input order), or why there is none.
    fn plan(&self, inputs: &[Operand]) -> Result<Plan>;
}

/// What a plan may know of an input: never its values, which stay on the device.
#[derive(Debug, Clone, Copy)]
pub struct Operand<'a> {
    pub dtype: DType,
    pub shape: &'a Shape,
}

/// The op's launches, in order, and the one output buffer they fill.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The op, for error messages.
    pub op: &'static str,
    pub output: Output,
    pub launches: Vec<Launch>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Output {
    pub dtype: DType,
    pub shape: Shape,
    /// Zeroed before the first launch (a kernel that accumulates into it); otherwise every
    /// element is written by the launches before anything reads it.
    pub zeroed: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Launch {
    /// The exported function, e.g. `bias_gelu_f16`.
    pub kernel: String,
    pub grid: (u32, u32, u32),
    pub threads: u32,
    pub shared_bytes: u32,
    pub args: Vec<Arg>,
}

impl Plan {
    /// One launch that writes every element of a `dtype` output of `shape`.
    pub fn single(op: &'static str, dtype: DType, shape: impl Into<Shape>, launch: Launch) -> Plan {
        let output = Output {
            dtype,
            shape: shape.into(),
            zeroed: false,
        };
        Plan {
            op,
            output,
            launches: vec![launch],
        }
    }
}

impl Launch {
    /// A grid-stride kernel over `n` elements, without shared memory.
    pub fn elementwise(kernel: String, n: usize, args: Vec<Arg>) -> Launch {
        let (grid, threads) = ((elementwise_blocks(n), 1, 1), ELEMENTWISE_THREADS);
        Launch {
            kernel,
            grid,
            threads,
            shared_bytes: 0,
            args,
        }
    }

    /// One block of `threads` per row (or sequence) of a `[rows, cols]` input, keeping one
    /// f32 row in shared memory.
    pub fn per_row(
        op: &str,
        kernel: String,
        (rows, cols): (usize, usize),
        threads: u32,
        args: Vec<Arg>,
    ) -> Result<Launch> {
        let shared_bytes = row_shared_bytes(cols).map_err(plan_error(op))?;
        Ok(Launch {
            kernel,
            grid: (rows as u32, 1, 1),
            threads,
            shared_bytes,
            args,
        })
    }
}

/// One kernel argument, in the kernel's parameter order.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arg {
    /// The op's input of this index, as a pointer to its first element.
    Input(usize),
    /// The output buffer.
    Output,
    I32(i32),
    U64(u64),
    F32(f32),
}

impl Operand<'_> {
    /// `[rows, cols]`, neither of them 0.
    pub fn rows_cols(&self, op: &str) -> Result<(usize, usize)> {
        let (rows, cols) = self.shape.dims2()?;
        if rows == 0 || cols == 0 {
            bail!("{op}: an empty [{rows}, {cols}] input has nothing to compute");
        }
        Ok((rows, cols))
    }

    /// Refuses `self` unless it has the input's dtype.
    pub fn same_dtype_as(&self, input: &Operand, op: &str, what: &str) -> Result<()> {
        if self.dtype != input.dtype {
            bail!(
                "{op}: {what} is {:?} but the input is {:?}",
                self.dtype,
                input.dtype
            );
        }
        Ok(())
    }

    /// Refuses `self` unless it is of `dtype`.
    pub fn expect_dtype(&self, dtype: DType, op: &str, what: &str) -> Result<()> {
        if self.dtype != dtype {
            bail!(
                "{op}: {what} must be {}, got {:?}",
                dtype.as_str(),
                self.dtype
            );
        }
        Ok(())
    }
}

/// The inputs an op takes, or an error naming the count it got.
pub fn operands<'a, const N: usize>(op: &str, inputs: &[Operand<'a>]) -> Result<[Operand<'a>; N]> {
    match inputs.try_into() {
        Ok(operands) => Ok(operands),
        Err(_) => bail!("{op}: {} inputs, expected {N}", inputs.len()),
    }
}

/// The kernel `root` for a tensor of `dtype` (`root_f32`, `root_f16`, `root_bf16`: the
/// names `FOR_EACH_STORAGE` in `common.cuh` exports).
pub fn float_kernel(op: &str, root: &str, dtype: DType) -> Result<String> {
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => Ok(format!("{root}_{}", dtype.as_str())),
        other => bail!("{op}: {other:?} has no CUDA kernel (f32, f16 or bf16)"),
    }
}

/// A launch-geometry refusal (`plan.rs`) as the op's error.
pub fn plan_error(op: &str) -> impl Fn(String) -> candle_core::Error + '_ {
    move |e| candle_core::Error::Msg(format!("{op}: {e}"))
}
