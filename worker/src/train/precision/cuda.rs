//! The trainable linear's low-precision GEMMs on a CUDA device, with the CPU ops' numerics
//! (`linear.rs`): bf16/f16 forward and backward on cuBLAS `GemmEx` (16-bit operands, f32
//! sums and output), and int8 forward on cuBLASLt (int8 × int8 → exact i32 sums, dequantised
//! with the per-tensor scales by `engine::ops::DequantizeSums`) with its backward at bf16 from
//! the saved quantised input. Quantisation is the engine's own int8 kernels, so the scales and
//! `q` never leave the device and match the CPU's bit for bit.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};

use candle_core::cuda_backend::cudarc::cublas::{result as cublas, sys as blas};
use candle_core::cuda_backend::cudarc::cublaslt::{result as cublaslt, sys as lt};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use candle_core::cuda_backend::WrapErr;
use candle_core::{
    bail, CpuStorage, CudaDevice, CudaStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor,
};
use half::{bf16, f16};

use super::Precision;
use crate::engine::ops::{DequantizeInt8, DequantizeSums, Granularity, Int8Scales, QuantizeInt8};

/// `x [rows, k] Wᵀ + b` at `precision` (bf16, f16 or int8) on `x`'s CUDA device; f32 in and out.
pub fn linear(x: &Tensor, weight: &Tensor, bias: &Tensor, precision: Precision) -> Result<Tensor> {
    let (x, weight) = (x.contiguous()?, weight.contiguous()?);
    match precision {
        Precision::Bf16 => x.apply_op2(&weight, HalfProduct::forward(DType::BF16))?.broadcast_add(bias),
        Precision::F16 => x.apply_op2(&weight, HalfProduct::forward(DType::F16))?.broadcast_add(bias),
        Precision::Int8 => {
            let bias = bias.contiguous()?;
            x.apply_op3(&weight, &bias, Int8Linear::new(&x, &weight, &bias)?)
        }
        Precision::F32 => bail!("linear: f32 runs on candle's matmul, not on the 16/8-bit CUDA ops"),
    }
}

/// Which product of two row-major matrices `a` and `b`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Form {
    /// `a [m, k] · b [n, k]ᵀ` (the forward, `x·Wᵀ`).
    Nt,
    /// `a [m, n] · b [n, k]` (dX = dY·W).
    Nn,
    /// `a [m, n]ᵀ · b [m, k]` (dW = dYᵀ·x).
    Tn,
}

/// One GEMM with both f32 operands rounded to `dtype` (bf16 or f16), summed and returned
/// in f32: cuBLAS `GemmEx` with `CUBLAS_COMPUTE_32F`. The forward form has a backward made of
/// the other two at the same precision (PyTorch AMP's recipe, as the CPU bf16 op).
#[derive(Debug, Clone, Copy)]
struct HalfProduct {
    form: Form,
    dtype: DType,
}

impl HalfProduct {
    fn forward(dtype: DType) -> HalfProduct {
        HalfProduct { form: Form::Nt, dtype }
    }

    /// `(m, n, k)` of cuBLAS's column-major call and the output's row-major dims, for
    /// operands `a [ra, ca]`, `b [rb, cb]`. Row-major `C = op(a)·op(b)` is column-major
    /// `Cᵀ = op(b)ᵀ·op(a)ᵀ`, so cuBLAS gets `b` first: its column-major view of row-major `b`
    /// is `bᵀ`, transposed back (`Nt`) or taken as is.
    fn dims(&self, (ra, ca): (usize, usize), (rb, cb): (usize, usize)) -> Result<Gemm> {
        let fits = match self.form {
            Form::Nt => ca == cb,
            Form::Nn => ca == rb,
            Form::Tn => ra == rb,
        };
        if !fits {
            bail!("{}: [{ra}, {ca}] and [{rb}, {cb}] do not fit", self.name());
        }
        Ok(match self.form {
            Form::Nt => Gemm { trans_b: true, trans_a: false, m: rb, n: ra, k: ca, ldb: cb, lda: ca, out: (ra, rb) },
            Form::Nn => Gemm { trans_b: false, trans_a: false, m: cb, n: ra, k: ca, ldb: cb, lda: ca, out: (ra, cb) },
            Form::Tn => Gemm { trans_b: false, trans_a: true, m: cb, n: ca, k: ra, ldb: cb, lda: ca, out: (ca, cb) },
        })
    }
}

