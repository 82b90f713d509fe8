//! QSync accuracy benchmark (issue 12): what per-operator precision on one rank of a
//! synchronous data-parallel job costs in validation accuracy, over paired seeds.
//!
//! Two ranks train one model in this process through the worker's real data-parallel path
//! (`collective::ring::loopback`, `RingSync`, `Trainer::with_sync`): each takes its half of
//! every fixed global batch, and the gradients are all-reduced every step. Rank 0 runs all
//! f32; rank 1 runs the plan under test: all f32, uniform int8 or bf16 (as far as QSync's
//! keep-list allows: the head stays f32), QSync's allocation, or the same allocation driven
//! by a shuffled indicator (the authors' `--random` ablation). The model is evaluated at f32
//! by rank 0 (the ranks hold the same weights).
//!
//! QSync's plan per seed comes from the worker's planner (`train::qsync::plan_rank`): the
//! gradient-variance indicator from the job's real tensors (rank 1's share of the first
//! global batch at the initial weights), and each operator profiled at each precision on
//! rank 1's real shapes with the real training ops. Rank 1 is *treated* as 3× slower than
//! rank 0 (rank 0's profile is rank 1's divided by `--slowdown`): the ratio only sets the
//! budget, no rank is throttled, and no time is reported as a speed-up. A second budget, half
//! way between rank 1's fastest plan and all f32, shows the allocator when the budget binds.
//!
//! The indicator, the profile and the graph are the job's own (`train::hybrid`): rank 1's
//! share of the seed's first global batch through the network's traced forward, the
//! gradients of its loss, and each traced operator timed at each precision on those tensors.
//!
//! Workloads: digits (an MLP trained from scratch), the MiniLM head in its 2-core variant
//! from `lr_schedules` (all-MiniLM-L6-v2 frozen, its sentence embeddings of the
//! rotten-tomatoes reviews cached once, a trained MLP head), and the whole encoder fine-tuned
//! (`encoder`: our trainable all-MiniLM-L6-v2, every linear, LayerNorm and embedding of it a
//! planned operator), sized for two cores: a third of the reviews, short batches.
//!
//! Run: cargo run --release -p tessera-bench --bin qsync_accuracy [-- --seeds 5 --workloads encoder]
//! Writes, per workload run, its part of the "## Accuracy" section of bench/results/qsync.md
//! and its entry of the `accuracy` key of qsync.json (the workloads not run, and the other
//! sections, are left as they are), rewritten after every seed with the seeds done so far.
//! `--quick` runs 2 seeds at a fifth of the steps and writes nothing.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::backprop::GradStore;
use candle_core::Device;
use clap::Parser;
use serde_json::{json, Value};
use tessera_api::precision::{AllocationStep, CastModel, CostTable, KeepRule, OpKind, Precision};
use tessera_api::train::LrSchedule;
use tessera_bench::datasets::{assets_dir, dataset, embedded_reviews};
use tessera_bench::report::{replace_section, section};
use tessera_bench::stats::{median, PairedDifference};
use tessera_bench::{cpu_flags, machine};
use tessera_worker::collective::{ring, RingSync};
use tessera_worker::train::data::{prepare, Prepared, Table, Targets, TaskColumns, TaskKind};
use tessera_worker::train::hybrid::{self, ops};
use tessera_worker::train::loader::Loader;
use tessera_worker::train::model::bert::BertClassifier;
use tessera_worker::train::model::mlp::Mlp;
use tessera_worker::train::model::{Network, OpTrace};
use tessera_worker::train::optim::OptimizerKind;
use tessera_worker::train::policy;
use tessera_worker::train::precision::PrecisionPlan;
use tessera_worker::train::qsync::{plan_rank, Indicators, RankPlanRequest, RankProfile, TrainingGraph};
use tessera_worker::train::session::{Limits, Session};
use tessera_worker::train::trainer::{Evaluation, Share, Slowdown, Trainer};
use uuid::Uuid;

#[derive(Debug, Parser)]
struct Cli {
    /// Paired seeds per workload (1, 2, …).
    #[arg(long, default_value_t = 5)]
    seeds: u64,
    /// 2 seeds at a fifth of the steps, results printed only: checks the benchmark runs.
    #[arg(long)]
    quick: bool,
    /// Workloads to run, of `digits`, `minilm`, `encoder`.
    #[arg(long, value_delimiter = ',', default_value = "digits,minilm,encoder")]
    workloads: Vec<String>,
    /// How many times slower than rank 0 rank 1 is taken to be when setting the budget.
    #[arg(long, default_value_t = 3.0)]
    slowdown: f64,
    /// Where the assets are (default: .assets, or $TESSERA_ASSETS).
    #[arg(long)]
    assets: Option<PathBuf>,
}

