//! QSync's allocator (`Syncer/algos.py::greedy`): start the slow rank at its fastest plan,
//! take the budget from the fast ranks (the predicted synchronous step with the slow rank
//! at its fastest), and raise operators' precision in order of indicator gain per unit of
//! predicted cost while the prediction stays within the budget.
//!
//! Departures from the released code, each for a property the tests check:
//! - The gain of a raise is ω(current) − ω(raised) (the code's `ω[idx] − ω[idx−1]` looks like
//!   an off-by-one), divided by the raise's predicted cost on the rank (the code ranks by
//!   gain alone), and a raise may skip a level (the indicator does not order int8 against
//!   16 bits, see `indicator`).
//! - The search walks one path that does not depend on the budget, taking the best raise
//!   whether or not it fits, and the plan is the path's furthest state predicted within
//!   budget. QSync instead skips a raise that does not fit and goes on; that can give a
//!   larger budget a worse plan. Ours is never over budget, never worse for a larger
//!   budget, and all f32 whenever all f32 fits.

use tessera_api::precision::{
    AllocationStep, KeepRule, PlannedOp, Precision, RankPlan,
};

use super::indicator::Indicators;
use super::replay::{replay_step, RankProfile, RankTimeline, TrainingGraph};
use super::QsyncError;

/// A plan's predicted times, milliseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prediction {
    /// The planned rank's own iteration time: what a raise costs.
    pub rank_ms: f64,
    /// The synchronous step across ranks: what the budget bounds.
    pub step_ms: f64,
}

/// What the search chose.
#[derive(Debug, Clone, PartialEq)]
pub struct Allocation {
    /// The fastest plan the search started from.
    pub start: Vec<Precision>,
    pub plan: Vec<Precision>,
    pub budget_ms: f64,
    pub predicted: Prediction,
    /// The start itself is predicted over budget: no plan of this rank fits, and the plan is
    /// the fastest one.
    pub start_over_budget: bool,
    /// Every raise of the path, the accepted prefix first.
    pub trace: Vec<AllocationStep>,
}

impl Allocation {
    /// Σω of the plan.
    pub fn indicator_sum(&self, indicators: &Indicators) -> f64 {
        self.plan
            .iter()
            .enumerate()
            .map(|(i, &p)| indicators.value(i, p))
            .sum()
    }

    /// The wire form of this rank's plan.
    pub fn rank_plan(
        &self,
        rank: u32,
        device: &str,
        graph: &TrainingGraph,
        indicators: &Indicators,
    ) -> RankPlan {
        RankPlan {
            rank,
            device: device.to_string(),
            ops: graph
                .ops
                .iter()
                .zip(&self.plan)
                .enumerate()
                .map(|(i, (op, &precision))| PlannedOp {
                    op: op.name.clone(),
                    kind: op.kind,
                    precision,
                    indicator: indicators.value(i, precision),
                })
                .collect(),
            predicted_ms: self.predicted.rank_ms,
            indicator_sum: self.indicator_sum(indicators),
        }
    }
}

