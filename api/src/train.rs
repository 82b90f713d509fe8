//! Training jobs: the spec a user submits, the resolved spec a worker receives, and the
//! wire types of the training side of the worker protocol (metrics, AutoLRS stage
//! records, checkpoints).
//!
//! The user's body (`POST /api/v1/jobs`, one of the shapes of [`crate::jobs::CreateJob`])
//! is a [`TrainSpec`]. The server checks it, resolves the model and dataset names to ids,
//! and queues a [`crate::jobs::JobSpec::Train`] holding a [`TrainJob`].

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

use crate::datasets::{DatasetColumn, DatasetFormat};
use crate::elastic::{Resources, ResourcesSpec};
use crate::parallel::{ParallelSpec, RankStep};

/// A spec mistake, named by its JSON path (`task.validation_split`), so the 422 says
/// exactly which field to change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecError {
    pub field: String,
    pub message: String,
}

impl SpecError {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> SpecError {
        SpecError { field: field.into(), message: message.into() }
    }
}

impl std::fmt::Display for SpecError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

impl std::error::Error for SpecError {}

/// `POST /api/v1/jobs` for a training job (issue 6's body): a name, the run's fields at
/// the top level, and optionally how many lease expiries the job survives. Unknown
/// fields are refused, so a misspelt one is named in the 422 instead of ignored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TrainSpec {
    /// 1 to 200 characters.
    pub name: String,
    /// How many times an expired lease may requeue the job before it fails (default 3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_attempts: Option<u32>,
    pub model: ModelChoice,
    /// Dataset id, or the name of one of your datasets.
    pub dataset: String,
    pub task: TaskSpec,
    pub optimizer: OptimizerSpec,
    pub batch_size: u32,
    pub max_steps: u64,
    pub eval_every: u64,
    pub checkpoint_every: u64,
    pub lr_schedule: LrSchedule,
    pub seed: u64,
    /// Data-parallel ranks (issue 12); left out, the job runs on one device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel: Option<ParallelSpec>,
    /// Elastic rank range and preemptibility (issue 16, [`crate::elastic`]); left out,
    /// the job runs at its `parallel.ranks` and is never preempted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourcesSpec>,
}