/// A column-major cuBLAS call `C [m, n] = op(B) [m, k] · op(A) [k, n]` over the row-major
/// operands `a` (leading dimension `lda`) and `b` (`ldb`), `C`'s leading dimension `m`.
struct Gemm {
    trans_b: bool,
    trans_a: bool,
    m: usize,
    n: usize,
    k: usize,
    ldb: usize,
    lda: usize,
    out: (usize, usize),
}

fn op(transpose: bool) -> blas::cublasOperation_t {
    if transpose {
        blas::cublasOperation_t::CUBLAS_OP_T
    } else {
        blas::cublasOperation_t::CUBLAS_OP_N
    }
}

/// A dimension as cuBLAS's `int`.
fn int(op: &str, v: usize) -> Result<i32> {
    match i32::try_from(v) {
        Ok(v) => Ok(v),
        Err(_) => bail!("{op}: dimension {v} is beyond cuBLAS's 32-bit sizes"),
    }
}

/// The contiguous data of a CUDA storage rounded to `dtype`: a fresh buffer of exactly the
/// elements `l` covers, so its pointer is the matrix's first element.
fn rounded(op: &str, s: &CudaStorage, l: &Layout, dtype: DType) -> Result<CudaStorage> {
    use candle_core::backend::BackendStorage;
    if l.contiguous_offsets().is_none() {
        bail!("{op}: operands must be contiguous");
    }
    if s.dtype() != DType::F32 {
        bail!("{op}: operands must be f32 (the master weights' type), got {:?}", s.dtype());
    }
    s.to_dtype(l, dtype)
}

impl CustomOp2 for HalfProduct {
    fn name(&self) -> &'static str {
        match (self.form, self.dtype) {
            (Form::Nt, DType::F16) => "linear-f16-cuda",
            (Form::Nt, _) => "linear-bf16-cuda",
            (Form::Nn, _) => "matmul-nn-half-cuda",
            (Form::Tn, _) => "matmul-tn-half-cuda",
        }
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("{}: a CUDA op; the CPU's are in train/precision/linear.rs", self.name())
    }

    fn cuda_fwd(
        &self,
        a_s: &CudaStorage,
        a_l: &Layout,
        b_s: &CudaStorage,
        b_l: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let name = self.name();
        let g = self.dims(a_l.shape().dims2()?, b_l.shape().dims2()?)?;
        let data_type = match self.dtype {
            DType::BF16 => blas::cudaDataType::CUDA_R_16BF,
            DType::F16 => blas::cudaDataType::CUDA_R_16F,
            other => bail!("{name}: {other:?} is not a 16-bit float"),
        };
        let (a, b) = (rounded(name, a_s, a_l, self.dtype)?, rounded(name, b_s, b_l, self.dtype)?);
        let dev = a_s.device.clone();
        let stream = dev.cuda_stream();
        let len = g.out.0 * g.out.1;
        // SAFETY: with beta = 0 cuBLAS writes every element of C before anything reads it.
        let mut out = unsafe { dev.alloc::<f32>(len.max(1))? };
        let (alpha, beta) = (1f32, 0f32);
        let blas_handle = dev.cublas_handle();
        {
            let (a_ptr, _a_read) = device_ptr(&a, self.dtype, &stream)?;
            let (b_ptr, _b_read) = device_ptr(&b, self.dtype, &stream)?;
            let (c_ptr, _c_write) = out.device_ptr_mut(&stream);
            // SAFETY: the dims were checked against both operands' shapes; the buffers hold
            // exactly those matrices, and the handle issues on candle's stream, which the
            // guards order after the operands' last writes.
            unsafe {
                cublas::gemm_ex(
                    *blas_handle.handle(),
                    op(g.trans_b),
                    op(g.trans_a),
                    int(name, g.m)?,
                    int(name, g.n)?,
                    int(name, g.k)?,
                    (&alpha as *const f32).cast(),
                    b_ptr as *const c_void,
                    data_type,
                    int(name, g.ldb)?,
                    a_ptr as *const c_void,
                    data_type,
                    int(name, g.lda)?,
                    (&beta as *const f32).cast(),
                    c_ptr as *mut c_void,
                    blas::cudaDataType::CUDA_R_32F,
                    int(name, g.m)?,
                    blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
                .w()?;
            }
        }
        Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(g.out)))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        if self.form != Form::Nt {
            bail!("{}: only the forward product has a backward", self.name());
        }
        let grad = grad.contiguous()?;
        let dx = grad.apply_op2_no_bwd(w, &HalfProduct { form: Form::Nn, dtype: self.dtype })?;
        let dw = grad.apply_op2_no_bwd(x, &HalfProduct { form: Form::Tn, dtype: self.dtype })?;
        Ok((Some(dx), Some(dw)))
    }
}

