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
//! checkpoint profiles and plans again (it may run on other devices), and so does a gang
//! whose ranks' speeds drift apart from what its plan predicted (`drift`): every rank goes
//! back to f32 at the same step, profiles, and the new plan lists the dropped ones.

pub mod drift;
pub mod ops;
pub mod plan;

use std::time::Duration;

use candle_core::backprop::GradStore;
use tessera_api::parallel::{PrecisionSpec, MAX_REPLANS, REPLAN_CHECK_STEPS};
use tessera_api::precision::{CastModel, CostTable, OpCost, OpKind, Precision, PrecisionPlanReport, ReplacedPlan};

use super::model::OpTrace;
use super::precision::{PlanError, PrecisionPlan};
use super::qsync::{IndicatorConfig, Indicators, OpStats, QsyncError, Statistic, TrainingGraph};
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
    #[error("precision planning: a rank sent {what} that is not 8 bytes")]
    Malformed { what: &'static str },
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
    /// The batch's work ([`Network::batch_work`](super::model::Network::batch_work)).
    pub work: f64,
}

impl Sample {
    /// The parts of the step `trainer` took last.
    pub fn last_step(trainer: &Trainer) -> candle_core::Result<Sample> {
        let phases = trainer.last_phases().unwrap_or_default();
        Ok(Sample {
            compute_ms: ms(phases.compute),
            optimizer_ms: ms(phases.optimizer),
            allreduce_ms: trainer.last_timing().map_or(0.0, |t| ms(t.reduce)),
            work: trainer.last_batch_work()? as f64,
        })
    }
}

/// What a rank measured of its operators before the plan, with the traced forward it
/// measured on (whose tensors and gradients give rank 0 the indicator).
pub struct RankProfiling {
    /// Every traced operator of its last batch at each precision; the rest of the step is
    /// filled in from the profiled steps by [`RankProfiling::measurement`].
    pub operators: CostTable,
    pub casts: CastModel,
    pub traces: Vec<OpTrace>,
    pub grads: GradStore,
}

impl RankProfiling {
    /// The measurement the plan uses: the operators completed with the rest of the step
    /// from `samples`, the f32 steps the rank took, the last of them on the traced batch
    /// ([`fit_to_samples`]).
    pub fn measurement(&self, samples: &[Sample], statistic: Statistic) -> RankMeasurement {
        let mut table = self.operators.clone();
        let allreduce_ms = fit_to_samples(&mut table, samples, statistic);
        RankMeasurement { table, casts: self.casts.clone(), allreduce_ms }
    }
}

/// The first profiled steps, cold (caches, allocator, the kernels' first runs), that the
/// median of the rest leaves out.
pub const COLD_STEPS: usize = 2;
/// Profiled steps from which on the planner reads their median, the cold ones left out.
pub const MEDIAN_FROM_STEPS: usize = 6;

/// How the rest of a rank's step is read from its profiled f32 steps (which of them, and
/// which figure of each part): with [`MEDIAN_FROM_STEPS`] or more the median of all but the
/// first [`COLD_STEPS`], with fewer the fastest of all. The profiled steps are the job's
/// first, and on a shared host neither figure is the better at every count: over three runs
/// each on a 2-core host, at 3 steps the median predicted steps 29% (fixed batch lengths)
/// and 20% (natural) too long and the fastest 12% and 3%; at 8 steps the fastest came out
/// under the typical step (10% and 4%) and the median without the first two 5% and 3%, and
/// in three more runs at 8 (a session later, the host drifting more) 9% and 6% against the
/// fastest's 15% and 14%.
/// `qsync_gang_predictor` compares the readings side by side (`bench/results/qsync.md`).
pub fn step_reading(samples: &[Sample]) -> (&[Sample], Statistic) {
    if samples.len() >= MEDIAN_FROM_STEPS {
        (&samples[COLD_STEPS..], Statistic::Median)
    } else {
        (samples, Statistic::Min)
    }
}

/// Times every traced operator of the rank's last batch at each precision down to `low`
/// (`rounds` timed rounds), and its cast model.
pub fn profile_rank(
    trainer: &Trainer,
    device: &str,
    low: Precision,
    rounds: usize,
) -> Result<RankProfiling, PlanningError> {
    let (mut traces, grads) = trainer.trace_last_batch()?;
    if traces.is_empty() {
        return Err(PlanningError::NoOperators);
    }
    let slowdown = trainer.slowdown();
    let operators = ops::profile(device, &mut traces, low, rounds, slowdown.clone())?;
    let casts = ops::profile_cast_model(trainer.device(), &traces, rounds, slowdown)?;
    Ok(RankProfiling { operators, casts, traces, grads })
}

