//! Runs the ops' CUDA kernels (`worker/src/engine/ops/<op>/*.cu`) on the CPU: the kernels' own
//! source, compiled by the host C++ compiler against `cuda_runtime.hpp` (CUDA's built-ins, one
//! fiber per CUDA thread), into a library this module builds once per source version and
//! loads. So every CI run checks the kernels' indexing, shared memory, barriers and warp
//! shuffles against the CPU references, where no GPU is lent; the GPU tests check the rest
//! (PTX, the driver, cudarc launches).
//!
//! [`run`] executes an op's own launch plan (`CudaKernel::plan`), the one the GPU runner
//! executes: the same kernel names, geometry and argument order.
#![allow(dead_code)] // each test binary uses its own part

use candle_core::{DType, Device, Tensor};
use std::ffi::{c_char, c_void, CStr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use tessera_worker::engine::ops::cuda::{self as ops_cuda, CudaKernel, Operand};

type LaunchFn = unsafe extern "C" fn(
    *const u32,
    *const u32,
    u32,
    unsafe extern "C" fn(*mut c_void),
    *mut c_void,
) -> *const c_char;
type AllocFn = unsafe extern "C" fn(usize, usize) -> *mut u8;
type FreeFn = unsafe extern "C" fn(*mut u8, usize);
/// Any kernel, called the x86-64 System V way: integer and pointer arguments travel in six
/// integer registers in order, floats in vector registers in order, and a callee reads only
/// the registers its own signature names. Every kernel here takes at most six of the one and
/// one of the other, so this one signature calls each of them with its real arguments.
type KernelFn = unsafe extern "C" fn(u64, u64, u64, u64, u64, u64, f32);

pub struct Emulator {
    library: libloading::Library,
    launch: LaunchFn,
    alloc: AllocFn,
    free: FreeFn,
}

/// The compiled emulator, built on first use.
pub fn emulator() -> &'static Emulator {
    static EMULATOR: OnceLock<Emulator> = OnceLock::new();
    EMULATOR.get_or_init(|| Emulator::load(&build()))
}

/// Runs `op` on `inputs` (CPU tensors in their storage types) as a GPU would: its launch
/// plan, every launch on the emulator, over buffers that end at an unmapped page.
pub fn run<K: CudaKernel>(op: &K, inputs: &[&Tensor]) -> Tensor {
    let operands: Vec<Operand> = inputs
        .iter()
        .map(|t| Operand {
            dtype: t.dtype(),
            shape: t.shape(),
        })
        .collect();
    let plan = op.plan(&operands).unwrap_or_else(|e| panic!("{e}"));
    let buffers: Vec<Buffer> = inputs.iter().map(|t| Buffer::from_tensor(t)).collect();
    let (dtype, len) = (plan.output.dtype, plan.output.shape.elem_count());
    let output = if plan.output.zeroed {
        Buffer::zeros(dtype, len)
    } else {
        Buffer::output(dtype, len)
    };
    for launch in &plan.launches {
        let args: Vec<Arg> = launch
            .args
            .iter()
            .map(|arg| match *arg {
                ops_cuda::Arg::Input(i) => buffers[i].arg(),
                ops_cuda::Arg::Output => output.arg(),
                ops_cuda::Arg::I32(v) => Arg::I32(v),
                ops_cuda::Arg::U64(v) => Arg::U64(v),
                ops_cuda::Arg::F32(v) => Arg::F32(v),
            })
            .collect();
        emulator()
            .launch(
                &launch.kernel,
                launch.grid,
                launch.threads,
                launch.shared_bytes,
                &args,
            )
            .unwrap_or_else(|e| panic!("{e}"));
    }
    output.to_tensor(dtype, plan.output.shape.dims())
}

/// The ops' folder: each op's `.cu` beside its Rust, `cuda/common.cuh` shared.
fn ops() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src/engine/ops")
}

fn sources() -> (PathBuf, Vec<PathBuf>) {
    let emulator = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cuda_emulator");
    let list = |dir: &Path| -> Vec<PathBuf> {
        let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        entries.map(|e| e.unwrap().path()).collect()
    };
    let mut files: Vec<PathBuf> = list(&ops())
        .into_iter()
        .filter(|p| p.is_dir())
        .flat_map(|dir| list(&dir))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    files.sort();
    files.push(emulator.join("runtime.cpp"));
    files.push(emulator.join("misbehaving.cu"));
    (emulator, files)
}

