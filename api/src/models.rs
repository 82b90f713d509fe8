//! The model registry: uploaded weights, config and tokenizer, addressed by digest.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Model {
    pub id: Uuid,
    pub name: String,
    /// `sha256:<hex>` over the sorted list of `(path, file digest)` pairs.
    pub digest: String,
    /// `architectures[0]` of `config.json`, e.g. `BertModel`.
    pub architecture: String,
    pub size_bytes: u64,
    pub files: Vec<ModelFile>,
    pub owner: String,
    pub created_at: DateTime<Utc>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ModelFile {
    /// Path inside the model folder, e.g. `1_Pooling/config.json`.
    pub path: String,
    /// `sha256:<hex>` of the file's bytes.
    pub digest: String,
    pub size_bytes: u64,
}
