//! Learning-rate schedules benchmark: AutoLRS against constant, cosine and one-cycle, at
//! their sensible defaults and over a small LR grid, training the built-in MLP on two
//! real datasets (scikit-learn's digits, linfa's red wine quality) with the training
//! engine the worker runs. Per run: the steps to reach a target validation metric
//! (AutoLRS's search steps included: every optimizer step counts) and the metric at a
//! fixed step budget. Prints one line per figure; writes bench/results/lr_schedules.{json,md}.
//!
//! Run: scripts/fetch-datasets.sh, then
//!      cargo run --release -p tessera-bench --bin lr_schedules [-- --seeds 3]

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use candle_core::Device;
use clap::Parser;
use serde_json::{json, Value};
use tessera_api::train::LrSchedule;
use tessera_bench::machine;
use tessera_worker::train::data::{prepare, Prepared, Table, TaskColumns, TaskKind};
use tessera_worker::train::model::mlp::Mlp;
use tessera_worker::train::optim::OptimizerKind;
use tessera_worker::train::policy;
use tessera_worker::train::session::{Event, Limits, Session};
use tessera_worker::train::trainer::Trainer;

#[derive(Debug, Parser)]
struct Cli {
    /// Seeds per configuration (1, 2, …).
    #[arg(long, default_value_t = 3)]
    seeds: u64,
    /// Where the datasets are (default: .assets/datasets, or $TESSERA_ASSETS/datasets).
    #[arg(long)]
    datasets: Option<PathBuf>,
}

/// One benchmark problem: a dataset, its task, the target and the budget.
struct Problem {
    name: &'static str,
    file: &'static str,
    task: TaskColumns,
    hidden: &'static [usize],
    /// `accuracy` (higher is better) or `rmse` (lower is better).
    metric: &'static str,
    target: f64,
    budget: u64,
}

impl Problem {
    fn better(&self, a: f64, b: f64) -> bool {
        if self.metric == "rmse" {
            a < b
        } else {
            a > b
        }
    }

    fn reached(&self, value: f64) -> bool {
        value == self.target || self.better(value, self.target)
    }
}

const BATCH: usize = 32;
const EVAL_EVERY: u64 = 10;
const SGD: OptimizerKind = OptimizerKind::Sgd { momentum: 0.9, nesterov: false, weight_decay: 0.0 };
const GRID: [f64; 5] = [0.003, 0.01, 0.03, 0.1, 0.3];
/// The "sensible default" peak LR for SGD with momentum 0.9 (PyTorch examples' 0.1).
const DEFAULT_LR: f64 = 0.1;

struct Config {
    family: &'static str,
    /// `default`, `grid` or `autolrs`.
    group: &'static str,
    schedule: LrSchedule,
}

fn configs() -> Vec<Config> {
    let cosine = |lr| LrSchedule::Cosine { lr, warmup_steps: 0, min_lr: 0.0 };
    let onecycle = |max_lr| LrSchedule::Onecycle { max_lr, pct_start: 0.3, div_factor: 25.0, final_div_factor: 1e4 };
    let mut all = vec![
        Config { family: "constant", group: "default", schedule: LrSchedule::Constant { lr: DEFAULT_LR } },
        Config { family: "cosine", group: "default", schedule: cosine(DEFAULT_LR) },
        Config { family: "onecycle", group: "default", schedule: onecycle(DEFAULT_LR) },
    ];
    for lr in GRID {
        all.push(Config { family: "constant", group: "grid", schedule: LrSchedule::Constant { lr } });
        all.push(Config { family: "cosine", group: "grid", schedule: cosine(lr) });
        all.push(Config { family: "onecycle", group: "grid", schedule: onecycle(lr) });
    }
    // The range; τ' and τ scaled to a data set of ~45 steps per epoch, and the
    // authors' defaults (τ' = 100, τ = 1000) as they are.
    all.push(Config {
        family: "autolrs",
        group: "autolrs",
        schedule: LrSchedule::Autolrs { min_lr: 1e-4, max_lr: 1.0, tau_prime: 20, tau: 200, k: 10, tau_max: 1600 },
    });
    all.push(Config {
        family: "autolrs-paper-defaults",
        group: "autolrs",
        schedule: LrSchedule::Autolrs { min_lr: 1e-4, max_lr: 1.0, tau_prime: 100, tau: 1000, k: 10, tau_max: 8000 },
    });
    all
}

