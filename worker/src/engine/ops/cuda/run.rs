//! Runs an op's [`Plan`](super::Plan) on its inputs' GPU: the one place that launches our
//! kernels. The module is loaded once per device through candle's module cache, the output
//! is allocated on the inputs' device, and the launches queue on candle's stream behind
//! candle's own work (the cuBLAS GEMMs), so a forward pass never waits on the GPU.
//!
//! What cannot be checked without reading device memory is trusted: `cu_seqlens` must be a
//! valid partition of the rows with no empty sequence (the host batcher builds it that way,
//! `Batch::pack`), and `VarlenAttention::max_seqlen` must be the longest sequence's length.

use super::launch::{Arg, CudaKernel, Module, Operand, Output};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, LaunchArgs, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Shape};
use half::{bf16, f16};

/// Plans `op` for `inputs` and runs the plan: the `cuda_fwd` of every op with a kernel.
pub fn run<K: CudaKernel>(
    op: &K,
    inputs: &[(&CudaStorage, &Layout)],
) -> Result<(CudaStorage, Shape)> {
    let operands: Vec<Operand> = inputs
        .iter()
        .map(|(s, l)| Operand {
            dtype: s.dtype(),
            shape: l.shape(),
        })
        .collect();
    let plan = op.plan(&operands)?;
    let Some((first, _)) = inputs.first() else {
        bail!("{}: no inputs", plan.op)
    };
    let dev = &first.device;
    let views = inputs
        .iter()
        .map(|(s, l)| Input::of(plan.op, s, l))
        .collect::<Result<Vec<_>>>()?;
    let mut output = Buffer::alloc(dev, &plan.output)?;
    let module_name = format!("tessera_{}", K::MODULE.name);
    for launch in &plan.launches {
        let func = dev.get_or_load_custom_func(&launch.kernel, &module_name, K::MODULE.ptx)?;
        let mut args = func.builder();
        // The output is lent to one launch argument at most, as the kernel's one written buffer.
        let mut unused_output = Some(&mut output);
        for arg in &launch.args {
            match arg {
                Arg::Input(i) => match views.get(*i) {
                    Some(view) => view.push(&mut args),
                    None => bail!(
                        "{}: {} names input {i} of {}",
                        plan.op,
                        launch.kernel,
                        views.len()
                    ),
                },
                Arg::Output => match unused_output.take() {
                    Some(output) => output.push(&mut args),
                    None => bail!("{}: {} names the output twice", plan.op, launch.kernel),
                },
                Arg::I32(v) => {
                    args.arg(v);
                }
                Arg::U64(v) => {
                    args.arg(v);
                }
                Arg::F32(v) => {
                    args.arg(v);
                }
            }
        }
        let config = LaunchConfig {
            grid_dim: launch.grid,
            block_dim: (launch.threads, 1, 1),
            shared_mem_bytes: launch.shared_bytes,
        };
        // SAFETY: the plan was made for these inputs' dtypes and shapes by the op that owns
        // the kernel, which names its parameters in order and sizes its grid so every access
        // stays inside the checked shapes (`cu_seqlens` aside: see the module comment).
        unsafe { args.launch(config) }.w()?;
    }
    Ok((output.into_storage(dev), plan.output.shape))
}

/// Loads every module on `device` (the driver JIT-compiles the PTX here), so a GPU or driver
/// that cannot take them is found at start rather than in a request.
pub fn load_all(device: &CudaDevice, modules: &[Module]) -> Result<()> {
    for module in modules {
        device.get_or_load_custom_func(
            module.probe,
            &format!("tessera_{}", module.name),
            module.ptx,
        )?;
    }
    Ok(())
}

/// Runs `$body` with `$v` bound to the typed value inside any variant of `$enum`.
macro_rules! each_type {
    ($enum:ident, $value:expr, $v:ident => $body:expr) => {
        match $value {
            $enum::F32($v) => $body,
            $enum::F16($v) => $body,
            $enum::BF16($v) => $body,
            $enum::U8($v) => $body,
            $enum::U32($v) => $body,
        }
    };
}

/// An input's elements on the device, in its own type.
enum Input<'a> {
    F32(CudaView<'a, f32>),
    F16(CudaView<'a, f16>),
    BF16(CudaView<'a, bf16>),
    U8(CudaView<'a, u8>),
    U32(CudaView<'a, u32>),
}

impl<'a> Input<'a> {
    /// The elements of `s` that `l` covers, which must be contiguous.
    fn of(op: &str, s: &'a CudaStorage, l: &Layout) -> Result<Self> {
        let Some((start, end)) = l.contiguous_offsets() else {
            bail!("{op}: every input must be contiguous");
        };
        Ok(match s.dtype() {
            DType::F32 => Input::F32(s.as_cuda_slice::<f32>()?.slice(start..end)),
            DType::F16 => Input::F16(s.as_cuda_slice::<f16>()?.slice(start..end)),
            DType::BF16 => Input::BF16(s.as_cuda_slice::<bf16>()?.slice(start..end)),
            DType::U8 => Input::U8(s.as_cuda_slice::<u8>()?.slice(start..end)),
            DType::U32 => Input::U32(s.as_cuda_slice::<u32>()?.slice(start..end)),
            other => bail!("{op}: no kernel takes {other:?}"),
        })
    }

    fn push<'b>(&'b self, args: &mut LaunchArgs<'b>) {
        each_type!(Input, self, view => {
            args.arg(view);
        })
    }
}

/// The output buffer, in its own type.
enum Buffer {
    F32(CudaSlice<f32>),
    F16(CudaSlice<f16>),
    BF16(CudaSlice<bf16>),
    U8(CudaSlice<u8>),
    U32(CudaSlice<u32>),
}

impl Buffer {
    fn alloc(dev: &CudaDevice, output: &Output) -> Result<Self> {
        let len = output.shape.elem_count();
        macro_rules! alloc {
            ($t:ty) => {
                if output.zeroed {
                    dev.alloc_zeros::<$t>(len)?
                } else {
                    // SAFETY: the plan's launches write every element before anything reads
                    // it (`Output::zeroed`).
                    unsafe { dev.alloc::<$t>(len)? }
                }
            };
        }
        Ok(match output.dtype {
            DType::F32 => Buffer::F32(alloc!(f32)),
            DType::F16 => Buffer::F16(alloc!(f16)),
            DType::BF16 => Buffer::BF16(alloc!(bf16)),
            DType::U8 => Buffer::U8(alloc!(u8)),
            DType::U32 => Buffer::U32(alloc!(u32)),
            other => bail!("no kernel writes {other:?}"),
        })
    }

    fn push<'b>(&'b mut self, args: &mut LaunchArgs<'b>) {
        each_type!(Buffer, self, slice => {
            args.arg(slice);
        })
    }

    fn into_storage(self, dev: &CudaDevice) -> CudaStorage {
        each_type!(Buffer, self, slice => CudaStorage::wrap_cuda_slice(slice, dev.clone()))
    }
}
