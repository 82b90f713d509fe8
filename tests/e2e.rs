//! End to end: the real server and worker binaries on loopback ports, driven over HTTP
//! as a user and an operator would.

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use candle_core::{Device, Tensor};
use serde_json::{json, Value};
use tessera_tests::{binary, eventually, minilm_dir, Process, MINILM_FILES};
use tessera_worker::engine::synthetic::RandomBert;
use tessera_worker::engine::EmbeddingModel;

const WORKER_TOKEN: &str = "e2e-worker-token-at-least-32-bytes-long";

struct Server {
    process: Process,
    url: String,
}

fn start_server(data_dir: &Path) -> Server {
    let (process, url) = tessera_tests::start_server(data_dir, WORKER_TOKEN, 5);
    Server { process, url }
}

fn start_worker(server: &str, data_dir: &Path) -> Process {
    Process::spawn(
        Command::new(binary("tessera-worker"))
            .args(["--server", server, "--name", "e2e-worker", "--data-dir"])
            .arg(data_dir)
            .env("TESSERA_WORKER_TOKEN", WORKER_TOKEN),
    )
}

/// Uploads `files` of the folder `dir` as the model `name`; returns the registered model.
async fn upload_model(http: &reqwest::Client, url: &str, token: &str, dir: &Path, files: &[&str], name: &str) -> Value {
    let mut form = reqwest::multipart::Form::new().text("name", name.to_string());
    for path in files {
        let bytes = std::fs::read(dir.join(path)).unwrap();
        form = form.part("files", reqwest::multipart::Part::bytes(bytes).file_name(path.to_string()));
    }
    let response = http.post(format!("{url}/api/v1/models")).bearer_auth(token).multipart(form).send().await.unwrap();
    assert_eq!(response.status(), 201);
    response.json().await.unwrap()
}

/// Uploads the real MiniLM folder as `name`; returns the model's id.
async fn upload_minilm(http: &reqwest::Client, url: &str, token: &str, dir: &Path, name: &str) -> String {
    let model = upload_model(http, url, token, dir, MINILM_FILES, name).await;
    assert_eq!(model["architecture"], "BertModel");
    model["id"].as_str().unwrap().to_string()
}

async fn login(http: &reqwest::Client, url: &str, username: &str, password: &str) -> String {
    let response = http.post(format!("{url}/api/v1/auth/login")).json(&json!({"username": username, "password": password})).send().await.unwrap();
    assert_eq!(response.status(), 200, "login as {username}");
    response.json::<Value>().await.unwrap()["token"].as_str().unwrap().to_string()
}

