//! One model being trained: network, optimizer and data loader together, with the three
//! things the training loop and AutoLRS need from them — take one optimizer step at a
//! given learning rate, evaluate on the validation split, and snapshot / restore the
//! whole trainable state.
//!
//! QSync seam (gradient synchronisation): `step` computes the gradients of this replica's
//! share of the global batch, hands them to a [`GradientSync`], then applies the
//! optimizer. Data-parallel training (`collective::RingSync`) replaces `LocalGradients`
//! with an all-reduce; nothing else changes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result, Tensor, Var};

use super::data::{Examples, Prepared, Targets, TaskKind};
use super::loader::{Loader, LoaderPosition};
use super::model::{Network, OpTrace};
use super::optim::{Optimizer, OptimizerKind, OptimizerState};

/// The rows of every global batch one replica computes: a contiguous share, the same
/// share on every step, so the replicas together cover the batch exactly once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Share {
    pub rank: usize,
    pub world: usize,
}

impl Share {
    pub const WHOLE: Share = Share { rank: 0, world: 1 };

    pub fn of<'a>(&self, rows: &'a [usize]) -> &'a [usize] {
        let n = rows.len();
        &rows[self.rank * n / self.world..(self.rank + 1) * n / self.world]
    }

    /// Rank 0 evaluates for everyone and writes the checkpoints.
    pub fn is_leader(&self) -> bool {
        self.rank == 0
    }
}

/// How one synchronous step's all-reduce spent its time.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SyncTiming {
    /// Waiting for the slowest replica to reach the all-reduce.
    pub wait: Duration,
    /// Everything else the sync took: staging the gradients, transfers and sums.
    pub reduce: Duration,
}

/// Combines the replicas of one synchronous step.
pub trait GradientSync: Send {
    /// This replica's rows of each global batch.
    fn share(&self) -> Share {
        Share::WHOLE
    }

    /// Sums `grads` and `loss` over the replicas, in place; each replica's loss (and so
    /// its gradients) is already weighted by its share of the global batch, so the sums
    /// are the global batch's. Returns the summed loss.
    fn synchronise(&mut self, parameters: &[(String, Var)], grads: &mut GradStore, loss: f64) -> Result<f64>;

    /// One evaluation every replica agrees on, from running `evaluate` where the sync
    /// chooses (the leader, for a data-parallel gang).
    fn evaluation(&mut self, evaluate: &mut dyn FnMut() -> Result<Evaluation>) -> Result<Evaluation> {
        evaluate()
    }

    /// The last `synchronise`'s timing, when it communicated.
    fn last_timing(&self) -> Option<SyncTiming> {
        None
    }

    /// Whether to stop after the step just taken (a preemption), given whether this
    /// replica was asked to. Replicas that communicate answer what they agreed in that
    /// step's `synchronise` (any one asked), so a gang stops at one step together.
    fn agreed_stop(&self, requested: bool) -> bool {
        requested
    }

    /// Every replica's `bytes`, by rank (precision planning gathers the ranks' profiles).
    fn all_gather(&mut self, bytes: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        Ok(vec![bytes])
    }

    /// Rank 0's `bytes` on every replica (the others pass an empty vector).
    fn broadcast(&mut self, bytes: Vec<u8>) -> Result<Vec<u8>> {
        Ok(bytes)
    }
}

/// How the last step spent its time on this replica.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepPhases {
    /// Forward, loss and backward (what a slower device takes longer at).
    pub compute: Duration,
    /// The optimizer's update after the all-reduce.
    pub optimizer: Duration,
}

/// Test-only: makes this replica's compute `factor` times slower by sleeping `factor − 1`
/// times as long as each piece of compute took, so one host can stand in for unequal
/// devices in tests of precision planning (its operators, profiled, slow down alike).
/// Clones share the factor, so a test can slow a rank down mid-run ([`Slowdown::set`]), as
/// another tenant would. Never used for a reported speed-up.
#[derive(Debug, Clone, Default)]
pub struct Slowdown(Arc<AtomicU64>);

impl Slowdown {
    /// `factor` ≥ 1; anything else (NaN, below 1) is no slowdown.
    pub fn new(factor: f64) -> Slowdown {
        let slowdown = Slowdown::default();
        slowdown.set(factor);
        slowdown
    }

    pub fn none() -> Slowdown {
        Slowdown::new(1.0)
    }

    pub fn factor(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed)).max(1.0)
    }

    /// Changes the factor for every clone.
    pub fn set(&self, factor: f64) {
        self.0.store(if factor >= 1.0 { factor } else { 1.0 }.to_bits(), Ordering::Relaxed);
    }

    /// Sleeps as long as the slowdown adds to compute that took `took`.
    pub fn pause(&self, took: Duration) {
        let factor = self.factor();
        if factor > 1.0 {
            std::thread::sleep(took.mul_f64(factor - 1.0));
        }
    }
}

