//! The server's capacity-loaning round at 1,000 training gangs and 500 MIG slices
//! (issue 16), timed as the server runs it: `loaning::run_round` against a real database,
//! its reads, the plan and its writes together. The simulator (`aryl`) times the pure
//! planning functions only; this is the rest of what a round costs.
//!
//! Each run builds a fleet in a fresh database through the server's own HTTP API, the way
//! workers and users build it: 72 workers offering 500 simulated 1g.10gb slices of H100s
//! (seven per GPU), the MiniLM model measured at 100 req/s per slice, 10 loanable
//! deployments of 25 replicas each (250 slices), and 1,000 data-parallel jobs. With no
//! traffic, two rounds lend all but one slice of each deployment and place the gangs that
//! fit; every placed rank is claimed, its gang forms, and each rank reports 50 step timings
//! (the round's step-time window). Then two deployments' demand returns (2,000 req/s, a
//! spike that needs 24 of their slices back) and the measured round runs: reclaims, shrinks
//! and preemptions, the waiting gangs' order and placement. The next rounds (no change in
//! the fleet) are timed too, as the steady cost of a round.
//!
//! The job mix follows the simulator's trace (GPUs per job 1/2/4/8/16 at 62/10/13/12/3 %,
//! half elastic with min = request/2 and max = 4 × request up to 32, every elastic job
//! and 60 % of the others preemptible); a one-GPU job is a gang of one rank.
//!
//!   loaning_round [--runs 3] [--postgres URL] [--assets DIR]
//!
//! SQLite always; PostgreSQL too with `--postgres` or `TESSERA_TEST_POSTGRES_URL` (a fresh
//! database per run is created in that cluster). Writes `bench/results/loaning_round.{json,md}`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use tessera_api::loaning::LoanState;
use tessera_bench::stats::median;
use tessera_server::app::router;
use tessera_server::config::Config;
use tessera_server::loaning::{run_round, RoundReport};
use tessera_server::state::AppState;
use tessera_server::store::loaning as loan_store;
use uuid::Uuid;

const PROFILE: &str = "1g.10gb";
const SLICES: usize = 500;
const SLICES_PER_GPU: usize = 7;
const DEPLOYMENTS: usize = 10;
const REPLICAS: usize = 25;
const JOBS: usize = 1000;
/// Step timings each formed rank reports: the round's window per rank count.
const STEPS: u64 = 50;
/// Deployments whose demand returns before the measured round, and their rate: 2,000 req/s
/// at 100 req/s a slice with 20 % headroom needs 24 slices.
const SPIKED: usize = 2;
const SPIKE_RATE: f64 = 2000.0;
/// Rounds timed after the measured one.
const STEADY_ROUNDS: usize = 5;
const ADMIN_PASSWORD: &str = "loaning-round-bench-admin";
const WORKER_TOKEN: &str = "loaning-round-bench-worker-token-32-bytes";

#[derive(Parser)]
struct Cli {
    /// Runs per database (each builds its fleet afresh); the figures are their medians.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// A PostgreSQL cluster to run against too (a fresh database per run).
    #[arg(long, env = "TESSERA_TEST_POSTGRES_URL")]
    postgres: Option<String>,
    /// Where all-MiniLM-L6-v2 is (default: TESSERA_ASSETS or <repo>/.assets).
    #[arg(long)]
    assets: Option<PathBuf>,
}

/// The server in this process, on a loopback port.
struct Server {
    state: AppState,
    url: String,
    http: reqwest::Client,
    _dir: tempfile::TempDir,
}

impl Server {
    async fn start(database_url: Option<String>) -> Result<Server> {
        let dir = tempfile::tempdir()?;
        let mut config = Config::with_data_dir(dir.path().to_path_buf());
        config.database_url = database_url;
        config.admin_password = Some(ADMIN_PASSWORD.into());
        config.worker_token = Some(WORKER_TOKEN.into());
        // Nothing may go offline or expire while the fleet is built (about half a minute).
        config.heartbeat_secs = 3600;
        config.lease_ttl_secs = 3600;
        config.gang_rendezvous_secs = 3600;
        let state = AppState::open(config).await?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}/api/v1", listener.local_addr()?);
        let app = router(state.clone()).into_make_service_with_connect_info::<SocketAddr>();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Server { state, url, http: reqwest::Client::new(), _dir: dir })
    }

    /// POSTs `body` with `token`; the reply's JSON (`null` for an empty one). Anything but
    /// a 2xx is an error naming the call.
    async fn post(&self, token: &str, path: &str, body: Value) -> Result<Value> {
        let response = self.http.post(format!("{}{path}", self.url)).bearer_auth(token).json(&body).send().await?;
        reply(path, response).await
    }
}

