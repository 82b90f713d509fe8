//! One model being trained: network, optimizer and data loader together, with the three
//! things the training loop and AutoLRS need from them — take one optimizer step at a
//! given learning rate, evaluate on the validation split, and snapshot / restore the
//! whole trainable state.
//!
//! QSync seam (gradient synchronisation): `step` computes the gradients of this replica's
//! share of the global batch, hands them to a [`GradientSync`], then applies the
//! optimizer. Data-parallel training (`collective::RingSync`) replaces `LocalGradients`
//! with an all-reduce; nothing else changes.

use std::sync::Arc;
use std::time::Duration;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result, Tensor, Var};

use super::data::{Examples, Prepared, Targets, TaskKind};
use super::loader::{Loader, LoaderPosition};
use super::model::Network;
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
    /// Transfers and sums.
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
        Ok(Trainer { network, optimizer, loader, data, kind, device, sync: Box::new(LocalGradients) })
    }

    /// Trains as one replica of a data-parallel gang: `sync` picks this replica's share of
    /// each global batch and combines the replicas' gradients.
    pub fn with_sync(self, sync: Box<dyn GradientSync>) -> Trainer {
        Trainer { sync, ..self }
    }

    pub fn share(&self) -> Share {
        self.sync.share()
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
        let outputs = self.network.forward(&self.data.train, rows, true)?;
        let mut loss = self.loss(&outputs, &self.data.train, rows)?;
        if share.world > 1 {
            // The mean over this share, weighted so the replicas' sum is the global mean.
            loss = (loss * (rows.len() as f64 / batch.len() as f64))?;
        }
        let mut grads = loss.backward()?;
        let loss = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let loss = self.sync.synchronise(self.network.parameters(), &mut grads, loss)?;
        self.optimizer.step(&grads, lr)?;
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
