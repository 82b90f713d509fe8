//! The profiler: measures a model's throughput and p99 latency at each batch size on each
//! kind of slice this worker offers, for the planner's throughput table.
//!
//! A slice kind is measured on the engine that would serve a replica bound to it (see
//! `serve::binding`): where that is an engine process confined to the slice (a real slice
//! in the cuda build, or any slice with `--slice-processes`), the profiler starts one on a
//! slice of that kind and times whole requests to it, as the gateway sends them; a
//! simulated slice served in this process is timed on the CPU engine directly. Figures
//! from the CPU are reported with `simulated: true`. A real slice on a build without GPU
//! processes is skipped: a CPU figure recorded under a GPU profile would mislead the
//! planner (the server estimates unmeasured profiles). Each kind is measured separately.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_api::deployments::BatchLimits;
use tessera_api::engine::{EngineInput, InferRequest};
use tessera_api::mig::{ProfilePoint, ProfileReport};
use uuid::Uuid;

use super::{prefetch, JobContext, JobError};
use crate::engine::{EmbeddingModel, EngineError, LoadOptions};
use crate::serve::binding::{bind, Binding};
use crate::serve::process::{EngineProcess, Spawn};

/// The input every measured request carries: a sentence of ordinary length.
const SAMPLE: &str = "The quick brown fox jumps over the lazy dog while the committee reviews \
                      the quarterly report on serving latency across the cluster.";

/// Timed runs per batch size: enough for a p99 over small batches, few for large ones.
fn runs_for(batch_size: u32) -> usize {
    (128 / batch_size.max(1) as usize).clamp(4, 32)
}

/// The 99th percentile of `samples` (nearest rank).
pub fn p99(samples: &mut [f64]) -> f64 {
    samples.sort_by(|a, b| a.total_cmp(b));
    let rank = ((samples.len() as f64) * 0.99).ceil() as usize;
    samples[rank.clamp(1, samples.len()) - 1]
}

/// A point from one warm-up and `runs_for(batch_size)` timed runs, in milliseconds.
fn point(batch_size: u32, mut latencies: Vec<f64>) -> ProfilePoint {
    let mean = latencies.iter().sum::<f64>() / latencies.len() as f64;
    ProfilePoint { batch_size, throughput: batch_size as f64 * 1000.0 / mean.max(1e-6), p99_ms: p99(&mut latencies) }
}

/// Times batches of `batch_size` copies of the sample on the engine in this process.
fn measure(model: &EmbeddingModel, batch_size: u32) -> Result<ProfilePoint, EngineError> {
    let tokens = model.tokenize(SAMPLE, true)?;
    let batch = model.pack(&vec![tokens.as_slice(); batch_size as usize], true)?;
    let run = || -> Result<f64, EngineError> {
        let started = Instant::now();
        match model.labels() {
            Some(_) => model.classify_batch(&batch).map(|_| ())?,
            None => model.embed_batch(&batch).map(|_| ())?,
        }
        Ok(started.elapsed().as_secs_f64() * 1000.0)
    };
    run()?; // warm-up
    let latencies = (0..runs_for(batch_size)).map(|_| run()).collect::<Result<Vec<f64>, _>>()?;
    Ok(point(batch_size, latencies))
}

/// The longest one measured batch may take: an engine process that hangs fails the
/// profile job rather than holding the worker's batch slot for good.
const BATCH_TIMEOUT: Duration = Duration::from_secs(300);

/// Times requests of `batch_size` copies of the sample to an engine process, one at a
/// time, so each is computed as one batch.
async fn measure_process(engine: &EngineProcess, token: &str, batch_size: u32) -> Result<ProfilePoint, JobError> {
    let route = if engine.report.task == "Classify" { "classify" } else { "embed" };
    let request = InferRequest { inputs: vec![EngineInput::Text(SAMPLE.into()); batch_size as usize], truncate: true };
    let http = reqwest::Client::builder()
        .timeout(BATCH_TIMEOUT)
        .build()
        .map_err(|e| JobError::Profile(format!("building the engine client: {e}")))?;
    let mut latencies = Vec::new();
    for run in 0..=runs_for(batch_size) {
        let started = Instant::now();
        let response = http
            .post(format!("{}/{route}", engine.url))
            .bearer_auth(token)
            .json(&request)
            .send()
            .await
            .map_err(|e| JobError::Profile(format!("the engine process did not answer: {e}")))?;
        if !response.status().is_success() {
            let status = response.status();
            let body = response.text().await.unwrap_or_default();
            return Err(JobError::Profile(format!("the engine process answered {status}: {body}")));
        }
        response.bytes().await.map_err(|e| JobError::Profile(format!("reading the engine's answer: {e}")))?;
        if run > 0 {
            latencies.push(started.elapsed().as_secs_f64() * 1000.0);
        }
    }
    Ok(point(batch_size, latencies))
}