/// A registered model (id or name) to fine-tune, or a built-in model trained from
/// scratch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum ModelChoice {
    Registered(String),
    Builtin(BuiltinModel),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum BuiltinModel {
    /// A multi-layer perceptron over the numeric feature columns: ReLU hidden layers of
    /// the given widths, then a linear head.
    Mlp { hidden: Vec<u32> },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum TaskType {
    Classification,
    Regression,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TaskSpec {
    #[serde(rename = "type")]
    pub kind: TaskType,
    pub label_column: String,
    /// Numeric input columns (MLP). Left out: every number column but the label.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub feature_columns: Option<Vec<String>>,
    /// The text input column (a registered transformer model).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text_column: Option<String>,
    /// Fraction of rows held out for evaluation, in (0, 1).
    pub validation_split: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "lowercase", deny_unknown_fields)]
pub enum OptimizerSpec {
    Sgd {
        #[serde(default)]
        momentum: f64,
        #[serde(default)]
        nesterov: bool,
        #[serde(default)]
        weight_decay: f64,
    },
    Adamw {
        #[serde(default = "default_betas")]
        betas: (f64, f64),
        #[serde(default = "default_eps")]
        eps: f64,
        #[serde(default = "default_adamw_weight_decay")]
        weight_decay: f64,
    },
}

fn default_betas() -> (f64, f64) {
    (0.9, 0.999)
}

fn default_eps() -> f64 {
    1e-8
}

fn default_adamw_weight_decay() -> f64 {
    0.01
}

impl OptimizerSpec {
    pub fn validate(&self) -> Result<(), SpecError> {
        match *self {
            OptimizerSpec::Sgd { momentum, nesterov, weight_decay } => {
                if !(0.0..1.0).contains(&momentum) {
                    return Err(SpecError::new("optimizer.momentum", "must be in [0, 1)"));
                }
                if nesterov && momentum == 0.0 {
                    return Err(SpecError::new("optimizer.nesterov", "Nesterov momentum needs a momentum above 0"));
                }
                check_weight_decay(weight_decay)
            }
            OptimizerSpec::Adamw { betas, eps, weight_decay } => {
                if !(0.0..1.0).contains(&betas.0) || !(0.0..1.0).contains(&betas.1) {
                    return Err(SpecError::new("optimizer.betas", "both betas must be in [0, 1)"));
                }
                if !(eps > 0.0 && eps.is_finite()) {
                    return Err(SpecError::new("optimizer.eps", "must be a positive number"));
                }
                check_weight_decay(weight_decay)
            }
        }
    }
}

fn check_weight_decay(weight_decay: f64) -> Result<(), SpecError> {
    if weight_decay >= 0.0 && weight_decay.is_finite() {
        Ok(())
    } else {
        Err(SpecError::new("optimizer.weight_decay", "must be 0 or a positive number"))
    }
}

/// The learning-rate schedule. Wire format and checks only; the schedules themselves
/// (and AutoLRS, ICLR 2021) are computed by the worker's `train::lr` module.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "lowercase", deny_unknown_fields)]
pub enum LrSchedule {
    /// `lr` at every step.
    Constant { lr: f64 },
    /// `lr · gamma^⌊step / step_size⌋`.
    Step { lr: f64, step_size: u64, gamma: f64 },
    /// Linear warm-up from 0 to `lr` over `warmup_steps`, then linear decay to 0 at
    /// `max_steps` (the Hugging Face fine-tuning default, `get_linear_schedule_with_warmup`).
    Linear {
        lr: f64,
        #[serde(default)]
        warmup_steps: u64,
    },
    /// Linear warm-up from 0 to `lr` over `warmup_steps`, then cosine decay to `min_lr`
    /// at `max_steps`.
    Cosine {
        lr: f64,
        #[serde(default)]
        warmup_steps: u64,
        #[serde(default)]
        min_lr: f64,
    },
    /// Smith's one-cycle policy: from `max_lr/div_factor` up to `max_lr` over
    /// `pct_start` of the run, then down to `max_lr/(div_factor·final_div_factor)`.
    Onecycle {
        max_lr: f64,
        #[serde(default = "default_pct_start")]
        pct_start: f64,
        #[serde(default = "default_div_factor")]
        div_factor: f64,
        #[serde(default = "default_final_div_factor")]
        final_div_factor: f64,
    },
    /// AutoLRS: Bayesian optimisation over log-LR in `[min_lr, max_lr]` per stage.
    /// Defaults from the authors' code: τ' = 100, τ = 1000, k = 10, τ_max = 8000.
    Autolrs {
        min_lr: f64,
        max_lr: f64,
        #[serde(default = "default_tau_prime")]
        tau_prime: u64,
        #[serde(default = "default_tau")]
        tau: u64,
        #[serde(default = "default_k")]
        k: u32,
        #[serde(default = "default_tau_max")]
        tau_max: u64,
    },
}

fn default_pct_start() -> f64 {
    0.3
}
fn default_div_factor() -> f64 {
    25.0
}
fn default_final_div_factor() -> f64 {
    1e4
}
fn default_tau_prime() -> u64 {
    100
}
fn default_tau() -> u64 {
    1000
}
fn default_k() -> u32 {
    10
}
fn default_tau_max() -> u64 {
    8000
}

fn positive_lr(field: &str, lr: f64) -> Result<(), SpecError> {
    if lr > 0.0 && lr.is_finite() {
        Ok(())
    } else {
        Err(SpecError::new(format!("lr_schedule.{field}"), "must be a positive number"))
    }
}

impl LrSchedule {
    pub fn kind(&self) -> &'static str {
        match self {
            LrSchedule::Constant { .. } => "constant",
            LrSchedule::Step { .. } => "step",
            LrSchedule::Linear { .. } => "linear",
            LrSchedule::Cosine { .. } => "cosine",
            LrSchedule::Onecycle { .. } => "onecycle",
            LrSchedule::Autolrs { .. } => "autolrs",
        }
    }

    /// Checks the numbers; field names are JSON paths from the job body.
    pub fn validate(&self) -> Result<(), SpecError> {
        match *self {
            LrSchedule::Constant { lr } => positive_lr("lr", lr),
            LrSchedule::Step { lr, step_size, gamma } => {
                positive_lr("lr", lr)?;
                if step_size == 0 {
                    return Err(SpecError::new("lr_schedule.step_size", "must be at least 1"));
                }
                if !(gamma > 0.0 && gamma <= 1.0) {
                    return Err(SpecError::new("lr_schedule.gamma", "must be in (0, 1]"));
                }
                Ok(())
            }
            LrSchedule::Linear { lr, .. } => positive_lr("lr", lr),
            LrSchedule::Cosine { lr, min_lr, .. } => {
                positive_lr("lr", lr)?;
                if !(min_lr >= 0.0 && min_lr <= lr) {
                    return Err(SpecError::new("lr_schedule.min_lr", "must be in [0, lr]"));
                }
                Ok(())
            }
            LrSchedule::Onecycle { max_lr, pct_start, div_factor, final_div_factor } => {
                positive_lr("max_lr", max_lr)?;
                if !(pct_start > 0.0 && pct_start < 1.0) {
                    return Err(SpecError::new("lr_schedule.pct_start", "must be in (0, 1)"));
                }
                if !(div_factor >= 1.0 && div_factor.is_finite()) {
                    return Err(SpecError::new("lr_schedule.div_factor", "must be at least 1"));
                }
                if !(final_div_factor >= 1.0 && final_div_factor.is_finite()) {
                    return Err(SpecError::new("lr_schedule.final_div_factor", "must be at least 1"));
                }
                Ok(())
            }
            LrSchedule::Autolrs { min_lr, max_lr, tau_prime, tau, k, tau_max } => {
                positive_lr("min_lr", min_lr)?;
                positive_lr("max_lr", max_lr)?;
                if min_lr >= max_lr {
                    return Err(SpecError::new("lr_schedule.max_lr", "must be greater than min_lr"));
                }
                if tau_prime < 2 {
                    return Err(SpecError::new("lr_schedule.tau_prime", "must be at least 2 steps"));
                }
                if tau <= tau_prime {
                    return Err(SpecError::new("lr_schedule.tau", "must be greater than tau_prime"));
                }
                // A stage records at most 1000 candidates; τ_max within `max_steps`' bound
                // keeps the stage arithmetic far from overflowing.
                if !(1..=1000).contains(&k) {
                    return Err(SpecError::new("lr_schedule.k", "must be 1 to 1000"));
                }
                if tau_max < tau || tau_max > MAX_STEPS {
                    return Err(SpecError::new("lr_schedule.tau_max", "must be at least tau and at most 100000000"));
                }
                Ok(())
            }
        }
    }
}

