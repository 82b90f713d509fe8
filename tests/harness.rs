//! Starts the real `tessera-server` and `tessera-worker` binaries as child processes and
//! captures their output, so end-to-end tests see exactly what an operator would.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// A built binary: `$TESSERA_SERVER_BIN` / `$TESSERA_WORKER_BIN`, else next to this
/// test executable's target directory (`cargo build --workspace --bins` builds them).
pub fn binary(name: &str) -> PathBuf {
    let variable = format!("TESSERA_{}_BIN", name.trim_start_matches("tessera-").to_uppercase());
    if let Ok(path) = std::env::var(&variable) {
        return PathBuf::from(path);
    }
    let exe = std::env::current_exe().expect("test executable path");
    let profile_dir = exe.parent().and_then(Path::parent).expect("target/<profile>/deps");
    let path = profile_dir.join(name);
    assert!(path.exists(), "{} is not built; run `cargo build --workspace --bins` first (or set {variable})", path.display());
    path
}

/// Starts `tessera-server` on a free loopback port with its own data dir (SQLite), the
/// given worker token, 1 s heartbeats and `lease_ttl_secs` leases; the generated admin
/// password is in its output. Returns the process and the server's URL.
pub fn start_server(data_dir: &Path, worker_token: &str, lease_ttl_secs: u64) -> (Process, String) {
    let lease = lease_ttl_secs.to_string();
    start_server_with(data_dir, &[("TESSERA_WORKER_TOKEN", worker_token), ("TESSERA_LEASE_TTL_SECS", &lease)])
}

/// Starts `tessera-server` as [`start_server`] does, over SQLite in `data_dir` unless `env`
/// names a `TESSERA_DATABASE_URL`, on a free loopback port unless it names a `TESSERA_BIND`,
/// with 1 s heartbeats and the settings in `env` (which must include
/// `TESSERA_WORKER_TOKEN`). Returns the process and the server's URL.
pub fn start_server_with(data_dir: &Path, env: &[(&str, &str)]) -> (Process, String) {
    let mut command = Command::new(binary("tessera-server"));
    command
        .arg("--data-dir")
        .arg(data_dir)
        .env("TESSERA_BIND", "127.0.0.1:0")
        .env("TESSERA_HEARTBEAT_SECS", "1")
        .env_remove("TESSERA_ADMIN_PASSWORD")
        .env_remove("TESSERA_DATABASE_URL")
        .env_remove("TESSERA_BLOB_STORE")
        .envs(env.iter().copied());
    let mut process = Process::spawn(&mut command);
    let line = process.wait_for_line("listening on http://", Duration::from_secs(60));
    let url = line.rsplit(' ').next().unwrap().trim().to_string();
    (process, url)
}

/// A running child process whose stdout and stderr lines are collected.
pub struct Process {
    child: Child,
    output: Arc<Mutex<Vec<String>>>,
}

impl Process {
    pub fn spawn(command: &mut Command) -> Process {
        let mut child = command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("start the binary");
        let output = Arc::new(Mutex::new(Vec::new()));
        for stream in [Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>, Box::new(child.stderr.take().unwrap())] {
            let output = output.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    output.lock().unwrap().push(line);
                }
            });
        }
        Process { child, output }
    }

    /// Everything printed so far.
    pub fn output(&self) -> String {
        self.output.lock().unwrap().join("\n")
    }

    /// Waits for a line containing `needle`; returns that line.
    pub fn wait_for_line(&mut self, needle: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(line) = self.output.lock().unwrap().iter().find(|l| l.contains(needle)) {
                return line.clone();
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("process exited ({status}) before printing {needle:?}:\n{}", self.output());
            }
            assert!(Instant::now() < deadline, "timed out waiting for {needle:?}:\n{}", self.output());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits for the process to exit and returns its status; panics if it prints
    /// `started` first (it is running when it should have refused) or after `timeout`.
    pub fn wait_for_exit_unless(&mut self, started: &str, timeout: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                // Let the reader threads take the last lines.
                std::thread::sleep(Duration::from_millis(100));
                return status;
            }
            assert!(!self.output().contains(started), "the process started:\n{}", self.output());
            assert!(Instant::now() < deadline, "timed out waiting for the process to exit:\n{}", self.output());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The operating system's id of the process.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// The process's resident memory (`VmRSS` of `/proc/<pid>/status`), in bytes.
    pub fn rss_bytes(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.id())).expect("read /proc/<pid>/status");
        let line = status.lines().find(|l| l.starts_with("VmRSS:")).expect("VmRSS in /proc/<pid>/status");
        let kib: u64 = line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).expect("VmRSS in kB");
        kib * 1024
    }

    /// Stops the process the hard way (as a crash or power loss would).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Polls `check` until it returns `Some`, or panics with `what` after `timeout`.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A worker process joining `server` with the worker token `token`.
