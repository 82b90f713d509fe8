//! One replica's engine in its own process, confined to one slice (see `binding`).
//!
//! The worker re-executes itself as `tessera-worker engine …` with the slice's
//! environment (`CUDA_VISIBLE_DEVICES`) and the engine token in `TESSERA_ENGINE_TOKEN`.
//! The child loads and warms the model, serves it on its own endpoint (a free port on the
//! worker's listen host, same routes and token as the worker's), and prints one
//! `TESSERA_ENGINE_READY {json}` line with its URL. It serves as long as its stdin is
//! open: the serve job holds the pipe, so an aborted job, a stopped or crashed worker all
//! end the engine too, once it has answered the requests it admitted (a scale-down or a
//! reclaim loses no request in flight). The child's other output goes to the worker's log.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tessera_api::deployments::BatchLimits;
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader, Lines};
use tokio::process::{Child, ChildStdin, Command};
use uuid::Uuid;

use super::batcher::Admission;
use super::binding::CpuPrecision;
use super::endpoint::Endpoint;
use super::{load_replica, LoadReport};
use crate::engine::{EngineError, LoadOptions};

/// The line prefix the engine process announces itself with.
const READY: &str = "TESSERA_ENGINE_READY ";
/// The environment variable the engine token is passed in (never on the command line).
pub const TOKEN_ENV: &str = "TESSERA_ENGINE_TOKEN";
/// Lines of the child's output kept for the error message when it dies.
const LAST_WORDS: usize = 8;

/// `tessera-worker engine`: serve one replica in this process.
#[derive(Debug, Clone, clap::Args)]
pub struct EngineArgs {
    /// The model folder.
    #[arg(long)]
    pub model: PathBuf,
    /// The model's registry id (reported by `/info`).
    #[arg(long)]
    pub model_id: Uuid,
    /// The replica (serve job) id: the engine answers at `/replicas/{id}/…`.
    #[arg(long)]
    pub replica: Uuid,
    /// `--max-batch-tokens`, `--max-batch-requests`: the deployment's batching.
    #[command(flatten)]
    pub limits: BatchLimits,
    /// `--max-queue-wait-ms`, `--max-request-inputs`, `--max-request-tokens`: the worker's.
    #[command(flatten)]
    pub admission: Admission,
    /// Compute on CUDA device 0 (the slice `CUDA_VISIBLE_DEVICES` names) in f16; the CPU
    /// otherwise.
    #[arg(long)]
    pub gpu: bool,
    /// The CPU engine's GEMM inputs (the worker's `--cpu-precision`).
    #[arg(long, value_enum, default_value_t = CpuPrecision::Auto)]
    pub cpu_precision: CpuPrecision,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: String,
}

