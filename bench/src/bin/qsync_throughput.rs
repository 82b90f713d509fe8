//! QSync hybrid throughput benchmark (issue 12): steps per second of a synchronous
//! data-parallel job whose two ranks run on unequal devices, with the slow rank kept at f32,
//! at uniform bf16 or int8, or at QSync's plan.
//!
//! Two ranks train one model in this process over the worker's real data-parallel path:
//! `collective::ring::loopback`, `collective::for_gang` (the host-staged ring between unequal
//! devices), `Trainer::with_sync`, and the worker's precision planner in the session
//! (`train::hybrid::Planner`: every rank profiles its operators on its real shapes, rank 0
//! plans the gang with `train::qsync::plan_rank`, its budget the fast rank's step, and every
//! rank applies its plan). Each rank's compute runs in its own rayon pool of `--threads` threads
//! (installed around the session, as the worker runs a rank whose spec says
//! `{"device":"cpu","threads":N}`), so the GEMMs of a 12-thread rank and a 4-thread rank are
//! truly unequal; `--device cuda` puts rank 0 on the GPU (a build with `--features cuda`).
//! Nothing is throttled: the speed ratio between the ranks is what the devices give, and it is
//! measured and printed next to the figures.
//!
//! A run trains `profile_steps` steps at f32 (the planner's profiling), `--warmup` steps under
//! the plan, then `--steps` timed steps; steps/s is rank 0's over the timed steps (a step ends
//! for both ranks at the all-reduce). The plans alternate within each round of runs, so drift
//! of the host touches them alike; the figure per plan is the median of `--runs` runs.
//!
//! Run (on a host with at least as many cores as the threads asked, e.g. 16):
//!   cargo run --release -p tessera-bench --bin qsync_throughput -- --threads 12,4
//! Writes one section (per configuration: devices, threads, workload) of
//! bench/results/qsync_throughput.md and its key of qsync_throughput.json, or of `--out`. It
//! prints only, writing nothing, where the figure would not be a hybrid throughput: fewer cores
//! than threads asked (the ranks would share cores), ranks on equal resources, or fewer than 3
//! runs.

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use candle_core::Device;
use clap::{Parser, ValueEnum};
use serde_json::{json, Value};
use tessera_api::parallel::{PrecisionPolicy, PrecisionSpec, RankStep};
use tessera_api::precision::{Precision, PrecisionPlanReport};
use tessera_api::train::LrSchedule;
use tessera_bench::datasets::{assets_dir, dataset, every_kth_row};
use tessera_bench::report::replace_section;
use tessera_bench::stats::median;
use tessera_bench::{cpu_flags, machine, split_gemms_for};
use tessera_worker::collective::{for_gang, ring};
use tessera_worker::train::data::{prepare, Prepared, TaskColumns, TaskKind};
use tessera_worker::train::hybrid::Planner;
use tessera_worker::train::model::bert::BertClassifier;
use tessera_worker::train::model::mlp::Mlp;
use tessera_worker::train::model::Network;
use tessera_worker::train::optim::OptimizerKind;
use tessera_worker::train::policy;
use tessera_worker::train::session::{Event, Limits, Session};
use tessera_worker::train::trainer::Trainer;
use uuid::Uuid;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum RankDevice {
    Cpu,
    Cuda,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum WorkloadKind {
    /// all-MiniLM-L6-v2 fine-tuned (every encoder operator plannable) on the rotten-tomatoes reviews.
    Minilm,
    /// An MLP trained from scratch on scikit-learn's digits (cheap: a check that the benchmark runs).
    Mlp,
}

#[derive(Debug, Parser)]
struct Cli {
    /// Training threads of rank 0 and rank 1: each rank's compute runs in a rayon pool of
    /// that size (a CUDA rank's pool runs its host side).
    #[arg(long, value_delimiter = ',', default_value = "12,4")]
    threads: Vec<usize>,
    /// Rank 0's device (rank 1 is always the CPU); `cuda` needs a build with `--features cuda`.
    #[arg(long, value_enum, default_value_t = RankDevice::Cpu)]
    device: RankDevice,
    #[arg(long, value_enum, default_value_t = WorkloadKind::Minilm)]
    workload: WorkloadKind,
    /// Timed steps per run (after the profiling and the warm-up).
    #[arg(long, default_value_t = 8)]
    steps: u64,
    /// Untimed steps under the plan before the timed ones.
    #[arg(long, default_value_t = 2)]
    warmup: u64,
    /// Runs per plan; the figure is their median (3 at least for a recorded figure).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// The planner's profiled f32 steps (the job spec's `precision.profile_steps`).
    #[arg(long, default_value_t = 8)]
    profile_steps: u32,
    /// The global batch (each rank takes half); default 32 for minilm, 512 for mlp.
    #[arg(long)]
    batch: Option<usize>,
    /// Rows of the dataset used (every k-th row, so both classes stay); default 4096 for
    /// minilm (short evaluations), all for mlp.
    #[arg(long)]
    rows: Option<usize>,
    /// Where the assets are (default: .assets, or $TESSERA_ASSETS).
    #[arg(long)]
    assets: Option<PathBuf>,
    /// Folder the results go to (default: bench/results of the source tree).
    #[arg(long)]
    out: Option<PathBuf>,
    /// scripts/gpu-bundle.sh's build-info.json, copied into the results (a GPU machine run).
    #[arg(long)]
    build_info: Option<PathBuf>,
}

/// How long a rank waits on a silent neighbour (the leader's evaluation included).
const RING_TIMEOUT: Duration = Duration::from_secs(300);
/// Goals of issue 12: QSync against the slow rank kept at f32 (at a 3:1 speed ratio), and
/// against uniform low precision.
const GOAL_VS_F32: f64 = 1.5;
const GOAL_VS_UNIFORM: f64 = 0.95;

/// What the slow rank runs.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Arm {
    /// No planner: every rank at f32.
    F32,
    /// The planner's uniform policy: every operator the keep-list allows at `low` on the slower rank.
    Uniform(Precision),
    /// The planner's QSync policy, down to int8.
    Qsync,
}

