//! Running one leased job: do the work, report how it ended. What a job prints goes to
//! the server as log lines; what it measures, as metric points. Batch jobs report
//! `running` when they start; a serving replica reports it once its engine answers. A
//! training job asked to preempt checkpoints, then reports `preempted`.

pub mod prefetch;
pub mod profile;
pub mod serve;
pub mod train;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tessera_api::jobs::{JobSpec, JobState, MetricPoint};
use tessera_api::mig::Slice;
use tessera_api::train::TrainDataset;
use uuid::Uuid;

use crate::cache::{Cache, Digest, Entry, Found, InUse};
use crate::client::{Client, ClientError};
use crate::engine::EngineError;
use crate::serve::binding::Policy;
use crate::serve::endpoint::Endpoint;

pub struct JobContext {
    client: Client,
    job: Uuid,
    data_dir: PathBuf,
    endpoint: Arc<Endpoint>,
    /// The slice a serving replica is bound to (none on a CPU-only worker).
    slice: Option<Slice>,
    /// Every slice this worker offers (the profiler measures them).
    offered: Arc<Vec<Slice>>,
    /// How replicas bound to slices run.
    binding: Policy,
    /// Test-only: data-parallel ranks compute this many times slower (`--test-slowdown`).
    test_slowdown: f64,
    /// Set by the agent when the server asks to preempt the job (training jobs heed it).
    preempt: Arc<Preempt>,
    /// The models and datasets this worker's jobs use (`cache`), and this job's uses, held
    /// to its end.
    cache: Arc<Cache>,
    uses: Mutex<Vec<InUse>>,
}

/// The server's request that a job preempt (checkpoint now and stop), which training jobs
/// heed; a rank's gang also stops this way to regroup in place. A rank that re-formed
/// clears it (`resume`), and a request the agent asked for before that, the stop it just
/// heeded, is dropped (`request`), or the rank would stop once more for nothing.
#[derive(Default)]
pub struct Preempt {
    flag: Arc<AtomicBool>,
    resumes: AtomicU64,
}

impl Preempt {
    /// What a later `request` needs to still apply: taken before asking the server.
    pub fn asked(&self) -> u64 {
        self.resumes.load(Ordering::SeqCst)
    }

    /// Sets the flag unless the job resumed since `asked`; true if it newly set it. Only
    /// the agent requests, so a request that raced a `resume` may take itself back.
    pub fn request(&self, asked: u64) -> bool {
        if self.asked() != asked {
            return false;
        }
        let newly = !self.flag.swap(true, Ordering::SeqCst);
        if self.asked() != asked {
            self.flag.store(false, Ordering::SeqCst);
            return false;
        }
        newly
    }

    /// Clears the flag: the job goes on (a regroup formed).
    pub fn resume(&self) {
        self.resumes.fetch_add(1, Ordering::SeqCst);
        self.flag.store(false, Ordering::SeqCst);
    }

    /// The flag a training session polls.
    pub fn flag(&self) -> Arc<AtomicBool> {
        self.flag.clone()
    }
}

impl JobContext {
    pub fn new(client: Client, job: Uuid, data_dir: PathBuf, endpoint: Arc<Endpoint>) -> JobContext {
        JobContext {
            client,
            job,
            data_dir,
            endpoint,
            slice: None,
            offered: Arc::default(),
            binding: Policy::default(),
            test_slowdown: 1.0,
            preempt: Arc::default(),
            cache: Arc::default(),
            uses: Mutex::default(),
        }
    }

    /// The cache this worker's jobs share (a job alone has its own).
    pub fn with_cache(self, cache: Arc<Cache>) -> JobContext {
        JobContext { cache, ..self }
    }

    /// The cache folder of the worker's models.
    fn models_dir(&self) -> PathBuf {
        self.data_dir.join(crate::cache::MODELS)
    }

    /// Keeps `model`'s cached folder until this job ends, and makes room for its `size`
    /// bytes by deleting entries no job uses ([`crate::cache`]).
    fn use_model(&self, model: Uuid, size: u64) {
        let entry = Entry::Model(model);
        self.keep(&entry);
        self.make_room(&entry, size);
    }

