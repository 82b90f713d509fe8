//! The training engine end to end in process: real data through the session loop, with
//! fixed schedules and AutoLRS, checkpoints written and resumed.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use candle_core::Device;
use tessera_api::train::{LrSchedule, StepPhase};
use tessera_worker::train::data::{prepare, Table, TaskColumns, TaskKind};
use tessera_worker::train::model::mlp::Mlp;
use tessera_worker::train::optim::OptimizerKind;
use tessera_worker::train::policy;
use tessera_worker::train::rng::Rng;
use tessera_worker::train::session::{Event, Limits, Session};
use tessera_worker::train::trainer::{Evaluation, Trainer};

const SGD: OptimizerKind = OptimizerKind::Sgd { momentum: 0.9, nesterov: false, weight_decay: 0.0 };

/// Three noisy Gaussian blobs in 4-D: learnable, but not in one step.
fn blobs_csv(seed: u64) -> String {
    let mut rng = Rng::new(seed);
    let mut csv = String::from("a,b,c,d,label\n");
    for i in 0..300 {
        let class = i % 3;
        let values: Vec<String> =
            (0..4).map(|d| format!("{:.4}", (class * (d + 1)) as f64 * 0.6 + rng.next_f64() * 2.0)).collect();
        csv += &format!("{},{class}\n", values.join(","));
    }
    csv
}

fn classification() -> TaskColumns {
    TaskColumns {
        kind: TaskKind::Classification,
        label: "label".into(),
        features: None,
        text: None,
        validation_split: 0.2,
    }
}

fn session(
    csv: &str,
    task: &TaskColumns,
    optimizer: OptimizerKind,
    schedule: &LrSchedule,
    limits: Limits,
    seed: u64,
) -> Session {
    let table = Table::parse(csv.as_bytes()).unwrap();
    let data = Arc::new(prepare(&table, task, seed).unwrap());
    let outputs = if task.kind == TaskKind::Classification { data.classes.len() } else { 1 };
    let mlp = Mlp::new(data.input_dim(), &[32], outputs, seed, &Device::Cpu).unwrap();
    let trainer = Trainer::new(Box::new(mlp), optimizer, data, task.kind, 32, seed, Device::Cpu).unwrap();
    Session::new(trainer, policy::build(schedule, limits.max_steps, seed), limits)
}

/// Runs to the end; returns the `(step, loss)` series, the checkpoints and the final eval.
fn run(session: &mut Session) -> (Vec<(u64, Option<f64>)>, Vec<(u64, HashMap<String, Vec<u8>>)>, Evaluation) {
    let (mut losses, mut checkpoints) = (Vec::new(), Vec::new());
    let evaluation = session
        .run(&AtomicBool::new(false), &mut |event| match event {
            Event::Step(row) => losses.push((row.step, row.values.get("loss").copied())),
            Event::Checkpoint(c) => {
                checkpoints.push((c.step, c.files.into_iter().map(|(n, b)| (n.to_string(), b)).collect()))
            }
            Event::Eval(_) | Event::Stage(_) | Event::RankStep(_) | Event::PrecisionPlan(_) => {}
        })
        .unwrap();
    (losses, checkpoints, evaluation)
}

fn limits(max_steps: u64) -> Limits {
    Limits { max_steps, eval_every: 25, checkpoint_every: 40 }
}

#[test]
fn same_seed_gives_the_same_loss_sequence() {
    let csv = blobs_csv(1);
    let schedule = LrSchedule::Constant { lr: 0.05 };
    let (a, _, _) = run(&mut session(&csv, &classification(), SGD, &schedule, limits(60), 7));
    let (b, _, _) = run(&mut session(&csv, &classification(), SGD, &schedule, limits(60), 7));
    let (c, _, _) = run(&mut session(&csv, &classification(), SGD, &schedule, limits(60), 8));
    assert_eq!(a.len(), 60);
    assert_eq!(a, b, "same seed, same losses, bit for bit");
    assert_ne!(a, c, "another seed starts elsewhere");
}

/// Resuming from a checkpoint gives exactly the losses the uninterrupted run had after it.
fn resume_matches(schedule: LrSchedule, optimizer: OptimizerKind, max_steps: u64) {
    let csv = blobs_csv(2);
    let task = classification();
    let (full, checkpoints, final_eval) = run(&mut session(&csv, &task, optimizer, &schedule, limits(max_steps), 3));
    let steps: Vec<u64> = checkpoints.iter().map(|(s, _)| *s).collect();
    assert_eq!(*steps.last().unwrap(), max_steps, "a checkpoint at the end");
    for (step, files) in &checkpoints[..checkpoints.len() - 1] {
        let mut resumed = session(&csv, &task, optimizer, &schedule, limits(max_steps), 3);
        resumed.resume(files, &Device::Cpu).unwrap();
        assert_eq!(resumed.step(), *step);
        let (rest, _, resumed_eval) = run(&mut resumed);
        let expected: Vec<(u64, Option<f64>)> = full.iter().copied().filter(|(s, _)| s > step).collect();
        assert_eq!(rest, expected, "resumed at step {step}");
        assert_eq!(resumed_eval, final_eval);
    }
}