/// Goal margin: QSync's mean accuracy at most this many points below all-f32's.
const F32_MARGIN_POINTS: f64 = 0.5;

/// The workloads in the order the results list them: key and title (the title heads the
/// workload's part of the results).
const WORKLOADS: [(&str, &str); 3] = [
    ("digits", "digits, from scratch (MLP)"),
    ("minilm", "rotten tomatoes, MiniLM fine-tune (2-core variant: frozen all-MiniLM-L6-v2, trained head)"),
    ("encoder", "rotten tomatoes, MiniLM fine-tune (the whole encoder trained)"),
];

/// What a workload trains.
enum Model {
    /// An MLP of these hidden widths, from the seed's initialisation.
    Mlp(Vec<usize>),
    /// The registered encoder in this folder with a classification head.
    Encoder(PathBuf),
}

struct Workload {
    key: &'static str,
    title: &'static str,
    table: Table,
    task: TaskColumns,
    model: Model,
    optimizer: OptimizerKind,
    schedule: LrSchedule,
    /// The global batch; each rank takes half.
    batch: usize,
    steps: u64,
    setup: String,
}

const SGD: OptimizerKind = OptimizerKind::Sgd { momentum: 0.9, nesterov: false, weight_decay: 0.0 };
const ADAMW: OptimizerKind = OptimizerKind::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };

/// Classification of `label` from every numeric column, or from the `text` column.
fn task(text: Option<&str>) -> TaskColumns {
    TaskColumns {
        kind: TaskKind::Classification,
        label: "label".into(),
        features: None,
        text: text.map(str::to_string),
        validation_split: 0.2,
    }
}

/// One plan of rank 1 for one seed.
#[derive(Clone)]
struct Planned {
    label: String,
    /// Per operator of the graph, in forward order.
    precisions: Vec<Precision>,
    /// Rank 1's predicted iteration time for the planned operators, ms.
    predicted_ms: f64,
    budget_ms: Option<f64>,
    indicator_sum: f64,
    /// The allocator's path (QSync and the ablation), for the JSON.
    trace: Vec<AllocationStep>,
}

/// A run's outcome.
#[derive(Clone, Copy)]
struct Outcome {
    evaluation: Evaluation,
    seconds: f64,
}

fn network(workload: &Workload, data: &Prepared, seed: u64) -> candle_core::Result<Box<dyn Network>> {
    Ok(match &workload.model {
        Model::Mlp(hidden) => Box::new(Mlp::new(data.input_dim(), hidden, data.classes.len(), seed, &Device::Cpu)?),
        Model::Encoder(folder) => {
            Box::new(BertClassifier::load(folder, data, TaskKind::Classification, seed, &Device::Cpu)?)
        }
    })
}

/// Rank 1's share of the seed's first global batch through the network at its initial
/// weights, at f32: every planned operator as it ran, and the gradients of the batch's loss
/// (what a job's ranks trace before planning, `Trainer::trace_last_batch`).
fn trace(workload: &Workload, data: &Prepared, seed: u64) -> anyhow::Result<(Vec<OpTrace>, GradStore)> {
    let network = network(workload, data, seed)?;
    let batch = Loader::new(data.train.len(), workload.batch, seed).next_batch();
    let rows = Share { rank: 1, world: 2 }.of(&batch);
    let Targets::Classes(labels) = &data.train.targets else {
        anyhow::bail!("the benchmark's workloads are classification tasks");
    };
    let (outputs, traces) = network.forward_traced(&data.train, rows)?;
    let targets: Vec<u32> = rows.iter().map(|&r| labels[r]).collect();
    let loss = candle_nn::loss::cross_entropy(&outputs, &candle_core::Tensor::new(targets, &Device::Cpu)?)?;
    Ok((traces, loss.backward()?))
}

/// Rank 1's cost table: every traced operator at every precision it may take (down to
/// int8, the keep-list's floors kept), on its real tensors with the training ops, by the
/// job's harness (the fastest of 25 rounds: other processes share these cores). Only the
/// planned operators: the rest of the step is the same on every plan.
fn profile(traces: &mut [OpTrace]) -> anyhow::Result<CostTable> {
    Ok(ops::profile("cpu", traces, Precision::Int8, 25, Slowdown::none())?)
}