async fn reply(path: &str, response: reqwest::Response) -> Result<Value> {
    let status = response.status();
    let text = response.text().await?;
    if !status.is_success() {
        bail!("{path}: {status}: {text}");
    }
    Ok(if text.is_empty() { Value::Null } else { serde_json::from_str(&text)? })
}

/// A registered worker: the secret it calls the agent API with.
struct Worker {
    secret: String,
}

/// The fleet of one run, built and ready for the measured round.
struct Fleet {
    server: Server,
    /// Gangs placed and formed before the measured round, and the ranks they hold.
    formed_gangs: usize,
    formed_ranks: usize,
    setup_secs: f64,
}

async fn build_fleet(database_url: Option<String>, model_dir: &Path) -> Result<Fleet> {
    let started = Instant::now();
    let server = Server::start(database_url).await?;
    let admin = server.post("", "/auth/login", json!({"username": "admin", "password": ADMIN_PASSWORD})).await?["token"]
        .as_str()
        .context("login gives a token")?
        .to_string();
    upload_model(&server, &admin, model_dir).await?;

    let mut workers = Vec::new();
    for w in 0..SLICES.div_ceil(SLICES_PER_GPU) {
        let n = SLICES_PER_GPU.min(SLICES - w * SLICES_PER_GPU);
        let slices: Vec<Value> = (0..n)
            .map(|i| {
                json!({"uuid": format!("MIG-bench-{w}-{i}"), "gpu_uuid": format!("GPU-bench-{w}"), "gpu_index": 0,
                       "gpu_model": "H100-80GB", "profile": PROFILE, "start": null, "memory_bytes": 10u64 << 30, "simulated": true})
            })
            .collect();
        let name = format!("gpu-{w}");
        let inventory = json!({"hostname": name, "cpu_cores": 16, "memory_bytes": 128u64 << 30, "slices": slices});
        let body = json!({"name": name, "version": "bench", "inventory": inventory, "allow_repartition": false});
        let registered = server.post(WORKER_TOKEN, "/agent/register", body).await?;
        workers.push(Worker { secret: registered["secret"].as_str().context("a worker secret")?.to_string() });
    }

    // The model's throughput table on the slice kind, as a profile job reports it.
    server.post(&admin, "/models/minilm/profiles", json!({})).await?;
    let job = claim(&server, &workers[0], "profile").await?.context("the profile job")?;
    let id = job["job_id"].as_str().context("a job id")?;
    let table = json!([{"gpu_model": "H100-80GB", "profile": PROFILE, "simulated": true,
        "points": [{"batch_size": 16, "throughput": 100.0, "p99_ms": 30.0}]}]);
    server.post(&workers[0].secret, &format!("/agent/jobs/{id}/profiles"), table).await?;
    server.post(&workers[0].secret, &format!("/agent/jobs/{id}/status"), json!({"state": "succeeded"})).await?;

    let mut deployments = Vec::new();
    for d in 0..DEPLOYMENTS {
        let body = json!({"name": format!("embed-{d}"), "model": "minilm", "replicas": REPLICAS, "loanable": true, "reclaim_headroom": 0.2});
        let created = server.post(&admin, "/deployments", body).await?;
        deployments.push(created["id"].as_str().context("a deployment id")?.parse()?);
    }
    for worker in &workers {
        while let Some(replica) = claim(&server, worker, "serve").await? {
            let id = replica["job_id"].as_str().context("a replica id")?;
            let body = json!({"state": "running", "endpoint": "http://127.0.0.1:9/"});
            server.post(&worker.secret, &format!("/agent/jobs/{id}/status"), body).await?;
        }
    }

    let dataset = upload_dataset(&server, &admin).await?;
    let mut rng = StdRng::seed_from_u64(16);
    for j in 0..JOBS {
        server.post(&admin, "/jobs", job_spec(&mut rng, j, &dataset)).await?;
    }

    // No traffic: the first round is calm, the second lends and places what fits.
    for _ in 0..2 {
        run_round(&server.state).await?;
    }
    let (formed_gangs, formed_ranks) = form_placed_gangs(&server, &workers).await?;

    // Two deployments' demand returns.
    let rates: Vec<(Uuid, f64)> = deployments[..SPIKED].iter().map(|&d| (d, SPIKE_RATE)).collect();
    loan_store::record_rates(&server.state.db, Uuid::new_v4(), &rates).await?;
    Ok(Fleet { server, formed_gangs, formed_ranks, setup_secs: started.elapsed().as_secs_f64() })
}

