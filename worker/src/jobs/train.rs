//! Train: fetch the dataset (and the model to fine-tune), resume from the job's latest
//! checkpoint when there is one, and run the training session on a blocking thread while
//! this task streams what it produces to the server: step and eval metrics in batches,
//! AutoLRS stage records, checkpoints, log lines. Metrics up to a checkpoint's step are
//! sent before the checkpoint itself, so a resumed run re-reports (and so overwrites)
//! only steps after the checkpoint. Dropping this task (lease revoked, job cancelled)
//! stops the training thread at its next step.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::Device;
use tessera_api::jobs::JobState;
use tessera_api::train::{OptimizerSpec, TaskType, TrainJob, TrainModel, TrainingMetrics};
use tokio::sync::mpsc;

use super::{prefetch, JobContext, JobError};
use crate::train::data::{self, TaskColumns, TaskKind};
use crate::train::model::bert::BertClassifier;
use crate::train::model::mlp::Mlp;
use crate::train::model::Network;
use crate::train::optim::OptimizerKind;
use crate::train::policy;
use crate::train::session::{Event, Limits, Session};
use crate::train::trainer::{Evaluation, Trainer};

/// Metric rows are sent when this many are waiting, or after `FLUSH_EVERY`.
const FLUSH_ROWS: usize = 500;
const FLUSH_EVERY: Duration = Duration::from_secs(1);

/// Sets the flag when dropped, which the training thread polls every step.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

fn task_columns(spec: &TrainJob) -> TaskColumns {
    TaskColumns {
        kind: match spec.task.kind {
            TaskType::Classification => TaskKind::Classification,
            TaskType::Regression => TaskKind::Regression,
        },
        label: spec.task.label_column.clone(),
        features: (!spec.task.feature_columns.is_empty()).then(|| spec.task.feature_columns.clone()),
        text: spec.task.text_column.clone(),
        validation_split: spec.task.validation_split,
    }
}

pub fn optimizer_kind(spec: &OptimizerSpec) -> OptimizerKind {
    match *spec {
        OptimizerSpec::Sgd { momentum, nesterov, weight_decay } => {
            OptimizerKind::Sgd { momentum, nesterov, weight_decay }
        }
        OptimizerSpec::Adamw { betas, eps, weight_decay } => {
            OptimizerKind::AdamW { beta1: betas.0, beta2: betas.1, eps, weight_decay }
        }
    }
}

fn summary(step: u64, evaluation: &Evaluation) -> String {
    let metric = match (evaluation.accuracy, evaluation.rmse) {
        (Some(accuracy), _) => format!(", accuracy {accuracy:.4}"),
        (_, Some(rmse)) => format!(", rmse {rmse:.4}"),
        _ => String::new(),
    };
    format!("Trained {step} steps: val_loss {:.4}{metric}.", evaluation.val_loss)
}

/// Downloads the latest checkpoint's files, if the job has one.
async fn latest_checkpoint(context: &JobContext) -> Result<Option<(u64, HashMap<String, Vec<u8>>)>, JobError> {
    let Some(checkpoint) = context.client.latest_checkpoint(context.job).await? else { return Ok(None) };
    let mut files = HashMap::new();
    for file in &checkpoint.files {
        let bytes = context.client.checkpoint_file(context.job, checkpoint.step, &file.name).await?;
        files.insert(file.name.clone(), bytes);
    }
    Ok(Some((checkpoint.step, files)))
}

/// Sends what the session produced, batching metric rows.
struct Uplink<'a> {
    context: &'a JobContext,
    pending: TrainingMetrics,
    last_flush: Instant,
}

impl Uplink<'_> {
    async fn flush(&mut self) -> Result<(), JobError> {
        if !self.pending.steps.is_empty() || !self.pending.evals.is_empty() {
            let batch = std::mem::take(&mut self.pending);
            self.context.client.training_metrics(self.context.job, &batch).await?;
        }
        self.last_flush = Instant::now();
        Ok(())
    }

    async fn handle(&mut self, event: Event) -> Result<(), JobError> {
        match event {
            Event::Step(row) => self.pending.steps.push(row),
            Event::Eval(row) => {
                let line = row.values.iter().map(|(k, v)| format!("{k} {v:.4}")).collect::<Vec<_>>().join(", ");
                self.context.log(format!("step {}: {line}", row.step)).await?;
                self.pending.evals.push(row);
            }
            Event::Stage(record) => {
                self.flush().await?;
                self.context.client.lr_stage(self.context.job, &record).await?;
            }
            Event::Checkpoint(checkpoint) => {
                self.flush().await?;
                let size: usize = checkpoint.files.iter().map(|(_, b)| b.len()).sum();
                let files = checkpoint.files.into_iter().map(|(n, b)| (n.to_string(), b)).collect();
                self.context.client.upload_checkpoint(self.context.job, checkpoint.step, files).await?;
                self.context.log(format!("checkpoint at step {} uploaded ({size} bytes)", checkpoint.step)).await?;
            }
        }
        if self.pending.steps.len() + self.pending.evals.len() >= FLUSH_ROWS || self.last_flush.elapsed() >= FLUSH_EVERY
        {
            self.flush().await?;
        }
        Ok(())
    }
}