async fn get_json(http: &reqwest::Client, url: &str, token: &str) -> Value {
    let response = http.get(url).bearer_auth(token).send().await.unwrap();
    assert!(response.status().is_success(), "GET {url}: {}", response.status());
    response.json().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_and_worker_binaries_serve_a_real_model_end_to_end() {
    let Some(model_dir) = minilm_dir() else { return };
    let data = tempfile::tempdir().unwrap();
    let server_dir = data.path().join("server");
    let worker_dir = data.path().join("worker");
    let http = reqwest::Client::new();

    let mut server = start_server(&server_dir);
    let url = server.url.clone();
    // First start: the generated admin password is printed once.
    let line = server.process.wait_for_line("with password: ", Duration::from_secs(5));
    let admin_password = line.rsplit(' ').next().unwrap().to_string();
    assert_eq!(http.get(format!("{url}/healthz")).send().await.unwrap().status(), 200);
    let admin = login(&http, &url, "admin", &admin_password).await;

    // A user of their own, who owns the model and job below.
    let user_password = "e2e-user-password-7f3a";
    let response = http.post(format!("{url}/api/v1/users")).bearer_auth(&admin)
        .json(&json!({"username": "erin", "password": user_password, "role": "user"})).send().await.unwrap();
    assert_eq!(response.status(), 201);
    let erin = login(&http, &url, "erin", user_password).await;

    // Upload the real MiniLM model over multipart.
    let model_id = upload_minilm(&http, &url, &erin, &model_dir, "all-MiniLM-L6-v2").await;

    // A worker joins and is seen online with its devices.
    let mut worker = start_worker(&url, &worker_dir);
    let workers = eventually("the worker is online", Duration::from_secs(30), || async {
        let list = get_json(&http, &format!("{url}/api/v1/workers"), &erin).await;
        let online = list.as_array().unwrap().iter().any(|w| w["name"] == "e2e-worker" && w["status"] == "online");
        online.then_some(list)
    })
    .await;
    assert!(workers[0]["inventory"]["cpu_cores"].as_u64().unwrap() >= 1);
    assert!(workers[0]["inventory"]["memory_bytes"].as_u64().unwrap() > 0);

    // A prefetch job runs on the worker: it downloads and verifies the model.
    let response = http.post(format!("{url}/api/v1/jobs")).bearer_auth(&erin)
        .json(&json!({"name": "warm cache", "spec": {"kind": "prefetch", "model": "all-MiniLM-L6-v2"}})).send().await.unwrap();
    assert_eq!(response.status(), 201);
    let job_id = response.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_string();
    let job = eventually("the prefetch job ends", Duration::from_secs(60), || async {
        let job = get_json(&http, &format!("{url}/api/v1/jobs/{job_id}"), &erin).await;
        (job["state"] == "succeeded" || job["state"] == "failed").then_some(job)
    })
    .await;
    assert_eq!(job["state"], "succeeded", "{job}\n{}", worker.output());
    assert_eq!(job["attempts"], 1);
    let logs = get_json(&http, &format!("{url}/api/v1/jobs/{job_id}/logs"), &erin).await;
    assert!(logs.as_array().unwrap().iter().any(|l| l["line"].as_str().unwrap().contains("model.safetensors: downloaded")), "{logs}");
    let metrics = get_json(&http, &format!("{url}/api/v1/jobs/{job_id}/metrics"), &erin).await;
    assert!(metrics["steps"].as_array().unwrap().iter().any(|row| row["download_mb_per_s"].as_f64().is_some()), "{metrics}");
    let cached = worker_dir.join("models").join(&model_id).join("model.safetensors");
    assert_eq!(std::fs::read(&cached).unwrap(), std::fs::read(model_dir.join("model.safetensors")).unwrap());

    // Prometheus (here with an admin's token) sees the traffic and the worker.
    let metrics = http.get(format!("{url}/metrics")).bearer_auth(&admin).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("http_requests_total{method=\"POST\",route=\"/api/v1/models\",status=\"201\"}"), "{metrics}");
    assert!(metrics.contains("tessera_workers_online 1"));

    // A worker that dies is shown offline.
    worker.kill();
    eventually("the dead worker is shown offline", Duration::from_secs(30), || async {
        let list = get_json(&http, &format!("{url}/api/v1/workers"), &erin).await;
        (list[0]["status"] == "offline").then_some(())
    })
    .await;

    // Work queued while no worker runs survives a server crash and restart.
    let response = http.post(format!("{url}/api/v1/jobs")).bearer_auth(&erin)
        .json(&json!({"name": "queued across restart", "spec": {"kind": "prefetch", "model": model_id}})).send().await.unwrap();
    assert_eq!(response.status(), 201);
    let queued_id = response.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_string();
    let first_output = server.process.output();
    server.process.kill();
    let mut server = start_server(&server_dir);
    let url = server.url.clone();
    let erin = login(&http, &url, "erin", user_password).await;
    let models = get_json(&http, &format!("{url}/api/v1/models"), &erin).await;
    assert_eq!(models[0]["id"], model_id.as_str());
    let queued = get_json(&http, &format!("{url}/api/v1/jobs/{queued_id}"), &erin).await;
    assert_eq!(queued["state"], "queued");

    // The restarted worker picks the queued job up.
    let worker = start_worker(&url, &worker_dir);
    let job = eventually("the queued job runs after the restart", Duration::from_secs(60), || async {
        let job = get_json(&http, &format!("{url}/api/v1/jobs/{queued_id}"), &erin).await;
        (job["state"] == "succeeded").then_some(job)
    })
    .await;
    assert!(job["message"].as_str().unwrap().contains("already cached"), "{job}");

    // Passwords never reach the logs (the generated admin password is printed once, by design).
    let second_output = server.process.output();
    for output in [&first_output, &second_output, &worker.output()] {
        assert!(!output.contains(user_password), "a password was logged");
    }
    assert!(!second_output.contains(&admin_password), "the admin password is printed only on first start");
    assert_eq!(first_output.matches(&admin_password).count(), 1);
    server.process.kill();
}

