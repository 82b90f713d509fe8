//! QSync's predictor on a real gang (issue 12): the synchronous step the replayer predicts
//! for a two-rank data-parallel job against the step measured, over pairs of per-rank
//! precision plans, on the MiniLM fine-tune a job runs.
//!
//! `qsync_predictor` checks the replayer on one rank of a chain of linears, every operator
//! planned. Here everything is the job's own: two ranks in this process over the worker's
//! data-parallel path (`collective::ring::loopback`, `collective::for_gang`,
//! `Trainer::with_sync`), each rank's compute in its own rayon pool, all-MiniLM-L6-v2 through
//! our trainable encoder (attention, GELU, residual sums and the tokenizer are not planned
//! operators: the planner covers them as the rank's measured overhead). Each rank takes
//! `--profile-steps` steps at f32 and measures itself as a job's rank does
//! (`train::hybrid::profile_rank`: its traced operators at every precision, the cast model,
//! the rest of its step from the f32 steps), the ranks exchange their measurements over the
//! ring (`gather_measurements`), and rank 0 predicts each pair of plans with
//! `train::hybrid::plan::predict_gang`, the replay `plan_gang` reports for the plans it
//! chooses. Then every pair runs: both ranks apply their plans, restore the same snapshot (so
//! every pair trains on the same batches), take a warm-up step and `--steps` timed steps; the
//! measured step is the time between rank 0's consecutive step ends (a synchronous step ends
//! after the all-reduce and the optimizer). Pairs alternate within each of `--runs` rounds;
//! the figure per pair is the median over the rounds of each round's median step.
//!
//! The rest of a rank's step (the overhead around the planned operators, the all-reduce, the
//! optimizer) comes from its profiled f32 steps; beside the planner's reading of them
//! (`step_reading`: the fastest of a few, the median of many less the cold first two) every
//! pair is also predicted with each of those readings of `READINGS` and the plain median, so
//! the readings compare on one profile and one set of timed steps.
//!
//! Two batch shapes: `fixed` (each review repeated past the 128-token cut, so every batch
//! has the traced batch's shape: the replayer's own error) and `natural` (the reviews as a
//! job sees them, each batch padded to its longest: what a job's predicted-against-measured
//! step shows, the traced batch standing for all of them).
//!
//! Run: cargo run --release -p tessera-bench --bin qsync_gang_predictor
//! Writes bench/results/qsync_gang_predictor.{json,md} (or into `--out`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::Device;
use clap::{Parser, ValueEnum};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tessera_api::precision::{CostTable, Precision};
use tessera_bench::datasets::{assets_dir, dataset, every_kth_row};
use tessera_bench::stats::median;
use tessera_bench::{cpu_flags, machine, split_gemms_for};
use tessera_worker::collective::{for_gang, ring};
use tessera_worker::train::data::{prepare, Prepared, TaskColumns, TaskKind};
use tessera_worker::train::hybrid::plan::{predict_gang, RankMeasurement};
use tessera_worker::train::hybrid::{gang_graph, gather_measurements, profile_rank, step_reading, Sample, COLD_STEPS};
use tessera_worker::train::model::bert::BertClassifier;
use tessera_worker::train::model::Network;
use tessera_worker::train::optim::OptimizerKind;
use tessera_worker::train::precision::PrecisionPlan;
use tessera_worker::train::qsync::Statistic;
use tessera_worker::train::rng::Rng;
use tessera_worker::train::trainer::Trainer;
use uuid::Uuid;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
enum Lengths {
    Fixed,
    Natural,
}

#[derive(Debug, Parser)]
struct Cli {
    /// Training threads of rank 0 and rank 1 (each rank's compute runs in a rayon pool of
    /// that size).
    #[arg(long, value_delimiter = ',', default_value = "1,1")]
    threads: Vec<usize>,
    /// Batch shapes to measure, in order.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "fixed,natural")]
    lengths: Vec<Lengths>,
    /// The global batch (each rank takes half).
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Timed steps per pair and round (after one warm-up step).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Rounds over all pairs; a recorded figure is the median of 3 at least.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// The f32 steps a rank measures itself on (the job spec's `precision.profile_steps`).
    #[arg(long, default_value_t = 8)]
    profile_steps: usize,
    /// Pairs of random plans besides the four fixed pairs.
    #[arg(long, default_value_t = 6)]
    random_pairs: usize,
    /// Rows of the reviews used (every k-th row of the file).
    #[arg(long, default_value_t = 2048)]
    rows: usize,
    /// Where the assets are (default: .assets, or $TESSERA_ASSETS).
    #[arg(long)]
    assets: Option<PathBuf>,
    /// Folder the results go to (default: bench/results of the source tree).
    #[arg(long)]
    out: Option<PathBuf>,
}

