//! HTTP client for the agent protocol: every call the worker makes to the server.
//!
//! A job's calls ride out a server restart or a moment of overload: one the server did
//! not answer (unreachable, timed out, 429, 502, 503, 504) is sent again with backoff,
//! waiting up to [`RETRY_FOR`] in all. Every such call is safe to repeat (the server
//! replaces metrics, checkpoints, plans and stage records by their key, stores a log
//! batch once under the id the worker gave it; a status or rendezvous says the same
//! thing twice).
//! The agent loop's own heartbeat and claim are sent once: its loop is their retry.

use std::future::Future;
use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use reqwest::{RequestBuilder, StatusCode};
use sha2::{Digest, Sha256};
use tessera_api::datasets::Dataset;
use tessera_api::error::ErrorBody;
use tessera_api::jobs::JobState;
use tessera_api::models::Model;
use tessera_api::workers::{
    Assignment, ClaimRequest, Heartbeat, HeartbeatResponse, LogBatch, MetricBatch, RegisterRequest, RegisterResponse,
    StatusReport,
};
use tessera_api::jobs::MetricPoint;
use tessera_api::parallel::{RegroupRequest, RegroupResponse, RendezvousRequest, RendezvousResponse};
use tessera_api::precision::PrecisionPlanReport;
use tessera_api::train::{Checkpoint, CheckpointFile, LrStageRecord, TrainingMetrics};
use tokio::io::AsyncWriteExt;
use uuid::Uuid;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot reach the server: {0}")]
    Transport(#[from] reqwest::Error),
    #[error("the server refused the worker's credentials; it must register again")]
    Unauthorized,
    #[error("the worker no longer holds this job's lease")]
    LeaseLost,
    #[error("the server answered {status}: {body}")]
    Status { status: StatusCode, body: String },
    #[error("downloaded {path} does not match its digest (expected {expected}, got {actual})")]
    DigestMismatch { path: String, expected: String, actual: String },
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    base: String,
    secret: String,
}

async fn check(response: reqwest::Response) -> Result<reqwest::Response, ClientError> {
    match response.status() {
        s if s.is_success() => Ok(response),
        StatusCode::UNAUTHORIZED => Err(ClientError::Unauthorized),
        StatusCode::CONFLICT => Err(ClientError::LeaseLost),
        status => Err(ClientError::Status { status, body: response.text().await.unwrap_or_default() }),
    }
}

/// How long a job waits, in all, between the attempts at a call the server does not
/// answer: longer than a restart takes, and past the 30 s lease a job outlives only if its
/// worker heartbeats.
pub const RETRY_FOR: Duration = Duration::from_secs(120);

/// A JSON call the server has not answered in this long is given up on (and retried).
/// Transfers of files (models, datasets, checkpoints) have no such limit.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// The agent loop's heartbeat and claim give up sooner: one loop sends both, so a claim
/// the server sits on delays the next heartbeat, and two of these in a row still leave
/// the leases (30 s by default) renewed in time.
const LOOP_CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// A connection that has given nothing for this long is given up on (and retried).
const STALL_TIMEOUT: Duration = Duration::from_secs(60);

impl ClientError {
    /// Whether the server did not answer the call (not reached, no answer in time, the
    /// answer broke off) or said it is overloaded or restarting: a repeat may succeed.
    pub fn unanswered(&self) -> bool {
        match self {
            ClientError::Transport(e) => e.is_connect() || e.is_timeout() || e.is_request() || e.is_body(),
            ClientError::Status { status, .. } => matches!(
                *status,
                StatusCode::TOO_MANY_REQUESTS
                    | StatusCode::BAD_GATEWAY
                    | StatusCode::SERVICE_UNAVAILABLE
                    | StatusCode::GATEWAY_TIMEOUT
            ),
            _ => false,
        }
    }

    /// Whether a refused registration is final: the server finds the worker's token or
    /// what it reports wrong (400, 401, 403, 422), which no retry changes. A 409 is not:
    /// the name or a slice is another live worker's until that one goes quiet.
    pub fn refuses_registration(&self) -> bool {
        matches!(
            self,
            ClientError::Status { status, .. } if matches!(
                *status,
                StatusCode::BAD_REQUEST
                    | StatusCode::UNAUTHORIZED
                    | StatusCode::FORBIDDEN
                    | StatusCode::UNPROCESSABLE_ENTITY
            )
        )
    }
}

