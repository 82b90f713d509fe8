//! Jobs: work items in the leased queue, and what a worker reports about them.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

use crate::parallel::RankJob;
use crate::train::{TrainJob, TrainModel, TrainProgress, TrainSpec};

/// `queued → leased → running → succeeded | failed | cancelled`; an expired lease puts a
/// leased or running job back to `queued`. A preempted training job (issue 16) checkpoints
/// and waits as `preempted` (`running → preempted → leased`): claimed like a queued job,
/// it resumes from that checkpoint, and the preempted run spends no attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    Queued,
    Leased,
    Running,
    Succeeded,
    Failed,
    Cancelled,
    Preempted,
}

impl JobState {
    pub const ALL: [JobState; 7] = [
        JobState::Queued,
        JobState::Preempted,
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
            JobState::Preempted => "preempted",
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
        #[serde(flatten)]
        limits: crate::deployments::BatchLimits,
    },
    /// Train a model (see [`crate::train`]); resumes from the job's latest checkpoint.
    Train(TrainJob),
    /// One rank of a data-parallel training job, claimed with the rest of its gang.
    TrainRank(RankJob),
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
            JobSpec::TrainRank(_) => "train_rank",
            JobSpec::Profile { .. } => "profile",
        }
    }

    /// The registered model the job reads (prefetches, serves, trains or profiles), if any.
    pub fn model(&self) -> Option<Uuid> {
        match self {
            JobSpec::Prefetch { model } | JobSpec::Serve { model, .. } | JobSpec::Profile { model, .. } => Some(*model),
            JobSpec::Train(train) | JobSpec::TrainRank(RankJob { train, .. }) => match &train.model {
                TrainModel::Registered { id, .. } => Some(*id),
                TrainModel::Mlp { .. } => None,
            },
        }
    }
}

/// `POST /api/v1/jobs`, in one of two shapes told apart by `spec`: a training job writes
/// its fields at the top level (issue 6's body, [`TrainSpec`]); a job of any other kind
/// nests its spec, tagged by `kind`, under `spec` ([`GenericJob`]).
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(untagged)]
pub enum CreateJob {
    Train(TrainSpec),
    Generic(GenericJob),
}

impl CreateJob {
    /// Reads a body. A mistake comes back with the JSON path of the field at fault
    /// (`task.validation_split`, `spec.model`; `.` when a field is missing).
    pub fn from_json(body: serde_json::Value) -> Result<CreateJob, serde_path_to_error::Error<serde_json::Error>> {
        if body.get("spec").is_some() {
            serde_path_to_error::deserialize(body).map(CreateJob::Generic)
        } else {
            serde_path_to_error::deserialize(body).map(CreateJob::Train)
        }
    }

    pub fn name(&self) -> &str {
        match self {
            CreateJob::Train(train) => &train.name,
            CreateJob::Generic(job) => &job.name,
        }
    }

    pub fn max_attempts(&self) -> Option<u32> {
        match self {
            CreateJob::Train(train) => train.max_attempts,
            CreateJob::Generic(job) => job.max_attempts,
        }
    }
}

impl<'de> Deserialize<'de> for CreateJob {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<CreateJob, D::Error> {
        let body = serde_json::Value::deserialize(deserializer)?;
        CreateJob::from_json(body).map_err(serde::de::Error::custom)
    }
}

/// A job of a kind other than training: `{"name", "spec": {"kind": …}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct GenericJob {
    pub name: String,
    pub spec: GenericSpec,
    /// How many times an expired lease may requeue the job before it fails (default 3).
    #[serde(default)]
    pub max_attempts: Option<u32>,
}

/// What a [`GenericJob`] asks for, as the user names it; the server resolves it into a
/// [`JobSpec`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum GenericSpec {
    /// Warm a worker's model cache ([`JobSpec::Prefetch`]).
    Prefetch {
        /// The id or name of a model.
        model: String,
    },
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
    /// Times the job was preempted (checkpointed and stopped to free its slices); these
    /// runs are not counted in `attempts`.
    #[serde(default)]
    pub preemptions: u32,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::deployments::BatchLimits;

    #[test]
    fn a_serve_spec_keeps_its_batch_limits_at_the_top_level_on_the_wire() {
        let spec = JobSpec::Serve {
            deployment: Uuid::nil(),
            model: Uuid::nil(),
            limits: BatchLimits { max_batch_tokens: 4096, max_batch_requests: 16 },
        };
        let json = serde_json::to_value(&spec).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "kind": "serve",
                "deployment": Uuid::nil(),
                "model": Uuid::nil(),
                "max_batch_tokens": 4096,
                "max_batch_requests": 16,
            })
        );
        assert_eq!(serde_json::from_value::<JobSpec>(json).unwrap(), spec);
    }
}

#[cfg(test)]
mod create_job_tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_body_with_spec_is_generic_and_one_without_is_training() {
        let generic = CreateJob::from_json(json!({"name": "warm", "spec": {"kind": "prefetch", "model": "tiny"}}));
        let expected = GenericJob {
            name: "warm".into(),
            spec: GenericSpec::Prefetch { model: "tiny".into() },
            max_attempts: None,
        };
        assert_eq!(generic.unwrap(), CreateJob::Generic(expected));
        let train = CreateJob::from_json(json!({"name": "digits", "max_attempts": 2, "seed": 1}));
        assert_eq!(train.unwrap_err().path().to_string(), ".", "a training body missing fields");
    }

    #[test]
    fn mistakes_are_named_by_their_path() {
        let error = CreateJob::from_json(json!({"name": "n", "learning_rate": 0.1})).unwrap_err();
        assert_eq!(error.path().to_string(), "learning_rate");
        let error = CreateJob::from_json(json!({"name": "n", "spec": {"kind": "prefetch"}})).unwrap_err();
        assert!(error.to_string().starts_with("spec"), "{error}");
        assert!(error.to_string().contains("model"), "{error}");
    }

    #[test]
    fn a_misspelt_field_of_a_generic_job_is_refused_by_name() {
        let spec = json!({"kind": "prefetch", "model": "tiny"});
        let error = CreateJob::from_json(json!({"name": "n", "spec": spec, "max_attempt": 2})).unwrap_err();
        assert!(error.to_string().contains("unknown field `max_attempt`"), "{error}");
        let spec = json!({"kind": "prefetch", "model": "tiny", "modle": "other"});
        let error = CreateJob::from_json(json!({"name": "n", "spec": spec})).unwrap_err();
        assert!(error.to_string().starts_with("spec"), "{error}");
        assert!(error.to_string().contains("unknown field `modle`"), "{error}");
    }
}
