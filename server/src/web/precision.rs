//! The job page's precision-plan panel for data-parallel jobs (QSync, issue 12): a card per
//! rank (predicted against measured time, waiting), the layer × rank precision table with
//! indicator values, step time against the budget, final accuracy beside the baselines
//! (`training::precision::baselines` says which jobs), and the allocator's trace.

use std::collections::BTreeMap;

use chrono::Utc;
use tessera_api::jobs::{Job, JobSpec};
use tessera_api::parallel::RankStep;
use tessera_api::precision::{IndicatorKind, OpKind, PrecisionPlanReport, RankPlan, ReplacedPlan};

use super::chart::{self, Chart};
use super::format;
use crate::error::Result;
use crate::state::AppState;
use crate::store::db::time;
use crate::store::{gangs, precision as store};
use crate::training::precision::{baselines, final_eval, Policy};

/// Buckets the step-time chart draws at most.
const CHART_BUCKETS: usize = 150;
/// Allocator steps the page lists (the API has them all).
const TRACE_ROWS: usize = 500;

pub struct RankCard {
    pub rank: u32,
    pub device: String,
    /// How many operators run at each precision, e.g. `4 int8 · 8 f32`.
    pub mix: String,
    /// The plan's prediction of the rank's own iteration (forward, backward, casts).
    pub predicted: String,
    /// Median over the measured steps of the step less waiting and all-reduce.
    pub compute: String,
    /// `compute` against `predicted`, e.g. `+3.2 %`; empty before any step.
    pub error: String,
    pub step: String,
    pub waiting: String,
    /// Waiting as a share of the step.
    pub waiting_share: String,
    pub allreduce: String,
    pub steps: usize,
}

pub struct HeatCell {
    pub precision: &'static str,
    pub indicator: String,
}

pub struct HeatRow {
    pub op: String,
    pub kind: &'static str,
    pub cells: Vec<HeatCell>,
}

pub struct AccuracyRow {
    pub href: String,
    pub name: String,
    pub policy: String,
    pub state: &'static str,
    /// `accuracy 0.9412 @ 300`, or `—` before any evaluation.
    pub metric: String,
    /// This job less the baseline (accuracy in points); empty on this job's own row.
    pub difference: String,
    pub this: bool,
}

/// A plan the run dropped because its ranks drifted apart from its prediction.
pub struct ReplacedRow {
    pub step: u64,
    /// Per rank: `rank 1: 30.0 ms measured, 12.0 ms predicted (+150 %), 4 operators below f32`.
    pub ranks: Vec<String>,
}

pub struct TraceRow {
    pub op: String,
    pub from: &'static str,
    pub to: &'static str,
    pub gain: String,
    pub cost: String,
    pub predicted: String,
    pub accepted: bool,
}

/// What the job page shows of a plan.
pub struct PlanView {
    pub policy: String,
    pub indicator: String,
    pub budget: String,
    pub predicted_step: String,
    pub measured_step: String,
    pub updated_ago: String,
    pub cards: Vec<RankCard>,
    /// Column heads of the heat map: `rank 0`, with the device below.
    pub columns: Vec<(u32, String)>,
    pub rows: Vec<HeatRow>,
    pub chart: Chart,
    /// First and last step the chart covers.
    pub chart_span: (u64, u64),
    pub steps_measured: usize,
    /// Share of measured steps at or under the budget, e.g. `92 %`.
    pub within_budget: String,
    pub accuracy: Vec<AccuracyRow>,
    pub trace: Vec<TraceRow>,
    pub trace_total: usize,
    /// The run's earlier plans, oldest first; the cards and chart figures are this plan's.
    pub replaced: Vec<ReplacedRow>,
    pub trace_accepted: usize,
}

fn ms(value: f64) -> String {
    if value.abs() >= 100.0 {
        format!("{value:.0} ms")
    } else if value.abs() >= 10.0 {
        format!("{value:.1} ms")
    } else {
        format!("{value:.2} ms")
    }
}