/// Compiles the kernels and the runtime into one shared library, named by a digest of every
/// input so a changed kernel is rebuilt and an unchanged one is not.
fn build() -> PathBuf {
    use sha2::{Digest, Sha256};
    let (include, files) = sources();
    let mut digest = Sha256::new();
    let mut inputs = files.clone();
    inputs.push(ops().join("cuda/common.cuh"));
    for header in ["cuda_runtime.hpp", "cuda_fp16.h", "cuda_bf16.h", "mma.h"] {
        inputs.push(include.join(header));
    }
    for path in &inputs {
        digest.update(std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())));
    }
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "tessera-cuda-emulator-{}.so",
        &hex::encode(digest.finalize())[..16]
    ));
    if out.exists() {
        return out;
    }
    let partial = out.with_extension(format!("{}.tmp", std::process::id()));
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let status = Command::new(&cxx)
        .args([
            "-std=c++20",
            "-O2",
            "-shared",
            "-fPIC",
            "-Wall",
            "-Wno-unknown-pragmas",
        ])
        .arg("-I")
        .arg(&include)
        .arg("-I")
        .arg(ops().join("cuda"))
        .args(["-include", "cuda_runtime.hpp", "-x", "c++"])
        .args(&files)
        .arg("-o")
        .arg(&partial)
        .status()
        .unwrap_or_else(|e| panic!("cannot run {cxx} to build the CUDA emulator: {e}"));
    assert!(status.success(), "{cxx} could not build the CUDA emulator");
    std::fs::rename(&partial, &out).unwrap();
    out
}

impl Emulator {
    fn load(path: &Path) -> Self {
        // SAFETY: the library is ours; its symbols have the types declared above.
        unsafe {
            let library = libloading::Library::new(path).unwrap();
            let launch = *library.get::<LaunchFn>(b"tessera_emu_launch").unwrap();
            let alloc = *library.get::<AllocFn>(b"tessera_emu_alloc").unwrap();
            let free = *library.get::<FreeFn>(b"tessera_emu_free").unwrap();
            Self {
                library,
                launch,
                alloc,
                free,
            }
        }
    }

    /// Launches `kernel` over `grid` blocks of `threads` threads with `shared_bytes` of
    /// dynamic shared memory; an error names what the GPU would have refused or where the
    /// block's barriers stopped lining up.
    pub fn launch(
        &self,
        kernel: &str,
        grid: (u32, u32, u32),
        threads: u32,
        shared_bytes: u32,
        args: &[Arg],
    ) -> Result<(), String> {
        let function = self.kernel(kernel)?;
        let call = Call::new(function, args)?;
        let grid = [grid.0, grid.1, grid.2];
        let block = [threads, 1, 1];
        // SAFETY: `call_body` receives `&call`, which outlives the launch; the argument types
        // are the caller's promise, as with any CUDA launch.
        let error = unsafe {
            (self.launch)(
                grid.as_ptr(),
                block.as_ptr(),
                shared_bytes,
                call_body,
                &call as *const Call as *mut c_void,
            )
        };
        if error.is_null() {
            Ok(())
        } else {
            // SAFETY: a NUL-terminated message that lives until the next launch on this thread.
            Err(format!(
                "{kernel}: {}",
                unsafe { CStr::from_ptr(error) }.to_string_lossy()
            ))
        }
    }

    fn kernel(&self, name: &str) -> Result<KernelFn, String> {
        // SAFETY: called only through `Call`, with the kernel's own arguments.
        unsafe { self.library.get::<KernelFn>(name.as_bytes()) }
            .map(|symbol| *symbol)
            .map_err(|_| format!("no kernel named {name} in the ops' .cu files"))
    }
}

/// One kernel argument, as `cudarc`'s launch builder takes them.
#[derive(Debug, Clone, Copy)]
pub enum Arg {
    Ptr(*mut u8),
    I32(i32),
    U64(u64),
    F32(f32),
}

struct Call {
    function: KernelFn,
    ints: [u64; 6],
    float: f32,
}