/// `table` with every time divided by `factor`: the faster rank 0.
fn scaled(table: &CostTable, factor: f64) -> CostTable {
    let mut fast = table.clone();
    for op in &mut fast.ops {
        for t in &mut op.timings {
            t.forward_ms /= factor;
            t.backward_ms /= factor;
        }
    }
    fast.overhead_ms /= factor;
    fast.optimizer_ms /= factor;
    fast
}

/// The gradient-variance indicator of the seed's traced batch, as the job computes it.
fn indicators(workload: &Workload, data: &Prepared, seed: u64) -> anyhow::Result<Indicators> {
    let (traces, grads) = trace(workload, data, seed)?;
    Ok(hybrid::indicators(&traces, &grads)?)
}

/// Rank 1's plans for one seed: the uniform ones, and QSync's and the random ablation's at
/// the 3:1 budget and at the midpoint budget.
fn plans(
    graph: &TrainingGraph,
    profiles: &[RankProfile],
    real: &Indicators,
    seed: u64,
) -> anyhow::Result<Vec<Planned>> {
    let names: Vec<(String, OpKind)> = graph.ops.iter().map(|op| (op.name.clone(), op.kind)).collect();
    let rank1 = &profiles[1];
    let predicted = |plan: &[Precision]| -> anyhow::Result<f64> { Ok(rank1.replay(graph, plan)?.compute_ms) };
    let sum = |plan: &[Precision]| -> f64 { plan.iter().enumerate().map(|(i, &p)| real.value(i, p)).sum() };
    let mut out = Vec::new();
    for (label, precision) in
        [("all f32", Precision::F32), ("uniform int8", Precision::Int8), ("uniform bf16", Precision::Bf16)]
    {
        let plan = PrecisionPlan::uniform(&names, precision);
        let precisions: Vec<Precision> = names.iter().map(|(n, _)| plan.get(n)).collect();
        out.push(Planned {
            label: label.into(),
            predicted_ms: predicted(&precisions)?,
            indicator_sum: sum(&precisions),
            precisions,
            budget_ms: None,
            trace: Vec::new(),
        });
    }
    let f32_plan = vec![Precision::F32; graph.ops.len()];
    let keep = KeepRule::qsync_defaults();
    let random = real.shuffled(seed);
    let allocate = |indicators: &Indicators, budget_ms: Option<f64>| {
        plan_rank(&RankPlanRequest {
            graph,
            profiles,
            plans: &[f32_plan.clone(), f32_plan.clone()],
            rank: 1,
            indicators,
            keep: &keep,
            budget_ms,
        })
    };
    let qsync = allocate(real, None)?;
    let fastest_ms = predicted(&qsync.start)?;
    let f32_ms = predicted(&f32_plan)?;
    let midpoint = fastest_ms + 0.5 * (f32_ms - fastest_ms).max(0.0);
    for (budget_label, budget) in [("3:1", None), ("midpoint", Some(midpoint))] {
        for (who, indicators) in [("QSync", real), ("random indicator", &random)] {
            let allocation = allocate(indicators, budget)?;
            out.push(Planned {
                label: format!("{who} @ {budget_label} budget"),
                predicted_ms: predicted(&allocation.plan)?,
                indicator_sum: sum(&allocation.plan),
                budget_ms: Some(allocation.budget_ms),
                precisions: allocation.plan,
                trace: allocation.trace,
            });
        }
    }
    Ok(out)
}

