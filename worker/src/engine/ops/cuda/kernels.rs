//! Launches of `worker/kernels/*.cu` (PTX compiled by build.rs, embedded here, loaded once per
//! device through candle's module cache) as the `cuda_fwd` of the engine's ops. Each launch
//! checks shapes and dtypes as the CPU path does, allocates its output on the input's device
//! and queues on candle's stream behind candle's own work (the cuBLAS GEMMs), so a forward
//! pass never waits on the GPU.
//!
//! What cannot be checked without reading device memory is trusted: `cu_seqlens` must be a
//! valid partition of the rows with no empty sequence (the host batcher builds it that way,
//! `Batch::pack`), and `VarlenAttention::max_seqlen` must be the longest sequence's length.

use super::plan;
use crate::engine::ops::{
    BiasResidualLayerNorm, Granularity, Int8Scales, Pooling, SegmentedPool, VarlenAttention,
};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Shape, WithDType};

/// One kernels/*.cu file: its name in candle's per-device module cache, and its PTX.
#[derive(Debug, Clone, Copy)]
pub struct Module {
    name: &'static str,
    ptx: &'static str,
    /// A function the module exports, loaded by [`load_all`] to prove the PTX loads.
    probe: &'static str,
}

macro_rules! module {
    ($file:literal, $probe:literal) => {
        Module {
            name: concat!("tessera_", $file),
            ptx: include_str!(concat!(env!("OUT_DIR"), "/", $file, ".ptx")),
            probe: $probe,
        }
    };
}

const ATTENTION: Module = module!("varlen_attention", "varlen_attention_short_d64_f16");
const LAYERNORM: Module = module!("layernorm", "bias_residual_layernorm_f32");
const BIAS_GELU: Module = module!("bias_gelu", "bias_gelu_f32");
const POOLING: Module = module!("pooling", "segmented_pool_f32");
const INT8: Module = module!("int8", "int8_dequantize");
const ALL: [Module; 5] = [ATTENTION, LAYERNORM, BIAS_GELU, POOLING, INT8];

/// Loads every module on `device` (the driver JIT-compiles the PTX here), so a GPU or driver
/// that cannot take them is found at start rather than in a request.
pub fn load_all(device: &CudaDevice) -> Result<()> {
    for module in ALL {
        device.get_or_load_custom_func(module.probe, module.name, module.ptx)?;
    }
    Ok(())
}

/// Calls `$f::<T>(args…)` with `T` the element type of `$dtype`.
macro_rules! by_float_type {
    ($op:expr, $dtype:expr, $f:ident($($arg:expr),* $(,)?)) => {
        match $dtype {
            DType::F32 => $f::<f32>($($arg),*),
            DType::F16 => $f::<half::f16>($($arg),*),
            DType::BF16 => $f::<half::bf16>($($arg),*),
            other => bail!("{}: {other:?} has no CUDA kernel (f32, f16 or bf16)", $op),
        }
    };
}

/// The element types the kernels are instantiated for.
trait Element: CudaDType + DeviceRepr + WithDType {}
impl<T: CudaDType + DeviceRepr + WithDType> Element for T {}

/// The kernel `root` for element type `T` (`root_f16`, …), as exported by `FOR_EACH_STORAGE`.
fn kernel_name<T: WithDType>(root: &str) -> String {
    format!("{root}_{}", T::DTYPE.as_str())
}

/// The elements of `s` that `l` covers, which must be contiguous.
fn view<'a, T: CudaDType>(
    op: &str,
    what: &str,
    s: &'a CudaStorage,
    l: &Layout,
) -> Result<CudaView<'a, T>> {
    let Some((start, end)) = l.contiguous_offsets() else {
        bail!("{op}: {what} must be contiguous");
    };
    Ok(s.as_cuda_slice::<T>()?.slice(start..end))
}

fn same_dtype(op: &str, what: &str, a: &CudaStorage, b: &CudaStorage) -> Result<()> {
    if a.dtype() != b.dtype() {
        bail!(
            "{op}: {what} is {:?} but the input is {:?}",
            b.dtype(),
            a.dtype()
        );
    }
    Ok(())
}

fn rows_cols(op: &str, l: &Layout) -> Result<(usize, usize)> {
    let (rows, cols) = l.shape().dims2()?;
    if rows == 0 || cols == 0 {
        bail!("{op}: an empty [{rows}, {cols}] input has nothing to compute");
    }
    Ok((rows, cols))
}