/// An indicator value: exactly 0 (f32) reads as 0, the rest in scientific notation.
fn omega(value: f64) -> String {
    if value == 0.0 {
        "0".into()
    } else {
        format!("{value:.3e}")
    }
}

fn median(mut values: Vec<f64>) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    Some(if values.len() % 2 == 1 { values[mid] } else { (values[mid - 1] + values[mid]) / 2.0 })
}

fn kind_name(kind: OpKind) -> &'static str {
    match kind {
        OpKind::Linear => "linear",
        OpKind::Embedding => "embedding",
        OpKind::LayerNorm => "layer norm",
        OpKind::Activation => "activation",
        OpKind::Head => "head",
    }
}

fn card(plan: &RankPlan, steps: &[&RankStep]) -> RankCard {
    let mut counts: BTreeMap<_, usize> = BTreeMap::new();
    for op in &plan.ops {
        *counts.entry(op.precision).or_default() += 1;
    }
    let mix = counts.iter().map(|(p, n)| format!("{n} {p}")).collect::<Vec<_>>().join(" · ");
    let of = |f: fn(&RankStep) -> f64| median(steps.iter().map(|s| f(s)).collect());
    let compute = of(|s| (s.iter_ms - s.wait_ms - s.allreduce_ms).max(0.0));
    let (step, waiting, allreduce) = (of(|s| s.iter_ms), of(|s| s.wait_ms), of(|s| s.allreduce_ms));
    let dash = || "—".to_string();
    RankCard {
        rank: plan.rank,
        device: plan.device.clone(),
        mix,
        predicted: ms(plan.predicted_ms),
        compute: compute.map(ms).unwrap_or_else(dash),
        error: match compute {
            Some(c) if plan.predicted_ms > 0.0 => {
                format!("{:+.1} %", (c - plan.predicted_ms) / plan.predicted_ms * 100.0)
            }
            _ => String::new(),
        },
        step: step.map(ms).unwrap_or_else(dash),
        waiting: waiting.map(ms).unwrap_or_else(dash),
        waiting_share: match (waiting, step) {
            (Some(w), Some(s)) if s > 0.0 => format!("{:.0} % of the step", w / s * 100.0),
            _ => String::new(),
        },
        allreduce: allreduce.map(ms).unwrap_or_else(dash),
        steps: steps.len(),
    }
}

/// The synchronous step time per step (the slowest rank's), and the worker's per-step
/// prediction where it sent one, by step.
fn step_times(steps: &[RankStep]) -> BTreeMap<u64, (f64, Option<f64>)> {
    let mut by_step: BTreeMap<u64, (f64, Option<f64>)> = BTreeMap::new();
    for s in steps {
        let entry = by_step.entry(s.step).or_insert((0.0, None));
        entry.0 = entry.0.max(s.iter_ms);
        if let Some(p) = s.predicted_ms {
            entry.1 = Some(entry.1.map_or(p, |q: f64| q.max(p)));
        }
    }
    by_step
}

/// Mean of each of at most `CHART_BUCKETS` runs of consecutive values.
fn buckets(values: &[Option<f64>]) -> Vec<Option<f64>> {
    let size = values.len().div_ceil(CHART_BUCKETS).max(1);
    values
        .chunks(size)
        .map(|chunk| {
            let known: Vec<f64> = chunk.iter().flatten().copied().collect();
            (!known.is_empty()).then(|| known.iter().sum::<f64>() / known.len() as f64)
        })
        .collect()
}

