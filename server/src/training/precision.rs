//! QSync precision plans of data-parallel jobs (issue 12) on the server: checking the
//! report rank 0 posts (bounded, and consistent with the gang it plans), keeping it under
//! the job users see, and the jobs a plan's accuracy is read against (its baselines).
//! The planning itself runs on the worker (`worker/src/train/qsync`).

use std::collections::HashSet;

use tessera_api::jobs::{Job, JobSpec};
use tessera_api::parallel::MAX_REPLANS;
use tessera_api::precision::{PrecisionPlanReport, RankPlan};
use tessera_api::train::{TrainJob, TrainModel};
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::store::db::{now_ms, Db};
use crate::store::precision as store;
use crate::store::training::last_eval;

/// Operators one rank's plan or cost table may list (MiniLM has about a hundred).
pub const MAX_OPS: usize = 4096;
/// Steps of the allocator's trace (each raises one operator one level or more).
pub const MAX_TRACE: usize = 4 * MAX_OPS;
/// Characters of an operator's or a device's name.
pub const MAX_NAME: usize = 200;
/// Cast fits per rank: one per ordered pair of the four precisions.
pub const MAX_CAST_FITS: usize = 12;

fn invalid(message: String) -> Error {
    Error::invalid("invalid_precision_plan", message)
}

fn finite(field: &str, value: f64) -> Result<()> {
    if value.is_finite() {
        Ok(())
    } else {
        Err(invalid(format!("{field} is not a finite number.")))
    }
}

/// A duration: finite milliseconds, 0 or more.
fn millis(field: &str, value: f64) -> Result<()> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(invalid(format!("{field} must be finite milliseconds, 0 or more (got {value}).")))
    }
}

fn name(field: &str, value: &str) -> Result<()> {
    if (1..=MAX_NAME).contains(&value.chars().count()) && !value.chars().any(char::is_control) {
        Ok(())
    } else {
        Err(invalid(format!("{field} must have 1 to {MAX_NAME} characters and no control characters.")))
    }
}

