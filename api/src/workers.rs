//! The worker protocol: register with an inventory, heartbeat, claim work, report.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

use crate::jobs::{JobSpec, JobState, MetricPoint};
use crate::mig::{Slice, SliceStatus};

/// What a worker host offers.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Inventory {
    pub hostname: String,
    pub cpu_cores: u32,
    pub memory_bytes: u64,
    #[serde(default)]
    pub gpus: Vec<Gpu>,
    /// The slices replicas can be bound to: each MIG instance, or each GPU without MIG.
    #[serde(default)]
    pub slices: Vec<Slice>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Gpu {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub memory_bytes: u64,
    /// `(major, minor)`, e.g. `(9, 0)` for an H100.
    pub compute_capability: (u32, u32),
    pub mig_enabled: bool,
    #[serde(default)]
    pub mig_instances: Vec<MigInstance>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct MigInstance {
    pub uuid: String,
    pub name: String,
    pub memory_bytes: u64,
}

/// `POST /api/v1/agent/register`, authenticated with the shared worker token.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct RegisterRequest {
    /// Stable name of the worker; registering again under the same name resumes it.
    pub name: String,
    pub version: String,
    pub inventory: Inventory,
    /// The operator lets the scheduler change this worker's MIG partitions (only
    /// simulated GPUs are repartitioned today; real ones get "would change" steps).
    #[serde(default)]
    pub allow_repartition: bool,
    /// The secret this worker got when it last registered. While a worker of this name
    /// is online (heartbeats fresh), only one that presents its secret may take the name
    /// over: a restart of the same worker, never a second machine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_secret: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct RegisterResponse {
    pub worker_id: Uuid,
    /// Secret for every later agent call (`Authorization: Bearer <secret>`).
    pub secret: String,
    pub heartbeat_interval_secs: u64,
    pub lease_ttl_secs: u64,
    /// Bearer token the server's gateway presents to this worker's engine endpoint.
    pub engine_token: String,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
pub struct Heartbeat {
    /// Jobs the worker is still working on: their leases are renewed.
    #[serde(default)]
    pub jobs: Vec<Uuid>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
pub struct HeartbeatResponse {
    /// Jobs the worker must stop: cancelled by a user, or no longer leased to it.
    pub stop: Vec<Uuid>,
    /// Training jobs (or ranks) to preempt: checkpoint at the step they are on, upload
    /// it, report `preempted` and stop. A rank of a gang that resizes in place is asked the
    /// same way and then posts at `…/regroup`, which says whether to re-form or report
    /// `preempted`. Absent from servers before issue 16, ignored by workers before it
    /// (their jobs then stop only when the lease is revoked).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub preempt: Vec<Uuid>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ClaimRequest {
    /// Job kinds this worker has room for: `prefetch`, `train`, `train_rank`, `profile`
    /// (a batch slot each), `serve` (a slice or the device), and `slice_rank`: only a rank
    /// the loaning round pinned to one of this worker's free slices (it holds the slice).
    pub kinds: Vec<String>,
}

/// A job leased to a worker.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Assignment {
    pub job_id: Uuid,
    pub spec: JobSpec,
    pub attempt: u32,
    pub lease_expires_at: DateTime<Utc>,
    /// For a serving replica on a worker with slices: the slice it is bound to.
    #[serde(default)]
    pub slice: Option<Slice>,
}

/// `POST /api/v1/agent/jobs/{id}/status`: only `running`, `succeeded`, `failed`, and
/// `preempted` for a training job told to preempt, once its checkpoint is uploaded.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct StatusReport {
    pub state: JobState,
    #[serde(default)]
    pub message: Option<String>,
    /// For a serving replica reported `running`: the URL its engine answers on.
    #[serde(default)]
    pub endpoint: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct LogBatch {
    pub lines: Vec<String>,
    /// An id the worker gives the batch, the same each time it sends it: a batch the server
    /// has stored under its id already is not appended again (a retry after a lost answer).
    #[serde(default)]
    pub batch: Option<Uuid>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct MetricBatch {
    pub points: Vec<MetricPoint>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum WorkerStatus {
    Online,
    Offline,
}

/// A worker as `GET /api/v1/workers` lists it.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Worker {
    pub id: Uuid,
    pub name: String,
    pub version: String,
    pub status: WorkerStatus,
    pub inventory: Inventory,
    /// The slices as the server records them, with the replica holding each.
    pub slices: Vec<SliceStatus>,
    pub allow_repartition: bool,
    pub registered_at: DateTime<Utc>,
    pub last_seen_at: DateTime<Utc>,
}
