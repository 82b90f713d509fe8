//! Deployments: a model served under a name by a number of replicas, each an engine
//! bound to one device slice of one worker.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

/// Either a replica count (default 1) or a throughput SLO, which the scheduler turns into
/// replicas bound to MIG slices with the partition planner.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(try_from = "CreateDeploymentBody")]
pub struct CreateDeployment {
    /// The name clients call it by (`model` in `/v1/embeddings`, `/v2/models/{name}`).
    pub name: String,
    /// Id or name of a registered model.
    pub model: String,
    /// Replicas to run; not given together with `throughput`.
    #[schema(default = 1)]
    pub replicas: u32,
    /// How each replica's engine batches (both limits default when left out).
    #[serde(flatten)]
    pub limits: BatchLimits,
    /// Throughput SLO in requests per second, instead of `replicas`.
    #[serde(default)]
    pub throughput: Option<f64>,
    /// p99 latency SLO in milliseconds (with `throughput`).
    #[serde(default)]
    pub latency_ms: Option<f64>,
    /// Lend the slices its measured traffic leaves idle to training (default false).
    #[serde(default)]
    pub loanable: bool,
    /// With `loanable`: the fraction above the measured request rate that keeps serving
    /// (default 0.2, at most 4).
    #[serde(default)]
    pub reclaim_headroom: Option<f64>,
}

/// Headroom a loanable deployment keeps when none is given.
pub const DEFAULT_RECLAIM_HEADROOM: f64 = 0.2;
/// The largest headroom accepted: five times the measured rate stays served.
pub const MAX_RECLAIM_HEADROOM: f64 = 4.0;

/// Refuses a headroom that is not a number between 0 and [`MAX_RECLAIM_HEADROOM`].
pub fn check_reclaim_headroom(headroom: f64) -> Result<(), String> {
    if headroom.is_finite() && (0.0..=MAX_RECLAIM_HEADROOM).contains(&headroom) {
        Ok(())
    } else {
        Err(format!(
            "reclaim_headroom is the fraction above the measured request rate that keeps serving: give a number \
             from 0 to {MAX_RECLAIM_HEADROOM} (0.2 keeps 20% headroom)."
        ))
    }
}

/// The body as sent, so that giving both `replicas` and `throughput` can be refused (and
/// unknown fields, which `deny_unknown_fields` cannot do beside a flattened field).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateDeploymentBody {
    name: String,
    model: String,
    #[serde(default)]
    replicas: Option<u32>,
    #[serde(default)]
    max_batch_tokens: Option<u32>,
    #[serde(default)]
    max_batch_requests: Option<u32>,
    #[serde(default)]
    throughput: Option<f64>,
    #[serde(default)]
    latency_ms: Option<f64>,
    #[serde(default)]
    loanable: Option<bool>,
    #[serde(default)]
    reclaim_headroom: Option<f64>,
}

impl TryFrom<CreateDeploymentBody> for CreateDeployment {
    type Error = String;

    fn try_from(body: CreateDeploymentBody) -> Result<CreateDeployment, String> {
        let replicas = match (body.replicas, body.throughput) {
            (Some(_), Some(_)) => {
                return Err("give either \"replicas\" or a throughput SLO (\"throughput\", \"latency_ms\"), not both".into())
            }
            (None, None) if body.latency_ms.is_some() => {
                return Err("\"latency_ms\" comes with \"throughput\": add the requests per second to meet".into())
            }
            (Some(n), None) => n,
            (None, Some(_)) => 0,
            (None, None) => 1,
        };
        if body.reclaim_headroom.is_some() && body.loanable != Some(true) {
            return Err("\"reclaim_headroom\" comes with \"loanable\": true (a deployment that lends nothing keeps all its slices)".into());
        }
        let defaults = BatchLimits::DEFAULT;
        Ok(CreateDeployment {
            name: body.name,
            model: body.model,
            replicas,
            limits: BatchLimits {
                max_batch_tokens: body.max_batch_tokens.unwrap_or(defaults.max_batch_tokens),
                max_batch_requests: body.max_batch_requests.unwrap_or(defaults.max_batch_requests),
            },
            throughput: body.throughput,
            latency_ms: body.latency_ms,
            loanable: body.loanable.unwrap_or(false),
            reclaim_headroom: body.reclaim_headroom,
        })
    }
}

/// How one replica's engine forms batches: a token budget and a request cap. One type from
/// the REST body through the job spec and the engine process's command line to the batcher.
/// Both fields default when absent, so bodies and stored job specs that leave them out keep
/// today's meaning.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[cfg_attr(feature = "clap", derive(clap::Args))]
pub struct BatchLimits {
    /// Most tokens one batch may hold (default 16384).
    #[serde(default = "BatchLimits::default_max_batch_tokens")]
    #[schema(default = 16384)]
    #[cfg_attr(feature = "clap", arg(long, default_value_t = BatchLimits::DEFAULT.max_batch_tokens))]
    pub max_batch_tokens: u32,
    /// Most requests one batch may hold (default 64).
    #[serde(default = "BatchLimits::default_max_batch_requests")]
    #[schema(default = 64)]
    #[cfg_attr(feature = "clap", arg(long, default_value_t = BatchLimits::DEFAULT.max_batch_requests))]
    pub max_batch_requests: u32,
}

impl BatchLimits {
    pub const DEFAULT: BatchLimits = BatchLimits { max_batch_tokens: 16_384, max_batch_requests: 64 };
    /// A whole max-length input (512 tokens for BERT) must fit one batch.
    const TOKENS: std::ops::RangeInclusive<u32> = 512..=1 << 20;
    const REQUESTS: std::ops::RangeInclusive<u32> = 1..=4096;