async fn claim(server: &Server, worker: &Worker, kind: &str) -> Result<Option<Value>> {
    let claimed = server.post(&worker.secret, "/agent/claim", json!({"kinds": [kind]})).await?;
    Ok(Some(claimed).filter(|c| !c.is_null()))
}

/// The model files a worker serves from (the registry checks them).
async fn upload_model(server: &Server, token: &str, dir: &Path) -> Result<()> {
    let mut form = reqwest::multipart::Form::new().text("name", "minilm");
    for file in ["config.json", "model.safetensors", "tokenizer.json", "1_Pooling/config.json"] {
        let bytes = std::fs::read(dir.join(file)).with_context(|| format!("{} (scripts/fetch-assets.sh)", dir.join(file).display()))?;
        form = form.part("files", reqwest::multipart::Part::bytes(bytes).file_name(file));
    }
    let response = server.http.post(format!("{}/models", server.url)).bearer_auth(token).multipart(form).send().await?;
    reply("/models", response).await.map(drop)
}

async fn upload_dataset(server: &Server, token: &str) -> Result<String> {
    let mut csv = String::from("f0,f1,label\n");
    for i in 0..64 {
        csv.push_str(&format!("{},{},{}\n", i % 7, i % 5, i % 2));
    }
    let form = reqwest::multipart::Form::new()
        .text("name", "toy")
        .part("file", reqwest::multipart::Part::bytes(csv.into_bytes()).file_name("toy.csv"));
    let response = server.http.post(format!("{}/datasets", server.url)).bearer_auth(token).multipart(form).send().await?;
    Ok(reply("/datasets", response).await?["id"].as_str().context("a dataset id")?.to_string())
}

/// Job `j` of the mix (module doc).
fn job_spec(rng: &mut StdRng, j: usize, dataset: &str) -> Value {
    let draw: f64 = rng.gen();
    let request = match draw {
        d if d < 0.62 => 1,
        d if d < 0.72 => 2,
        d if d < 0.85 => 4,
        d if d < 0.97 => 8,
        _ => 16,
    };
    let elastic = rng.gen_bool(0.5);
    let (min, max, preemptible) = if elastic {
        ((request / 2).max(1), (4 * request).min(32), true)
    } else {
        (request, request, rng.gen_bool(0.6))
    };
    // Log-uniform from 100 to 100,000 steps: the order the queue is sorted in.
    let max_steps = 10f64.powf(rng.gen_range(2.0..5.0)).round() as u64;
    json!({"name": format!("job-{j}"), "model": {"kind": "mlp", "hidden": [8]}, "dataset": dataset,
        "task": {"type": "classification", "label_column": "label", "validation_split": 0.25},
        "optimizer": {"type": "sgd"}, "batch_size": 64, "max_steps": max_steps, "eval_every": 1000,
        "checkpoint_every": 500, "lr_schedule": {"type": "constant", "lr": 0.1}, "seed": 1,
        "parallel": {"ranks": vec![json!({"slice": PROFILE}); max as usize]},
        "resources": {"min_ranks": min, "max_ranks": max, "preemptible": preemptible}})
}

