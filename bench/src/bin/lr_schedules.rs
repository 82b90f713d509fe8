//! Learning-rate schedules benchmark: AutoLRS against the usual fixed schedules, at their
//! defaults and over a small LR grid, with the training engine the worker runs. Per run:
//! the steps to reach a target validation metric (AutoLRS's search steps included: every
//! optimizer step counts) and the metric at the budget. Prints one line per figure;
//! writes bench/results/lr_schedules.{json,md}.
//!
//! The main problem is issue 13's fine-tuning task: all-MiniLM-L6-v2 plus a classification
//! head on the rotten-tomatoes critic reviews (fresh vs rotten), AdamW, the target being
//! the default recipe's (linear warm-up and decay, peak 5e-5, 3 epochs) final validation
//! loss, seed by seed. On a 2-core machine it runs the documented variant: the
//! encoder is frozen and its sentence embeddings are computed once (the worker's serving
//! engine) and cached; the head (an MLP, 384 → 256 → 2) is what trains. Digits and red
//! wine with SGD stay as a sanity table.
//!
//! Run: scripts/fetch-datasets.sh and scripts/fetch-assets.sh (the model), then
//!      cargo run -p tessera-bench --bin lr_schedules [-- --seeds 10 --sanity-seeds 5]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use candle_core::Device;
use clap::Parser;
use serde_json::{json, Value};
use tessera_api::train::{CandidateScore, LrSchedule, LrStageRecord, StepPhase};
use tessera_bench::datasets::{assets_dir, dataset, embedded_reviews};
use tessera_bench::stats::t95;
use tessera_bench::{cpu_flags, machine};
use tessera_worker::train::data::{prepare, Prepared, Table, TaskColumns, TaskKind};
use tessera_worker::train::model::mlp::Mlp;
use tessera_worker::train::optim::OptimizerKind;
use tessera_worker::train::policy;
use tessera_worker::train::session::{Event, Limits, Session};
use tessera_worker::train::trainer::Trainer;

#[derive(Debug, Parser)]
struct Cli {
    /// Seeds per configuration on the fine-tuning task (1, 2, …).
    #[arg(long, default_value_t = 5)]
    seeds: u64,
    /// Seeds per configuration on digits and wine.
    #[arg(long, default_value_t = 5)]
    sanity_seeds: u64,
    /// Run only the fine-tuning task.
    #[arg(long)]
    skip_sanity: bool,
    /// Run only these problems, of `finetune`, `digits`, `wine`.
    #[arg(long, value_delimiter = ',', default_value = "finetune,digits,wine")]
    problems: Vec<String>,
    /// Run only the configurations of these groups (`default`, `grid`, `autolrs`); a
    /// problem whose target is its default recipe's result runs that recipe anyway.
    #[arg(long, value_delimiter = ',')]
    groups: Option<Vec<String>>,
    /// The budget of the digits and wine runs, in steps.
    #[arg(long, default_value_t = 3000)]
    sanity_budget: u64,
    /// Print each AutoLRS run's stages (candidates, scores, choice, fallbacks).
    #[arg(long)]
    stages: bool,
    /// Where the assets are (default: .assets, or $TESSERA_ASSETS).
    #[arg(long)]
    assets: Option<PathBuf>,
}

/// What counts as reaching the goal.
#[derive(Debug, Clone, Copy)]
enum Target {
    /// A fixed value of the metric.
    Fixed(f64),
    /// The default recipe's final validation loss at its budget, per seed.
    DefaultFinal,
}

struct Problem {
    name: &'static str,
    /// `accuracy` (higher is better), `rmse` or `val_loss` (lower is better).
    metric: &'static str,
    target: Target,
    budget: u64,
    eval_every: u64,
    batch: usize,
    hidden: &'static [usize],
    optimizer: OptimizerKind,
    kind: TaskKind,
    configs: Vec<Config>,
    /// The optimizer and data in words, for the result file.
    setup: String,
}

impl Problem {
    fn reached(&self, value: f64, target: f64) -> bool {
        if self.metric == "accuracy" {
            value >= target
        } else {
            value <= target
        }
    }
}

struct Config {
    family: &'static str,
    /// `default`, `grid` or `autolrs`.
    group: &'static str,
    schedule: LrSchedule,
}