/// Checks a report against the gang it plans (`world` ranks): one plan, cost table and
/// cast model per rank in rank order, every rank planning the same operators in the same
/// order at precisions its own cost table measured, finite figures, bounded sizes.
pub fn check(report: &PrecisionPlanReport, world: u32) -> Result<()> {
    let world = world as usize;
    for (what, count) in [
        ("ranks", report.ranks.len()),
        ("cost_tables", report.cost_tables.len()),
        ("cast_models", report.cast_models.len()),
    ] {
        if count != world {
            return Err(invalid(format!(
                "{what} has {count} entries but the job runs {world} ranks; send one per rank, rank 0 first."
            )));
        }
    }
    millis("budget_ms", report.budget_ms)?;
    millis("predicted_step_ms", report.predicted_step_ms)?;
    if let Some(measured) = report.measured_step_ms {
        millis("measured_step_ms", measured)?;
    }
    for (i, table) in report.cost_tables.iter().enumerate() {
        name(&format!("cost_tables[{i}].device"), &table.device)?;
        if table.ops.len() > MAX_OPS {
            return Err(invalid(format!("cost_tables[{i}] lists {} operators; at most {MAX_OPS}.", table.ops.len())));
        }
        millis(&format!("cost_tables[{i}].overhead_ms"), table.overhead_ms)?;
        millis(&format!("cost_tables[{i}].optimizer_ms"), table.optimizer_ms)?;
        for (j, op) in table.ops.iter().enumerate() {
            let field = format!("cost_tables[{i}].ops[{j}]");
            name(&format!("{field}.op"), &op.op)?;
            let mut seen = HashSet::new();
            if op.timings.is_empty() || op.timings.iter().any(|t| !seen.insert(t.precision)) {
                return Err(invalid(format!("{field} needs one timing per precision it measured, each at most once.")));
            }
            for timing in &op.timings {
                millis(&format!("{field} {} forward_ms", timing.precision), timing.forward_ms)?;
                millis(&format!("{field} {} backward_ms", timing.precision), timing.backward_ms)?;
            }
        }
    }
    for (i, model) in report.cast_models.iter().enumerate() {
        if model.fits.len() > MAX_CAST_FITS {
            return Err(invalid(format!("cast_models[{i}] has {} fits; at most {MAX_CAST_FITS}.", model.fits.len())));
        }
        for (j, fit) in model.fits.iter().enumerate() {
            for (what, value) in [("ms_per_element", fit.ms_per_element), ("fixed_ms", fit.fixed_ms), ("r2", fit.r2)] {
                finite(&format!("cast_models[{i}].fits[{j}].{what}"), value)?;
            }
        }
    }
    let first = &report.ranks[0];
    for (i, plan) in report.ranks.iter().enumerate() {
        check_rank(i, plan, first, &report.cost_tables[i])?;
    }
    if report.trace.len() > MAX_TRACE {
        return Err(invalid(format!("The trace has {} steps; at most {MAX_TRACE}.", report.trace.len())));
    }
    let planned: HashSet<&str> = first.ops.iter().map(|op| op.op.as_str()).collect();
    for (k, step) in report.trace.iter().enumerate() {
        if !planned.contains(step.op.as_str()) {
            return Err(invalid(format!("trace[{k}] raises {:?}, which no rank plans.", step.op)));
        }
        if step.to <= step.from {
            return Err(invalid(format!(
                "trace[{k}] goes from {} to {}; each allocator step raises an operator's precision.",
                step.from, step.to
            )));
        }
        finite(&format!("trace[{k}].gain"), step.gain)?;
        finite(&format!("trace[{k}].cost_ms"), step.cost_ms)?;
        millis(&format!("trace[{k}].predicted_ms"), step.predicted_ms)?;
    }
    check_replaced(report, world)
}

/// The plans a report says the run dropped: at most `MAX_REPLANS`, in step order, each
/// with one figure per rank.
fn check_replaced(report: &PrecisionPlanReport, world: usize) -> Result<()> {
    if report.replaced.len() > MAX_REPLANS {
        let plans = report.replaced.len();
        return Err(invalid(format!("replaced lists {plans} plans; a run replans at most {MAX_REPLANS} times.")));
    }
    if report.replaced.windows(2).any(|pair| pair[1].step <= pair[0].step) {
        return Err(invalid("replaced must list the dropped plans oldest first, each at a later step.".into()));
    }
    for (i, dropped) in report.replaced.iter().enumerate() {
        let counts = [
            ("predicted_ms", dropped.predicted_ms.len()),
            ("measured_ms", dropped.measured_ms.len()),
            ("lowered", dropped.lowered.len()),
        ];
        for (what, count) in counts {
            if count != world {
                return Err(invalid(format!("replaced[{i}].{what} has {count} entries; send one per rank.")));
            }
        }
        for (rank, (predicted, measured)) in dropped.predicted_ms.iter().zip(&dropped.measured_ms).enumerate() {
            millis(&format!("replaced[{i}].predicted_ms[{rank}]"), *predicted)?;
            millis(&format!("replaced[{i}].measured_ms[{rank}]"), *measured)?;
        }
    }
    Ok(())
}