/// The device pointer of a whole 16-bit buffer and the guard that orders its use.
fn device_ptr<'a>(
    s: &'a CudaStorage,
    dtype: DType,
    stream: &'a candle_core::cuda_backend::cudarc::driver::CudaStream,
) -> Result<(u64, candle_core::cuda_backend::cudarc::driver::SyncOnDrop<'a>)> {
    Ok(match dtype {
        DType::BF16 => {
            let (ptr, guard) = s.as_cuda_slice::<bf16>()?.device_ptr(stream);
            (ptr as u64, guard)
        }
        DType::F16 => {
            let (ptr, guard) = s.as_cuda_slice::<f16>()?.device_ptr(stream);
            (ptr as u64, guard)
        }
        other => bail!("no 16-bit buffer of {other:?}"),
    })
}

/// The int8 linear: `(x, W, b) → (q_x·q_wᵀ) · s_x·s_w + b` with `q = quantise(·, absmax/127)`
/// per tensor. The quantised operands are made before the op runs (the engine's kernels), so
/// the op holds them: padded for the GEMM, and `q_x`, `s_x` for the backward.
struct Int8Linear {
    /// `q_x [m, k4]` and `q_w [n4, k4]` (u8 holding i8), zero-padded to multiples of 4: the
    /// row-major int8 layout cuBLASLt takes. Zeros add nothing to the sums.
    qx_padded: Tensor,
    qw_padded: Tensor,
    /// `[s_x, s_w, b…]`, what `DequantizeSums` takes.
    params: Tensor,
    /// For the backward: `q_x [m, k]` and `s_x [1]`.
    qx: Tensor,
    sx: Tensor,
}

impl Int8Linear {
    fn new(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Int8Linear> {
        let per_tensor = Int8Scales { granularity: Granularity::PerTensor };
        let (x, w) = (x.detach(), w.detach());
        let (sx, sw) = (x.apply_op1_no_bwd(&per_tensor)?, w.apply_op1_no_bwd(&per_tensor)?);
        let (qx, qw) = (x.apply_op2_no_bwd(&sx, &QuantizeInt8)?, w.apply_op2_no_bwd(&sw, &QuantizeInt8)?);
        let ((_, k), (n, _)) = (qx.dims2()?, qw.dims2()?);
        let (pad_k, pad_n) = (k.next_multiple_of(4) - k, n.next_multiple_of(4) - n);
        let qx_padded = if pad_k > 0 { qx.pad_with_zeros(1, 0, pad_k)? } else { qx.clone() };
        let qw_padded = match (pad_k, pad_n) {
            (0, 0) => qw,
            _ => qw.pad_with_zeros(1, 0, pad_k)?.pad_with_zeros(0, 0, pad_n)?,
        };
        let params = Tensor::cat(&[&sx, &sw, &b.detach()], 0)?;
        Ok(Int8Linear { qx_padded, qw_padded, params, qx, sx })
    }
}

/// The CUDA storage and layout behind a tensor.
fn cuda_storage<T>(op: &str, t: &Tensor, f: impl FnOnce(&CudaStorage, &Layout) -> Result<T>) -> Result<T> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cuda(s) => f(s, layout),
        _ => bail!("{op}: expected a CUDA tensor, got one on {:?}", t.device().location()),
    }
}