fn label(config: &Config) -> String {
    match config.schedule {
        LrSchedule::Constant { lr } => format!("constant lr={lr}"),
        LrSchedule::Linear { lr, warmup_steps } => format!("linear lr={lr} warmup={warmup_steps}"),
        LrSchedule::Cosine { lr, warmup_steps, .. } => format!("cosine lr={lr} warmup={warmup_steps}"),
        LrSchedule::Onecycle { max_lr, .. } => format!("onecycle max_lr={max_lr}"),
        LrSchedule::Autolrs { min_lr, max_lr, tau_prime, tau, k, .. } => {
            format!("{} [{min_lr}, {max_lr}] τ'={tau_prime} τ={tau} k={k}", config.family)
        }
        LrSchedule::Step { lr, .. } => format!("step lr={lr}"),
    }
}

/// The fine-tuning recipe's defaults: AdamW (β 0.9/0.999, weight decay 0.01), peak LR
/// 5e-5 with a linear warm-up over 10 % of the run then linear decay (BERT's and the
/// Hugging Face Trainer's recipe), batch 32, 3 epochs.
const FT_PEAK: f64 = 5e-5;
const FT_BATCH: usize = 32;
const FT_EPOCHS: u64 = 3;
const ADAMW: OptimizerKind = OptimizerKind::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };

fn finetune_configs(budget: u64) -> Vec<Config> {
    let warmup = budget / 10;
    let linear = |lr| LrSchedule::Linear { lr, warmup_steps: warmup };
    // In the order they run, most informative first (the results file is rewritten after
    // each configuration, so a run cut short still records what it measured): the
    // default recipe (the targets), AutoLRS over a range a new user would give (four
    // decades around the default; τ' and τ scaled to a run of ~1000 steps, the authors'
    // τ = 1000 being the whole budget), the grid over the default recipe's peak, then the
    // other schedules at the default peak.
    let mut all = vec![
        Config { family: "linear", group: "default", schedule: linear(FT_PEAK) },
        Config {
            family: "autolrs",
            group: "autolrs",
            schedule: LrSchedule::Autolrs { min_lr: 1e-5, max_lr: 1e-1, tau_prime: 20, tau: 200, k: 10, tau_max: 1600 },
        },
    ];
    for lr in [1e-3, 5e-3, 2e-4, 2e-2] {
        all.push(Config { family: "linear", group: "grid", schedule: linear(lr) });
    }
    all.push(Config { family: "constant", group: "default", schedule: LrSchedule::Constant { lr: FT_PEAK } });
    all.push(Config {
        family: "cosine",
        group: "default",
        schedule: LrSchedule::Cosine { lr: FT_PEAK, warmup_steps: warmup, min_lr: 0.0 },
    });
    all
}

const SGD: OptimizerKind = OptimizerKind::Sgd { momentum: 0.9, nesterov: false, weight_decay: 0.0 };
/// The "sensible default" peak LR for SGD with momentum 0.9 (PyTorch examples' 0.1).
const SANITY_DEFAULT_LR: f64 = 0.1;

/// The sanity problems' default, the best grid points of the earlier full grid
/// (onecycle 0.3 on digits, constant 0.03 on wine, both measured in the 2026-11-23 run),
/// and AutoLRS over the range.
fn sanity_configs() -> Vec<Config> {
    let onecycle = |max_lr| LrSchedule::Onecycle { max_lr, pct_start: 0.3, div_factor: 25.0, final_div_factor: 1e4 };
    vec![
        Config { family: "onecycle", group: "default", schedule: onecycle(SANITY_DEFAULT_LR) },
        Config { family: "constant", group: "default", schedule: LrSchedule::Constant { lr: SANITY_DEFAULT_LR } },
        Config { family: "onecycle", group: "grid", schedule: onecycle(0.3) },
        Config { family: "constant", group: "grid", schedule: LrSchedule::Constant { lr: 0.03 } },
        Config {
            family: "autolrs",
            group: "autolrs",
            schedule: LrSchedule::Autolrs { min_lr: 1e-4, max_lr: 1.0, tau_prime: 20, tau: 200, k: 10, tau_max: 1600 },
        },
    ]
}