/// One device, one replica: its gradients are the step's gradients.
pub struct LocalGradients;

impl GradientSync for LocalGradients {
    fn synchronise(&mut self, _parameters: &[(String, Var)], _grads: &mut GradStore, loss: f64) -> Result<f64> {
        Ok(loss)
    }
}

/// Rows per forward pass when evaluating.
const EVAL_BATCH: usize = 512;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Evaluation {
    pub val_loss: f64,
    /// Classification.
    pub accuracy: Option<f64>,
    /// Regression.
    pub rmse: Option<f64>,
}

/// The trainable state at one moment: parameter values, optimizer moments, loader position.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub parameters: Vec<Tensor>,
    pub optimizer: OptimizerState,
    pub loader: LoaderPosition,
}

pub struct Trainer {
    network: Box<dyn Network>,
    optimizer: Optimizer,
    loader: Loader,
    data: Arc<Prepared>,
    kind: TaskKind,
    device: Device,
    sync: Box<dyn GradientSync>,
    slowdown: Slowdown,
    /// This replica's rows of the last global batch, and how its step spent its time.
    last_rows: Vec<usize>,
    last_phases: Option<StepPhases>,
}

impl Trainer {
    pub fn new(
        network: Box<dyn Network>,
        optimizer: OptimizerKind,
        data: Arc<Prepared>,
        kind: TaskKind,
        batch_size: usize,
        seed: u64,
        device: Device,
    ) -> Result<Trainer> {
        let optimizer = Optimizer::new(optimizer, network.parameters())?;
        let loader = Loader::new(data.train.len(), batch_size, seed);
        Ok(Trainer {
            network,
            optimizer,
            loader,
            data,
            kind,
            device,
            sync: Box::new(LocalGradients),
            slowdown: Slowdown::none(),
            last_rows: Vec::new(),
            last_phases: None,
        })
    }

    /// Trains as one replica of a data-parallel gang: `sync` picks this replica's share of
    /// each global batch and combines the replicas' gradients.
    pub fn with_sync(self, sync: Box<dyn GradientSync>) -> Trainer {
        Trainer { sync, ..self }
    }

    /// Test-only: this replica computes `slowdown` times slower ([`Slowdown`]).
    pub fn with_slowdown(self, slowdown: Slowdown) -> Trainer {
        Trainer { slowdown, ..self }
    }

    pub fn slowdown(&self) -> Slowdown {
        self.slowdown.clone()
    }

    pub fn share(&self) -> Share {
        self.sync.share()
    }

    /// How the last step spent its time.
    pub fn last_phases(&self) -> Option<StepPhases> {
        self.last_phases
    }

    /// The gradient sync, for what else the replicas exchange (precision planning).
    pub fn sync_mut(&mut self) -> &mut dyn GradientSync {
        self.sync.as_mut()
    }

