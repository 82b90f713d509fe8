//! Collective communication between the ranks of a data-parallel gang: the TCP ring
//! (`ring`) and [`RingSync`], the training engine's `GradientSync` over it. Each step's
//! gradients (every parameter, flattened in the network's fixed order), the weighted
//! loss and each rank's stop request (a preemption) travel as one f32 buffer, so every
//! rank applies bit-identical gradients and the ranks agree on the step they stop after.
//! A gang whose ranks are all CUDA GPUs reduces over NCCL instead (`nccl`, the `nccl`
//! feature): [`for_gang`] picks, the same way on every rank.

#[cfg(feature = "nccl")]
pub mod nccl;
pub mod ring;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result, Tensor, Var};

use crate::train::trainer::{Evaluation, GradientSync, Share, SyncTiming};
use ring::{Ring, RingError};

/// The ring's first failure, kept for the job: a lost rank is the server's to recover
/// (the gang resumes from its checkpoint), not a failure of the training run.
pub type RingFault = Arc<OnceLock<String>>;

/// Why a gang's gradient sync could not be set up or failed.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error(transparent)]
    Ring(#[from] RingError),
    #[error("NCCL: {0}")]
    Nccl(String),
    #[error("NCCL: no progress in {what} for {seconds} s: a rank is gone; the step fails and the gang resumes from its last checkpoint")]
    NcclTimeout { what: &'static str, seconds: u64 },
}

impl SyncError {
    /// A lost or silent rank (the server's to recover), not a fault of this rank's set-up.
    pub fn is_rank_lost(&self) -> bool {
        matches!(self, SyncError::Ring(_) | SyncError::NcclTimeout { .. })
    }
}

/// How a gang reduces its gradients: the transport, for the rank's log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// GPU to GPU (every rank on CUDA, every worker built with `nccl`).
    Nccl,
    /// Host-staged over the TCP ring (unequal devices).
    Ring,
}

/// This rank's claim to join an NCCL gang: its GPU's UUID, when it trains on a CUDA device
/// in a build with NCCL; `None` otherwise.
fn nccl_identity(device: &Device) -> Option<[u8; 16]> {
    #[cfg(feature = "nccl")]
    if let Ok(cuda) = device.as_cuda_device() {
        let uuid = cuda.cuda_stream().context().uuid().ok()?;
        return Some(uuid.bytes.map(|b| b as u8));
    }
    let _ = device;
    None
}

/// f32 slots per rank in the vote: whether it can join, then its GPU's 16 UUID bytes as six
/// 24-bit integers (exact in f32; the ring adds only zeros to them).
const VOTE_SLOTS: usize = 7;