/// One evaluation: its step, the metric, and whether it measured a search candidate.
struct Eval {
    step: u64,
    value: f64,
    phase: Option<StepPhase>,
}

struct Run {
    evals: Vec<Eval>,
    /// Exploitation steps done by each step number (AutoLRS; 0 for fixed schedules).
    exploit_steps: Vec<u64>,
    /// `None`: the run diverged (its loss became NaN or infinite).
    final_metric: Option<f64>,
    final_val_loss: Option<f64>,
    stages: Vec<LrStageRecord>,
    seconds: f64,
}

impl Run {
    /// The first evaluation of a model the run keeps (not a search candidate's) that meets
    /// the target.
    fn steps_to(&self, problem: &Problem, target: f64) -> Option<u64> {
        self.evals
            .iter()
            .filter(|e| e.phase != Some(StepPhase::Search))
            .find(|e| problem.reached(e.value, target))
            .map(|e| e.step)
    }
}

fn train(problem: &Problem, data: &Arc<Prepared>, schedule: &LrSchedule, seed: u64) -> Run {
    let outputs = if problem.kind == TaskKind::Classification { data.classes.len() } else { 1 };
    let mlp = Mlp::new(data.input_dim(), problem.hidden, outputs, seed, &Device::Cpu).expect("mlp");
    let trainer =
        Trainer::new(Box::new(mlp), problem.optimizer, data.clone(), problem.kind, problem.batch, seed, Device::Cpu)
            .expect("trainer");
    let limits = Limits { max_steps: problem.budget, eval_every: problem.eval_every, checkpoint_every: u64::MAX };
    let mut session = Session::new(trainer, policy::build(schedule, problem.budget, seed), limits);
    let (mut evals, mut exploit_steps) = (Vec::new(), vec![0u64]);
    let mut stages: BTreeMap<u32, LrStageRecord> = BTreeMap::new();
    let started = Instant::now();
    let result = session.run(&AtomicBool::new(false), &mut |event| match event {
        Event::Eval(row) => evals.push(Eval { step: row.step, value: row.values[problem.metric], phase: row.phase }),
        Event::Step(row) => {
            let done = exploit_steps.last().copied().unwrap_or(0);
            exploit_steps.push(done + u64::from(row.phase == Some(StepPhase::Exploit)));
        }
        Event::Stage(record) => {
            stages.insert(record.stage, record);
        }
        Event::Checkpoint(_) | Event::RankStep(_) | Event::PrecisionPlan(_) => {}
    });
    let seconds = started.elapsed().as_secs_f64();
    let (final_metric, final_val_loss) = match result {
        Ok(evaluation) => {
            let metric = match problem.metric {
                "rmse" => evaluation.rmse,
                "accuracy" => evaluation.accuracy,
                _ => Some(evaluation.val_loss),
            };
            (metric.filter(|v| v.is_finite()), Some(evaluation.val_loss).filter(|v| v.is_finite()))
        }
        Err(_) => (None, None),
    };
    Run { evals, exploit_steps, final_metric, final_val_loss, stages: stages.into_values().collect(), seconds }
}

fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len().max(1) as f64
}

/// A paired speed-up: per seed `baseline / contender` steps to target, summarised by the
/// geometric mean with a 95 % t-interval on the log ratios. Seeds where either missed
/// the target are left out (and counted).
#[derive(Debug, Clone, Copy)]
struct Paired {
    n: usize,
    missed: usize,
    mean: f64,
    low: f64,
    high: f64,
}