fn label(config: &Config) -> String {
    match config.schedule {
        LrSchedule::Constant { lr } => format!("constant lr={lr}"),
        LrSchedule::Cosine { lr, .. } => format!("cosine lr={lr}"),
        LrSchedule::Onecycle { max_lr, .. } => format!("onecycle max_lr={max_lr}"),
        LrSchedule::Autolrs { tau_prime, tau, k, .. } => format!("{} τ'={tau_prime} τ={tau} k={k}", config.family),
        LrSchedule::Step { lr, .. } => format!("step lr={lr}"),
    }
}

struct Outcome {
    steps_to_target: Option<u64>,
    /// `None`: the run diverged (its loss became NaN or infinite).
    final_metric: Option<f64>,
    seconds: f64,
}

fn train(problem: &Problem, data: &Arc<Prepared>, schedule: &LrSchedule, seed: u64) -> Outcome {
    let outputs = if problem.task.kind == TaskKind::Classification { data.classes.len() } else { 1 };
    let mlp = Mlp::new(data.input_dim(), problem.hidden, outputs, seed, &Device::Cpu).expect("mlp");
    let trainer =
        Trainer::new(Box::new(mlp), SGD, data.clone(), problem.task.kind, BATCH, seed, Device::Cpu).expect("trainer");
    let limits = Limits { max_steps: problem.budget, eval_every: EVAL_EVERY, checkpoint_every: u64::MAX };
    let mut session = Session::new(trainer, policy::build(schedule, problem.budget, seed), limits);
    let mut evals: Vec<(u64, f64)> = Vec::new();
    let started = Instant::now();
    let result = session.run(&AtomicBool::new(false), &mut |event| {
        if let Event::Eval(row) = event {
            evals.push((row.step, row.values[problem.metric]));
        }
    });
    let seconds = started.elapsed().as_secs_f64();
    match result {
        Ok(evaluation) => {
            let final_metric = if problem.metric == "rmse" { evaluation.rmse } else { evaluation.accuracy };
            let steps_to_target = evals.iter().find(|(_, v)| problem.reached(*v)).map(|(s, _)| *s);
            Outcome { steps_to_target, final_metric: final_metric.filter(|v| v.is_finite()), seconds }
        }
        // A diverged run stops; it reached the target only if it did before.
        Err(_) => {
            let steps_to_target = evals.iter().find(|(_, v)| problem.reached(*v)).map(|(s, _)| *s);
            Outcome { steps_to_target, final_metric: None, seconds }
        }
    }
}

fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len().max(1) as f64
}

