//! The protocol between the server's gateway and a worker's engine endpoint (internal:
//! the worker only accepts the engine token the server gave it at registration).

use serde::{Deserialize, Serialize};

/// One input: text to tokenize, or token ids already made by the client.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum EngineInput {
    Text(String),
    Ids(Vec<u32>),
}

/// `POST <endpoint>/embed` and `POST <endpoint>/classify`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InferRequest {
    pub inputs: Vec<EngineInput>,
    /// Cut inputs longer than the model's maximum instead of refusing them.
    #[serde(default = "yes")]
    pub truncate: bool,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InferResponse {
    /// One row per input: the pooled embedding, or the classifier's logits.
    pub outputs: Vec<Vec<f32>>,
    /// Tokens per input after truncation.
    pub tokens: Vec<u32>,
    /// Class names of the logits' columns (classification only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub labels: Vec<String>,
    pub timings: Timings,
}

/// Where the time went, in microseconds (also sent as `x-*-time` response headers).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct Timings {
    pub queue_us: u64,
    pub tokenization_us: u64,
    pub inference_us: u64,
    /// Requests and tokens in the batch this request was computed in.
    pub batch_size: u32,
    pub batch_tokens: u32,
}

/// The engine's errors: `{"error": "...", "kind": "..."}` with the matching status
/// (422 validation, 413 too long, 429 queue full, 503 not ready).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EngineError {
    pub error: String,
    pub kind: String,
}

/// The kind of an engine's 503 for a request it did not take (the replica is not served
/// there, or its queue closed): nothing was computed, so another replica may take it.
pub const NOT_SERVING: &str = "not_serving";

/// The kind of an engine's 503 for a request its replica stopped before computing: as
/// with [`NOT_SERVING`], another replica may take it.
pub const UNHEALTHY: &str = "unhealthy";

/// `GET <endpoint>/info`
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EngineInfo {
    pub model_id: String,
    pub architecture: String,
    /// Embedding width (or number of classes for a classifier).
    pub dimensions: u32,
    pub max_input_tokens: u32,
    pub labels: Vec<String>,
}