impl CustomOp3 for Int8Linear {
    fn name(&self) -> &'static str {
        "linear-int8-cuda"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("{}: a CUDA op; the CPU's are in train/precision/linear.rs", self.name())
    }

    fn cuda_fwd(
        &self,
        x_s: &CudaStorage,
        x_l: &Layout,
        _w_s: &CudaStorage,
        w_l: &Layout,
        _b_s: &CudaStorage,
        b_l: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let name = self.name();
        let ((m, k), (n, kw)) = (x_l.shape().dims2()?, w_l.shape().dims2()?);
        if kw != k || b_l.shape().dims1()? != n {
            bail!("{name}: input [{m}, {k}], weight [{n}, {kw}] and bias {:?} do not fit", b_l.dims());
        }
        let ((_, k4), (n4, _)) = (self.qx_padded.dims2()?, self.qw_padded.dims2()?);
        let dev = x_s.device.clone();
        let sums = cuda_storage(name, &self.qx_padded, |qx, qx_l| {
            cuda_storage(name, &self.qw_padded, |qw, qw_l| int8_gemm(&dev, (qx, qx_l), (qw, qw_l), (m, n4, k4)))
        })?;
        // The bias reaches the kernel inside `params`; x and W through their quantised copies.
        cuda_storage(name, &self.params, |p, p_l| {
            candle_core::CustomOp2::cuda_fwd(&DequantizeSums, &sums, &Layout::contiguous((m, n4)), p, p_l)
        })
    }

    fn bwd(
        &self,
        _x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        // q_x as f32 holds small integers, exact in bf16: the GEMM sees the quantised input.
        let one = Tensor::ones(1, DType::F32, grad.device())?;
        let qx = self.qx.apply_op2_no_bwd(&one, &DequantizeInt8)?;
        let dw =
            grad.apply_op2_no_bwd(&qx, &HalfProduct { form: Form::Tn, dtype: DType::BF16 })?.broadcast_mul(&self.sx)?;
        let dx = grad.apply_op2_no_bwd(w, &HalfProduct { form: Form::Nn, dtype: DType::BF16 })?;
        Ok((Some(dx), Some(dw), Some(grad.sum(0)?)))
    }
}

/// One cuBLASLt handle per GPU, made on first use and kept for the process (a handle holds
/// no GPU memory; making one per call would cost a driver round trip every step).
struct LtHandle(lt::cublasLtHandle_t);
// SAFETY: a cuBLASLt handle may be used from any thread; calls with it are serialised by the
// stream they are issued on.
unsafe impl Send for LtHandle {}

fn lt_error(e: cublaslt::CublasError) -> candle_core::Error {
    candle_core::Error::Msg(format!("cuBLASLt: {e}"))
}

fn lt_handle(dev: &CudaDevice) -> Result<lt::cublasLtHandle_t> {
    static HANDLES: OnceLock<Mutex<HashMap<usize, LtHandle>>> = OnceLock::new();
    let ordinal = dev.cuda_stream().context().ordinal();
    let mut handles = HANDLES.get_or_init(Default::default).lock().expect("the handle map is never poisoned");
    if let Some(handle) = handles.get(&ordinal) {
        return Ok(handle.0);
    }
    dev.cuda_stream().context().bind_to_thread().w()?;
    let handle = cublaslt::create_handle().map_err(lt_error)?;
    handles.insert(ordinal, LtHandle(handle));
    Ok(handle)
}

