//! The agent loop: register, then heartbeat and claim until the server forgets us (then
//! register again). Jobs run as tasks; a heartbeat answer that says a job's lease is
//! gone (cancelled, expired) aborts that task, one that says to preempt a job sets its
//! preemption flag (a training job then checkpoints and stops on its own).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tessera_api::workers::{Inventory, RegisterRequest};
use tokio::task::JoinSet;
use uuid::Uuid;

use crate::cache::{self, Cache};
use crate::client::{Client, ClientError};
use crate::jobs::{self, JobContext, Preempt};
use crate::serve::binding::Policy;
use crate::serve::endpoint::Endpoint;

pub struct AgentConfig {
    pub server: String,
    pub worker_token: String,
    pub name: String,
    pub data_dir: PathBuf,
    /// Batch jobs (prefetch, …) run at once.
    pub slots: usize,
    /// Serving replicas hosted at once: one engine per device slice. The CPU path has
    /// one slice, the host's thread pool.
    pub replica_slots: usize,
    pub inventory: Inventory,
    /// Let the server change this worker's MIG partitions (`--allow-repartition`).
    pub allow_repartition: bool,
    pub endpoint: Arc<Endpoint>,
    /// How replicas bound to slices run (`serve::binding`).
    pub binding: Policy,
    /// Test-only: data-parallel ranks compute this many times slower (`--test-slowdown`).
    pub test_slowdown: Option<f64>,
}

/// Jobs by how they use the host: a replica holds a device slice until it is stopped,
/// a batch job holds a slot until it ends, a rank pinned to a slice holds only that slice
/// (so a worker of one batch slot can still host every rank the round pins to its slices).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Use {
    Replica,
    Batch,
    SliceRank,
}

/// A job task the agent runs: how it uses the host, its handle, its preemption flag.
struct Running {
    usage: Use,
    task: tokio::task::AbortHandle,
    preempt: Arc<Preempt>,
}

pub struct Agent {
    config: AgentConfig,
    client: Client,
    /// The models and datasets its jobs use, which the cache keeps (`crate::cache`).
    cache: Arc<Cache>,
}

/// The server refused this worker's registration for good (a wrong token or configuration).
#[derive(Debug, thiserror::Error)]
#[error("the server refused to register this worker: {0}")]
pub struct Refused(ClientError);

/// How often to ask for work while idle.
const CLAIM_POLL: Duration = Duration::from_millis(500);

impl Agent {
    pub fn new(config: AgentConfig) -> Result<Agent, ClientError> {
        let client = Client::new(&config.server)?;
        Ok(Agent { config, client, cache: Arc::default() })
    }

    /// Runs until the process stops: registers, then works until the server forgets this
    /// worker, then registers again. Returns only when the server refuses the registration
    /// for good ([`ClientError::refuses_registration`]): the worker's configuration must change.
    pub async fn run(mut self) -> Refused {
        // What an earlier process left half-downloaded, in any cached model's or dataset's folder.
        for kind in [cache::MODELS, cache::DATASETS] {
            crate::client::remove_stale_partials(&self.config.data_dir.join(kind));
        }
        loop {
            let heartbeat = match self.register().await {
                Ok(heartbeat) => heartbeat,
                Err(refused) => return refused,
            };
            self.work(heartbeat).await;
            tracing::warn!("the server no longer knows this worker; registering again");
        }
    }

    /// Where the secret of the last registration is kept, so a restarted worker proves it
    /// is the same one and takes its name back at once (the server refuses a live name to
    /// anyone else).
    fn secret_file(&self) -> PathBuf {
        self.config.data_dir.join("worker-secret")
    }

    fn previous_secret(&self) -> Option<String> {
        let in_memory = self.client.secret();
        if !in_memory.is_empty() {
            return Some(in_memory.to_string());
        }
        std::fs::read_to_string(self.secret_file()).ok().map(|s| s.trim().to_string()).filter(|s| !s.is_empty())
    }

    fn keep_secret(&self, secret: &str) {
        let path = self.secret_file();
        let written = std::fs::create_dir_all(&self.config.data_dir).and_then(|_| write_private(&path, secret));
        if let Err(error) = written {
            let why = "could not keep the worker secret; a restart waits for the old registration to go quiet";
            tracing::warn!(%error, path = %path.display(), "{why}");
        }
    }