fn check_rank(i: usize, plan: &RankPlan, first: &RankPlan, table: &tessera_api::precision::CostTable) -> Result<()> {
    if plan.rank as usize != i {
        return Err(invalid(format!("ranks[{i}] is rank {}; list the ranks' plans in rank order.", plan.rank)));
    }
    name(&format!("ranks[{i}].device"), &plan.device)?;
    millis(&format!("ranks[{i}].predicted_ms"), plan.predicted_ms)?;
    finite(&format!("ranks[{i}].indicator_sum"), plan.indicator_sum)?;
    if plan.ops.is_empty() || plan.ops.len() > MAX_OPS {
        return Err(invalid(format!("ranks[{i}] plans {} operators; give 1 to {MAX_OPS}.", plan.ops.len())));
    }
    if plan.ops.len() != first.ops.len() {
        return Err(invalid(format!(
            "ranks[{i}] plans {} operators and rank 0 plans {}; every rank plans the same operators.",
            plan.ops.len(),
            first.ops.len()
        )));
    }
    let mut names = HashSet::new();
    for (j, (op, reference)) in plan.ops.iter().zip(&first.ops).enumerate() {
        name(&format!("ranks[{i}].ops[{j}].op"), &op.op)?;
        if op.op != reference.op || op.kind != reference.kind {
            return Err(invalid(format!(
                "ranks[{i}].ops[{j}] is {:?} where rank 0 plans {:?}; every rank plans the same operators in the same order.",
                op.op, reference.op
            )));
        }
        if !names.insert(op.op.as_str()) {
            return Err(invalid(format!("ranks[{i}] plans {:?} twice; operator names are unique.", op.op)));
        }
        finite(&format!("ranks[{i}].ops[{j}].indicator"), op.indicator)?;
        let measured = table.ops.iter().find(|cost| cost.op == op.op && cost.kind == op.kind);
        let Some(measured) = measured else {
            return Err(invalid(format!("ranks[{i}] plans {:?}, which its cost table does not list.", op.op)));
        };
        if !measured.timings.iter().any(|t| t.precision == op.precision) {
            return Err(invalid(format!(
                "ranks[{i}] runs {:?} at {}, which its cost table did not measure.",
                op.op, op.precision
            )));
        }
    }
    Ok(())
}

/// Stores the report a worker posts through the rank job `job` it holds: 409 when it no
/// longer holds it (lease expired, gang released or requeued, job ended), 403 when another
/// worker holds it or it is not rank 0, 422 for a job that is not data-parallel or a
/// report that does not fit its gang. Kept under the gang's job.
pub async fn accept(db: &Db, worker: Uuid, job: Uuid, report: &PrecisionPlanReport) -> Result<()> {
    let poster = match store::poster(db, job).await? {
        Some(poster) if poster.holder == Some(worker) => poster,
        Some(store::Poster { holder: Some(_), .. }) => {
            return Err(Error::Forbidden(
                "Another worker holds this job's lease; a worker posts plans only for the rank it holds.".into(),
            ))
        }
        _ => return Err(Error::Conflict(
            "This worker does not hold the job's lease (it expired, the gang was requeued or the job ended); stop it."
                .into(),
        )),
    };
    let Some((gang, rank)) = poster.gang else {
        return Err(Error::invalid(
            "invalid_precision_plan",
            "This job runs as one process; only a data-parallel job (with parallel.ranks) has a precision plan.",
        ));
    };
    if rank != 0 {
        return Err(Error::Forbidden(format!(
            "This worker holds rank {rank}; rank 0 of the gang posts the precision plan for every rank."
        )));
    }
    check(report, poster.world)?;
    store::upsert(db, gang, report, now_ms()).await?;
    Ok(())
}

/// `job`'s plan report and when it was posted; 404 with the reason when it has none.
pub async fn read(db: &Db, job: &Job) -> Result<(PrecisionPlanReport, i64)> {
    if let Some(found) = store::get(db, job.id).await? {
        return Ok(found);
    }
    let parallel = matches!(&job.spec, JobSpec::Train(train) if train.parallel.is_some());
    Err(Error::NotFound(if parallel {
        "This job has no precision plan yet: rank 0 posts it once the ranks have profiled their operators and planned."
            .into()
    } else {
        "This job has no precision plan: only data-parallel jobs (with parallel.ranks) get one.".into()
    }))
}

