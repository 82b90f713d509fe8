//! Rank 0's plan for the whole gang from what every rank measured: plain data in, the
//! report and each rank's precision per operator out (no I/O, no clock).
//!
//! Every rank is replayed alone at f32; the fastest sets the pace. A rank predicted more
//! than [`SLOWER`] times slower is planned, each against the fastest rank alone (so the
//! slow ranks do not hold each other's budgets), by the policy: QSync's allocator
//! (`qsync::plan_rank`, its budget QSync's: the fastest rank's step, or the slow rank's own
//! fastest plan where it cannot get that fast), the same search over shuffled indicator
//! values (the random ablation), or every operator at `low` (uniform). The other ranks stay
//! at f32. The report's indicator values are always the real ones, so policies compare on
//! one scale; the trace lists the slow ranks' searches one after another, in rank order.

use serde::{Deserialize, Serialize};
use tessera_api::parallel::PrecisionPolicy;
use tessera_api::precision::{
    CastModel, CostTable, IndicatorKind, KeepRule, OpKind, OpSelector, PlannedOp, Precision, PrecisionPlanReport,
    RankPlan,
};

use crate::train::qsync::{
    plan_rank, replay_step, Indicators, QsyncError, RankPlanRequest, RankProfile, StepPrediction, TrainingGraph,
};

/// A rank is planned when its f32 step is predicted this much slower than the fastest
/// rank's: below it, the difference is the noise of timing on a shared host.
pub const SLOWER: f64 = 1.05;

/// What one rank measured, as it travels to rank 0.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankMeasurement {
    /// Its operators at each precision, with the rest of its step (overhead, optimizer).
    pub table: CostTable,
    pub casts: CastModel,
    /// Its all-reduce while profiling (waiting excluded; read from the profiled steps as
    /// [`super::step_reading`] says), ms.
    pub allreduce_ms: f64,
}

/// The gang's plan: the report, and per rank one precision per graph operator.
#[derive(Debug, Clone, PartialEq)]
pub struct GangPlan {
    pub report: PrecisionPlanReport,
    pub plans: Vec<Vec<Precision>>,
}

/// QSync's keep-list with nothing below `low`.
fn keep_rules(low: Precision) -> Vec<KeepRule> {
    let mut keep = KeepRule::qsync_defaults();
    for kind in [OpKind::Linear, OpKind::Embedding, OpKind::LayerNorm, OpKind::Activation, OpKind::Head] {
        keep.push(KeepRule { select: OpSelector::Kind(kind), at_least: low });
    }
    keep
}

/// Every rank's measurements resolved against the graph (int8 operators run their
/// backward at bf16).
fn rank_profiles(graph: &TrainingGraph, ranks: &[RankMeasurement]) -> Result<Vec<RankProfile>, QsyncError> {
    ranks.iter().map(|m| RankProfile::new(graph, &m.table, &m.casts, Precision::Bf16)).collect()
}

/// The synchronous step the replayer predicts with every rank at its plan (`plans` by rank,
/// one precision per graph operator), as `plan_gang` predicts the plans it chooses.
pub fn predict_gang(
    graph: &TrainingGraph,
    ranks: &[RankMeasurement],
    plans: &[Vec<Precision>],
) -> Result<StepPrediction, QsyncError> {
    let timelines = rank_profiles(graph, ranks)?
        .iter()
        .zip(plans)
        .map(|(profile, plan)| profile.replay(graph, plan))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(replay_step(graph, &timelines))
}