    /// Registers, retrying with backoff until the server accepts or refuses for good (a
    /// server away or a name still another's is tried again). Returns the heartbeat
    /// interval the server asks for.
    async fn register(&mut self) -> Result<Duration, Refused> {
        let request = RegisterRequest {
            name: self.config.name.clone(),
            version: env!("CARGO_PKG_VERSION").into(),
            inventory: self.config.inventory.clone(),
            allow_repartition: self.config.allow_repartition,
            previous_secret: self.previous_secret(),
        };
        let mut backoff = Duration::from_millis(250);
        loop {
            match self.client.register(&self.config.worker_token, &request).await {
                Ok(registered) => {
                    tracing::info!(worker = %registered.worker_id, server = %self.config.server, "registered");
                    self.keep_secret(&registered.secret);
                    self.config.endpoint.set_token(registered.engine_token);
                    return Ok(Duration::from_secs(registered.heartbeat_interval_secs.max(1)));
                }
                Err(e) if e.refuses_registration() => return Err(Refused(e)),
                Err(e) => {
                    tracing::warn!(error = %e, "registration failed; retrying in {:?}", backoff);
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(10));
                }
            }
        }
    }

    /// The job kinds there is room for now: none on a worker with slices while an engine
    /// process it stopped still answers what it admitted (its slice holds its memory).
    fn claimable(&self, running: &HashMap<Uuid, Running>) -> Vec<&'static str> {
        let used = |u: Use| running.values().filter(|job| job.usage == u).count();
        let has_slices = !self.config.inventory.slices.is_empty();
        if has_slices && self.config.endpoint.any_stopping() {
            return Vec::new();
        }
        claimable_kinds(used(Use::Batch) < self.config.slots, used(Use::Replica) < self.config.replica_slots, has_slices)
    }

    /// Heartbeats, claims and runs jobs until the server answers 401 (it forgot this
    /// worker). A server that cannot be reached, times out or sheds load costs nothing: the
    /// jobs keep running (their own calls retry), the next heartbeat tries again, and claims
    /// back off. Leases outlive an outage shorter than their TTL; after a longer one the
    /// heartbeat's answer stops the jobs the server requeued. Returning drops `tasks`,
    /// which aborts every job: a worker registering again holds nothing (the server
    /// requeues what its previous registration held).
    async fn work(&self, heartbeat_every: Duration) {
        let offered = Arc::new(self.config.inventory.slices.clone());
        let mut running: HashMap<Uuid, Running> = HashMap::new();
        let mut tasks: JoinSet<Uuid> = JoinSet::new();
        let mut heartbeat = tokio::time::interval(heartbeat_every);
        let mut poll = tokio::time::interval(CLAIM_POLL);
        let mut outage = Outage::default();
        loop {
            tokio::select! {
                _ = heartbeat.tick() => {
                    let asked: HashMap<Uuid, u64> = running.iter().map(|(&job, r)| (job, r.preempt.asked())).collect();
                    let answer = match self.client.heartbeat(asked.keys().copied().collect()).await {
                        Ok(answer) => answer,
                        Err(ClientError::Unauthorized) => return,
                        Err(error) => {
                            outage.failed("heartbeat", &error);
                            continue;
                        }
                    };
                    outage.answered();
                    for job in answer.stop {
                        if let Some(stopped) = running.remove(&job) {
                            tracing::info!(%job, "the server revoked this job's lease; stopping it");
                            stopped.task.abort();
                        }
                    }
                    for job in answer.preempt {
                        if let (Some(preempted), Some(&asked)) = (running.get(&job), asked.get(&job)) {
                            if preempted.preempt.request(asked) {
                                tracing::info!(%job, "the server asks to preempt this job; it checkpoints and stops");
                            }
                        }
                    }
                }
                _ = poll.tick(), if !self.claimable(&running).is_empty() => {
                    let claimed = match self.client.claim(&self.claimable(&running)).await {
                        Ok(claimed) => claimed,
                        Err(ClientError::Unauthorized) => return,
                        Err(error) => {
                            poll.reset_after(outage.failed("claim", &error));
                            continue;
                        }
                    };
                    outage.answered();
                    if let Some(assignment) = claimed {
                        let job = assignment.job_id;
                        let kind = assignment.spec.kind();
                        let on_slice = assignment.slice.is_some();
                        tracing::info!(%job, kind, attempt = assignment.attempt, "leased a job");
                        // Leased again while an earlier run of it is still here (ending, its last
                        // report retrying): that run is over to the server, and its late report
                        // must not end this one.
                        if let Some(stale) = running.remove(&job) {
                            stale.task.abort();
                        }
                        let context = JobContext::new(
                            self.client.clone(),
                            job,
                            self.config.data_dir.clone(),
                            self.config.endpoint.clone(),
                        )
                        .with_slices(assignment.slice.clone(), offered.clone(), self.config.binding)
                        .with_test_slowdown(self.config.test_slowdown.unwrap_or(1.0))
                        .with_cache(self.cache.clone());
                        let preempt = context.preempt();
                        let task = tasks.spawn(async move {
                            jobs::run(context, assignment.spec).await;
                            job
                        });
                        let usage = match kind {
                            "serve" => Use::Replica,
                            "train_rank" if on_slice => Use::SliceRank,
                            _ => Use::Batch,
                        };
                        running.insert(job, Running { usage, task, preempt });
                        poll.reset_immediately();
                    }
                }
                Some(done) = tasks.join_next_with_id(), if !tasks.is_empty() => {
                    // Only this task's entry: the job may have been claimed again meanwhile.
                    if let Ok((task, job)) = done {
                        if running.get(&job).is_some_and(|entry| entry.task.id() == task) {
                            running.remove(&job);
                        }
                    }
                    running.retain(|_, job| !job.task.is_finished());
                }
            }
        }
    }
}