/// The most steps a job may train.
const MAX_STEPS: u64 = 100_000_000;

impl TrainSpec {
    /// The checks that need nothing but the spec itself (the server adds those that
    /// need the model and the dataset).
    pub fn validate(&self) -> Result<(), SpecError> {
        if let ModelChoice::Builtin(BuiltinModel::Mlp { hidden }) = &self.model {
            if hidden.len() > 16 || hidden.iter().any(|&w| w == 0 || w > 65_536) {
                return Err(SpecError::new("model.hidden", "give at most 16 layer widths, each 1 to 65536"));
            }
        }
        if self.dataset.trim().is_empty() {
            return Err(SpecError::new("dataset", "give the id or name of one of your datasets"));
        }
        if !(self.task.validation_split > 0.0 && self.task.validation_split < 1.0) {
            return Err(SpecError::new("task.validation_split", "must be in (0, 1)"));
        }
        self.optimizer.validate()?;
        if self.batch_size == 0 || self.batch_size > 65_536 {
            return Err(SpecError::new("batch_size", "must be 1 to 65536"));
        }
        if self.max_steps == 0 || self.max_steps > MAX_STEPS {
            return Err(SpecError::new("max_steps", "must be 1 to 100000000"));
        }
        if self.eval_every == 0 {
            return Err(SpecError::new("eval_every", "must be at least 1"));
        }
        if self.checkpoint_every == 0 {
            return Err(SpecError::new("checkpoint_every", "must be at least 1"));
        }
        self.lr_schedule.validate()?;
        if let Some(parallel) = &self.parallel {
            parallel.validate(self.batch_size)?;
        }
        self.resolve_resources().map(|_| ())
    }