fn iteration_chart(report: &PrecisionPlanReport, by_step: &BTreeMap<u64, (f64, Option<f64>)>) -> Chart {
    let measured: Vec<Option<f64>> = by_step.values().map(|(t, _)| Some(*t)).collect();
    let per_step_prediction = by_step.values().any(|(_, p)| p.is_some());
    let predicted: Vec<Option<f64>> = if per_step_prediction {
        by_step.values().map(|(_, p)| *p).collect()
    } else {
        vec![Some(report.predicted_step_ms); measured.len()]
    };
    let measured = buckets(&measured);
    let n = measured.len().max(2);
    let series = [
        ("measured step", measured),
        ("budget", vec![Some(report.budget_ms); n]),
        ("predicted", if by_step.is_empty() { vec![Some(report.predicted_step_ms); n] } else { buckets(&predicted) }),
    ];
    chart::chart("Step time", "ms", &series, ms)
}

fn replaced_row(dropped: &ReplacedPlan) -> ReplacedRow {
    let ranks = dropped
        .measured_ms
        .iter()
        .zip(&dropped.predicted_ms)
        .zip(&dropped.lowered)
        .enumerate()
        .map(|(rank, ((&measured, &predicted), lowered))| {
            let off = match predicted > 0.0 {
                true => format!(" ({:+.0} %)", (measured / predicted - 1.0) * 100.0),
                false => String::new(),
            };
            let (measured, predicted) = (ms(measured), ms(predicted));
            format!("rank {rank}: {measured} measured, {predicted} predicted{off}, {lowered} operators below f32")
        })
        .collect();
    ReplacedRow { step: dropped.step, ranks }
}

fn indicator_name(kind: IndicatorKind) -> String {
    match kind {
        IndicatorKind::GradientVariance => "gradient variance with depth weighting (QSync)".into(),
        IndicatorKind::Random { seed } => format!("random, seed {seed} (ablation)"),
    }
}

async fn accuracy_rows(state: &AppState, job: &Job) -> Result<Vec<AccuracyRow>> {
    let ours = final_eval(&state.db, job.id).await?;
    let policy = match &job.spec {
        JobSpec::Train(train) => Policy::of(train).label(),
        _ => String::new(),
    };
    let describe = |found: Option<(&'static str, i64, f64)>| match found {
        Some((metric, step, value)) => format!("{metric} {} @ {step}", format::number(value)),
        None => "—".into(),
    };
    let mut rows = vec![AccuracyRow {
        href: format!("/jobs/{}", job.id),
        name: job.name.clone(),
        policy,
        state: job.state.as_str(),
        metric: describe(ours),
        difference: String::new(),
        this: true,
    }];
    for (other, policy) in baselines(&state.db, job).await? {
        let theirs = final_eval(&state.db, other.id).await?;
        let difference = match (ours, theirs) {
            (Some(("accuracy", _, a)), Some(("accuracy", _, b))) => format!("{:+.2} points", (a - b) * 100.0),
            (Some((m, _, a)), Some((n, _, b))) if m == n => format!("{m} {:+.4}", a - b),
            _ => String::new(),
        };
        rows.push(AccuracyRow {
            href: format!("/jobs/{}", other.id),
            name: other.name.clone(),
            policy: policy.label(),
            state: other.state.as_str(),
            metric: describe(theirs),
            difference,
            this: false,
        });
    }
    Ok(rows)
}

