//! NCCL all-reduce for a gang whose ranks all train on CUDA GPUs (the `nccl` feature): the
//! gradients are summed GPU to GPU and never staged through the host. The TCP ring stays
//! beside it and carries what is small: NCCL's unique id from rank 0, the step's loss (whose
//! ring all-reduce is also the barrier that finds a dead rank before NCCL would wait on it
//! forever) and rank 0's evaluation. NCCL's own waits are bounded by polling, so a rank that
//! dies inside a reduction fails the step instead of hanging the gang.

use std::ffi::{c_char, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use candle_core::backprop::GradStore;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut};
use candle_core::cuda_backend::cudarc::nccl::{result, sys};
use candle_core::cuda_backend::WrapErr;
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Device, Result, Storage, Tensor, Var};

use super::ring::Ring;
use super::{decode, encode, RingFault, SyncError};
use crate::train::trainer::{Evaluation, GradientSync, Share, SyncTiming};

/// How often a wait on NCCL looks at the stream and at NCCL's asynchronous error.
const POLL: Duration = Duration::from_micros(200);

/// One rank's NCCL communicator; dropping it aborts any reduction still in flight (a rank
/// that leaves after a failure must not block in NCCL).
struct Communicator(sys::ncclComm_t);

// SAFETY: a communicator may be used from any one thread at a time, which `&mut self` on
// every use (and `Send` without `Sync`) guarantees.
unsafe impl Send for Communicator {}

impl Drop for Communicator {
    fn drop(&mut self) {
        // SAFETY: the communicator was initialised and is not used after this.
        let _ = unsafe { result::comm_abort(self.0) };
    }
}

impl Communicator {
    /// NCCL's asynchronous error (a peer gone, a network failure), if any.
    fn check(&self) -> std::result::Result<(), String> {
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: `self.0` is a live communicator and `state` a valid out-pointer.
        let call = unsafe { sys::ncclCommGetAsyncError(self.0, &mut state) };
        match (call, state) {
            (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress) => {
                Ok(())
            }
            (sys::ncclResult_t::ncclSuccess, failed) => Err(format!("NCCL reported {failed:?}")),
            (failed, _) => Err(format!("ncclCommGetAsyncError failed: {failed:?}")),
        }
    }
}

/// Data-parallel gradient synchronisation with NCCL, for ranks that are all CUDA devices.
pub struct NcclSync {
    ring: Ring,
    comm: Communicator,
    device: CudaDevice,
    timeout: Duration,
    timing: Option<SyncTiming>,
    fault: RingFault,
    /// This rank's preemption flag, and whether any rank's was set in the last step.
    stop_request: Arc<AtomicBool>,
    stop_agreed: bool,
}

impl NcclSync {
    /// Joins the gang's NCCL communicator on `device`: rank 0 makes the unique id and the
    /// ring carries it to the others. Every rank must call this (the ring's broadcast and
    /// NCCL's initialisation are collective); `timeout` bounds the initialisation and every
    /// later reduction.
    pub fn new(mut ring: Ring, device: &Device, timeout: Duration) -> std::result::Result<NcclSync, SyncError> {
        let nccl = |e: String| SyncError::Nccl(e);
        let device = device.as_cuda_device().map_err(|e| nccl(e.to_string()))?.clone();
        let mine = if ring.rank() == 0 {
            let id = result::get_uniqueid().map_err(|e| nccl(format!("cannot make the unique id: {e:?}")))?;
            id.internal.iter().map(|c| *c as u8).collect()
        } else {
            Vec::new()
        };
        let id = ring.broadcast(mine)?;
        let Ok(internal) = <[u8; 128]>::try_from(id.as_slice()) else {
            return Err(nccl(format!("rank 0 sent a unique id of {} bytes, not 128", id.len())));
        };
        let id = sys::ncclUniqueId { internal: internal.map(|b| b as c_char) };
        let (rank, world) = (ring.rank() as i32, ring.world() as i32);
        // ncclCommInitRank blocks until every rank has joined, with no time-out of its own: it
        // runs on a thread of its own, and a rank that never joins leaves this one to give up
        // after `timeout` (the stuck thread is abandoned; the process is the job's to end).
        let (tx, rx) = mpsc::channel();
        let context = device.cuda_stream().context().clone();
        std::thread::Builder::new()
            .name(format!("nccl-init-{rank}"))
            .spawn(move || {
                let joined = context.bind_to_thread().map_err(|e| format!("{e:?}")).and_then(|()| {
                    let mut comm = std::mem::MaybeUninit::uninit();
                    // SAFETY: `comm` is a valid out-pointer and the id the gang's own.
                    unsafe { result::comm_init_rank(comm.as_mut_ptr(), world, id, rank) }
                        .map(|_| Communicator(unsafe { comm.assume_init() }))
                        .map_err(|e| format!("{e:?}"))
                });
                let _ = tx.send(joined);
            })
            .map_err(|e| nccl(format!("cannot start the initialisation thread: {e}")))?;
        let comm = match rx.recv_timeout(timeout) {
            Ok(Ok(comm)) => comm,
            Ok(Err(e)) => return Err(nccl(format!("ncclCommInitRank failed on rank {rank} of {world}: {e}"))),
            Err(_) => {
                return Err(SyncError::NcclTimeout { what: "joining the communicator", seconds: timeout.as_secs() })
            }
        };
        Ok(NcclSync {
            ring,
            comm,
            device,
            timeout,
            timing: None,
            fault: RingFault::default(),
            stop_request: Arc::default(),
            stop_agreed: false,
        })
    }

    /// The same sync with `stop_request` as this rank's preemption flag: the ranks agree in
    /// each step's loss reduction whether to stop after that step.
    pub fn with_stop_request(self, stop_request: Arc<AtomicBool>) -> NcclSync {
        NcclSync { stop_request, ..self }
    }

