//! End to end, training: the real server and worker binaries train the built-in MLP on
//! scikit-learn's digits, stream metrics and checkpoints, a job whose worker is killed
//! mid-run resumes on the next worker from its last checkpoint with one continuous
//! metrics series, and one whose server is killed and started again runs on untouched.

use std::time::Duration;

use serde_json::{json, Value};
use tessera_tests::{digits_csv, eventually, start_server, start_server_with, start_worker, User};

const WORKER_TOKEN: &str = "e2e-training-token-at-least-32-bytes-long";

/// The example job, shorter.
fn example(dataset: &str, max_steps: u64, lr_schedule: Value) -> Value {
    json!({
        "name": "digits", "model": {"kind": "mlp", "hidden": [64]}, "dataset": dataset,
        "task": {"type": "classification", "label_column": "label", "validation_split": 0.2},
        "optimizer": {"type": "sgd", "momentum": 0.9}, "batch_size": 64, "max_steps": max_steps,
        "eval_every": 50, "checkpoint_every": 100, "lr_schedule": lr_schedule, "seed": 1
    })
}

/// Every step from 1 to `max_steps` exactly once, each with loss, lr (cosine ends at 0) and throughput.
fn assert_one_continuous_series(metrics: &Value, max_steps: u64) {
    let steps = metrics["steps"].as_array().unwrap();
    let numbers: Vec<u64> = steps.iter().map(|r| r["step"].as_u64().unwrap()).collect();
    assert_eq!(numbers, (1..=max_steps).collect::<Vec<_>>());
    for row in steps {
        let complete = row["loss"].as_f64().is_some_and(f64::is_finite)
            && row["lr"].as_f64().is_some_and(|lr| lr >= 0.0)
            && row["throughput"].as_f64().is_some_and(|t| t > 0.0);
        assert!(complete, "a step without a finite loss, an lr or a throughput: {row}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn autolrs_job_trains_digits_with_metrics_stages_and_checkpoints() {
    let Some(csv) = digits_csv() else { return };
    let data = tempfile::tempdir().unwrap();
    let (mut server, url) = start_server(&data.path().join("server"), WORKER_TOKEN, 3);
    let user = User::login(&mut server, &url).await;
    let dataset = user.upload_dataset(csv).await;
    let worker = start_worker(&url, WORKER_TOKEN, &data.path().join("worker"), "trainer-1");

    // τ' = 20, k = 10: a 400-step first stage (200 search + 200 exploitation).
    let schedule = json!({"type": "autolrs", "min_lr": 1e-4, "max_lr": 1, "tau_prime": 20, "tau": 200});
    let job = user.submit(example(&dataset, 500, schedule)).await;
    let finished = user.finished(&job, &[&worker], Duration::from_secs(240)).await;
    assert_eq!(finished["attempts"], 1);
    assert!(finished["message"].as_str().unwrap().contains("accuracy"), "{finished}");

    let metrics = user.get(&format!("/jobs/{job}/metrics")).await;
    assert_one_continuous_series(&metrics, 500);
    let evals = metrics["evals"].as_array().unwrap();
    assert!(evals.iter().any(|e| e["step"] == 500));
    let accuracy = evals.iter().find(|e| e["step"] == 500).unwrap()["accuracy"].as_f64().unwrap();
    assert!(accuracy > 0.9, "final validation accuracy {accuracy}");

    let stages = user.get(&format!("/jobs/{job}/lr-stages")).await;
    let first = &stages[0];
    assert_eq!(first["candidates"].as_array().unwrap().len(), 10);
    // Over [1e-4, 1] an exploitation may diverge: the stage then restores its snapshot and
    // exploits the next-best candidate from that step on (every step counts), so the chosen
    // LR is the one in use from the last fallback, and a stage cut short by the job's end
    // has no loss observed after τ.
    let fallbacks = first["fallbacks"].as_array().unwrap();
    let exploited_from = fallbacks.last().map_or(200, |f| f["at_step"].as_u64().unwrap() as usize);
    if fallbacks.is_empty() {
        assert!(first["observed_loss_after_tau"].as_f64().is_some(), "{stages}");
    }
    let chosen = first["chosen_lr"].as_f64().unwrap();
    let steps = metrics["steps"].as_array().unwrap();
    assert!(steps[..200].iter().all(|r| r["phase"] == "search"), "{metrics}");
    assert!(steps[200..400].iter().all(|r| r["phase"] == "exploit"), "{metrics}");
    assert!(steps[exploited_from..400].iter().all(|r| r["lr"].as_f64().unwrap() == chosen), "{stages}");

    let checkpoints = user.get(&format!("/jobs/{job}/checkpoints")).await;
    let steps: Vec<u64> = checkpoints.as_array().unwrap().iter().map(|c| c["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [100, 200, 300, 400, 500]);
    let names: Vec<&str> =
        checkpoints[4]["files"].as_array().unwrap().iter().map(|f| f["name"].as_str().unwrap()).collect();
    assert!(names.contains(&"model.safetensors") && names.contains(&"state.json"), "{names:?}");
    let state = user
        .http
        .get(format!("{url}/api/v1/jobs/{job}/checkpoints/500/files/state.json"))
        .bearer_auth(&user.token)
        .send()
        .await
        .unwrap();
    let state: Value = state.json().await.unwrap();
    assert_eq!(state["step"], 500);
    assert!(state["lr_policy"]["tuner"].is_object(), "the tuner's state is checkpointed: {state}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_s_job_resumes_from_its_checkpoint_on_another_worker() {
    let Some(csv) = digits_csv() else { return };
    let data = tempfile::tempdir().unwrap();
    let (mut server, url) = start_server(&data.path().join("server"), WORKER_TOKEN, 3);
    let user = User::login(&mut server, &url).await;
    let dataset = user.upload_dataset(csv).await;
    let mut first = start_worker(&url, WORKER_TOKEN, &data.path().join("worker-1"), "trainer-1");

    let max_steps = 3000;
    let job =
        user.submit(example(&dataset, max_steps, json!({"type": "cosine", "lr": 0.1, "warmup_steps": 100}))).await;
    let checkpoint = eventually("a checkpoint is uploaded", Duration::from_secs(120), || async {
        let list = user.get(&format!("/jobs/{job}/checkpoints")).await;
        list.as_array().unwrap().last().map(|c| c["step"].as_u64().unwrap())
    })
    .await;
    first.kill();
    assert!(checkpoint < max_steps, "the job must still be running when its worker dies");
    let reported_before = user.get(&format!("/jobs/{job}/metrics")).await["steps"].as_array().unwrap().len() as u64;

    let second = start_worker(&url, WORKER_TOKEN, &data.path().join("worker-2"), "trainer-2");
    let finished = user.finished(&job, &[&second], Duration::from_secs(240)).await;
    assert_eq!(finished["attempts"], 2, "{finished}");
    let logs = user.get(&format!("/jobs/{job}/logs")).await;
    let resumed_from: u64 = logs
        .as_array()
        .unwrap()
        .iter()
        .find_map(|l| {
            l["line"]
                .as_str()
                .unwrap()
                .strip_prefix("resuming from the checkpoint at step ")
                .map(|s| s.parse().unwrap())
        })
        .expect("the second worker logs where it resumed");
    assert!(
        resumed_from >= checkpoint && resumed_from < max_steps,
        "resumed at {resumed_from}, first checkpoint seen {checkpoint}"
    );
    assert!(reported_before >= resumed_from, "at most the steps since the checkpoint are redone");
    assert_one_continuous_series(&user.get(&format!("/jobs/{job}/metrics")).await, max_steps);
}

/// The server killed (as a crash would) and started again on its address and data: the
/// worker keeps its running job through the outage (its calls are sent again, its
/// heartbeat tries again) and the job finishes on its first attempt, every step reported once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_restart_leaves_a_running_job_running() {
    let Some(csv) = digits_csv() else { return };
    let data = tempfile::tempdir().unwrap();
    let server_dir = data.path().join("server");
    let lease = "10";
    let env = [("TESSERA_WORKER_TOKEN", WORKER_TOKEN), ("TESSERA_LEASE_TTL_SECS", lease)];
    let (mut server, url) = start_server_with(&server_dir, &env);
    let user = User::login(&mut server, &url).await;
    let dataset = user.upload_dataset(csv).await;
    let worker = start_worker(&url, WORKER_TOKEN, &data.path().join("worker"), "trainer-1");

    let max_steps = 3000;
    let job =
        user.submit(example(&dataset, max_steps, json!({"type": "cosine", "lr": 0.1, "warmup_steps": 100}))).await;
    let step = eventually("the job reports steps", Duration::from_secs(120), || async {
        let step = user.get(&format!("/jobs/{job}")).await["progress"]["step"].as_u64().unwrap_or(0);
        (step >= 50).then_some(step)
    })
    .await;
    server.kill();
    assert!(step < max_steps, "the job must still be running when its server dies");
    // Long enough for heartbeats and the job's metric batches to find no server.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let address = url.trim_start_matches("http://");
    let (_server, again) = start_server_with(&server_dir, &[env[0], env[1], ("TESSERA_BIND", address)]);
    assert_eq!(again, url);

    let finished = user.finished(&job, &[&worker], Duration::from_secs(240)).await;
    assert_eq!(finished["attempts"], 1, "{finished}\n{}", worker.output());
    assert_one_continuous_series(&user.get(&format!("/jobs/{job}/metrics")).await, max_steps);
    assert!(worker.output().contains("the server did not answer"), "the worker saw no outage: {}", worker.output());
}