/// A data-parallel job's precision policy, as its spec says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// `f32` (no `parallel.precision`), `qsync`, `random` or `uniform`.
    pub name: String,
    /// The low precision the policy may use (`int8`, `bf16`); none for all-f32.
    pub low: Option<String>,
}

impl Policy {
    /// `parallel.precision` of `train`, read by its wire names (`policy`, `low`) so a spec
    /// of any version reads; a job without one trains all in f32.
    pub fn of(train: &TrainJob) -> Policy {
        let value = serde_json::to_value(train).unwrap_or_default();
        let precision = &value["parallel"]["precision"];
        let text = |key: &str| precision[key].as_str().map(str::to_string);
        match text("policy") {
            Some(name) => Policy { name, low: text("low") },
            None => Policy { name: "f32".into(), low: None },
        }
    }

    /// How the dashboard names it.
    pub fn label(&self) -> String {
        let low = self.low.as_deref().unwrap_or("low precision");
        match self.name.as_str() {
            "f32" => "all f32".into(),
            "uniform" => format!("uniform {low}"),
            "random" => format!("random indicator, {low} (ablation)"),
            "qsync" => format!("QSync, {low}"),
            other => format!("{other}, {low}"),
        }
    }

    /// Whether a job under this policy is a baseline for a plan: all f32, uniform low
    /// precision, or the random-indicator ablation.
    pub fn is_baseline(&self) -> bool {
        matches!(self.name.as_str(), "f32" | "uniform" | "random")
    }
}

/// The same model: the same registered model, or an MLP of the same shape.
fn same_model(a: &TrainModel, b: &TrainModel) -> bool {
    match (a, b) {
        (TrainModel::Registered { id: a, .. }, TrainModel::Registered { id: b, .. }) => a == b,
        (TrainModel::Mlp { hidden: a }, TrainModel::Mlp { hidden: b }) => a == b,
        _ => false,
    }
}

/// Baselines a plan page links without anyone typing ids.
const MAX_BASELINES: usize = 8;

/// The jobs `job`'s accuracy is read against: its owner's other data-parallel jobs on the
/// same model, dataset and number of ranks whose policy is a baseline (all f32, uniform
/// low precision, the random ablation), newest first.
pub async fn baselines(db: &Db, job: &Job) -> Result<Vec<(Job, Policy)>> {
    let JobSpec::Train(train) = &job.spec else { return Ok(Vec::new()) };
    let Some(parallel) = &train.parallel else { return Ok(Vec::new()) };
    let mut found = Vec::new();
    for other in store::sibling_gangs(db, job.id, 200).await? {
        let JobSpec::Train(theirs) = &other.spec else { continue };
        let ranks = theirs.parallel.as_ref().map_or(0, |p| p.ranks.len());
        let policy = Policy::of(theirs);
        if ranks == parallel.ranks.len() && same_model(&theirs.model, &train.model) && policy.is_baseline() {
            found.push((other, policy));
            if found.len() == MAX_BASELINES {
                break;
            }
        }
    }
    Ok(found)
}

