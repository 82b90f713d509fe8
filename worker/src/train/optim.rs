//! Optimizers whose state can be saved and restored: candle-nn's `SGD` has no momentum and
//! its `AdamW` keeps its moments private, while AutoLRS restores the optimizer with the
//! model before every candidate and checkpoints must resume it exactly. Both follow
//! PyTorch's update rules (`torch.optim.SGD` with dampening 0, `torch.optim.AdamW`), so
//! hyper-parameters carry over.
//!
//! AdamW on the CPU runs as one fused pass per parameter (`adamw_on_cpu`): the same f32
//! operations in the same order as the tensor expression, so bit-identical to it, without
//! the expression's dozen parameter-sized temporaries (on MiniLM each one is 91 MB of fresh
//! pages per step, and zeroing them took more of a CPU rank's step than its GEMMs).

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, Device, Result, Storage, StorageRef, Tensor, Var};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::engine::ops::zeros;

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum OptimizerKind {
    Sgd { momentum: f64, nesterov: bool, weight_decay: f64 },
    AdamW { beta1: f64, beta2: f64, eps: f64, weight_decay: f64 },
}

/// Everything the optimizer carries between steps: the step count and, per parameter,
/// the momentum buffer (SGD) or the first and second moments (AdamW), in the order of
/// `Optimizer::names`. Tensors are immutable, so cloning this is a snapshot.
#[derive(Debug, Clone)]
pub struct OptimizerState {
    pub steps: u64,
    pub moments: Vec<Tensor>,
}

pub struct Optimizer {
    kind: OptimizerKind,
    parameters: Vec<(String, Var)>,
    state: OptimizerState,
}

impl Optimizer {
    pub fn new(kind: OptimizerKind, parameters: &[(String, Var)]) -> Result<Optimizer> {
        let per_parameter = match kind {
            OptimizerKind::Sgd { .. } => 1,
            OptimizerKind::AdamW { .. } => 2,
        };
        let moments = parameters
            .iter()
            .flat_map(|(_, var)| std::iter::repeat_n(var, per_parameter))
            .map(|var| var.as_tensor().zeros_like())
            .collect::<Result<_>>()?;
        Ok(Optimizer { kind, parameters: parameters.to_vec(), state: OptimizerState { steps: 0, moments } })
    }

    /// Checkpoint names of the state tensors, in `OptimizerState::moments` order.
    pub fn names(&self) -> Vec<String> {
        let kinds: &[&str] = match self.kind {
            OptimizerKind::Sgd { .. } => &["momentum"],
            OptimizerKind::AdamW { .. } => &["exp_avg", "exp_avg_sq"],
        };
        self.parameters.iter().flat_map(|(name, _)| kinds.iter().map(move |k| format!("{k}.{name}"))).collect()
    }

    pub fn state(&self) -> &OptimizerState {
        &self.state
    }

    pub fn restore(&mut self, state: OptimizerState) -> Result<()> {
        if state.moments.len() != self.state.moments.len() {
            candle_core::bail!(
                "optimizer state has {} tensors, expected {}",
                state.moments.len(),
                self.state.moments.len()
            );
        }
        for (new, old) in state.moments.iter().zip(&self.state.moments) {
            if new.dims() != old.dims() {
                candle_core::bail!("optimizer state shape {:?} does not match {:?}", new.dims(), old.dims());
            }
        }
        self.state = state;
        Ok(())
    }