const SEED: u64 = 1;
const LR: f64 = 2e-5;
const RING_TIMEOUT: Duration = Duration::from_secs(300);
/// Words a review is repeated to in the fixed shape: past the encoder's 128-token cut.
const FIXED_WORDS: usize = 200;
/// Issue 12's goals for the predictor.
const GOAL_MEDIAN: f64 = 0.05;
const GOAL_P90: f64 = 0.10;

/// Readings of the rest of a rank's step from its profiled f32 steps, compared side by side
/// on the same profile and the same timed steps; the planner's first.
const READINGS: [Reading; 4] = [
    Reading::Planner,
    Reading::Of { name: "fastest of the steps", statistic: Statistic::Min, cold: 0 },
    Reading::Of { name: "median of the steps", statistic: Statistic::Median, cold: 0 },
    Reading::Of { name: "median, the first two steps left out", statistic: Statistic::Median, cold: COLD_STEPS },
];

enum Reading {
    /// `step_reading`, which picks one of the others by the number of steps.
    Planner,
    /// `statistic` of the steps after the first `cold` (as many as leave one).
    Of { name: &'static str, statistic: Statistic, cold: usize },
}

impl Reading {
    fn name(&self) -> &'static str {
        match self {
            Reading::Planner => "the planner's (step_reading)",
            Reading::Of { name, .. } => name,
        }
    }

    fn of<'a>(&self, samples: &'a [Sample]) -> (&'a [Sample], Statistic) {
        match *self {
            Reading::Planner => step_reading(samples),
            Reading::Of { statistic, cold, .. } => (&samples[cold.min(samples.len().saturating_sub(1))..], statistic),
        }
    }
}

/// One pair of plans, by rank, one precision per operator of the graph.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Pair {
    label: String,
    plans: [Vec<Precision>; 2],
    /// The replayer's step, by reading.
    predicted_ms: Vec<f64>,
    /// The replayer's compute (forward and backward with the overhead) per rank, by reading.
    predicted_compute_ms: Vec<[f64; 2]>,
}

/// What one rank measured of one pair in one round, per timed step: the time since the
/// previous step ended, and this rank's compute, all-reduce (waiting excluded) and optimizer.
#[derive(Debug, Clone, Default)]
struct PairSteps {
    step_ms: Vec<f64>,
    compute_ms: Vec<f64>,
    allreduce_ms: Vec<f64>,
    optimizer_ms: Vec<f64>,
}

/// One rank's run: the pairs (from rank 0), its measurement by reading, and per round and
/// pair what it measured.
struct RankOutcome {
    pairs: Vec<Pair>,
    measurements: Vec<RankMeasurement>,
    rounds: Vec<Vec<PairSteps>>,
}

fn reviews(cli: &Cli, lengths: Lengths) -> anyhow::Result<Prepared> {
    let assets = assets_dir(cli.assets.clone());
    let mut table = every_kth_row(dataset(&assets, "rotten_tomatoes.csv")?, cli.rows);
    if lengths == Lengths::Fixed {
        let text = table.column("text")?;
        for row in &mut table.rows {
            let words: Vec<&str> = row[text].split_whitespace().collect();
            if !words.is_empty() {
                row[text] = words.iter().cycle().take(FIXED_WORDS).copied().collect::<Vec<_>>().join(" ");
            }
        }
    }
    let columns = TaskColumns {
        kind: TaskKind::Classification,
        label: "label".into(),
        features: None,
        text: Some("text".into()),
        validation_split: 0.05,
    };
    Ok(prepare(&table, &columns, SEED)?)
}

/// The precisions each operator ran at in a rank's profile (its candidates: the keep-list's
/// floors already applied), lowest first.
fn levels(table: &CostTable) -> Vec<Vec<Precision>> {
    table
        .ops
        .iter()
        .map(|op| {
            let mut levels: Vec<Precision> = op.timings.iter().map(|t| t.precision).collect();
            levels.sort();
            levels
        })
        .collect()
}

/// Every operator at the lowest of its levels that is at least `p`.
fn uniform(levels: &[Vec<Precision>], p: Precision) -> Vec<Precision> {
    levels.iter().map(|l| l.iter().copied().find(|&q| q >= p).unwrap_or(Precision::F32)).collect()
}

