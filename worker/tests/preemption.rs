//! Preemption in process (issue 16): a session asked to preempt checkpoints at the step it
//! is on (not at the next multiple of `checkpoint_every`) and stops; resumed from that
//! checkpoint it ends bit-identical to the run nobody interrupted, under fixed schedules,
//! AdamW and inside AutoLRS stages. A two-rank gang stops at one step when either rank is
//! asked, resumes bit-identically, and an elastic gang resumes at one rank, or at three
//! (the loaning round's resize: stop at a checkpoint, restart at another world size), and
//! finishes with the weights the uninterrupted run reaches, to f32 rounding.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use candle_core::Device;
use tessera_api::train::LrSchedule;
use tessera_worker::collective::{ring, RingSync};
use tessera_worker::train::data::{prepare, Table, TaskColumns, TaskKind};
use tessera_worker::train::model::mlp::Mlp;
use tessera_worker::train::optim::OptimizerKind;
use tessera_worker::train::policy;
use tessera_worker::train::rng::Rng;
use tessera_worker::train::session::{Event, Limits, Session, SessionError};
use tessera_worker::train::trainer::{Evaluation, Trainer};
use uuid::Uuid;

const SGD: OptimizerKind = OptimizerKind::Sgd { momentum: 0.9, nesterov: false, weight_decay: 0.0 };
const ADAMW: OptimizerKind = OptimizerKind::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
const LIMITS: Limits = Limits { max_steps: 150, eval_every: 25, checkpoint_every: 40 };

/// Three noisy Gaussian blobs in 4-D.
fn blobs_csv() -> String {
    let mut rng = Rng::new(5);
    let mut csv = String::from("a,b,c,d,label\n");
    for i in 0..300 {
        let class = i % 3;
        let values: Vec<String> =
            (0..4).map(|d| format!("{:.4}", (class * (d + 1)) as f64 * 0.6 + rng.next_f64() * 2.0)).collect();
        csv += &format!("{},{class}\n", values.join(","));
    }
    csv
}

fn session(optimizer: OptimizerKind, schedule: &LrSchedule, sync: Option<RingSync>) -> Session {
    let task = TaskColumns {
        kind: TaskKind::Classification,
        label: "label".into(),
        features: None,
        text: None,
        validation_split: 0.2,
    };
    let data = Arc::new(prepare(&Table::parse(blobs_csv().as_bytes()).unwrap(), &task, 3).unwrap());
    let mlp = Mlp::new(data.input_dim(), &[32], data.classes.len(), 3, &Device::Cpu).unwrap();
    let mut trainer = Trainer::new(Box::new(mlp), optimizer, data, task.kind, 32, 3, Device::Cpu).unwrap();
    if let Some(sync) = sync {
        trainer = trainer.with_sync(Box::new(sync));
    }
    Session::new(trainer, policy::build(schedule, LIMITS.max_steps, 3), LIMITS)
}

type Files = HashMap<String, Vec<u8>>;

/// What a run produced: its `(step, loss)` rows, its checkpoints, how it ended, and the
/// weights it ended with.
struct Run {
    losses: Vec<(u64, Option<f64>)>,
    checkpoints: Vec<(u64, Files)>,
    outcome: Result<Evaluation, SessionError>,
    weights: Vec<Vec<f32>>,
}