/// The panel for `job`, or `None` when it is not data-parallel or has no plan yet.
pub async fn view(state: &AppState, job: &Job) -> Result<Option<PlanView>> {
    let JobSpec::Train(train) = &job.spec else { return Ok(None) };
    if train.parallel.is_none() {
        return Ok(None);
    }
    let Some((report, updated_at)) = store::get(&state.db, job.id).await? else { return Ok(None) };
    // The steps since the plan in force was asked for (a run that planned again dropped
    // the earlier plans at the step `replaced` names).
    let since = report.replaced.last().map_or(0, |dropped| dropped.step);
    let steps: Vec<RankStep> =
        gangs::rank_steps(&state.db, job.id).await?.into_iter().filter(|s| s.step > since).collect();
    let cards = report
        .ranks
        .iter()
        .map(|plan| card(plan, &steps.iter().filter(|s| s.rank == plan.rank).collect::<Vec<_>>()))
        .collect();
    let columns = report.ranks.iter().map(|r| (r.rank, r.device.clone())).collect();
    let rows = report.ranks.first().map_or(Vec::new(), |first| {
        first
            .ops
            .iter()
            .enumerate()
            .map(|(i, op)| HeatRow {
                op: op.op.clone(),
                kind: kind_name(op.kind),
                cells: report
                    .ranks
                    .iter()
                    .filter_map(|r| r.ops.get(i))
                    .map(|o| HeatCell { precision: o.precision.as_str(), indicator: omega(o.indicator) })
                    .collect(),
            })
            .collect()
    });
    let by_step = step_times(&steps);
    let measured = median(by_step.values().map(|(t, _)| *t).collect());
    let within = by_step.values().filter(|(t, _)| *t <= report.budget_ms).count();
    let trace_accepted = report.trace.iter().filter(|s| s.accepted).count();
    Ok(Some(PlanView {
        policy: Policy::of(train).label(),
        indicator: indicator_name(report.indicator),
        budget: ms(report.budget_ms),
        predicted_step: ms(report.predicted_step_ms),
        measured_step: report.measured_step_ms.or(measured).map(ms).unwrap_or_else(|| "—".into()),
        updated_ago: format::ago(time(updated_at), Utc::now()),
        cards,
        columns,
        rows,
        chart: iteration_chart(&report, &by_step),
        chart_span: (by_step.keys().next().copied().unwrap_or(0), by_step.keys().last().copied().unwrap_or(0)),
        steps_measured: by_step.len(),
        within_budget: if by_step.is_empty() {
            String::new()
        } else {
            format!("{:.0} %", within as f64 / by_step.len() as f64 * 100.0)
        },
        accuracy: accuracy_rows(state, job).await?,
        trace: report
            .trace
            .iter()
            .take(TRACE_ROWS)
            .map(|s| TraceRow {
                op: s.op.clone(),
                from: s.from.as_str(),
                to: s.to.as_str(),
                gain: format!("{:.3e}", s.gain),
                cost: format!("{:+.3} ms", s.cost_ms),
                predicted: ms(s.predicted_ms),
                accepted: s.accepted,
            })
            .collect(),
        trace_total: report.trace.len(),
        replaced: report.replaced.iter().map(replaced_row).collect(),
        trace_accepted,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(rank: u32, step: u64, iter_ms: f64, predicted_ms: Option<f64>) -> RankStep {
        RankStep { rank, step, iter_ms, wait_ms: 1.0, allreduce_ms: 0.5, predicted_ms }
    }

    #[test]
    fn the_step_time_is_the_slowest_ranks() {
        let steps = [step(0, 1, 10.0, None), step(1, 1, 12.0, Some(11.0)), step(0, 2, 9.0, Some(9.5))];
        let by_step = step_times(&steps);
        assert_eq!(by_step[&1], (12.0, Some(11.0)));
        assert_eq!(by_step[&2], (9.0, Some(9.5)));
    }

    #[test]
    fn long_runs_are_bucketed_by_their_mean() {
        let values: Vec<Option<f64>> = (0..300).map(|i| Some(i as f64)).collect();
        let out = buckets(&values);
        assert_eq!(out.len(), CHART_BUCKETS);
        assert_eq!(out[0], Some(0.5));
        assert_eq!(buckets(&[None, Some(2.0)]), vec![None, Some(2.0)]);
    }

    #[test]
    fn medians_and_durations_read_as_people_write_them() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0]), Some(2.5));
        assert_eq!(median(vec![]), None);
        assert_eq!((ms(4.126), ms(41.26), ms(412.6)), ("4.13 ms".into(), "41.3 ms".into(), "413 ms".into()));
        assert_eq!((omega(0.0), omega(0.0042)), ("0".into(), "4.200e-3".into()));
    }
}