/// The gradient sync for this rank of a gang, over its connected `ring`: NCCL when every
/// rank can join (a CUDA GPU in an `nccl` build) and no GPU is in the gang twice (NCCL
/// refuses that; two ranks sharing one GPU stay on the ring), the host-staged ring
/// otherwise. The ranks vote with one ring all-reduce in which each fills only its own
/// slots, so all of them see every rank's claim and pick alike; every rank must call this
/// once, right after the ring connects. `timeout` bounds NCCL's set-up and reductions (the
/// ring has its own). `stop_request` is this rank's preemption flag: the ranks agree in
/// each step's reduction whether any one of them was asked to stop.
pub fn for_gang(
    mut ring: Ring,
    device: &Device,
    timeout: std::time::Duration,
    stop_request: Arc<AtomicBool>,
) -> std::result::Result<(Box<dyn GradientSync>, RingFault, Transport), SyncError> {
    let (rank, world) = (ring.rank(), ring.world());
    let mut votes = vec![0f32; world * VOTE_SLOTS];
    if let Some(uuid) = nccl_identity(device) {
        let mine = &mut votes[rank * VOTE_SLOTS..(rank + 1) * VOTE_SLOTS];
        mine[0] = 1.0;
        let mut bytes = [0u8; 18];
        bytes[..16].copy_from_slice(&uuid);
        for (slot, chunk) in mine[1..].iter_mut().zip(bytes.chunks(3)) {
            *slot = u32::from_be_bytes([0, chunk[0], chunk[1], chunk[2]]) as f32;
        }
    }
    ring.all_reduce(&mut votes)?;
    let claims: Vec<&[f32]> = votes.chunks(VOTE_SLOTS).collect();
    let all_can = claims.iter().all(|c| c[0] == 1.0);
    let distinct = claims.iter().enumerate().all(|(i, a)| claims[..i].iter().all(|b| a[1..] != b[1..]));
    if world > 1 && all_can && distinct {
        #[cfg(feature = "nccl")]
        {
            let sync = nccl::NcclSync::new(ring, device, timeout)?.with_stop_request(stop_request);
            let fault = sync.fault();
            return Ok((Box::new(sync), fault, Transport::Nccl));
        }
    }
    let _ = timeout;
    let sync = RingSync::new(ring).with_stop_request(stop_request);
    let fault = sync.fault();
    Ok((Box::new(sync), fault, Transport::Ring))
}

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
        let started = std::time::Instant::now();
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
        let mut offset = 0;
        for (_, var) in parameters {
            let n = var.elem_count();
            let summed = Tensor::from_slice(&self.buffer[offset..offset + n], var.shape(), var.device())?;
            grads.insert(var.as_tensor(), summed.to_dtype(var.dtype())?);
            offset += n;
        }
        // Staging the gradients through the host buffer and back is part of what the step
        // spends on the all-reduce (for MiniLM two copies of 90 MB): everything but the
        // waiting counts, so the planner's profile and the step metrics see it.
        self.timing = Some(SyncTiming { wait: timing.wait, reduce: started.elapsed() - timing.wait });
        Ok(self.buffer[offset] as f64)
    }

    fn evaluation(&mut self, evaluate: &mut dyn FnMut() -> Result<Evaluation>) -> Result<Evaluation> {
        let mine = if self.ring.rank() == 0 { encode(&evaluate()?) } else { Vec::new() };
        let agreed = self.ring.broadcast_unhurried(mine).map_err(|e| self.failed(e))?;
        decode(&agreed).ok_or_else(|| candle_core::Error::Msg("rank 0 sent an evaluation that does not decode".into()))
    }

    fn last_timing(&self) -> Option<SyncTiming> {
        self.timing
    }

    fn all_gather(&mut self, bytes: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        self.ring.all_gather(bytes).map_err(|e| self.failed(e))
    }

    fn broadcast(&mut self, bytes: Vec<u8>) -> Result<Vec<u8>> {
        self.ring.broadcast(bytes).map_err(|e| self.failed(e))
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use uuid::Uuid;

    use super::*;

    /// CPU ranks cannot use NCCL: the vote keeps every rank of the gang on the ring, and the
    /// ring still reduces afterwards (the vote consumed one all-reduce on every rank alike).
    #[test]
    fn cpu_ranks_vote_for_the_ring_and_stay_in_step() {
        let timeout = Duration::from_secs(20);
        let rings = ring::loopback(3, Uuid::new_v4(), timeout).unwrap();
        let results: Vec<(Transport, f64)> = std::thread::scope(|scope| {
            let handles: Vec<_> = rings
                .into_iter()
                .map(|ring| {
                    scope.spawn(move || {
                        let (mut sync, _, transport) = for_gang(ring, &Device::Cpu, timeout, Arc::default()).unwrap();
                        let mut grads = Tensor::zeros((), DType::F32, &Device::Cpu).unwrap().backward().unwrap();
                        let share = sync.share();
                        (transport, sync.synchronise(&[], &mut grads, share.rank as f64 + 0.5).unwrap())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(results, vec![(Transport::Ring, 4.5); 3]);
    }
}
