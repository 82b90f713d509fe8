//! HTTP client for the agent protocol: every call the worker makes to the server.

use std::path::Path;

use futures_util::StreamExt;
use reqwest::StatusCode;
use sha2::{Digest, Sha256};
use tessera_api::jobs::JobState;
use tessera_api::models::Model;
use tessera_api::workers::{
    Assignment, ClaimRequest, Heartbeat, HeartbeatResponse, LogBatch, MetricBatch, RegisterRequest, RegisterResponse,
    StatusReport,
};
use tessera_api::jobs::MetricPoint;
use tessera_api::parallel::{RegroupRequest, RegroupResponse, RendezvousRequest, RendezvousResponse};
use tessera_api::precision::PrecisionPlanReport;
use tessera_api::train::{Checkpoint, LrStageRecord, TrainingMetrics};
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

impl Client {
    pub fn new(base: &str) -> Result<Client, ClientError> {
        let http = reqwest::Client::builder().connect_timeout(std::time::Duration::from_secs(10)).build()?;
        Ok(Client { http, base: base.trim_end_matches('/').to_string(), secret: String::new() })
    }

    fn url(&self, path: &str) -> String {
        format!("{}/api/v1/agent/{path}", self.base)
    }

    async fn post<B: serde::Serialize>(&self, path: &str, body: &B) -> Result<reqwest::Response, ClientError> {
        check(self.http.post(self.url(path)).bearer_auth(&self.secret).json(body).send().await?).await
    }

    async fn put<B: serde::Serialize>(&self, path: &str, body: &B) -> Result<reqwest::Response, ClientError> {
        check(self.http.put(self.url(path)).bearer_auth(&self.secret).json(body).send().await?).await
    }

    /// The secret of the last registration (empty before the first).
    pub fn secret(&self) -> &str {
        &self.secret
    }

    /// Joins with the shared token; later calls use the secret the server hands back.
    pub async fn register(&mut self, token: &str, request: &RegisterRequest) -> Result<RegisterResponse, ClientError> {
        let response = check(self.http.post(self.url("register")).bearer_auth(token).json(request).send().await?).await?;
        let registered: RegisterResponse = response.json().await?;
        self.secret = registered.secret.clone();
        Ok(registered)
    }

    pub async fn heartbeat(&self, jobs: Vec<Uuid>) -> Result<HeartbeatResponse, ClientError> {
        Ok(self.post("heartbeat", &Heartbeat { jobs }).await?.json().await?)
    }

    pub async fn claim(&self, kinds: &[&str]) -> Result<Option<Assignment>, ClientError> {
        let request = ClaimRequest { kinds: kinds.iter().map(|k| k.to_string()).collect() };
        let response = self.post("claim", &request).await?;
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

    pub async fn logs(&self, job: Uuid, lines: Vec<String>) -> Result<(), ClientError> {
        self.post(&format!("jobs/{job}/logs"), &LogBatch { lines }).await?;
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
        let mut form = reqwest::multipart::Form::new().text("step", step.to_string());
        for (name, bytes) in files {
            form = form.part("files", reqwest::multipart::Part::bytes(bytes).file_name(name));
        }
        let request = self.http.post(self.url(&format!("jobs/{job}/checkpoints"))).bearer_auth(&self.secret).multipart(form);
        check(request.send().await?).await?;
        Ok(())
    }

    /// The job's latest checkpoint, if it has one.
    pub async fn latest_checkpoint(&self, job: Uuid) -> Result<Option<Checkpoint>, ClientError> {
        let response = self.get(&format!("jobs/{job}/checkpoints/latest")).await?;
        if response.status() == StatusCode::NO_CONTENT {
            return Ok(None);
        }
        Ok(Some(response.json().await?))
    }

    pub async fn checkpoint_file(&self, job: Uuid, step: u64, name: &str) -> Result<Vec<u8>, ClientError> {
        Ok(self.get(&format!("jobs/{job}/checkpoints/{step}/files/{name}")).await?.bytes().await?.to_vec())
    }

    /// A dataset's bytes, checked against its digest.
    pub async fn dataset(&self, id: Uuid, digest: &str) -> Result<Vec<u8>, ClientError> {
        let bytes = self.get(&format!("datasets/{id}/file")).await?.bytes().await?.to_vec();
        let actual = format!("sha256:{}", hex::encode(Sha256::digest(&bytes)));
        if actual != digest {
            return Err(ClientError::DigestMismatch { path: format!("dataset {id}"), expected: digest.into(), actual });
        }
        Ok(bytes)
    }

    async fn get(&self, path: &str) -> Result<reqwest::Response, ClientError> {
        check(self.http.get(self.url(path)).bearer_auth(&self.secret).send().await?).await
    }

    pub async fn model(&self, id: Uuid) -> Result<Model, ClientError> {
        let response = self.http.get(self.url(&format!("models/{id}"))).bearer_auth(&self.secret).send().await?;
        Ok(check(response).await?.json().await?)
    }

    /// Streams one model file to `target`, checking its SHA-256 against `digest`; the
    /// file appears under `target` only once it is complete and verified.
    pub async fn download(&self, model: Uuid, path: &str, digest: &str, target: &Path) -> Result<u64, ClientError> {
        let response = self
            .http
            .get(self.url(&format!("models/{model}/files/{path}")))
            .bearer_auth(&self.secret)
            .send()
            .await?;
        let response = check(response).await?;
        let partial = target.with_extension("partial");
        let mut file = tokio::fs::File::create(&partial).await?;
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
            let _ = tokio::fs::remove_file(&partial).await;
            return Err(ClientError::DigestMismatch { path: path.into(), expected: digest.into(), actual });
        }
        tokio::fs::rename(&partial, target).await?;
        Ok(size)
    }
}