    /// A training job's dataset: its file in the cache, checked against its digest, or
    /// else downloaded into it first; kept there until this job ends.
    async fn dataset(&self, dataset: &TrainDataset) -> Result<(Vec<u8>, Found), JobError> {
        let digest = Digest::parse(&dataset.digest).ok_or_else(|| {
            JobError::Train(format!("the dataset's digest '{}' is not sha256:<64 hex digits>", dataset.digest))
        })?;
        let entry = Entry::Dataset(digest.clone());
        self.keep(&entry);
        let fetch = async |target: &Path| -> Result<(), JobError> {
            let size = self.client.dataset(dataset.id).await?.size_bytes;
            self.make_room(&entry, size);
            self.client.download_dataset(dataset.id, &dataset.digest, target).await?;
            Ok(())
        };
        self.cache.dataset(&self.data_dir, &digest, fetch).await
    }

    /// Keeps `entry` in the cache until this job ends.
    fn keep(&self, entry: &Entry) {
        let held = self.cache.hold(&self.data_dir, entry.clone());
        self.uses.lock().expect("cache uses lock").push(held);
    }

    /// Makes room in the cache for `entry`'s `size` bytes. Room not made is logged, not
    /// fatal: the download itself says whether the disk had enough.
    fn make_room(&self, entry: &Entry, size: u64) {
        if let Err(error) = self.cache.make_room(&self.data_dir, entry, size) {
            tracing::warn!(%error, ?entry, "could not make room in the cache");
        }
    }

    /// Test-only: the data-parallel ranks this worker runs compute `factor` times slower.
    pub fn with_test_slowdown(self, factor: f64) -> JobContext {
        JobContext { test_slowdown: factor, ..self }
    }

    /// The request that this job preempt (checkpoint now and stop).
    pub fn preempt(&self) -> Arc<Preempt> {
        self.preempt.clone()
    }

    /// The slice the server bound this job to, the slices the worker offers, and how
    /// replicas bound to slices run.
    pub fn with_slices(self, slice: Option<Slice>, offered: Arc<Vec<Slice>>, binding: Policy) -> JobContext {
        JobContext { slice, offered, binding, ..self }
    }

    pub async fn log(&self, line: impl Into<String>) -> Result<(), ClientError> {
        let line = line.into();
        tracing::info!(job = %self.job, "{line}");
        self.client.logs(self.job, vec![line]).await
    }

    /// The host the server reaches this worker at (its engine endpoint's), where a
    /// data-parallel rank listens for its ring neighbour.
    pub fn host(&self) -> String {
        let url = self.endpoint.url.as_str();
        let authority = url.split("://").nth(1).unwrap_or(url).split('/').next().unwrap_or_default();
        match authority.rsplit_once(':') {
            Some((host, port)) if port.parse::<u16>().is_ok() => host.to_string(),
            _ => authority.to_string(),
        }
    }

    pub async fn metric(&self, name: &str, step: i64, value: f64) -> Result<(), ClientError> {
        self.client.metrics(self.job, vec![MetricPoint { name: name.into(), step, value, at: None }]).await
    }
}