    /// Set once a reduction fails (a rank died or went silent).
    pub fn fault(&self) -> RingFault {
        self.fault.clone()
    }

    fn failed(&self, error: SyncError) -> candle_core::Error {
        let message = error.to_string();
        let _ = self.fault.set(message.clone());
        candle_core::Error::Msg(message)
    }

    /// Sums `flat` (f32, contiguous, on this rank's GPU) over the ranks into a new tensor,
    /// and waits for it, bounded by the time-out.
    fn all_reduce(&mut self, flat: &Tensor) -> std::result::Result<Tensor, SyncError> {
        let n = flat.elem_count();
        let stream = self.device.cuda_stream();
        let cuda = |e: candle_core::Error| SyncError::Nccl(e.to_string());
        // SAFETY: NCCL writes every element of the receive buffer.
        let mut summed = unsafe { self.device.alloc::<f32>(n) }.map_err(cuda)?;
        {
            let (storage, layout) = flat.storage_and_layout();
            let (Storage::Cuda(storage), Some((start, end))) = (&*storage, layout.contiguous_offsets()) else {
                return Err(SyncError::Nccl("the gradients are not one contiguous CUDA buffer".into()));
            };
            let send = storage.as_cuda_slice::<f32>().map_err(cuda)?.slice(start..end);
            let (send, _read) = send.device_ptr(&stream);
            let (receive, _write) = summed.device_ptr_mut(&stream);
            // SAFETY: both buffers hold `n` f32 on this communicator's GPU, and the call is
            // queued on candle's stream behind the backward pass that wrote the gradients.
            unsafe {
                result::all_reduce(
                    send as *const c_void,
                    receive as *mut c_void,
                    n,
                    sys::ncclDataType_t::ncclFloat32,
                    sys::ncclRedOp_t::ncclSum,
                    self.comm.0,
                    stream.cu_stream() as sys::cudaStream_t,
                )
            }
            .map_err(|e| SyncError::Nccl(format!("ncclAllReduce: {e:?}")))?;
        }
        let done = stream.record_event(None).w().map_err(cuda)?;
        let deadline = Instant::now() + self.timeout;
        while !done.try_is_complete().w().map_err(cuda)? {
            self.comm.check().map_err(SyncError::Nccl)?;
            if Instant::now() >= deadline {
                return Err(SyncError::NcclTimeout { what: "an all-reduce", seconds: self.timeout.as_secs() });
            }
            std::thread::sleep(POLL);
        }
        let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(summed, self.device.clone()));
        Ok(Tensor::from_storage(storage, n, BackpropOp::none(), false))
    }
}

impl GradientSync for NcclSync {
    fn share(&self) -> Share {
        Share { rank: self.ring.rank(), world: self.ring.world() }
    }

    fn synchronise(&mut self, parameters: &[(String, Var)], grads: &mut GradStore, loss: f64) -> Result<f64> {
        let started = Instant::now();
        let device = Device::Cuda(self.device.clone());
        let mut parts = Vec::with_capacity(parameters.len());
        for (_, var) in parameters {
            parts.push(match grads.get(var.as_tensor()) {
                Some(grad) => grad.to_dtype(DType::F32)?.to_device(&device)?.flatten_all()?,
                // Unused in this step's forward pass on every rank alike: a zero gradient.
                None => Tensor::zeros(var.elem_count(), DType::F32, &device)?,
            });
        }
        let flat = Tensor::cat(&parts, 0)?;
        // The loss and the stop requests over the ring first: every rank alive and at this
        // step, or an error now.
        let stop = if self.stop_request.load(Ordering::Relaxed) { 1.0 } else { 0.0 };
        let mut summed_loss = [loss as f32, stop];
        let ring = self.ring.all_reduce(&mut summed_loss).map_err(|e| self.failed(e.into()))?;
        self.stop_agreed = summed_loss[1] > 0.5;
        let summed = self.all_reduce(&flat).map_err(|e| self.failed(e))?;
        let mut offset = 0;
        for (_, var) in parameters {
            let n = var.elem_count();
            let grad = summed.narrow(0, offset, n)?.reshape(var.shape())?;
            grads.insert(var.as_tensor(), grad.to_device(var.device())?.to_dtype(var.dtype())?);
            offset += n;
        }
        // As the host ring counts it: everything but the waiting, the gradients' staging
        // into one buffer and back included.
        self.timing = Some(SyncTiming { wait: ring.wait, reduce: started.elapsed() - ring.wait });
        Ok(summed_loss[0] as f64)
    }

    fn evaluation(&mut self, evaluate: &mut dyn FnMut() -> Result<Evaluation>) -> Result<Evaluation> {
        let mine = if self.ring.rank() == 0 { encode(&evaluate()?) } else { Vec::new() };
        let agreed = self.ring.broadcast(mine).map_err(|e| self.failed(e.into()))?;
        decode(&agreed).ok_or_else(|| candle_core::Error::Msg("rank 0 sent an evaluation that does not decode".into()))
    }

    fn last_timing(&self) -> Option<SyncTiming> {
        self.timing
    }

    fn agreed_stop(&self, _requested: bool) -> bool {
        self.stop_agreed
    }

    // Precision planning's small exchanges stay on the TCP ring, as for the loss.
    fn all_gather(&mut self, bytes: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        self.ring.all_gather(bytes).map_err(|e| self.failed(e.into()))
    }

    fn broadcast(&mut self, bytes: Vec<u8>) -> Result<Vec<u8>> {
        self.ring.broadcast(bytes).map_err(|e| self.failed(e.into()))
    }
}
