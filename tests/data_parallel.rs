//! End to end, data-parallel training (issue 12): the real server runs a two-rank job on
//! two real worker processes, which meet through the server's rendezvous and all-reduce
//! over TCP; and when one rank's worker is killed, the gang is requeued and resumes from
//! rank 0's last checkpoint with one continuous metrics series. With `precision` the ranks
//! plan per-operator precision (QSync) and the plan is served by the job. Each test runs
//! on SQLite, then on PostgreSQL where `TESSERA_TEST_POSTGRES_URL` is set (`databases()`).

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};
use tessera_tests::{binary, databases, digits_csv, eventually, start_server_with, start_worker, Process, User};

const WORKER_TOKEN: &str = "e2e-data-parallel-token-at-least-32-bytes";

/// A server over SQLite in `dir`, or over `database`, with 3 s leases (a killed rank's lease
/// runs out quickly).
fn server(dir: &Path, database: Option<&str>) -> (Process, String) {
    let mut settings = vec![("TESSERA_WORKER_TOKEN", WORKER_TOKEN), ("TESSERA_LEASE_TTL_SECS", "3")];
    settings.extend(database.map(|url| ("TESSERA_DATABASE_URL", url)));
    start_server_with(dir, &settings)
}

fn two_rank_job(dataset: &str, max_steps: u64) -> Value {
    json!({
        "name": "digits-dp", "model": {"kind": "mlp", "hidden": [64]}, "dataset": dataset,
        "task": {"type": "classification", "label_column": "label", "validation_split": 0.2},
        "optimizer": {"type": "sgd", "momentum": 0.9}, "batch_size": 64, "max_steps": max_steps,
        "eval_every": 50, "checkpoint_every": 100, "lr_schedule": {"type": "constant", "lr": 0.05}, "seed": 1,
        "parallel": {"ranks": [{"device": "cpu", "threads": 1}, {"device": "cpu"}]}
    })
}