    /// One update at learning rate `lr`. Parameters without a gradient are left alone.
    pub fn step(&mut self, grads: &GradStore, lr: f64) -> Result<()> {
        self.state.steps += 1;
        let t = self.state.steps as i32;
        for (index, (_, var)) in self.parameters.iter().enumerate() {
            let Some(grad) = grads.get(var) else { continue };
            let param = var.as_tensor();
            match self.kind {
                OptimizerKind::Sgd { momentum, nesterov, weight_decay } => {
                    let grad =
                        if weight_decay != 0.0 { (grad + param.affine(weight_decay, 0.0)?)? } else { grad.clone() };
                    let buffer = (self.state.moments[index].affine(momentum, 0.0)? + &grad)?;
                    let update = if nesterov { (grad + buffer.affine(momentum, 0.0)?)? } else { buffer.clone() };
                    var.set(&(param - update.affine(lr, 0.0)?)?)?;
                    self.state.moments[index] = buffer;
                }
                OptimizerKind::AdamW { beta1, beta2, eps, weight_decay } => {
                    let moments = (&self.state.moments[2 * index], &self.state.moments[2 * index + 1]);
                    let coefficients = AdamWStep::new(self.kind, lr, t);
                    if let Some((param, m, v)) = adamw_on_cpu(param, grad, moments, coefficients)? {
                        var.set(&param)?;
                        self.state.moments[2 * index] = m;
                        self.state.moments[2 * index + 1] = v;
                        continue;
                    }
                    let decayed = param.affine(1.0 - lr * weight_decay, 0.0)?;
                    let m = (self.state.moments[2 * index].affine(beta1, 0.0)? + grad.affine(1.0 - beta1, 0.0)?)?;
                    let v = (self.state.moments[2 * index + 1].affine(beta2, 0.0)?
                        + grad.sqr()?.affine(1.0 - beta2, 0.0)?)?;
                    let m_hat = m.affine(1.0 / (1.0 - beta1.powi(t)), 0.0)?;
                    let v_hat = v.affine(1.0 / (1.0 - beta2.powi(t)), 0.0)?;
                    let update = (m_hat / (v_hat.sqrt()? + eps)?)?;
                    var.set(&(decayed - update.affine(lr, 0.0)?)?)?;
                    self.state.moments[2 * index] = m;
                    self.state.moments[2 * index + 1] = v;
                }
            }
        }
        Ok(())
    }
}

/// AdamW's f32 coefficients at one step, as the tensor expression in `Optimizer::step` rounds
/// them (candle's `affine` takes `mul` and `add` to f32).
#[derive(Debug, Clone, Copy)]
struct AdamWStep {
    decay: f32,
    beta1: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    m_correction: f32,
    v_correction: f32,
    eps: f32,
    lr: f32,
}

impl AdamWStep {
    fn new(kind: OptimizerKind, lr: f64, t: i32) -> AdamWStep {
        let OptimizerKind::AdamW { beta1, beta2, eps, weight_decay } = kind else {
            unreachable!("AdamWStep of an SGD optimizer")
        };
        AdamWStep {
            decay: (1.0 - lr * weight_decay) as f32,
            beta1: beta1 as f32,
            one_minus_beta1: (1.0 - beta1) as f32,
            beta2: beta2 as f32,
            one_minus_beta2: (1.0 - beta2) as f32,
            m_correction: (1.0 / (1.0 - beta1.powi(t))) as f32,
            v_correction: (1.0 / (1.0 - beta2.powi(t))) as f32,
            eps: eps as f32,
            lr: lr as f32,
        }
    }

    /// One element: `(param, m, v)` after the step, each operation rounded as candle's
    /// (`affine` is `x · mul + add`, also where `add` is 0).
    fn apply(&self, p: f32, g: f32, m: f32, v: f32) -> (f32, f32, f32) {
        let decayed = p * self.decay + 0.0;
        let m = (m * self.beta1 + 0.0) + (g * self.one_minus_beta1 + 0.0);
        let v = (v * self.beta2 + 0.0) + ((g * g) * self.one_minus_beta2 + 0.0);
        let m_hat = m * self.m_correction + 0.0;
        let v_hat = v * self.v_correction + 0.0;
        let update = m_hat / (v_hat.sqrt() * 1.0 + self.eps);
        (decayed - (update * self.lr + 0.0), m, v)
    }
}

/// A contiguous f32 tensor's storage on the CPU (held for reading) and its range, or `None`.
fn cpu_f32(tensor: &Tensor) -> Option<(StorageRef<'_>, usize, usize)> {
    let (storage, layout) = tensor.storage_and_layout();
    let (start, end) = layout.contiguous_offsets()?;
    matches!(&*storage, Storage::Cpu(CpuStorage::F32(_))).then_some((storage, start, end))
}

