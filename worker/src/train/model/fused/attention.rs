//! Multi-head self-attention, `softmax(q_h k_hᵀ/√d + mask) v_h` for every head h, as one CPU
//! op with its backward. candle ran it as about fifteen graph nodes a layer: three
//! head-splitting copies, the score matmul, the softmax, the context matmul and a copy back,
//! each with its gradient node, and its batched matmuls ran the 192 small per-head products
//! one after another on one thread. Here each (sequence, head) is one rayon task over
//! cache-sized tiles: forward the scores, softmax and context, keeping the probabilities;
//! backward `dP = dC·Vᵀ`, `dV = Pᵀ·dC`, `dS = P ⊙ (dP − Σ_row P ⊙ dP)/√d`, `dQ = dS·K`,
//! `dK = dSᵀ·Q`. The products run on a 4 × 16 AVX2 register tile (plain loops on other
//! CPUs and on the edges of a tile). Each task's sums run in a fixed order, so the results do
//! not depend on the thread count. At MiniLM's shapes (16 × 128 tokens, 12 heads) on a
//! 2-core Xeon: forward 3.1–3.3× and backward 6.1–6.7× candle's ops, the f32 encoder step
//! 1.31× (`qsync_gemm`; bench/results/cpu_f32_avx512.md).

use std::sync::OnceLock;

use candle_core::{bail, CpuStorage, CustomOp3, Layout, Result, Shape, Storage, Tensor, D};
use rayon::prelude::*;

use super::{fused, values};
use crate::engine::ops::vector_math::exp_in_place;
use crate::engine::ops::zeros;

/// Self-attention over `q`, `k`, `v` `[batch, tokens, hidden]` (the projections, heads side
/// by side) with the additive padding mask `[batch, 1, 1, tokens]` (0 for a token, the most
/// negative f32 for padding, as the encoder builds it): the heads' contexts, side by side.
/// The mask gets no gradient.
pub fn self_attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, heads: usize) -> Result<Tensor> {
    let (batch, tokens, hidden) = q.dims3()?;
    if k.dims() != q.dims() || v.dims() != q.dims() {
        bail!("attention: queries {:?}, keys {:?} and values {:?} differ", q.dims(), k.dims(), v.dims());
    }
    if heads == 0 || hidden % heads != 0 {
        bail!("attention: {hidden} values a token do not split into {heads} heads");
    }
    if mask.dims() != [batch, 1, 1, tokens] {
        bail!("attention: a mask of {:?} for {batch} sequences of {tokens} tokens", mask.dims());
    }
    if [q, k, v, mask].into_iter().all(fused) {
        let op = Attention { heads, mask: mask.flatten_all()?.to_vec1()?, probs: OnceLock::new() };
        return q.contiguous()?.apply_op3(&k.contiguous()?, &v.contiguous()?, op);
    }
    self_attention_expression(q, k, v, mask, heads)
}

/// [`self_attention`] as candle tensor ops (split the heads, matmul, softmax, matmul, join),
/// differentiable on every device and dtype: what runs where the op does not, and the
/// benchmark's baseline.
pub fn self_attention_expression(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, heads: usize) -> Result<Tensor> {
    let (batch, tokens, hidden) = q.dims3()?;
    let head_dim = hidden / heads.max(1);
    let split = |x: &Tensor| x.reshape((batch, tokens, heads, head_dim))?.transpose(1, 2)?.contiguous();
    let scores = (split(q)?.matmul(&split(k)?.t()?)? / (head_dim as f64).sqrt())?;
    let probs = candle_nn::ops::softmax(&scores.broadcast_add(mask)?, D::Minus1)?;
    probs.matmul(&split(v)?)?.transpose(1, 2)?.contiguous()?.flatten_from(D::Minus2)
}

/// The op; its forward keeps the probabilities `[batch, heads, tokens, tokens]` for the
/// backward.
struct Attention {
    heads: usize,
    /// The additive mask, `[batch, tokens]`.
    mask: Vec<f32>,
    probs: OnceLock<Vec<f32>>,
}

/// Sizes of one call: `batch` sequences of `tokens`, `heads` heads of `head_dim`.
#[derive(Clone, Copy)]
struct Dims {
    batch: usize,
    tokens: usize,
    heads: usize,
    head_dim: usize,
}