/// Completes `table` (its operators profiled on the batch of the last of `samples`) with
/// the rest of the step the samples measured: the part of the compute the operators do not
/// cover (attention products, activations, the loss, the batch) as the overhead, and the
/// optimizer; returns the all-reduce's time. Each part is `statistic` of the samples.
///
/// Batches differ in size (a text batch is padded to its longest row), so each sample's
/// compute is first scaled to the traced batch's work: otherwise the fastest sample is the
/// shortest batch and the overhead comes out too small. Then the whole table (operators and
/// overhead) is scaled from the traced batch to the samples' median work, so the plan
/// predicts a typical step of this rank, and ranks compare on their typical batches, not on
/// the one each happened to trace. Both take time as proportional to the work.
pub fn fit_to_samples(table: &mut CostTable, samples: &[Sample], statistic: Statistic) -> f64 {
    let of = |part: &dyn Fn(&Sample) -> f64| statistic.of(&mut samples.iter().map(part).collect::<Vec<_>>());
    let traced_work = samples.last().map_or(1.0, |s| s.work).max(1.0);
    let f32_ops: f64 = table.ops.iter().filter_map(f32_ms).sum();
    table.overhead_ms = (of(&|s| s.compute_ms * traced_work / s.work.max(1.0)) - f32_ops).max(0.0);
    let typical = median(samples.iter().map(|s| s.work).collect()).max(1.0) / traced_work;
    for timing in table.ops.iter_mut().flat_map(|op| op.timings.iter_mut()) {
        timing.forward_ms *= typical;
        timing.backward_ms *= typical;
    }
    table.overhead_ms *= typical;
    table.optimizer_ms = of(&|s| s.optimizer_ms);
    of(&|s| s.allreduce_ms)
}

/// The plan in force on this rank.
struct Planned {
    /// The gang's report; kept on rank 0 only, which reports it.
    report: Option<PrecisionPlanReport>,
    predicted_ms: f64,
    /// Every rank's predicted compute, by rank, for a typical batch of `typical_work`.
    ranks_ms: Vec<f64>,
    typical_work: f64,
    /// Every rank's operators below f32, by rank.
    lowered: Vec<u32>,
    /// This rank's step times since the plan.
    iter_ms: Vec<f64>,
    /// This rank's compute per unit of work in the steps since the last drift check.
    window: Vec<f64>,
    /// Drift checks in a row that found the ranks apart.
    apart: u32,
}

impl Planned {
    fn new(report: &PrecisionPlanReport, typical_work: f64, leader: bool) -> Planned {
        Planned {
            report: leader.then(|| report.clone()),
            predicted_ms: report.predicted_step_ms,
            ranks_ms: report.ranks.iter().map(|r| r.predicted_ms).collect(),
            typical_work,
            lowered: report
                .ranks
                .iter()
                .map(|r| r.ops.iter().filter(|op| op.precision < Precision::F32).count() as u32)
                .collect(),
            iter_ms: Vec::new(),
            window: Vec::new(),
            apart: 0,
        }
    }
}