/// The search over plain data. `levels[i]` are the precisions operator i may take, in
/// ascending order and ending at f32; `start[i]` is one of them; `names` label the trace;
/// `predict` prices any plan.
pub fn greedy(
    names: &[String],
    levels: &[Vec<Precision>],
    indicators: &Indicators,
    start: &[Precision],
    budget_ms: f64,
    predict: &mut dyn FnMut(&[Precision]) -> Result<Prediction, QsyncError>,
) -> Result<Allocation, QsyncError> {
    let n = levels.len();
    if start.len() != n || names.len() != n {
        return Err(QsyncError::PlanLength {
            expected: n,
            got: start.len().min(names.len()),
        });
    }
    if indicators.len() != n {
        return Err(QsyncError::IndicatorLength {
            expected: n,
            got: indicators.len(),
        });
    }
    let mut state = start.to_vec();
    let mut current = predict(&state)?;
    let start_prediction = current;
    // (step, prediction after it, operator index) along the budget-independent path.
    let mut path: Vec<(AllocationStep, Prediction, usize)> = Vec::new();
    loop {
        let mut best: Option<(Candidate, Prediction)> = None;
        for i in 0..n {
            let from = state[i];
            for &to in levels[i].iter().filter(|&&p| p > from) {
                state[i] = to;
                let trial = predict(&state)?;
                state[i] = from;
                let candidate = Candidate {
                    op: i,
                    to,
                    gain: indicators.value(i, from) - indicators.value(i, to),
                    cost: trial.rank_ms - current.rank_ms,
                };
                if best.as_ref().is_none_or(|(b, _)| candidate.beats(b)) {
                    best = Some((candidate, trial));
                }
            }
        }
        let Some((c, trial)) = best else { break };
        path.push((
            AllocationStep {
                op: names[c.op].clone(),
                from: state[c.op],
                to: c.to,
                gain: c.gain,
                cost_ms: c.cost,
                predicted_ms: trial.step_ms,
                accepted: false,
            },
            trial,
            c.op,
        ));
        state[c.op] = c.to;
        current = trial;
    }

    // The furthest state within budget; the start when none is.
    let accepted = path
        .iter()
        .rposition(|(_, p, _)| p.step_ms <= budget_ms)
        .map_or(0, |k| k + 1);
    let mut plan = start.to_vec();
    let mut predicted = start_prediction;
    for (step, prediction, op) in path.iter_mut().take(accepted) {
        step.accepted = true;
        plan[*op] = step.to;
        predicted = *prediction;
    }
    Ok(Allocation {
        start: start.to_vec(),
        plan,
        budget_ms,
        predicted,
        start_over_budget: start_prediction.step_ms > budget_ms,
        trace: path.into_iter().map(|(step, _, _)| step).collect(),
    })
}

struct Candidate {
    op: usize,
    to: Precision,
    gain: f64,
    cost: f64,
}

/// Raises that cost nothing measurable.
const FREE_MS: f64 = 1e-9;

impl Candidate {
    /// Free raises that lower the indicator come first (largest gain first), then the rest by
    /// gain per millisecond; ties go to the earlier operator, then the smaller raise, so the
    /// path is deterministic.
    fn beats(&self, other: &Candidate) -> bool {
        let key = |c: &Candidate| {
            if c.cost <= FREE_MS && c.gain > 0.0 {
                (1, c.gain)
            } else {
                (0, c.gain / c.cost.max(FREE_MS))
            }
        };
        let (a, b) = (key(self), key(other));
        a.0.cmp(&b.0)
            .then(a.1.total_cmp(&b.1))
            .then(other.op.cmp(&self.op))
            .then(other.to.cmp(&self.to))
            .is_gt()
    }
}

/// Planning one rank of a data-parallel job, the others' plans fixed.
pub struct RankPlanRequest<'a> {
    pub graph: &'a TrainingGraph,
    /// Every rank's profile, by rank.
    pub profiles: &'a [RankProfile],
    /// Every rank's current plan; the planned rank's entry is replaced.
    pub plans: &'a [Vec<Precision>],
    pub rank: usize,
    pub indicators: &'a Indicators,
    pub keep: &'a [KeepRule],
    /// `None`: QSync's budget, the predicted step with this rank at its fastest plan.
    pub budget_ms: Option<f64>,
}