/// The elements of what `cpu_f32` returned.
fn elements<'a>((storage, start, end): &'a (StorageRef<'_>, usize, usize)) -> &'a [f32] {
    match &**storage {
        Storage::Cpu(CpuStorage::F32(data)) => &data[*start..*end],
        _ => unreachable!("checked by cpu_f32"),
    }
}

/// AdamW's step of one parameter in a single parallel pass over its elements: the new
/// parameter and moments, or `None` where an operand is not a contiguous f32 CPU tensor (the
/// tensor expression handles those). The moments come back as new tensors, so a cloned
/// `OptimizerState` stays a snapshot.
fn adamw_on_cpu(
    param: &Tensor,
    grad: &Tensor,
    (m, v): (&Tensor, &Tensor),
    step: AdamWStep,
) -> Result<Option<(Tensor, Tensor, Tensor)>> {
    let operands = [param, grad, m, v].map(cpu_f32);
    let [Some(p_data), Some(g_data), Some(m_data), Some(v_data)] = &operands else { return Ok(None) };
    let (p, g, m, v) = (elements(p_data), elements(g_data), elements(m_data), elements(v_data));
    if [g.len(), m.len(), v.len()] != [p.len(); 3] {
        candle_core::bail!("AdamW: parameter, gradient and moments differ in size");
    }
    const CHUNK: usize = 1 << 14;
    let mut out = (zeros(p.len()), zeros(p.len()), zeros(p.len()));
    out.0
        .par_chunks_mut(CHUNK)
        .zip(out.1.par_chunks_mut(CHUNK))
        .zip(out.2.par_chunks_mut(CHUNK))
        .enumerate()
        .for_each(|(chunk, ((p_out, m_out), v_out))| {
            let at = chunk * CHUNK;
            for i in 0..p_out.len() {
                (p_out[i], m_out[i], v_out[i]) = step.apply(p[at + i], g[at + i], m[at + i], v[at + i]);
            }
        });
    let shape = param.shape();
    let tensor = |data: Vec<f32>| Tensor::from_vec(data, shape, &Device::Cpu);
    Ok(Some((tensor(out.0)?, tensor(out.1)?, tensor(out.2)?)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Minimises `0.5·Σ p²` (gradient = p) from `p = [1, -2]` for two steps.
    fn run(kind: OptimizerKind, lr: f64) -> Vec<f32> {
        let var = Var::from_tensor(&Tensor::new(&[1f32, -2.0], &Device::Cpu).unwrap()).unwrap();
        let mut optimizer = Optimizer::new(kind, &[("p".into(), var.clone())]).unwrap();
        for _ in 0..2 {
            let loss = (var.as_tensor().sqr().unwrap().sum_all().unwrap() * 0.5).unwrap();
            optimizer.step(&loss.backward().unwrap(), lr).unwrap();
        }
        var.as_tensor().to_vec1().unwrap()
    }

    fn close(actual: &[f32], expected: &[f64]) {
        for (a, e) in actual.iter().zip(expected) {
            assert!((f64::from(*a) - e).abs() < 1e-6, "{actual:?} vs {expected:?}");
        }
    }

    #[test]
    fn sgd_momentum_matches_hand_computation() {
        // p=1: buf=1, p=0.9; buf=0.9·1+0.9=1.8, p=0.9-0.18=0.72.
        close(&run(OptimizerKind::Sgd { momentum: 0.9, nesterov: false, weight_decay: 0.0 }, 0.1), &[0.72, -1.44]);
    }

    #[test]
    fn sgd_nesterov_and_weight_decay_match_hand_computation() {
        // g = p + 0.1p = 1.1; buf=1.1; upd=1.1+0.5·1.1=1.65; p=1-0.165=0.835.
        // g = 0.9185; buf=0.55+0.9185=1.4685; upd=0.9185+0.73425=1.65275; p=0.835-0.165275=0.669725.
        close(
            &run(OptimizerKind::Sgd { momentum: 0.5, nesterov: true, weight_decay: 0.1 }, 0.1),
            &[0.669725, -1.33945],
        );
    }

    #[test]
    fn adamw_matches_hand_computation() {
        // Bias-corrected Adam moves each coordinate by ~lr·sign(g) early on; decoupled decay
        // shrinks p by (1 - lr·wd) first. Step 1: p = 1·(1-0.001) - 0.1·1/(1+1e-8).
        let p1 = 1.0 * (1.0 - 0.1 * 0.01) - 0.1 * 1.0 / (1.0 + 1e-8);
        let g1: f64 = 1.0;
        let (m1, v1) = (0.1 * g1, 0.001 * g1 * g1);
        let g2 = p1;
        let (m2, v2) = (0.9 * m1 + 0.1 * g2, 0.999 * v1 + 0.001 * g2 * g2);
        let (m_hat, v_hat) = (m2 / (1.0 - 0.81), v2 / (1.0 - 0.999f64.powi(2)));
        let p2 = p1 * (1.0 - 0.1 * 0.01) - 0.1 * m_hat / (v_hat.sqrt() + 1e-8);
        let kind = OptimizerKind::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
        let result = run(kind, 0.1);
        close(&result[..1], &[p2]);
    }

    /// The fused CPU step against the tensor expression it replaces, on values of every scale
    /// (tiny gradients, zero moments, large parameters) over several steps: bit for bit.
    #[test]
    fn fused_cpu_adamw_is_bit_identical_to_the_tensor_expression() {
        let n = 40_000; // more than two chunks
        let values = |seed: u32| -> Vec<f32> {
            (0..n as u32)
                .map(|i| {
                    let x = (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8) as f32 / (1u32 << 24) as f32;
                    (x - 0.5) * 10f32.powi((i % 9) as i32 - 6)
                })
                .collect()
        };
        let kind = OptimizerKind::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
        let OptimizerKind::AdamW { beta1, beta2, eps, weight_decay } = kind else { unreachable!() };
        let cpu = |data: Vec<f32>| Tensor::from_vec(data, n, &Device::Cpu).unwrap();
        let (mut p, mut m, mut v) = (cpu(values(1)), cpu(vec![0.0; n]), cpu(vec![0.0; n]));
        let (mut p_ref, mut m_ref, mut v_ref) = (p.clone(), m.clone(), v.clone());
        for t in 1..=3 {
            let g = cpu(values(10 + t as u32));
            let lr = 1e-3 * f64::from(t);
            (p, m, v) = adamw_on_cpu(&p, &g, (&m, &v), AdamWStep::new(kind, lr, t)).unwrap().unwrap();
            // The tensor expression of `Optimizer::step`.
            let decayed = p_ref.affine(1.0 - lr * weight_decay, 0.0).unwrap();
            m_ref = (m_ref.affine(beta1, 0.0).unwrap() + g.affine(1.0 - beta1, 0.0).unwrap()).unwrap();
            v_ref = (v_ref.affine(beta2, 0.0).unwrap() + g.sqr().unwrap().affine(1.0 - beta2, 0.0).unwrap()).unwrap();
            let m_hat = m_ref.affine(1.0 / (1.0 - beta1.powi(t)), 0.0).unwrap();
            let v_hat = v_ref.affine(1.0 / (1.0 - beta2.powi(t)), 0.0).unwrap();
            let update = (m_hat / (v_hat.sqrt().unwrap() + eps).unwrap()).unwrap();
            p_ref = (decayed - update.affine(lr, 0.0).unwrap()).unwrap();
            for (fused, reference) in [(&p, &p_ref), (&m, &m_ref), (&v, &v_ref)] {
                let bits = |t: &Tensor| t.to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(fused), bits(reference), "step {t}");
            }
        }
        let strided = cpu(values(2)).reshape((200, 200)).unwrap().t().unwrap();
        let moments = (&strided, &strided);
        assert!(adamw_on_cpu(&strided, &strided, moments, AdamWStep::new(kind, 0.1, 1)).unwrap().is_none());
    }

    #[test]
    fn restoring_state_replays_the_same_update() {
        let var = Var::from_tensor(&Tensor::new(&[1f32, -2.0], &Device::Cpu).unwrap()).unwrap();
        let kind = OptimizerKind::Sgd { momentum: 0.9, nesterov: false, weight_decay: 0.0 };
        let mut optimizer = Optimizer::new(kind, &[("p".into(), var.clone())]).unwrap();
        let grad_step = |optimizer: &mut Optimizer| {
            let loss = (var.as_tensor().sqr().unwrap().sum_all().unwrap() * 0.5).unwrap();
            optimizer.step(&loss.backward().unwrap(), 0.1).unwrap();
        };
        grad_step(&mut optimizer);
        let (saved_state, saved_param) = (optimizer.state().clone(), var.as_tensor().copy().unwrap());
        grad_step(&mut optimizer);
        let after: Vec<f32> = var.as_tensor().to_vec1().unwrap();
        var.set(&saved_param).unwrap();
        optimizer.restore(saved_state).unwrap();
        grad_step(&mut optimizer);
        assert_eq!(var.as_tensor().to_vec1::<f32>().unwrap(), after);
        assert_eq!(optimizer.names(), ["momentum.p"]);
    }
}