/// Drives one rank through profiling and planning; the session calls it after every step.
pub struct Planner {
    spec: PrecisionSpec,
    seed: u64,
    /// The rank's device in words, for the report.
    device: String,
    samples: Vec<Sample>,
    planned: Option<Planned>,
    /// The plans this run dropped for drift, oldest first.
    replaced: Vec<ReplacedPlan>,
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
        Planner { spec, seed, device: device.into(), samples: Vec::new(), planned: None, replaced: Vec::new() }
    }

    /// What the plan in force predicts a step takes (the synchronous step); `None` while
    /// profiling.
    pub fn predicted_ms(&self) -> Option<f64> {
        self.planned.as_ref().map(|p| p.predicted_ms)
    }

    /// After each optimizer step (`step` of `max_steps`, which took `iter`). Once
    /// `profile_steps` steps are timed, profiles, plans and applies the plan; returns the
    /// gang's report on rank 0 at that step. Under a plan, checks the ranks' drift from it
    /// every [`REPLAN_CHECK_STEPS`] steps (`drift`), and drops it when they have come apart,
    /// as long as a new plan would still run a check's worth of steps.
    pub fn after_step(
        &mut self,
        trainer: &mut Trainer,
        step: u64,
        max_steps: u64,
        iter: Duration,
    ) -> Result<Option<PrecisionPlanReport>, PlanningError> {
        if let Some(planned) = &mut self.planned {
            planned.iter_ms.push(ms(iter));
            let worth_it = max_steps.saturating_sub(step) >= u64::from(self.spec.profile_steps) + REPLAN_CHECK_STEPS;
            // The same on every rank: the spec, the steps and the plans replaced are the gang's.
            if self.spec.replan_drift > 0.0 && self.replaced.len() < MAX_REPLANS && worth_it {
                let sample = Sample::last_step(trainer)?;
                planned.window.push(sample.compute_ms / sample.work.max(1.0));
                if planned.window.len() as u64 >= REPLAN_CHECK_STEPS {
                    self.check_drift(trainer, step)?;
                }
            }
            return Ok(None);
        }
        self.samples.push(Sample::last_step(trainer)?);
        if self.samples.len() < self.spec.profile_steps as usize {
            return Ok(None);
        }
        let (report, typical_work) = self.plan(trainer)?;
        let leader = trainer.share().is_leader();
        self.planned = Some(Planned::new(&report, typical_work, leader));
        Ok(leader.then_some(report))
    }

    /// Every rank at the same step: shares its drift from the plan in force; once the
    /// drifts have been apart in [`drift::CHECKS_IN_A_ROW`] checks, drops the plan (every
    /// rank back at f32, profiling again), keeping it for the next plan's report.
    fn check_drift(&mut self, trainer: &mut Trainer, step: u64) -> Result<(), PlanningError> {
        let Some(planned) = &mut self.planned else { return Ok(()) };
        let share = trainer.share();
        // A gang re-formed at another size since the plan (elastic) has no prediction per
        // rank to compare with; every rank skips alike.
        let Some(&predicted) = planned.ranks_ms.get(share.rank).filter(|_| planned.ranks_ms.len() == share.world)
        else {
            planned.window.clear();
            return Ok(());
        };
        let mine = drift::drift(&planned.window, planned.typical_work, predicted);
        planned.window.clear();
        let drifts = gather_drifts(trainer, mine)?;
        planned.apart = if drift::spread(&drifts) > self.spec.replan_drift { planned.apart + 1 } else { 0 };
        if planned.apart < drift::CHECKS_IN_A_ROW {
            return Ok(());
        }
        self.replaced.push(ReplacedPlan {
            step,
            measured_ms: drifts.iter().zip(&planned.ranks_ms).map(|(d, p)| d * p).collect(),
            predicted_ms: planned.ranks_ms.clone(),
            lowered: planned.lowered.clone(),
        });
        let all_f32 = trainer.network().precision_ops().into_iter().map(|(op, _)| (op, Precision::F32)).collect();
        trainer.network_mut().set_precision(&PrecisionPlan(all_f32))?;
        self.samples.clear();
        self.planned = None;
        Ok(())
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

    /// Profiles, plans and applies the plan; returns the gang's report and the typical
    /// batch's work the plan predicts for.
    fn plan(&self, trainer: &mut Trainer) -> Result<(PrecisionPlanReport, f64), PlanningError> {
        let profiling = profile_rank(trainer, &self.device, self.spec.low, self.samples.len())?;
        let (samples, statistic) = step_reading(&self.samples);
        let typical_work = median(samples.iter().map(|s| s.work).collect()).max(1.0);
        let ranks = gather_measurements(trainer, &profiling.measurement(samples, statistic))?;
        let rank = trainer.share().rank;
        let report = if rank == 0 {
            let graph = gang_graph(&profiling.traces, &ranks);
            let indicators = indicators(&profiling.traces, &profiling.grads)?;
            let mut gang = plan_gang(self.spec.policy, self.spec.low, self.seed, &graph, &ranks, &indicators)?;
            gang.report.replaced = self.replaced.clone();
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
        Ok((report, typical_work))
    }
}

/// Every rank's drift, by rank (every rank calls it at the same step).
fn gather_drifts(trainer: &mut Trainer, mine: f64) -> Result<Vec<f64>, PlanningError> {
    trainer
        .sync_mut()
        .all_gather(mine.to_le_bytes().to_vec())?
        .iter()
        .map(|bytes| <[u8; 8]>::try_from(bytes.as_slice()).map(f64::from_le_bytes))
        .collect::<Result<_, _>>()
        .map_err(|_| PlanningError::Malformed { what: "its drift" })
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

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_api::precision::OpTiming;

    /// Two operators whose f32 forward and backward take 10 ms together on the traced batch.
    fn table() -> CostTable {
        let op = |name: &str| OpCost {
            op: name.into(),
            kind: OpKind::Linear,
            timings: vec![
                OpTiming { precision: Precision::Bf16, forward_ms: 1.0, backward_ms: 3.0 },
                OpTiming { precision: Precision::F32, forward_ms: 2.0, backward_ms: 3.0 },
            ],
        };
        CostTable {
            device: "cpu".into(),
            ops: vec![op("a"), op("b")],
            overhead_ms: 0.0,
            optimizer_ms: 0.0,
            casts_in_op_time: true,
        }
    }

    fn sample(compute_ms: f64, work: f64) -> Sample {
        Sample { compute_ms, optimizer_ms: 4.0 + compute_ms / 100.0, allreduce_ms: 6.0 + compute_ms / 100.0, work }
    }

    #[test]
    fn few_profiled_steps_read_the_fastest_and_many_the_median_of_the_warm_ones() {
        // Cold first steps (40 and 30 ms), then warm ones around 20 with one quick outlier.
        let steps = [40.0, 30.0, 21.0, 20.0, 12.0, 22.0, 20.0, 19.0];
        let samples: Vec<Sample> = steps.iter().map(|&ms| sample(ms, 64.0)).collect();
        let reading = |n: usize| {
            let (chosen, statistic) = step_reading(&samples[..n]);
            (chosen.len(), statistic.of(&mut chosen.iter().map(|s| s.compute_ms).collect::<Vec<_>>()))
        };
        assert_eq!(reading(3), (3, 21.0), "three steps: the fastest of all");
        assert_eq!(reading(MEDIAN_FROM_STEPS - 1), (5, 12.0));
        assert_eq!(reading(MEDIAN_FROM_STEPS), (4, 20.5), "the cold two left out, then the median");
        assert_eq!(reading(8), (6, 20.0));
    }

    #[test]
    fn batches_of_one_size_leave_the_operators_as_profiled_and_the_rest_is_the_statistic() {
        let samples = [sample(14.0, 64.0), sample(12.0, 64.0), sample(13.0, 64.0)];
        for (statistic, compute) in [(Statistic::Median, 13.0), (Statistic::Min, 12.0)] {
            let mut t = table();
            let allreduce = fit_to_samples(&mut t, &samples, statistic);
            assert_eq!(t.ops, table().ops);
            assert!((t.overhead_ms - (compute - 10.0)).abs() < 1e-9, "{statistic:?}: {}", t.overhead_ms);
            let (optimizer, reduce) = (4.0 + compute / 100.0, 6.0 + compute / 100.0);
            assert!((t.optimizer_ms - optimizer).abs() < 1e-9, "{statistic:?}: {}", t.optimizer_ms);
            assert!((allreduce - reduce).abs() < 1e-9, "{statistic:?}: {allreduce}");
        }
    }

    #[test]
    fn the_overhead_is_measured_at_the_traced_batch_and_the_table_scaled_to_the_typical_one() {
        // 0.2 ms a token; the traced batch (the last) has 100 tokens, the median one too.
        // Scaled to 100 tokens every sample took 20 ms, 10 of them outside the operators;
        // unscaled, the shortest batch less the operators would give 0 (clamped from -5).
        let mut t = table();
        fit_to_samples(&mut t, &[sample(5.0, 25.0), sample(30.0, 150.0), sample(20.0, 100.0)], Statistic::Min);
        assert!((t.overhead_ms - 10.0).abs() < 1e-9, "{}", t.overhead_ms);
        assert_eq!(t.ops, table().ops);

        // 0.3 ms a token; the traced batch has 50 tokens (15 ms: 5 outside the operators),
        // the median one 100: the operators and the overhead double.
        let mut t = table();
        fit_to_samples(&mut t, &[sample(30.0, 100.0), sample(45.0, 150.0), sample(15.0, 50.0)], Statistic::Min);
        assert!((t.overhead_ms - 10.0).abs() < 1e-9, "{}", t.overhead_ms);
        let f32_ms: f64 = t.ops.iter().filter_map(f32_ms).sum();
        assert!((f32_ms - 20.0).abs() < 1e-9, "{f32_ms}");
        assert_eq!((t.ops[0].timings[0].forward_ms, t.ops[0].timings[0].backward_ms), (2.0, 6.0));
    }
}