fn paired(baseline: &[Option<u64>], contender: &[Option<u64>]) -> Paired {
    let logs: Vec<f64> = baseline
        .iter()
        .zip(contender)
        .filter_map(|(b, c)| Some((b.as_ref().copied()? as f64 / c.as_ref().copied()?.max(1) as f64).ln()))
        .collect();
    let n = logs.len();
    let m = mean(&logs);
    let half = if n >= 2 {
        let sd = (logs.iter().map(|l| (l - m).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt();
        t95(n - 1) * sd / (n as f64).sqrt()
    } else {
        f64::NAN
    };
    Paired { n, missed: baseline.len() - n, mean: m.exp(), low: (m - half).exp(), high: (m + half).exp() }
}

impl Paired {
    fn text(&self) -> String {
        if self.n == 0 {
            return "n/a (no seed where both reached the target)".into();
        }
        let missed = if self.missed > 0 {
            format!(", {} seed(s) left out: a side missed the target", self.missed)
        } else {
            String::new()
        };
        if self.n >= 2 {
            format!("{:.2}× (95 % CI {:.2}–{:.2}, {} seeds{missed})", self.mean, self.low, self.high, self.n)
        } else {
            format!("{:.2}× (1 seed{missed})", self.mean)
        }
    }

    fn json(&self) -> Value {
        let finite = |v: f64| if v.is_finite() { json!(v) } else { Value::Null };
        json!({"geometric_mean": finite(self.mean), "ci95_low": finite(self.low), "ci95_high": finite(self.high), "seeds": self.n, "seeds_left_out": self.missed})
    }
}

/// One configuration's runs over the seeds, read against the per-seed targets.
struct Row<'a> {
    config: &'a Config,
    steps: Vec<Option<u64>>,
    /// AutoLRS: exploitation steps (only) before the target.
    exploit_steps: Vec<Option<u64>>,
    finals: Vec<Option<f64>>,
    runs: Vec<Run>,
}

impl Row<'_> {
    fn reached(&self) -> usize {
        self.steps.iter().flatten().count()
    }

    fn mean_steps(&self) -> f64 {
        let reached: Vec<f64> = self.steps.iter().flatten().map(|&s| s as f64).collect();
        if reached.is_empty() {
            f64::INFINITY
        } else {
            mean(&reached)
        }
    }

    fn diverged(&self) -> usize {
        self.finals.iter().filter(|f| f.is_none()).count()
    }
}

fn cell(value: Option<u64>) -> String {
    value.map_or("–".into(), |s| s.to_string())
}

