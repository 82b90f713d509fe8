//! Jobs: work items in the leased queue, and what a worker reports about them.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

use crate::train::{TrainJob, TrainProgress};

/// `queued → leased → running → succeeded | failed | cancelled`; an expired lease puts a
/// leased or running job back to `queued`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    Queued,
    Leased,
    Running,
    Succeeded,
    Failed,
    Cancelled,
}

impl JobState {
    pub const ALL: [JobState; 6] = [
        JobState::Queued,
        JobState::Leased,
        JobState::Running,
        JobState::Succeeded,
        JobState::Failed,
        JobState::Cancelled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Queued => "queued",
            JobState::Leased => "leased",
            JobState::Running => "running",
            JobState::Succeeded => "succeeded",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
        }
    }

    pub fn parse(s: &str) -> Option<JobState> {
        JobState::ALL.into_iter().find(|state| state.as_str() == s)
    }

    pub fn is_terminal(self) -> bool {
        matches!(self, JobState::Succeeded | JobState::Failed | JobState::Cancelled)
    }
}

/// What a job asks a worker to do. Tagged by `kind` so new kinds (training, serving
/// replicas) are added without changing the queue.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum JobSpec {
    /// Download a registered model into the worker's cache and verify every file's
    /// digest, so a later deployment on that worker starts without a transfer.
    Prefetch { model: Uuid },
    /// Serve one replica of a deployment until the lease is taken back.
    Serve {
        deployment: Uuid,
        model: Uuid,
        max_batch_tokens: u32,
        max_batch_requests: u32,
    },
    /// Train a model (see [`crate::train`]); resumes from the job's latest checkpoint.
    Train(TrainJob),
    /// Measure a model's throughput and p99 latency per batch size on each kind of slice
    /// the worker has (the planner's throughput table).
    Profile { model: Uuid, batch_sizes: Vec<u32> },
}

impl JobSpec {
    pub fn kind(&self) -> &'static str {
        match self {
            JobSpec::Prefetch { .. } => "prefetch",
            JobSpec::Serve { .. } => "serve",
            JobSpec::Train(_) => "train",
            JobSpec::Profile { .. } => "profile",
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct CreateJob {
    pub name: String,
    /// `{"kind": "prefetch", "model": "<model id or name>"}`
    pub spec: serde_json::Value,
    /// How many times an expired lease may requeue the job before it fails (default 3).
    pub max_attempts: Option<u32>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Job {
    pub id: Uuid,
    pub name: String,
    pub owner: String,
    pub spec: JobSpec,
    pub state: JobState,
    /// Why the job is in its state: the failure, the cancellation, the requeue.
    pub message: Option<String>,
    pub attempts: u32,
    pub max_attempts: u32,
    pub worker_id: Option<Uuid>,
    pub lease_expires_at: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub started_at: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
    /// Training jobs: the step reached of `max_steps`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<TrainProgress>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct LogLine {
    pub seq: i64,
    pub at: DateTime<Utc>,
    pub line: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct MetricPoint {
    pub name: String,
    pub step: i64,
    pub value: f64,
    #[serde(default)]
    pub at: Option<DateTime<Utc>>,
}
