//! The profiler: measures a model's throughput and p99 latency at each batch size on each
//! kind of slice this worker offers, for the planner's throughput table.
//!
//! A simulated slice is measured on the CPU engine that serves a replica bound to it (see
//! `serve::binding`), in this process, so its figures are the CPU's and are reported with
//! `simulated: true`. A real GPU slice is skipped: measuring it needs an engine process
//! confined to it, which the profiler does not start yet, and a CPU figure recorded under
//! a GPU profile would mislead the planner (the server estimates unmeasured profiles).
//! Each kind is measured separately, even when two kinds share the CPU engine.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Instant;

use tessera_api::mig::{ProfilePoint, ProfileReport};
use uuid::Uuid;

use super::{prefetch, JobContext, JobError};
use crate::engine::{EmbeddingModel, EngineError};

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
    let mut latencies = (0..runs_for(batch_size))
        .map(|_| run())
        .collect::<Result<Vec<f64>, _>>()?;
    let mean = latencies.iter().sum::<f64>() / latencies.len() as f64;
    Ok(ProfilePoint {
        batch_size,
        throughput: batch_size as f64 * 1000.0 / mean.max(1e-6),
        p99_ms: p99(&mut latencies),
    })
}

pub async fn run(
    context: &JobContext,
    model_id: Uuid,
    batch_sizes: Vec<u32>,
) -> Result<String, JobError> {
    let mut kinds = BTreeSet::new();
    for slice in context.offered.iter() {
        let (Some(gpu_model), Some(profile)) = (&slice.gpu_model, &slice.profile) else {
            context
                .log(format!(
                    "skipping {}: not a MIG slice of a GPU model the planner knows",
                    slice.uuid
                ))
                .await?;
            continue;
        };
        if slice.simulated {
            kinds.insert((gpu_model.clone(), profile.clone(), slice.simulated));
        } else {
            context
                .log(format!(
                    "skipping {}: the profiler measures only simulated slices so far; a real slice's throughput is estimated",
                    slice.uuid
                ))
                .await?;
        }
    }
    if kinds.is_empty() {
        return Err(JobError::Profile(
            "this worker offers no slice it can measure; run the profiler on a worker with MIG slices (or --simulate-gpus)".into(),
        ));
    }
    let (folder, summary) = prefetch::fetch(context, model_id).await?;
    context.log(summary).await?;
    let model = Arc::new(
        tokio::task::spawn_blocking(move || EmbeddingModel::load(&folder))
            .await
            .map_err(|e| JobError::Profile(format!("the loading thread panicked: {e}")))??,
    );
    let mut reports = Vec::new();
    for (gpu_model, profile, simulated) in kinds {
        let mut points = Vec::new();
        for &b in &batch_sizes {
            let engine = model.clone();
            let point = tokio::task::spawn_blocking(move || measure(&engine, b))
                .await
                .map_err(|e| JobError::Profile(format!("the measuring thread panicked: {e}")))??;
            let engine_name = if simulated {
                "CPU engine (simulated slice)"
            } else {
                "GPU"
            };
            context
                .log(format!(
                    "{gpu_model} {profile} batch {b}: {:.1} req/s, p99 {:.1} ms on the {engine_name}",
                    point.throughput, point.p99_ms
                ))
                .await?;
            points.push(point);
        }
        reports.push(ProfileReport {
            gpu_model,
            profile,
            simulated,
            points,
        });
    }
    let kinds = reports.len();
    context.client.profiles(context.job, &reports).await?;
    Ok(format!(
        "Measured {kinds} slice kind(s) at batch sizes {batch_sizes:?}."
    ))
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
