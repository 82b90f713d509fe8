//! Deployments: a model served under a name by a number of replicas, each an engine
//! bound to one device slice of one worker.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct CreateDeployment {
    /// The name clients call it by (`model` in `/v1/embeddings`, `/v2/models/{name}`).
    pub name: String,
    /// Id or name of a registered model.
    pub model: String,
    #[serde(default = "one")]
    pub replicas: u32,
    /// Most tokens one batch may hold (default 16384).
    #[serde(default)]
    pub max_batch_tokens: Option<u32>,
    /// Most requests one batch may hold (default 64).
    #[serde(default)]
    pub max_batch_requests: Option<u32>,
}

fn one() -> u32 {
    1
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct UpdateDeployment {
    pub replicas: u32,
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

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Replica {
    pub id: Uuid,
    pub state: ServingState,
    pub worker_id: Option<Uuid>,
    /// Why the replica is in its state (a load failure, a requeue after a worker died).
    pub message: Option<String>,
    /// How many times the replica has been placed.
    pub attempts: u32,
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
    pub max_batch_tokens: u32,
    pub max_batch_requests: u32,
    pub replica_status: Vec<Replica>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}