/// Ranks configurations: most seeds reaching the target first, then fewest mean steps.
fn rank_key(steps: &[Option<u64>]) -> (usize, f64) {
    let reached: Vec<f64> = steps.iter().flatten().map(|&s| s as f64).collect();
    (steps.len() - reached.len(), if reached.is_empty() { f64::INFINITY } else { mean(&reached) })
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let root = std::env::var("TESSERA_ASSETS")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.assets"));
    let folder = cli.datasets.unwrap_or_else(|| root.join("datasets"));
    let problems = [
        Problem {
            name: "digits",
            file: "digits.csv",
            task: TaskColumns {
                kind: TaskKind::Classification,
                label: "label".into(),
                features: None,
                text: None,
                validation_split: 0.2,
            },
            hidden: &[64],
            metric: "accuracy",
            target: 0.98,
            budget: 3000,
        },
        Problem {
            name: "wine quality (red)",
            file: "winequality-red.csv",
            task: TaskColumns {
                kind: TaskKind::Regression,
                label: "quality".into(),
                features: None,
                text: None,
                validation_split: 0.2,
            },
            hidden: &[32],
            metric: "rmse",
            target: 0.65,
            budget: 3000,
        },
    ];
    let seeds: Vec<u64> = (1..=cli.seeds).collect();
    let mut results = Vec::new();
    let mut markdown = String::new();
    for problem in &problems {
        let path = folder.join(problem.file);
        let bytes = std::fs::read(&path)
            .map_err(|e| anyhow::anyhow!("{}: {e}; run scripts/fetch-datasets.sh", path.display()))?;
        let table = Table::parse(&bytes)?;
        let direction = if problem.metric == "rmse" { "≤" } else { "≥" };
        println!(
            "== {}: target {} {direction} {}, budget {} steps, seeds {seeds:?}",
            problem.name, problem.metric, problem.target, problem.budget
        );
        let mut rows = Vec::new();
        for config in configs() {
            let mut outcomes = Vec::new();
            for &seed in &seeds {
                // The split and standardisation follow the seed, as in a job.
                let data = Arc::new(prepare(&table, &problem.task, seed)?);
                outcomes.push(train(problem, &data, &config.schedule, seed));
            }
            let steps: Vec<Option<u64>> = outcomes.iter().map(|o| o.steps_to_target).collect();
            let finals: Vec<Option<f64>> = outcomes.iter().map(|o| o.final_metric).collect();
            let finite: Vec<f64> = finals.iter().flatten().copied().collect();
            let mean_final = (finite.len() == finals.len()).then(|| mean(&finite));
            let (missed, mean_steps) = rank_key(&steps);
            let steps_text: Vec<String> = steps.iter().map(|s| s.map_or("-".into(), |s| s.to_string())).collect();
            println!(
                "{:<8} {:<46} steps to target [{}] (reached {}/{}), final {} mean {} [{}], {:.1} s",
                config.group,
                label(&config),
                steps_text.join(", "),
                seeds.len() - missed,
                seeds.len(),
                problem.metric,
                mean_final.map_or("–".into(), |m| format!("{m:.4}")),
                finals
                    .iter()
                    .map(|f| f.map_or("diverged".into(), |f| format!("{f:.4}")))
                    .collect::<Vec<_>>()
                    .join(", "),
                outcomes.iter().map(|o| o.seconds).sum::<f64>(),
            );
            rows.push(json!({
                "group": config.group,
                "family": config.family,
                "label": label(&config),
                "schedule": serde_json::to_value(&config.schedule)?,
                "steps_to_target": steps,
                "reached": seeds.len() - missed,
                "mean_steps_to_target_of_reached": if mean_steps.is_finite() { json!(mean_steps) } else { Value::Null },
                "final_metric": finals,
                "mean_final_metric": mean_final,
            }));
        }
        let summary = summarise(problem, &rows);
        println!("{}", summary.0);
        markdown += &format!(
            "## {}\n\nTarget: validation {} {direction} {}; budget {} steps; SGD momentum 0.9, batch {BATCH}, MLP hidden {:?}; evaluation every {EVAL_EVERY} steps; seeds {seeds:?}.\n\n{}\n\n| group | schedule | steps to target per seed | reached | mean final {} |\n|---|---|---|---|---|\n",
            problem.name, problem.metric, problem.target, problem.budget, problem.hidden, summary.0, problem.metric
        );
        for row in &rows {
            let steps: Vec<String> = row["steps_to_target"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s.as_u64().map_or("–".into(), |s| s.to_string()))
                .collect();
            markdown += &format!(
                "| {} | {} | {} | {}/{} | {} |\n",
                row["group"].as_str().unwrap(),
                row["label"].as_str().unwrap(),
                steps.join(", "),
                row["reached"],
                seeds.len(),
                row["mean_final_metric"].as_f64().map_or("diverged on some seed".into(), |m| format!("{m:.4}"))
            );
        }
        markdown += "\n";
        results.push(json!({
            "problem": problem.name,
            "dataset": problem.file,
            "metric": problem.metric,
            "target": problem.target,
            "budget_steps": problem.budget,
            "summary": summary.1,
            "runs": rows,
        }));
    }
    let date = chrono::Utc::now().to_rfc3339();
    let profile = if cfg!(debug_assertions) { "debug" } else { "release" };
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let out = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("results");
    std::fs::create_dir_all(&out)?;
    let document = json!({"benchmark": "lr_schedules", "machine": machine(), "date": date, "command": command, "seeds": seeds, "problems": results});
    std::fs::write(out.join("lr_schedules.json"), serde_json::to_string_pretty(&document)? + "\n")?;
    let header = format!(
        "# Learning-rate schedules: AutoLRS vs constant, cosine, one-cycle\n\nMachine: {}. Date: {date}. Command: `{command}` ({profile} build).\n\nSteps to target count every optimizer step, AutoLRS's candidate (search) steps included; a run reaches the target at the first evaluation (every {EVAL_EVERY} steps) whose validation metric meets it, whichever model produced it (for AutoLRS that may be a candidate's model during a search). \"default\" schedules use the usual peak LR {DEFAULT_LR} for SGD with momentum; \"grid\" tries peak LRs {GRID:?}; a configuration's mean steps are over the seeds that reached the target, and configurations are ranked by seeds reached, then mean steps.\n\n",
        machine()
    );
    std::fs::write(out.join("lr_schedules.md"), header + &markdown)?;
    println!("wrote {}", out.join("lr_schedules.{json,md}").display());
    Ok(())
}