impl Call {
    fn new(function: KernelFn, args: &[Arg]) -> Result<Self, String> {
        let (mut ints, mut floats) = (Vec::new(), Vec::new());
        for arg in args {
            match *arg {
                Arg::Ptr(p) => ints.push(p as u64),
                Arg::I32(v) => ints.push(v as u32 as u64),
                Arg::U64(v) => ints.push(v),
                Arg::F32(v) => floats.push(v),
            }
        }
        if ints.len() > 6 || floats.len() > 1 {
            return Err("the emulator passes at most six integer and one float argument".into());
        }
        ints.resize(6, 0);
        Ok(Self {
            function,
            ints: ints.try_into().unwrap(),
            float: floats.first().copied().unwrap_or(0.0),
        })
    }
}

/// What every emulated CUDA thread runs: the kernel with the launch's arguments.
unsafe extern "C" fn call_body(call: *mut c_void) {
    let call = &*(call as *const Call);
    let [a, b, c, d, e, f] = call.ints;
    (call.function)(a, b, c, d, e, f, call.float);
}

/// Emulated global memory: its last byte is followed by an unmapped page, so a kernel that
/// reads or writes past the end crashes the test instead of passing.
pub struct Buffer {
    ptr: *mut u8,
    bytes: usize,
}

impl Buffer {
    fn new(bytes: usize, align: usize) -> Self {
        let e = emulator();
        // SAFETY: plain allocation; freed in Drop with the same size.
        let ptr = unsafe { (e.alloc)(bytes, align) };
        assert!(
            !ptr.is_null(),
            "cannot map {bytes} bytes for a kernel buffer"
        );
        Self { ptr, bytes }
    }

    /// A tensor's elements, in its own type (f32, f16, bf16, u8 or u32).
    pub fn from_tensor(t: &Tensor) -> Self {
        let bytes = tensor_bytes(t);
        let buffer = Self::new(bytes.len(), t.dtype().size_in_bytes());
        // SAFETY: the buffer holds exactly `bytes.len()` bytes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buffer.ptr, bytes.len()) };
        buffer
    }

    /// Room for `len` elements of `dtype`, every byte 0xff (NaN in each float type), so an
    /// element the kernel never writes shows.
    pub fn output(dtype: DType, len: usize) -> Self {
        let buffer = Self::new(len * dtype.size_in_bytes(), dtype.size_in_bytes());
        // SAFETY: within the buffer.
        unsafe { std::ptr::write_bytes(buffer.ptr, 0xff, buffer.bytes) };
        buffer
    }

    /// Zeroed room for `len` elements of `dtype`.
    pub fn zeros(dtype: DType, len: usize) -> Self {
        let buffer = Self::new(len * dtype.size_in_bytes(), dtype.size_in_bytes());
        // SAFETY: within the buffer.
        unsafe { std::ptr::write_bytes(buffer.ptr, 0, buffer.bytes) };
        buffer
    }

    pub fn arg(&self) -> Arg {
        Arg::Ptr(self.ptr)
    }

    /// The buffer as a CPU tensor of `dtype` and `shape`.
    pub fn to_tensor(&self, dtype: DType, shape: &[usize]) -> Tensor {
        // SAFETY: the buffer's bytes, read-only while `self` lives.
        let bytes = unsafe { std::slice::from_raw_parts(self.ptr, self.bytes) };
        Tensor::from_raw_buffer(bytes, dtype, shape, &Device::Cpu).unwrap()
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: allocated by `tessera_emu_alloc` with this size.
        unsafe { (emulator().free)(self.ptr, self.bytes) }
    }
}

fn tensor_bytes(t: &Tensor) -> Vec<u8> {
    fn raw<T: Copy>(v: Vec<T>) -> Vec<u8> {
        let len = std::mem::size_of_val(v.as_slice());
        // SAFETY: plain numbers, viewed as their bytes.
        unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, len) }.to_vec()
    }
    let flat = t.flatten_all().unwrap();
    match t.dtype() {
        DType::F32 => raw(flat.to_vec1::<f32>().unwrap()),
        DType::F16 => raw(flat.to_vec1::<half::f16>().unwrap()),
        DType::BF16 => raw(flat.to_vec1::<half::bf16>().unwrap()),
        DType::U8 => flat.to_vec1::<u8>().unwrap(),
        DType::U32 => raw(flat.to_vec1::<u32>().unwrap()),
        other => panic!("no kernel takes {other:?}"),
    }
}