/// What the serve job starts an engine process with.
pub struct Spawn {
    pub folder: PathBuf,
    pub model_id: Uuid,
    pub replica: Uuid,
    pub limits: BatchLimits,
    pub admission: Admission,
    pub gpu: bool,
    pub cpu_precision: CpuPrecision,
    pub env: Vec<(String, String)>,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Ready {
    url: String,
    report: LoadReport,
}

/// Why an engine process could not start or stopped serving: the child's own failures
/// (it prints them and exits) and, on the worker's side, how the child ended.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error("{TOKEN_ENV} is not set")]
    NoToken,
    #[error("this tessera-worker was built without the cuda feature; it cannot serve on a GPU")]
    NoCuda,
    #[error(transparent)]
    Device(#[from] candle_core::Error),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("the engine process announced itself oddly: {0}")]
    Announcement(serde_json::Error),
    #[error("the engine process exited ({status}) before serving; {last_words}")]
    ExitedBeforeServing { status: ExitStatus, last_words: String },
    #[error("the engine process exited ({status}); {last_words}")]
    Exited { status: ExitStatus, last_words: String },
    #[error("{0}")]
    Broken(String),
}

fn load_options(gpu: bool, cpu_precision: CpuPrecision) -> Result<LoadOptions, ProcessError> {
    if !gpu {
        return Ok(LoadOptions { dtype: cpu_precision.dtype(), ..LoadOptions::default() });
    }
    #[cfg(feature = "cuda")]
    {
        let device = candle_core::Device::new_cuda(0)?;
        Ok(LoadOptions { device: Some(device), dtype: Some(candle_core::DType::F16), ..LoadOptions::default() })
    }
    #[cfg(not(feature = "cuda"))]
    Err(ProcessError::NoCuda)
}

/// The child's side: load, announce, serve until stdin closes.
pub async fn run_engine(args: EngineArgs) -> Result<(), ProcessError> {
    let token = std::env::var(TOKEN_ENV).map_err(|_| ProcessError::NoToken)?;
    let options = load_options(args.gpu, args.cpu_precision)?;
    let endpoint = Endpoint::start(&args.listen, None).await?;
    endpoint.set_token(token);
    let (replica, report) = load_replica(args.model, options, args.model_id, args.limits, args.admission).await?;
    let health = replica.queue.health();
    let registration = endpoint.add(args.replica, replica);
    let ready = Ready { url: endpoint.replica_url(args.replica), report };
    println!("{READY}{}", serde_json::to_string(&ready).expect("the announcement serialises"));
    // Serve until the worker closes the pipe (or dies), then answer what was admitted.
    let mut stdin = BufReader::new(tokio::io::stdin()).lines();
    let closed = async {
        while stdin.next_line().await?.is_some() {}
        Ok::<_, std::io::Error>(())
    };
    tokio::select! {
        closed = closed => closed?,
        why = health.broken() => return Err(ProcessError::Broken(why)),
    }
    let drain = drain_time(args.admission);
    tracing::info!(replica = %args.replica, "the worker closed the engine's stdin; answering what it admitted");
    if registration.drain(drain).await {
        // A handler lets go of the replica just before its answer is written out.
        tokio::time::sleep(Duration::from_millis(250)).await;
    } else {
        let waited = drain.as_secs();
        tracing::warn!(replica = %args.replica, "requests were still running {waited} s after the stop; stopping anyway");
    }
    Ok(())
}

/// How long a stopping engine may take to answer the requests it admitted: one may wait
/// its whole queue-time limit, then be computed (a batch takes well under 10 s); five
/// minutes at most, whatever the limit.
pub fn drain_time(admission: Admission) -> Duration {
    (admission.max_queue_wait() + Duration::from_secs(10)).min(Duration::from_secs(300))
}

/// The worker's side: a running engine process. Dropped (the serve job ended or was
/// aborted), it closes the engine's stdin, which stops the engine taking requests; the
/// engine answers those it admitted and exits, and is killed if it has not within its
/// drain time and a little more. One still starting is killed at once.
pub struct EngineProcess {
    child: Option<Child>,
    /// Held open: closing it tells the engine to stop.
    stdin: Option<ChildStdin>,
    /// How long the engine may take to stop once told.
    drain: Duration,
    /// Taken when it is told to stop, held until it has exited: its slice is busy till then.
    endpoint: Arc<Endpoint>,
    pub pid: u32,
    pub url: String,
    pub report: LoadReport,
    last: Arc<Mutex<VecDeque<String>>>,
}

impl Drop for EngineProcess {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let Some(mut child) = self.child.take() else { return };
        let grace = self.drain + Duration::from_secs(5);
        let pid = self.pid;
        let stopping = self.endpoint.stopping();
        // Outside a runtime (or when it shuts down) the child is dropped, which kills it.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if tokio::time::timeout(grace, child.wait()).await.is_err() {
                    tracing::warn!(pid, "the engine process did not stop in time; killing it");
                    let _ = child.kill().await;
                }
                drop(stopping);
            });
        }
    }
}