/// `sums [m, n4] = q_x [m, k4] · q_w [n4, k4]ᵀ` in exact i32 on cuBLASLt (IMMA tensor cores),
/// returned as u32 storage holding the i32 bits (what `DequantizeSums` reads). Column-major,
/// that is `sumsᵀ = q_w · q_xᵀ` in the "TN" form cuBLASLt's int8 GEMM takes with ordinary
/// layouts, which needs leading dimensions in multiples of 4 (the padding).
fn int8_gemm(
    dev: &CudaDevice,
    (qx, qx_l): (&CudaStorage, &Layout),
    (qw, qw_l): (&CudaStorage, &Layout),
    (m, n4, k4): (usize, usize, usize),
) -> Result<CudaStorage> {
    const OP: &str = "linear-int8-cuda";
    let (Some((qx_start, qx_end)), Some((qw_start, qw_end))) = (qx_l.contiguous_offsets(), qw_l.contiguous_offsets())
    else {
        bail!("{OP}: the quantised operands must be contiguous")
    };
    if qx_end - qx_start != m * k4 || qw_end - qw_start != n4 * k4 || k4 % 4 != 0 || n4 % 4 != 0 {
        bail!(
            "{OP}: quantised operands of {} and {} bytes for [{m}, {k4}] and [{n4}, {k4}]",
            qx_end - qx_start,
            qw_end - qw_start
        );
    }
    let stream = dev.cuda_stream();
    stream.context().bind_to_thread().w()?;
    let handle = lt_handle(dev)?;
    let (qx, qw) = (qx.as_cuda_slice::<u8>()?, qw.as_cuda_slice::<u8>()?);
    let (qx, qw) = (qx.slice(qx_start..qx_end), qw.slice(qw_start..qw_end));
    // SAFETY: the GEMM writes every element (beta = 0) before anything reads the buffer.
    let mut sums: CudaSlice<u32> = unsafe { dev.alloc::<u32>((m * n4).max(1))? };
    let i64_of = |v: usize| v as i64;
    // SAFETY: descriptors are created, used and destroyed here; the dims match the buffers
    // (checked above), and the call is issued on candle's stream after the guards order it
    // behind the quantisation kernels that wrote q_x and q_w.
    unsafe {
        let desc =
            cublaslt::create_matmul_desc(lt::cublasComputeType_t::CUBLAS_COMPUTE_32I, lt::cudaDataType::CUDA_R_32I)
                .map_err(lt_error)?;
        let transpose = blas::cublasOperation_t::CUBLAS_OP_T;
        let layouts = (|| {
            cublaslt::set_matmul_desc_attribute(
                desc,
                lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                (&transpose as *const blas::cublasOperation_t).cast(),
                std::mem::size_of::<blas::cublasOperation_t>(),
            )?;
            let a = cublaslt::create_matrix_layout(lt::cudaDataType::CUDA_R_8I, k4 as u64, n4 as u64, i64_of(k4))?;
            let b = cublaslt::create_matrix_layout(lt::cudaDataType::CUDA_R_8I, k4 as u64, m as u64, i64_of(k4))?;
            let c = cublaslt::create_matrix_layout(lt::cudaDataType::CUDA_R_32I, n4 as u64, m as u64, i64_of(n4))?;
            Ok::<_, cublaslt::CublasError>((a, b, c))
        })();
        let result = layouts.and_then(|(a, b, c)| {
            let run = (|| {
                let pref = cublaslt::create_matmul_pref()?;
                let heuristic = cublaslt::get_matmul_algo_heuristic(handle, desc, a, b, c, c, pref);
                cublaslt::destroy_matmul_pref(pref)?;
                let heuristic = heuristic?;
                let (alpha, beta) = (1i32, 0i32);
                let (a_ptr, _a_read) = qw.device_ptr(&stream);
                let (b_ptr, _b_read) = qx.device_ptr(&stream);
                let (c_ptr, _c_write) = sums.device_ptr_mut(&stream);
                cublaslt::matmul(
                    handle,
                    desc,
                    (&alpha as *const i32).cast(),
                    (&beta as *const i32).cast(),
                    a_ptr as *const c_void,
                    a,
                    b_ptr as *const c_void,
                    b,
                    c_ptr as *const c_void,
                    c,
                    c_ptr as *mut c_void,
                    c,
                    &heuristic.algo,
                    std::ptr::null_mut(),
                    0,
                    stream.cu_stream() as lt::cudaStream_t,
                )
            })();
            for layout in [a, b, c] {
                cublaslt::destroy_matrix_layout(layout)?;
            }
            run
        });
        cublaslt::destroy_matmul_desc(desc).map_err(lt_error)?;
        result.map_err(|e| {
            candle_core::Error::Msg(format!("{OP}: cuBLASLt int8 GEMM [{m}, {k4}] × [{n4}, {k4}]ᵀ: {e}"))
        })?;
    }
    Ok(CudaStorage::wrap_cuda_slice(sums, dev.clone()))
}