/// The pairs to measure: both ranks at f32, rank 1 alone at uniform bf16 or int8 (the slow
/// rank lowered, as a plan does), both ranks lowered unlike each other, and seeded random
/// mixes on both ranks.
fn pairs(cli: &Cli, ranks: &[RankMeasurement]) -> Vec<(String, [Vec<Precision>; 2])> {
    let levels: Vec<Vec<Vec<Precision>>> = ranks.iter().map(|m| levels(&m.table)).collect();
    let (f32, bf16, int8) = (Precision::F32, Precision::Bf16, Precision::Int8);
    let mut pairs = vec![
        ("f32 / f32".to_string(), [uniform(&levels[0], f32), uniform(&levels[1], f32)]),
        ("f32 / uniform bf16".into(), [uniform(&levels[0], f32), uniform(&levels[1], bf16)]),
        ("f32 / uniform int8".into(), [uniform(&levels[0], f32), uniform(&levels[1], int8)]),
        ("uniform int8 / uniform bf16".into(), [uniform(&levels[0], int8), uniform(&levels[1], bf16)]),
    ];
    let mut rng = Rng::new(12);
    let mut random = |levels: &[Vec<Precision>]| -> Vec<Precision> {
        levels.iter().map(|l| l[rng.below(l.len())]).collect()
    };
    for k in 0..cli.random_pairs {
        pairs.push((format!("random {k}"), [random(&levels[0]), random(&levels[1])]));
    }
    pairs
}

fn plan_of(network: &dyn Network, precisions: &[Precision]) -> PrecisionPlan {
    PrecisionPlan(network.precision_ops().into_iter().map(|(name, _)| name).zip(precisions.iter().copied()).collect())
}