/// The configurations of the groups asked for (all without `--groups`); `keep_first`
/// keeps the first, whose result is the problem's target.
fn selected(configs: Vec<Config>, groups: &Option<Vec<String>>, keep_first: bool) -> Vec<Config> {
    let Some(groups) = groups else { return configs };
    configs
        .into_iter()
        .enumerate()
        .filter(|(i, c)| (keep_first && *i == 0) || groups.iter().any(|g| g == c.group))
        .map(|(_, c)| c)
        .collect()
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let assets = assets_dir(cli.assets.clone());
    let started = Instant::now();
    let mut results = Vec::new();
    let mut markdown = String::new();

    let reviews = embedded_reviews(&assets)?;
    let label_task = |label: &str, kind| TaskColumns {
        kind,
        label: label.into(),
        features: None,
        text: None,
        validation_split: 0.2,
    };
    let train_rows = (reviews.rows.len() as f64 * 0.8) as u64;
    let ft_budget = FT_EPOCHS * train_rows / FT_BATCH as u64;
    let finetune = Problem {
        name: "rotten tomatoes (all-MiniLM-L6-v2, frozen encoder + head)",
        metric: "val_loss",
        target: Target::DefaultFinal,
        budget: ft_budget,
        eval_every: 40,
        batch: FT_BATCH,
        hidden: &[256],
        optimizer: ADAMW,
        kind: TaskKind::Classification,
        configs: selected(finetune_configs(ft_budget), &cli.groups, true),
        setup: format!(
            "{} reviews (fresh/rotten), 20 % held out per seed; encoder frozen, its normalised mean-pooled embeddings cached once; head MLP 384 → 256 → 2 (ReLU); AdamW β (0.9, 0.999), weight decay 0.01; batch {FT_BATCH}; {FT_EPOCHS} epochs = {ft_budget} steps; warm-up 10 % of the run for linear and cosine",
            reviews.rows.len()
        ),
    };
    let seeds: Vec<u64> = (1..=cli.seeds).collect();
    let write = |markdown: &str, results: &[Value]| write_results(&started, markdown, results);
    let wanted = |name: &str| cli.problems.iter().any(|p| p == name);
    if wanted("finetune") {
        let (text, value) = run_problem(
            &finetune,
            &reviews,
            &label_task("label", TaskKind::Classification),
            &seeds,
            cli.stages,
            &mut |text, value| write(text, std::slice::from_ref(value)),
        )?;
        markdown += &text;
        results.push(value);
        write(&markdown, &results)?;
    }

    if !cli.skip_sanity {
        let sanity_seeds: Vec<u64> = (1..=cli.sanity_seeds).collect();
        let sanity = [
            (
                Problem {
                    name: "digits (sanity)",
                    metric: "accuracy",
                    target: Target::Fixed(0.98),
                    budget: cli.sanity_budget,
                    eval_every: 10,
                    batch: 32,
                    hidden: &[64],
                    optimizer: SGD,
                    kind: TaskKind::Classification,
                    configs: selected(sanity_configs(), &cli.groups, false),
                    setup: "scikit-learn's 1797 8×8 digits, 20 % held out; MLP hidden [64]; SGD momentum 0.9; batch 32"
                        .into(),
                },
                "digits.csv",
                label_task("label", TaskKind::Classification),
            ),
            (
                Problem {
                    name: "wine quality, red (sanity)",
                    metric: "rmse",
                    target: Target::Fixed(0.65),
                    budget: cli.sanity_budget,
                    eval_every: 10,
                    batch: 32,
                    hidden: &[32],
                    optimizer: SGD,
                    kind: TaskKind::Regression,
                    configs: selected(sanity_configs(), &cli.groups, false),
                    setup: "1599 red wines, 20 % held out; MLP hidden [32]; SGD momentum 0.9; batch 32".into(),
                },
                "winequality-red.csv",
                label_task("quality", TaskKind::Regression),
            ),
        ];
        let key = |file: &str| if file.starts_with("digits") { "digits" } else { "wine" };
        for (problem, file, task) in sanity.iter().filter(|(_, file, _)| wanted(key(file))) {
            let table = dataset(&assets, file)?;
            let so_far = (markdown.clone(), results.clone());
            let (text, value) = run_problem(problem, &table, task, &sanity_seeds, cli.stages, &mut |text, value| {
                let mut all = so_far.1.clone();
                all.push(value.clone());
                write(&(so_far.0.clone() + text), &all)
            })?;
            markdown += &text;
            results.push(value);
            write(&markdown, &results)?;
        }
    }
    println!("wrote bench/results/lr_schedules.{{json,md}} in {:.0} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// Writes bench/results/lr_schedules.{json,md} with what has been measured so far.
fn write_results(started: &Instant, markdown: &str, results: &[Value]) -> anyhow::Result<()> {
    let date = chrono::Utc::now().to_rfc3339();
    let profile = if cfg!(debug_assertions) {
        "dev profile: tessera-worker opt-level 2, dependencies 1"
    } else {
        "release build"
    };
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let flags = cpu_flags();
    let out = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("results");
    std::fs::create_dir_all(&out)?;
    let wall = started.elapsed().as_secs_f64();
    let document = json!({"benchmark": "lr_schedules", "machine": machine(), "cpu_flags": flags, "date": date, "command": command, "profile": profile, "wall_seconds": wall, "problems": results});
    std::fs::write(out.join("lr_schedules.json"), serde_json::to_string_pretty(&document)? + "\n")?;
    let header = format!(
        "# Learning-rate schedules: AutoLRS vs the usual fixed schedules\n\n\
         Machine: {}; CPU flags of note: {flags}. Date: {date}. Command: `{command}` ({profile}); wall time {wall:.0} s.\n\n\
         Steps to target count every optimizer step, AutoLRS's candidate (search) steps included. A run reaches the target at the \
         first evaluation of a model it keeps whose validation metric meets it: evaluations of AutoLRS's search candidates (step \
         rows tagged `search`) do not count, since the search restores them away. The \"exploit-only\" reading counts only the \
         steps tagged `exploit` before that point (the search for free). Speed-ups are per seed (baseline steps / AutoLRS steps), \
         summarised by their geometric mean with a 95 % t-interval over the seeds (paired: same seed, same split and \
         initialisation). A run that diverged has no final metric; AutoLRS restores a diverged exploitation and goes on, and a run \
         whose budget ends inside a search (or on a diverged exploitation) ends on the stage snapshot, its last kept model.\n\n",
        machine()
    );
    std::fs::write(out.join("lr_schedules.md"), header + markdown)?;
    Ok(())
}

/// The CPU flags that decide the kernels' speed (for the result file's header).
/// Runs every configuration of a problem; after each one, `partial` gets the summary so
/// far (so the results file records a run that is cut short).
fn run_problem(
    problem: &Problem,
    table: &Table,
    task: &TaskColumns,
    seeds: &[u64],
    print_stages: bool,
    partial: &mut dyn FnMut(&str, &Value) -> anyhow::Result<()>,
) -> anyhow::Result<(String, Value)> {
    let datas: Vec<Arc<Prepared>> =
        seeds.iter().map(|&seed| prepare(table, task, seed).map(Arc::new)).collect::<Result<_, _>>()?;
    println!("== {}: metric {}, budget {} steps, seeds {seeds:?}", problem.name, problem.metric, problem.budget);
    // Per-seed targets: fixed, or the default recipe's final validation loss.
    let default_runs: Vec<Run> = match problem.target {
        Target::Fixed(_) => Vec::new(),
        Target::DefaultFinal => {
            let default = &problem.configs[0];
            seeds.iter().zip(&datas).map(|(&seed, data)| train(problem, data, &default.schedule, seed)).collect()
        }
    };
    let targets: Vec<f64> = match problem.target {
        Target::Fixed(value) => vec![value; seeds.len()],
        Target::DefaultFinal => default_runs
            .iter()
            .map(|r| r.final_val_loss.ok_or_else(|| anyhow::anyhow!("the default recipe diverged")))
            .collect::<anyhow::Result<_>>()?,
    };
    let mut default_runs = Some(default_runs).filter(|r| !r.is_empty());
    let mut rows: Vec<Row> = Vec::new();
    for (index, config) in problem.configs.iter().enumerate() {
        let runs: Vec<Run> = match (index, default_runs.take()) {
            (0, Some(runs)) => runs,
            _ => seeds.iter().zip(&datas).map(|(&seed, data)| train(problem, data, &config.schedule, seed)).collect(),
        };
        let steps: Vec<Option<u64>> = runs.iter().zip(&targets).map(|(r, &t)| r.steps_to(problem, t)).collect();
        let exploit_steps = runs
            .iter()
            .zip(&steps)
            .map(|(r, s)| s.map(|s| r.exploit_steps[(s as usize).min(r.exploit_steps.len() - 1)]))
            .collect();
        let finals = runs.iter().map(|r| r.final_metric).collect();
        let row = Row { config, steps, exploit_steps, finals, runs };
        println!(
            "{:<8} {:<48} steps to target [{}] (reached {}/{}), final {} [{}], {:.1} s",
            config.group,
            label(config),
            row.steps.iter().map(|s| cell(*s)).collect::<Vec<_>>().join(", "),
            row.reached(),
            seeds.len(),
            problem.metric,
            row.finals
                .iter()
                .map(|f| f.map_or("diverged".into(), |f| format!("{f:.4}")))
                .collect::<Vec<_>>()
                .join(", "),
            row.runs.iter().map(|r| r.seconds).sum::<f64>(),
        );
        if print_stages {
            for (seed, run) in seeds.iter().zip(&row.runs) {
                print_run_stages(*seed, run);
            }
        }
        rows.push(row);
        if index + 1 < problem.configs.len() {
            let (text, value) = summarise(problem, seeds, &targets, &rows);
            partial(
                &format!("{text}(Cut short: {} of {} configurations run.)\n\n", rows.len(), problem.configs.len()),
                &value,
            )?;
        }
    }
    Ok(summarise(problem, seeds, &targets, &rows))
}

/// One AutoLRS run's stages, a line per candidate, for `--stages`.
fn print_run_stages(seed: u64, run: &Run) {
    for s in &run.stages {
        println!(
            "  seed {seed} stage {} from step {} (τ'={} τ={} {}): chose {:.3e}, after τ {}, error {}{}",
            s.stage,
            s.start_step,
            s.tau_prime,
            s.tau,
            s.metric,
            s.chosen_lr,
            s.observed_loss_after_tau.map_or("–".into(), |v| format!("{v:.4}")),
            s.forecast_error.map_or("–".into(), |v| format!("{v:+.4}")),
            s.run_end.as_deref().map_or(String::new(), |r| format!("; run end: {r}")),
        );
        for c in &s.candidates {
            println!(
                "    lr {:.3e} score {} by {:?} (forecast {}, observed {}){}",
                c.lr,
                c.score.map_or("–".into(), |v| format!("{v:.4}")),
                c.scored_by,
                c.forecast_loss.map_or("–".into(), |v| format!("{v:.4}")),
                c.observed_loss.map_or("–".into(), |v| format!("{v:.4}")),
                c.note.as_deref().map_or(String::new(), |n| format!(" — {n}")),
            );
        }
        for f in &s.fallbacks {
            println!("    fallback from {:.3e} at step {} after {} steps: {}", f.lr, f.at_step, f.steps, f.reason);
        }
    }
    let kept: Vec<String> = run
        .evals
        .iter()
        .filter(|e| e.phase != Some(StepPhase::Search))
        .map(|e| format!("{}:{:.3}", e.step, e.value))
        .collect();
    println!("  seed {seed} kept-model evaluations: {}", kept.join(" "));
}

/// Ranks configurations: most seeds reaching the target, then fewest mean steps.
fn best<'a, 'b>(rows: &'a [Row<'b>], group: &str) -> Option<&'a Row<'b>> {
    rows.iter()
        .filter(|r| r.config.group == group)
        .min_by(|a, b| b.reached().cmp(&a.reached()).then(a.mean_steps().total_cmp(&b.mean_steps())))
}

fn summarise(problem: &Problem, seeds: &[u64], targets: &[f64], rows: &[Row]) -> (String, Value) {
    let n = seeds.len();
    let default = &rows[0];
    let best_default = best(rows, "default").unwrap_or(default);
    // Before any grid row has run, the default stands in (a gap of 1×).
    let best_grid = best(rows, "grid").unwrap_or(best_default);
    let describe = |row: &Row| {
        format!(
            "{} ({}/{n} seeds reached, mean {} steps)",
            label(row.config),
            row.reached(),
            if row.mean_steps().is_finite() { format!("{:.0}", row.mean_steps()) } else { "–".into() }
        )
    };
    let target_text = match problem.target {
        Target::Fixed(v) => {
            format!("validation {} {} {v}", problem.metric, if problem.metric == "accuracy" { "≥" } else { "≤" })
        }
        Target::DefaultFinal => format!(
            "validation loss ≤ the default recipe's ({}) final validation loss at its {} steps, per seed: [{}]",
            label(&problem.configs[0]),
            problem.budget,
            targets.iter().map(|t| format!("{t:.4}")).collect::<Vec<_>>().join(", ")
        ),
    };
    let mut text = format!(
        "## {}\n\nSetup: {}. Target: {target_text}. Budget {} steps for every run; evaluation every {} steps; seeds {seeds:?}.\n\n",
        problem.name, problem.setup, problem.budget, problem.eval_every
    );
    let gap = paired(&best_default.steps, &best_grid.steps);
    text += &format!(
        "**Gap first.** Best default: {}. Best grid configuration: {}. Best grid vs best default: {} fewer steps; this is roughly \
         the most a perfect tuner that pays nothing for its search could gain.\n\n",
        describe(best_default),
        describe(best_grid),
        gap.text()
    );
    let mut summary = json!({
        "targets": targets,
        "default": label(default.config),
        "best_default": label(best_default.config),
        "best_grid": label(best_grid.config),
        "best_grid_vs_best_default": gap.json(),
    });
    for row in rows.iter().filter(|r| r.config.group == "autolrs") {
        let vs_default = paired(&best_default.steps, &row.steps);
        let vs_grid = paired(&best_grid.steps, &row.steps);
        let exploit_only = paired(&best_default.steps, &row.exploit_steps);
        let stages: Vec<&LrStageRecord> = row.runs.iter().flat_map(|r| &r.stages).collect();
        let candidates: Vec<_> = stages.iter().flat_map(|s| &s.candidates).collect();
        let count = |kind: CandidateScore| candidates.iter().filter(|c| c.scored_by == kind).count();
        let fallbacks: usize = stages.iter().map(|s| s.fallbacks.len()).sum();
        let errors: Vec<f64> = stages.iter().filter_map(|s| s.forecast_error).map(f64::abs).collect();
        let ended_on_snapshot = row.runs.iter().filter(|r| r.stages.iter().any(|s| s.run_end.is_some())).count();
        let unsearched = stages.iter().filter(|s| s.tau_prime == 0).count();
        text += &format!(
            "**{}**: {}. Speed-up in steps to target, search steps counted: {} vs the best default, {} vs the best grid \
             configuration. Exploit-only reading vs the best default: {}. Diverged runs: {}/{n}; runs that ended on a stage snapshot \
             (budget inside a search, or a diverged exploitation at the end): {}/{n}. Candidates scored by their forecast {}, by \
             their observed loss (forecast not credible, or a stage comparing observed losses) {}, failed {}; exploitation \
             fallbacks {} over {} stages, {} of them (at the budget's end) without a search; mean |forecast error| after τ \
             {}.\n\n",
            label(row.config),
            describe(row),
            vs_default.text(),
            vs_grid.text(),
            exploit_only.text(),
            row.diverged(),
            ended_on_snapshot,
            count(CandidateScore::Forecast),
            count(CandidateScore::Observed),
            count(CandidateScore::Failed),
            fallbacks,
            stages.len(),
            unsearched,
            if errors.is_empty() { "–".into() } else { format!("{:.4}", mean(&errors)) },
        );
        summary[row.config.family] = json!({
            "label": label(row.config),
            "speedup_vs_best_default": vs_default.json(),
            "speedup_vs_best_grid": vs_grid.json(),
            "exploit_only_speedup_vs_best_default": exploit_only.json(),
            "diverged_runs": row.diverged(),
            "candidates_by_forecast": count(CandidateScore::Forecast),
            "candidates_by_observed": count(CandidateScore::Observed),
            "candidates_failed": count(CandidateScore::Failed),
            "fallbacks": fallbacks,
            "runs_ended_on_stage_snapshot": ended_on_snapshot,
            "stages_without_search": unsearched,
            "stages": stages.len(),
            "mean_abs_forecast_error": if errors.is_empty() { Value::Null } else { json!(mean(&errors)) },
        });
    }
    text += &format!(
        "| group | schedule | steps to target per seed | reached | AutoLRS exploit steps to target | final {} per seed (mean) |\n|---|---|---|---|---|---|\n",
        problem.metric
    );
    let mut runs_json = Vec::new();
    for row in rows {
        let finite: Vec<f64> = row.finals.iter().flatten().copied().collect();
        let mean_final = (finite.len() == n).then(|| mean(&finite));
        text += &format!(
            "| {} | {} | {} | {}/{n} | {} | {} ({}) |\n",
            row.config.group,
            label(row.config),
            row.steps.iter().map(|s| cell(*s)).collect::<Vec<_>>().join(", "),
            row.reached(),
            if row.config.group == "autolrs" {
                row.exploit_steps.iter().map(|s| cell(*s)).collect::<Vec<_>>().join(", ")
            } else {
                "".into()
            },
            row.finals
                .iter()
                .map(|f| f.map_or("diverged".into(), |f| format!("{f:.4}")))
                .collect::<Vec<_>>()
                .join(", "),
            mean_final.map_or("–".into(), |m| format!("{m:.4}")),
        );
        runs_json.push(json!({
            "group": row.config.group,
            "family": row.config.family,
            "label": label(row.config),
            "schedule": serde_json::to_value(&row.config.schedule).expect("schedule serialises"),
            "steps_to_target": row.steps,
            "exploit_steps_to_target": row.exploit_steps,
            "final_metric": row.finals,
            "stages": row.runs.iter().map(|r| &r.stages).collect::<Vec<_>>(),
        }));
    }
    text += "\n";
    let value = json!({
        "problem": problem.name,
        "metric": problem.metric,
        "budget_steps": problem.budget,
        "seeds": seeds,
        "summary": summary,
        "runs": runs_json,
    });
    println!("{}", text.lines().filter(|l| l.starts_with("**")).collect::<Vec<_>>().join("\n"));
    (text, value)
}