    /// The job's resources with their defaults filled in (checked against `parallel`).
    pub fn resolve_resources(&self) -> Result<Resources, SpecError> {
        let ranks = self.parallel.as_ref().map_or(1, |p| p.ranks.len() as u32);
        self.resources.clone().unwrap_or_default().resolve(ranks)
    }
}

/// The model of a queued job, resolved.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum TrainModel {
    Mlp {
        hidden: Vec<u32>,
    },
    /// A registered transformer model; the worker downloads its files like a prefetch.
    Registered {
        id: Uuid,
        name: String,
        architecture: String,
        /// Labels of the model's own classification head, when it has one.
        #[serde(default)]
        num_labels: Option<u32>,
    },
}

/// The dataset of a queued job: enough for the worker to fetch and parse it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TrainDataset {
    pub id: Uuid,
    pub digest: String,
    pub format: DatasetFormat,
    pub columns: Vec<DatasetColumn>,
    pub rows: u64,
}

/// The task of a queued job: the input columns are always spelled out.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TrainTask {
    #[serde(rename = "type")]
    pub kind: TaskType,
    pub label_column: String,
    /// Numeric inputs, in order (MLP); empty for a text model.
    #[serde(default)]
    pub feature_columns: Vec<String>,
    /// Text input (registered model).
    #[serde(default)]
    pub text_column: Option<String>,
    pub validation_split: f64,
}

/// `JobSpec::Train`: the checked, resolved training run a worker claims.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TrainJob {
    pub model: TrainModel,
    pub dataset: TrainDataset,
    pub task: TrainTask,
    pub optimizer: OptimizerSpec,
    pub batch_size: u32,
    pub max_steps: u64,
    pub eval_every: u64,
    pub checkpoint_every: u64,
    pub lr_schedule: LrSchedule,
    pub seed: u64,
    /// The ranks of a data-parallel job; `batch_size` is then the global batch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel: Option<ParallelSpec>,
    /// Rank range and preemptibility; absent in jobs queued before issue 16 (see
    /// [`TrainJob::resources`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<Resources>,
}

impl TrainJob {
    /// The job's resources: as queued, or for a job queued before they existed, its
    /// ranks fixed and not preemptible.
    pub fn resources(&self) -> Resources {
        self.resources.unwrap_or_else(|| Resources::fixed(self.parallel.as_ref().map_or(1, |p| p.ranks.len() as u32)))
    }
}

/// The most classes a classification job may have. The model's head grows with them, and
/// a label column with more distinct values is more likely an id or a measurement than a
/// class; the server refuses such a job when the dataset's column counts say so, the worker
/// when its data does.
pub const MAX_CLASSES: usize = 10_000;

/// The most parameters a built-in MLP may have. Training holds four f32 values a parameter
/// (the weight, its gradient and AdamW's two moments: 1.6 GB at the cap) and a checkpoint
/// copies two of them while it is written, so the largest MLP leaves most of a 24 GiB CPU
/// worker to its data and activations. Past the cap a spec could make the worker allocate
/// more memory than it has and abort, then abort every worker the requeued job reaches.
pub const MAX_MLP_PARAMETERS: u64 = 100_000_000;

/// The most f32 values one training step's forward may hold for its backward: 2^31, 8 GiB.
/// The backward's gradients take about as much again while it runs, so a step at the cap,
/// beside the largest MLP's state, stays within a 24 GiB CPU worker.
pub const MAX_ACTIVATIONS: u64 = 1 << 31;

