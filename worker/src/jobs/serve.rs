//! Serve one replica: cache the model, load it and warm it up, put it behind a batching
//! queue on an engine endpoint (this worker's, or its own engine process's when the
//! replica is bound to a slice: see `serve::binding`), and report `running` with its URL.
//! It serves until the server takes the lease back; then the task is aborted and the
//! registration (or the engine process) dropped, which takes the replica off the air once
//! it answered what it admitted. A replica whose engine fails batch after batch (see
//! `batcher::Health`) ends failed, and the server restarts it.

use tessera_api::deployments::BatchLimits;
use tessera_api::jobs::JobState;
use uuid::Uuid;

use super::{prefetch, JobContext, JobError};
use crate::engine::LoadOptions;
use crate::serve::binding::{bind, Binding};
use crate::serve::{load_replica, process, LoadReport};

pub async fn run(context: &JobContext, model_id: Uuid, limits: BatchLimits) -> Result<String, JobError> {
    let binding = bind(context.slice.as_ref(), context.binding);
    let note = match &binding {
        Binding::Cpu { note } | Binding::Process { note, .. } => note.clone(),
    };
    if !note.is_empty() {
        context.log(format!("replica {note}")).await?;
    }
    let (folder, summary) = prefetch::fetch(context, model_id).await?;
    context.log(summary).await?;

    let cpu_precision = context.binding.cpu_precision;
    let cpu_options = LoadOptions { dtype: cpu_precision.dtype(), ..LoadOptions::default() };
    match binding {
        Binding::Cpu { .. } => {
            let (replica, report) = load_replica(folder, cpu_options, model_id, limits, context.binding.admission).await?;
            report_loaded(context, &report).await?;
            let health = replica.queue.health();
            let _registration = context.endpoint.add(context.job, replica);
            let url = context.endpoint.replica_url(context.job);
            report_running(context, &url, None).await?;
            // Failed, it is restarted by the server's repair tick (an engine process exits instead).
            Err(JobError::Broken(health.broken().await))
        }
        Binding::Process { env, gpu, .. } => {
            let admission = context.binding.admission;
            let spawn = process::Spawn { folder, model_id, replica: context.job, limits, admission, gpu, cpu_precision, env };
            let mut engine = process::EngineProcess::start(&context.endpoint, spawn).await?;
            report_loaded(context, &engine.report).await?;
            let url = engine.url.clone();
            report_running(context, &url, Some(engine.pid)).await?;
            Err(engine.wait().await.into())
        }
    }
}

async fn report_loaded(context: &JobContext, report: &LoadReport) -> Result<(), JobError> {
    for line in report.lines() {
        context.log(line).await?;
    }
    context.metric("warmup_tokens_per_s", 0, report.warmup_tokens_per_s()).await?;
    Ok(())
}

async fn report_running(context: &JobContext, url: &str, pid: Option<u32>) -> Result<(), JobError> {
    let process = pid.map(|pid| format!(" (engine process {pid})")).unwrap_or_default();
    let message = match &context.slice {
        Some(slice) => format!("Serving at {url} on slice {}{process}.", slice.uuid),
        None => format!("Serving at {url}."),
    };
    context.client.status(context.job, JobState::Running, Some(message), Some(url.to_string())).await?;
    Ok(())
}
