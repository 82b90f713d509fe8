//! Device slices and what the scheduler does with them: the slices a worker offers (MIG
//! instances, whole GPUs), a deployment's throughput SLO with the slices planned for it and
//! the partition steps, and the throughput tables the planner reads (measured by the
//! `profile` job or estimated from measurements).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

/// One device slice a serving replica can be bound to: a MIG instance, or a whole GPU
/// when MIG is off. A CPU-only worker has none (it serves on its thread pool).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Slice {
    /// `MIG-…` for a MIG instance, the GPU's `GPU-…` uuid for a whole GPU. Processes bind
    /// to it with `CUDA_VISIBLE_DEVICES=<uuid>`.
    pub uuid: String,
    pub gpu_uuid: String,
    pub gpu_index: u32,
    /// The GPU's model as the MIG catalog names it (`H100-80GB`, `A100-40GB`, …), when the
    /// worker recognised it; the planner uses only GPUs it knows.
    pub gpu_model: Option<String>,
    /// MIG profile (`1g.10gb`); `None` for a whole GPU.
    pub profile: Option<String>,
    /// Start on the GPU's memory-slice axis; `None` when unknown or for a whole GPU.
    pub start: Option<u8>,
    pub memory_bytes: u64,
    /// From `--simulate-gpus`: advertised like a real slice, but replicas bound to it run
    /// the CPU engine.
    #[serde(default)]
    pub simulated: bool,
}

/// A slice as `GET /api/v1/workers` shows it: what holds it now.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SliceStatus {
    #[serde(flatten)]
    pub slice: Slice,
    /// The live replica (serve job) bound to it.
    pub replica: Option<Uuid>,
    /// The deployment that replica serves; shown only to its owner and to admins.
    pub deployment: Option<String>,
    /// A replica or a training rank holds the slice, whether or not the caller may see whose.
    #[serde(default)]
    pub in_use: bool,
    /// Serving, lent to training, or being taken back (issue 16).
    #[serde(default)]
    pub loan_state: crate::loaning::LoanState,
    /// The deployment that lent it, while loaned or reclaiming (named as `deployment` is).
    #[serde(default)]
    pub lender: Option<String>,
    /// The training job whose rank holds it (shown only to its owner and to admins).
    #[serde(default)]
    pub training_job: Option<Uuid>,
}

/// A slice the planner chose for an SLO deployment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct PlannedSlice {
    pub slice: String,
    pub worker_id: Uuid,
    pub gpu_uuid: String,
    pub gpu_model: String,
    pub profile: String,
    pub start: u8,
    /// Requests per second the deployment's model gets from it under the latency SLO.
    pub throughput: f64,
    /// The throughput comes from the cost model, not a measurement.
    pub estimated: bool,
}

/// One step of a partition transition (MIG-serving's exchange-and-compact).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TransitionStep {
    /// `create_slice`, `start_replica`, `drain_and_stop_replica` or `destroy_slice`.
    pub action: String,
    /// The GPU; `None` for a GPU the fleet does not have (the plan needs more GPUs).
    pub gpu_uuid: Option<String>,
    pub worker_id: Option<Uuid>,
    pub profile: String,
    pub start: u8,
    /// The deployment the replica serves; `None` also when it is another tenant's (only
    /// its owner and admins see its name).
    pub service: Option<String>,
}

/// What the scheduler planned for a throughput SLO.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SloStatus {
    /// Required throughput, requests per second.
    pub throughput: f64,
    /// p99 latency SLO the throughput table is read under.
    pub latency_ms: Option<f64>,
    /// What the planned slices give, requests per second.
    pub capacity: f64,
    pub slices: Vec<PlannedSlice>,
    /// Whether `steps` were applied (the GPUs' workers allow repartitioning) or are what
    /// the planner would change.
    pub applied: bool,
    pub steps: Vec<TransitionStep>,
    /// GPUs the better plan would need beyond the fleet's.
    pub extra_gpus: usize,
    /// A sentence on the outcome: met, short by how much, what would help.
    pub note: String,
}

/// One measurement of the profiler: a batch size on one slice kind.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ProfilePoint {
    pub batch_size: u32,
    /// Requests per second at this batch size.
    pub throughput: f64,
    pub p99_ms: f64,
}

/// What a `profile` job reports for one slice kind (`POST /api/v1/agent/jobs/{id}/profiles`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ProfileReport {
    pub gpu_model: String,
    pub profile: String,
    /// Measured on the CPU engine behind a simulated slice.
    pub simulated: bool,
    pub points: Vec<ProfilePoint>,
}

/// A row of a model's throughput table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ThroughputEntry {
    pub gpu_model: String,
    pub profile: String,
    pub batch_size: u32,
    pub throughput: f64,
    pub p99_ms: f64,
    /// From the cost model (compute-slice scaling of a measured profile), not measured.
    pub estimated: bool,
    /// Measured (or estimated from a measurement) on the CPU engine of a simulated slice.
    pub simulated: bool,
    pub measured_at: Option<DateTime<Utc>>,
}

/// `GET /api/v1/models/{id}/profiles`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ModelProfiles {
    pub model_id: Uuid,
    /// Sub-linear exponent of the cost model: throughput ∝ compute slices^exponent.
    pub scaling_exponent: f64,
    pub entries: Vec<ThroughputEntry>,
}

/// `POST /api/v1/models/{id}/profiles`: queue a profiler job. The body may be left out.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateProfile {
    /// Batch sizes to measure (default 1, 2, 4, …, 64).
    #[serde(default)]
    pub batch_sizes: Option<Vec<u32>>,
}