/// Runs `call` again with backoff while it is [`ClientError::unanswered`], waiting
/// [`RETRY_FOR`] in all between attempts (some 30 of them). The attempts' own time does
/// not count, so a long transfer that breaks off is still sent again.
async fn retrying<T, F>(mut call: impl FnMut() -> F) -> Result<T, ClientError>
where
    F: Future<Output = Result<T, ClientError>>,
{
    let mut waited = Duration::ZERO;
    let mut backoff = Duration::from_millis(250);
    loop {
        match call().await {
            Err(error) if error.unanswered() && waited + backoff <= RETRY_FOR => {
                tracing::warn!(%error, "the server did not answer; sending again in {backoff:?}");
                tokio::time::sleep(backoff).await;
                waited += backoff;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
            answer => return answer,
        }
    }
}

impl Client {
    pub fn new(base: &str) -> Result<Client, ClientError> {
        // A transfer that stalls this long breaks off (and is retried); one that flows has no limit.
        let http =
            reqwest::Client::builder().connect_timeout(Duration::from_secs(10)).read_timeout(STALL_TIMEOUT).build()?;
        Ok(Client { http, base: base.trim_end_matches('/').to_string(), secret: String::new() })
    }

    fn url(&self, path: &str) -> String {
        format!("{}/api/v1/agent/{path}", self.base)
    }

    /// Sends the request `build` makes, once.
    async fn send_once(&self, build: impl Fn() -> RequestBuilder) -> Result<reqwest::Response, ClientError> {
        check(build().bearer_auth(&self.secret).send().await?).await
    }

    /// Sends the request `build` makes, [`retrying`].
    async fn send(&self, build: impl Fn() -> RequestBuilder) -> Result<reqwest::Response, ClientError> {
        retrying(|| self.send_once(&build)).await
    }

    async fn post<B: serde::Serialize>(&self, path: &str, body: &B) -> Result<reqwest::Response, ClientError> {
        self.send(|| self.http.post(self.url(path)).timeout(CALL_TIMEOUT).json(body)).await
    }

    async fn put<B: serde::Serialize>(&self, path: &str, body: &B) -> Result<reqwest::Response, ClientError> {
        self.send(|| self.http.put(self.url(path)).timeout(CALL_TIMEOUT).json(body)).await
    }

    /// A call of the agent loop: sent once (the loop sends the next), never waiting long.
    async fn post_once<B: serde::Serialize>(&self, path: &str, body: &B) -> Result<reqwest::Response, ClientError> {
        self.send_once(|| self.http.post(self.url(path)).timeout(LOOP_CALL_TIMEOUT).json(body)).await
    }

    /// The secret of the last registration (empty before the first).
    pub fn secret(&self) -> &str {
        &self.secret
    }

    /// Joins with the shared token; later calls use the secret the server hands back. A
    /// refusal is a [`ClientError::Status`] with the server's sentence (a 401 here is about
    /// the token, a 409 about the name or the slices, not a lease).
    pub async fn register(&mut self, token: &str, request: &RegisterRequest) -> Result<RegisterResponse, ClientError> {
        let call = self.http.post(self.url("register")).timeout(CALL_TIMEOUT).bearer_auth(token).json(request);
        let response = call.send().await?;
        let status = response.status();
        if !status.is_success() {
            let body = response.text().await.unwrap_or_default();
            let sentence = serde_json::from_str::<ErrorBody>(&body).map(|refusal| refusal.error.message);
            return Err(ClientError::Status { status, body: sentence.unwrap_or(body) });
        }
        let registered: RegisterResponse = response.json().await?;
        self.secret = registered.secret.clone();
        Ok(registered)
    }

    pub async fn heartbeat(&self, jobs: Vec<Uuid>) -> Result<HeartbeatResponse, ClientError> {
        Ok(self.post_once("heartbeat", &Heartbeat { jobs }).await?.json().await?)
    }

    pub async fn claim(&self, kinds: &[&str]) -> Result<Option<Assignment>, ClientError> {
        let request = ClaimRequest { kinds: kinds.iter().map(|k| k.to_string()).collect() };
        let response = self.post_once("claim", &request).await?;
        if response.status() == StatusCode::NO_CONTENT {
            return Ok(None);
        }
        Ok(Some(response.json().await?))
    }

    /// `endpoint`: where a serving replica's engine answers, reported with `running`.
    pub async fn status(
        &self,
        job: Uuid,
        state: JobState,
        message: Option<String>,
        endpoint: Option<String>,
    ) -> Result<(), ClientError> {
        self.post(&format!("jobs/{job}/status"), &StatusReport { state, message, endpoint }).await?;
        Ok(())
    }

    /// Sent again after a lost answer under the same batch id, which the server stores once.
    pub async fn logs(&self, job: Uuid, lines: Vec<String>) -> Result<(), ClientError> {
        self.post(&format!("jobs/{job}/logs"), &LogBatch { lines, batch: Some(Uuid::new_v4()) }).await?;
        Ok(())
    }

    pub async fn metrics(&self, job: Uuid, points: Vec<MetricPoint>) -> Result<(), ClientError> {
        self.post(&format!("jobs/{job}/metrics"), &MetricBatch { points }).await?;
        Ok(())
    }

    /// Stores a profiler job's measurements (the model's throughput table).
    pub async fn profiles(&self, job: Uuid, reports: &[tessera_api::mig::ProfileReport]) -> Result<(), ClientError> {
        self.post(&format!("jobs/{job}/profiles"), &reports).await?;
        Ok(())
    }

    /// Step and eval rows of a training job; re-sent steps replace the stored ones.
    pub async fn training_metrics(&self, job: Uuid, metrics: &TrainingMetrics) -> Result<(), ClientError> {
        self.post(&format!("jobs/{job}/training-metrics"), metrics).await?;
        Ok(())
    }

    /// Posts where this rank accepts its ring neighbour; answers whether the gang formed.
    pub async fn rendezvous(&self, job: Uuid, address: &str) -> Result<RendezvousResponse, ClientError> {
        let request = RendezvousRequest { address: address.to_string() };
        Ok(self.post(&format!("jobs/{job}/rendezvous"), &request).await?.json().await?)
    }

    /// Posts where this rank accepts its ring neighbour in its gang's new world (an in-place
    /// resize); `generation` is the one it last ran in (0 for a joining rank).
    pub async fn regroup(&self, job: Uuid, address: &str, generation: u32) -> Result<RegroupResponse, ClientError> {
        let request = RegroupRequest { address: address.to_string(), generation };
        Ok(self.post(&format!("jobs/{job}/regroup"), &request).await?.json().await?)
    }

    /// A data-parallel job's precision plan, from rank 0 (sent again, replacing it, with the
    /// step time measured under the plan).
    pub async fn precision_plan(&self, job: Uuid, report: &PrecisionPlanReport) -> Result<(), ClientError> {
        self.put(&format!("jobs/{job}/precision-plan"), report).await?;
        Ok(())
    }

    /// One AutoLRS stage record (a record for the same stage replaces it).
    pub async fn lr_stage(&self, job: Uuid, record: &LrStageRecord) -> Result<(), ClientError> {
        self.post(&format!("jobs/{job}/lr-stages"), record).await?;
        Ok(())
    }

    /// Uploads a checkpoint's files as one multipart request (`step`, then `files` parts).
    pub async fn upload_checkpoint(&self, job: Uuid, step: u64, files: Vec<(String, Vec<u8>)>) -> Result<(), ClientError> {
        // Shared, so that each attempt's form reuses the bytes.
        let files: Vec<(String, Bytes)> = files.into_iter().map(|(name, bytes)| (name, bytes.into())).collect();
        let form = || {
            let mut form = reqwest::multipart::Form::new().text("step", step.to_string());
            for (name, bytes) in &files {
                let part = reqwest::multipart::Part::stream_with_length(bytes.clone(), bytes.len() as u64);
                form = form.part("files", part.file_name(name.clone()));
            }
            form
        };
        self.send(|| self.http.post(self.url(&format!("jobs/{job}/checkpoints"))).multipart(form())).await?;
        Ok(())
    }

    /// The job's latest checkpoint, if it has one.
    pub async fn latest_checkpoint(&self, job: Uuid) -> Result<Option<Checkpoint>, ClientError> {
        let response = self.get_timed(&format!("jobs/{job}/checkpoints/latest")).await?;
        if response.status() == StatusCode::NO_CONTENT {
            return Ok(None);
        }
        Ok(Some(response.json().await?))
    }

    /// A checkpoint file's bytes, checked against the digest its checkpoint lists.
    pub async fn checkpoint_file(&self, job: Uuid, step: u64, file: &CheckpointFile) -> Result<Vec<u8>, ClientError> {
        let bytes = self.get_bytes(&format!("jobs/{job}/checkpoints/{step}/files/{}", file.name)).await?;
        checked(bytes.to_vec(), &file.digest, || format!("checkpoint file {} of step {step}", file.name))
    }

    /// A dataset's record (its size, before fetching its file).
    pub async fn dataset(&self, id: Uuid) -> Result<Dataset, ClientError> {
        Ok(self.get_timed(&format!("datasets/{id}")).await?.json().await?)
    }

    /// Streams a dataset's file to `target`, as [`Client::download`] does a model's.
    pub async fn download_dataset(&self, id: Uuid, digest: &str, target: &Path) -> Result<u64, ClientError> {
        let (url_path, what) = (format!("datasets/{id}/file"), format!("dataset {id}"));
        retrying(|| self.download_once(&url_path, &what, digest, target)).await
    }

    /// A GET of JSON, [`retrying`].
    async fn get_timed(&self, path: &str) -> Result<reqwest::Response, ClientError> {
        self.send(|| self.http.get(self.url(path)).timeout(CALL_TIMEOUT)).await
    }

    /// A file's bytes, [`retrying`] the whole transfer (one that breaks off included).
    async fn get_bytes(&self, path: &str) -> Result<Bytes, ClientError> {
        retrying(|| async { Ok(self.send_once(|| self.http.get(self.url(path))).await?.bytes().await?) }).await
    }

    pub async fn model(&self, id: Uuid) -> Result<Model, ClientError> {
        Ok(self.get_timed(&format!("models/{id}")).await?.json().await?)
    }

    /// Streams one model file to `target`, checking its SHA-256 against `digest`; the
    /// file appears under `target` only once it is complete and verified. A transfer that
    /// breaks off starts again ([`retrying`]).
    pub async fn download(&self, model: Uuid, path: &str, digest: &str, target: &Path) -> Result<u64, ClientError> {
        let url_path = format!("models/{model}/files/{path}");
        retrying(|| self.download_once(&url_path, path, digest, target)).await
    }

    /// Streams the file at `url_path` to `target` once; `what` names it if it does not match.
    async fn download_once(&self, url_path: &str, what: &str, digest: &str, target: &Path) -> Result<u64, ClientError> {
        let response = self.send_once(|| self.http.get(self.url(url_path))).await?;
        // Its own partial file: two jobs fetching one file on this worker never write one.
        let partial = Partial(target.with_extension(format!("{}-{}.partial", this_run(), Uuid::new_v4().simple())));
        let mut file = tokio::fs::File::create(&partial.0).await?;
        let mut hasher = Sha256::new();
        let mut size = 0u64;
        let mut body = response.bytes_stream();
        while let Some(chunk) = body.next().await {
            let chunk = chunk?;
            hasher.update(&chunk);
            size += chunk.len() as u64;
            file.write_all(&chunk).await?;
        }
        file.flush().await?;
        file.sync_all().await?;
        let actual = format!("sha256:{}", hex::encode(hasher.finalize()));
        if actual != digest {
            return Err(ClientError::DigestMismatch { path: what.into(), expected: digest.into(), actual });
        }
        tokio::fs::rename(&partial.0, target).await?;
        Ok(size)
    }
}

/// `bytes` if their SHA-256 is `digest` (`sha256:<hex>`); `what` names them otherwise.
fn checked(bytes: Vec<u8>, digest: &str, what: impl FnOnce() -> String) -> Result<Vec<u8>, ClientError> {
    let actual = format!("sha256:{}", hex::encode(Sha256::digest(&bytes)));
    if actual != digest {
        return Err(ClientError::DigestMismatch { path: what(), expected: digest.into(), actual });
    }
    Ok(bytes)
}

/// A name for this worker process, in the names of its partial files (a process id
/// would do, but a container's worker is process 1 each time it starts).
fn this_run() -> &'static str {
    static RUN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    RUN.get_or_init(|| Uuid::new_v4().simple().to_string()[..12].to_string())
}