/// How one slice kind is measured.
enum Bench {
    InProcess,
    Process(EngineProcess),
}

pub async fn run(context: &JobContext, model_id: Uuid, batch_sizes: Vec<u32>) -> Result<String, JobError> {
    // One slice of each kind: (GPU model, profile, simulated) → the slice.
    let mut kinds = BTreeMap::new();
    for slice in context.offered.iter() {
        let (Some(gpu_model), Some(profile)) = (&slice.gpu_model, &slice.profile) else {
            context.log(format!("skipping {}: not a MIG slice of a GPU model the planner knows", slice.uuid)).await?;
            continue;
        };
        match bind(Some(slice), context.binding) {
            Binding::Cpu { .. } if !slice.simulated => {
                context
                    .log(format!("skipping {}: this build has no GPU serving engine to measure it with", slice.uuid))
                    .await?;
            }
            _ => {
                kinds.entry((gpu_model.clone(), profile.clone(), slice.simulated)).or_insert_with(|| slice.clone());
            }
        }
    }
    if kinds.is_empty() {
        return Err(JobError::Profile(
            "this worker offers no slice it can measure; run the profiler on a worker with MIG slices (or --simulate-gpus)".into(),
        ));
    }
    let (folder, summary) = prefetch::fetch(context, model_id).await?;
    context.log(summary).await?;
    let max_batch = batch_sizes.iter().copied().max().unwrap_or(1);
    let mut in_process: Option<Arc<EmbeddingModel>> = None;
    let mut reports = Vec::new();
    for ((gpu_model, profile, simulated), slice) in kinds {
        let bench = match bind(Some(&slice), context.binding) {
            Binding::Process { env, gpu, .. } => {
                let limits = BatchLimits { max_batch_tokens: max_batch * 512, max_batch_requests: max_batch };
                let cpu_precision = context.binding.cpu_precision;
                let admission = context.binding.admission;
                let spawn = Spawn { folder: folder.clone(), model_id, replica: context.job, limits, admission, gpu, cpu_precision, env };
                Bench::Process(EngineProcess::start(&context.endpoint, spawn).await?)
            }
            Binding::Cpu { .. } => {
                if in_process.is_none() {
                    let folder = folder.clone();
                    let options = LoadOptions { dtype: context.binding.cpu_precision.dtype(), ..LoadOptions::default() };
                    let model = tokio::task::spawn_blocking(move || EmbeddingModel::load_with(&folder, &options))
                        .await
                        .map_err(|e| JobError::Profile(format!("the loading thread panicked: {e}")))??;
                    in_process = Some(Arc::new(model));
                }
                Bench::InProcess
            }
        };
        let engine_name = match (&bench, simulated) {
            (Bench::InProcess, _) => "CPU engine (simulated slice)".to_string(),
            (Bench::Process(engine), true) => format!("CPU engine process {} (simulated slice {})", engine.pid, slice.uuid),
            (Bench::Process(engine), false) => format!("GPU engine process {} on {}", engine.pid, slice.uuid),
        };
        let mut points = Vec::new();
        for &b in &batch_sizes {
            let point = match &bench {
                Bench::Process(engine) => measure_process(engine, &context.endpoint.token(), b).await?,
                Bench::InProcess => {
                    let engine = in_process.clone().expect("loaded above");
                    tokio::task::spawn_blocking(move || measure(&engine, b))
                        .await
                        .map_err(|e| JobError::Profile(format!("the measuring thread panicked: {e}")))??
                }
            };
            context
                .log(format!(
                    "{gpu_model} {profile} batch {b}: {:.1} req/s, p99 {:.1} ms on the {engine_name}",
                    point.throughput, point.p99_ms
                ))
                .await?;
            points.push(point);
        }
        reports.push(ProfileReport { gpu_model, profile, simulated, points });
    }
    let kinds = reports.len();
    context.client.profiles(context.job, &reports).await?;
    Ok(format!("Measured {kinds} slice kind(s) at batch sizes {batch_sizes:?}."))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn p99_is_the_nearest_rank() {
        let mut few = vec![3.0, 1.0, 2.0];
        assert_eq!(p99(&mut few), 3.0);
        let mut hundred: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(p99(&mut hundred), 99.0);
    }

    #[test]
    fn small_batches_get_more_runs_than_large_ones() {
        assert_eq!(runs_for(1), 32);
        assert_eq!(runs_for(64), 4);
    }
}