/// Plans every rank. `graph` and `indicators` (rank 0's real tensors) follow the model's
/// operators in forward order, `ranks` are indexed by rank; `seed` shuffles the random
/// ablation's indicator.
pub fn plan_gang(
    policy: PrecisionPolicy,
    low: Precision,
    seed: u64,
    graph: &TrainingGraph,
    ranks: &[RankMeasurement],
    indicators: &Indicators,
) -> Result<GangPlan, QsyncError> {
    let n = graph.ops.len();
    if indicators.len() != n {
        return Err(QsyncError::IndicatorLength { expected: n, got: indicators.len() });
    }
    if ranks.is_empty() {
        return Err(QsyncError::NoRank { rank: 0, ranks: 0 });
    }
    let profiles = rank_profiles(graph, ranks)?;
    let all_f32 = vec![Precision::F32; n];
    let alone: Vec<f64> = profiles
        .iter()
        .map(|p| Ok(replay_step(graph, &[p.replay(graph, &all_f32)?]).step_ms))
        .collect::<Result<_, QsyncError>>()?;
    let fastest = (0..alone.len()).fold(0, |best, r| if alone[r] < alone[best] { r } else { best });
    let keep = keep_rules(low);
    let search_indicators = match policy {
        PrecisionPolicy::Random => indicators.shuffled(seed),
        PrecisionPolicy::Qsync | PrecisionPolicy::Uniform => indicators.clone(),
    };

    let mut plans = vec![all_f32.clone(); ranks.len()];
    let mut budget_ms = alone[fastest];
    let mut trace = Vec::new();
    for rank in (0..ranks.len()).filter(|&r| alone[r] > alone[fastest] * SLOWER) {
        let profile = &profiles[rank];
        plans[rank] = match policy {
            PrecisionPolicy::Uniform => graph
                .ops
                .iter()
                .enumerate()
                .map(|(i, op)| {
                    let floor = KeepRule::floor(&keep, &op.name, op.kind);
                    profile.precisions(i).into_iter().find(|&p| p >= floor).unwrap_or(Precision::F32)
                })
                .collect(),
            PrecisionPolicy::Qsync | PrecisionPolicy::Random => {
                let pair = [profiles[fastest].clone(), profile.clone()];
                let allocation = plan_rank(&RankPlanRequest {
                    graph,
                    profiles: &pair,
                    plans: &[all_f32.clone(), all_f32.clone()],
                    rank: 1,
                    indicators: &search_indicators,
                    keep: &keep,
                    budget_ms: None,
                })?;
                budget_ms = budget_ms.max(allocation.budget_ms);
                trace.extend(allocation.trace);
                allocation.plan
            }
        };
    }

    let timelines =
        profiles.iter().zip(&plans).map(|(p, plan)| p.replay(graph, plan)).collect::<Result<Vec<_>, _>>()?;
    let step = replay_step(graph, &timelines);
    let rank_plans = plans
        .iter()
        .zip(&timelines)
        .zip(ranks)
        .enumerate()
        .map(|(rank, ((plan, timeline), measured))| {
            let ops: Vec<PlannedOp> = graph
                .ops
                .iter()
                .zip(plan)
                .enumerate()
                .map(|(i, (op, &precision))| PlannedOp {
                    op: op.name.clone(),
                    kind: op.kind,
                    precision,
                    indicator: indicators.value(i, precision),
                })
                .collect();
            RankPlan {
                rank: rank as u32,
                device: measured.table.device.clone(),
                indicator_sum: ops.iter().map(|op| op.indicator).sum(),
                ops,
                predicted_ms: timeline.compute_ms,
            }
        })
        .collect();
    let report = PrecisionPlanReport {
        indicator: match policy {
            PrecisionPolicy::Random => IndicatorKind::Random { seed },
            PrecisionPolicy::Qsync | PrecisionPolicy::Uniform => IndicatorKind::GradientVariance,
        },
        cost_tables: ranks.iter().map(|m| m.table.clone()).collect(),
        cast_models: ranks.iter().map(|m| m.casts.clone()).collect(),
        ranks: rank_plans,
        budget_ms,
        predicted_step_ms: step.step_ms,
        measured_step_ms: None,
        trace,
        replaced: Vec::new(),
    };
    Ok(GangPlan { report, plans })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::qsync::{GradBucket, GraphOp};
    use tessera_api::precision::{CastFit, OpCost, OpTiming};
    use Precision::*;

    /// embeddings, its LayerNorm, two linears, the head: the shapes of a small encoder.
    fn graph() -> TrainingGraph {
        let op = |name: &str, kind, input, weight| GraphOp {
            name: name.into(),
            kind,
            input,
            input_numel: 4096,
            weight_numel: weight,
            output_numel: 4096,
        };
        TrainingGraph {
            ops: vec![
                op("embeddings", OpKind::Embedding, None, 30_000),
                op("embeddings.LayerNorm", OpKind::LayerNorm, Some(0), 0),
                op("layer.0.query", OpKind::Linear, Some(1), 16_384),
                op("layer.0.intermediate", OpKind::Linear, None, 65_536),
                op("head", OpKind::Head, None, 128),
            ],
            buckets: vec![GradBucket { ops: (0..5).collect(), allreduce_ms: 0.5 }],
        }
    }

    /// A rank whose every time is `scale` × the base figures; int8 and bf16 linears are
    /// cheaper than f32 (as this CPU's GEMMs are), 16-bit norms and embeddings save a little.
    fn rank(device: &str, scale: f64) -> RankMeasurement {
        let timing = |precision, forward_ms: f64, backward_ms: f64| OpTiming {
            precision,
            forward_ms: forward_ms * scale,
            backward_ms: backward_ms * scale,
        };
        let cost = |name: &str, kind, timings| OpCost { op: name.into(), kind, timings };
        let table = CostTable {
            device: device.into(),
            ops: vec![
                cost("embeddings", OpKind::Embedding, vec![timing(Bf16, 0.9, 1.8), timing(F32, 1.0, 2.0)]),
                cost("embeddings.LayerNorm", OpKind::LayerNorm, vec![timing(Bf16, 0.45, 0.9), timing(F32, 0.5, 1.0)]),
                cost(
                    "layer.0.query",
                    OpKind::Linear,
                    vec![timing(Int8, 1.0, 3.0), timing(Bf16, 1.2, 3.2), timing(F32, 4.0, 8.0)],
                ),
                cost(
                    "layer.0.intermediate",
                    OpKind::Linear,
                    vec![timing(Int8, 3.0, 9.0), timing(Bf16, 4.0, 9.5), timing(F32, 12.0, 24.0)],
                ),
                cost("head", OpKind::Head, vec![timing(F32, 0.1, 0.2)]),
            ],
            overhead_ms: 2.0 * scale,
            optimizer_ms: 1.0,
            casts_in_op_time: true,
        };
        let fit = |from, to| CastFit { from, to, ms_per_element: 1e-7, fixed_ms: 0.001, r2: 0.99, samples: 3 };
        RankMeasurement { table, casts: CastModel { fits: vec![fit(F32, Bf16), fit(Bf16, F32)] }, allreduce_ms: 0.5 }
    }

    /// Indicator rows per operator (int8, bf16, f16, f32): the intermediate is the more
    /// sensitive linear.
    fn indicators() -> Indicators {
        Indicators::from_values(vec![
            [9.0, 0.3, 0.1, 0.0],
            [9.0, 0.2, 0.1, 0.0],
            [1.0, 0.4, 0.1, 0.0],
            [8.0, 3.0, 0.5, 0.0],
            [5.0, 2.0, 1.0, 0.0],
        ])
    }

    fn floors_hold(plan: &[Precision], graph: &TrainingGraph, low: Precision) {
        for (op, &p) in graph.ops.iter().zip(plan) {
            let floor = KeepRule::floor(&KeepRule::qsync_defaults(), &op.name, op.kind).max(low);
            assert!(p >= floor, "{} at {p}, below {floor}", op.name);
        }
    }

    #[test]
    fn the_slow_rank_lowers_operators_and_the_fast_rank_stays_f32() {
        let graph = graph();
        let ranks = [rank("cpu:fast", 1.0), rank("cpu:slow", 1.8)];
        let gang = plan_gang(PrecisionPolicy::Qsync, Int8, 1, &graph, &ranks, &indicators()).unwrap();
        assert_eq!(gang.plans[0], vec![F32; 5]);
        assert!(gang.plans[1].iter().any(|&p| p < F32), "{:?}", gang.plans[1]);
        floors_hold(&gang.plans[1], &graph, Int8);
        // The query (cheaper to lower, less sensitive) goes below f32 before the intermediate.
        assert!(gang.plans[1][2] <= gang.plans[1][3], "{:?}", gang.plans[1]);

        let report = &gang.report;
        assert_eq!(report.indicator, IndicatorKind::GradientVariance);
        assert_eq!((report.cost_tables.len(), report.cast_models.len(), report.ranks.len()), (2, 2, 2));
        assert_eq!(report.cost_tables[1].device, "cpu:slow");
        for (rank, plan) in report.ranks.iter().enumerate() {
            assert_eq!(plan.rank, rank as u32);
            let names: Vec<&str> = plan.ops.iter().map(|op| op.op.as_str()).collect();
            assert_eq!(names, ["embeddings", "embeddings.LayerNorm", "layer.0.query", "layer.0.intermediate", "head"]);
            let precisions: Vec<Precision> = plan.ops.iter().map(|op| op.precision).collect();
            assert_eq!(precisions, gang.plans[rank]);
            for (i, op) in plan.ops.iter().enumerate() {
                assert_eq!(op.indicator, indicators().value(i, op.precision));
            }
            assert!((plan.indicator_sum - plan.ops.iter().map(|op| op.indicator).sum::<f64>()).abs() < 1e-12);
            assert!(plan.predicted_ms > 0.0);
        }
        assert_eq!(report.ranks[0].indicator_sum, 0.0);
        // The slow rank is predicted faster than at f32, and the step is the slower rank's.
        let slow_f32 = 1.8 * (2.0 + 3.0 + 1.5 + 12.0 + 36.0 + 0.3);
        assert!(report.ranks[1].predicted_ms < slow_f32, "{}", report.ranks[1].predicted_ms);
        assert!(report.predicted_step_ms >= report.ranks[1].predicted_ms.max(report.ranks[0].predicted_ms));
        // The trace's accepted raises, applied to the fastest plan, give the slow rank's plan.
        assert!(!report.trace.is_empty());
        let accepted = report.trace.iter().take_while(|s| s.accepted).count();
        assert!(report.trace[accepted..].iter().all(|s| !s.accepted));
        for step in &report.trace[..accepted] {
            assert!(step.predicted_ms <= report.budget_ms + 1e-9, "{step:?} over {}", report.budget_ms);
        }
        assert_eq!(report.measured_step_ms, None);
    }

    #[test]
    fn predict_gang_replays_the_plans_plan_gang_reports() {
        let graph = graph();
        let ranks = [rank("fast", 1.0), rank("slow", 1.8)];
        let gang = plan_gang(PrecisionPolicy::Qsync, Int8, 1, &graph, &ranks, &indicators()).unwrap();
        let step = predict_gang(&graph, &ranks, &gang.plans).unwrap();
        assert_eq!(step.step_ms, gang.report.predicted_step_ms);
        for (predicted, planned) in step.ranks.iter().zip(&gang.report.ranks) {
            assert_eq!(predicted.compute_ms, planned.predicted_ms);
        }
        // All f32, the slow rank sets the pace: the fast one waits for it, and the step is
        // longer than with the slow rank lowered.
        let all_f32 = predict_gang(&graph, &ranks, &[vec![F32; 5], vec![F32; 5]]).unwrap();
        assert!(all_f32.step_ms > step.step_ms, "{} <= {}", all_f32.step_ms, step.step_ms);
        assert!(all_f32.ranks[0].wait_ms > all_f32.ranks[1].wait_ms, "{:?}", all_f32.ranks);
        // Lowering the fast rank changes nothing of the step but its waiting.
        let fast_lowered = predict_gang(&graph, &ranks, &[vec![Bf16, Bf16, Int8, Int8, F32], vec![F32; 5]]).unwrap();
        assert_eq!(fast_lowered.step_ms, all_f32.step_ms);
    }

    #[test]
    fn ranks_of_equal_speed_all_stay_f32_under_every_policy() {
        let graph = graph();
        // 3% apart: timing noise, not a slower device.
        let ranks = [rank("a", 1.0), rank("b", 1.03)];
        for policy in [PrecisionPolicy::Qsync, PrecisionPolicy::Random, PrecisionPolicy::Uniform] {
            let gang = plan_gang(policy, Int8, 3, &graph, &ranks, &indicators()).unwrap();
            assert!(gang.plans.iter().all(|plan| plan.iter().all(|&p| p == F32)), "{policy:?}: {:?}", gang.plans);
            assert!(gang.report.trace.is_empty());
        }
    }

    #[test]
    fn uniform_lowers_every_operator_the_keep_list_allows_on_the_slow_rank() {
        let graph = graph();
        let ranks = [rank("fast", 1.0), rank("slow", 3.0), rank("fast too", 1.01)];
        let gang = plan_gang(PrecisionPolicy::Uniform, Int8, 1, &graph, &ranks, &indicators()).unwrap();
        assert_eq!(gang.plans[1], [Bf16, Bf16, Int8, Int8, F32]);
        assert_eq!(gang.plans[0], vec![F32; 5]);
        assert_eq!(gang.plans[2], vec![F32; 5]);
        assert!(gang.report.trace.is_empty());
        let bf16 = plan_gang(PrecisionPolicy::Uniform, Bf16, 1, &graph, &ranks, &indicators()).unwrap();
        assert_eq!(bf16.plans[1], [Bf16, Bf16, Bf16, Bf16, F32]);
    }

    #[test]
    fn a_bf16_floor_keeps_int8_out_of_every_plan() {
        let graph = graph();
        let ranks = [rank("fast", 1.0), rank("slow", 2.5)];
        for policy in [PrecisionPolicy::Qsync, PrecisionPolicy::Random] {
            let gang = plan_gang(policy, Bf16, 5, &graph, &ranks, &indicators()).unwrap();
            floors_hold(&gang.plans[1], &graph, Bf16);
            assert!(gang.plans[1].iter().any(|&p| p == Bf16), "{policy:?}: {:?}", gang.plans[1]);
        }
    }

    #[test]
    fn the_random_ablation_searches_shuffled_values_and_reports_the_real_ones() {
        let graph = graph();
        let ranks = [rank("fast", 1.0), rank("slow", 1.6)];
        let gang = plan_gang(PrecisionPolicy::Random, Int8, 42, &graph, &ranks, &indicators()).unwrap();
        assert_eq!(gang.report.indicator, IndicatorKind::Random { seed: 42 });
        assert_eq!(gang, plan_gang(PrecisionPolicy::Random, Int8, 42, &graph, &ranks, &indicators()).unwrap());
        floors_hold(&gang.plans[1], &graph, Int8);
        for (i, op) in gang.report.ranks[1].ops.iter().enumerate() {
            assert_eq!(op.indicator, indicators().value(i, op.precision));
        }
    }

    #[test]
    fn measurements_that_do_not_fit_the_graph_are_refused() {
        let graph = graph();
        let mut short = rank("slow", 2.0);
        short.table.ops.pop();
        let err =
            plan_gang(PrecisionPolicy::Qsync, Int8, 1, &graph, &[rank("fast", 1.0), short], &indicators()).unwrap_err();
        assert!(matches!(err, QsyncError::MissingOp(ref op) if op == "head"), "{err}");
        let few = Indicators::from_values(vec![[0.0; 4]; 2]);
        let err = plan_gang(PrecisionPolicy::Qsync, Int8, 1, &graph, &[rank("a", 1.0)], &few).unwrap_err();
        assert!(matches!(err, QsyncError::IndicatorLength { expected: 5, got: 2 }), "{err}");
    }
}