pub fn start_worker(server: &str, token: &str, data_dir: &Path, name: &str) -> Process {
    Process::spawn(
        Command::new(binary("tessera-worker"))
            .args(["--server", server, "--name", name, "--data-dir"])
            .arg(data_dir)
            .env("TESSERA_WORKER_TOKEN", token),
    )
}

/// scikit-learn's digits as CSV from the assets, or `None` (skip) where they are missing
/// and not required.
pub fn digits_csv() -> Option<Vec<u8>> {
    let root = std::env::var("TESSERA_ASSETS")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.assets"));
    let path = root.join("datasets/digits.csv");
    match std::fs::read(&path) {
        Ok(bytes) => Some(bytes),
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

/// The first admin's password, which a server prints once, on its first start.
pub fn admin_password(server: &mut Process) -> String {
    let line = server.wait_for_line("with password: ", Duration::from_secs(5));
    line.rsplit(' ').next().unwrap().to_string()
}

/// The first admin, signed in over the REST API.
pub struct User {
    pub http: reqwest::Client,
    pub url: String,
    pub token: String,
}

impl User {
    pub async fn login(server: &mut Process, url: &str) -> User {
        let password = admin_password(server);
        let http = reqwest::Client::new();
        let response = http
            .post(format!("{url}/api/v1/auth/login"))
            .json(&json!({"username": "admin", "password": password}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let token = response.json::<Value>().await.unwrap()["token"].as_str().unwrap().to_string();
        User { http, url: url.to_string(), token }
    }

    /// The URL of `path` under `/api/v1`.
    pub fn api(&self, path: &str) -> String {
        format!("{}/api/v1{path}", self.url)
    }

    /// Uploads the files of the folder `dir` (paths relative to it) as the model `name`;
    /// returns the registered model.
    pub async fn upload_model(&self, dir: &Path, files: &[&str], name: &str) -> Value {
        let mut form = reqwest::multipart::Form::new().text("name", name.to_string());
        for path in files {
            let bytes = std::fs::read(dir.join(path)).unwrap();
            form = form.part("files", reqwest::multipart::Part::bytes(bytes).file_name(path.to_string()));
        }
        let response = self.http.post(self.api("/models")).bearer_auth(&self.token).multipart(form).send().await.unwrap();
        let status = response.status();
        let body: Value = response.json().await.unwrap();
        assert_eq!(status, 201, "{body}");
        body
    }

    pub async fn get(&self, path: &str) -> Value {
        let response =
            self.http.get(format!("{}/api/v1{path}", self.url)).bearer_auth(&self.token).send().await.unwrap();
        assert!(response.status().is_success(), "GET {path}: {}", response.status());
        response.json().await.unwrap()
    }

    pub async fn upload_dataset(&self, bytes: Vec<u8>) -> String {
        let form = reqwest::multipart::Form::new()
            .text("name", "digits")
            .part("file", reqwest::multipart::Part::bytes(bytes).file_name("digits.csv"));
        let response = self
            .http
            .post(format!("{}/api/v1/datasets", self.url))
            .bearer_auth(&self.token)
            .multipart(form)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 201);
        response.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_string()
    }

    pub async fn submit(&self, body: Value) -> String {
        let response = self
            .http
            .post(format!("{}/api/v1/jobs", self.url))
            .bearer_auth(&self.token)
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = response.status();
        let body: Value = response.json().await.unwrap();
        assert_eq!(status, 201, "{body}");
        body["id"].as_str().unwrap().to_string()
    }

    pub async fn finished(&self, job: &str, workers: &[&Process], timeout: Duration) -> Value {
        let job = eventually("the training job ends", timeout, || async {
            let job = self.get(&format!("/jobs/{job}")).await;
            ["succeeded", "failed", "cancelled"].contains(&job["state"].as_str().unwrap()).then_some(job)
        })
        .await;
        let output: Vec<String> = workers.iter().map(|w| w.output()).collect();
        assert_eq!(job["state"], "succeeded", "{job}\n{}", output.join("\n----\n"));
        job
    }

    /// A job's log lines, oldest first.
    pub async fn log_lines(&self, job: &str) -> Vec<String> {
        let logs = self.get(&format!("/jobs/{job}/logs?limit=10000")).await;
        logs.as_array().unwrap().iter().map(|l| l["line"].as_str().unwrap().to_string()).collect()
    }
}

/// The databases a test runs the server on: SQLite (`None`), then a fresh database in the
/// throwaway PostgreSQL cluster when `TESSERA_TEST_POSTGRES_URL` is set (scripts/test.sh
/// sets it, with `TESSERA_REQUIRE_POSTGRES=1` so that its absence fails).
pub fn databases() -> Vec<Option<String>> {
    let Ok(base) = std::env::var("TESSERA_TEST_POSTGRES_URL") else {
        assert!(
            std::env::var("TESSERA_REQUIRE_POSTGRES").as_deref() != Ok("1"),
            "TESSERA_REQUIRE_POSTGRES=1 but TESSERA_TEST_POSTGRES_URL is not set"
        );
        eprintln!("note: TESSERA_TEST_POSTGRES_URL not set; testing SQLite only");
        return vec![None];
    };
    // Created with `psql` (installed with the cluster) so that this crate needs no driver.
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = format!("e2e_{}_{nanos}_{n}", std::process::id());
    let output = Command::new("psql")
        .args([base.as_str(), "-v", "ON_ERROR_STOP=1", "-c", &format!("CREATE DATABASE {name}")])
        .output()
        .expect("run psql (the PostgreSQL client) to create a test database");
    assert!(output.status.success(), "CREATE DATABASE {name}: {}", String::from_utf8_lossy(&output.stderr));
    let (prefix, _) = base.rsplit_once('/').expect("TESSERA_TEST_POSTGRES_URL names a database");
    vec![None, Some(format!("{prefix}/{name}"))]
}

/// The body of a rejection in the platform's `{"error":{"code","message"}}` shape, which
/// this asserts (with `status`).
pub async fn error_body(response: reqwest::Response, status: u16) -> Value {
    let what = format!("{}", response.url());
    assert_eq!(response.status(), status, "{what}");
    let text = response.text().await.unwrap();
    let body: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("{what}: not the error shape: {text}"));
    assert!(
        body["error"]["code"].is_string() && body["error"]["message"].is_string(),
        "{what}: not the error shape: {body}"
    );
    body
}

/// The files of the demo model's folder a model upload sends (sentence-transformers layout).
pub const MINILM_FILES: &[&str] = &[
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
    "1_Pooling/config.json",
];

/// The JSON body of a response that must succeed (the status and body in the panic if not).
pub async fn success_json(response: reqwest::Response) -> Value {
    let status = response.status();
    let body: Value = response.json().await.unwrap();
    assert!(status.is_success(), "{status}: {body}");
    body
}

/// The demo model's folder (MiniLM) under `$TESSERA_ASSETS`, or `None` (skip) where it is
/// missing and not required.
pub fn minilm_dir() -> Option<PathBuf> {
    let root = std::env::var("TESSERA_ASSETS")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.assets"));
    let dir = root.join("all-MiniLM-L6-v2");
    if dir.join("model.safetensors").exists() {
        return Some(dir);
    }
    assert!(
        std::env::var("TESSERA_REQUIRE_ASSETS").as_deref() != Ok("1"),
        "{} is missing; run scripts/fetch-assets.sh",
        dir.display()
    );
    eprintln!("skipping: {} is missing; run scripts/fetch-assets.sh", dir.display());
    None
}