/// Steps 1..=max_steps once each with a finite loss, and both ranks' timings of each step
/// after `timed_from` (a killed rank's last unsent timings before it are lost with it).
fn assert_one_series_with_rank_timings(metrics: &Value, max_steps: u64, timed_from: u64) {
    let steps = metrics["steps"].as_array().unwrap();
    let numbers: Vec<u64> = steps.iter().map(|r| r["step"].as_u64().unwrap()).collect();
    assert_eq!(numbers, (1..=max_steps).collect::<Vec<_>>());
    assert!(steps.iter().all(|r| r["loss"].as_f64().is_some_and(f64::is_finite)), "{metrics}");
    let ranks = metrics["ranks"].as_array().unwrap();
    for rank in 0..2 {
        let timed: Vec<u64> = ranks
            .iter()
            .filter(|r| r["rank"] == rank)
            .map(|r| r["step"].as_u64().unwrap())
            .filter(|&s| s > timed_from)
            .collect();
        assert_eq!(timed, (timed_from + 1..=max_steps).collect::<Vec<_>>(), "rank {rank} timed every step");
    }
    for row in ranks {
        let (iter, wait, reduce) =
            (row["iter_ms"].as_f64().unwrap(), row["wait_ms"].as_f64().unwrap(), row["allreduce_ms"].as_f64().unwrap());
        assert!(iter > 0.0 && wait >= 0.0 && reduce > 0.0 && wait + reduce <= iter, "{row}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_two_rank_job_trains_on_two_workers() {
    let Some(csv) = digits_csv() else { return };
    for database in databases() {
        eprintln!("on {}", if database.is_some() { "PostgreSQL" } else { "SQLite" });
        a_two_rank_job_trains_on_two_workers_on(csv.clone(), database.as_deref()).await;
    }
}

async fn a_two_rank_job_trains_on_two_workers_on(csv: Vec<u8>, database: Option<&str>) {
    let data = tempfile::tempdir().unwrap();
    let (mut server, url) = server(&data.path().join("server"), database);
    let user = User::login(&mut server, &url).await;
    let dataset = user.upload_dataset(csv).await;
    let first = start_worker(&url, WORKER_TOKEN, &data.path().join("worker-1"), "rank-host-1");
    let second = start_worker(&url, WORKER_TOKEN, &data.path().join("worker-2"), "rank-host-2");

    let job = user.submit(two_rank_job(&dataset, 300)).await;
    let finished = user.finished(&job, &[&first, &second], Duration::from_secs(240)).await;
    assert_eq!(finished["attempts"], 1, "{finished}");
    assert!(finished["message"].as_str().unwrap().contains("accuracy"), "{finished}");

    let metrics = user.get(&format!("/jobs/{job}/metrics")).await;
    assert_one_series_with_rank_timings(&metrics, 300, 0);
    let accuracy = metrics["evals"].as_array().unwrap().last().unwrap()["accuracy"].as_f64().unwrap();
    assert!(accuracy > 0.9, "final validation accuracy {accuracy}");
    let checkpoints = user.get(&format!("/jobs/{job}/checkpoints")).await;
    let steps: Vec<u64> = checkpoints.as_array().unwrap().iter().map(|c| c["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [100, 200, 300], "rank 0 checkpoints");
    // Each worker ran one rank.
    let lines = user.log_lines(&job).await;
    for rank in 0..2 {
        let joined = format!("rank {rank}: rank {rank} of 2 joined attempt 1");
        assert!(lines.iter().any(|l| l.starts_with(&joined)), "{joined:?} in {lines:?}");
    }
    let jobs = user.get("/jobs").await;
    assert_eq!(jobs.as_array().unwrap().len(), 1, "the ranks are not listed as jobs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_rank_s_gang_resumes_from_the_last_checkpoint() {
    let Some(csv) = digits_csv() else { return };
    for database in databases() {
        eprintln!("on {}", if database.is_some() { "PostgreSQL" } else { "SQLite" });
        a_killed_rank_s_gang_resumes_from_the_last_checkpoint_on(csv.clone(), database.as_deref()).await;
    }
}

async fn a_killed_rank_s_gang_resumes_from_the_last_checkpoint_on(csv: Vec<u8>, database: Option<&str>) {
    let data = tempfile::tempdir().unwrap();
    let (mut server, url) = server(&data.path().join("server"), database);
    let user = User::login(&mut server, &url).await;
    let dataset = user.upload_dataset(csv).await;
    let mut first = start_worker(&url, WORKER_TOKEN, &data.path().join("worker-1"), "rank-host-1");
    let second = start_worker(&url, WORKER_TOKEN, &data.path().join("worker-2"), "rank-host-2");

    let max_steps = 3000;
    let job = user.submit(two_rank_job(&dataset, max_steps)).await;
    let first_checkpoint = tokio::time::timeout(
        Duration::from_secs(120),
        eventually("a checkpoint is uploaded", Duration::from_secs(3600), || async {
            let list = user.get(&format!("/jobs/{job}/checkpoints")).await;
            list.as_array().unwrap().last().map(|c| c["step"].as_u64().unwrap())
        }),
    )
    .await;
    let Ok(checkpoint) = first_checkpoint else {
        let job = user.get(&format!("/jobs/{job}")).await;
        let logs = [&server, &first, &second].map(|p| p.output()).join("\n----\n");
        panic!("no checkpoint in 120 s: {job}\n{logs}");
    };
    first.kill();
    assert!(checkpoint < max_steps, "the job must still be running when a rank dies");

    let third = start_worker(&url, WORKER_TOKEN, &data.path().join("worker-3"), "rank-host-3");
    let finished = user.finished(&job, &[&second, &third], Duration::from_secs(300)).await;
    assert_eq!(finished["attempts"], 2, "{finished}");
    let lines = user.log_lines(&job).await;
    assert!(lines.iter().any(|l| l.contains("the gang lost a rank")), "the surviving rank saw its peer go: {lines:?}");
    let resumed: Vec<u64> = lines
        .iter()
        .filter_map(|l| l.split("resuming from the checkpoint at step ").nth(1).map(|s| s.parse().unwrap()))
        .collect();
    assert_eq!(resumed.len(), 2, "both ranks of the second attempt resumed: {lines:?}");
    assert!(resumed[0] == resumed[1] && resumed[0] >= checkpoint && resumed[0] < max_steps, "{resumed:?}");
    assert_one_series_with_rank_timings(&user.get(&format!("/jobs/{job}/metrics")).await, max_steps, resumed[0]);
}

/// Whether the cost table of `device` in `plan` shows an operator whose forward and
/// backward at some lower precision take under 90% of its f32 time.
fn lowering_pays(plan: &Value, device: &str) -> bool {
    let table = plan["cost_tables"].as_array().unwrap().iter().find(|t| t["device"] == device).unwrap();
    table["ops"].as_array().unwrap().iter().any(|op| {
        let total = |t: &Value| t["forward_ms"].as_f64().unwrap() + t["backward_ms"].as_f64().unwrap();
        let timings = op["timings"].as_array().unwrap();
        let f32_ms = timings.iter().find(|t| t["precision"] == "f32").map(total).unwrap();
        timings.iter().filter(|t| t["precision"] != "f32").any(|t| total(t) < 0.9 * f32_ms)
    })
}

/// A two-rank QSync job with one worker slowed 3× (the worker's test-only `--test-slowdown`:
/// one host cannot hold unequal devices). The slowed rank lowers operators where its profile
/// says that pays, the other stays f32, and the plan, its measured step and the per-step
/// predictions are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qsync_job_serves_its_precision_plan() {
    let Some(csv) = digits_csv() else { return };
    for database in databases() {
        eprintln!("on {}", if database.is_some() { "PostgreSQL" } else { "SQLite" });
        a_qsync_job_serves_its_precision_plan_on(csv.clone(), database.as_deref()).await;
    }
}

async fn a_qsync_job_serves_its_precision_plan_on(csv: Vec<u8>, database: Option<&str>) {
    let data = tempfile::tempdir().unwrap();
    let (mut server, url) = server(&data.path().join("server"), database);
    let user = User::login(&mut server, &url).await;
    let dataset = user.upload_dataset(csv).await;
    let fast = start_worker(&url, WORKER_TOKEN, &data.path().join("worker-1"), "rank-host-1");
    let slow = Process::spawn(
        Command::new(binary("tessera-worker"))
            .args(["--server", &url, "--name", "rank-host-slow", "--data-dir"])
            .arg(data.path().join("worker-2"))
            .env("TESSERA_WORKER_TOKEN", WORKER_TOKEN)
            .env("TESSERA_TEST_SLOWDOWN", "3"),
    );

    let max_steps = 40;
    // The default, stated: with 3 profiled steps (each rank then reads the fastest) a fast
    // rank whose every profiled step a parallel test load disturbed once looked slower than
    // the slowed rank (overhead 23 ms against 0.5) and was planned itself; with 8 each reads
    // the median of the warm ones (`train::hybrid::step_reading`).
    let profile_steps = 8;
    let mut spec = two_rank_job(&dataset, max_steps);
    // Layers wide enough that this CPU's bf16 and int8 GEMMs beat f32.
    spec["model"] = json!({"kind": "mlp", "hidden": [512, 512]});
    spec["batch_size"] = json!(256);
    spec["parallel"] = json!({
        "ranks": [{"device": "cpu", "threads": 1}, {"device": "cpu", "threads": 1}],
        "precision": {"policy": "qsync", "profile_steps": profile_steps}
    });
    let job = user.submit(spec).await;
    user.finished(&job, &[&fast, &slow, &server], Duration::from_secs(300)).await;

    let plan = user.get(&format!("/jobs/{job}/precision-plan")).await;
    assert_eq!(plan["indicator"]["kind"], "gradient_variance", "{plan}");
    let ranks = plan["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 2, "{plan}");
    let slowed = |r: &Value| r["device"].as_str().unwrap().contains("test slowdown 3");
    let (slow_rank, fast_rank) = match (slowed(&ranks[0]), slowed(&ranks[1])) {
        (false, true) => (&ranks[1], &ranks[0]),
        (true, false) => (&ranks[0], &ranks[1]),
        _ => panic!("one rank runs on the slowed worker: {plan}"),
    };
    let precisions = |r: &Value| -> Vec<String> {
        r["ops"].as_array().unwrap().iter().map(|op| op["precision"].as_str().unwrap().to_string()).collect()
    };
    assert_eq!(precisions(fast_rank), ["f32", "f32", "f32"], "{plan}");
    let lowered = precisions(slow_rank);
    // The slowed rank lowers an operator whenever its own profile shows a lower precision
    // clearly faster than f32. Whether one is depends on the host: in this debug build
    // under a parallel test load the bf16 and int8 backwards were once slower than f32's,
    // and then f32 throughout is the fastest plan.
    if lowering_pays(&plan, slow_rank["device"].as_str().unwrap()) {
        assert!(lowered[..2].iter().any(|p| p != "f32"), "the slowed rank lowered nothing: {plan}");
    } else {
        eprintln!("no lower precision was faster on the slowed rank; its plan: {lowered:?}");
    }
    assert_eq!(lowered[2], "f32", "the head stays f32");
    for table in plan["cost_tables"].as_array().unwrap() {
        let ops: Vec<&str> = table["ops"].as_array().unwrap().iter().map(|op| op["op"].as_str().unwrap()).collect();
        assert_eq!(ops, ["layers.0", "layers.1", "layers.2"], "{plan}");
    }
    assert_eq!(plan["cast_models"].as_array().unwrap().len(), 2);
    let predicted = plan["predicted_step_ms"].as_f64().unwrap();
    assert!(predicted > 0.0 && plan["budget_ms"].as_f64().unwrap() > 0.0, "{plan}");
    assert!(plan["measured_step_ms"].as_f64().is_some_and(|m| m > 0.0), "the end's report has the measured step: {plan}");

    // Each rank's steps after the profiled ones carry the plan's prediction.
    let metrics = user.get(&format!("/jobs/{job}/metrics")).await;
    for row in metrics["ranks"].as_array().unwrap() {
        let step = row["step"].as_u64().unwrap();
        match row["predicted_ms"].as_f64() {
            Some(ms) => assert!(step > profile_steps && (ms - predicted).abs() <= 1e-6 * predicted, "{row}"),
            None => assert!(step <= profile_steps, "step {step} has no prediction: {row}"),
        }
    }
    // The job's log states the plan as served: the slowed rank with its count of lowered operators.
    let said = format!(
        "rank {} ({}) {} of 3 operators below f32",
        slow_rank["rank"],
        slow_rank["device"].as_str().unwrap(),
        lowered.iter().filter(|p| *p != "f32").count()
    );
    let lines = user.log_lines(&job).await;
    assert!(lines.iter().any(|l| l.contains("precision plan: ") && l.contains(&said)), "no line says {said:?}: {lines:?}");
}
