//! A short training job on a CUDA worker (issue 15): the real server and a `cuda` build of the
//! worker train the digits MLP on CUDA device 0; its loss falls and its checkpoints are
//! written. It runs where `TESSERA_REQUIRE_GPU=1` says a GPU is there (scripts/gpu-run.sh
//! `train`, with `TESSERA_WORKER_BIN` the cuda build's worker); elsewhere it is skipped, as
//! training.rs trains the same kind of job on a CPU worker.

use std::time::Duration;

use serde_json::{json, Value};
use tessera_tests::{digits_csv, start_server, start_worker, User};

const WORKER_TOKEN: &str = "gpu-training-token-at-least-32-bytes-long";

fn mean_loss(steps: &[Value]) -> f64 {
    steps.iter().map(|r| r["loss"].as_f64().unwrap()).sum::<f64>() / steps.len() as f64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_job_trains_on_the_gpu_with_falling_loss_and_checkpoints() {
    if std::env::var_os("TESSERA_REQUIRE_GPU").is_none() {
        eprintln!("skipped: a GPU machine runs this (TESSERA_REQUIRE_GPU=1, TESSERA_WORKER_BIN a cuda build)");
        return;
    }
    let csv = digits_csv().expect("datasets/digits.csv under TESSERA_ASSETS");
    let data = tempfile::tempdir().unwrap();
    let (mut server, url) = start_server(&data.path().join("server"), WORKER_TOKEN, 3);
    let user = User::login(&mut server, &url).await;
    let dataset = user.upload_dataset(csv).await;
    let worker = start_worker(&url, WORKER_TOKEN, &data.path().join("worker"), "gpu-trainer");

    let job = user
        .submit(json!({
            "name": "digits on the GPU", "model": {"kind": "mlp", "hidden": [64]}, "dataset": dataset,
            "task": {"type": "classification", "label_column": "label", "validation_split": 0.2},
            "optimizer": {"type": "sgd", "momentum": 0.9}, "batch_size": 64, "max_steps": 300,
            "eval_every": 100, "checkpoint_every": 100,
            "lr_schedule": {"type": "cosine", "lr": 0.1, "warmup_steps": 30}, "seed": 1
        }))
        .await;
    let finished = user.finished(&job, &[&worker], Duration::from_secs(180)).await;

    let metrics = user.get(&format!("/jobs/{job}/metrics")).await;
    let steps = metrics["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 300, "{metrics}");
    let (first, last) = (mean_loss(&steps[..30]), mean_loss(&steps[270..]));
    println!("loss: mean of steps 1-30 {first:.4}, of steps 271-300 {last:.4}; {}", finished["message"]);
    assert!(last < 0.5 * first, "the loss did not fall: {first} → {last}");
    let accuracy = metrics["evals"].as_array().unwrap().last().unwrap()["accuracy"].as_f64().unwrap();
    assert!(accuracy > 0.85, "validation accuracy {accuracy}");

    let checkpoints = user.get(&format!("/jobs/{job}/checkpoints")).await;
    let saved: Vec<u64> = checkpoints.as_array().unwrap().iter().map(|c| c["step"].as_u64().unwrap()).collect();
    assert_eq!(saved, [100, 200, 300]);
    let names: Vec<&str> =
        checkpoints[2]["files"].as_array().unwrap().iter().map(|f| f["name"].as_str().unwrap()).collect();
    assert!(names.contains(&"model.safetensors"), "{names:?}");
    // Last, so that a CPU worker shows every other check passing before this one fails.
    let lines = user.log_lines(&job).await;
    assert!(lines.iter().any(|l| l.contains("training on CUDA device 0")), "{lines:#?}");
}