/// The longest text input, in tokens, a transformer job trains on; longer texts are
/// truncated.
pub const MAX_TEXT_TOKENS: usize = 128;

/// The parameters of an MLP of these layer widths (its inputs first, its outputs last): a
/// weight and a bias per layer.
pub fn mlp_parameters(widths: &[u64]) -> u64 {
    widths.windows(2).map(|pair| pair[0].saturating_mul(pair[1]).saturating_add(pair[1])).fold(0, u64::saturating_add)
}

/// The f32 values an MLP's forward holds for its backward, per row: each layer's output
/// before and after its ReLU, and the batch itself, so about twice the sum of the widths.
pub fn mlp_activations_per_row(widths: &[u64]) -> u64 {
    widths.iter().fold(0u64, |sum, &width| sum.saturating_add(width)).saturating_mul(2)
}

/// The f32 values a BERT-family encoder's forward holds for its backward, per row of
/// `tokens` tokens: per layer and token about ten hidden-wide states (the query, key and
/// value projections, the attention's output and its projection, the residual sums and
/// LayerNorms), the feed-forward's intermediate before and after its activation, and every
/// head's attention scores before and after the softmax.
pub fn encoder_activations_per_row(tokens: u64, hidden: u64, intermediate: u64, heads: u64, layers: u64) -> u64 {
    let per_token = hidden
        .saturating_mul(10)
        .saturating_add(intermediate.saturating_mul(2))
        .saturating_add(heads.saturating_mul(tokens).saturating_mul(2));
    layers.saturating_mul(tokens).saturating_mul(per_token)
}

/// Refuses an MLP of these widths (inputs first, outputs last) trained on `batch` rows a
/// step when it is past [`MAX_MLP_PARAMETERS`] or its step past [`MAX_ACTIVATIONS`]. The
/// server checks a spec with it before queueing, the worker again before allocating.
pub fn check_mlp(widths: &[u64], batch: u64) -> Result<(), SpecError> {
    let parameters = mlp_parameters(widths);
    if parameters > MAX_MLP_PARAMETERS {
        let (inputs, outputs) = (widths.first().copied().unwrap_or(0), widths.last().copied().unwrap_or(0));
        return Err(SpecError::new(
            "model.hidden",
            format!(
                "with {inputs} inputs and {outputs} outputs these widths make an MLP of {parameters} parameters, past \
                 the {MAX_MLP_PARAMETERS} allowed; use fewer or narrower layers"
            ),
        ));
    }
    check_activations(batch, mlp_activations_per_row(widths))
}

/// Refuses a step of `batch` rows whose forward, at `per_row` values a row, would hold more
/// than [`MAX_ACTIVATIONS`].
pub fn check_activations(batch: u64, per_row: u64) -> Result<(), SpecError> {
    let held = batch.saturating_mul(per_row);
    if held <= MAX_ACTIVATIONS {
        return Ok(());
    }
    let most = MAX_ACTIVATIONS / per_row.max(1);
    let advice = match most {
        0 => "the model is too large for even one row".to_string(),
        _ => format!("use a batch_size of at most {most}"),
    };
    Err(SpecError::new(
        "batch_size",
        format!(
            "a step of {batch} rows would hold about {held} activations ({per_row} a row), past the \
             {MAX_ACTIVATIONS} allowed; {advice}"
        ),
    ))
}

/// One row of a metric series: the step and the values named at it, e.g.
/// `{"step": 10, "loss": 0.41, "lr": 0.1, "phase": "search"}`. The same shape goes up
/// (worker → server) and comes back (`GET /api/v1/jobs/{id}/metrics`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct MetricRow {
    pub step: u64,
    /// Under AutoLRS, whether the step (or the model an evaluation measured) belongs to a
    /// candidate's search or to a stage's exploitation; absent for fixed schedules.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<StepPhase>,
    #[serde(flatten)]
    pub values: BTreeMap<String, f64>,
}

/// What an AutoLRS step is spent on, so a speed-up can be read with or without the
/// search's steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum StepPhase {
    /// A candidate LR's τ' steps from the stage snapshot (restored afterwards).
    Search,
    /// The stage's τ steps at the chosen LR.
    Exploit,
}