/// Removes the partial files under `folder` that an earlier worker process left behind
/// (killed mid-download, it never removed them); this process's own are in use.
pub fn remove_stale_partials(folder: &Path) {
    let Ok(entries) = std::fs::read_dir(folder) else { return };
    let ours = format!(".{}-", this_run());
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if path.is_dir() {
            remove_stale_partials(&path);
        } else if name.ends_with(".partial") && !name.contains(&ours) {
            let _ = std::fs::remove_file(&path);
        }
    }
}

/// A download's partial file, removed unless it was renamed into place (a failed or
/// aborted download leaves nothing behind).
struct Partial(std::path::PathBuf);

impl Drop for Partial {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    use axum::body::Body;
    use axum::extract::State;
    use axum::http::StatusCode as Code;
    use axum::routing::{get, post};
    use axum::Router;

    use super::*;

    /// A client of `router`, served on a free loopback port.
    async fn client_of(router: Router) -> Client {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
        Client::new(&url).unwrap()
    }

    /// Answers 503 to the first two calls it counts, then `then`.
    async fn shed_twice(calls: &AtomicU32, then: Code) -> Code {
        if calls.fetch_add(1, Ordering::SeqCst) < 2 { Code::SERVICE_UNAVAILABLE } else { then }
    }

    #[tokio::test]
    async fn a_job_s_call_is_sent_again_while_shed_and_a_refused_or_loop_call_is_not() {
        let calls = Arc::new(AtomicU32::new(0));
        let counted = |then: Code| move |State(calls): State<Arc<AtomicU32>>| async move { shed_twice(&calls, then).await };
        let router = Router::new()
            .route("/api/v1/agent/jobs/{job}/logs", post(counted(Code::NO_CONTENT)))
            .route("/api/v1/agent/jobs/{job}/metrics", post(counted(Code::CONFLICT)))
            .route("/api/v1/agent/heartbeat", post(counted(Code::OK)))
            .with_state(calls.clone());
        let client = client_of(router).await;

        client.logs(Uuid::new_v4(), vec!["a line".into()]).await.unwrap();
        assert_eq!(calls.swap(0, Ordering::SeqCst), 3, "shed twice, answered the third time");
        let refused = client.metrics(Uuid::new_v4(), Vec::new()).await;
        assert!(matches!(refused, Err(ClientError::LeaseLost)), "{refused:?}");
        assert_eq!(calls.swap(0, Ordering::SeqCst), 3, "a 409 is an answer: not sent again");
        let heartbeat = client.heartbeat(Vec::new()).await;
        assert!(matches!(heartbeat, Err(ClientError::Status { status: StatusCode::SERVICE_UNAVAILABLE, .. })));
        assert_eq!(calls.load(Ordering::SeqCst), 1, "the agent loop's heartbeat is its own retry");
    }