/// Every worker claims the ranks the rounds pinned to its slices; each gang forms (every
/// rank posts its ring address, then again to learn the gang formed) and its ranks report
/// `STEPS` step timings each. Returns the gangs and ranks formed.
async fn form_placed_gangs(server: &Server, workers: &[Worker]) -> Result<(usize, usize)> {
    // gang → (rank, rank job id, the worker's secret)
    let mut gangs: HashMap<String, Vec<(u64, String, String)>> = HashMap::new();
    for worker in workers {
        while let Some(rank) = claim(server, worker, "train_rank").await? {
            let spec = &rank["spec"];
            gangs.entry(spec["gang"].as_str().context("a gang id")?.to_string()).or_default().push((
                spec["rank"].as_u64().context("a rank")?,
                rank["job_id"].as_str().context("a rank job id")?.to_string(),
                worker.secret.clone(),
            ));
        }
    }
    let mut ranks = 0;
    for members in gangs.values_mut() {
        members.sort();
        for _ in 0..2 {
            for (rank, id, secret) in members.iter() {
                let body = json!({"address": format!("127.0.0.1:{}", 20000 + rank)});
                server.post(secret, &format!("/agent/jobs/{id}/rendezvous"), body).await?;
            }
        }
        // Faster at more ranks, as a data-parallel job is; each rank reports its own steps.
        let iter_ms = 1000.0 * (0.1 + 0.9 / members.len() as f64);
        for (rank, id, secret) in members.iter() {
            let timings: Vec<Value> = (1..=STEPS)
                .map(|step| json!({"rank": rank, "step": step, "iter_ms": iter_ms, "wait_ms": 0.0, "allreduce_ms": 1.0}))
                .collect();
            server.post(secret, &format!("/agent/jobs/{id}/training-metrics"), json!({"ranks": timings})).await?;
        }
        ranks += members.len();
    }
    Ok((gangs.len(), ranks))
}

/// One run's figures.
struct Run {
    setup_secs: f64,
    formed_gangs: usize,
    formed_ranks: usize,
    measured_ms: f64,
    measured: RoundReport,
    steady_ms: Vec<f64>,
    lent_after: usize,
}

async fn one_run(database_url: Option<String>, model_dir: &Path) -> Result<Run> {
    let fleet = build_fleet(database_url, model_dir).await?;
    let state = &fleet.server.state;
    let start = Instant::now();
    let measured = run_round(state).await?;
    let measured_ms = start.elapsed().as_secs_f64() * 1000.0;
    let mut steady_ms = Vec::new();
    for _ in 0..STEADY_ROUNDS {
        let start = Instant::now();
        run_round(state).await?;
        steady_ms.push(start.elapsed().as_secs_f64() * 1000.0);
    }
    let overview = loan_store::fleet(&state.db, 0).await?;
    let lent_after = overview.iter().filter(|s| s.loan_state == LoanState::Loaned).count();
    Ok(Run {
        setup_secs: fleet.setup_secs,
        formed_gangs: fleet.formed_gangs,
        formed_ranks: fleet.formed_ranks,
        measured_ms,
        measured,
        steady_ms,
        lent_after,
    })
}