fn plan_error(op: &str, e: String) -> candle_core::Error {
    candle_core::Error::Msg(format!("{op}: {e}"))
}

fn cfg(grid: (u32, u32, u32), threads: u32, shared_bytes: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (threads, 1, 1),
        shared_mem_bytes: shared_bytes,
    }
}

/// Allocates `len` elements that the kernel about to be launched overwrites entirely.
fn output<T: DeviceRepr>(dev: &CudaDevice, len: usize) -> Result<CudaSlice<T>> {
    // SAFETY: every launch below writes each output element before anything reads it.
    unsafe { dev.alloc::<T>(len) }
}

// ---------------------------------------------------------------------------------------
// Attention

pub fn varlen_attention(
    op: &VarlenAttention,
    qkv_s: &CudaStorage,
    qkv_l: &Layout,
    bias_s: &CudaStorage,
    bias_l: &Layout,
    cu_s: &CudaStorage,
    cu_l: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let name = "varlen-attention";
    let hidden = op.num_heads * op.head_dim;
    let (tokens, width) = rows_cols(name, qkv_l)?;
    if width != 3 * hidden {
        bail!(
            "{name}: qkv is [{tokens}, {width}], expected [T, {}]",
            3 * hidden
        );
    }
    if bias_l.shape().elem_count() != 3 * hidden {
        bail!(
            "{name}: qkv bias has {} values, expected {}",
            bias_l.shape().elem_count(),
            3 * hidden
        );
    }
    same_dtype(name, "qkv bias", qkv_s, bias_s)?;
    if op.max_seqlen == 0 || op.max_seqlen > tokens {
        bail!(
            "{name}: max_seqlen {} must be the longest sequence's length (1..={tokens}): the \
             grid is sized from it",
            op.max_seqlen
        );
    }
    let sequences = cu_l.shape().elem_count().saturating_sub(1);
    let dtype = qkv_s.dtype();
    let plan = plan::attention_plan(
        sequences,
        op.max_seqlen,
        op.num_heads,
        op.head_dim,
        dtype.size_in_bytes(),
    )
    .map_err(|e| plan_error(name, e))?;
    let launch = AttentionLaunch {
        plan,
        head_dim: op.head_dim,
        hidden,
        tokens,
    };
    let out = by_float_type!(
        name,
        dtype,
        attention(&launch, qkv_s, qkv_l, bias_s, bias_l, cu_s, cu_l)
    )?;
    Ok((out, Shape::from((tokens, hidden))))
}

struct AttentionLaunch {
    plan: plan::AttentionPlan,
    head_dim: usize,
    hidden: usize,
    tokens: usize,
}

