//! Overload benchmark (issue 14, "Overload must shed load, not time out"): the release
//! `tessera-server` and `tessera-worker` on loopback serving all-MiniLM-L6-v2 with the
//! default limits. First the capacity: real tokens/s answered to a few closed-loop clients
//! (a load that barely queues). Then, for a bounded time each, an open-loop offered load of
//! 2×, 5× and 20× that capacity (requests sent at a fixed rate, whatever the answers), and
//! per level: goodput (real tokens/s of answered requests over the level), p50/p99 latency
//! of answered requests, the share of 429s, client time-outs and peak RSS (VmHWM) of the
//! server and the worker. Repeated `--runs` times from a fresh server and worker; the
//! result files hold every run and the median.
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
    /// Closed-loop clients of the capacity measurement, and its seconds.
    #[arg(long, default_value_t = 2)]
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

/// One request's outcome as the client saw it.
#[derive(Clone, Copy)]
enum Outcome {
    Answered { tokens: u64, ms: f64 },
    Refused { retry_after: bool },
    Other,
    TimedOut,
}

struct Service {
    http: reqwest::Client,
    url: String,
    token: String,
    body: Value,
}

impl Service {
    async fn call(&self) -> Outcome {
        let started = Instant::now();
        let sent = self.http.post(format!("{}/v1/embeddings", self.url)).bearer_auth(&self.token).json(&self.body).send().await;
        let response = match sent {
            Ok(response) => response,
            Err(e) if e.is_timeout() => return Outcome::TimedOut,
            Err(_) => return Outcome::Other,
        };
        let status = response.status();
        let retry_after = response.headers().contains_key("retry-after");
        match response.json::<Value>().await {
            Ok(body) if status.is_success() => {
                Outcome::Answered { tokens: body["usage"]["total_tokens"].as_u64().unwrap_or(0), ms: started.elapsed().as_secs_f64() * 1e3 }
            }
            Ok(_) if status.as_u16() == 429 => Outcome::Refused { retry_after },
            Err(e) if e.is_timeout() => Outcome::TimedOut,
            _ => Outcome::Other,
        }
    }
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
fn level_figures(outcomes: &[Outcome], secs: f64, capacity: f64, offered: f64, server: &Process, worker: &Process) -> Value {
    let latencies: Vec<f64> = outcomes.iter().filter_map(|o| if let Outcome::Answered { ms, .. } = o { Some(*ms) } else { None }).collect();
    let tokens: u64 = outcomes.iter().map(|o| if let Outcome::Answered { tokens, .. } = o { *tokens } else { 0 }).sum();
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
    let service = Arc::new(Service { http, url, token: session, body: json!({"model": "minilm", "input": texts}) });

    // Capacity: closed-loop clients, after a few warm-up requests.
    for _ in 0..3 {
        service.call().await;
    }
    let deadline = Instant::now() + Duration::from_secs(cli.capacity_secs);
    let measuring = Instant::now();
    let clients: Vec<_> = (0..cli.capacity_clients)
        .map(|_| {
            let service = service.clone();
            tokio::spawn(async move {
                let mut outcomes = Vec::new();
                while Instant::now() < deadline {
                    outcomes.push(service.call().await);
                }
                outcomes
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for client in clients {
        outcomes.extend(client.await?);
    }
    let secs = measuring.elapsed().as_secs_f64();
    let answered: Vec<(u64, f64)> = outcomes.iter().filter_map(|o| if let Outcome::Answered { tokens, ms } = o { Some((*tokens, *ms)) } else { None }).collect();
    ensure!(answered.len() == outcomes.len() && !answered.is_empty(), "the capacity load was not all answered");
    let capacity = answered.iter().map(|a| a.0).sum::<u64>() as f64 / secs;
    let tokens_per_request = answered[0].0 as f64;
    let capacity_p50 = percentile(&answered.iter().map(|a| a.1).collect::<Vec<_>>(), 50.0);
    println!("run {index}: capacity {capacity:.0} tokens/s ({tokens_per_request} tokens per request, p50 {capacity_p50:.0} ms at {} clients)", cli.capacity_clients);

    let mut levels = Vec::new();
    for &multiple in &cli.levels {
        let offered = multiple * capacity;
        let interval = Duration::from_secs_f64(tokens_per_request / offered);
        let level_started = Instant::now();
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
        let figures = level_figures(&outcomes, secs, capacity, offered, &server, &worker);
        println!(
            "run {index}: {multiple}x: goodput {:.0} tokens/s ({:.2} of capacity), p50 {:.0} ms, p99 {:.0} ms, 429 {:.1}%, time-outs {}, RSS server {:.0} MiB worker {:.0} MiB",
            figures["goodput_tokens_per_s"].as_f64().unwrap_or(0.0),
            figures["goodput_of_capacity"].as_f64().unwrap_or(0.0),
            figures["p50_ms"].as_f64().unwrap_or(f64::NAN),
            figures["p99_ms"].as_f64().unwrap_or(f64::NAN),
            100.0 * figures["share_429"].as_f64().unwrap_or(0.0),
            figures["client_timeouts"],
            figures["server_peak_rss_mib"].as_f64().unwrap_or(f64::NAN),
            figures["worker_peak_rss_mib"].as_f64().unwrap_or(f64::NAN),
        );
        let mut figures = figures;
        figures["multiple"] = json!(multiple);
        figures["secs"] = json!(secs);
        levels.push(figures);
    }
    Ok(json!({"capacity_tokens_per_s": capacity, "tokens_per_request": tokens_per_request, "capacity_p50_ms": capacity_p50, "levels": levels}))
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
    let fields = ["goodput_tokens_per_s", "goodput_of_capacity", "p50_ms", "p99_ms", "share_429", "client_timeouts", "other_errors", "server_peak_rss_mib", "worker_peak_rss_mib"];
    let medians: Vec<Value> = (0..cli.levels.len())
        .map(|i| {
            let mut level = json!({"multiple": cli.levels[i]});
            for field in fields {
                level[field] = json!(median(runs.iter().map(|r| r["levels"][i][field].as_f64().unwrap_or(f64::NAN)).collect()));
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
        "capacity_tokens_per_s": capacity, "median": medians, "runs": runs,
    });
    let results = workspace.join("bench/results");
    std::fs::write(results.join("overload.json"), serde_json::to_string_pretty(&result)? + "\n")?;
    let mut md = String::from("| offered | goodput (tokens/s) | / capacity | p50 (ms) | p99 (ms) | 429 share | client time-outs | server / worker peak RSS (MiB) |\n|---|---:|---:|---:|---:|---:|---:|---|\n");
    for level in &medians {
        let f = |k: &str| level[k].as_f64().unwrap_or(f64::NAN);
        md += &format!(
            "| {}x | {:.0} | {:.2} | {:.0} | {:.0} | {:.1}% | {:.0} | {:.0} / {:.0} |\n",
            f("multiple"), f("goodput_tokens_per_s"), f("goodput_of_capacity"), f("p50_ms"), f("p99_ms"), 100.0 * f("share_429"), f("client_timeouts"), f("server_peak_rss_mib"), f("worker_peak_rss_mib")
        );
    }
    println!("median of {} runs, capacity {capacity:.0} tokens/s:\n{md}", cli.runs);
    std::fs::write(std::env::temp_dir().join("overload-table.md"), md)?;
    Ok(())
}