/// QSync's allocation for one (slow) rank: its fastest plan within the keep-list, the
/// budget, and the greedy search priced by the replayer across all ranks.
pub fn plan_rank(request: &RankPlanRequest<'_>) -> Result<Allocation, QsyncError> {
    let RankPlanRequest {
        graph,
        profiles,
        plans,
        rank,
        indicators,
        keep,
        budget_ms,
    } = *request;
    let ranks = profiles.len();
    if rank >= ranks || plans.len() != ranks {
        return Err(QsyncError::NoRank {
            rank,
            ranks: ranks.min(plans.len()),
        });
    }
    let profile = &profiles[rank];
    let levels: Vec<Vec<Precision>> = graph
        .ops
        .iter()
        .enumerate()
        .map(|(i, op)| {
            let floor = KeepRule::floor(keep, &op.name, op.kind);
            profile
                .precisions(i)
                .into_iter()
                .filter(|&p| p >= floor)
                .collect()
        })
        .collect();
    let others: Vec<Option<RankTimeline>> = profiles
        .iter()
        .zip(plans)
        .enumerate()
        .map(|(r, (p, plan))| {
            if r == rank {
                Ok(None)
            } else {
                p.replay(graph, plan).map(Some)
            }
        })
        .collect::<Result<_, _>>()?;
    let mut predict = |plan: &[Precision]| -> Result<Prediction, QsyncError> {
        let mine = profile.replay(graph, plan)?;
        let rank_ms = mine.compute_ms;
        let timelines: Vec<RankTimeline> = others
            .iter()
            .map(|t| t.clone().unwrap_or_else(|| mine.clone()))
            .collect();
        Ok(Prediction {
            rank_ms,
            step_ms: replay_step(graph, &timelines).step_ms,
        })
    };
    let start = fastest_plan(profile, &levels, &mut predict)?;
    let budget = match budget_ms {
        Some(b) => b,
        None => predict(&start)?.step_ms,
    };
    let names: Vec<String> = graph.ops.iter().map(|op| op.name.clone()).collect();
    greedy(&names, &levels, indicators, &start, budget, &mut predict)
}

