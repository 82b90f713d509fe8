//! Hybrid data-parallel training (QSync) in a running gang: the ranks train their first
//! `profile_steps` steps at f32, timing each step's parts; then every rank traces one
//! forward of its last batch and times each of the model's operators at every precision on
//! those real shapes (`ops`), the ranks gather what they measured, rank 0 computes the
//! gradient-variance indicator from its real tensors and plans the gang (`plan`), and every
//! rank applies its own plan before the next step.
//!
//! The exchange runs over the gang's ring, in the same order on every rank: an all-gather
//! of the measurements, then rank 0's report broadcast. So every rank switches at the same
//! step and the all-reduce keeps their weights bit-identical. A gang resumed from a
//! checkpoint profiles and plans again (it may run on other devices).

pub mod ops;
pub mod plan;

use std::time::Duration;

use candle_core::backprop::GradStore;
use tessera_api::parallel::PrecisionSpec;
use tessera_api::precision::{OpCost, OpKind, Precision, PrecisionPlanReport};

use super::model::OpTrace;
use super::precision::{PlanError, PrecisionPlan};
use super::qsync::{IndicatorConfig, Indicators, OpStats, QsyncError, TrainingGraph};
use super::trainer::Trainer;
use plan::{plan_gang, RankMeasurement};

#[derive(Debug, thiserror::Error)]
pub enum PlanningError {
    #[error("precision planning: {0}")]
    Tensor(#[from] candle_core::Error),
    #[error("precision planning: {0}")]
    Qsync(#[from] QsyncError),
    #[error("the precision plan does not fit the model: {0}")]
    Plan(#[from] PlanError),
    #[error("precision planning: a rank sent {what} that does not decode: {error}")]
    Decode { what: &'static str, error: serde_json::Error },
    #[error("precision planning: the model has no operators a plan can name")]
    NoOperators,
}

/// One profiled step's parts, milliseconds.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    pub compute_ms: f64,
    pub optimizer_ms: f64,
    /// Waiting for the other ranks excluded.
    pub allreduce_ms: f64,
}

impl Sample {
    /// The parts of the step `trainer` took last.
    pub fn last_step(trainer: &Trainer) -> Sample {
        let phases = trainer.last_phases().unwrap_or_default();
        Sample {
            compute_ms: ms(phases.compute),
            optimizer_ms: ms(phases.optimizer),
            allreduce_ms: trainer.last_timing().map_or(0.0, |t| ms(t.reduce)),
        }
    }
}

/// What a rank measured before the plan, with the traced forward it measured on (whose
/// tensors and gradients give rank 0 the indicator).
pub struct RankProfiling {
    pub measurement: RankMeasurement,
    pub traces: Vec<OpTrace>,
    pub grads: GradStore,
}

/// A rank's measurements for the plan: every traced operator of its last batch at each
/// precision down to `low` (as many timed rounds as `samples`), its cast model, and the
/// rest of its step from `samples`, the steps it took at f32 (the part of the compute the
/// operators do not cover, the optimizer, the all-reduce). Like the operators, each part is
/// taken at its fastest sample: the first steps are cold and the host is shared, so a median
/// of three still measures the disturbance.
pub fn profile_rank(
    trainer: &Trainer,
    device: &str,
    low: Precision,
    samples: &[Sample],
) -> Result<RankProfiling, PlanningError> {
    let (mut traces, grads) = trainer.trace_last_batch()?;
    if traces.is_empty() {
        return Err(PlanningError::NoOperators);
    }
    let slowdown = trainer.slowdown();
    let iterations = samples.len();
    let mut table = ops::profile(device, &mut traces, low, iterations, slowdown)?;
    let casts = ops::profile_cast_model(trainer.device(), &traces, iterations, slowdown)?;
    // What the operators do not cover (attention products, activations, the loss, the
    // batch) is the measured step less the operators at f32.
    let fastest = |part: fn(&Sample) -> f64| samples.iter().map(part).fold(f64::INFINITY, f64::min);
    let f32_ops: f64 = table.ops.iter().filter_map(f32_ms).sum();
    table.overhead_ms = (fastest(|s| s.compute_ms) - f32_ops).max(0.0);
    table.optimizer_ms = fastest(|s| s.optimizer_ms);
    let allreduce_ms = fastest(|s| s.allreduce_ms);
    Ok(RankProfiling { measurement: RankMeasurement { table, casts, allreduce_ms }, traces, grads })
}

/// The plan in force on this rank.
struct Planned {
    /// The gang's report; kept on rank 0 only, which reports it.
    report: Option<PrecisionPlanReport>,
    predicted_ms: f64,
    /// This rank's step times since the plan.
    iter_ms: Vec<f64>,
}

/// Drives one rank through profiling and planning; the session calls it after every step.
pub struct Planner {
    spec: PrecisionSpec,
    seed: u64,
    /// The rank's device in words, for the report.
    device: String,
    samples: Vec<Sample>,
    planned: Option<Planned>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn median(mut values: Vec<f64>) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

impl Planner {
    /// `seed` (the job's) shuffles the random ablation's indicator.
    pub fn new(spec: PrecisionSpec, seed: u64, device: impl Into<String>) -> Planner {
        Planner { spec, seed, device: device.into(), samples: Vec::new(), planned: None }
    }

    /// What the plan in force predicts a step takes (the synchronous step); `None` while
    /// profiling.
    pub fn predicted_ms(&self) -> Option<f64> {
        self.planned.as_ref().map(|p| p.predicted_ms)
    }

    /// After each optimizer step (`iter`: the whole step). Once `profile_steps` steps are
    /// timed, profiles, plans and applies the plan; returns the gang's report on rank 0 at
    /// that step.
    pub fn after_step(
        &mut self,
        trainer: &mut Trainer,
        iter: Duration,
    ) -> Result<Option<PrecisionPlanReport>, PlanningError> {
        if let Some(planned) = &mut self.planned {
            planned.iter_ms.push(ms(iter));
            return Ok(None);
        }
        self.samples.push(Sample::last_step(trainer));
        if self.samples.len() < self.spec.profile_steps as usize {
            return Ok(None);
        }
        let (report, predicted_ms) = self.plan(trainer)?;
        let leader = trainer.share().is_leader();
        self.planned = Some(Planned { report: leader.then_some(report.clone()), predicted_ms, iter_ms: Vec::new() });
        Ok(leader.then_some(report))
    }

    /// Rank 0's report with the median step time measured under the plan.
    pub fn finish(&self) -> Option<PrecisionPlanReport> {
        let planned = self.planned.as_ref()?;
        let mut report = planned.report.clone()?;
        if !planned.iter_ms.is_empty() {
            report.measured_step_ms = Some(median(planned.iter_ms.clone()));
        }
        Some(report)
    }

    fn plan(&self, trainer: &mut Trainer) -> Result<(PrecisionPlanReport, f64), PlanningError> {
        let RankProfiling { measurement, traces, grads } =
            profile_rank(trainer, &self.device, self.spec.low, &self.samples)?;
        let ranks = gather_measurements(trainer, &measurement)?;
        let rank = trainer.share().rank;
        let report = if rank == 0 {
            let graph = gang_graph(&traces, &ranks);
            let indicators = indicators(&traces, &grads)?;
            let gang = plan_gang(self.spec.policy, self.spec.low, self.seed, &graph, &ranks, &indicators)?;
            let bytes = serde_json::to_vec(&gang.report).expect("reports serialise");
            trainer.sync_mut().broadcast(bytes)?;
            gang.report
        } else {
            let bytes = trainer.sync_mut().broadcast(Vec::new())?;
            serde_json::from_slice(&bytes).map_err(|error| PlanningError::Decode { what: "the plan", error })?
        };
        let plan = report.ranks.get(rank).ok_or(QsyncError::NoRank { rank, ranks: report.ranks.len() })?;
        let plan = PrecisionPlan(plan.ops.iter().map(|op| (op.op.clone(), op.precision)).collect());
        trainer.network_mut().set_precision(&plan)?;
        let predicted = report.predicted_step_ms;
        Ok((report, predicted))
    }
}

/// Every rank's measurements, by rank, exchanged over the gang's ring (every rank calls it
/// at the same step).
pub fn gather_measurements(
    trainer: &mut Trainer,
    mine: &RankMeasurement,
) -> Result<Vec<RankMeasurement>, PlanningError> {
    let bytes = serde_json::to_vec(mine).expect("measurements serialise");
    trainer
        .sync_mut()
        .all_gather(bytes)?
        .iter()
        .map(|b| serde_json::from_slice(b))
        .collect::<Result<_, _>>()
        .map_err(|error| PlanningError::Decode { what: "its measurements", error })
}

/// The replayer's graph of the gang's model from a rank's traced operators; the all-reduce
/// runs at the pace of the slowest rank's link.
pub fn gang_graph(traces: &[OpTrace], ranks: &[RankMeasurement]) -> TrainingGraph {
    let allreduce_ms = ranks.iter().map(|m| m.allreduce_ms).fold(0.0, f64::max);
    ops::graph(traces, allreduce_ms)
}

/// An operator's measured forward and backward at f32.
fn f32_ms(op: &OpCost) -> Option<f64> {
    op.timings.iter().find(|t| t.precision == Precision::F32).map(|t| t.forward_ms + t.backward_ms)
}

/// QSync's gradient-variance indicator of each traced operator from the traced tensors and
/// the gradients of the traced loss; depths count the operators in forward order.
pub fn indicators(traces: &[OpTrace], grads: &GradStore) -> Result<Indicators, PlanningError> {
    let stats = traces
        .iter()
        .map(|t| match (&t.weight, t.kind) {
            (Some(weight), OpKind::Linear | OpKind::Head | OpKind::Embedding) => {
                let zeros;
                let grad = match grads.get(weight) {
                    Some(grad) => grad,
                    // No gradient reached it (unused in this batch): a zero one.
                    None => {
                        zeros = weight.zeros_like()?;
                        &zeros
                    }
                };
                OpStats::weighted_tensors(&t.input, weight, grad, &t.output)
            }
            _ => OpStats::single_input_tensor(&t.input),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let depths: Vec<usize> = (1..=stats.len()).collect();
    Ok(Indicators::gradient_variance(&stats, &depths, stats.len(), &IndicatorConfig::default())?)
}