#[test]
fn compose_file_uses_only_flags_and_variables_the_binaries_know() {
    let compose = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docker/docker-compose.yml")).unwrap();
    let help = |name: &str| {
        let output = Command::new(binary(name)).arg("--help").output().unwrap();
        String::from_utf8(output.stdout).unwrap()
    };
    let server_help = help("tessera-server");
    let worker_help = help("tessera-worker");
    let mut checked = 0;
    for line in compose.lines() {
        let line = line.trim();
        let Some(variable) = line.split(':').next().filter(|v| v.starts_with("TESSERA_")) else { continue };
        if variable == "TESSERA_PORT" {
            continue; // compose's own knob for the published port
        }
        assert!(
            server_help.contains(&format!("env: {variable}")) || worker_help.contains(&format!("env: {variable}")),
            "docker-compose.yml sets {variable}, which neither binary reads"
        );
        checked += 1;
    }
    assert!(checked >= 8, "the compose file configures the binaries through TESSERA_* variables");
    for dockerfile in ["Dockerfile.server", "Dockerfile.worker", "Dockerfile.worker-cuda"] {
        let text = std::fs::read_to_string(format!("{}/../docker/{dockerfile}", env!("CARGO_MANIFEST_DIR"))).unwrap();
        for variable in text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).filter(|w| w.starts_with("TESSERA_")) {
            assert!(
                server_help.contains(&format!("env: {variable}")) || worker_help.contains(&format!("env: {variable}")),
                "{dockerfile} uses {variable}, which neither binary reads"
            );
        }
    }
}

/// sentence-transformers' own embeddings of a few texts (worker/tests/fixtures).
fn reference_embeddings() -> Vec<(String, Vec<f32>)> {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../worker/tests/fixtures/minilm_reference.json")).unwrap();
    let fixture: Value = serde_json::from_str(&text).unwrap();
    fixture["texts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| (t["text"].as_str().unwrap().to_string(), t["embedding"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect()))
        .collect()
}

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
    dot / (norm(a) * norm(b))
}

const CLASSIFIER_LABELS: [&str; 3] = ["negative", "neutral", "positive"];