/// The fastest of: each operator at its own fastest measured precision, and each uniform
/// precision (clamped into each operator's levels). QSync starts from uniform f16 or an
/// exhaustive search over isomorphic blocks; with casts priced, a uniform plan can beat the
/// per-operator minimum, so both kinds are tried.
fn fastest_plan(
    profile: &RankProfile,
    levels: &[Vec<Precision>],
    predict: &mut dyn FnMut(&[Precision]) -> Result<Prediction, QsyncError>,
) -> Result<Vec<Precision>, QsyncError> {
    let mut candidates = vec![levels
        .iter()
        .enumerate()
        .map(|(i, ps)| {
            *ps.iter()
                .min_by(|&&a, &&b| {
                    profile
                        .op_ms(i, a)
                        .unwrap_or(f64::INFINITY)
                        .total_cmp(&profile.op_ms(i, b).unwrap_or(f64::INFINITY))
                })
                .expect("every operator has f32")
        })
        .collect::<Vec<_>>()];
    for p in Precision::ALL {
        candidates.push(
            levels
                .iter()
                .map(|ps| {
                    ps.iter()
                        .copied()
                        .find(|&q| q >= p)
                        .unwrap_or(Precision::F32)
                })
                .collect(),
        );
    }
    let mut best: Option<(f64, Vec<Precision>)> = None;
    for plan in candidates {
        let ms = predict(&plan)?.rank_ms;
        if best.as_ref().is_none_or(|(b, _)| ms < *b) {
            best = Some((ms, plan));
        }
    }
    Ok(best.expect("at least one candidate").1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::qsync::replay::{GradBucket, GraphOp};
    use proptest::prelude::*;
    use tessera_api::precision::{
        CastFit, CastModel, CostTable, OpCost, OpKind, OpSelector, OpTiming,
    };
    use Precision::*;

    /// A synthetic rank: each operator's time per precision plus a penalty for each pair of
    /// neighbours at different precisions (casts), so costs are not additive.
    #[derive(Debug, Clone)]
    struct Synthetic {
        levels: Vec<Vec<Precision>>,
        times: Vec<[f64; 4]>,
        omega: Vec<[f64; 4]>,
        boundary_ms: f64,
    }

    impl Synthetic {
        fn predict(&self, plan: &[Precision]) -> Prediction {
            let ops: f64 = plan
                .iter()
                .enumerate()
                .map(|(i, &p)| self.times[i][p as usize])
                .sum();
            let boundaries = plan.windows(2).filter(|w| w[0] != w[1]).count() as f64;
            let ms = ops + self.boundary_ms * boundaries;
            Prediction {
                rank_ms: ms,
                step_ms: ms,
            }
        }

        fn run(&self, budget: f64) -> Allocation {
            let names: Vec<String> = (0..self.levels.len()).map(|i| format!("op{i}")).collect();
            let start: Vec<Precision> = self.levels.iter().map(|l| l[0]).collect();
            let indicators = Indicators::from_values(self.omega.clone());
            greedy(
                &names,
                &self.levels,
                &indicators,
                &start,
                budget,
                &mut |p| Ok(self.predict(p)),
            )
            .unwrap()
        }
    }

    fn synthetic() -> impl Strategy<Value = Synthetic> {
        (1usize..7, 0.0f64..0.5).prop_flat_map(|(n, boundary_ms)| {
            let op = (
                prop::sample::subsequence(vec![Int8, Bf16, F16], 0..=3),
                prop::array::uniform4(0.1f64..4.0),
                prop::array::uniform3(0.0f64..10.0),
            );
            prop::collection::vec(op, n).prop_map(move |ops| {
                let mut s = Synthetic {
                    levels: vec![],
                    times: vec![],
                    omega: vec![],
                    boundary_ms,
                };
                for (mut lower, mut times, omega) in ops {
                    lower.push(F32);
                    // Lower precision is faster here, and ω falls towards 0 at f32.
                    times.sort_by(f64::total_cmp);
                    let mut o = [
                        omega[0] + omega[1] + omega[2],
                        omega[1] + omega[2],
                        omega[2],
                        0.0,
                    ];
                    if lower.len() == 1 {
                        o = [0.0; 4];
                    }
                    s.levels.push(lower);
                    s.times.push(times);
                    s.omega.push(o);
                }
                s
            })
        })
    }

    fn total_bits(plan: &[Precision]) -> u32 {
        plan.iter().map(|p| p.bits()).sum()
    }

    proptest! {
        #[test]
        fn never_over_budget(s in synthetic(), budget in 0.0f64..30.0) {
            let a = s.run(budget);
            let start = s.predict(&a.start).step_ms;
            prop_assert!(a.predicted.step_ms <= budget.max(start), "{} over {budget}", a.predicted.step_ms);
            prop_assert_eq!(a.predicted, s.predict(&a.plan));
            prop_assert_eq!(a.start_over_budget, start > budget);
        }

        #[test]
        fn larger_budget_never_plans_less_precision(s in synthetic(), b1 in 0.0f64..30.0, extra in 0.0f64..10.0) {
            let (small, large) = (s.run(b1), s.run(b1 + extra));
            let omega = Indicators::from_values(s.omega.clone());
            prop_assert!(total_bits(&large.plan) >= total_bits(&small.plan));
            prop_assert!(large.indicator_sum(&omega) <= small.indicator_sum(&omega) + 1e-12);
            for (l, m) in large.plan.iter().zip(&small.plan) {
                prop_assert!(l >= m, "{:?} vs {:?}", large.plan, small.plan);
            }
        }

        #[test]
        fn all_f32_whenever_it_fits(s in synthetic(), slack in 0.0f64..5.0) {
            let all_f32 = vec![F32; s.levels.len()];
            let a = s.run(s.predict(&all_f32).step_ms + slack);
            prop_assert_eq!(a.plan, all_f32);
        }

        #[test]
        fn plans_stay_within_the_allowed_levels(s in synthetic(), budget in 0.0f64..30.0) {
            let a = s.run(budget);
            for (i, p) in a.plan.iter().enumerate() {
                prop_assert!(s.levels[i].contains(p));
            }
            // The trace replays into the plan: accepted raises first, in order.
            let mut plan = a.start.clone();
            let mut seen_rejected = false;
            for step in &a.trace {
                if step.accepted {
                    prop_assert!(!seen_rejected);
                    prop_assert!(step.to > step.from);
                    let i: usize = step.op[2..].parse().unwrap();
                    prop_assert_eq!(plan[i], step.from);
                    plan[i] = step.to;
                } else {
                    seen_rejected = true;
                }
            }
            prop_assert_eq!(plan, a.plan);
        }
    }

    /// Two ranks replayed for real: random operator kinds and times, the fast rank f32 only,
    /// casts with random linear costs, one gradient bucket per operator.
    fn replayed_cluster() -> impl Strategy<Value = (TrainingGraph, Vec<RankProfile>, Indicators)> {
        let kinds = prop::sample::select(vec![
            OpKind::Linear,
            OpKind::Embedding,
            OpKind::LayerNorm,
            OpKind::Activation,
            OpKind::Head,
        ]);
        let op = (
            kinds,
            prop::array::uniform3(0.1f64..3.0),
            0.1f64..3.0,
            0.0f64..2.0,
        );
        (
            prop::collection::vec(op, 1..6),
            prop::array::uniform2(0.0f64..1e-3),
        )
            .prop_map(|(ops, cast)| {
                let graph = TrainingGraph {
                    ops: ops
                        .iter()
                        .enumerate()
                        .map(|(i, (kind, ..))| GraphOp {
                            name: format!("op{i}"),
                            kind: *kind,
                            input: i.checked_sub(1),
                            input_numel: 100 * (i + 1),
                            weight_numel: 50,
                            output_numel: 100 * (i + 2),
                        })
                        .collect(),
                    buckets: (0..ops.len())
                        .rev()
                        .map(|i| GradBucket {
                            ops: vec![i],
                            allreduce_ms: 0.1,
                        })
                        .collect(),
                };
                let table = |slow: bool| CostTable {
                    device: if slow { "cpu" } else { "gpu" }.into(),
                    ops: ops
                        .iter()
                        .enumerate()
                        .map(|(i, (kind, low, fast, _))| {
                            let mut timings = Vec::new();
                            if slow {
                                for (p, ms) in [(Int8, low[0]), (Bf16, low[1]), (F32, low[2] * 2.0)]
                                {
                                    timings.push(OpTiming {
                                        precision: p,
                                        forward_ms: ms,
                                        backward_ms: ms,
                                    });
                                }
                            } else {
                                timings.push(OpTiming {
                                    precision: F32,
                                    forward_ms: *fast,
                                    backward_ms: *fast,
                                });
                            }
                            OpCost {
                                op: format!("op{i}"),
                                kind: *kind,
                                timings,
                            }
                        })
                        .collect(),
                    overhead_ms: 0.0,
                    optimizer_ms: 0.2,
                    casts_in_op_time: false,
                };
                let fits = Precision::ALL
                    .iter()
                    .flat_map(|&from| {
                        Precision::ALL.map(|to| CastFit {
                            from,
                            to,
                            ms_per_element: cast[0],
                            fixed_ms: cast[1],
                            r2: 1.0,
                            samples: 2,
                        })
                    })
                    .collect();
                let casts = CastModel { fits };
                let profiles = vec![
                    RankProfile::new(&graph, &table(false), &casts, Bf16).unwrap(),
                    RankProfile::new(&graph, &table(true), &casts, Bf16).unwrap(),
                ];
                let omega = ops
                    .iter()
                    .map(|(.., w)| [3.0 * w, 2.0 * w, 1.0 * w, 0.0])
                    .collect();
                (graph, profiles, Indicators::from_values(omega))
            })
    }

    fn plan_slow_rank(
        graph: &TrainingGraph,
        profiles: &[RankProfile],
        indicators: &Indicators,
        keep: &[KeepRule],
        budget_ms: Option<f64>,
    ) -> Allocation {
        let plans = vec![vec![F32; graph.ops.len()]; 2];
        plan_rank(&RankPlanRequest {
            graph,
            profiles,
            plans: &plans,
            rank: 1,
            indicators,
            keep,
            budget_ms,
        })
        .unwrap()
    }

    proptest! {
        #[test]
        fn replayed_plans_keep_the_floors_and_the_budget(
            (graph, profiles, indicators) in replayed_cluster(),
            budget in proptest::option::of(0.0f64..40.0),
            extra in 0.0f64..10.0,
        ) {
            let keep = KeepRule::qsync_defaults();
            let a = plan_slow_rank(&graph, &profiles, &indicators, &keep, budget);
            for (op, p) in graph.ops.iter().zip(&a.plan) {
                let floor = match op.kind {
                    OpKind::LayerNorm | OpKind::Embedding => Bf16,
                    OpKind::Head => F32,
                    OpKind::Linear | OpKind::Activation => Int8,
                };
                prop_assert!(*p >= floor, "{} at {p} under {floor}", op.name);
            }
            // QSync's own budget always admits the start; any budget bounds the plan unless
            // even the start is over it.
            prop_assert!(budget.is_some() || !a.start_over_budget);
            prop_assert!(a.start_over_budget || a.predicted.step_ms <= a.budget_ms);
            let b = plan_slow_rank(&graph, &profiles, &indicators, &keep, Some(a.budget_ms + extra));
            for (more, less) in b.plan.iter().zip(&a.plan) {
                prop_assert!(more >= less, "{:?} vs {:?}", b.plan, a.plan);
            }
        }
    }

    #[test]
    fn highest_gain_per_millisecond_goes_first() {
        // op0: int8 → f32 gains 10 for 10 ms; op1 gains 6 for 2 ms; op2 gains 1 for free.
        let s = Synthetic {
            levels: vec![vec![Int8, F32], vec![Int8, F32], vec![Int8, F32]],
            times: vec![
                [1.0, 0.0, 0.0, 11.0],
                [1.0, 0.0, 0.0, 3.0],
                [1.0, 0.0, 0.0, 1.0],
            ],
            omega: vec![
                [10.0, 0.0, 0.0, 0.0],
                [6.0, 0.0, 0.0, 0.0],
                [1.0, 0.0, 0.0, 0.0],
            ],
            boundary_ms: 0.0,
        };
        let a = s.run(5.5);
        let order: Vec<&str> = a.trace.iter().map(|t| t.op.as_str()).collect();
        assert_eq!(order, ["op2", "op1", "op0"]);
        assert_eq!(
            a.trace.iter().map(|t| t.predicted_ms).collect::<Vec<_>>(),
            [3.0, 5.0, 15.0]
        );
        assert_eq!(
            a.trace.iter().map(|t| t.accepted).collect::<Vec<_>>(),
            [true, true, false]
        );
        assert_eq!(a.plan, [Int8, F32, F32]);
        assert_eq!(a.trace[1].cost_ms, 2.0);
        assert_eq!(a.trace[1].gain, 6.0);
    }

    /// Two ranks on a two-linear model with a head. The fast rank runs all f32 in 6 ms of
    /// compute; the slow one takes 4 ms per linear at f32, 1.5 at bf16, 1 at int8, and 1 ms
    /// for the head, which may only run f32. Casts are free, so plans are easy to time.
    fn two_ranks(keep: &[KeepRule]) -> (Allocation, Indicators, Vec<RankProfile>, TrainingGraph) {
        let op = |name: &str, kind| GraphOp {
            name: name.into(),
            kind,
            input: None,
            input_numel: 10,
            weight_numel: 10,
            output_numel: 10,
        };
        let graph = TrainingGraph {
            ops: vec![
                op("l1", OpKind::Linear),
                op("l2", OpKind::Linear),
                op("head", OpKind::Head),
            ],
            buckets: vec![GradBucket {
                ops: vec![2, 1, 0],
                allreduce_ms: 0.5,
            }],
        };
        let table = |device: &str, f32_ms: f64, low: &[(Precision, f64)]| CostTable {
            device: device.into(),
            ops: ["l1", "l2", "head"]
                .iter()
                .map(|&n| {
                    let mut timings = vec![OpTiming {
                        precision: F32,
                        forward_ms: f32_ms / 2.0,
                        backward_ms: f32_ms / 2.0,
                    }];
                    for &(precision, ms) in low {
                        timings.push(OpTiming {
                            precision,
                            forward_ms: ms / 2.0,
                            backward_ms: ms / 2.0,
                        });
                    }
                    OpCost {
                        op: n.into(),
                        kind: OpKind::Linear,
                        timings,
                    }
                })
                .collect(),
            overhead_ms: 0.0,
            optimizer_ms: 0.0,
            casts_in_op_time: false,
        };
        let free: Vec<CastFit> = Precision::ALL
            .iter()
            .flat_map(|&from| {
                Precision::ALL.map(|to| CastFit {
                    from,
                    to,
                    ms_per_element: 0.0,
                    fixed_ms: 0.0,
                    r2: 1.0,
                    samples: 2,
                })
            })
            .collect();
        let casts = CastModel { fits: free };
        let fast = RankProfile::new(&graph, &table("gpu", 2.0, &[]), &casts, Bf16).unwrap();
        let mut slow_table = table("cpu", 4.0, &[(Bf16, 1.5), (Int8, 1.0)]);
        slow_table.ops[2].timings.truncate(1);
        slow_table.ops[2].timings[0] = OpTiming {
            precision: F32,
            forward_ms: 0.5,
            backward_ms: 0.5,
        };
        let slow = RankProfile::new(&graph, &slow_table, &casts, Bf16).unwrap();
        // l2 is the more sensitive layer.
        let indicators = Indicators::from_values(vec![
            [2.0, 1.5, 1.0, 0.0],
            [8.0, 6.0, 4.0, 0.0],
            [9.0, 9.0, 9.0, 0.0],
        ]);
        let profiles = vec![fast, slow];
        let plans = vec![vec![F32; 3], vec![F32; 3]];
        let allocation = plan_rank(&RankPlanRequest {
            graph: &graph,
            profiles: &profiles,
            plans: &plans,
            rank: 1,
            indicators: &indicators,
            keep,
            budget_ms: None,
        })
        .unwrap();
        (allocation, indicators, profiles, graph)
    }

    #[test]
    fn slow_rank_gets_the_fast_ranks_step_as_budget() {
        let (a, indicators, profiles, graph) = two_ranks(&KeepRule::qsync_defaults());
        // Fastest: l1, l2 int8, head f32 (keep-list) = 3 ms, under the fast rank's 6 ms, so
        // the budget is the fast rank's step: 6 + 0.5 ms all-reduce tail.
        assert_eq!(a.start, [Int8, Int8, F32]);
        assert_eq!(a.budget_ms, 6.5);
        assert!(!a.start_over_budget);
        // By gain per ms: l2 to bf16 (2 for 0.5 ms) first, then l2 to f32 (6 for 2.5 ms) beats
        // l1 to bf16 (0.5 for 0.5 ms): 6 ms of compute, on budget. l1 to bf16 would then make
        // 6.5 ms of compute and a 7 ms step, so the plan stops there.
        assert_eq!(a.plan, [Int8, F32, F32]);
        assert_eq!(
            a.predicted,
            Prediction {
                rank_ms: 6.0,
                step_ms: 6.5
            }
        );
        let steps: Vec<(&str, Precision, Precision, bool)> = a
            .trace
            .iter()
            .map(|t| (t.op.as_str(), t.from, t.to, t.accepted))
            .collect();
        assert_eq!(
            steps,
            [
                ("l2", Int8, Bf16, true),
                ("l2", Bf16, F32, true),
                ("l1", Int8, Bf16, false),
                ("l1", Bf16, F32, false)
            ]
        );
        assert_eq!(a.trace[2].predicted_ms, 7.0);
        assert!(
            a.trace.iter().all(|t| t.op != "head"),
            "the head is kept at f32"
        );
        let wire = a.rank_plan(1, &profiles[1].device, &graph, &indicators);
        assert_eq!(wire.ops[1].precision, F32);
        assert_eq!(wire.indicator_sum, 2.0);
        assert_eq!(wire.predicted_ms, 6.0);
    }

    #[test]
    fn keep_list_floors_are_respected() {
        let keep = vec![
            KeepRule {
                select: OpSelector::Name("l1".into()),
                at_least: Bf16,
            },
            KeepRule {
                select: OpSelector::Kind(OpKind::Head),
                at_least: F32,
            },
        ];
        let (a, ..) = two_ranks(&keep);
        assert_eq!(a.start[0], Bf16);
        assert!(a.plan[0] >= Bf16);
        assert_eq!(a.plan[2], F32);
    }

    #[test]
    fn an_unknown_rank_is_refused() {
        let graph = TrainingGraph {
            ops: vec![],
            buckets: vec![],
        };
        let err = plan_rank(&RankPlanRequest {
            graph: &graph,
            profiles: &[],
            plans: &[],
            rank: 0,
            indicators: &Indicators::from_values(vec![]),
            keep: &[],
            budget_ms: None,
        })
        .unwrap_err();
        assert!(matches!(err, QsyncError::NoRank { rank: 0, ranks: 0 }));
    }
}