/// The comparison the issue asks for: AutoLRS's steps to target against the best default
/// schedule and the best grid configuration, and final metrics at the budget.
fn summarise(problem: &Problem, rows: &[Value]) -> (String, Value) {
    let key = |row: &Value| {
        let steps: Vec<Option<u64>> = row["steps_to_target"].as_array().unwrap().iter().map(Value::as_u64).collect();
        rank_key(&steps)
    };
    let best = |group: &str| -> Option<&Value> {
        rows.iter().filter(|r| r["group"] == group && r["family"] != "autolrs-paper-defaults").min_by(|a, b| {
            let (ka, kb) = (key(a), key(b));
            ka.0.cmp(&kb.0).then(ka.1.total_cmp(&kb.1))
        })
    };
    let autolrs = rows.iter().find(|r| r["family"] == "autolrs").expect("autolrs row");
    let (default, grid) = (best("default").unwrap(), best("grid").unwrap());
    let describe = |row: &Value| {
        let (missed, steps) = key(row);
        let seeds = row["steps_to_target"].as_array().unwrap().len();
        format!(
            "{} ({}/{} seeds reached, mean {} steps)",
            row["label"].as_str().unwrap(),
            seeds - missed,
            seeds,
            if steps.is_finite() { format!("{steps:.0}") } else { "–".into() }
        )
    };
    let ratio = |other: &Value| {
        let (a, b) = (key(autolrs), key(other));
        (a.0 == 0 && b.0 == 0).then(|| b.1 / a.1)
    };
    let best_final = rows
        .iter()
        .filter(|r| r["group"] != "autolrs")
        .filter_map(|r| r["mean_final_metric"].as_f64())
        .fold(None, |acc: Option<f64>, v| Some(acc.map_or(v, |a| if problem.better(v, a) { v } else { a })));
    let text = format!(
        "Best default schedule: {}. Best grid configuration: {}. AutoLRS: {}. Speed-up of AutoLRS in steps to target: {} vs the best default, {} vs the best tuned (>1 means AutoLRS is faster). Mean final {} at {} steps: AutoLRS {}, best fixed configuration {:.4}.",
        describe(default),
        describe(grid),
        describe(autolrs),
        ratio(default).map_or("n/a (not every seed reached the target)".into(), |r| format!("{r:.2}×")),
        ratio(grid).map_or("n/a (not every seed reached the target)".into(), |r| format!("{r:.2}×")),
        problem.metric,
        problem.budget,
        autolrs["mean_final_metric"].as_f64().map_or("diverged".into(), |m| format!("{m:.4}")),
        best_final.unwrap_or(f64::NAN),
    );
    let value = json!({
        "best_default": default["label"],
        "best_grid": grid["label"],
        "autolrs_speedup_vs_best_default": ratio(default),
        "autolrs_speedup_vs_best_grid": ratio(grid),
        "autolrs_mean_final_metric": autolrs["mean_final_metric"],
        "best_fixed_mean_final_metric": best_final,
    });
    (text, value)
}