/// The kinds to claim: batch jobs while a batch slot is free; a replica while a replica
/// slot is free, or always on a worker with device slices, whose free slices the server
/// knows (it may have repartitioned them into more than the worker started with); and a
/// rank pinned to one of its slices when no batch slot is.
fn claimable_kinds(batch_slot: bool, replica_slot: bool, has_slices: bool) -> Vec<&'static str> {
    let mut kinds = Vec::new();
    if batch_slot {
        kinds.extend(["prefetch", "train", "train_rank", "profile"]);
    }
    if replica_slot || has_slices {
        kinds.push("serve");
    }
    if has_slices && !batch_slot {
        kinds.push("slice_rank");
    }
    kinds
}

/// Calls of the agent loop the server has not answered since it was last heard from: the
/// first failure is logged, later ones only every so often, and claims back off.
#[derive(Default)]
struct Outage {
    failures: u32,
}

impl Outage {
    /// Notes a failed `call`; returns how long to wait before the next claim.
    fn failed(&mut self, call: &str, error: &ClientError) -> Duration {
        self.failures += 1;
        if self.failures.is_power_of_two() {
            tracing::warn!(%error, failures = self.failures, "the server did not answer the {call}; jobs keep running");
        }
        (CLAIM_POLL * self.failures.min(20)).min(Duration::from_secs(10))
    }

    fn answered(&mut self) {
        if self.failures > 0 {
            tracing::info!(failures = self.failures, "the server answers again");
        }
        self.failures = 0;
    }
}

/// Writes a file only its owner may read (the worker secret).
fn write_private(path: &std::path::Path, contents: &str) -> std::io::Result<()> {
    use std::io::Write;
    #[cfg(unix)]
    use std::os::unix::fs::OpenOptionsExt;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    options.mode(0o600);
    options.open(path)?.write_all(contents.as_bytes())
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use axum::http::StatusCode;
    use axum::routing::post;
    use axum::Router;

    use super::*;

    #[tokio::test]
    async fn a_worker_whose_token_is_refused_stops_and_says_why() {
        let calls = Arc::new(AtomicU32::new(0));
        let counted = calls.clone();
        let refusal = r#"{"error":{"code":"unauthorized","message":"Send the worker token."}}"#;
        let register = move || async move {
            counted.fetch_add(1, Ordering::SeqCst);
            (StatusCode::UNAUTHORIZED, refusal)
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let server = format!("http://{}", listener.local_addr().unwrap());
        let router = Router::new().route("/api/v1/agent/register", post(register));
        tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
        let data = tempfile::tempdir().unwrap();
        let agent = Agent::new(AgentConfig {
            server,
            worker_token: "wrong".into(),
            name: "w".into(),
            data_dir: data.path().into(),
            slots: 1,
            replica_slots: 1,
            inventory: Inventory::default(),
            allow_repartition: false,
            endpoint: Endpoint::start("127.0.0.1:0", None).await.unwrap(),
            binding: Policy::default(),
            test_slowdown: None,
        })
        .unwrap();
        let refused = tokio::time::timeout(Duration::from_secs(10), agent.run()).await.expect("the agent stops");
        assert!(refused.to_string().contains("401 Unauthorized: Send the worker token."), "{refused}");
        assert_eq!(calls.load(Ordering::SeqCst), 1, "not tried again");
    }

    #[test]
    fn a_worker_with_slices_asks_for_replicas_past_the_slices_it_started_with() {
        assert_eq!(claimable_kinds(true, true, false), ["prefetch", "train", "train_rank", "profile", "serve"]);
        assert_eq!(claimable_kinds(true, false, false), ["prefetch", "train", "train_rank", "profile"]);
        // Its replica slots are taken, but the server may have cut its GPU into more slices.
        assert_eq!(claimable_kinds(false, false, true), ["serve", "slice_rank"]);
        assert!(claimable_kinds(false, false, false).is_empty());
    }
}
