//! Overload benchmark (issue 14, "Overload must shed load, not time out"): the release
//! `tessera-server` and `tessera-worker` on loopback serving all-MiniLM-L6-v2 with the
//! default limits. First the capacity: real tokens/s answered to closed-loop clients that
//! keep the replica busy (its saturated throughput). Then, for a bounded time each, an
//! open-loop offered load of 2×, 5× and 20× that capacity (requests sent at a fixed rate,
//! whatever the answers), and per level: goodput (real tokens/s of answered requests over
//! the level), p50/p99 latency of answered requests, the share of 429s, client time-outs,
//! peak RSS (VmHWM) of the server and the worker, the cores the driver, the server and
//! the worker used, and what the replica's compute did (busy share of the time, tokens/s
//! while computing, from the answers' `x-inference-time`). Repeated `--runs` times from a
//! fresh server and worker; the result files hold every run and the median.
//!
//! Run: cargo build --release -p tessera-server -p tessera-worker &&
//!      cargo run --release -p tessera-bench --bin overload -- [--bin-dir DIR]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::Parser;
use serde_json::{json, Value};

const ADMIN_PASSWORD: &str = "overload-bench-admin-password";
const WORKER_TOKEN: &str = "overload-bench-worker-token-32-bytes-long";
const MODEL_FILES: &[&str] = &[
    "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
    "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json", "1_Pooling/config.json",
];
/// Words the request texts are made of (real English, so tokens are ordinary word pieces).
const WORDS: &[&str] = &[
    "the", "software", "is", "provided", "as", "without", "warranty", "of", "any", "kind", "express", "or", "implied",
    "including", "but", "not", "limited", "to", "warranties", "merchantability", "fitness", "for", "a", "particular",
    "purpose", "and", "noninfringement", "in", "no", "event", "shall", "authors", "copyright", "holders", "be", "liable",
];

#[derive(Debug, Parser)]
struct Cli {
    /// The all-MiniLM-L6-v2 folder (default: $TESSERA_ASSETS or .assets, all-MiniLM-L6-v2).
    #[arg(long, env = "TESSERA_BENCH_MODEL")]
    model: Option<PathBuf>,
    /// Folder holding the release tessera-server and tessera-worker (default: this binary's).
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// Fresh server + worker runs; the result is the median of each figure.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Texts per request.
    #[arg(long, default_value_t = 8)]
    texts: usize,
    /// Words per text (about 1.2 tokens each, cut at the model's 256 tokens).
    #[arg(long, default_value_t = 150)]
    words: usize,
    /// Closed-loop clients of the capacity measurement, and its seconds. 8 keep several
    /// requests queued behind the computing batch (the replica never waits for work, as
    /// under overload) and less than the wait limit of work queued (none is refused).
    #[arg(long, default_value_t = 8)]
    capacity_clients: usize,
    #[arg(long, default_value_t = 10)]
    capacity_secs: u64,
    /// Offered load as multiples of the capacity, and seconds of each level.
    #[arg(long, value_delimiter = ',', default_value = "2,5,20")]
    levels: Vec<f64>,
    #[arg(long, default_value_t = 20)]
    level_secs: u64,
    /// The clients' time-out (the 60 s).
    #[arg(long, default_value_t = 60)]
    client_timeout_secs: u64,
}