impl Dims {
    fn hidden(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Where task `task` (sequence `task / heads`, head `task % heads`) starts in a
    /// `[batch, tokens, hidden]` tensor, and its sequence.
    fn start(&self, task: usize) -> (usize, usize) {
        let (sequence, head) = (task / self.heads, task % self.heads);
        (sequence * self.tokens * self.hidden() + head * self.head_dim, sequence)
    }

    /// candle's `scores / √d` multiplies by the reciprocal, rounded from f64; so does this.
    fn scale(&self) -> f32 {
        (1.0 / (self.head_dim as f64).sqrt()) as f32
    }
}

impl Attention {
    fn dims(&self, l: &Layout) -> Result<Dims> {
        let (batch, tokens, hidden) = l.shape().dims3()?;
        if self.mask.len() != batch * tokens {
            bail!("attention: {} mask values for {batch} sequences of {tokens} tokens", self.mask.len());
        }
        Ok(Dims { batch, tokens, heads: self.heads, head_dim: hidden / self.heads })
    }
}

impl CustomOp3 for Attention {
    fn name(&self) -> &'static str {
        "self-attention"
    }

    fn cpu_fwd(
        &self,
        q_s: &CpuStorage,
        q_l: &Layout,
        k_s: &CpuStorage,
        k_l: &Layout,
        v_s: &CpuStorage,
        v_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let name = self.name();
        let (q, k, v) = (values(name, q_s, q_l)?, values(name, k_s, k_l)?, values(name, v_s, v_l)?);
        if k.len() != q.len() || v.len() != q.len() {
            bail!("{name}: queries, keys and values of {}, {} and {} values", q.len(), k.len(), v.len());
        }
        let dims = self.dims(q_l)?;
        let Dims { batch, tokens: t, heads, head_dim: d } = dims;
        let (hidden, scale) = (dims.hidden(), dims.scale());
        let mut probs = zeros(batch * heads * t * t);
        let mut contexts = zeros(q.len());
        // `.max(1)`: an empty batch (no tokens, or no values a head) has no task, not a panic.
        let (scores, head) = ((t * t).max(1), (t * d).max(1));
        probs.par_chunks_mut(scores).zip(contexts.par_chunks_mut(head)).enumerate().for_each(|(task, (p, context))| {
            let (at, sequence) = dims.start(task);
            let mask = &self.mask[sequence * t..][..t];
            let keys = transposed(&k[at..], hidden, t, d);
            product(View::rows(&q[at..], hidden), View::rows(&keys, t), (p, t), (t, d, t));
            for row in p.chunks_exact_mut(t) {
                row.iter_mut().zip(mask).for_each(|(s, m)| *s = *s * scale + m);
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                row.iter_mut().for_each(|s| *s -= max);
                exp_in_place(row);
                let sum: f32 = row.iter().sum();
                row.iter_mut().for_each(|s| *s /= sum);
            }
            product(View::rows(p, t), View::rows(&v[at..], hidden), (context, d), (t, t, d));
        });
        // One forward per op value: `self_attention` makes a new one per call.
        let _ = self.probs.set(probs);
        Ok((CpuStorage::F32(side_by_side(&contexts, dims)), q_l.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let name = self.name();
        let Some(probs) = self.probs.get() else { bail!("{name}: backward before forward") };
        let grad = grad.contiguous()?;
        let guards = [q, k, v, &grad].map(|t| t.storage_and_layout());
        let mut operands = Vec::with_capacity(4);
        for (storage, layout) in &guards {
            let Storage::Cpu(cpu) = &**storage else { bail!("{name}: the backward runs on the CPU") };
            operands.push(values(name, cpu, layout)?);
        }
        let [q_v, k_v, v_v, g] = operands[..] else { unreachable!("four operands") };
        if g.len() != q_v.len() {
            bail!("{name}: a gradient of {} values for outputs of {}", g.len(), q_v.len());
        }
        let dims = self.dims(guards[0].1)?;
        let Dims { tokens: t, head_dim: d, .. } = dims;
        let (hidden, scale) = (dims.hidden(), dims.scale());
        let (mut dq, mut dk, mut dv) = (zeros(g.len()), zeros(g.len()), zeros(g.len()));
        let head = (t * d).max(1);
        let per_head = dq.par_chunks_mut(head).zip(dk.par_chunks_mut(head)).zip(dv.par_chunks_mut(head));
        per_head.zip(probs.par_chunks((t * t).max(1))).enumerate().for_each(|(task, (((dq, dk), dv), p))| {
            let (at, _) = dims.start(task);
            let grad = View::rows(&g[at..], hidden);
            // dS starts as dP = dC·Vᵀ.
            let mut ds = vec![0f32; t * t];
            product(grad, View::rows(&transposed(&v_v[at..], hidden, t, d), t), (&mut ds, t), (t, d, t));
            product(View::columns(p, t), grad, (dv, d), (t, t, d));
            for (ds, p) in ds.chunks_exact_mut(t).zip(p.chunks_exact(t)) {
                let dot: f32 = ds.iter().zip(p).map(|(g, p)| g * p).sum();
                ds.iter_mut().zip(p).for_each(|(g, p)| *g = p * (*g - dot) * scale);
            }
            product(View::rows(&ds, t), View::rows(&k_v[at..], hidden), (dq, d), (t, t, d));
            product(View::columns(&ds, t), View::rows(&q_v[at..], hidden), (dk, d), (t, t, d));
        });
        let device = grad.device();
        let gradient = |heads: Vec<f32>| Tensor::from_vec(side_by_side(&heads, dims), q.shape(), device);
        Ok((Some(gradient(dq)?), Some(gradient(dk)?), Some(gradient(dv)?)))
    }
}

/// `[batch, heads, tokens, head_dim]` per-head results as `[batch, tokens, hidden]`.
fn side_by_side(per_head: &[f32], dims: Dims) -> Vec<f32> {
    let Dims { tokens, head_dim: d, .. } = dims;
    let hidden = dims.hidden();
    let mut out = zeros(per_head.len());
    let sequence = (tokens * hidden).max(1);
    out.par_chunks_mut(sequence).zip(per_head.par_chunks(sequence)).for_each(|(out, sequence)| {
        for (i, row) in out.chunks_exact_mut(hidden).enumerate() {
            for (h, part) in row.chunks_exact_mut(d).enumerate() {
                part.copy_from_slice(&sequence[(h * tokens + i) * d..][..d]);
            }
        }
    });
    out
}

/// The `[tokens, head_dim]` block of one head, rows `stride` apart from `x`'s start, as
/// `[head_dim, tokens]`.
fn transposed(x: &[f32], stride: usize, tokens: usize, d: usize) -> Vec<f32> {
    let mut out = vec![0f32; d * tokens];
    for (j, row) in x.chunks(stride).take(tokens).enumerate() {
        for (c, value) in row[..d].iter().enumerate() {
            out[c * tokens + j] = *value;
        }
    }
    out
}

/// A read-only matrix: element (i, j) at `data[i·row + j·col]`.
#[derive(Clone, Copy)]
struct View<'a> {
    data: &'a [f32],
    row: usize,
    col: usize,
}

impl<'a> View<'a> {
    /// Rows `stride` apart.
    fn rows(data: &'a [f32], stride: usize) -> Self {
        View { data, row: stride, col: 1 }
    }