impl Arm {
    const ALL: [Arm; 4] = [Arm::F32, Arm::Uniform(Precision::Bf16), Arm::Uniform(Precision::Int8), Arm::Qsync];

    fn label(self) -> String {
        match self {
            Arm::F32 => "slow rank at f32".into(),
            Arm::Uniform(p) => format!("uniform {p}"),
            Arm::Qsync => "QSync".into(),
        }
    }

    fn spec(self, profile_steps: u32) -> Option<PrecisionSpec> {
        let (policy, low) = match self {
            Arm::F32 => return None,
            Arm::Uniform(low) => (PrecisionPolicy::Uniform, low),
            Arm::Qsync => (PrecisionPolicy::Qsync, Precision::Int8),
        };
        // Each arm times one plan: no re-plan midway.
        Some(PrecisionSpec { policy, low, profile_steps, replan_drift: 0.0 })
    }
}

struct Workload {
    key: &'static str,
    title: &'static str,
    data: Arc<Prepared>,
    /// The model's folder (the MiniLM fine-tune).
    model: Option<PathBuf>,
    hidden: Vec<usize>,
    optimizer: OptimizerKind,
    lr: f64,
    batch: usize,
    setup: String,
}

const SEED: u64 = 1;

fn workload(cli: &Cli, assets: &Path) -> anyhow::Result<Workload> {
    let columns = |text: Option<&str>, validation_split: f64| TaskColumns {
        kind: TaskKind::Classification,
        label: "label".into(),
        features: None,
        text: text.map(String::from),
        validation_split,
    };
    Ok(match cli.workload {
        WorkloadKind::Minilm => {
            let table = every_kth_row(dataset(assets, "rotten_tomatoes.csv")?, cli.rows.unwrap_or(4096));
            let rows = table.rows.len();
            let batch = cli.batch.unwrap_or(32);
            let model = assets.join("all-MiniLM-L6-v2");
            anyhow::ensure!(
                model.join("model.safetensors").exists(),
                "{}: run scripts/fetch-assets.sh",
                model.display()
            );
            Workload {
                key: "minilm",
                title: "MiniLM fine-tune",
                data: Arc::new(prepare(&table, &columns(Some("text"), 0.05), SEED)?),
                model: Some(model),
                hidden: Vec::new(),
                optimizer: OptimizerKind::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 },
                lr: 2e-5,
                batch,
                setup: format!(
                    "all-MiniLM-L6-v2 fine-tuned whole (6 layers, hidden 384, every linear, LayerNorm and the embeddings \
                     plannable, the head f32) on {rows} rotten-tomatoes reviews (every k-th row of the file, 5 % held out), \
                     texts up to 128 tokens padded to the batch's longest; AdamW, constant LR 2e-5; global batch {batch} \
                     ({} per rank)",
                    batch / 2
                ),
            }
        }
        WorkloadKind::Mlp => {
            let table = every_kth_row(dataset(assets, "digits.csv")?, cli.rows.unwrap_or(0));
            let batch = cli.batch.unwrap_or(512);
            let hidden = vec![1024; 3];
            Workload {
                key: "mlp",
                title: "MLP on digits",
                data: Arc::new(prepare(&table, &columns(None, 0.2), SEED)?),
                model: None,
                setup: format!(
                    "scikit-learn's digits, MLP 64 → {} → 10 (ReLU) from scratch; SGD momentum 0.9, constant LR 0.05; \
                     global batch {batch} ({} per rank)",
                    hidden.iter().map(|h| h.to_string()).collect::<Vec<_>>().join(" → "),
                    batch / 2
                ),
                hidden,
                optimizer: OptimizerKind::Sgd { momentum: 0.9, nesterov: false, weight_decay: 0.0 },
                lr: 0.05,
                batch,
            }
        }
    })
}