impl StepPhase {
    pub fn as_str(self) -> &'static str {
        match self {
            StepPhase::Search => "search",
            StepPhase::Exploit => "exploit",
        }
    }

    pub fn parse(text: &str) -> Option<StepPhase> {
        match text {
            "search" => Some(StepPhase::Search),
            "exploit" => Some(StepPhase::Exploit),
            _ => None,
        }
    }
}

/// `POST /api/v1/agent/jobs/{id}/training-metrics` (worker) and the body of
/// `GET /api/v1/jobs/{id}/metrics`. `steps` are per training step (`loss`, `lr`,
/// `throughput` in samples/s, …); `evals` per evaluation (`val_loss`, `accuracy`, …);
/// `ranks` per rank and step of a data-parallel job (`iter_ms`, `wait_ms`, `allreduce_ms`).
/// A step reported again (a job resumed from a checkpoint) replaces the earlier value,
/// so the series stays one run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TrainingMetrics {
    #[serde(default)]
    pub steps: Vec<MetricRow>,
    #[serde(default)]
    pub evals: Vec<MetricRow>,
    /// Data-parallel jobs: each rank's step timings.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ranks: Vec<RankStep>,
}

/// One AutoLRS candidate: the LR tried for τ' steps from the stage's snapshot, the loss
/// forecast for step τ, and the loss actually observed at the end of its τ' steps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct LrCandidate {
    pub lr: f64,
    /// `None` when no fit was possible (a loss that is not a number, a curve too short).
    pub forecast_loss: Option<f64>,
    pub observed_loss: Option<f64>,
    /// What the choice compared for this LR (lower is better); 1e6 for a loss that was
    /// not a number. Where some candidates of a stage had no credible forecast, every
    /// candidate is compared by its observed loss.
    #[serde(default)]
    pub score: Option<f64>,
    /// Where `score` came from. Records stored before this field read as `forecast`.
    #[serde(default)]
    pub scored_by: CandidateScore,
    /// Why the forecast was not used, or why the candidate failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// How a candidate was scored.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum CandidateScore {
    /// The curve's forecast at τ (the paper's method), judged credible.
    #[default]
    Forecast,
    /// The forecast was not credible (or the validation guard applied, or another
    /// candidate of the stage had no credible forecast): the observed loss at the end of
    /// the window (the mean of the last 10 training losses, or the last validation loss).
    Observed,
    /// The loss was not a number (scored 1e6) or rose over the window beyond its noise
    /// (scored its observed loss): never chosen while a candidate that did not fail
    /// remains.
    Failed,
}

/// An exploitation that diverged: its steps count, the stage snapshot was restored and
/// the next-best candidate exploited instead.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct LrFallback {
    /// The LR whose exploitation diverged.
    pub lr: f64,
    /// The global step at which it was abandoned.
    pub at_step: u64,
    /// Exploitation steps it ran before that.
    pub steps: u64,
    /// What was seen: a loss that is not a number, or the smoothed loss well above the
    /// stage's start.
    pub reason: String,
}

/// One AutoLRS stage, reported by the worker when its search ends and again (same
/// `stage`, replacing it) when its exploitation steps end.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct LrStageRecord {
    /// 0, 1, 2, … in order.
    pub stage: u32,
    /// The global step at which the stage's snapshot was taken.
    pub start_step: u64,
    pub tau_prime: u64,
    pub tau: u64,
    /// `train_loss`, or `val_loss` once τ' has reached τ_max/10.
    pub metric: String,
    pub candidates: Vec<LrCandidate>,
    /// The LR exploited (after any fallbacks, the one exploited last). In a stage whose
    /// search the budget cut short (`run_end` set) nothing was exploited: the best
    /// candidate so far, or the one in progress if none had finished.
    pub chosen_lr: f64,
    /// Loss after the τ exploitation steps at `chosen_lr`, once they are done: the
    /// smoothed training loss, or the validation loss when `metric` is `val_loss`.
    #[serde(default)]
    pub observed_loss_after_tau: Option<f64>,
    /// `observed_loss_after_tau` minus the chosen candidate's score (its forecast, or its
    /// observed loss where the forecast was not credible): how far off the choice's
    /// prediction was.
    #[serde(default)]
    pub forecast_error: Option<f64>,
    /// Exploitations abandoned for divergence, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fallbacks: Vec<LrFallback>,
    /// Set on the stage the run ended in when the budget ran out with a model the run does
    /// not keep (a search candidate's, or a diverged exploitation's): why, and that the
    /// run ended on the stage's snapshot, the last model it kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_end: Option<String>,
}