/// Runs `session`, setting `flag` once step `preempt_at` has been taken.
fn run(mut session: Session, flag: Option<(Arc<AtomicBool>, u64)>) -> Run {
    if let Some((flag, _)) = &flag {
        session = session.with_preemption(flag.clone());
    }
    let (mut losses, mut checkpoints) = (Vec::new(), Vec::new());
    let outcome = session.run(&AtomicBool::new(false), &mut |event| match event {
        Event::Step(row) => {
            if let Some((flag, at)) = &flag {
                if row.step == *at {
                    flag.store(true, Ordering::Relaxed);
                }
            }
            losses.push((row.step, row.values.get("loss").copied()));
        }
        Event::Checkpoint(c) => {
            checkpoints.push((c.step, c.files.into_iter().map(|(n, b)| (n.to_string(), b)).collect()))
        }
        Event::Eval(_) | Event::Stage(_) | Event::RankStep(_) | Event::PrecisionPlan(_) => {}
    });
    let weights = session
        .trainer()
        .network()
        .parameters()
        .iter()
        .map(|(_, var)| var.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .collect();
    Run { losses, checkpoints, outcome, weights }
}

fn resumed(mut session: Session, files: &Files) -> Session {
    session.resume(files, &Device::Cpu).unwrap();
    session
}

fn preempt_and_resume_matches(optimizer: OptimizerKind, schedule: LrSchedule, at: u64) {
    let full = run(session(optimizer, &schedule, None), None);
    let final_eval = *full.outcome.as_ref().unwrap();

    let flag = Arc::new(AtomicBool::new(false));
    let stopped = run(session(optimizer, &schedule, None), Some((flag, at)));
    assert!(matches!(stopped.outcome, Err(SessionError::Preempted { step }) if step == at), "{:?}", stopped.outcome);
    let steps: Vec<u64> = stopped.checkpoints.iter().map(|(s, _)| *s).collect();
    assert_eq!(steps, [40, at], "the regular checkpoint, then one at the step the preemption came");
    assert_eq!(stopped.losses, full.losses[..at as usize], "the same steps up to the preemption");

    let rest = run(resumed(session(optimizer, &schedule, None), &stopped.checkpoints[1].1), None);
    let expected: Vec<(u64, Option<f64>)> = full.losses.iter().copied().filter(|(s, _)| *s > at).collect();
    assert_eq!(rest.losses, expected, "the resumed run takes the uninterrupted run's steps, bit for bit");
    assert_eq!(*rest.outcome.as_ref().unwrap(), final_eval);
    assert_eq!(rest.weights, full.weights, "the same final weights, bit for bit");
    let last = |run: &Run| run.checkpoints.last().unwrap().1["model.safetensors"].clone();
    assert_eq!(last(&rest), last(&full), "the same final checkpoint bytes");
}

#[test]
fn a_preempted_run_with_sgd_and_cosine_resumes_bit_identically() {
    preempt_and_resume_matches(SGD, LrSchedule::Cosine { lr: 0.1, warmup_steps: 10, min_lr: 0.0 }, 57);
}

#[test]
fn a_preempted_run_with_adamw_resumes_bit_identically() {
    preempt_and_resume_matches(ADAMW, LrSchedule::Constant { lr: 0.003 }, 63);
}

#[test]
fn a_run_preempted_inside_an_autolrs_search_resumes_bit_identically() {
    // τ' = 6, k = 3: an 18-step search, then 20 exploitation steps; step 45 falls inside
    // the second stage's search, with a stage snapshot and a candidate under way.
    let schedule = LrSchedule::Autolrs { min_lr: 1e-3, max_lr: 1.0, tau_prime: 6, tau: 20, k: 3, tau_max: 40 };
    preempt_and_resume_matches(SGD, schedule, 45);
}

#[test]
fn a_preemption_asked_on_the_last_step_lets_the_run_finish() {
    let schedule = LrSchedule::Constant { lr: 0.05 };
    let flag = Arc::new(AtomicBool::new(false));
    let finished = run(session(SGD, &schedule, None), Some((flag, LIMITS.max_steps)));
    assert!(finished.outcome.is_ok(), "{:?}", finished.outcome.err());
    assert_eq!(finished.checkpoints.last().unwrap().0, LIMITS.max_steps);
}

/// Two ranks over loopback, rank r's flag set after step `asks[r]` (if any).
fn two_ranks(schedule: &LrSchedule, resume: Option<&Files>, asks: [Option<u64>; 2]) -> Vec<Run> {
    let rings = ring::loopback(2, Uuid::new_v4(), Duration::from_secs(30)).unwrap();
    std::thread::scope(|scope| {
        let handles: Vec<_> = rings
            .into_iter()
            .zip(asks)
            .map(|(ring, ask)| {
                scope.spawn(move || {
                    let flag = Arc::new(AtomicBool::new(false));
                    let sync = RingSync::new(ring).with_stop_request(flag.clone());
                    let mut session = session(SGD, schedule, Some(sync));
                    if let Some(files) = resume {
                        session = resumed(session, files);
                    }
                    run(session, ask.map(|at| (flag, at)))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn a_gang_stops_at_one_step_when_one_rank_is_asked_and_resumes_bit_identically() {
    let schedule = LrSchedule::Cosine { lr: 0.1, warmup_steps: 10, min_lr: 0.0 };
    let full = two_ranks(&schedule, None, [None, None]);
    // Rank 1 hears of the preemption after step 23; the ranks learn it from each other in
    // step 24's all-reduce and both stop after it.
    let stopped = two_ranks(&schedule, None, [None, Some(23)]);
    for (rank, run) in stopped.iter().enumerate() {
        assert!(matches!(run.outcome, Err(SessionError::Preempted { step: 24 })), "rank {rank}: {:?}", run.outcome);
    }
    assert_eq!(stopped[0].checkpoints.last().map(|(s, _)| *s), Some(24), "rank 0 checkpoints where the gang stopped");
    assert!(stopped[1].checkpoints.is_empty());

    let checkpoint = &stopped[0].checkpoints.last().unwrap().1;
    let rest = two_ranks(&schedule, Some(checkpoint), [None, None]);
    for rank in 0..2 {
        let expected: Vec<(u64, Option<f64>)> = full[rank].losses.iter().copied().filter(|(s, _)| *s > 24).collect();
        assert_eq!(rest[rank].losses, expected, "rank {rank}");
        assert_eq!(rest[rank].weights, full[rank].weights, "rank {rank}: the same final weights, bit for bit");
        assert_eq!(rest[rank].outcome.as_ref().unwrap(), full[rank].outcome.as_ref().unwrap());
    }
}

/// Shrinking: the global batch stays 32 rows, so one rank computes the same update the two
/// did, summed in another order. It resumes and finishes; its weights agree with the
/// two-rank run's to f32 rounding, not bit for bit.
#[test]
fn an_elastic_gang_resumes_at_one_rank_from_its_two_rank_checkpoint() {
    let schedule = LrSchedule::Cosine { lr: 0.1, warmup_steps: 10, min_lr: 0.0 };
    let full = two_ranks(&schedule, None, [None, None]);
    let stopped = two_ranks(&schedule, None, [Some(30), None]);
    let (step, checkpoint) = stopped[0].checkpoints.last().unwrap();
    assert_eq!(*step, 31);

    let alone = run(resumed(session(SGD, &schedule, None), checkpoint), None);
    assert!(alone.outcome.is_ok(), "{:?}", alone.outcome.err());
    assert_eq!(alone.losses.first().map(|(s, _)| *s), Some(32));
    assert_eq!(alone.checkpoints.last().unwrap().0, LIMITS.max_steps);
    let worst = largest_relative_difference(&alone.weights, &full[0].weights);
    eprintln!("largest relative weight difference, one rank after two vs two throughout: {worst:.2e}");
    assert!(worst < 1e-4, "{worst}");
}

/// The largest difference between two runs' weights, relative to the larger value (or 1).
fn largest_relative_difference(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(a, b)| ((a - b).abs() / a.abs().max(b.abs()).max(1.0)) as f64)
        .fold(0.0, f64::max)
}

/// Three ranks over loopback resuming from `files`.
fn three_ranks(schedule: &LrSchedule, files: &Files) -> Vec<Run> {
    let rings = ring::loopback(3, Uuid::new_v4(), Duration::from_secs(30)).unwrap();
    std::thread::scope(|scope| {
        let handles: Vec<_> = rings
            .into_iter()
            .map(|ring| scope.spawn(move || run(resumed(session(SGD, schedule, Some(RingSync::new(ring))), files), None)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Growing: the global batch stays 32 rows, now split 10/11/11, so three ranks compute the
/// same update two did. Every rank ends with the same weights, and they agree with the
/// uninterrupted two-rank run's to f32 rounding.
#[test]
fn an_elastic_gang_resumes_at_three_ranks_from_its_two_rank_checkpoint() {
    let schedule = LrSchedule::Cosine { lr: 0.1, warmup_steps: 10, min_lr: 0.0 };
    let full = two_ranks(&schedule, None, [None, None]);
    let stopped = two_ranks(&schedule, None, [None, Some(40)]);
    let (step, checkpoint) = stopped[0].checkpoints.last().unwrap();
    assert_eq!(*step, 41);

    let grown = three_ranks(&schedule, checkpoint);
    for (rank, run) in grown.iter().enumerate() {
        assert!(run.outcome.is_ok(), "rank {rank}: {:?}", run.outcome.as_ref().err());
        assert_eq!(run.losses.first().map(|(s, _)| *s), Some(42), "rank {rank}");
        assert_eq!(run.weights, grown[0].weights, "rank {rank} holds rank 0's weights");
    }
    assert_eq!(grown[0].checkpoints.last().unwrap().0, LIMITS.max_steps);
    let worst = largest_relative_difference(&grown[0].weights, &full[0].weights);
    eprintln!("largest relative weight difference, three ranks after two vs two throughout: {worst:.2e}");
    assert!(worst < 1e-4, "{worst}");
    // The losses of the global batch agree step by step.
    for ((s, a), (t, b)) in grown[0].losses.iter().zip(full[0].losses.iter().filter(|(s, _)| *s > 41)) {
        assert_eq!(s, t);
        let (a, b) = (a.unwrap(), b.unwrap());
        assert!((a - b).abs() <= 1e-4 * a.abs().max(1.0), "step {s}: {a} vs {b}");
    }
}
