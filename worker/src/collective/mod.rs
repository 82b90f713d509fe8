//! Collective communication between the ranks of a data-parallel gang: the TCP ring
//! (`ring`) and [`RingSync`], the training engine's `GradientSync` over it. Each step's
//! gradients (every parameter, flattened in the network's fixed order), the weighted
//! loss and each rank's stop request (a preemption) travel as one f32 buffer, so every
//! rank applies bit-identical gradients and the ranks agree on the step they stop after.

pub mod ring;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use candle_core::backprop::GradStore;
use candle_core::{DType, Result, Tensor, Var};

use crate::train::trainer::{Evaluation, GradientSync, Share, SyncTiming};
use ring::{Ring, RingError};

/// The ring's first failure, kept for the job: a lost rank is the server's to recover
/// (the gang resumes from its checkpoint), not a failure of the training run.
pub type RingFault = Arc<OnceLock<String>>;

/// Data-parallel gradient synchronisation over a [`Ring`].
pub struct RingSync {
    ring: Ring,
    buffer: Vec<f32>,
    timing: Option<SyncTiming>,
    fault: RingFault,
    /// Set when this rank is asked to preempt (its worker's heartbeat).
    stop_request: Arc<AtomicBool>,
    /// Whether any rank asked, in the last all-reduce.
    stop_agreed: bool,
}

impl RingSync {
    pub fn new(ring: Ring) -> RingSync {
        RingSync {
            ring,
            buffer: Vec::new(),
            timing: None,
            fault: RingFault::default(),
            stop_request: Arc::default(),
            stop_agreed: false,
        }
    }

    /// This rank's preemption flag: once set, the next all-reduce tells every rank, and all
    /// stop after that step.
    pub fn with_stop_request(self, stop_request: Arc<AtomicBool>) -> RingSync {
        RingSync { stop_request, ..self }
    }

    /// Set once the ring fails (a rank died or went silent).
    pub fn fault(&self) -> RingFault {
        self.fault.clone()
    }

    fn failed(&self, error: RingError) -> candle_core::Error {
        let message = error.to_string();
        let _ = self.fault.set(message.clone());
        candle_core::Error::Msg(message)
    }
}

impl GradientSync for RingSync {
    fn share(&self) -> Share {
        Share { rank: self.ring.rank(), world: self.ring.world() }
    }

    fn synchronise(&mut self, parameters: &[(String, Var)], grads: &mut GradStore, loss: f64) -> Result<f64> {
        self.buffer.clear();
        for (_, var) in parameters {
            match grads.get(var.as_tensor()) {
                Some(grad) => self.buffer.extend(grad.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?),
                // Unused in this step's forward pass on every rank alike: a zero gradient.
                None => self.buffer.extend(std::iter::repeat_n(0.0, var.elem_count())),
            }
        }
        self.buffer.push(loss as f32);
        // Every rank adds 0 or 1: the sum is above 0 on every rank alike once one asked.
        self.buffer.push(if self.stop_request.load(Ordering::Relaxed) { 1.0 } else { 0.0 });
        let timing = self.ring.all_reduce(&mut self.buffer).map_err(|e| self.failed(e))?;
        self.stop_agreed = self.buffer[self.buffer.len() - 1] > 0.5;
        self.timing = Some(SyncTiming { wait: timing.wait, reduce: timing.reduce });
        let mut offset = 0;
        for (_, var) in parameters {
            let n = var.elem_count();
            let summed = Tensor::from_slice(&self.buffer[offset..offset + n], var.shape(), var.device())?;
            grads.insert(var.as_tensor(), summed.to_dtype(var.dtype())?);
            offset += n;
        }
        Ok(self.buffer[offset] as f64)
    }

    fn evaluation(&mut self, evaluate: &mut dyn FnMut() -> Result<Evaluation>) -> Result<Evaluation> {
        let mine = if self.ring.rank() == 0 { encode(&evaluate()?) } else { Vec::new() };
        let agreed = self.ring.broadcast(mine).map_err(|e| self.failed(e))?;
        decode(&agreed).ok_or_else(|| candle_core::Error::Msg("rank 0 sent an evaluation that does not decode".into()))
    }

    fn last_timing(&self) -> Option<SyncTiming> {
        self.timing
    }

    fn agreed_stop(&self, _requested: bool) -> bool {
        self.stop_agreed
    }
}

/// `val_loss`, `accuracy`, `rmse` as f64 bits; NaN stands for an absent metric.
fn encode(evaluation: &Evaluation) -> Vec<u8> {
    [evaluation.val_loss, evaluation.accuracy.unwrap_or(f64::NAN), evaluation.rmse.unwrap_or(f64::NAN)]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect()
}

fn decode(bytes: &[u8]) -> Option<Evaluation> {
    if bytes.len() != 24 {
        return None;
    }
    let at = |i: usize| f64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().unwrap());
    let present = |v: f64| Some(v).filter(|v| !v.is_nan());
    Some(Evaluation { val_loss: at(0), accuracy: present(at(1)), rmse: present(at(2)) })
}