/// Where training runs: the first visible GPU in a cuda build that finds one, else the CPU.
fn training_device() -> Device {
    #[cfg(feature = "cuda")]
    if let Ok(device) = Device::new_cuda(0) {
        return device;
    }
    Device::Cpu
}

pub async fn run(context: &JobContext, spec: TrainJob) -> Result<String, JobError> {
    context.client.status(context.job, JobState::Running, None, None).await?;
    let bytes = context.client.dataset(spec.dataset.id, &spec.dataset.digest).await?;
    context
        .log(format!("dataset {} fetched ({} bytes, {} rows)", spec.dataset.id, bytes.len(), spec.dataset.rows))
        .await?;
    let model_folder = match &spec.model {
        TrainModel::Registered { id, .. } => Some(prefetch::fetch(context, *id).await?.0),
        TrainModel::Mlp { .. } => None,
    };
    let resume = latest_checkpoint(context).await?;
    if let Some((step, _)) = &resume {
        context.log(format!("resuming from the checkpoint at step {step}")).await?;
    }

    let device = training_device();
    context.log(format!("training on {}", if device.is_cuda() { "CUDA device 0" } else { "the CPU" })).await?;
    let columns = task_columns(&spec);
    let setup_spec = spec.clone();
    let session = tokio::task::spawn_blocking(move || -> Result<Session, JobError> {
        let table = data::Table::parse(&bytes)?;
        let prepared = Arc::new(data::prepare(&table, &columns, setup_spec.seed)?);
        let network: Box<dyn Network> = match (&setup_spec.model, &model_folder) {
            (TrainModel::Mlp { hidden }, _) => {
                let hidden: Vec<usize> = hidden.iter().map(|&h| h as usize).collect();
                let outputs = if columns.kind == TaskKind::Classification { prepared.classes.len() } else { 1 };
                Box::new(Mlp::new(prepared.input_dim(), &hidden, outputs, setup_spec.seed, &device)?)
            }
            (TrainModel::Registered { .. }, folder) => {
                let folder = folder.as_ref().expect("the model folder is fetched above");
                Box::new(BertClassifier::load(folder, &prepared, columns.kind, setup_spec.seed, &device)?)
            }
        };
        let trainer = Trainer::new(
            network,
            optimizer_kind(&setup_spec.optimizer),
            prepared,
            columns.kind,
            setup_spec.batch_size as usize,
            setup_spec.seed,
            device.clone(),
        )?;
        let policy = policy::build(&setup_spec.lr_schedule, setup_spec.max_steps, setup_spec.seed);
        let limits = Limits {
            max_steps: setup_spec.max_steps,
            eval_every: setup_spec.eval_every,
            checkpoint_every: setup_spec.checkpoint_every,
        };
        let mut session = Session::new(trainer, policy, limits);
        if let Some((_, files)) = &resume {
            session.resume(files, &device)?;
        }
        Ok(session)
    })
    .await
    .map_err(|e| JobError::Train(format!("the set-up thread panicked: {e}")))??;
    context.log(format!("training from step {} to {}", session.step(), spec.max_steps)).await?;

    let cancel = Arc::new(AtomicBool::new(false));
    let _cancel_on_drop = CancelOnDrop(cancel.clone());
    let (sender, mut events) = mpsc::unbounded_channel();
    let thread_cancel = cancel.clone();
    let training = tokio::task::spawn_blocking(move || {
        let mut session = session;
        let outcome = session.run(&thread_cancel, &mut |event| {
            let _ = sender.send(event);
        });
        (session.step(), outcome)
    });
    let mut uplink = Uplink { context, pending: TrainingMetrics::default(), last_flush: Instant::now() };
    let mut tick = tokio::time::interval(FLUSH_EVERY);
    loop {
        tokio::select! {
            event = events.recv() => match event {
                Some(event) => uplink.handle(event).await?,
                None => break,
            },
            _ = tick.tick() => uplink.flush().await?,
        }
    }
    uplink.flush().await?;
    let (step, outcome) = training.await.map_err(|e| JobError::Train(format!("the training thread panicked: {e}")))?;
    let evaluation = outcome?;
    Ok(summary(step, &evaluation))
}