fn network(workload: &Workload, device: &Device) -> anyhow::Result<Box<dyn Network>> {
    Ok(match &workload.model {
        Some(folder) => Box::new(BertClassifier::load(folder, &workload.data, TaskKind::Classification, SEED, device)?),
        None => {
            let classes = workload.data.classes.len();
            Box::new(Mlp::new(workload.data.input_dim(), &workload.hidden, classes, SEED, device)?)
        }
    })
}

fn rank_device(cli: &Cli, rank: usize) -> anyhow::Result<Device> {
    match (rank, cli.device) {
        (0, RankDevice::Cuda) => {
            anyhow::ensure!(cfg!(feature = "cuda"), "--device cuda needs a build with --features cuda");
            Device::new_cuda(0).context("rank 0 on CUDA device 0")
        }
        _ => Ok(Device::Cpu),
    }
}

/// A rank's device in words, as the worker labels it in the plan (`cpu, 4 threads`).
fn device_label(cli: &Cli, rank: usize) -> String {
    match (rank, cli.device) {
        (0, RankDevice::Cuda) => format!("cuda:0 (host side {} threads)", cli.threads[0]),
        _ if cli.threads[rank] == 1 => "cpu, 1 thread".into(),
        _ => format!("cpu, {} threads", cli.threads[rank]),
    }
}

/// What one rank saw in one run.
#[derive(Default)]
struct RankRun {
    /// When each optimizer step's metrics came out (after its all-reduce).
    stamps: Vec<(u64, Instant)>,
    timings: Vec<RankStep>,
    /// Rank 0's last report: the plan, and at the end its measured step.
    report: Option<PrecisionPlanReport>,
}

/// One run of one plan.
struct RunResult {
    steps_per_s: f64,
    /// Per rank, the median of the timed steps less their waiting for the other rank, ms.
    busy_ms: Vec<f64>,
    /// The same over the steps before the plan (all f32, the planner's profiling). Those are
    /// other batches: the MiniLM's are padded to their longest review, so their cost differs
    /// from the timed steps' even at f32 (every plan times the same batches, a seed's order).
    busy_before_ms: Vec<f64>,
    report: Option<PrecisionPlanReport>,
}