    #[tokio::test]
    async fn two_downloads_of_one_file_at_once_both_land_it_whole() {
        const CHUNK: usize = 64 << 10;
        let bytes: Vec<u8> = (0..16 * CHUNK).map(|i| (i * 7 % 251) as u8).collect();
        let digest = format!("sha256:{}", hex::encode(Sha256::digest(&bytes)));
        let served = Bytes::from(bytes.clone());
        // Slow enough that the two transfers overlap.
        let file = move || {
            let served = served.clone();
            async move {
                let chunks = futures_util::stream::iter(0..16).then(move |i| {
                    let chunk = served.slice(i * CHUNK..(i + 1) * CHUNK);
                    async move {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        Ok::<_, std::io::Error>(chunk)
                    }
                });
                Body::from_stream(chunks)
            }
        };
        let client = client_of(Router::new().route("/api/v1/agent/models/{id}/files/{*path}", get(file))).await;
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("model.safetensors");
        let model = Uuid::new_v4();
        let (first, second) = tokio::join!(
            client.download(model, "model.safetensors", &digest, &target),
            client.download(model, "model.safetensors", &digest, &target),
        );
        assert_eq!((first.unwrap(), second.unwrap()), (bytes.len() as u64, bytes.len() as u64));
        assert_eq!(std::fs::read(&target).unwrap(), bytes);
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, ["model.safetensors"], "no partial file is left behind");
    }

    #[tokio::test]
    async fn a_checkpoint_file_that_does_not_match_its_listed_digest_is_refused() {
        let router = Router::new().route("/api/v1/agent/jobs/{job}/checkpoints/{step}/files/{name}", get(|| async { "weights" }));
        let client = client_of(router).await;
        let digest = format!("sha256:{}", hex::encode(Sha256::digest(b"weights")));
        let file = |digest: &str| CheckpointFile { name: "model.safetensors".into(), digest: digest.into(), size_bytes: 7 };
        assert_eq!(client.checkpoint_file(Uuid::new_v4(), 5, &file(&digest)).await.unwrap(), b"weights");
        let corrupt = client.checkpoint_file(Uuid::new_v4(), 5, &file("sha256:00")).await.unwrap_err();
        assert!(corrupt.to_string().contains("checkpoint file model.safetensors of step 5"), "{corrupt}");
    }

    /// The error of a registration the server answers with `status` and `body`.
    async fn refused_registration(status: Code, body: &'static str) -> ClientError {
        let router = Router::new().route("/api/v1/agent/register", post(move || async move { (status, body) }));
        let mut client = client_of(router).await;
        let request = RegisterRequest {
            name: "w".into(),
            version: "test".into(),
            inventory: Default::default(),
            allow_repartition: false,
            previous_secret: None,
        };
        client.register("token", &request).await.unwrap_err()
    }

    #[tokio::test]
    async fn a_refused_registration_says_why_and_is_final_only_for_a_wrong_token_or_report() {
        let busy = "A worker named 'w' is online; retry in 30 s.";
        let refused = refused_registration(Code::CONFLICT, busy).await;
        assert!(refused.to_string().contains(busy), "{refused}");
        assert!(!refused.refuses_registration(), "a live name goes quiet: registering is tried again");
        let token = r#"{"error":{"code":"unauthorized","message":"Send the worker token."}}"#;
        let refused = refused_registration(Code::UNAUTHORIZED, token).await;
        assert_eq!(refused.to_string(), "the server answered 401 Unauthorized: Send the worker token.");
        assert!(refused.refuses_registration());
    }

    #[tokio::test]
    async fn only_a_refusal_of_the_token_or_the_report_ends_registering() {
        let answered =
            |code: u16| ClientError::Status { status: StatusCode::from_u16(code).unwrap(), body: String::new() };
        for code in [400, 401, 403, 422] {
            assert!(answered(code).refuses_registration(), "{code} is final");
        }
        for code in [409, 429, 500, 502, 503, 504] {
            assert!(!answered(code).refuses_registration(), "{code} is tried again");
        }
        // A server not listening (yet): a connection error.
        let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap();
        let unreachable = reqwest::get(format!("http://{closed}/")).await.map(drop).map_err(ClientError::from);
        assert!(!unreachable.unwrap_err().refuses_registration(), "tried again");
    }

    #[test]
    fn only_partial_files_of_an_earlier_worker_process_are_swept() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("1_Pooling")).unwrap();
        let ours = format!("model.{}-0f.partial", this_run());
        let stale = ["model.0123456789ab-0f.partial", "1_Pooling/config.0123456789ab-1.partial"];
        for name in stale.iter().chain([&"model.safetensors", &ours.as_str()]) {
            std::fs::write(dir.path().join(name), b"x").unwrap();
        }
        remove_stale_partials(dir.path());
        for name in stale {
            assert!(!dir.path().join(name).exists(), "{name} is swept");
        }
        assert!(dir.path().join("model.safetensors").exists() && dir.path().join(&ours).exists());
    }
}
