//! Serve one replica: cache the model, load it, warm it up with a full batch (so a
//! model too big for the batch budget fails now, not under load), put it behind a
//! batching queue on the engine endpoint, and report `running` with its URL. It serves
//! until the server takes the lease back; then the task is aborted and the registration
//! dropped, which takes the replica off the endpoint.

use std::sync::Arc;
use std::time::Instant;

use tessera_api::jobs::JobState;
use uuid::Uuid;

use super::{prefetch, JobContext, JobError};
use crate::engine::{EmbeddingModel, EngineError};
use crate::serve::batcher::{BatchLimits, Queue, Task};
use crate::serve::binding::{bind, Binding, GPU_PROCESSES};
use crate::serve::endpoint::Replica;

/// Requests that may wait per replica, as a multiple of the batch's request cap.
const QUEUED_BATCHES: usize = 8;

fn joined<T>(result: Result<Result<T, EngineError>, tokio::task::JoinError>) -> Result<T, JobError> {
    result.map_err(|e| JobError::Engine(EngineError::Unsupported(format!("the loading thread panicked: {e}"))))?.map_err(Into::into)
}

/// Runs one batch as large as the budget allows, of the longest inputs the model takes.
fn warm_up(model: &EmbeddingModel, task: Task, max_batch_tokens: usize, max_batch_requests: usize) -> Result<usize, EngineError> {
    let text = "warm up ".repeat(model.max_input_tokens());
    let longest = model.tokenize(&text, true)?;
    let count = (max_batch_tokens / longest.len()).clamp(1, max_batch_requests);
    let batch = model.pack(&vec![longest.as_slice(); count], true)?;
    match task {
        Task::Embed => model.embed_batch(&batch).map(|_| ()),
        Task::Classify => model.classify_batch(&batch).map(|_| ()),
    }?;
    Ok(batch.total_tokens())
}

pub async fn run(context: &JobContext, model_id: Uuid, max_batch_tokens: usize, max_batch_requests: usize) -> Result<String, JobError> {
    let bound = match bind(context.slice.as_ref(), GPU_PROCESSES) {
        Binding::Cpu { note } => note,
        // Unreachable until GPU_PROCESSES is true: the per-slice process is the CUDA build's.
        Binding::Process { env } => {
            return Err(JobError::Profile(format!("per-slice engine processes ({env:?}) are not built yet")))
        }
    };
    if !bound.is_empty() {
        context.log(format!("replica {bound}")).await?;
    }
    let (folder, summary) = prefetch::fetch(context, model_id).await?;
    context.log(summary).await?;

    let started = Instant::now();
    let model = Arc::new(joined(tokio::task::spawn_blocking(move || EmbeddingModel::load(&folder)).await)?);
    let task = if model.labels().is_some() { Task::Classify } else { Task::Embed };
    context.log(format!("loaded in {:.2} s; serving {task:?}", started.elapsed().as_secs_f64())).await?;

    let started = Instant::now();
    let warm = model.clone();
    let tokens = joined(tokio::task::spawn_blocking(move || warm_up(&warm, task, max_batch_tokens, max_batch_requests)).await)?;
    let secs = started.elapsed().as_secs_f64();
    context.log(format!("warm-up batch of {tokens} tokens took {secs:.2} s")).await?;
    context.metric("warmup_tokens_per_s", 0, tokens as f64 / secs.max(1e-9)).await?;

    let limits = BatchLimits { max_batch_tokens, max_batch_requests, queue_capacity: QUEUED_BATCHES * max_batch_requests };
    let queue = Queue::start(model.clone(), task, limits);
    let _registration = context.endpoint.add(context.job, Replica { model, model_id, task, queue });
    let url = context.endpoint.replica_url(context.job);
    let message = match &context.slice {
        Some(slice) => format!("Serving at {url} on slice {}.", slice.uuid),
        None => format!("Serving at {url}."),
    };
    context.client.status(context.job, JobState::Running, Some(message), Some(url)).await?;
    std::future::pending().await
}
