//! The platform on a GPU machine (issue 15, step 4): the real server and a `cuda` build of
//! the worker
//! - train the digits MLP on CUDA device 0: its loss falls and its checkpoints are written;
//! - serve all-MiniLM-L6-v2 from one replica, an engine process bound to a slice of the GPU
//!   as it is partitioned (a MIG instance, or the whole GPU where MIG is off; the test never
//!   changes it), whose embeddings match the CPU engine's.
//!
//! They run where `TESSERA_REQUIRE_GPU=1` says a GPU is there (scripts/gpu-run.sh
//! `platform`, with `TESSERA_WORKER_BIN` the cuda build's worker); elsewhere they are
//! skipped, as training.rs, e2e.rs and mig.rs do the same on CPU workers. Each test keeps its
//! GPU-only checks last, so a CPU worker shows every other check passing.

use std::path::Path;
use std::time::{Duration, Instant};

use candle_core::DType;
use serde_json::{json, Value};
use tessera_tests::{digits_csv, eventually, minilm_dir, start_server, start_worker, User, MINILM_FILES};
use tessera_worker::engine::{EmbeddingModel, LoadOptions};

const WORKER_TOKEN: &str = "gpu-platform-token-at-least-32-bytes-long";

/// False (and the test skipped, saying so) unless this is the GPU machine.
fn on_a_gpu_machine() -> bool {
    let required = std::env::var_os("TESSERA_REQUIRE_GPU").is_some();
    if !required {
        eprintln!("skipped: a GPU machine runs this (TESSERA_REQUIRE_GPU=1, TESSERA_WORKER_BIN a cuda build)");
    }
    required
}

fn mean_loss(steps: &[Value]) -> f64 {
    steps.iter().map(|r| r["loss"].as_f64().unwrap()).sum::<f64>() / steps.len() as f64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_job_trains_on_the_gpu_with_falling_loss_and_checkpoints() {
    if !on_a_gpu_machine() {
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

const SENTENCES: [&str; 4] = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is playing a guitar.",
];

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let norm = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (norm(a) * norm(b))
}

/// The embeddings of `input` from `deployment` through the OpenAI route.
async fn embed(user: &User, deployment: &str, input: &[&str]) -> Vec<Vec<f32>> {
    let response = user
        .http
        .post(format!("{}/v1/embeddings", user.url))
        .bearer_auth(&user.token)
        .json(&json!({"model": deployment, "input": input}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    let data = body["data"].as_array().unwrap();
    data.iter()
        .map(|d| d["embedding"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect())
        .collect()
}

/// `clients` callers, each sending one sentence a request, `each` requests in turn: the
/// requests per second and the median and p99 latency in ms, for the record (not a goal).
async fn burst(user: &User, deployment: &str, clients: usize, each: usize) -> (f64, f64, f64) {
    let started = Instant::now();
    let mut callers = tokio::task::JoinSet::new();
    for client in 0..clients {
        let user = User { http: user.http.clone(), url: user.url.clone(), token: user.token.clone() };
        let deployment = deployment.to_string();
        callers.spawn(async move {
            let mut latencies = Vec::with_capacity(each);
            for i in 0..each {
                let at = Instant::now();
                embed(&user, &deployment, &[SENTENCES[(client + i) % SENTENCES.len()]]).await;
                latencies.push(at.elapsed().as_secs_f64() * 1e3);
            }
            latencies
        });
    }
    let mut latencies: Vec<f64> = callers.join_all().await.into_iter().flatten().collect();
    let rate = latencies.len() as f64 / started.elapsed().as_secs_f64();
    latencies.sort_by(f64::total_cmp);
    let at = |q: f64| latencies[((latencies.len() as f64 * q).ceil() as usize).clamp(1, latencies.len()) - 1];
    (rate, at(0.5), at(0.99))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_serves_from_an_engine_process_on_a_slice_of_the_gpu() {
    if !on_a_gpu_machine() {
        return;
    }
    let model_dir = minilm_dir().expect("all-MiniLM-L6-v2 under TESSERA_ASSETS");
    let data = tempfile::tempdir().unwrap();
    let (mut server, url) = start_server(&data.path().join("server"), WORKER_TOKEN, 10);
    let user = User::login(&mut server, &url).await;
    // The GPU bundle carries the files MiniLM has (its weights stored as f16).
    let files: Vec<&str> = MINILM_FILES.iter().copied().filter(|f| model_dir.join(f).exists()).collect();
    user.upload_model(&model_dir, &files, "minilm").await;
    let worker = start_worker(&url, WORKER_TOKEN, &data.path().join("worker"), "gpu-server");

    let response = user
        .http
        .post(user.api("/deployments"))
        .bearer_auth(&user.token)
        .json(&json!({"name": "minilm-gpu", "model": "minilm", "replicas": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    let ready = eventually("the deployment is ready", Duration::from_secs(180), || async {
        let d = user.get("/deployments/minilm-gpu").await;
        assert_ne!(d["state"], "failed", "{d}\n{}", worker.output());
        (d["state"] == "ready").then_some(d)
    })
    .await;

    // The served embeddings are MiniLM's: the CPU engine's on the same weights, in f32.
    let served = embed(&user, "minilm-gpu", &SENTENCES).await;
    let reference = reference_embeddings(&model_dir);
    let lowest = served.iter().zip(&reference).map(|(a, b)| cosine(a, b)).fold(1.0, f64::min);
    println!("served vs the CPU engine in f32: lowest cosine {lowest:.6}");
    assert!(served.iter().all(|e| e.len() == 384), "MiniLM's 384 dimensions");
    assert!(lowest >= 0.999, "served embeddings differ from the CPU engine's: cosine {lowest}");
    assert!(cosine(&served[0], &served[1]) > cosine(&served[0], &served[2]));

    let (rate, p50, p99) = burst(&user, "minilm-gpu", 8, 32).await;
    println!("one replica, one sentence a request, 8 in flight: {rate:.0} req/s, p50 {p50:.2} ms, p99 {p99:.2} ms");

    // Last, what only a GPU machine shows: the replica is bound to a slice the worker offers,
    // and a GPU engine process of its own serves it in f16.
    let workers = user.get("/workers").await;
    let offered = workers[0]["slices"].as_array().cloned().unwrap_or_default();
    let replica = &ready["replica_status"][0];
    println!("the worker offers {}; the replica: {replica}", Value::Array(offered.clone()));
    assert!(offered.iter().any(|s| s["uuid"] == replica["slice"]), "bound to an offered slice: {replica}");
    assert!(replica["message"].as_str().unwrap().contains("(engine process "), "{replica}");
    let lines = user.log_lines(replica["id"].as_str().unwrap()).await;
    assert!(lines.iter().any(|l| l.contains("a GPU engine process serves it")), "{lines:#?}");
    assert!(lines.iter().any(|l| l.ends_with("GEMMs in f16")), "{lines:#?}");
}

fn reference_embeddings(model_dir: &Path) -> Vec<Vec<f32>> {
    let options = LoadOptions { dtype: Some(DType::F32), ..LoadOptions::default() };
    let model = EmbeddingModel::load_with(model_dir, &options).unwrap();
    model.embed(&SENTENCES).unwrap()
}