#[test]
fn checkpoint_resume_continues_exactly_with_sgd_and_cosine() {
    resume_matches(LrSchedule::Cosine { lr: 0.1, warmup_steps: 10, min_lr: 0.0 }, SGD, 130);
}

#[test]
fn checkpoint_resume_continues_exactly_with_adamw() {
    let adamw = OptimizerKind::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
    resume_matches(LrSchedule::Constant { lr: 0.003 }, adamw, 90);
}

#[test]
fn checkpoint_resume_continues_exactly_inside_autolrs_stages() {
    // τ' = 6, k = 3: a 38-step stage (18 search + 20 exploitation), so checkpoints every
    // 40 steps land inside candidates and inside exploitation.
    let schedule = LrSchedule::Autolrs { min_lr: 1e-3, max_lr: 1.0, tau_prime: 6, tau: 20, k: 3, tau_max: 40 };
    resume_matches(schedule, SGD, 170);
}

#[test]
fn autolrs_searches_then_exploits_and_reports_its_stages() {
    let csv = blobs_csv(3);
    let schedule = LrSchedule::Autolrs { min_lr: 1e-3, max_lr: 1.0, tau_prime: 8, tau: 30, k: 4, tau_max: 60 };
    let mut s = session(&csv, &classification(), SGD, &schedule, limits(200), 5);
    let (mut lrs, mut phases, mut stages) = (Vec::new(), Vec::new(), Vec::new());
    s.run(&AtomicBool::new(false), &mut |event| match event {
        Event::Step(row) => {
            lrs.push(row.values["lr"]);
            phases.push(row.phase);
        }
        Event::Stage(record) => stages.push(record),
        _ => {}
    })
    .unwrap();
    assert_eq!(lrs.len(), 200, "search steps are training steps");
    // Each step row says what it was spent on.
    assert!(phases[..32].iter().all(|&p| p == Some(StepPhase::Search)), "{phases:?}");
    assert!(phases[32..62].iter().all(|&p| p == Some(StepPhase::Exploit)), "{phases:?}");
    // Stage 0: four candidates of 8 steps each at their own LR, then 30 at the chosen one.
    let first = stages.iter().find(|r| r.stage == 0 && r.observed_loss_after_tau.is_some()).expect("stage 0 completed");
    assert_eq!(first.candidates.len(), 4);
    for (i, candidate) in first.candidates.iter().enumerate() {
        assert!(lrs[i * 8..(i + 1) * 8].iter().all(|&lr| lr == candidate.lr));
        assert!((1e-3..=1.0).contains(&candidate.lr));
    }
    assert!(lrs[32..62].iter().all(|&lr| lr == first.chosen_lr));
    assert!(first.candidates.iter().any(|c| c.lr == first.chosen_lr));
    // Stage 1 doubles τ' and τ.
    let second = stages.iter().find(|r| r.stage == 1).expect("stage 1 searched");
    assert_eq!((second.tau_prime, second.tau, second.start_step), (16, 60, 62));
}

fn dataset(name: &str) -> Option<String> {
    let root = std::env::var("TESSERA_ASSETS")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.assets"));
    let path = root.join("datasets").join(name);
    match std::fs::read_to_string(&path) {
        Ok(text) => Some(text),
        Err(_) => {
            assert!(
                std::env::var("TESSERA_REQUIRE_ASSETS").as_deref() != Ok("1"),
                "{} is missing; run scripts/fetch-datasets.sh",
                path.display()
            );
            eprintln!("skipping: {} is missing; run scripts/fetch-datasets.sh", path.display());
            None
        }
    }
}

#[test]
fn mlp_learns_handwritten_digits() {
    let Some(csv) = dataset("digits.csv") else {
        return;
    };
    let schedule = LrSchedule::Constant { lr: 0.05 };
    let limits = Limits { max_steps: 300, eval_every: 100, checkpoint_every: 1000 };
    let mut s = session(&csv, &classification(), SGD, &schedule, limits, 1);
    let (losses, _, evaluation) = run(&mut s);
    let accuracy = evaluation.accuracy.unwrap();
    assert!(accuracy > 0.93, "validation accuracy {accuracy}");
    assert!(
        losses[0].1.unwrap() > 2.0 && losses.last().unwrap().1.unwrap() < 0.3,
        "{:?} … {:?}",
        losses[0],
        losses.last()
    );
}

#[test]
fn mlp_regresses_wine_quality() {
    let Some(csv) = dataset("winequality-red.csv") else {
        return;
    };
    let task = TaskColumns {
        kind: TaskKind::Regression,
        label: "quality".into(),
        features: None,
        text: None,
        validation_split: 0.2,
    };
    let adamw = OptimizerKind::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 };
    let limits = Limits { max_steps: 600, eval_every: 200, checkpoint_every: 1000 };
    let (_, _, evaluation) = run(&mut session(&csv, &task, adamw, &LrSchedule::Constant { lr: 0.01 }, limits, 1));
    // The quality score's standard deviation is about 0.81: a model that learned nothing
    // but the mean scores that; the features explain part of it.
    let rmse = evaluation.rmse.unwrap();
    assert!(rmse < 0.72, "validation rmse {rmse}");
}