/// One rank of the gang, from its first step to its last pair.
fn run_rank(cli: &Cli, data: Arc<Prepared>, rank: usize, ring: ring::Ring) -> anyhow::Result<RankOutcome> {
    let device = Device::Cpu;
    let (sync, _, _) = for_gang(ring, &device, RING_TIMEOUT, Arc::default())?;
    let model = assets_dir(cli.assets.clone()).join("all-MiniLM-L6-v2");
    let network = BertClassifier::load(&model, &data, TaskKind::Classification, SEED, &device)?;
    let adamw = OptimizerKind::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
    let mut trainer =
        Trainer::new(Box::new(network), adamw, data, TaskKind::Classification, cli.batch, SEED, device)?.with_sync(sync);

    let mut samples = Vec::new();
    for _ in 0..cli.profile_steps {
        trainer.step(LR)?;
        samples.push(Sample::last_step(&trainer)?);
    }
    let label = format!("cpu, {} thread(s)", cli.threads[rank]);
    let profiling = profile_rank(&trainer, &label, Precision::Int8, samples.len())?;
    // Every reading's measurements of every rank, exchanged in the same order on each.
    let gangs: Vec<Vec<RankMeasurement>> = READINGS
        .iter()
        .map(|r| {
            let (samples, statistic) = r.of(&samples);
            gather_measurements(&mut trainer, &profiling.measurement(samples, statistic))
        })
        .collect::<Result<_, _>>()?;
    let pairs: Vec<Pair> = if rank == 0 {
        let graphs: Vec<_> = gangs.iter().map(|ranks| gang_graph(&profiling.traces, ranks)).collect();
        let pairs = pairs(cli, &gangs[0])
            .into_iter()
            .map(|(label, plans)| {
                let steps = graphs
                    .iter()
                    .zip(&gangs)
                    .map(|(graph, ranks)| predict_gang(graph, ranks, &plans))
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(Pair {
                    label,
                    predicted_ms: steps.iter().map(|s| s.step_ms).collect(),
                    predicted_compute_ms: steps.iter().map(|s| [s.ranks[0].compute_ms, s.ranks[1].compute_ms]).collect(),
                    plans,
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        trainer.sync_mut().broadcast(serde_json::to_vec(&pairs)?)?;
        pairs
    } else {
        serde_json::from_slice(&trainer.sync_mut().broadcast(Vec::new())?)?
    };
    drop(profiling);

    let start = trainer.snapshot()?;
    let mut rounds = Vec::new();
    for _ in 0..cli.runs {
        let mut round = Vec::new();
        for pair in &pairs {
            let plan = plan_of(trainer.network(), &pair.plans[rank]);
            trainer.network_mut().set_precision(&plan)?;
            trainer.restore(&start)?;
            trainer.step(LR)?;
            let mut last = Instant::now();
            let mut steps = PairSteps::default();
            for _ in 0..cli.steps {
                trainer.step(LR)?;
                let now = Instant::now();
                steps.step_ms.push((now - last).as_secs_f64() * 1e3);
                let phases = trainer.last_phases().unwrap_or_default();
                let ms = |d: Duration| d.as_secs_f64() * 1e3;
                steps.compute_ms.push(ms(phases.compute));
                steps.allreduce_ms.push(trainer.last_timing().map_or(0.0, |t| ms(t.reduce)));
                steps.optimizer_ms.push(ms(phases.optimizer));
                last = now;
            }
            round.push(steps);
        }
        rounds.push(round);
    }
    let measurements = gangs.into_iter().map(|mut ranks| ranks.swap_remove(rank)).collect();
    Ok(RankOutcome { pairs, measurements, rounds })
}

fn percentile(values: &[f64], q: f64) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v[(q * (v.len() - 1) as f64).round() as usize]
}

fn plan_counts(plan: &[Precision]) -> String {
    [Precision::Int8, Precision::Bf16, Precision::F32]
        .iter()
        .map(|&p| format!("{p} ×{}", plan.iter().filter(|&&q| q == p).count()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// One batch shape measured: its markdown section and its JSON.
fn measure(cli: &Cli, lengths: Lengths) -> anyhow::Result<(String, serde_json::Value)> {
    let data = Arc::new(reviews(cli, lengths)?);
    let started = Instant::now();
    let rings = ring::loopback(2, Uuid::new_v4(), RING_TIMEOUT)?;
    let outcomes = std::thread::scope(|scope| {
        let handles: Vec<_> = rings
            .into_iter()
            .enumerate()
            .map(|(rank, ring)| {
                let data = data.clone();
                scope.spawn(move || -> anyhow::Result<RankOutcome> {
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(cli.threads[rank])
                        .thread_name(move |i| format!("rank{rank}-{i}"))
                        .build()?;
                    pool.install(|| run_rank(cli, data, rank, ring))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a rank panicked")).collect::<anyhow::Result<Vec<_>>>()
    })?;
    let pairs = &outcomes[0].pairs;
    let mut rows = Vec::new();
    // |error| per reading, per pair.
    let mut errors = vec![Vec::new(); READINGS.len()];
    let mut steady = Vec::new();
    let mut per_rounds = Vec::new();
    let mut md = format!(
        "## {} lengths\n\n| pair (rank 0 / rank 1) | predicted step ms | measured step ms (per round) | error | predicted / measured compute ms, rank 0 | rank 1 | rank 0 plan | rank 1 plan |\n|---|---|---|---|---|---|---|---|\n",
        match lengths {
            Lengths::Fixed => "Fixed",
            Lengths::Natural => "Natural",
        }
    );
    for (i, pair) in pairs.iter().enumerate() {
        let per_round: Vec<f64> = outcomes[0].rounds.iter().map(|round| median(&round[i].step_ms)).collect();
        let measured = median(&per_round);
        // A rank's median over every timed step of the pair.
        let part = |o: &RankOutcome, of: fn(&PairSteps) -> &Vec<f64>| -> f64 {
            median(&o.rounds.iter().flat_map(|round| of(&round[i]).iter().copied()).collect::<Vec<_>>())
        };
        let compute: Vec<f64> = outcomes.iter().map(|o| part(o, |p| &p.compute_ms)).collect();
        let rest: Vec<(f64, f64)> =
            outcomes.iter().map(|o| (part(o, |p| &p.allreduce_ms), part(o, |p| &p.optimizer_ms))).collect();
        let error: Vec<f64> = pair.predicted_ms.iter().map(|p| (p - measured) / measured).collect();
        for (errors, e) in errors.iter_mut().zip(&error) {
            errors.push(e.abs());
        }
        let row = format!(
            "| {} | {:.1} | {measured:.1} ({}) | {:+.1}% | {:.1} / {:.1} | {:.1} / {:.1} | {} | {} |\n",
            pair.label,
            pair.predicted_ms[0],
            per_round.iter().map(|m| format!("{m:.1}")).collect::<Vec<_>>().join(", "),
            100.0 * error[0],
            pair.predicted_compute_ms[0][0],
            compute[0],
            pair.predicted_compute_ms[0][1],
            compute[1],
            plan_counts(&pair.plans[0]),
            plan_counts(&pair.plans[1]),
        );
        print!("{lengths:?} {row}");
        md += &row;
        rows.push(json!({
            "pair": pair.label, "plans": pair.plans, "predicted_ms": pair.predicted_ms[0],
            "measured_ms": measured, "measured_per_round_ms": per_round, "error": error[0],
            "predicted_compute_ms": pair.predicted_compute_ms[0], "measured_compute_ms": compute,
            "measured_allreduce_ms": rest.iter().map(|r| r.0).collect::<Vec<_>>(),
            "measured_optimizer_ms": rest.iter().map(|r| r.1).collect::<Vec<_>>(),
            "by_reading": READINGS.iter().enumerate().map(|(k, r)| json!({
                "reading": r.name(), "predicted_ms": pair.predicted_ms[k], "error": error[k],
                "predicted_compute_ms": pair.predicted_compute_ms[k],
            })).collect::<Vec<_>>(),
        }));
        steady.push(rest);
        per_rounds.push(per_round);
    }
    let quantiles: Vec<(f64, f64)> = errors.iter().map(|e| (percentile(e, 0.5), percentile(e, 0.9))).collect();
    // This host's speed drifts from minute to minute (the same pair of plans took 446 and
    // 617 ms a step in two runs minutes apart), and the timed steps come minutes after the
    // profile. Each pair's step relative to the first pair's (f32 / f32) in the same round,
    // predicted against measured, leaves the drift out: what a plan choice rests on.
    let relative: Vec<(f64, f64)> = (0..READINGS.len())
        .map(|k| {
            let errors: Vec<f64> = (1..pairs.len())
                .map(|i| {
                    let predicted = pairs[i].predicted_ms[k] / pairs[0].predicted_ms[k];
                    let ratios: Vec<f64> = per_rounds[i].iter().zip(&per_rounds[0]).map(|(a, b)| a / b).collect();
                    (predicted / median(&ratios) - 1.0).abs()
                })
                .collect();
            (percentile(&errors, 0.5), percentile(&errors, 0.9))
        })
        .collect();
    let (median_error, p90_error) = quantiles[0];
    let verdict = |met: bool| if met { "met" } else { "not met" };
    let summary = format!(
        "**Median |error| {:.1}%, p90 |error| {:.1}%** over {} pairs (goal: median ≤ 5%: {}; p90 ≤ 10%: {}). \
         Relative to f32 / f32 in the same round (the host's drift left out), over the other {}: median {:.1}%, p90 {:.1}%. Wall time {:.0} s.",
        100.0 * median_error,
        100.0 * p90_error,
        pairs.len(),
        verdict(median_error <= GOAL_MEDIAN),
        verdict(p90_error <= GOAL_P90),
        pairs.len() - 1,
        100.0 * relative[0].0,
        100.0 * relative[0].1,
        started.elapsed().as_secs_f64()
    );
    println!("{lengths:?}: {summary}");
    // The timed steps' all-reduce and optimizer per rank: the median over the pairs of each
    // pair's median.
    let timed = |rank: usize, of: fn(&(f64, f64)) -> f64| median(&steady.iter().map(|r| of(&r[rank])).collect::<Vec<_>>());
    let mut readings = String::from(
        "| reading of the profiled steps | median / p90 \\|error\\| | relative to f32 / f32 | rank 0: overhead, all-reduce, optimizer ms | rank 1 |\n|---|---|---|---|---|\n",
    );
    for (k, reading) in READINGS.iter().enumerate() {
        let parts: Vec<String> = outcomes
            .iter()
            .map(|o| {
                let m = &o.measurements[k];
                format!("{:.1}, {:.1}, {:.1}", m.table.overhead_ms, m.allreduce_ms, m.table.optimizer_ms)
            })
            .collect();
        let row = format!(
            "| {} | {:.1}% / {:.1}% | {:.1}% / {:.1}% | {} | {} |\n",
            reading.name(),
            100.0 * quantiles[k].0,
            100.0 * quantiles[k].1,
            100.0 * relative[k].0,
            100.0 * relative[k].1,
            parts[0],
            parts[1]
        );
        print!("{lengths:?} {row}");
        readings += &row;
    }
    let timed_row = format!(
        "| the timed steps | – | – | –, {:.1}, {:.1} | –, {:.1}, {:.1} |\n",
        timed(0, |r| r.0),
        timed(0, |r| r.1),
        timed(1, |r| r.0),
        timed(1, |r| r.1)
    );
    print!("{lengths:?} {timed_row}");
    md = format!(
        "{md}\n{summary}\n\nThe readings of the rest of a rank's step from its profiled f32 steps, side by side on the same profile and timed steps (the table above is the first, the planner's), with the parts of the step no planned operator covers as each reads them and as the timed steps measured them (the median over the pairs of each pair's median):\n\n{readings}{timed_row}"
    );
    let value = json!({
        "lengths": lengths, "pairs": rows, "median_abs_error": median_error, "p90_abs_error": p90_error,
        "readings": READINGS.iter().enumerate().map(|(k, r)| json!({
            "reading": r.name(), "median_abs_error": quantiles[k].0, "p90_abs_error": quantiles[k].1,
            "relative_median_abs_error": relative[k].0, "relative_p90_abs_error": relative[k].1,
            "measurements": outcomes.iter().map(|o| &o.measurements[k]).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "wall_s": started.elapsed().as_secs_f64(),
    });
    Ok((md, value))
}

fn main() -> anyhow::Result<()> {
    // As the worker runs its ranks.
    tessera_worker::memory::keep_freed_memory();
    let cli = Cli::parse();
    anyhow::ensure!(
        cli.threads.len() == 2 && cli.threads.iter().all(|&t| t > 0),
        "--threads takes two thread counts, rank 0's and rank 1's (e.g. 1,1)"
    );
    anyhow::ensure!(cli.batch >= 2 && cli.steps >= 1 && cli.runs >= 1 && cli.profile_steps >= 1, "--batch must be 2 or more, --steps, --runs and --profile-steps 1 or more");
    let split = split_gemms_for(&cli.threads);
    let date = chrono::Utc::now();
    let load_before = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let mut sections = Vec::new();
    let mut values = Vec::new();
    for &lengths in &cli.lengths {
        let (md, value) = measure(&cli, lengths)?;
        sections.push(md);
        values.push(value);
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let loadavg = |s: &str| s.split_whitespace().take(3).collect::<Vec<_>>().join(" ");
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let profile = if cfg!(debug_assertions) { "debug build" } else { "release build" };
    let header = format!(
        "# QSync predictor on a real gang (issue 12)\n\n\
         Written by `qsync_gang_predictor` (`bench/src/bin/qsync_gang_predictor.rs`; its doc says how it measures).\n\n\
         - Machine: {}; CPU flags of note: {}; load average (1/5/15 min) before {}, at the end {}\n\
         - Date: {}; command: `{command}` ({profile})\n\
         - Gang: two ranks in one process over the worker's ring all-reduce (loopback TCP), rank threads {} and {}; candle splits an f32 GEMM into {split} tasks\n\
         - Workload: all-MiniLM-L6-v2 fine-tuned whole on {} rotten-tomatoes reviews, global batch {} ({} per rank), AdamW, LR {LR}; \
         each rank measured itself on {} f32 steps as a job's rank does; per pair and round one warm-up step and {} timed steps from the same snapshot, {} rounds, the pairs alternating\n\
         - Predicted: `predict_gang` (the replay `plan_gang` reports), from the ranks' own measurements; measured: rank 0's time between consecutive step ends, \
         the median of a round's steps, then the median over rounds. The compute columns: the replayer's forward and backward with the measured overhead against the ranks' measured compute (median of all steps)\n\n",
        machine(),
        cpu_flags(),
        loadavg(&load_before),
        loadavg(&load),
        date.to_rfc3339(),
        cli.threads[0],
        cli.threads[1],
        cli.rows,
        cli.batch,
        cli.batch / 2,
        cli.profile_steps,
        cli.steps,
        cli.runs,
    );
    let markdown = header + &sections.join("\n");
    let out = cli.out.clone().unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("results"));
    std::fs::create_dir_all(&out)?;
    std::fs::write(out.join("qsync_gang_predictor.md"), &markdown)?;
    let document = json!({
        "machine": machine(), "cpu_flags": cpu_flags(), "date": date.to_rfc3339(), "command": command,
        "threads": cli.threads, "batch": cli.batch, "rows": cli.rows, "steps": cli.steps, "runs": cli.runs,
        "profile_steps": cli.profile_steps, "shapes": values,
    });
    std::fs::write(out.join("qsync_gang_predictor.json"), serde_json::to_string_pretty(&document)? + "\n")?;
    println!("wrote {}", out.join("qsync_gang_predictor.md").display());
    Ok(())
}