/// A fresh database in the PostgreSQL cluster at `base`.
async fn fresh_postgres(base: &str) -> Result<String> {
    use sqlx::Connection;
    let name = format!("bench_{}", Uuid::new_v4().simple());
    let mut admin = sqlx::PgConnection::connect(base).await?;
    sqlx::Executor::execute(&mut admin, sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}"))).await?;
    let (prefix, _) = base.rsplit_once('/').context("the PostgreSQL URL names a database")?;
    Ok(format!("{prefix}/{name}"))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    let model_dir = tessera_bench::datasets::assets_dir(cli.assets.clone()).join("all-MiniLM-L6-v2");
    let mut backends: Vec<(&str, Option<&str>)> = vec![("SQLite", None)];
    if let Some(url) = cli.postgres.as_deref() {
        backends.push(("PostgreSQL 15", Some(url)));
    }
    let mut sections = Vec::new();
    let mut json_runs = serde_json::Map::new();
    for (name, base) in backends {
        let mut runs = Vec::new();
        for i in 0..cli.runs {
            let url = match base {
                Some(base) => Some(fresh_postgres(base).await?),
                None => None,
            };
            let run = one_run(url, &model_dir).await?;
            println!(
                "{name} run {}: fleet built in {:.0} s ({} gangs formed on {} slices); measured round {:.1} ms ({:?}); steady rounds {:?} ms",
                i + 1,
                run.setup_secs,
                run.formed_gangs,
                run.formed_ranks,
                run.measured_ms,
                run.measured,
                run.steady_ms.iter().map(|m| format!("{m:.1}")).collect::<Vec<_>>()
            );
            runs.push(run);
        }
        let measured: Vec<f64> = runs.iter().map(|r| r.measured_ms).collect();
        let steady: Vec<f64> = runs.iter().map(|r| median(&r.steady_ms)).collect();
        println!("{name}: measured round {:.1} ms, steady round {:.1} ms (medians of {} runs)", median(&measured), median(&steady), runs.len());
        sections.push(section(name, &runs));
        json_runs.insert(
            name.into(),
            json!(runs.iter().map(|r| json!({
                "setup_secs": r.setup_secs, "formed_gangs": r.formed_gangs, "formed_ranks": r.formed_ranks,
                "measured_round_ms": r.measured_ms, "steady_round_ms": r.steady_ms, "lent_after": r.lent_after,
                "report": format!("{:?}", r.measured),
            })).collect::<Vec<_>>()),
        );
    }
    write_results(&sections, Value::Object(json_runs))
}

fn section(name: &str, runs: &[Run]) -> String {
    let measured: Vec<f64> = runs.iter().map(|r| r.measured_ms).collect();
    let steady: Vec<f64> = runs.iter().map(|r| median(&r.steady_ms)).collect();
    let mut out = format!(
        "## {name}\n\n**Measured round: {:.1} ms; steady round: {:.1} ms** (medians of {} runs; a steady run's figure is its own median of {STEADY_ROUNDS} rounds).\n\n\
         | run | fleet built | gangs formed (ranks) | measured round | what it did | steady rounds | slices lent after |\n|---|---|---|---|---|---|---|\n",
        median(&measured),
        median(&steady),
        runs.len()
    );
    for (i, r) in runs.iter().enumerate() {
        let m = &r.measured;
        out.push_str(&format!(
            "| {} | {:.0} s | {} ({}) | {:.1} ms | lent {}, reclaiming {}, returned {}, started {}, preempted {}, resized {} | {} ms | {} |\n",
            i + 1,
            r.setup_secs,
            r.formed_gangs,
            r.formed_ranks,
            r.measured_ms,
            m.lent,
            m.reclaiming,
            m.returned,
            m.started,
            m.preempted,
            m.resized,
            r.steady_ms.iter().map(|v| format!("{v:.1}")).collect::<Vec<_>>().join(", "),
            r.lent_after
        ));
    }
    out
}

fn write_results(sections: &[String], runs: Value) -> Result<()> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("results");
    let args: Vec<String> = std::env::args().skip(1).collect();
    let header = format!(
        "# The server's loaning round against its database (issue 16)\n\n\
         Written by `loaning_round` (`bench/src/bin/loaning_round.rs`; its module doc describes the fleet). \
         Machine: {}. Date: {}. Command: `loaning_round {}` (release build).\n\n\
         Each run builds, through the server's HTTP API in a fresh database, 500 simulated 1g.10gb slices on 72 workers, \
         10 loanable deployments of 25 replicas (250 slices; with no traffic each lends 24), and {JOBS} data-parallel jobs; \
         the gangs that fit are placed, claimed, formed, and report {STEPS} step timings per rank. Then {SPIKED} deployments' \
         demand returns ({SPIKE_RATE} req/s each) and the *measured round* runs: `loaning::run_round` as the server's timer \
         calls it, every database read and write included. The *steady rounds* follow with nothing changed in the fleet.\n",
        tessera_bench::machine(),
        chrono::Utc::now().to_rfc3339(),
        args.join(" ")
    );
    std::fs::write(dir.join("loaning_round.md"), format!("{header}\n{}", sections.join("\n")))?;
    std::fs::write(dir.join("loaning_round.json"), serde_json::to_string_pretty(&runs)?)?;
    Ok(())
}
