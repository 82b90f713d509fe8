//! End to end: the real server and worker binaries on loopback ports, driven over HTTP
//! as a user and an operator would.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};
use tessera_tests::{binary, eventually, Process};

const WORKER_TOKEN: &str = "e2e-worker-token";

struct Server {
    process: Process,
    url: String,
}

fn start_server(data_dir: &Path) -> Server {
    let mut process = Process::spawn(
        Command::new(binary("tessera-server"))
            .args(["--bind", "127.0.0.1:0", "--data-dir"])
            .arg(data_dir)
            .env("TESSERA_WORKER_TOKEN", WORKER_TOKEN)
            .env("TESSERA_HEARTBEAT_SECS", "1")
            .env("TESSERA_LEASE_TTL_SECS", "5")
            .env_remove("TESSERA_ADMIN_PASSWORD")
            .env_remove("TESSERA_DATABASE_URL"),
    );
    let line = process.wait_for_line("listening on http://", Duration::from_secs(60));
    let url = line.rsplit(' ').next().unwrap().trim().to_string();
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

fn minilm_dir() -> Option<PathBuf> {
    let root = std::env::var("TESSERA_ASSETS").map(PathBuf::from).unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.assets"));
    let dir = root.join("all-MiniLM-L6-v2");
    if dir.join("model.safetensors").exists() {
        return Some(dir);
    }
    assert!(std::env::var("TESSERA_REQUIRE_ASSETS").as_deref() != Ok("1"), "{} is missing; run scripts/fetch-assets.sh", dir.display());
    eprintln!("skipping: {} is missing; run scripts/fetch-assets.sh", dir.display());
    None
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

const MODEL_FILES: &[&str] = &["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "modules.json", "1_Pooling/config.json"];

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
    let mut form = reqwest::multipart::Form::new().text("name", "all-MiniLM-L6-v2");
    for path in MODEL_FILES {
        let bytes = std::fs::read(model_dir.join(path)).unwrap();
        form = form.part("files", reqwest::multipart::Part::bytes(bytes).file_name(path.to_string()));
    }
    let response = http.post(format!("{url}/api/v1/models")).bearer_auth(&erin).multipart(form).send().await.unwrap();
    assert_eq!(response.status(), 201);
    let model: Value = response.json().await.unwrap();
    assert_eq!(model["architecture"], "BertModel");
    assert_eq!(model["size_bytes"].as_u64().unwrap() > 90_000_000, true);
    let model_id = model["id"].as_str().unwrap().to_string();

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
    assert!(metrics.as_array().unwrap().iter().any(|m| m["name"] == "download_mb_per_s"));
    let cached = worker_dir.join("models").join(&model_id).join("model.safetensors");
    assert_eq!(std::fs::read(&cached).unwrap(), std::fs::read(model_dir.join("model.safetensors")).unwrap());

    // Prometheus sees the traffic and the worker.
    let metrics = http.get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
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