    /// The transpose of [`View::rows`]: columns `stride` apart.
    fn columns(data: &'a [f32], stride: usize) -> Self {
        View { data, row: 1, col: stride }
    }

    fn at(&self, i: usize, j: usize) -> f32 {
        self.data[i * self.row + j * self.col]
    }

    /// Whether an `[rows, cols]` matrix fits in `data`.
    fn holds(&self, rows: usize, cols: usize) -> bool {
        rows == 0 || cols == 0 || (rows - 1) * self.row + (cols - 1) * self.col < self.data.len()
    }
}

/// `c = a·b` for `a` `[m, k]`, `b` `[k, n]` with unit column stride, `c` `[m, n]` with rows
/// `ldc` apart (overwritten). Every output sums its `k` products in order.
fn product(a: View, b: View, (c, ldc): (&mut [f32], usize), (m, k, n): (usize, usize, usize)) {
    assert!(b.col == 1 && a.holds(m, k) && b.holds(k, n), "attention: a product's operands are too short");
    assert!(m == 0 || n == 0 || (m - 1) * ldc + n <= c.len(), "attention: a product's output is too short");
    #[cfg(target_arch = "x86_64")]
    if crate::engine::ops::has_avx2_fma() {
        // SAFETY: AVX2 and FMA detected just above; the extents are checked above.
        unsafe { avx2::product(a, b, (c, ldc), (m, k, n)) };
        return;
    }
    product_loops(a, b, (c, ldc), (k, 0..m, 0..n));
}

/// [`product`]'s rows `rows` and columns `cols` in plain loops.
fn product_loops(
    a: View,
    b: View,
    (c, ldc): (&mut [f32], usize),
    (k, rows, cols): (usize, std::ops::Range<usize>, std::ops::Range<usize>),
) {
    if cols.is_empty() {
        return;
    }
    for i in rows {
        let out = &mut c[i * ldc..][cols.clone()];
        out.fill(0.0);
        for p in 0..k {
            let x = a.at(i, p);
            out.iter_mut().zip(&b.data[p * b.row..][cols.clone()]).for_each(|(o, y)| *o += x * y);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{product_loops, View};

    /// Rows and columns of the register tile: 4 × 16, eight accumulators.
    const MR: usize = 4;
    const NR: usize = 16;

    /// [`super::product`] on the tile; the edges that do not fill one in plain loops.
    ///
    /// # Safety
    /// AVX2 and FMA must be available and the extents checked as `product` does.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn product(a: View, b: View, (c, ldc): (&mut [f32], usize), (m, k, n): (usize, usize, usize)) {
        let (m_tiles, n_tiles) = (m / MR * MR, n / NR * NR);
        let (a_ptr, b_ptr, c_ptr) = (a.data.as_ptr(), b.data.as_ptr(), c.as_mut_ptr());
        for i0 in (0..m_tiles).step_by(MR) {
            for j0 in (0..n_tiles).step_by(NR) {
                let mut acc = [_mm256_setzero_ps(); 2 * MR];
                for p in 0..k {
                    let b0 = _mm256_loadu_ps(b_ptr.add(p * b.row + j0));
                    let b1 = _mm256_loadu_ps(b_ptr.add(p * b.row + j0 + 8));
                    for r in 0..MR {
                        let x = _mm256_set1_ps(*a_ptr.add((i0 + r) * a.row + p * a.col));
                        acc[2 * r] = _mm256_fmadd_ps(x, b0, acc[2 * r]);
                        acc[2 * r + 1] = _mm256_fmadd_ps(x, b1, acc[2 * r + 1]);
                    }
                }
                for r in 0..MR {
                    let out = c_ptr.add((i0 + r) * ldc + j0);
                    _mm256_storeu_ps(out, acc[2 * r]);
                    _mm256_storeu_ps(out.add(8), acc[2 * r + 1]);
                }
            }
        }
        product_loops(a, b, (c, ldc), (k, 0..m_tiles, n_tiles..n));
        product_loops(a, b, (c, ldc), (k, m_tiles..m, 0..n));
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Var};

    use super::*;

    type AttentionFn = fn(&Tensor, &Tensor, &Tensor, &Tensor, usize) -> Result<Tensor>;

    /// The output and the gradients of q, k and v under the loss `Σ attention ⊙ probe`, all
    /// as f32, computed at the inputs' dtype.
    fn run(inputs: &[Tensor; 4], mask: &Tensor, heads: usize, attention: AttentionFn) -> [Vec<f32>; 4] {
        let [q, k, v, probe] = inputs;
        let vars = [q, k, v].map(|t| Var::from_tensor(t).unwrap());
        let y = attention(vars[0].as_tensor(), vars[1].as_tensor(), vars[2].as_tensor(), mask, heads).unwrap();
        let grads = (&y * probe).unwrap().sum_all().unwrap().backward().unwrap();
        let flat = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let grad = |v: &Var| flat(grads.get(v.as_tensor()).expect("a gradient reaches q, k and v"));
        [flat(&y), grad(&vars[0]), grad(&vars[1]), grad(&vars[2])]
    }

    /// Random q, k, v and a probe `[batch, tokens, hidden]`, and a mask that pads every
    /// fifth key and the last sequence's last three.
    fn inputs(batch: usize, tokens: usize, hidden: usize) -> ([Tensor; 4], Tensor) {
        let x = |seed| super::super::tests::normal(seed, 0.0, 1.0, (batch, tokens, hidden));
        let padded = |i: usize| i % 5 == 4 || (i / tokens == batch - 1 && i % tokens >= tokens - 3);
        let mask: Vec<f32> = (0..batch * tokens).map(|i| if padded(i) { f32::MIN } else { 0.0 }).collect();
        ([x(1), x(2), x(3), x(4)], Tensor::from_vec(mask, (batch, 1, 1, tokens), &Device::Cpu).unwrap())
    }

    fn as_f64(t: &Tensor) -> Tensor {
        t.to_dtype(DType::F64).unwrap()
    }

    #[test]
    fn matches_candles_expression_at_f64_on_whole_tiles_and_their_edges() {
        // 64 tokens of 32 dims: whole 4 × 16 tiles; 19 tokens of 20 dims: every edge of one.
        for (batch, tokens, heads, head_dim) in [(2, 64, 2, 32), (3, 19, 3, 20)] {
            let (inputs, mask) = inputs(batch, tokens, heads * head_dim);
            let ours = run(&inputs, &mask, heads, self_attention);
            let reference = run(&inputs.clone().map(|t| as_f64(&t)), &as_f64(&mask), heads, self_attention_expression);
            for (what, (a, b)) in ["y", "dq", "dk", "dv"].iter().zip(ours.iter().zip(&reference)) {
                assert_eq!(a.len(), b.len());
                for (i, (a, b)) in a.iter().zip(b).enumerate() {
                    assert!((a - b).abs() <= 2e-5 * (1.0 + b.abs()), "{what}[{i}]: {a} against {b} ({tokens} tokens)");
                }
            }
            // Padded keys take no weight, so their keys and values get exactly no gradient.
            let padded = mask.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let hidden = heads * head_dim;
            for (token, _) in padded.iter().enumerate().filter(|(_, m)| **m < 0.0) {
                for grad in [&ours[2], &ours[3]] {
                    assert!(grad[token * hidden..][..hidden].iter().all(|g| *g == 0.0), "padded key {token}");
                }
            }
        }
    }

    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        let (inputs, mask) = inputs(2, 24, 2 * 16);
        let with_threads = |n| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(n).build().unwrap();
            pool.install(|| run(&inputs, &mask, 2, self_attention))
        };
        assert_eq!(with_threads(1), with_threads(3));
    }