fn run_once(cli: &Cli, workload: &Workload, arm: Arm) -> anyhow::Result<RunResult> {
    let first_timed = cli.profile_steps as u64 + cli.warmup;
    let max_steps = first_timed + cli.steps;
    let rings = ring::loopback(2, Uuid::new_v4(), RING_TIMEOUT)?;
    let runs = std::thread::scope(|scope| {
        let handles: Vec<_> = rings
            .into_iter()
            .enumerate()
            .map(|(rank, ring)| {
                scope.spawn(move || -> anyhow::Result<RankRun> {
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(cli.threads[rank])
                        .thread_name(move |i| format!("rank{rank}-{i}"))
                        .build()?;
                    pool.install(|| {
                        let device = rank_device(cli, rank)?;
                        let (sync, _, _) = for_gang(ring, &device, RING_TIMEOUT, Arc::default())?;
                        let trainer = Trainer::new(
                            network(workload, &device)?,
                            workload.optimizer,
                            workload.data.clone(),
                            TaskKind::Classification,
                            workload.batch,
                            SEED,
                            device.clone(),
                        )?
                        .with_sync(sync);
                        let limits = Limits { max_steps, eval_every: max_steps, checkpoint_every: u64::MAX };
                        let policy = policy::build(&LrSchedule::Constant { lr: workload.lr }, max_steps, SEED);
                        let mut session = Session::new(trainer, policy, limits);
                        if let Some(spec) = arm.spec(cli.profile_steps) {
                            session = session.with_planner(Planner::new(spec, SEED, device_label(cli, rank)));
                        }
                        let mut seen = RankRun::default();
                        session.run(&AtomicBool::new(false), &mut |event| match event {
                            Event::Step(row) => seen.stamps.push((row.step, Instant::now())),
                            Event::RankStep(timing) => seen.timings.push(timing),
                            Event::PrecisionPlan(report) => seen.report = Some(report),
                            _ => {}
                        })?;
                        Ok(seen)
                    })
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a rank panicked")).collect::<anyhow::Result<Vec<_>>>()
    })?;
    let at = |step: u64| {
        runs[0].stamps.iter().find(|(s, _)| *s == step).map(|(_, t)| *t).context("rank 0 reported every step")
    };
    let seconds = at(max_steps)?.duration_since(at(first_timed)?).as_secs_f64();
    let busy = |steps: &dyn Fn(u64) -> bool| -> Vec<f64> {
        runs.iter()
            .map(|run| {
                median(&run.timings.iter().filter(|t| steps(t.step)).map(|t| t.iter_ms - t.wait_ms).collect::<Vec<_>>())
            })
            .collect()
    };
    Ok(RunResult {
        steps_per_s: cli.steps as f64 / seconds,
        busy_ms: busy(&|step| step > first_timed),
        busy_before_ms: busy(&|step| step <= cli.profile_steps as u64),
        report: runs[0].report.clone(),
    })
}

/// The plan in words: per rank that lowers any operator, how many it runs at each
/// precision (the planner, not this benchmark, decides which rank is the slow one).
fn plan_counts(report: &PrecisionPlanReport) -> String {
    let mut ranks = Vec::new();
    for plan in &report.ranks {
        if plan.ops.iter().all(|op| op.precision == Precision::F32) {
            continue;
        }
        let mut parts = Vec::new();
        for p in [Precision::Int8, Precision::Bf16, Precision::F16, Precision::F32] {
            let n = plan.ops.iter().filter(|op| op.precision == p).count();
            if n > 0 {
                parts.push(format!("{p} ×{n}"));
            }
        }
        ranks.push(format!("rank {}: {} (of {})", plan.rank, parts.join(", "), plan.ops.len()));
    }
    if ranks.is_empty() {
        "all f32 (the planner lowered nothing)".into()
    } else {
        ranks.join("; ")
    }
}

/// Why this run's figures are not recorded (they are printed all the same), if they are not.
fn not_recorded(cli: &Cli) -> Vec<String> {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let asked: usize = cli.threads.iter().sum();
    let mut why = Vec::new();
    if cores < asked {
        why.push(format!(
            "this host has {cores} cores, fewer than the {asked} threads asked ({}): the ranks would share cores, \
             so the figure would measure their contention, not unequal devices",
            cli.threads.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(" + ")
        ));
    }
    if cli.device == RankDevice::Cpu && cli.threads[0] == cli.threads[1] {
        why.push(format!("both ranks are {}: the devices are not unequal", device_label(cli, 0)));
    }
    if cli.runs < 3 {
        why.push(format!("{} runs per plan: a recorded figure is the median of 3 at least", cli.runs));
    }
    why
}

fn ratio_text(a: f64, b: f64) -> String {
    format!("{:.2}×", a / b)
}

fn main() -> anyhow::Result<()> {
    // As the worker runs its ranks.
    tessera_worker::memory::keep_freed_memory();
    let cli = Cli::parse();
    anyhow::ensure!(
        cli.threads.len() == 2 && cli.threads.iter().all(|&t| t > 0),
        "--threads takes two thread counts, rank 0's and rank 1's (e.g. 12,4)"
    );
    anyhow::ensure!(cli.steps >= 2 && cli.runs >= 1, "--steps must be 2 or more and --runs 1 or more");
    let split = split_gemms_for(&cli.threads);
    let assets = assets_dir(cli.assets.clone());
    let workload = workload(&cli, &assets)?;
    let date = chrono::Utc::now();
    let started = Instant::now();
    let refused = not_recorded(&cli);
    println!(
        "qsync_throughput: {} on rank 0 = {}, rank 1 = {}; {} runs of {} timed steps per plan; candle splits an f32 GEMM \
         into {split} tasks",
        workload.title,
        device_label(&cli, 0),
        device_label(&cli, 1),
        cli.runs,
        cli.steps
    );

    let mut results: Vec<(Arm, Vec<RunResult>)> = Arm::ALL.iter().map(|&arm| (arm, Vec::new())).collect();
    for run in 1..=cli.runs {
        for (arm, runs) in &mut results {
            let begun = Instant::now();
            let result = run_once(&cli, &workload, *arm)?;
            println!(
                "run {run} {}: {:.3} steps/s, rank busy ms {} (profiled steps, other batches: {}) ({:.0} s){}",
                arm.label(),
                result.steps_per_s,
                result.busy_ms.iter().map(|b| format!("{b:.1}")).collect::<Vec<_>>().join(" / "),
                result.busy_before_ms.iter().map(|b| format!("{b:.1}")).collect::<Vec<_>>().join(" / "),
                begun.elapsed().as_secs_f64(),
                result.report.as_ref().map_or(String::new(), |r| format!(
                    ", plan {}, predicted step {:.1} ms, budget {:.1} ms",
                    plan_counts(r),
                    r.predicted_step_ms,
                    r.budget_ms
                )),
            );
            runs.push(result);
        }
    }
    let (markdown, value) = summarise(&cli, &workload, &results, &date, started.elapsed().as_secs_f64());
    println!("{}", markdown.lines().filter(|l| l.starts_with("- ")).collect::<Vec<_>>().join("\n"));
    if refused.is_empty() {
        let out = cli.out.clone().unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("results"));
        write_results(&out, &markdown, &value)?;
        println!("wrote {}", out.join("qsync_throughput.md").display());
    } else {
        println!("not recorded (printed only):\n- {}", refused.join("\n- "));
    }
    Ok(())
}

fn configuration_key(cli: &Cli, workload: &Workload) -> String {
    let rank0 = match cli.device {
        RankDevice::Cuda => "cuda".into(),
        RankDevice::Cpu => format!("cpu{}", cli.threads[0]),
    };
    format!("{rank0}-cpu{}-{}", cli.threads[1], workload.key)
}

fn summarise(
    cli: &Cli,
    workload: &Workload,
    results: &[(Arm, Vec<RunResult>)],
    date: &chrono::DateTime<chrono::Utc>,
    wall: f64,
) -> (String, Value) {
    let figure = |arm: Arm| -> f64 {
        let runs = &results.iter().find(|(a, _)| *a == arm).expect("every arm runs").1;
        median(&runs.iter().map(|r| r.steps_per_s).collect::<Vec<_>>())
    };
    let f32_runs = &results[0].1;
    let busy_f32: Vec<f64> =
        (0..2).map(|rank| median(&f32_runs.iter().map(|r| r.busy_ms[rank]).collect::<Vec<_>>())).collect();
    let slow = if busy_f32[1] >= busy_f32[0] { 1 } else { 0 };
    let speed_ratio = busy_f32[slow] / busy_f32[1 - slow].max(1e-9);
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let profile = if cfg!(debug_assertions) { "debug build" } else { "release build" };
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load: String = load.split_whitespace().take(3).collect::<Vec<_>>().join(" ");
    let build_info: Value = cli
        .build_info
        .as_ref()
        .and_then(|p| std::fs::read_to_string(p).ok())
        .and_then(|s| serde_json::from_str(&s).ok())
        .unwrap_or(Value::Null);
    let title = format!("{}: rank 0 {}, rank 1 {}", workload.title, device_label(cli, 0), device_label(cli, 1));

    let mut md = format!(
        "## {title}\n\nMachine: {}; CPU flags of note: {}. Date: {}. Command: `{command}` ({profile}){}; wall time {wall:.0} s; \
         load average at the end {load}. Each rank's pool: {} threads; candle splits an f32 GEMM into {} tasks \
         (`RAYON_NUM_THREADS`).\n\nSetup: {}. Each run: {} profiled f32 steps (the planner's), {} warm-up steps under \
         the plan, {} timed steps; {} runs per plan, the plans alternating within each round.\n\n\
         Measured speed ratio of the ranks at all f32 (median step less waiting, slow ÷ fast): **{speed_ratio:.2} : 1** \
         (rank {slow} is the slow one: {:.1} ms against {:.1} ms).\n\n\
         | plan | steps/s per run | median steps/s | vs slow rank at f32 | step ms (median) | predicted step ms | budget ms | rank busy ms (r0 / r1) | operators lowered (run 1) |\n\
         |---|---|---|---|---|---|---|---|---|\n",
        machine(),
        cpu_flags(),
        date.to_rfc3339(),
        build_info.get("git_commit").and_then(Value::as_str).map_or(String::new(), |c| format!(", build of {c}")),
        cli.threads.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(" and "),
        candle_core::utils::get_num_threads(),
        workload.setup,
        cli.profile_steps,
        cli.warmup,
        cli.steps,
        cli.runs,
        busy_f32[slow],
        busy_f32[1 - slow],
    );
    let baseline = figure(Arm::F32);
    let mut arms_json = Vec::new();
    for (arm, runs) in results {
        let per_run: Vec<f64> = runs.iter().map(|r| r.steps_per_s).collect();
        let med = median(&per_run);
        let predicted: Vec<f64> = runs.iter().filter_map(|r| r.report.as_ref()).map(|r| r.predicted_step_ms).collect();
        let budgets: Vec<f64> = runs.iter().filter_map(|r| r.report.as_ref()).map(|r| r.budget_ms).collect();
        let busy: Vec<f64> =
            (0..2).map(|rank| median(&runs.iter().map(|r| r.busy_ms[rank]).collect::<Vec<_>>())).collect();
        let cell = |v: &[f64]| if v.is_empty() { "–".to_string() } else { format!("{:.1}", median(v)) };
        md += &format!(
            "| {} | {} | {med:.3} | {} | {:.1} | {} | {} | {:.1} / {:.1} | {} |\n",
            arm.label(),
            per_run.iter().map(|s| format!("{s:.3}")).collect::<Vec<_>>().join(", "),
            ratio_text(med, baseline),
            1e3 / med,
            cell(&predicted),
            cell(&budgets),
            busy[0],
            busy[1],
            runs[0].report.as_ref().map_or("all f32 (no planner)".into(), plan_counts),
        );
        arms_json.push(json!({
            "plan": arm.label(),
            "steps_per_s": per_run,
            "median_steps_per_s": med,
            "vs_slow_rank_f32": med / baseline,
            "busy_ms_median": busy,
            "busy_before_plan_ms": runs.iter().map(|r| &r.busy_before_ms).collect::<Vec<_>>(),
            "predicted_step_ms": predicted,
            "budget_ms": budgets,
            // Per run, per rank: each operator's precision (none without a planner).
            "plans": runs.iter().map(|r| r.report.as_ref().map(|rep| rep.ranks.iter().map(|p| {
                p.ops.iter().map(|op| (op.op.clone(), op.precision)).collect::<std::collections::BTreeMap<_, _>>()
            }).collect::<Vec<_>>())).collect::<Vec<_>>(),
        }));
    }
    let qsync = figure(Arm::Qsync);
    let (bf16, int8) = (figure(Arm::Uniform(Precision::Bf16)), figure(Arm::Uniform(Precision::Int8)));
    let at_three = (speed_ratio - 3.0).abs() <= 0.45;
    let ratio_note = if at_three {
        format!("the ranks' measured ratio {speed_ratio:.2} : 1 is near the goal's 3:1")
    } else {
        format!("the ranks' measured ratio is {speed_ratio:.2} : 1, not the goal's 3:1, so this is context, not the goal's test")
    };
    let verdict = |met: bool| if met { "met" } else { "not met" };
    md += &format!(
        "\nRatios of the medians:\n\n\
         - QSync ÷ slow rank at f32: **{}** (goal ≥ {GOAL_VS_F32}× at 3:1: **{}**; {ratio_note})\n\
         - QSync ÷ uniform bf16: **{}** (goal ≥ {GOAL_VS_UNIFORM}×: **{}**)\n\
         - QSync ÷ uniform int8: **{}** (goal ≥ {GOAL_VS_UNIFORM}×: **{}**)\n\n",
        ratio_text(qsync, baseline),
        verdict(qsync / baseline >= GOAL_VS_F32),
        ratio_text(qsync, bf16),
        verdict(qsync / bf16 >= GOAL_VS_UNIFORM),
        ratio_text(qsync, int8),
        verdict(qsync / int8 >= GOAL_VS_UNIFORM),
    );
    let value = json!({
        "benchmark": "qsync_throughput", "title": title, "machine": machine(), "cpu_flags": cpu_flags(),
        "date": date.to_rfc3339(), "command": command, "profile": profile, "build_info": build_info,
        "wall_seconds": wall, "load_average": load,
        "threads": cli.threads, "devices": [device_label(cli, 0), device_label(cli, 1)],
        "candle_gemm_split": candle_core::utils::get_num_threads(),
        "workload": workload.key, "setup": workload.setup, "batch": workload.batch,
        "profile_steps": cli.profile_steps, "warmup_steps": cli.warmup, "timed_steps": cli.steps, "runs": cli.runs,
        "slow_rank": slow, "busy_ms_at_f32": busy_f32, "speed_ratio": speed_ratio,
        "plans": arms_json,
        "ratios": {
            "qsync_vs_slow_rank_f32": qsync / baseline,
            "qsync_vs_uniform_bf16": qsync / bf16,
            "qsync_vs_uniform_int8": qsync / int8,
        },
        "goals": {"vs_slow_rank_f32": GOAL_VS_F32, "vs_uniform": GOAL_VS_UNIFORM, "speed_ratio_near_3_to_1": at_three},
    });
    let key = configuration_key(cli, workload);
    (md, json!({ "key": key, "result": value }))
}

/// Rewrites this configuration's section of qsync_throughput.md and its key of
/// qsync_throughput.json in `out`.
fn write_results(out: &Path, markdown: &str, value: &Value) -> anyhow::Result<()> {
    std::fs::create_dir_all(out)?;
    let md_path = out.join("qsync_throughput.md");
    let existing = std::fs::read_to_string(&md_path).unwrap_or_else(|_| {
        "# QSync hybrid throughput (issue 12)\n\n\
         Written by `qsync_throughput` (`bench/src/bin/qsync_throughput.rs`), one section per configuration (devices, \
         threads, workload); a run rewrites only its own. Two ranks train one model through the worker's data-parallel \
         path and its precision planner; each rank's compute runs in its own thread pool (or rank 0 on the GPU). Nothing \
         is throttled: a section exists only where the host had a core for every thread asked.\n"
            .into()
    });
    let heading = markdown.lines().next().expect("a section starts with its heading");
    std::fs::write(&md_path, replace_section(&existing, heading, markdown))?;
    let json_path = out.join("qsync_throughput.json");
    let mut document: Value = std::fs::read_to_string(&json_path)
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok())
        .filter(Value::is_object)
        .unwrap_or_else(|| json!({}));
    let key = value["key"].as_str().expect("a configuration key").to_string();
    document[key] = value["result"].clone();
    std::fs::write(&json_path, serde_json::to_string_pretty(&document)? + "\n")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use tessera_api::precision::{IndicatorKind, OpKind, PlannedOp, RankPlan};
    use tessera_worker::train::data::Table;

    use super::*;

    fn cli(args: &[&str]) -> Cli {
        Cli::parse_from(std::iter::once("qsync_throughput").chain(args.iter().copied()))
    }

    fn tiny_workload() -> Workload {
        let table = Table::parse(b"f0,label\n1,a\n2,b\n3,a\n4,b\n5,a\n6,b\n7,a\n8,b\n").unwrap();
        let columns = TaskColumns {
            kind: TaskKind::Classification,
            label: "label".into(),
            features: None,
            text: None,
            validation_split: 0.25,
        };
        Workload {
            key: "mlp",
            title: "MLP on digits",
            data: Arc::new(prepare(&table, &columns, SEED).unwrap()),
            model: None,
            hidden: vec![4],
            optimizer: OptimizerKind::Sgd { momentum: 0.0, nesterov: false, weight_decay: 0.0 },
            lr: 0.1,
            batch: 4,
            setup: "tiny".into(),
        }
    }

    /// Rank 1 runs `lowered` of two operators at int8.
    fn report(lowered: usize) -> PrecisionPlanReport {
        let plan = |rank: u32, low: usize| RankPlan {
            rank,
            device: "cpu".into(),
            ops: (0..2)
                .map(|i| PlannedOp {
                    op: format!("layers.{i}"),
                    kind: OpKind::Linear,
                    precision: if i < low { Precision::Int8 } else { Precision::F32 },
                    indicator: 0.0,
                })
                .collect(),
            predicted_ms: 10.0,
            indicator_sum: 0.0,
        };
        PrecisionPlanReport {
            indicator: IndicatorKind::GradientVariance,
            cost_tables: Vec::new(),
            cast_models: Vec::new(),
            ranks: vec![plan(0, 0), plan(1, lowered)],
            budget_ms: 10.0,
            predicted_step_ms: 11.0,
            measured_step_ms: None,
            trace: Vec::new(),
            replaced: Vec::new(),
        }
    }

    fn runs(steps_per_s: [f64; 3], lowered: Option<usize>) -> Vec<RunResult> {
        steps_per_s
            .iter()
            .map(|&s| RunResult {
                steps_per_s: s,
                busy_ms: vec![10.0, 30.0],
                busy_before_ms: vec![10.0, 30.0],
                report: lowered.map(report),
            })
            .collect()
    }

    #[test]
    fn medians_and_ratios_go_side_by_side_and_each_configuration_keeps_its_own_section() {
        let workload = tiny_workload();
        let results = vec![
            (Arm::F32, runs([1.0, 1.2, 0.8], None)),
            (Arm::Uniform(Precision::Bf16), runs([1.5, 1.6, 1.4], Some(1))),
            (Arm::Uniform(Precision::Int8), runs([2.0, 2.1, 1.9], Some(2))),
            (Arm::Qsync, runs([1.8, 1.9, 1.7], Some(1))),
        ];
        let date = chrono::Utc::now();
        let (md, value) = summarise(&cli(&["--threads", "12,4"]), &workload, &results, &date, 1.0);
        assert!(md.starts_with("## MLP on digits: rank 0 cpu, 12 threads, rank 1 cpu, 4 threads\n"), "{md}");
        assert!(md.contains("**3.00 : 1**"), "the ranks' measured ratio: {md}");
        assert!(md.contains("QSync ÷ slow rank at f32: **1.80×** (goal ≥ 1.5× at 3:1: **met**"), "{md}");
        assert!(md.contains("QSync ÷ uniform int8: **0.90×** (goal ≥ 0.95×: **not met**)"), "{md}");
        assert!(md.contains("rank 1: int8 ×1, f32 ×1 (of 2)"), "{md}");
        assert_eq!(value["key"], "cpu12-cpu4-mlp");
        assert_eq!(value["result"]["ratios"]["qsync_vs_uniform_bf16"], json!(1.8 / 1.5));

        let out = tempfile::tempdir().unwrap();
        write_results(out.path(), &md, &value).unwrap();
        let (other_md, other_value) =
            summarise(&cli(&["--threads", "4,12", "--device", "cuda"]), &workload, &results, &date, 1.0);
        write_results(out.path(), &other_md, &other_value).unwrap();
        write_results(out.path(), &md, &value).unwrap();
        let written = std::fs::read_to_string(out.path().join("qsync_throughput.md")).unwrap();
        assert_eq!(written.matches("\n## ").count(), 2, "one section per configuration, rewritten in place: {written}");
        let json: Value =
            serde_json::from_str(&std::fs::read_to_string(out.path().join("qsync_throughput.json")).unwrap()).unwrap();
        assert_eq!(json.as_object().unwrap().keys().collect::<Vec<_>>(), ["cpu12-cpu4-mlp", "cuda-cpu12-mlp"]);
    }

    #[test]
    fn a_host_short_of_cores_or_equal_ranks_records_nothing() {
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        let too_many = format!("{cores},1");
        assert!(not_recorded(&cli(&["--threads", &too_many]))[0].contains("fewer than the"));
        let equal = not_recorded(&cli(&["--threads", "1,1"]));
        assert!(equal.iter().any(|w| w.contains("not unequal")), "{equal:?}");
        assert!(not_recorded(&cli(&["--threads", "1,1", "--device", "cuda"]))
            .iter()
            .all(|w| !w.contains("not unequal")));
        assert!(not_recorded(&cli(&["--runs", "2"])).iter().any(|w| w.contains("median of 3")));
    }
}
