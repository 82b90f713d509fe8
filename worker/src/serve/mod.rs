//! Serving replicas on this worker: each replica is a loaded model behind a batching
//! queue, reachable through the worker's engine endpoint at `/replicas/{id}/…`, or
//! through its own engine process's endpoint when it is bound to a slice (`process`).

pub mod batcher;
pub mod binding;
pub mod endpoint;
pub mod process;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use tessera_api::deployments::BatchLimits;
use uuid::Uuid;

use crate::engine::{EmbeddingModel, EngineError, LoadOptions};
use batcher::{Admission, Queue, Task};
use endpoint::Replica;

/// What loading a replica took, for its log.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct LoadReport {
    pub task: String,
    /// What the GEMMs multiply in (`EmbeddingModel::gemm_dtype`).
    pub gemm_dtype: String,
    pub load_secs: f64,
    pub warmup_tokens: usize,
    pub warmup_secs: f64,
}

impl LoadReport {
    pub fn lines(&self) -> [String; 2] {
        [
            format!("loaded in {:.2} s; serving {}; GEMMs in {}", self.load_secs, self.task, self.gemm_dtype),
            format!("warm-up batch of {} tokens took {:.2} s", self.warmup_tokens, self.warmup_secs),
        ]
    }

    pub fn warmup_tokens_per_s(&self) -> f64 {
        self.warmup_tokens as f64 / self.warmup_secs.max(1e-9)
    }
}

fn joined<T>(result: Result<Result<T, EngineError>, tokio::task::JoinError>) -> Result<T, EngineError> {
    result.map_err(|e| EngineError::Unsupported(format!("the loading thread panicked: {e}")))?
}

/// Runs one batch as large as the replica's budget allows, of the longest inputs the model
/// takes, as the queue would compute it.
fn warm_up(model: &EmbeddingModel, task: Task, limits: BatchLimits) -> Result<usize, EngineError> {
    let limits = batcher::compute_limits(model, limits);
    let text = "warm up ".repeat(model.max_input_tokens());
    let longest = model.tokenize(&text, true)?;
    let count = (limits.max_batch_tokens as usize / longest.len()).clamp(1, limits.max_batch_requests as usize);
    batcher::run(model, task, &vec![longest.as_slice(); count])?;
    Ok(count * longest.len())
}

/// Loads the model in `folder`, warms it up with a full batch (so a model too big for the
/// batch budget fails now, not under load) and puts it behind a batching queue that admits
/// requests within `admission`, its waits first estimated from the warm-up's tokens/s.
pub async fn load_replica(
    folder: PathBuf,
    options: LoadOptions,
    model_id: Uuid,
    limits: BatchLimits,
    admission: Admission,
) -> Result<(Replica, LoadReport), EngineError> {
    let started = Instant::now();
    let model = Arc::new(joined(tokio::task::spawn_blocking(move || EmbeddingModel::load_with(&folder, &options)).await)?);
    let task = if model.labels().is_some() { Task::Classify } else { Task::Embed };
    let load_secs = started.elapsed().as_secs_f64();

    let started = Instant::now();
    let warm = model.clone();
    let warmup_tokens =
        joined(tokio::task::spawn_blocking(move || warm_up(&warm, task, limits)).await)?;
    let report =
        LoadReport { task: format!("{task:?}"), gemm_dtype: model.gemm_dtype().into(), load_secs, warmup_tokens, warmup_secs: started.elapsed().as_secs_f64() };

    let queue = Queue::start(model.clone(), task, limits, admission, report.warmup_tokens_per_s());
    Ok((Replica { model, model_id, task, queue }, report))
}