    #[test]
    fn the_tile_agrees_with_the_plain_loops() {
        let values = super::super::tests::normal(5, 0.0, 1.0, 4000).to_vec1::<f32>().unwrap();
        // a [m, k] read by columns (a transpose), b [k, n] rows 41 apart, c rows 37 apart.
        for (m, k, n) in [(8, 20, 32), (11, 13, 35), (3, 5, 7)] {
            let (a, b) = (View::columns(&values, 23), View::rows(&values[100..], 41));
            let (mut tiled, mut plain) = (vec![f32::NAN; 37 * m], vec![f32::NAN; 37 * m]);
            product(a, b, (&mut tiled, 37), (m, k, n));
            product_loops(a, b, (&mut plain, 37), (k, 0..m, 0..n));
            for i in 0..m {
                for j in 0..n {
                    let (t, p) = (tiled[i * 37 + j], plain[i * 37 + j]);
                    assert!((t - p).abs() <= 1e-5 * (1.0 + p.abs()), "[{i}, {j}] of {m}x{k}x{n}: {t} against {p}");
                }
            }
        }
    }

    #[test]
    fn other_dtypes_and_bad_shapes() {
        let (inputs, mask) = inputs(2, 6, 8);
        let [q, k, v, _] = inputs.map(|t| as_f64(&t));
        let mask = as_f64(&mask);
        let ours = self_attention(&q, &k, &v, &mask, 2).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let candle = self_attention_expression(&q, &k, &v, &mask, 2).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
        assert_eq!(ours, candle);
        assert!(self_attention(&q, &k, &v, &mask, 3).is_err(), "8 values do not split into 3 heads");
        // No tokens: an empty output and empty gradients, not a panic.
        let empty = Var::zeros((2, 0, 8), DType::F32, &Device::Cpu).unwrap();
        let no_keys = Tensor::zeros((2, 1, 1, 0), DType::F32, &Device::Cpu).unwrap();
        let y = self_attention(&empty, &empty, &empty, &no_keys, 2).unwrap();
        assert_eq!(y.dims(), [2, 0, 8]);
        let grads = y.sum_all().unwrap().backward().unwrap();
        assert_eq!(grads.get(&empty).expect("a gradient reaches the input").dims(), [2, 0, 8]);
        assert!(self_attention(&q, &k.narrow(1, 0, 5).unwrap(), &v, &mask, 2).is_err());
        assert!(self_attention(&q, &k, &v, &mask.narrow(3, 0, 5).unwrap(), 2).is_err());
    }
}
