//! Running one leased job: report it running, do the work, report how it ended. What a
//! job prints goes to the server as log lines; what it measures, as metric points.

pub mod prefetch;

use std::path::PathBuf;

use tessera_api::jobs::{JobSpec, JobState, MetricPoint};
use uuid::Uuid;

use crate::client::{Client, ClientError};

/// The job kinds this worker can run.
pub const KINDS: &[&str] = &["prefetch"];

pub struct JobContext {
    client: Client,
    job: Uuid,
    data_dir: PathBuf,
}

impl JobContext {
    pub fn new(client: Client, job: Uuid, data_dir: PathBuf) -> JobContext {
        JobContext { client, job, data_dir }
    }

    pub async fn log(&self, line: impl Into<String>) -> Result<(), ClientError> {
        let line = line.into();
        tracing::info!(job = %self.job, "{line}");
        self.client.logs(self.job, vec![line]).await
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
    #[error("this worker cannot run {0} jobs")]
    Unsupported(&'static str),
}

/// Runs the job to its end and reports the outcome; a lost lease ends it silently,
/// since the job then belongs to someone else.
pub async fn run(context: JobContext, spec: JobSpec) {
    let job = context.job;
    if let Err(e) = context.client.status(job, JobState::Running, None).await {
        tracing::warn!(%job, error = %e, "could not start the job");
        return;
    }
    let outcome = match spec {
        JobSpec::Prefetch { model } => prefetch::run(&context, model).await,
        // Not in KINDS, so never claimed; a server bug would otherwise hang the job.
        other => Err(JobError::Unsupported(other.kind())),
    };
    let (state, message) = match outcome {
        Ok(summary) => (JobState::Succeeded, summary),
        Err(JobError::Client(ClientError::LeaseLost)) => {
            tracing::info!(%job, "lease lost while running; leaving the job to the server");
            return;
        }
        Err(e) => {
            let _ = context.log(format!("error: {e}")).await;
            (JobState::Failed, e.to_string())
        }
    };
    if let Err(e) = context.client.status(job, state, Some(message)).await {
        tracing::warn!(%job, error = %e, "could not report the job's end");
    }
}