fn attention<T: Element>(
    launch: &AttentionLaunch,
    qkv_s: &CudaStorage,
    qkv_l: &Layout,
    bias_s: &CudaStorage,
    bias_l: &Layout,
    cu_s: &CudaStorage,
    cu_l: &Layout,
) -> Result<CudaStorage> {
    let name = "varlen-attention";
    let dev = &qkv_s.device;
    let qkv = view::<T>(name, "qkv", qkv_s, qkv_l)?;
    let bias = view::<T>(name, "qkv bias", bias_s, bias_l)?;
    let cu = view::<u32>(name, "cu_seqlens", cu_s, cu_l)?;
    let mut out = output::<T>(dev, launch.tokens * launch.hidden)?;
    let kernel = launch.plan.kernel.name();
    let func = dev.get_or_load_custom_func(
        &kernel_name::<T>(&format!("varlen_attention_{kernel}_d{}", launch.head_dim)),
        ATTENTION.name,
        ATTENTION.ptx,
    )?;
    let hidden = launch.hidden as i32;
    // exp2 in the kernel: fold log2(e) into the 1/√d scale.
    let scale_log2 = std::f32::consts::LOG2_E / (launch.head_dim as f32).sqrt();
    let mut args = func.builder();
    args.arg(&qkv);
    args.arg(&bias);
    args.arg(&cu);
    args.arg(&mut out);
    args.arg(&hidden);
    args.arg(&scale_log2);
    let config = cfg(
        launch.plan.grid,
        plan::ATTENTION_THREADS,
        launch.plan.shared_bytes,
    );
    // SAFETY: the arguments match the kernel's signature; it reads T rows inside `qkv` as
    // `cu_seqlens` directs (trusted, see the module comment) and writes `tokens × hidden`.
    unsafe { args.launch(config) }.w()?;
    drop(args);
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

// ---------------------------------------------------------------------------------------
// Bias + residual + LayerNorm

pub fn bias_residual_layernorm(
    op: &BiasResidualLayerNorm,
    x_s: &CudaStorage,
    x_l: &Layout,
    r_s: &CudaStorage,
    r_l: &Layout,
    p_s: &CudaStorage,
    p_l: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let name = "bias-residual-layernorm";
    let (rows, cols) = rows_cols(name, x_l)?;
    if r_l.shape().dims() != [rows, cols] {
        bail!(
            "{name}: residual is {:?}, input is [{rows}, {cols}]",
            r_l.shape()
        );
    }
    if p_l.shape().dims() != [3, cols] {
        bail!(
            "{name}: params must be [3, {cols}] (bias, gamma, beta), got {:?}",
            p_l.shape()
        );
    }
    same_dtype(name, "residual", x_s, r_s)?;
    same_dtype(name, "params", x_s, p_s)?;
    let shared = plan::row_shared_bytes(cols).map_err(|e| plan_error(name, e))?;
    let out = by_float_type!(
        name,
        x_s.dtype(),
        layernorm(
            op.eps,
            (rows, cols),
            shared,
            [(x_s, x_l), (r_s, r_l), (p_s, p_l)]
        )
    )?;
    Ok((out, Shape::from((rows, cols))))
}

fn layernorm<T: Element>(
    eps: f32,
    (rows, cols): (usize, usize),
    shared: u32,
    [(x_s, x_l), (r_s, r_l), (p_s, p_l)]: [(&CudaStorage, &Layout); 3],
) -> Result<CudaStorage> {
    let name = "bias-residual-layernorm";
    let dev = &x_s.device;
    let x = view::<T>(name, "input", x_s, x_l)?;
    let residual = view::<T>(name, "residual", r_s, r_l)?;
    let params = view::<T>(name, "params", p_s, p_l)?;
    let mut out = output::<T>(dev, rows * cols)?;
    let func = dev.get_or_load_custom_func(
        &kernel_name::<T>("bias_residual_layernorm"),
        LAYERNORM.name,
        LAYERNORM.ptx,
    )?;
    let cols_i = cols as i32;
    let mut args = func.builder();
    args.arg(&x);
    args.arg(&residual);
    args.arg(&params);
    args.arg(&mut out);
    args.arg(&cols_i);
    args.arg(&eps);
    // SAFETY: one block per row of `cols` values, all inside the checked shapes.
    unsafe { args.launch(cfg((rows as u32, 1, 1), plan::ROW_THREADS, shared)) }.w()?;
    drop(args);
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

// ---------------------------------------------------------------------------------------
// Bias + GELU

pub fn bias_gelu(
    x_s: &CudaStorage,
    x_l: &Layout,
    b_s: &CudaStorage,
    b_l: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let name = "bias-gelu";
    let (rows, cols) = rows_cols(name, x_l)?;
    if b_l.shape().elem_count() != cols {
        bail!(
            "{name}: bias has {} values for {cols} columns",
            b_l.shape().elem_count()
        );
    }
    same_dtype(name, "bias", x_s, b_s)?;
    let out = by_float_type!(name, x_s.dtype(), gelu((rows, cols), x_s, x_l, b_s, b_l))?;
    Ok((out, Shape::from((rows, cols))))
}

fn gelu<T: Element>(
    (rows, cols): (usize, usize),
    x_s: &CudaStorage,
    x_l: &Layout,
    b_s: &CudaStorage,
    b_l: &Layout,
) -> Result<CudaStorage> {
    let name = "bias-gelu";
    let dev = &x_s.device;
    let x = view::<T>(name, "input", x_s, x_l)?;
    let bias = view::<T>(name, "bias", b_s, b_l)?;
    let n = rows * cols;
    let mut out = output::<T>(dev, n)?;
    let func = dev.get_or_load_custom_func(
        &kernel_name::<T>("bias_gelu"),
        BIAS_GELU.name,
        BIAS_GELU.ptx,
    )?;
    let (n_u64, cols_i) = (n as u64, cols as i32);
    let mut args = func.builder();
    args.arg(&x);
    args.arg(&bias);
    args.arg(&mut out);
    args.arg(&n_u64);
    args.arg(&cols_i);
    let grid = (plan::elementwise_blocks(n), 1, 1);
    // SAFETY: grid-stride over the n elements of the checked shapes.
    unsafe { args.launch(cfg(grid, plan::ELEMENTWISE_THREADS, 0)) }.w()?;
    drop(args);
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

// ---------------------------------------------------------------------------------------
// Segmented pooling

pub fn segmented_pool(
    op: &SegmentedPool,
    h_s: &CudaStorage,
    h_l: &Layout,
    cu_s: &CudaStorage,
    cu_l: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let name = "segmented-pool";
    let (_, cols) = rows_cols(name, h_l)?;
    let sequences = cu_l.shape().elem_count().saturating_sub(1);
    if sequences == 0 {
        bail!("{name}: cu_seqlens names no sequence");
    }
    let shared = plan::row_shared_bytes(cols).map_err(|e| plan_error(name, e))?;
    let out = by_float_type!(
        name,
        h_s.dtype(),
        pool(op, (sequences, cols), shared, h_s, h_l, cu_s, cu_l)
    )?;
    Ok((out, Shape::from((sequences, cols))))
}

fn pool<T: Element>(
    op: &SegmentedPool,
    (sequences, cols): (usize, usize),
    shared: u32,
    h_s: &CudaStorage,
    h_l: &Layout,
    cu_s: &CudaStorage,
    cu_l: &Layout,
) -> Result<CudaStorage> {
    let name = "segmented-pool";
    let dev = &h_s.device;
    let hidden = view::<T>(name, "hidden states", h_s, h_l)?;
    let cu = view::<u32>(name, "cu_seqlens", cu_s, cu_l)?;
    let mut out = output::<T>(dev, sequences * cols)?;
    let func = dev.get_or_load_custom_func(
        &kernel_name::<T>("segmented_pool"),
        POOLING.name,
        POOLING.ptx,
    )?;
    // POOL_MEAN / POOL_CLS / POOL_MAX in pooling.cu.
    let mode: i32 = match op.pooling {
        Pooling::Mean => 0,
        Pooling::Cls => 1,
        Pooling::Max => 2,
    };
    let (cols_i, normalize) = (cols as i32, op.normalize as i32);
    let mut args = func.builder();
    args.arg(&hidden);
    args.arg(&cu);
    args.arg(&mut out);
    args.arg(&cols_i);
    args.arg(&mode);
    args.arg(&normalize);
    // SAFETY: one block per sequence; rows come from `cu_seqlens` (trusted).
    unsafe { args.launch(cfg((sequences as u32, 1, 1), plan::POOL_THREADS, shared)) }.w()?;
    drop(args);
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

// ---------------------------------------------------------------------------------------
// Int8 quantisation

pub fn int8_scales(
    op: &Int8Scales,
    x_s: &CudaStorage,
    x_l: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let name = "int8-scales";
    let (rows, cols) = rows_cols(name, x_l)?;
    let per_channel = op.granularity == Granularity::PerChannel;
    let n = if per_channel { rows } else { 1 };
    let out = by_float_type!(
        name,
        x_s.dtype(),
        scales((rows, cols), per_channel, x_s, x_l)
    )?;
    Ok((out, Shape::from(n)))
}

fn scales<T: Element>(
    (rows, cols): (usize, usize),
    per_channel: bool,
    x_s: &CudaStorage,
    x_l: &Layout,
) -> Result<CudaStorage> {
    let name = "int8-scales";
    let dev = &x_s.device;
    let x = view::<T>(name, "input", x_s, x_l)?;
    let n = if per_channel { rows } else { 1 };
    // Zeroed: the maxima are accumulated into it with atomicMax.
    let mut scales = dev.alloc_zeros::<f32>(n)?;
    let absmax =
        dev.get_or_load_custom_func(&kernel_name::<T>("int8_absmax"), INT8.name, INT8.ptx)?;
    let (rows_i, cols_i, per_channel_i) = (rows as i32, cols as i32, per_channel as i32);
    let mut args = absmax.builder();
    args.arg(&x);
    args.arg(&mut scales);
    args.arg(&rows_i);
    args.arg(&cols_i);
    args.arg(&per_channel_i);
    let blocks = rows.min(1 << 16) as u32;
    // SAFETY: grid-stride over rows; one atomic per row into `scales[row or 0]`.
    unsafe { args.launch(cfg((blocks, 1, 1), plan::ROW_THREADS, 0)) }.w()?;
    drop(args);

    let finish = dev.get_or_load_custom_func("int8_scales_finish", INT8.name, INT8.ptx)?;
    let n_i = n as i32;
    let mut args = finish.builder();
    args.arg(&mut scales);
    args.arg(&n_i);
    let grid = (n.div_ceil(plan::ELEMENTWISE_THREADS as usize) as u32, 1, 1);
    // SAFETY: one thread per scale, bounds-checked in the kernel.
    unsafe { args.launch(cfg(grid, plan::ELEMENTWISE_THREADS, 0)) }.w()?;
    drop(args);
    Ok(CudaStorage::wrap_cuda_slice(scales, dev.clone()))
}

/// Checks `scales` against a `[rows, cols]` tensor and says whether they are per channel.
fn scales_layout(op: &str, rows: usize, s_s: &CudaStorage, s_l: &Layout) -> Result<bool> {
    if s_s.dtype() != DType::F32 {
        bail!("{op}: scales must be f32, got {:?}", s_s.dtype());
    }
    crate::engine::ops::int8::per_channel(op, s_l.shape().elem_count(), rows)
}

pub fn quantize_int8(
    x_s: &CudaStorage,
    x_l: &Layout,
    s_s: &CudaStorage,
    s_l: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let name = "quantize-int8";
    let (rows, cols) = rows_cols(name, x_l)?;
    let per_channel = scales_layout(name, rows, s_s, s_l)?;
    let out = by_float_type!(
        name,
        x_s.dtype(),
        quantize((rows, cols), per_channel, x_s, x_l, s_s, s_l)
    )?;
    Ok((out, Shape::from((rows, cols))))
}

fn quantize<T: Element>(
    (rows, cols): (usize, usize),
    per_channel: bool,
    x_s: &CudaStorage,
    x_l: &Layout,
    s_s: &CudaStorage,
    s_l: &Layout,
) -> Result<CudaStorage> {
    let name = "quantize-int8";
    let dev = &x_s.device;
    let x = view::<T>(name, "input", x_s, x_l)?;
    let scales = view::<f32>(name, "scales", s_s, s_l)?;
    let n = rows * cols;
    let mut q = output::<u8>(dev, n)?;
    let func =
        dev.get_or_load_custom_func(&kernel_name::<T>("int8_quantize"), INT8.name, INT8.ptx)?;
    let (n_u64, cols_i, per_channel_i) = (n as u64, cols as i32, per_channel as i32);
    let mut args = func.builder();
    args.arg(&x);
    args.arg(&scales);
    args.arg(&mut q);
    args.arg(&n_u64);
    args.arg(&cols_i);
    args.arg(&per_channel_i);
    // SAFETY: grid-stride over the n elements; scales indexed by row or 0 (checked length).
    unsafe {
        args.launch(cfg(
            (plan::elementwise_blocks(n), 1, 1),
            plan::ELEMENTWISE_THREADS,
            0,
        ))
    }
    .w()?;
    drop(args);
    Ok(CudaStorage::wrap_cuda_slice(q, dev.clone()))
}

pub fn dequantize_int8(
    q_s: &CudaStorage,
    q_l: &Layout,
    s_s: &CudaStorage,
    s_l: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let name = "dequantize-int8";
    let (rows, cols) = rows_cols(name, q_l)?;
    if q_s.dtype() != DType::U8 {
        bail!("{name}: q must be u8 (int8 bytes), got {:?}", q_s.dtype());
    }
    let per_channel = scales_layout(name, rows, s_s, s_l)?;
    let dev = &q_s.device;
    let q = view::<u8>(name, "q", q_s, q_l)?;
    let scales = view::<f32>(name, "scales", s_s, s_l)?;
    let n = rows * cols;
    let mut out = output::<f32>(dev, n)?;
    let func = dev.get_or_load_custom_func("int8_dequantize", INT8.name, INT8.ptx)?;
    let (n_u64, cols_i, per_channel_i) = (n as u64, cols as i32, per_channel as i32);
    let mut args = func.builder();
    args.arg(&q);
    args.arg(&scales);
    args.arg(&mut out);
    args.arg(&n_u64);
    args.arg(&cols_i);
    args.arg(&per_channel_i);
    // SAFETY: grid-stride over the n elements, as in `quantize`.
    unsafe {
        args.launch(cfg(
            (plan::elementwise_blocks(n), 1, 1),
            plan::ELEMENTWISE_THREADS,
            0,
        ))
    }
    .w()?;
    drop(args);
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev.clone()),
        Shape::from((rows, cols)),
    ))
}
