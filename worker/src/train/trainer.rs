//! One model being trained: network, optimizer and data loader together, with the three
//! things the training loop and AutoLRS need from them — take one optimizer step at a
//! given learning rate, evaluate on the validation split, and snapshot / restore the
//! whole trainable state.
//!
//! QSync seam (gradient synchronisation): `step` computes the local gradients, hands them
//! to a [`GradientSync`], then applies the optimizer. Data-parallel training across
//! devices replaces `LocalGradients` with an all-reduce; nothing else changes.

use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result, Tensor, Var};

use super::data::{Examples, Prepared, Targets, TaskKind};
use super::loader::{Loader, LoaderPosition};
use super::model::Network;
use super::optim::{Optimizer, OptimizerKind, OptimizerState};

/// Combines the gradients of the replicas of one synchronous step.
pub trait GradientSync: Send {
    fn synchronise(&mut self, parameters: &[(String, Var)], grads: &mut GradStore) -> Result<()>;
}

/// One device, one replica: its gradients are the step's gradients.
pub struct LocalGradients;

impl GradientSync for LocalGradients {
    fn synchronise(&mut self, _parameters: &[(String, Var)], _grads: &mut GradStore) -> Result<()> {
        Ok(())
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

    /// One optimizer step on the next batch at learning rate `lr`; returns the batch loss
    /// before the update.
    pub fn step(&mut self, lr: f64) -> Result<f64> {
        let rows = self.loader.next_batch();
        let outputs = self.network.forward(&self.data.train, &rows, true)?;
        let loss = self.loss(&outputs, &self.data.train, &rows)?;
        let mut grads = loss.backward()?;
        self.sync.synchronise(self.network.parameters(), &mut grads)?;
        self.optimizer.step(&grads, lr)?;
        loss.to_dtype(DType::F64)?.to_scalar::<f64>()
    }

    pub fn evaluate(&self) -> Result<Evaluation> {
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