/// A tiny `BertForSequenceClassification` with random weights, laid out as `transformers`
/// saves a task model: encoder and pooler under `bert.`, the head at the top level, the
/// labels in config.json's `id2label`. The tokenizer is MiniLM's (bert-base's vocabulary).
fn write_classifier(dir: &Path, tokenizer_dir: &Path) {
    let sizes = RandomBert { hidden: 32, layers: 2, heads: 2, intermediate: 64, vocab: 30522, max_positions: 128 };
    sizes.write(dir, 11, tokenizer_dir).unwrap();
    let weights = dir.join("model.safetensors");
    let encoder = candle_core::safetensors::load(&weights, &Device::Cpu).unwrap();
    let mut tensors: HashMap<String, Tensor> = encoder.into_iter().map(|(name, tensor)| (format!("bert.{name}"), tensor)).collect();
    // Uniform in ±0.5 (xorshift), larger than BERT's 0.02 initialisation so that different
    // texts get clearly different logits.
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut random = |shape: &[usize]| {
        let values: Vec<f32> = (0..shape.iter().product())
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect();
        Tensor::from_vec(values, shape, &Device::Cpu).unwrap()
    };
    let (h, classes) = (sizes.hidden, CLASSIFIER_LABELS.len());
    tensors.insert("bert.pooler.dense.weight".into(), random(&[h, h]));
    tensors.insert("bert.pooler.dense.bias".into(), random(&[h]));
    tensors.insert("classifier.weight".into(), random(&[classes, h]));
    tensors.insert("classifier.bias".into(), random(&[classes]));
    candle_core::safetensors::save(&tensors, &weights).unwrap();

    let config_path = dir.join("config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["architectures"] = json!(["BertForSequenceClassification"]);
    config["id2label"] = Value::Object(CLASSIFIER_LABELS.iter().enumerate().map(|(i, label)| (i.to_string(), json!(label))).collect());
    config["label2id"] = Value::Object(CLASSIFIER_LABELS.iter().enumerate().map(|(i, label)| (label.to_string(), json!(i))).collect());
    std::fs::write(&config_path, config.to_string()).unwrap();
}

/// The gateway's timings (ms, as TEI sends them) are on `response`, and the total covers
/// the inference.
fn assert_timing_headers(response: &reqwest::Response) {
    let ms = |header: &str| -> f64 {
        let value = response.headers().get(header).unwrap_or_else(|| panic!("{header} is missing: {:?}", response.headers()));
        let ms: f64 = value.to_str().unwrap().parse().unwrap_or_else(|_| panic!("{header}: {value:?} is not a number"));
        assert!(ms.is_finite() && ms >= 0.0, "{header}: {ms}");
        ms
    };
    let [_, _, inference, total] = ["x-queue-time", "x-tokenization-time", "x-inference-time", "x-total-time"].map(ms);
    assert!(inference > 0.0 && total >= inference, "x-inference-time {inference} ms, x-total-time {total} ms");
}

/// One KServe v2 JSON inference of `texts`: the reply's timings are checked and its one
/// output returned.
async fn kserve_infer(http: &reqwest::Client, url: &str, token: &str, deployment: &str, texts: &[&str]) -> Value {
    let request = json!({"id": "e2e", "inputs": [{"name": "text", "datatype": "BYTES", "shape": [texts.len()], "data": texts}]});
    let reply = http.post(format!("{url}/v2/models/{deployment}/infer")).bearer_auth(token).json(&request).send().await.unwrap();
    assert_eq!(reply.status(), 200);
    assert_timing_headers(&reply);
    let reply: Value = reply.json().await.unwrap();
    assert_eq!((&reply["model_name"], &reply["model_version"], &reply["id"]), (&json!(deployment), &json!("1"), &json!("e2e")), "{reply}");
    let outputs = reply["outputs"].as_array().unwrap();
    assert_eq!(outputs.len(), 1, "{reply}");
    outputs[0].clone()
}

fn floats(data: &Value) -> Vec<f32> {
    data.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect()
}

/// Deploys `model` as `deployment` with one replica and waits until it is ready.
async fn deploy(http: &reqwest::Client, url: &str, token: &str, deployment: &str, model: &str, worker: &Process) {
    let response = http.post(format!("{url}/api/v1/deployments")).bearer_auth(token)
        .json(&json!({"name": deployment, "model": model, "replicas": 1, "max_batch_tokens": 2048})).send().await.unwrap();
    assert_eq!(response.status(), 201);
    eventually(&format!("{deployment} is ready"), Duration::from_secs(120), || async {
        let d = get_json(http, &format!("{url}/api/v1/deployments/{deployment}"), token).await;
        assert_ne!(d["state"], "failed", "{d}\n{}", worker.output());
        (d["state"] == "ready").then_some(())
    })
    .await;
}

/// A small random classifier, written to `model_dir`, uploaded and deployed: KServe answers
/// its logits as the engine computes them in process; the OpenAI embeddings route refuses
/// it with a pointer to KServe.
async fn serve_a_classifier(http: &reqwest::Client, url: &str, token: &str, tokenizer_dir: &Path, model_dir: &Path, worker: &Process) {
    write_classifier(model_dir, tokenizer_dir);
    let model = upload_model(http, url, token, model_dir, &["config.json", "model.safetensors", "tokenizer.json"], "tiny-classifier").await;
    assert_eq!(model["architecture"], "BertForSequenceClassification");
    let deployment = "sentiment";
    deploy(http, url, token, deployment, "tiny-classifier", worker).await;

    let metadata = get_json(http, &format!("{url}/v2/models/{deployment}"), token).await;
    assert_eq!(metadata["outputs"], json!([{"name": "logits", "datatype": "FP32", "shape": [-1, CLASSIFIER_LABELS.len()]}]));
    let texts = ["The service was wonderful and quick.", "The service was slow, and the food arrived cold."];
    let mut answers = Vec::new();
    for _ in 0..2 {
        let output = kserve_infer(http, url, token, deployment, &texts).await;
        assert_eq!((&output["name"], &output["datatype"]), (&json!("logits"), &json!("FP32")), "{output}");
        assert_eq!(output["shape"], json!([texts.len(), CLASSIFIER_LABELS.len()]));
        let logits = floats(&output["data"]);
        assert_eq!(logits.len(), texts.len() * CLASSIFIER_LABELS.len());
        assert!(logits.iter().all(|v| v.is_finite()), "{logits:?}");
        answers.push(logits);
    }
    assert_eq!(answers[0], answers[1], "the same texts must get the same logits");
    let (first, second) = answers[0].split_at(CLASSIFIER_LABELS.len());
    assert_ne!(first, second, "different texts must get different logits");

    let engine = EmbeddingModel::load(model_dir).unwrap();
    let expected = engine.classify(&texts).unwrap();
    for ((text, served), prediction) in texts.iter().zip(answers[0].chunks(CLASSIFIER_LABELS.len())).zip(&expected) {
        let gap = served.iter().zip(&prediction.logits).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(gap <= 1e-4, "{text:?}: served {served:?}, the engine in process {:?}", prediction.logits);
    }

    let response = http.post(format!("{url}/v1/embeddings")).bearer_auth(token).json(&json!({"model": deployment, "input": texts[0]})).send().await.unwrap();
    assert_eq!(response.status(), 400);
    let error: Value = response.json().await.unwrap();
    assert_eq!(error["error"]["type"], "invalid_request_error", "{error}");
    let message = error["error"]["message"].as_str().unwrap();
    assert!(message.contains("classifier") && message.contains(&format!("/v2/models/{deployment}/infer")), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deployments_serve_embeddings_and_classifiers_to_openai_and_kserve_clients() {
    let Some(model_dir) = minilm_dir() else { return };
    let data = tempfile::tempdir().unwrap();
    let http = reqwest::Client::new();
    let mut server = start_server(&data.path().join("server"));
    let url = server.url.clone();
    let line = server.process.wait_for_line("with password: ", Duration::from_secs(5));
    let admin = login(&http, &url, "admin", line.rsplit(' ').next().unwrap()).await;

    // KServe's server metadata and health, without credentials (probes and tritonclient call
    // them so); the workspace shares one version.
    let metadata = http.get(format!("{url}/v2")).send().await.unwrap();
    assert_eq!(metadata.status(), 200);
    let metadata: Value = metadata.json().await.unwrap();
    assert_eq!(metadata, json!({"name": "tessera", "version": env!("CARGO_PKG_VERSION"), "extensions": ["binary_tensor_data"]}));
    for (route, body) in [("/v2/health/ready", json!({"ready": true})), ("/v2/health/live", json!({"live": true}))] {
        let response = http.get(format!("{url}{route}")).send().await.unwrap();
        assert_eq!(response.status(), 200, "{route}");
        assert_eq!(response.json::<Value>().await.unwrap(), body, "{route}");
    }

    upload_minilm(&http, &url, &admin, &model_dir, "minilm").await;
    let worker = start_worker(&url, &data.path().join("worker"));
    deploy(&http, &url, &admin, "minilm-embed", "minilm", &worker).await;

    // OpenAI: floats, base64, token ids, dimensions; the vectors are sentence-transformers'.
    let references = reference_embeddings();
    let texts: Vec<&str> = references.iter().map(|(t, _)| t.as_str()).collect();
    let response = http.post(format!("{url}/v1/embeddings")).bearer_auth(&admin)
        .json(&json!({"model": "minilm-embed", "input": texts})).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert_timing_headers(&response);
    let body: Value = response.json().await.unwrap();
    assert!(body["usage"]["prompt_tokens"].as_u64().unwrap() > texts.len() as u64);
    for ((text, expected), item) in references.iter().zip(body["data"].as_array().unwrap()) {
        let got: Vec<f32> = item["embedding"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
        assert!(cosine(&got, expected) >= 0.9999, "{text:?}: cosine {}", cosine(&got, expected));
    }
    let response = http.post(format!("{url}/v1/embeddings")).bearer_auth(&admin)
        .json(&json!({"model": "minilm-embed", "input": "hello world", "encoding_format": "base64", "dimensions": 64})).send().await.unwrap();
    let body: Value = response.json().await.unwrap();
    use base64::Engine as _;
    let bytes = base64::engine::general_purpose::STANDARD.decode(body["data"][0]["embedding"].as_str().unwrap()).unwrap();
    assert_eq!(bytes.len(), 64 * 4);
    let response = http.post(format!("{url}/v1/embeddings")).bearer_auth(&admin)
        .json(&json!({"model": "minilm-embed", "input": [[101, 7592, 2088, 102]]})).send().await.unwrap();
    assert_eq!(response.status(), 200);
    for (body, status) in [
        (json!({"model": "nope", "input": "x"}), 404),
        (json!({"model": "minilm-embed", "input": [[101, 999999]]}), 422),
        (json!({"model": "minilm-embed", "input": "x", "encoding_format": "hex"}), 400),
        (json!({"model": "minilm-embed", "input": []}), 400),
        (json!({"model": "minilm-embed", "input": "word ".repeat(400), "truncate": false}), 413),
    ] {
        let response = http.post(format!("{url}/v1/embeddings")).bearer_auth(&admin).json(&body).send().await.unwrap();
        assert_eq!(response.status(), status, "{body}");
        let error: Value = response.json().await.unwrap();
        assert!(error["error"]["message"].is_string(), "{error}");
    }
    assert_eq!(http.post(format!("{url}/v1/embeddings")).json(&json!({"model": "minilm-embed", "input": "x"})).send().await.unwrap().status(), 401);

    // KServe v2, JSON.
    let ready = http.get(format!("{url}/v2/models/minilm-embed/ready")).bearer_auth(&admin).send().await.unwrap();
    assert_eq!(ready.status(), 200);
    let metadata = get_json(&http, &format!("{url}/v2/models/minilm-embed"), &admin).await;
    assert_eq!(metadata["outputs"][0]["shape"], json!([-1, 384]));
    let output = kserve_infer(&http, &url, &admin, "minilm-embed", &[texts[1], texts[2]]).await;
    assert_eq!((&output["name"], &output["datatype"], &output["shape"]), (&json!("embedding"), &json!("FP32"), &json!([2, 384])));
    let flat = floats(&output["data"]);
    assert!(cosine(&flat[384..], &references[2].1) >= 0.9999);

    // KServe v2 with Triton's binary extension in both directions.
    let mut tensor = Vec::new();
    for text in [texts[1], texts[2]] {
        tensor.extend_from_slice(&(text.len() as u32).to_le_bytes());
        tensor.extend_from_slice(text.as_bytes());
    }
    let header = serde_json::to_vec(&json!({
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "parameters": {"binary_data_size": tensor.len()}}],
        "parameters": {"binary_data_output": true}
    })).unwrap();
    let mut body = header.clone();
    body.extend_from_slice(&tensor);
    let reply = http.post(format!("{url}/v2/models/minilm-embed/infer")).bearer_auth(&admin)
        .header("Inference-Header-Content-Length", header.len()).body(body).send().await.unwrap();
    assert_eq!(reply.status(), 200);
    let json_len: usize = reply.headers()["inference-header-content-length"].to_str().unwrap().parse().unwrap();
    let bytes = reply.bytes().await.unwrap();
    let head: Value = serde_json::from_slice(&bytes[..json_len]).unwrap();
    assert_eq!(head["outputs"][0]["parameters"]["binary_data_size"], 2 * 384 * 4);
    let values: Vec<f32> = bytes[json_len..].chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    assert!(cosine(&values[..384], &references[1].1) >= 0.9999);
    let bad = http.post(format!("{url}/v2/models/minilm-embed/infer")).bearer_auth(&admin).json(&json!({"inputs": []})).send().await.unwrap();
    assert_eq!(bad.status(), 400);
    assert!(bad.json::<Value>().await.unwrap()["error"].is_string());

    // The official Python clients, when the test script provides them.
    if let Ok(python) = std::env::var("TESSERA_TEST_PYTHON") {
        let token: Value = http.post(format!("{url}/api/v1/tokens")).bearer_auth(&admin).json(&json!({"name": "clients"})).send().await.unwrap().json().await.unwrap();
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/clients/check_clients.py");
        let output = Command::new(python).arg(script).arg(&url).arg(token["token"].as_str().unwrap()).arg("minilm-embed").output().unwrap();
        let printed = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
        assert!(output.status.success(), "python clients failed:\n{printed}");
        assert!(printed.contains("openai ok") && printed.contains("tritonclient ok"), "{printed}");
    } else {
        assert!(std::env::var("TESSERA_REQUIRE_ASSETS").as_deref() != Ok("1"), "TESSERA_TEST_PYTHON is not set; run scripts/test.sh");
    }

    // A CPU worker hosts one replica: MiniLM scales to zero to make room for a classifier.
    let response = http.patch(format!("{url}/api/v1/deployments/minilm-embed")).bearer_auth(&admin).json(&json!({"replicas": 0})).send().await.unwrap();
    assert_eq!(response.status(), 200);
    serve_a_classifier(&http, &url, &admin, &model_dir, &data.path().join("classifier"), &worker).await;

    // The gateway's metrics saw the traffic.
    let metrics = http.get(format!("{url}/metrics")).bearer_auth(&admin).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("tessera_inference_batch_tokens"), "{metrics}");
    server.process.kill();
}