#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("{0}")]
    Profile(String),
    #[error("dataset: {0}")]
    Data(#[from] crate::train::data::DataError),
    #[error(transparent)]
    Session(#[from] crate::train::session::SessionError),
    #[error("model: {0}")]
    Model(#[from] candle_core::Error),
    #[error("{0}")]
    Train(String),
    #[error(transparent)]
    Process(#[from] crate::serve::process::ProcessError),
    /// A replica whose engine stopped computing (see `serve::batcher::Health`).
    #[error("{0}")]
    Broken(String),
    /// A data-parallel rank lost its ring (a peer died or went silent).
    #[error("the gang lost a rank: {0}")]
    RankLost(String),
    /// Not a failure: asked to preempt, the job checkpointed at `step` (uploaded) and stopped.
    #[error("preempted at step {step}")]
    Preempted { step: u64 },
    /// Not a failure: the rank's gang shrank in place at `step` without it (its row goes).
    #[error("left its gang at step {step}")]
    LeftGang { step: u64 },
}

/// Runs the job to its end and reports the outcome; a lost lease ends it silently,
/// since the job then belongs to someone else.
pub async fn run(context: JobContext, spec: JobSpec) {
    let job = context.job;
    let outcome = match spec {
        JobSpec::Prefetch { model } => match context.client.status(job, JobState::Running, None, None).await {
            Ok(()) => prefetch::run(&context, model).await,
            Err(e) => Err(e.into()),
        },
        JobSpec::Serve { model, limits, .. } => serve::run(&context, model, limits).await,
        JobSpec::Profile { model, batch_sizes } => {
            match context.client.status(job, JobState::Running, None, None).await {
                Ok(()) => profile::run(&context, model, batch_sizes).await,
                Err(e) => Err(e.into()),
            }
        }
        JobSpec::Train(spec) => train::run(&context, spec).await,
        JobSpec::TrainRank(rank) => train::run_rank(&context, rank).await,
    };
    let (state, message) = match outcome {
        Ok(summary) => (JobState::Succeeded, summary),
        Err(JobError::Preempted { step }) => {
            let _ = context.log(format!("preempted: checkpointed at step {step} and stopped")).await;
            (JobState::Preempted, format!("Preempted at step {step}; resumes from its checkpoint there."))
        }
        Err(JobError::LeftGang { step }) => {
            // The server logs it under the gang's job (this rank's row goes with the regroup).
            tracing::info!(%job, step, "left its gang, which shrank in place");
            return;
        }
        Err(JobError::Client(ClientError::LeaseLost)) => {
            tracing::info!(%job, "lease lost while running; leaving the job to the server");
            return;
        }
        Err(JobError::Client(error)) if error.unanswered() => {
            // Not the job's failure: the server was away for longer than calls are retried.
            // Its lease, no longer renewed, expires and the job is requeued (an attempt spent).
            tracing::warn!(%job, %error, "the server did not answer for too long; leaving the job to it");
            return;
        }
        Err(JobError::RankLost(reason)) => {
            // Not this rank's failure: the server requeues the gang once the lost rank's
            // lease expires, and it resumes from its last checkpoint.
            let _ = context.log(format!("the gang lost a rank: {reason}")).await;
            tracing::warn!(%job, %reason, "the gang lost a rank; leaving the job to the server");
            return;
        }
        Err(e) => {
            let _ = context.log(format!("error: {e}")).await;
            (JobState::Failed, e.to_string())
        }
    };
    if let Err(e) = context.client.status(job, state, Some(message), None).await {
        tracing::warn!(%job, error = %e, "could not report the job's end");
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU32;

    use axum::routing::get;
    use axum::Router;
    use sha2::{Digest as _, Sha256};
    use tessera_api::datasets::DatasetFormat;

    use super::*;

    #[tokio::test]
    async fn a_job_s_next_attempt_on_this_worker_reads_its_dataset_from_the_cache() {
        const ROWS: &[u8] = b"f,y\n1,0\n2,1\n";
        let downloads = Arc::new(AtomicU32::new(0));
        let counted = downloads.clone();
        let record = serde_json::json!({
            "id": Uuid::nil(), "name": "d", "digest": "", "format": "csv", "columns": [], "rows": 2,
            "size_bytes": ROWS.len(), "owner": "u", "created_at": "2026-01-01T00:00:00Z"
        });
        let router = Router::new()
            .route("/api/v1/agent/datasets/{id}", get(move || async move { axum::Json(record) }))
            .route(
                "/api/v1/agent/datasets/{id}/file",
                get(move || async move {
                    counted.fetch_add(1, Ordering::SeqCst);
                    ROWS
                }),
            );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = Client::new(&format!("http://{}", listener.local_addr().unwrap())).unwrap();
        tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
        let (dir, cache) = (tempfile::tempdir().unwrap(), Arc::new(Cache::default()));
        let endpoint = Endpoint::start("127.0.0.1:0", None).await.unwrap();
        let attempt = || {
            JobContext::new(client.clone(), Uuid::new_v4(), dir.path().into(), endpoint.clone()).with_cache(cache.clone())
        };
        let dataset = TrainDataset {
            id: Uuid::new_v4(),
            digest: format!("sha256:{}", hex::encode(Sha256::digest(ROWS))),
            format: DatasetFormat::Csv,
            columns: Vec::new(),
            rows: 2,
        };
        assert_eq!(attempt().dataset(&dataset).await.unwrap(), (ROWS.to_vec(), Found::Fetched));
        assert_eq!(attempt().dataset(&dataset).await.unwrap(), (ROWS.to_vec(), Found::Cached));
        assert_eq!(downloads.load(Ordering::SeqCst), 1, "downloaded once");
    }

    #[test]
    fn a_preempt_request_asked_before_the_job_resumed_is_dropped() {
        let preempt = Preempt::default();
        let flag = preempt.flag();
        let asked = preempt.asked();
        assert!(preempt.request(asked), "a first request sets the flag");
        assert!(!preempt.request(asked), "and only once");
        assert!(flag.load(Ordering::SeqCst));
        // The gang regrouped: an answer the agent asked for before that is stale.
        preempt.resume();
        assert!(!flag.load(Ordering::SeqCst));
        assert!(!preempt.request(asked), "stale");
        assert!(!flag.load(Ordering::SeqCst));
        assert!(preempt.request(preempt.asked()), "a request asked after it applies");
        assert!(flag.load(Ordering::SeqCst));
    }
}