/// A stored stage as `GET /api/v1/jobs/{id}/lr-stages` lists it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct LrStage {
    #[serde(flatten)]
    pub record: LrStageRecord,
    pub updated_at: DateTime<Utc>,
}

/// One file of a checkpoint (e.g. `model.safetensors`, `state.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CheckpointFile {
    pub name: String,
    pub digest: String,
    pub size_bytes: u64,
}

/// A checkpoint of a training job. The server stores its files as opaque blobs; the
/// worker decides what goes in them (weights, optimizer, data-loader position, RNG,
/// LR-tuner state). One per step: uploading the same step again replaces it.
///
/// Upload: `POST /api/v1/agent/jobs/{id}/checkpoints` as `multipart/form-data` with a
/// text field `step` first, then one file part named `files` per file (its filename is
/// the file's name). Resume: `GET /api/v1/agent/jobs/{id}/checkpoints/latest` (204 when
/// there is none), then `GET /api/v1/agent/jobs/{id}/checkpoints/{step}/files/{name}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Checkpoint {
    pub job_id: Uuid,
    pub step: u64,
    pub size_bytes: u64,
    pub files: Vec<CheckpointFile>,
    pub created_at: DateTime<Utc>,
}

/// Progress of a training job, from its step metrics.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TrainProgress {
    /// The highest step reported so far (0 before the first).
    pub step: u64,
    pub max_steps: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = r#"{"name":"digits","model":{"kind":"mlp","hidden":[64]},"dataset":"d1",
        "task":{"type":"classification","label_column":"label","validation_split":0.2},
        "optimizer":{"type":"sgd","momentum":0.9},"batch_size":64,"max_steps":3000,
        "eval_every":100,"checkpoint_every":500,"lr_schedule":{"type":"autolrs","min_lr":1e-4,"max_lr":1},"seed":1}"#;

    #[test]
    fn the_issue_example_body_parses_and_validates() {
        let job: TrainSpec = serde_json::from_str(EXAMPLE).unwrap();
        assert_eq!(job.name, "digits");
        assert_eq!(job.model, ModelChoice::Builtin(BuiltinModel::Mlp { hidden: vec![64] }));
        assert_eq!(
            job.lr_schedule,
            LrSchedule::Autolrs { min_lr: 1e-4, max_lr: 1.0, tau_prime: 100, tau: 1000, k: 10, tau_max: 8000 }
        );
        assert_eq!(job.optimizer, OptimizerSpec::Sgd { momentum: 0.9, nesterov: false, weight_decay: 0.0 });
        job.validate().unwrap();
    }

    #[test]
    fn a_registered_model_is_named_by_a_string() {
        let body = EXAMPLE.replace(r#"{"kind":"mlp","hidden":[64]}"#, r#""minilm""#);
        let job: TrainSpec = serde_json::from_str(&body).unwrap();
        assert_eq!(job.model, ModelChoice::Registered("minilm".into()));
    }

    #[test]
    fn validation_names_the_field() {
        let mut job: TrainSpec = serde_json::from_str(EXAMPLE).unwrap();
        job.task.validation_split = 1.0;
        assert_eq!(job.validate().unwrap_err().field, "task.validation_split");
        job.task.validation_split = 0.2;
        job.lr_schedule =
            LrSchedule::Autolrs { min_lr: 1.0, max_lr: 0.1, tau_prime: 100, tau: 1000, k: 10, tau_max: 8000 };
        assert_eq!(job.validate().unwrap_err().field, "lr_schedule.max_lr");
        let huge = 1 << 61;
        job.lr_schedule =
            LrSchedule::Autolrs { min_lr: 0.1, max_lr: 1.0, tau_prime: huge, tau: huge + 1, k: 10, tau_max: huge + 1 };
        assert_eq!(job.validate().unwrap_err().field, "lr_schedule.tau_max");
        job.lr_schedule =
            LrSchedule::Autolrs { min_lr: 0.1, max_lr: 1.0, tau_prime: 10, tau: 100, k: 1001, tau_max: 800 };
        assert_eq!(job.validate().unwrap_err().field, "lr_schedule.k");
        job.lr_schedule = LrSchedule::Constant { lr: 0.1 };
        job.batch_size = 0;
        assert_eq!(job.validate().unwrap_err().field, "batch_size");
    }

    #[test]
    fn an_mlp_past_the_parameter_cap_is_refused_naming_model_hidden() {
        // 16 widths of 65536 pass `validate`; two are already 4.3 billion parameters.
        let error = check_mlp(&[10, 65_536, 65_536, 3], 1).unwrap_err();
        assert_eq!(error.field, "model.hidden");
        assert!(error.message.contains("4295950339 parameters"), "{error}");
        assert_eq!(mlp_parameters(&[3, 5, 2]), 3 * 5 + 5 + 5 * 2 + 2);
        check_mlp(&[10, 8192, 8192, 3], 1).unwrap();
    }

    #[test]
    fn a_batch_past_the_activation_cap_is_refused_naming_batch_size() {
        // 67 million parameters are allowed, but not 65536 rows of 2·16397 activations.
        let widths = [10, 8192, 8192, 3];
        let error = check_mlp(&widths, 65_536).unwrap_err();
        assert_eq!(error.field, "batch_size");
        assert!(error.message.contains("at most 65484"), "{error}");
        check_mlp(&widths, 65_484).unwrap();
        // BERT-base (768 wide, 3072 intermediate, 12 heads and layers) at 128 tokens.
        let bert_base = encoder_activations_per_row(128, 768, 3072, 12, 12);
        assert!(check_activations(64, bert_base).is_ok());
        assert_eq!(check_activations(65_536, bert_base).unwrap_err().field, "batch_size");
    }

    #[test]
    fn metric_rows_flatten_their_values() {
        let row: MetricRow = serde_json::from_str(r#"{"step":3,"loss":0.5,"lr":0.1}"#).unwrap();
        assert_eq!(row.step, 3);
        assert_eq!(row.values["loss"], 0.5);
        assert_eq!(serde_json::to_value(&row).unwrap(), serde_json::json!({"step":3,"loss":0.5,"lr":0.1}));
        assert_eq!(row.phase, None);
    }

    #[test]
    fn a_step_row_carries_its_autolrs_phase_beside_its_values() {
        let row: MetricRow = serde_json::from_str(r#"{"step":4,"loss":0.5,"phase":"exploit"}"#).unwrap();
        assert_eq!(row.phase, Some(StepPhase::Exploit));
        assert_eq!(row.values.len(), 1);
        assert_eq!(serde_json::to_value(&row).unwrap(), serde_json::json!({"step":4,"loss":0.5,"phase":"exploit"}));
    }

    #[test]
    fn stage_records_stored_before_credibility_was_recorded_still_read() {
        let old = r#"{"stage":0,"start_step":0,"tau_prime":10,"tau":100,"metric":"train_loss",
            "candidates":[{"lr":0.1,"forecast_loss":0.3,"observed_loss":0.5}],"chosen_lr":0.1,
            "observed_loss_after_tau":null}"#;
        let record: LrStageRecord = serde_json::from_str(old).unwrap();
        assert_eq!(record.candidates[0].scored_by, CandidateScore::Forecast);
        assert!(record.fallbacks.is_empty() && record.forecast_error.is_none());
        assert_eq!(record.run_end, None);
    }
}