    pub fn network_mut(&mut self) -> &mut dyn Network {
        self.network.as_mut()
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// One forward of this replica's rows of the last batch that records each operator a
    /// precision plan may name, and the gradients of its loss (nothing is updated): the job's
    /// real shapes and tensors, which precision planning profiles and reads.
    pub fn trace_last_batch(&self) -> Result<(Vec<OpTrace>, GradStore)> {
        let rows = &self.last_rows;
        if rows.is_empty() {
            candle_core::bail!("no step has been taken to trace");
        }
        let (outputs, traces) = self.network.forward_traced(&self.data.train, rows)?;
        let grads = self.loss(&outputs, &self.data.train, rows)?.backward()?;
        Ok((traces, grads))
    }

    /// The work of this replica's share of the last step's batch ([`Network::batch_work`]).
    pub fn last_batch_work(&self) -> Result<usize> {
        self.network.batch_work(&self.data.train, &self.last_rows)
    }

    pub fn last_timing(&self) -> Option<SyncTiming> {
        self.sync.last_timing()
    }

    /// See [`GradientSync::agreed_stop`].
    pub fn agreed_stop(&self, requested: bool) -> bool {
        self.sync.agreed_stop(requested)
    }

    pub fn batch_size(&self) -> usize {
        self.loader.batch_size()
    }

    pub fn network(&self) -> &dyn Network {
        self.network.as_ref()
    }

    pub fn optimizer(&self) -> &Optimizer {
        &self.optimizer
    }

    fn loss(&self, outputs: &Tensor, examples: &Examples, rows: &[usize]) -> Result<Tensor> {
        match (&examples.targets, self.kind) {
            (Targets::Classes(classes), TaskKind::Classification) => {
                let target: Vec<u32> = rows.iter().map(|&r| classes[r]).collect();
                candle_nn::loss::cross_entropy(outputs, &Tensor::new(target, &self.device)?)
            }
            (Targets::Values(values), TaskKind::Regression) => {
                let target: Vec<f32> = rows.iter().map(|&r| values[r]).collect();
                candle_nn::loss::mse(&outputs.squeeze(1)?, &Tensor::new(target, &self.device)?)
            }
            _ => candle_core::bail!("the targets do not match the task"),
        }
    }

    /// One optimizer step on the next global batch at learning rate `lr`; returns the
    /// batch loss before the update.
    pub fn step(&mut self, lr: f64) -> Result<f64> {
        let batch = self.loader.next_batch();
        let share = self.sync.share();
        let rows = share.of(&batch);
        if rows.is_empty() {
            // The server refuses such a job; a gang grown past its data still gets here.
            candle_core::bail!(
                "rank {} of {} has no row of the {}-row batch: the training split has fewer rows than the ranks",
                share.rank,
                share.world,
                batch.len()
            );
        }
        let started = Instant::now();
        let outputs = self.network.forward(&self.data.train, rows, true)?;
        let mut loss = self.loss(&outputs, &self.data.train, rows)?;
        if share.world > 1 {
            // The mean over this share, weighted so the replicas' sum is the global mean.
            loss = (loss * (rows.len() as f64 / batch.len() as f64))?;
        }
        let mut grads = loss.backward()?;
        let loss = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        self.slowdown.pause(started.elapsed());
        let compute = started.elapsed();
        self.last_rows = rows.to_vec();
        let loss = self.sync.synchronise(self.network.parameters(), &mut grads, loss)?;
        let optimizing = Instant::now();
        self.optimizer.step(&grads, lr)?;
        self.last_phases = Some(StepPhases { compute, optimizer: optimizing.elapsed() });
        Ok(loss)
    }

    /// Evaluates on the validation split; in a gang, the leader evaluates and the others
    /// receive its result, so every replica's LR policy hears the same loss.
    pub fn evaluate(&mut self) -> Result<Evaluation> {
        let mut sync = std::mem::replace(&mut self.sync, Box::new(LocalGradients));
        let evaluation = sync.evaluation(&mut || self.evaluate_here());
        self.sync = sync;
        evaluation
    }

    fn evaluate_here(&self) -> Result<Evaluation> {
        let examples = &self.data.validation;
        let rows: Vec<usize> = (0..examples.len()).collect();
        let (mut loss_sum, mut correct) = (0.0, 0usize);
        for chunk in rows.chunks(EVAL_BATCH) {
            let outputs = self.network.forward(examples, chunk, false)?;
            let loss = self.loss(&outputs, examples, chunk)?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            loss_sum += loss * chunk.len() as f64;
            if let Targets::Classes(classes) = &examples.targets {
                let predicted: Vec<u32> = outputs.argmax(1)?.to_vec1()?;
                correct += chunk.iter().zip(predicted).filter(|&(&r, p)| classes[r] == p).count();
            }
        }
        let val_loss = loss_sum / rows.len().max(1) as f64;
        Ok(match self.kind {
            TaskKind::Classification => {
                Evaluation { val_loss, accuracy: Some(correct as f64 / rows.len().max(1) as f64), rmse: None }
            }
            TaskKind::Regression => Evaluation { val_loss, accuracy: None, rmse: Some(val_loss.sqrt()) },
        })
    }

    pub fn snapshot(&self) -> Result<Snapshot> {
        Ok(Snapshot {
            parameters: self
                .network
                .parameters()
                .iter()
                .map(|(_, var)| var.as_tensor().copy())
                .collect::<Result<_>>()?,
            optimizer: self.optimizer.state().clone(),
            loader: self.loader.position().clone(),
        })
    }

    pub fn restore(&mut self, snapshot: &Snapshot) -> Result<()> {
        let parameters = self.network.parameters();
        if snapshot.parameters.len() != parameters.len() {
            candle_core::bail!(
                "snapshot has {} parameters, the network {}",
                snapshot.parameters.len(),
                parameters.len()
            );
        }
        for ((_, var), value) in parameters.iter().zip(&snapshot.parameters) {
            var.set(value)?;
        }
        self.optimizer.restore(snapshot.optimizer.clone())?;
        self.loader = Loader::resume(self.data.train.len(), self.loader.batch_size(), snapshot.loader.clone());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::Share;

    #[test]
    fn the_shares_of_a_gang_cover_every_row_of_a_batch_once_in_order() {
        for (world, rows) in [(2, 64), (3, 64), (4, 7), (5, 5)] {
            let batch: Vec<usize> = (100..100 + rows).collect();
            let covered: Vec<usize> = (0..world).flat_map(|rank| Share { rank, world }.of(&batch).to_vec()).collect();
            assert_eq!(covered, batch, "{world} ranks over {rows} rows");
            let sizes: Vec<usize> = (0..world).map(|rank| Share { rank, world }.of(&batch).len()).collect();
            assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1, "{sizes:?}");
        }
        assert_eq!(Share::WHOLE.of(&[3, 1, 2]), [3, 1, 2]);
    }
}