/// Where a job's evaluation ended: the last `accuracy`, else the last `val_loss`, as
/// `(metric, step, value)`.
pub async fn final_eval(db: &Db, job: Uuid) -> Result<Option<(&'static str, i64, f64)>> {
    for metric in ["accuracy", "val_loss"] {
        if let Some((step, value)) = last_eval(db, job, metric).await? {
            return Ok(Some((metric, step, value)));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_api::precision::{
        AllocationStep, CastFit, CastModel, CostTable, IndicatorKind, OpCost, OpKind, OpTiming, PlannedOp, Precision,
        ReplacedPlan,
    };

    fn timing(precision: Precision, ms: f64) -> OpTiming {
        OpTiming { precision, forward_ms: ms, backward_ms: 2.0 * ms }
    }

    fn table(device: &str) -> CostTable {
        let op = |name: &str, kind: OpKind, precisions: &[Precision]| OpCost {
            op: name.into(),
            kind,
            timings: precisions.iter().map(|&p| timing(p, p.bits() as f64 / 8.0)).collect(),
        };
        CostTable {
            device: device.into(),
            ops: vec![
                op("layer0.query", OpKind::Linear, &Precision::ALL),
                op("layer0.norm", OpKind::LayerNorm, &[Precision::Bf16, Precision::F32]),
                op("head", OpKind::Head, &[Precision::F32]),
            ],
            overhead_ms: 1.0,
            optimizer_ms: 0.5,
            casts_in_op_time: false,
        }
    }

    fn plan(rank: u32, device: &str, query: Precision) -> RankPlan {
        let op = |name: &str, kind: OpKind, precision: Precision, indicator: f64| PlannedOp {
            op: name.into(),
            kind,
            precision,
            indicator,
        };
        RankPlan {
            rank,
            device: device.into(),
            ops: vec![
                op("layer0.query", OpKind::Linear, query, if query == Precision::F32 { 0.0 } else { 0.3 }),
                op("layer0.norm", OpKind::LayerNorm, Precision::F32, 0.0),
                op("head", OpKind::Head, Precision::F32, 0.0),
            ],
            predicted_ms: 12.0,
            indicator_sum: 0.3,
        }
    }

    fn report() -> PrecisionPlanReport {
        let fit = CastFit {
            from: Precision::F32,
            to: Precision::Int8,
            ms_per_element: 1e-6,
            fixed_ms: 0.01,
            r2: 0.98,
            samples: 6,
        };
        PrecisionPlanReport {
            indicator: IndicatorKind::GradientVariance,
            cost_tables: vec![table("cpu:12 threads"), table("cpu:4 threads")],
            cast_models: vec![CastModel { fits: vec![fit] }, CastModel::default()],
            ranks: vec![plan(0, "cpu:12 threads", Precision::F32), plan(1, "cpu:4 threads", Precision::Int8)],
            budget_ms: 12.5,
            predicted_step_ms: 12.4,
            measured_step_ms: None,
            trace: vec![AllocationStep {
                op: "layer0.query".into(),
                from: Precision::Int8,
                to: Precision::Bf16,
                gain: 0.2,
                cost_ms: 1.5,
                predicted_ms: 13.9,
                accepted: false,
            }],
            replaced: Vec::new(),
        }
    }

    fn dropped(step: u64) -> ReplacedPlan {
        ReplacedPlan { step, predicted_ms: vec![12.0, 12.0], measured_ms: vec![12.5, 30.0], lowered: vec![0, 1] }
    }

    fn refused(report: &PrecisionPlanReport, world: u32) -> String {
        match check(report, world) {
            Err(Error::Invalid { code: "invalid_precision_plan", message }) => message,
            other => panic!("expected a 422, got {other:?}"),
        }
    }

    #[test]
    fn a_consistent_report_passes() {
        check(&report(), 2).unwrap();
    }

    #[test]
    fn counts_must_match_the_gang() {
        assert!(refused(&report(), 3).contains("ranks has 2 entries but the job runs 3 ranks"));
        let mut r = report();
        r.cast_models.pop();
        assert!(refused(&r, 2).contains("cast_models has 1 entries"));
        let mut r = report();
        r.ranks.swap(0, 1);
        assert!(refused(&r, 2).contains("ranks[0] is rank 1"));
    }

    #[test]
    fn ranks_plan_the_same_operators_each_measured_at_its_precision() {
        let mut r = report();
        r.ranks[1].ops.pop();
        assert!(refused(&r, 2).contains("ranks[1] plans 2 operators and rank 0 plans 3"));
        let mut r = report();
        r.ranks[1].ops.swap(0, 1);
        assert!(refused(&r, 2).contains("ranks[1].ops[0] is \"layer0.norm\""));
        let mut r = report();
        r.ranks[1].ops[1].precision = Precision::Int8;
        assert!(refused(&r, 2).contains("runs \"layer0.norm\" at int8, which its cost table did not measure"));
        let mut r = report();
        r.cost_tables[1].ops.remove(2);
        assert!(refused(&r, 2).contains("plans \"head\", which its cost table does not list"));
        let mut r = report();
        r.trace[0].op = "nowhere".into();
        assert!(refused(&r, 2).contains("trace[0] raises \"nowhere\""));
        let mut r = report();
        r.trace[0].to = Precision::Int8;
        assert!(refused(&r, 2).contains("each allocator step raises"));
    }

    #[test]
    fn figures_are_finite_and_sizes_bounded() {
        let mut r = report();
        r.budget_ms = -1.0;
        assert!(refused(&r, 2).contains("budget_ms must be finite milliseconds"));
        let mut r = report();
        r.ranks[0].ops[0].indicator = f64::NAN;
        assert!(refused(&r, 2).contains("ranks[0].ops[0].indicator is not a finite number"));
        let mut r = report();
        r.cost_tables[0].ops[0].timings.push(timing(Precision::F32, 1.0));
        assert!(refused(&r, 2).contains("each at most once"));
        let mut r = report();
        r.ranks[0].device = "x".repeat(MAX_NAME + 1);
        assert!(refused(&r, 2).contains("ranks[0].device must have 1 to 200 characters"));
        let mut r = report();
        r.trace = vec![r.trace[0].clone(); MAX_TRACE + 1];
        assert!(refused(&r, 2).contains("at most"));
    }

    #[test]
    fn dropped_plans_are_few_in_step_order_with_a_figure_per_rank() {
        let mut r = report();
        r.replaced = vec![dropped(40), dropped(90)];
        check(&r, 2).unwrap();
        r.replaced.reverse();
        assert!(refused(&r, 2).contains("oldest first"));
        let mut r = report();
        r.replaced = (1..=MAX_REPLANS as u64 + 1).map(|i| dropped(i * 40)).collect();
        assert!(refused(&r, 2).contains("at most 3 times"));
        let mut r = report();
        r.replaced = vec![dropped(40)];
        r.replaced[0].lowered.pop();
        assert!(refused(&r, 2).contains("replaced[0].lowered has 1 entries"));
        r.replaced = vec![dropped(40)];
        r.replaced[0].measured_ms[1] = f64::INFINITY;
        assert!(refused(&r, 2).contains("replaced[0].measured_ms[1] must be finite milliseconds"));
    }

    #[test]
    fn the_policy_is_read_from_the_spec_and_absent_means_f32() {
        let spec = |parallel: serde_json::Value| -> TrainJob {
            let mut value = serde_json::json!({
                "model": {"kind": "mlp", "hidden": [8]},
                "dataset": {"id": Uuid::nil(), "digest": "sha256:00", "format": "csv", "columns": [], "rows": 1},
                "task": {"type": "classification", "label_column": "label", "validation_split": 0.25},
                "optimizer": {"type": "sgd"}, "batch_size": 8, "max_steps": 1, "eval_every": 1,
                "checkpoint_every": 1, "lr_schedule": {"type": "constant", "lr": 0.1}, "seed": 1,
            });
            if !parallel.is_null() {
                value["parallel"] = parallel;
            }
            serde_json::from_value(value).unwrap()
        };
        let f32 = Policy::of(&spec(serde_json::json!({"ranks": [{"device": "cpu"}, {"device": "cpu"}]})));
        assert_eq!(f32, Policy { name: "f32".into(), low: None });
        assert!(f32.is_baseline());
        assert_eq!(f32.label(), "all f32");
        let uniform = Policy { name: "uniform".into(), low: Some("int8".into()) };
        assert!(uniform.is_baseline());
        assert_eq!(uniform.label(), "uniform int8");
        assert!(!Policy { name: "qsync".into(), low: Some("bf16".into()) }.is_baseline());
    }
}