struct Process {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Process {
    fn spawn(command: &mut Command) -> Result<Process> {
        let mut child = command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn()?;
        let lines = Arc::new(Mutex::new(Vec::new()));
        let streams: [Box<dyn std::io::Read + Send>; 2] = [Box::new(child.stdout.take().expect("piped")), Box::new(child.stderr.take().expect("piped"))];
        for stream in streams {
            let lines = lines.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    lines.lock().expect("output lock").push(line);
                }
            });
        }
        Ok(Process { child, lines })
    }

    async fn wait_for_line(&mut self, needle: &str) -> Result<String> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(line) = self.lines.lock().expect("output lock").iter().find(|l| l.contains(needle)) {
                return Ok(line.clone());
            }
            if let Some(status) = self.child.try_wait()? {
                bail!("exited ({status}) before printing {needle:?}");
            }
            ensure!(Instant::now() < deadline, "did not print {needle:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Peak resident memory so far (VmHWM), in MiB.
    fn peak_rss_mib(&self) -> f64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap_or_default();
        let kib = status.lines().find_map(|l| l.strip_prefix("VmHWM:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok());
        kib.unwrap_or(f64::NAN) / 1024.0
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn ok_json(response: reqwest::Response, what: &str) -> Result<Value> {
    let status = response.status();
    let body = response.text().await?;
    ensure!(status.is_success(), "{what}: {status} {body}");
    Ok(serde_json::from_str(&body)?)
}

/// One request's outcome as the client saw it. `batch_us` is the worker's compute time of
/// the batch the request was in (`x-inference-time`): the requests of one batch share it
/// to the microsecond, so its distinct values are the batches.
#[derive(Clone, Copy)]
enum Outcome {
    Answered { ms: f64, batch_us: u64 },
    Refused { retry_after: bool },
    Other,
    TimedOut,
}

/// The load driver shares the cores with the server and the worker, so a call costs it
/// as little as it can: the body is serialised once, and an answer's body is read but not
/// parsed (every request is the same, so every answer holds the same tokens: `tokens`,
/// read from the warm-up answer).
struct Service {
    http: reqwest::Client,
    url: String,
    authorization: String,
    body: String,
}

impl Service {
    async fn send(&self) -> Result<reqwest::Response, reqwest::Error> {
        self.http
            .post(&self.url)
            .header(reqwest::header::AUTHORIZATION, &self.authorization)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(self.body.clone())
            .send()
            .await
    }

    /// Real tokens of one answered request (`usage.total_tokens`).
    async fn tokens(&self) -> Result<u64> {
        let answer = ok_json(self.send().await?, "embeddings").await?;
        answer["usage"]["total_tokens"].as_u64().context("usage.total_tokens")
    }

    async fn call(&self) -> Outcome {
        let started = Instant::now();
        let response = match self.send().await {
            Ok(response) => response,
            Err(e) if e.is_timeout() => return Outcome::TimedOut,
            Err(_) => return Outcome::Other,
        };
        let status = response.status();
        let header = |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_string);
        let retry_after = header("retry-after").is_some();
        let batch_us = header("x-inference-time").and_then(|ms| ms.parse::<f64>().ok()).map(|ms| (ms * 1e3).round() as u64);
        match response.bytes().await {
            Ok(_) if status.is_success() => Outcome::Answered { ms: started.elapsed().as_secs_f64() * 1e3, batch_us: batch_us.unwrap_or(0) },
            Ok(_) if status.as_u16() == 429 => Outcome::Refused { retry_after },
            Err(e) if e.is_timeout() => Outcome::TimedOut,
            _ => Outcome::Other,
        }
    }
}

/// CPU seconds a process has used so far (user + system, `/proc/<pid>/stat`).
fn cpu_secs(pid: &str) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The fields after the command name (which may hold spaces) start at the state, field 3.
    let fields: Vec<&str> = stat.rsplit_once(')').map_or("", |(_, rest)| rest).split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(f64::NAN);
    // utime and stime are fields 14 and 15; clock ticks are 100 per second on Linux.
    (ticks(11) + ticks(12)) / 100.0
}

/// CPU seconds of the driver, the server and the worker (with its engine threads).
#[derive(Clone, Copy)]
struct Cpu([f64; 3]);

impl Cpu {
    fn now(server: &Process, worker: &Process) -> Cpu {
        Cpu([cpu_secs("self"), cpu_secs(&server.child.id().to_string()), cpu_secs(&worker.child.id().to_string())])
    }

    /// Cores each used since `before`, over `secs`.
    fn cores_since(&self, before: Cpu, secs: f64) -> Value {
        let core = |i: usize| (self.0[i] - before.0[i]) / secs;
        json!({"driver": core(0), "server": core(1), "worker": core(2)})
    }
}

/// What the replica's compute did over `secs`, from the answered requests' batches: the
/// share of the time it was computing, the mean batch, and its tokens/s while computing.
fn compute_figures(outcomes: &[Outcome], tokens_per_request: u64, secs: f64) -> Value {
    let mut batches: std::collections::HashMap<u64, u64> = std::collections::HashMap::new();
    for outcome in outcomes {
        if let Outcome::Answered { batch_us, .. } = outcome {
            *batches.entry(*batch_us).or_default() += tokens_per_request;
        }
    }
    let busy_secs = batches.keys().sum::<u64>() as f64 / 1e6;
    let tokens = batches.values().sum::<u64>() as f64;
    json!({
        "compute_busy_share": busy_secs / secs, "batches": batches.len(),
        "mean_batch_tokens": tokens / batches.len().max(1) as f64, "compute_tokens_per_s": tokens / busy_secs,
    })
}

fn percentile(values: &[f64], p: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((p / 100.0 * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1]
}

fn median(mut values: Vec<f64>) -> f64 {
    values.retain(|v| !v.is_nan());
    percentile(&values, 50.0)
}

/// Figures of one level of one run.
fn level_figures(outcomes: &[Outcome], tokens_per_request: u64, secs: f64, capacity: f64, offered: f64, server: &Process, worker: &Process) -> Value {
    let latencies: Vec<f64> = outcomes.iter().filter_map(|o| if let Outcome::Answered { ms, .. } = o { Some(*ms) } else { None }).collect();
    let tokens = latencies.len() as u64 * tokens_per_request;
    let refused = outcomes.iter().filter(|o| matches!(o, Outcome::Refused { .. })).count();
    let with_retry_after = outcomes.iter().filter(|o| matches!(o, Outcome::Refused { retry_after: true })).count();
    let timed_out = outcomes.iter().filter(|o| matches!(o, Outcome::TimedOut)).count();
    let other = outcomes.iter().filter(|o| matches!(o, Outcome::Other)).count();
    let goodput = tokens as f64 / secs;
    json!({
        "offered_tokens_per_s": offered, "requests": outcomes.len(), "answered": latencies.len(),
        "goodput_tokens_per_s": goodput, "goodput_of_capacity": goodput / capacity,
        "p50_ms": percentile(&latencies, 50.0), "p99_ms": percentile(&latencies, 99.0),
        "share_429": refused as f64 / outcomes.len().max(1) as f64, "429_with_retry_after": with_retry_after,
        "client_timeouts": timed_out, "other_errors": other,
        "server_peak_rss_mib": server.peak_rss_mib(), "worker_peak_rss_mib": worker.peak_rss_mib(),
    })
}

async fn run(cli: &Cli, bin_dir: &Path, model_dir: &Path, index: usize) -> Result<Value> {
    let data = tempfile::tempdir()?;
    let mut server = Process::spawn(
        Command::new(bin_dir.join("tessera-server"))
            .args(["--bind", "127.0.0.1:0", "--data-dir"])
            .arg(data.path().join("server"))
            .env("TESSERA_ADMIN_PASSWORD", ADMIN_PASSWORD)
            .env("TESSERA_WORKER_TOKEN", WORKER_TOKEN)
            .env("TESSERA_HEARTBEAT_SECS", "1")
            .env_remove("TESSERA_DATABASE_URL"),
    )?;
    let line = server.wait_for_line("listening on http://").await?;
    let url = line.rsplit(' ').next().context("the server's URL")?.trim().to_string();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(cli.client_timeout_secs))
        .pool_max_idle_per_host(512)
        .tcp_nodelay(true)
        .build()?;
    let login = http.post(format!("{url}/api/v1/auth/login")).json(&json!({"username": "admin", "password": ADMIN_PASSWORD})).send().await?;
    let session = ok_json(login, "login").await?["token"].as_str().context("session")?.to_string();
    let mut form = reqwest::multipart::Form::new().text("name", "minilm");
    for path in MODEL_FILES {
        form = form.part("files", reqwest::multipart::Part::bytes(std::fs::read(model_dir.join(path))?).file_name(path.to_string()));
    }
    ok_json(http.post(format!("{url}/api/v1/models")).bearer_auth(&session).multipart(form).send().await?, "upload").await?;
    let worker = Process::spawn(
        Command::new(bin_dir.join("tessera-worker"))
            .args(["--server", &url, "--name", "bench-worker", "--data-dir"])
            .arg(data.path().join("worker"))
            .env("TESSERA_WORKER_TOKEN", WORKER_TOKEN),
    )?;
    let created = http.post(format!("{url}/api/v1/deployments")).bearer_auth(&session).json(&json!({"name": "minilm", "model": "minilm", "replicas": 1})).send().await?;
    ok_json(created, "deployment").await?;
    let started = Instant::now();
    loop {
        let d = ok_json(http.get(format!("{url}/api/v1/deployments/minilm")).bearer_auth(&session).send().await?, "deployment").await?;
        if d["state"] == "ready" {
            break;
        }
        ensure!(d["state"] != "failed" && started.elapsed() < Duration::from_secs(300), "deployment: {d}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Distinct texts (a word walk seeded by the request's slot), so nothing is cached anywhere.
    let texts: Vec<String> = (0..cli.texts)
        .map(|t| (0..cli.words).map(|w| WORDS[(t * 7 + w * 13 + w * w) % WORDS.len()]).collect::<Vec<_>>().join(" "))
        .collect();
    let service = Arc::new(Service {
        http,
        url: format!("{url}/v1/embeddings"),
        authorization: format!("Bearer {session}"),
        body: json!({"model": "minilm", "input": texts}).to_string(),
    });

    // Capacity: the replica's saturated throughput, from closed-loop clients that keep it
    // busy (its compute's busy share is recorded to show it), after a few warm-up requests.
    let tokens_per_request = service.tokens().await?;
    for _ in 0..3 {
        service.call().await;
    }
    let clients = cli.capacity_clients;
    let deadline = Instant::now() + Duration::from_secs(cli.capacity_secs);
    let measuring = Instant::now();
    let cpu_before = Cpu::now(&server, &worker);
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let service = service.clone();
            tokio::spawn(async move {
                let mut outcomes = Vec::new();
                while Instant::now() < deadline {
                    let outcome = service.call().await;
                    if !matches!(outcome, Outcome::Answered { .. }) {
                        // Refused (or failed): back off rather than spin.
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    outcomes.push(outcome);
                }
                outcomes
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for task in tasks {
        outcomes.extend(task.await?);
    }
    let secs = measuring.elapsed().as_secs_f64();
    let cores = Cpu::now(&server, &worker).cores_since(cpu_before, secs);
    let latencies: Vec<f64> = outcomes.iter().filter_map(|o| if let Outcome::Answered { ms, .. } = o { Some(*ms) } else { None }).collect();
    ensure!(!latencies.is_empty(), "the capacity load got no answer");
    let refused = outcomes.len() - latencies.len();
    let capacity = (latencies.len() as u64 * tokens_per_request) as f64 / secs;
    let capacity_p50 = percentile(&latencies, 50.0);
    let compute = compute_figures(&outcomes, tokens_per_request, secs);
    println!(
        "run {index}: capacity {capacity:.0} tokens/s ({tokens_per_request} tokens per request, {clients} clients, p50 {capacity_p50:.0} ms, {refused} not answered), \
         compute busy {:.2}, mean batch {:.0} tokens, {:.0} tokens/s while computing, cores {cores}",
        compute["compute_busy_share"].as_f64().unwrap_or(f64::NAN),
        compute["mean_batch_tokens"].as_f64().unwrap_or(f64::NAN),
        compute["compute_tokens_per_s"].as_f64().unwrap_or(f64::NAN),
    );

    let mut levels = Vec::new();
    for &multiple in &cli.levels {
        let offered = multiple * capacity;
        let interval = Duration::from_secs_f64(tokens_per_request as f64 / offered);
        let level_started = Instant::now();
        let cpu_before = Cpu::now(&server, &worker);
        let end = level_started + Duration::from_secs(cli.level_secs);
        let mut next = level_started;
        let mut calls = Vec::new();
        while next < end {
            tokio::time::sleep_until(next.into()).await;
            let service = service.clone();
            calls.push(tokio::spawn(async move { service.call().await }));
            next += interval;
        }
        let mut outcomes = Vec::new();
        for call in calls {
            outcomes.push(call.await?);
        }
        // Goodput over the level until its last answer (the sending time, plus the drain).
        let secs = level_started.elapsed().as_secs_f64();
        let mut figures = level_figures(&outcomes, tokens_per_request, secs, capacity, offered, &server, &worker);
        figures["cores"] = Cpu::now(&server, &worker).cores_since(cpu_before, secs);
        figures["compute"] = compute_figures(&outcomes, tokens_per_request, secs);
        // The same ratio per CPU-second the worker got: the cores are shared with other
        // work, whose load may change between the capacity and the level.
        let per_core = |tokens_per_s: f64, cores: &Value| tokens_per_s / cores["worker"].as_f64().unwrap_or(f64::NAN);
        figures["goodput_of_capacity_per_worker_core"] =
            json!(per_core(figures["goodput_tokens_per_s"].as_f64().unwrap_or(f64::NAN), &figures["cores"]) / per_core(capacity, &cores));
        let f = |k: &str| figures[k].as_f64().unwrap_or(f64::NAN);
        let c = |k: &str| figures["compute"][k].as_f64().unwrap_or(f64::NAN);
        println!(
            "run {index}: {multiple}x: goodput {:.0} tokens/s ({:.2} of capacity), p50 {:.0} ms, p99 {:.0} ms, 429 {:.1}%, time-outs {}, \
             RSS server {:.0} MiB worker {:.0} MiB; compute busy {:.2}, mean batch {:.0} tokens, {:.0} tokens/s while computing; cores {}",
            f("goodput_tokens_per_s"), f("goodput_of_capacity"), f("p50_ms"), f("p99_ms"), 100.0 * f("share_429"), figures["client_timeouts"],
            f("server_peak_rss_mib"), f("worker_peak_rss_mib"), c("compute_busy_share"), c("mean_batch_tokens"), c("compute_tokens_per_s"), figures["cores"],
        );
        figures["multiple"] = json!(multiple);
        figures["secs"] = json!(secs);
        levels.push(figures);
    }
    Ok(json!({
        "capacity_tokens_per_s": capacity, "tokens_per_request": tokens_per_request, "capacity_clients": clients,
        "capacity_p50_ms": capacity_p50, "capacity_not_answered": refused, "capacity_cores": cores, "capacity_compute": compute,
        "levels": levels,
    }))
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg").unwrap_or_default().split_whitespace().take(3).collect::<Vec<_>>().join(" ")
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    let workspace = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let model_dir = cli.model.clone().unwrap_or_else(|| {
        std::env::var("TESSERA_ASSETS").map(PathBuf::from).unwrap_or_else(|_| workspace.join(".assets")).join("all-MiniLM-L6-v2")
    });
    let bin_dir = match &cli.bin_dir {
        Some(dir) => dir.clone(),
        None => std::env::current_exe()?.parent().context("binary folder")?.to_path_buf(),
    };
    let load_before = load_average();
    let started = chrono::Utc::now();
    let mut runs = Vec::new();
    for index in 1..=cli.runs {
        runs.push(run(&cli, &bin_dir, &model_dir, index).await?);
    }
    let load_after = load_average();
    let capacity = median(runs.iter().map(|r| r["capacity_tokens_per_s"].as_f64().unwrap_or(f64::NAN)).collect());
    let mut capacity_median = json!({});
    for path in ["capacity_p50_ms", "capacity_not_answered", "capacity_compute/compute_busy_share", "capacity_compute/compute_tokens_per_s", "capacity_compute/mean_batch_tokens", "capacity_cores/driver", "capacity_cores/server", "capacity_cores/worker"] {
        let value = |r: &Value| path.split('/').fold(r, |v, key| &v[key]).as_f64().unwrap_or(f64::NAN);
        capacity_median[path] = json!(median(runs.iter().map(value).collect()));
    }
    println!("capacity (median): {capacity_median}");
    let fields = ["goodput_tokens_per_s", "goodput_of_capacity", "p50_ms", "p99_ms", "share_429", "client_timeouts", "other_errors", "server_peak_rss_mib", "worker_peak_rss_mib", "goodput_of_capacity_per_worker_core",
        "compute/compute_busy_share", "compute/compute_tokens_per_s", "compute/mean_batch_tokens", "cores/driver", "cores/server", "cores/worker"];
    let medians: Vec<Value> = (0..cli.levels.len())
        .map(|i| {
            let mut level = json!({"multiple": cli.levels[i]});
            for field in fields {
                // A nested figure is named by its path ("compute/compute_busy_share").
                let value = |r: &Value| field.split('/').fold(&r["levels"][i], |v, key| &v[key]).as_f64().unwrap_or(f64::NAN);
                level[field] = json!(median(runs.iter().map(value).collect()));
            }
            level
        })
        .collect();
    let machine = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default().lines().find_map(|l| l.strip_prefix("model name")).map(|l| l.trim_start_matches([' ', '\t', ':']).to_string()).unwrap_or_default();
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let result = json!({
        "date": started.to_rfc3339(), "machine": machine, "cores": cores, "load_average_before": load_before, "load_average_after": load_after,
        "command": std::env::args().collect::<Vec<_>>().join(" "), "texts_per_request": cli.texts, "words_per_text": cli.words,
        "level_secs": cli.level_secs, "client_timeout_secs": cli.client_timeout_secs,
        "capacity_tokens_per_s": capacity, "capacity_median": capacity_median, "median": medians, "runs": runs,
    });
    let results = workspace.join("bench/results");
    std::fs::write(results.join("overload.json"), serde_json::to_string_pretty(&result)? + "\n")?;
    let mut md = String::from(
        "| offered | goodput (tokens/s) | / capacity | p50 (ms) | p99 (ms) | 429 share | client time-outs | server / worker peak RSS (MiB) | compute busy | tokens/s while computing | cores: driver / server / worker |\n|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---|\n",
    );
    for level in &medians {
        let f = |k: &str| level[k].as_f64().unwrap_or(f64::NAN);
        md += &format!(
            "| {}x | {:.0} | {:.2} | {:.0} | {:.0} | {:.1}% | {:.0} | {:.0} / {:.0} | {:.2} | {:.0} | {:.2} / {:.2} / {:.2} |\n",
            f("multiple"), f("goodput_tokens_per_s"), f("goodput_of_capacity"), f("p50_ms"), f("p99_ms"), 100.0 * f("share_429"), f("client_timeouts"),
            f("server_peak_rss_mib"), f("worker_peak_rss_mib"), f("compute/compute_busy_share"), f("compute/compute_tokens_per_s"),
            f("cores/driver"), f("cores/server"), f("cores/worker"),
        );
    }
    println!("median of {} runs, capacity {capacity:.0} tokens/s:\n{md}", cli.runs);
    std::fs::write(std::env::temp_dir().join("overload-table.md"), md)?;
    Ok(())
}