impl EngineProcess {
    /// Starts the engine process and waits until it serves (or fails to start).
    pub async fn start(endpoint: &Arc<Endpoint>, spawn: Spawn) -> Result<EngineProcess, ProcessError> {
        let exe = std::env::current_exe()?;
        let mut child = Command::new(exe)
            .arg("engine")
            .arg("--model")
            .arg(&spawn.folder)
            .args(["--model-id", &spawn.model_id.to_string(), "--replica", &spawn.replica.to_string()])
            .args(["--max-batch-tokens", &spawn.limits.max_batch_tokens.to_string()])
            .args(["--max-batch-requests", &spawn.limits.max_batch_requests.to_string()])
            .args(["--max-queue-wait-ms", &spawn.admission.max_queue_wait_ms.to_string()])
            .args(["--max-request-inputs", &spawn.admission.max_request_inputs.to_string()])
            .args(["--max-request-tokens", &spawn.admission.max_request_tokens.to_string()])
            .args(["--listen", &format!("{}:0", listen_host(&endpoint.url))])
            .args(spawn.gpu.then_some("--gpu"))
            .args(["--cpu-precision", spawn.cpu_precision.arg()])
            .envs(spawn.env)
            .env(TOKEN_ENV, endpoint.token())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let pid = child.id().unwrap_or_default();
        let stdin = child.stdin.take().expect("piped stdin");
        let mut stdout = BufReader::new(child.stdout.take().expect("piped stdout")).lines();
        let last = Arc::new(Mutex::new(VecDeque::new()));
        tokio::spawn(forward(BufReader::new(child.stderr.take().expect("piped stderr")).lines(), spawn.replica, last.clone()));

        let ready = loop {
            match stdout.next_line().await? {
                Some(line) => match line.strip_prefix(READY) {
                    Some(json) => {
                        break serde_json::from_str::<Ready>(json).map_err(ProcessError::Announcement)?
                    }
                    None => keep(&last, spawn.replica, line),
                },
                None => {
                    let status = child.wait().await?;
                    return Err(ProcessError::ExitedBeforeServing { status, last_words: last_words(&last) });
                }
            }
        };
        // Keep draining its output, or a full pipe would stall it.
        tokio::spawn(forward(stdout, spawn.replica, last.clone()));
        Ok(EngineProcess {
            child: Some(child),
            stdin: Some(stdin),
            drain: drain_time(spawn.admission),
            endpoint: endpoint.clone(),
            pid,
            url: ready.url,
            report: ready.report,
            last,
        })
    }

    /// Waits until the engine process exits on its own, which ends the replica: the error
    /// says how, with its last lines of output.
    pub async fn wait(&mut self) -> ProcessError {
        let child = self.child.as_mut().expect("a running engine process has its child");
        match child.wait().await {
            Ok(status) => ProcessError::Exited { status, last_words: last_words(&self.last) },
            Err(e) => e.into(),
        }
    }
}

/// The host part of the worker's endpoint URL (`http://HOST:PORT`): engine processes
/// listen on the same host, each on a free port.
fn listen_host(url: &str) -> &str {
    let authority = url.split("://").nth(1).unwrap_or(url);
    authority.rsplit_once(':').map_or(authority, |(host, _)| host)
}

fn keep(last: &Mutex<VecDeque<String>>, replica: Uuid, line: String) {
    tracing::info!(%replica, "engine: {line}");
    let mut last = last.lock().expect("engine output lock");
    if last.len() == LAST_WORDS {
        last.pop_front();
    }
    last.push_back(line);
}

async fn forward<R: AsyncRead + Unpin>(mut lines: Lines<BufReader<R>>, replica: Uuid, last: Arc<Mutex<VecDeque<String>>>) {
    while let Ok(Some(line)) = lines.next_line().await {
        keep(&last, replica, line);
    }
}

fn last_words(last: &Mutex<VecDeque<String>>) -> String {
    let last = last.lock().expect("engine output lock");
    if last.is_empty() {
        "it printed nothing".into()
    } else {
        format!("its last output: {}", last.iter().cloned().collect::<Vec<_>>().join(" | "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_processes_listen_on_the_worker_s_host() {
        assert_eq!(listen_host("http://127.0.0.1:40123"), "127.0.0.1");
        assert_eq!(listen_host("http://worker-3:9000"), "worker-3");
        assert_eq!(listen_host("http://[::1]:9000"), "[::1]");
    }
}