/// Two ranks over loopback TCP, rank 1 at `plan`; the final evaluation (rank 0's, at f32).
fn train_pair(workload: &Workload, data: &Arc<Prepared>, seed: u64, plan: &PrecisionPlan) -> anyhow::Result<Outcome> {
    let started = Instant::now();
    let rings = ring::loopback(2, Uuid::new_v4(), Duration::from_secs(120))?;
    let evaluations = std::thread::scope(|scope| {
        let handles: Vec<_> = rings
            .into_iter()
            .enumerate()
            .map(|(rank, ring)| {
                scope.spawn(move || -> anyhow::Result<Evaluation> {
                    let mut network = network(workload, data, seed)?;
                    if rank == 1 {
                        network.set_precision(plan)?;
                    }
                    let trainer = Trainer::new(
                        network,
                        workload.optimizer,
                        data.clone(),
                        TaskKind::Classification,
                        workload.batch,
                        seed,
                        Device::Cpu,
                    )?
                    .with_sync(Box::new(RingSync::new(ring)));
                    let limits =
                        Limits { max_steps: workload.steps, eval_every: workload.steps, checkpoint_every: u64::MAX };
                    let policy = policy::build(&workload.schedule, workload.steps, seed);
                    Ok(Session::new(trainer, policy, limits).run(&AtomicBool::new(false), &mut |_| {})?)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a rank panicked")).collect::<anyhow::Result<Vec<_>>>()
    })?;
    // The leader evaluates and the other rank receives its result: the same figure twice.
    anyhow::ensure!(evaluations[0] == evaluations[1], "the ranks disagree on the evaluation");
    Ok(Outcome { evaluation: evaluations[0], seconds: started.elapsed().as_secs_f64() })
}

/// Operators a plan is spelled out for in the results; a larger graph's plan is counted
/// per precision there (and listed whole in the JSON).
const SPELLED_OUT: usize = 8;

fn plan_text(graph: &TrainingGraph, precisions: &[Precision]) -> String {
    if graph.ops.len() <= SPELLED_OUT {
        return graph.ops.iter().zip(precisions).map(|(op, p)| format!("{}:{p}", op.name)).collect::<Vec<_>>().join(" ");
    }
    [Precision::Int8, Precision::Bf16, Precision::F32]
        .iter()
        .map(|p| format!("{p} ×{}", precisions.iter().filter(|&q| q == p).count()))
        .collect::<Vec<_>>()
        .join(", ")
}

fn to_plan(graph: &TrainingGraph, precisions: &[Precision]) -> PrecisionPlan {
    PrecisionPlan(graph.ops.iter().zip(precisions).map(|(op, &p)| (op.name.clone(), p)).collect())
}

/// Runs one workload over the seeds, handing `record` the Markdown and JSON of the seeds
/// done so far after each one (a long run keeps what it finished if it is stopped).
fn run_workload(
    workload: &Workload,
    seeds: &[u64],
    slowdown: f64,
    mut record: impl FnMut(&str, Value) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let started = Instant::now();
    // Profiled once, on seed 1's first batch: the costs hardly depend on the seed (the
    // encoder's batches differ in length, but the plan is drawn on one profile).
    let data = Arc::new(prepare(&workload.table, &workload.task, seeds[0])?);
    let (mut traces, _) = trace(workload, &data, seeds[0])?;
    let graph = ops::graph(&traces, 0.0);
    let table = profile(&mut traces)?;
    drop(traces);
    let casts = CastModel { fits: Vec::new() };
    let profiles = [
        RankProfile::new(&graph, &scaled(&table, slowdown), &casts, Precision::Bf16)?,
        RankProfile::new(&graph, &table, &casts, Precision::Bf16)?,
    ];
    for op in &table.ops {
        let cells: Vec<String> =
            op.timings.iter().map(|t| format!("{} {:.3}+{:.3} ms", t.precision, t.forward_ms, t.backward_ms)).collect();
        println!("[{}] profile {}: {}", workload.key, op.op, cells.join(", "));
    }

    // Per plan label: per seed, (plan, outcome).
    let mut rows: Vec<(String, Vec<(Planned, Outcome)>)> = Vec::new();
    for (done_seeds, &seed) in seeds.iter().enumerate() {
        let data = Arc::new(prepare(&workload.table, &workload.task, seed)?);
        let real = indicators(workload, &data, seed)?;
        // Training is deterministic, so a plan that two labels share runs once per seed.
        let mut done: HashMap<Vec<Precision>, Outcome> = HashMap::new();
        for planned in plans(&graph, &profiles, &real, seed)? {
            let outcome = match done.get(&planned.precisions) {
                Some(outcome) => *outcome,
                None => {
                    let outcome = train_pair(workload, &data, seed, &to_plan(&graph, &planned.precisions))?;
                    done.insert(planned.precisions.clone(), outcome);
                    outcome
                }
            };
            println!(
                "[{}] seed {seed} {}: accuracy {:.2} %, val_loss {:.4} ({:.1} s) [{}], rank 1 predicted {:.3} ms{}",
                workload.key,
                planned.label,
                100.0 * outcome.evaluation.accuracy.unwrap_or(f64::NAN),
                outcome.evaluation.val_loss,
                outcome.seconds,
                plan_text(&graph, &planned.precisions),
                planned.predicted_ms,
                planned.budget_ms.map_or(String::new(), |b| format!(", budget {b:.3} ms")),
            );
            match rows.iter_mut().find(|(label, _)| *label == planned.label) {
                Some((_, runs)) => runs.push((planned, outcome)),
                None => rows.push((planned.label.clone(), vec![(planned, outcome)])),
            }
        }
        let seconds = started.elapsed().as_secs_f64();
        let (md, value) = summarise(workload, &seeds[..=done_seeds], &graph, &table, slowdown, &rows, seconds);
        record(&md, value)?;
    }
    Ok(())
}

fn points(runs: &[(Planned, Outcome)]) -> Vec<f64> {
    runs.iter().map(|(_, o)| 100.0 * o.evaluation.accuracy.unwrap_or(f64::NAN)).collect()
}

fn verdict(met: bool) -> &'static str {
    if met {
        "met"
    } else {
        "not met"
    }
}

fn difference_text(d: &PairedDifference) -> String {
    if !d.ci95.0.is_finite() {
        return format!("{:+.2} (one seed: no CI)", d.mean);
    }
    format!("{:+.2} (95 % CI {:+.2} to {:+.2}; median {:+.2})", d.mean, d.ci95.0, d.ci95.1, d.median)
}

fn difference_json(d: &PairedDifference) -> Value {
    let finite = |v: f64| if v.is_finite() { json!(v) } else { Value::Null };
    json!({"per_seed": d.differences, "mean": d.mean, "median": d.median, "ci95": [finite(d.ci95.0), finite(d.ci95.1)]})
}

#[allow(clippy::type_complexity)]
fn summarise(
    workload: &Workload,
    seeds: &[u64],
    graph: &TrainingGraph,
    table: &CostTable,
    slowdown: f64,
    rows: &[(String, Vec<(Planned, Outcome)>)],
    seconds: f64,
) -> (String, Value) {
    let find = |label: &str| &rows.iter().find(|(l, _)| l == label).expect("every plan runs").1;
    let f32_points = points(find("all f32"));
    let mut md = format!("Setup: {}. Seeds {seeds:?}; {:.0} s.\n\n", workload.setup, seconds);
    md += "Rank 1's operators profiled alone on its real shapes (fastest of 25, forward + backward ms; casts and quantisation inside):\n\n\
           | operator | int8 | bf16 | f32 |\n|---|---|---|---|\n";
    for op in &table.ops {
        let cell = |p: Precision| {
            op.timings
                .iter()
                .find(|t| t.precision == p)
                .map_or("–".into(), |t| format!("{:.3} + {:.3}", t.forward_ms, t.backward_ms))
        };
        md += &format!(
            "| {} | {} | {} | {} |\n",
            op.op,
            cell(Precision::Int8),
            cell(Precision::Bf16),
            cell(Precision::F32)
        );
    }
    md += &format!(
        "\n| rank 1 plan | accuracy % per seed | median | mean | vs all f32, points: mean (95 % CI; median) | rank 1 predicted ms (median) | budget ms | Σω (median) | plan (seed {}) | plans differ by seed |\n|---|---|---|---|---|---|---|---|---|---|\n",
        seeds[0]
    );
    let mut rows_json = Vec::new();
    for (label, runs) in rows {
        let accuracy = points(runs);
        let vs_f32 = PairedDifference::of(&accuracy, &f32_points);
        let predicted: Vec<f64> = runs.iter().map(|(p, _)| p.predicted_ms).collect();
        let sums: Vec<f64> = runs.iter().map(|(p, _)| p.indicator_sum).collect();
        let budgets: Vec<f64> = runs.iter().filter_map(|(p, _)| p.budget_ms).collect();
        let distinct = runs.iter().any(|(p, _)| p.precisions != runs[0].0.precisions);
        md += &format!(
            "| {label} | {} | {:.2} | {:.2} | {} | {:.3} | {} | {:.3e} | {} | {} |\n",
            accuracy.iter().map(|a| format!("{a:.2}")).collect::<Vec<_>>().join(", "),
            median(&accuracy),
            accuracy.iter().sum::<f64>() / accuracy.len() as f64,
            if label == "all f32" { "–".into() } else { difference_text(&vs_f32) },
            median(&predicted),
            if budgets.is_empty() { "–".into() } else { format!("{:.3}", median(&budgets)) },
            median(&sums),
            plan_text(graph, &runs[0].0.precisions),
            if distinct { "yes" } else { "no" },
        );
        rows_json.push(json!({
            "plan": label,
            "accuracy_points": accuracy,
            "val_loss": runs.iter().map(|(_, o)| o.evaluation.val_loss).collect::<Vec<_>>(),
            "seconds": runs.iter().map(|(_, o)| o.seconds).collect::<Vec<_>>(),
            "median": median(&accuracy),
            "vs_f32": difference_json(&vs_f32),
            "rank1_predicted_ms": predicted,
            "budget_ms": budgets,
            "indicator_sum": sums,
            "precisions": runs.iter().map(|(p, _)| to_plan(graph, &p.precisions)).collect::<Vec<_>>(),
            "allocator_trace": runs.iter().map(|(p, _)| &p.trace).collect::<Vec<_>>(),
        }));
    }
    md += "\nVerdicts (mean paired difference in accuracy points; \"≥\" holds when the mean difference is ≥ 0, a CI spanning 0 means the seeds do not tell the two apart):\n\n";
    let mut verdicts = Vec::new();
    for budget in ["3:1", "midpoint"] {
        let qsync_label = format!("QSync @ {budget} budget");
        let qsync = points(find(&qsync_label));
        let same_as = |other: &str| {
            let (a, b) = (find(&qsync_label), find(other));
            a.iter().zip(b).all(|((p, _), (q, _))| p.precisions == q.precisions)
        };
        for (goal, other, margin) in [
            ("QSync ≥ uniform int8", "uniform int8", 0.0),
            ("QSync ≥ uniform bf16", "uniform bf16", 0.0),
            ("QSync ≥ random-indicator ablation", &format!("random indicator @ {budget} budget") as &str, 0.0),
            ("QSync within 0.5 points of all f32", "all f32", -F32_MARGIN_POINTS),
        ] {
            let d = PairedDifference::of(&qsync, &points(find(other)));
            let met = d.mean_at_least(margin);
            let identical = same_as(other);
            let noise = !met && d.ci95.0 <= margin && margin <= d.ci95.1;
            md += &format!(
                "- {budget} budget, {goal}: **{}**{}, QSync − {other} = {} points{}\n",
                verdict(met),
                if noise { " (within noise: the CI spans the margin)" } else { "" },
                difference_text(&d),
                if identical { " (the same plan on every seed: the same run)" } else { "" }
            );
            verdicts.push(json!({"budget": budget, "goal": goal, "met": met, "difference": difference_json(&d), "same_plan_every_seed": identical}));
        }
    }
    md += "\n";
    let value = json!({
        "workload": workload.key,
        "title": workload.title,
        "setup": workload.setup,
        "seeds": seeds,
        "slowdown": slowdown,
        "seconds": seconds,
        "cost_table_rank1": table,
        "plans": rows_json,
        "verdicts": verdicts,
    });
    (md, value)
}

/// `64 → 256 → … → 10`.
fn widths(input: usize, hidden: &[usize], output: usize) -> String {
    std::iter::once(input)
        .chain(hidden.iter().copied())
        .chain([output])
        .map(|w| w.to_string())
        .collect::<Vec<_>>()
        .join(" → ")
}

fn workloads(cli: &Cli, assets: &std::path::Path) -> anyhow::Result<Vec<Workload>> {
    let scale = |steps: u64| if cli.quick { steps / 5 } else { steps };
    let mut all = Vec::new();
    if cli.workloads.iter().any(|w| w == "digits") {
        let steps = scale(800);
        // Equal hidden widths: the raises cost alike, so where the budget affords only some
        // of them the indicator (not the cost) decides which.
        let hidden = vec![256; 5];
        all.push(Workload {
            key: WORKLOADS[0].0,
            title: WORKLOADS[0].1,
            table: dataset(assets, "digits.csv")?,
            task: task(None),
            model: Model::Mlp(hidden.clone()),
            optimizer: SGD,
            schedule: LrSchedule::Onecycle { max_lr: 0.1, pct_start: 0.3, div_factor: 25.0, final_div_factor: 1e4 },
            batch: 128,
            steps,
            setup: format!(
                "scikit-learn's 1797 8×8 digits, 20 % held out per seed (360 rows: one row is 0.28 points); MLP {} (ReLU) \
                 from the seed's initialisation; SGD momentum 0.9, one-cycle LR peak 0.1; global batch 128 (64 per rank); {steps} steps",
                widths(64, &hidden, 10)
            ),
        });
    }
    if cli.workloads.iter().any(|w| w == "minilm") {
        let steps = scale(240);
        let hidden = vec![512; 3];
        let (table, batch) = (embedded_reviews(assets)?, 256);
        let epochs = (steps as usize * batch) as f64 / (table.rows.len() as f64 * 0.8);
        all.push(Workload {
            key: WORKLOADS[1].0,
            title: WORKLOADS[1].1,
            task: task(None),
            model: Model::Mlp(hidden.clone()),
            optimizer: ADAMW,
            schedule: LrSchedule::Linear { lr: 1e-3, warmup_steps: steps / 10 },
            batch,
            steps,
            setup: format!(
                "{} critic reviews (fresh/rotten), 20 % held out per seed; all-MiniLM-L6-v2 frozen, its normalised mean-pooled \
                 sentence embeddings computed once by the serving engine and cached (as `lr_schedules`); head MLP {} (ReLU) trained; \
                 AdamW (0.9, 0.999, weight decay 0.01), linear LR peak 1e-3 with 10 % warm-up (`lr_schedules`' best grid point); global batch 256 \
                 (128 per rank: at 32 rows the f32 GEMM is the fastest and there is nothing to allocate); {steps} steps ({epochs:.1} epochs)",
                table.rows.len(),
                widths(384, &hidden, 2)
            ),
            table,
        });
    }
    if cli.workloads.iter().any(|w| w == "encoder") {
        let steps = scale(ENCODER_STEPS);
        let mut table = dataset(assets, "rotten_tomatoes.csv")?;
        // Every third review (the corpus is ordered by source, so a stride keeps its mix).
        table.rows = table.rows.into_iter().step_by(3).collect();
        let batch = 16;
        let epochs = (steps as usize * batch) as f64 / (table.rows.len() as f64 * 0.8);
        all.push(Workload {
            key: WORKLOADS[2].0,
            title: WORKLOADS[2].1,
            task: task(Some("text")),
            model: Model::Encoder(assets.join("all-MiniLM-L6-v2")),
            optimizer: ADAMW,
            schedule: LrSchedule::Linear { lr: ENCODER_LR, warmup_steps: steps / 10 },
            batch,
            steps,
            setup: format!(
                "every third of the 12808 critic reviews ({} rows: fresh/rotten, 20 % held out per seed, one validation row is {:.2} points); \
                 all-MiniLM-L6-v2 fine-tuned whole: our trainable encoder (`train::model::encoder`), mean pooling, a linear head \
                 from the seed's initialisation; rank 1's plan names every embedding, linear and LayerNorm of it (int8 for the \
                 linears; embeddings and LayerNorms at bf16 or more, the head f32: QSync's keep-list); AdamW (0.9, 0.999, weight \
                 decay 0.01), linear LR peak {ENCODER_LR:e} with 10 % warm-up; global batch {batch} ({} per rank, each batch padded \
                 to its longest review, at most 128 tokens); {steps} steps ({epochs:.2} epochs)",
                table.rows.len(),
                100.0 / (table.rows.len() as f64 * 0.2).round(),
                batch / 2,
            ),
            table,
        });
    }
    Ok(all)
}

/// The encoder fine-tune's length and LR peak: what two cores afford per run (about half
/// an epoch of its subset) at a rate that moves the pretrained encoder that far.
const ENCODER_STEPS: u64 = 100;
const ENCODER_LR: f64 = 1e-4;

fn main() -> anyhow::Result<()> {
    // As the worker runs its ranks.
    tessera_worker::memory::keep_freed_memory();
    let cli = Cli::parse();
    let assets = assets_dir(cli.assets.clone());
    let seeds: Vec<u64> = (1..=if cli.quick { 2 } else { cli.seeds.max(1) }).collect();
    let started = Instant::now();
    for workload in workloads(&cli, &assets)? {
        let date = chrono::Utc::now();
        run_workload(&workload, &seeds, cli.slowdown, |md, value| {
            println!("{}", md.lines().filter(|l| l.starts_with("- ")).collect::<Vec<_>>().join("\n"));
            if cli.quick {
                return Ok(());
            }
            write_results(&cli, &workload, &date, md, value)
        })?;
    }
    println!("done in {:.0} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// What the "## Accuracy" section says before the workloads' parts.
const ACCURACY_INTRO: &str = "## Accuracy\n\n\
     Written by `qsync_accuracy` (`bench/src/bin/qsync_accuracy.rs`), one part per workload (a run rewrites the parts of the \
     workloads it ran; each part names its machine, date and command).\n\n\
     Two ranks in one process train one model through the worker's data-parallel path (ring all-reduce over loopback TCP, \
     `RingSync`, a fixed global batch split in halves, gradients averaged every step). Rank 0 runs all f32; rank 1 runs the plan of \
     the row. Accuracy is the final validation accuracy, evaluated at f32 by rank 0 (both ranks hold the same weights). Seeds are \
     paired: a seed fixes the split, the initialisation and the batch order for every plan, so the differences are per seed.\n\n\
     QSync's plan is the worker planner's (`train::qsync::plan_rank`) per seed: the gradient-variance indicator from rank 1's share of \
     the seed's first global batch at the initial weights, and rank 1's operators profiled at each precision with the real training \
     ops. Rank 1 is *treated* as slower than rank 0 by the part's factor (rank 0's profile is rank 1's divided by it): this ratio only \
     sets the budget (QSync's: the synchronous step with rank 1 at its fastest plan); nothing is throttled and no speed is claimed \
     here. The midpoint budget (half way between rank 1's fastest plan and all f32, predicted) shows the allocator where the budget \
     binds. The random ablation is the same allocator on the real indicator's rows shuffled across operators (a new shuffle per \
     seed). Uniform int8 and bf16 keep QSync's keep-list (the head f32; embeddings and LayerNorms at bf16 or more). Training is \
     deterministic, so a plan two rows share is run once per seed.\n";

/// Rewrites this workload's part of the accuracy section of bench/results/qsync.md and its
/// entry under the `accuracy` key of qsync.json; the other workloads' are kept.
fn write_results(
    cli: &Cli,
    workload: &Workload,
    date: &chrono::DateTime<chrono::Utc>,
    body: &str,
    mut value: Value,
) -> anyhow::Result<()> {
    let out = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("results");
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let profile = if cfg!(debug_assertions) { "debug build" } else { "release build" };
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load: String = load.split_whitespace().take(3).collect::<Vec<_>>().join(" ");
    let heading = format!("### {}", workload.title);
    let part = format!(
        "{heading}\n\n\
         Machine: {}; CPU flags of note: {}. Date: {}. Command: `{command}` ({profile}); load average at the end {load} (a shared \
         host). Rank 1 treated as {}× slower.\n\n{body}",
        machine(),
        cpu_flags(),
        date.to_rfc3339(),
        cli.slowdown,
    );
    let md_path = out.join("qsync.md");
    let existing = std::fs::read_to_string(&md_path).unwrap_or_else(|_| skeleton());
    let mut accuracy = ACCURACY_INTRO.to_string();
    for (_, title) in WORKLOADS {
        let heading_of = format!("### {title}");
        let kept = if heading_of == heading { Some(part.clone()) } else { section(&existing, &heading_of) };
        if let Some(kept) = kept {
            accuracy += &format!("\n{}", kept.trim_end());
            accuracy += "\n";
        }
    }
    std::fs::write(&md_path, replace_section(&existing, "## Accuracy", &accuracy))?;

    let json_path = out.join("qsync.json");
    let mut document: Value = std::fs::read_to_string(&json_path)
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok())
        .filter(Value::is_object)
        .unwrap_or_else(|| json!({}));
    if !document["accuracy"]["workloads"].is_object() {
        document["accuracy"] = json!({"benchmark": "qsync_accuracy", "workloads": {}});
    }
    for (key, field) in [
        ("machine", json!(machine())),
        ("cpu_flags", json!(cpu_flags())),
        ("date", json!(date.to_rfc3339())),
        ("command", json!(command)),
        ("profile", json!(profile)),
        ("load_average", json!(load)),
        ("f32_margin_points", json!(F32_MARGIN_POINTS)),
    ] {
        value[key] = field;
    }
    document["accuracy"]["workloads"][workload.key] = value;
    std::fs::write(&json_path, serde_json::to_string_pretty(&document)? + "\n")?;
    Ok(())
}

/// The file's other sections, for when it does not exist yet.
fn skeleton() -> String {
    "# QSync (issue 12): recorded figures\n\n\
     Each section is written by one benchmark; a run rewrites only its own (the JSON beside this file has one key per section).\n\n\
     ## Predictor\n\n\
     The replayer's predicted against measured iteration time: [qsync_predictor.md](qsync_predictor.md) (`qsync_predictor`).\n\n\
     ## GEMM speed\n\n\
     The bf16 and int8 linear layers against f32, forward and backward: [qsync_gemm.md](qsync_gemm.md) (`qsync_gemm`).\n\n\
     ## Hybrid throughput\n\n\
     Not measured: QSync against the slow rank kept at f32 (goal ≥ 1.5× at 3:1) and against uniform low precision (≥ 0.95×) needs \
     ranks of truly unequal speed (a GPU and CPU ranks, or 12 vs 4 CPU threads on a 16-core host). A 2-core host cannot provide \
     them, and a throttled rank is not a speed-up.\n"
        .into()
}