    fn default_max_batch_tokens() -> u32 {
        Self::DEFAULT.max_batch_tokens
    }

    fn default_max_batch_requests() -> u32 {
        Self::DEFAULT.max_batch_requests
    }

    /// Refuses limits no engine should run with, in a sentence that says what to change.
    pub fn validate(&self) -> Result<(), String> {
        if Self::TOKENS.contains(&self.max_batch_tokens) && Self::REQUESTS.contains(&self.max_batch_requests) {
            return Ok(());
        }
        Err("max_batch_tokens must be between 512 and 1048576 (a whole max-length input must fit) and \
             max_batch_requests between 1 and 4096."
            .into())
    }
}

impl Default for BatchLimits {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// `PATCH`: any of the replica count, whether it lends idle slices, and its headroom.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UpdateDeployment {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loanable: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reclaim_headroom: Option<f64>,
}

/// `pending → loading → ready`, or `failed` with the reason shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ServingState {
    Pending,
    Loading,
    Ready,
    Failed,
}

impl ServingState {
    pub fn as_str(self) -> &'static str {
        match self {
            ServingState::Pending => "pending",
            ServingState::Loading => "loading",
            ServingState::Ready => "ready",
            ServingState::Failed => "failed",
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Replica {
    pub id: Uuid,
    pub state: ServingState,
    pub worker_id: Option<Uuid>,
    /// Why the replica is in its state (a load failure, a requeue after a worker died).
    pub message: Option<String>,
    /// How many times the replica has been placed.
    pub attempts: u32,
    /// The device slice (`MIG-…`/`GPU-…` uuid) the replica is bound to, while placed.
    #[serde(default)]
    pub slice: Option<String>,
    /// The worker's engine endpoint the gateway forwards to, once the replica is ready
    /// (only the server may call it: it wants the worker's engine token).
    pub endpoint: Option<String>,
    pub updated_at: DateTime<Utc>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Deployment {
    pub id: Uuid,
    pub name: String,
    pub model_id: Uuid,
    pub model_name: String,
    pub owner: String,
    /// Replicas asked for.
    pub replicas: u32,
    pub ready_replicas: u32,
    pub state: ServingState,
    /// Why the deployment is not ready, when it is not.
    pub reason: Option<String>,
    #[serde(flatten)]
    pub limits: BatchLimits,
    pub replica_status: Vec<Replica>,
    /// For a deployment given a throughput SLO: the plan behind its replicas.
    #[serde(default)]
    pub slo: Option<crate::mig::SloStatus>,
    /// It lends the slices its measured traffic leaves idle to training.
    #[serde(default)]
    pub loanable: bool,
    /// Fraction above the measured request rate that keeps serving.
    #[serde(default)]
    pub reclaim_headroom: f64,
    /// Slices lent to training now (loaned or being reclaimed); `replicas` less these
    /// are the replicas that serve.
    #[serde(default)]
    pub loaned_slices: u32,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// Latency percentiles, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Percentiles {
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
}

/// Traffic over one span of time. Latency is the gateway's, from picking a replica to
/// its answer, over the requests that succeeded; batch figures are the mean, over those
/// requests, of the batch each was computed in.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TrafficSummary {
    pub requests: u64,
    /// Requests answered with an error (the engine refused them, or no replica could).
    pub errors: u64,
    /// Real tokens computed for the requests that succeeded.
    pub tokens: u64,
    pub latency_ms: Option<Percentiles>,
    pub mean_batch_size: Option<f64>,
    pub mean_batch_tokens: Option<f64>,
}

/// One slice of the rolling window.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TrafficBucket {
    pub start: DateTime<Utc>,
    /// Requests per second over this bucket.
    pub request_rate: f64,
    #[serde(flatten)]
    pub traffic: TrafficSummary,
}

/// What this server has forwarded to a deployment: totals since the server started and
/// a rolling window of the last minutes, oldest bucket first. Each server of a shared
/// database counts only the requests that reached it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct DeploymentStats {
    pub deployment: Uuid,
    /// When this server started counting.
    pub since: DateTime<Utc>,
    pub total: TrafficSummary,
    /// Requests per second over the last minute.
    pub request_rate: f64,
    pub window_seconds: u32,
    pub bucket_seconds: u32,
    /// The whole window in one summary.
    pub window: TrafficSummary,
    pub buckets: Vec<TrafficBucket>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_limits_left_out_take_the_defaults() {
        let limits: BatchLimits = serde_json::from_str(r#"{"max_batch_requests": 8}"#).unwrap();
        assert_eq!(limits, BatchLimits { max_batch_tokens: 16_384, max_batch_requests: 8 });
        assert_eq!(serde_json::from_str::<BatchLimits>("{}").unwrap(), BatchLimits::default());
    }

    #[test]
    fn batch_limits_refuse_a_budget_smaller_than_one_long_input() {
        assert!(BatchLimits::default().validate().is_ok());
        let small = BatchLimits { max_batch_tokens: 511, ..BatchLimits::default() };
        assert!(small.validate().unwrap_err().contains("between 512 and 1048576"));
        assert!(BatchLimits { max_batch_requests: 0, ..BatchLimits::default() }.validate().is_err());
        assert!(BatchLimits { max_batch_requests: 4097, ..BatchLimits::default() }.validate().is_err());
        assert!(BatchLimits { max_batch_tokens: 1 << 20, max_batch_requests: 4096 }.validate().is_ok());
    }
}
