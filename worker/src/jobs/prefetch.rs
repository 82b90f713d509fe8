//! Prefetch: bring a registered model into this worker's cache (`models/<id>/<path>`)
//! and verify every file's digest, so serving it later starts without a transfer.
//! Files already cached are re-hashed and kept when they still match.

use std::path::{Path, PathBuf};
use std::time::Instant;

use sha2::{Digest, Sha256};
use tokio::io::AsyncReadExt;
use uuid::Uuid;

use super::{JobContext, JobError};

async fn file_digest(path: &Path) -> std::io::Result<String> {
    let mut file = tokio::fs::File::open(path).await?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buffer).await?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
    }
    Ok(format!("sha256:{}", hex::encode(hasher.finalize())))
}

pub async fn run(context: &JobContext, model_id: Uuid) -> Result<String, JobError> {
    Ok(fetch(context, model_id).await?.1)
}

/// Brings the model into the cache; returns its folder and a summary sentence.
pub async fn fetch(context: &JobContext, model_id: Uuid) -> Result<(PathBuf, String), JobError> {
    let model = context.client.model(model_id).await?;
    let folder = context.models_dir().join(model.id.to_string());
    crate::client::remove_stale_partials(&folder);
    context.use_model(model.id, model.size_bytes);
    context.log(format!("prefetching model '{}' ({} files, {} bytes) into {}", model.name, model.files.len(), model.size_bytes, folder.display())).await?;
    let started = Instant::now();
    let mut downloaded = 0u64;
    let mut reused = 0usize;
    for (step, file) in model.files.iter().enumerate() {
        let target = folder.join(&file.path);
        if let Some(parent) = target.parent() {
            tokio::fs::create_dir_all(parent).await?;
        }
        if tokio::fs::try_exists(&target).await? && file_digest(&target).await? == file.digest {
            reused += 1;
            context.log(format!("{}: cached copy verified", file.path)).await?;
        } else {
            let file_started = Instant::now();
            let size = context.client.download(model.id, &file.path, &file.digest, &target).await?;
            downloaded += size;
            let secs = file_started.elapsed().as_secs_f64();
            context.log(format!("{}: downloaded {size} bytes in {secs:.2} s, digest verified", file.path)).await?;
        }
        context.metric("bytes_downloaded", step as i64, downloaded as f64).await?;
    }
    let secs = started.elapsed().as_secs_f64();
    let throughput = downloaded as f64 / 1e6 / secs.max(1e-6);
    context.metric("download_mb_per_s", 0, throughput).await?;
    let summary = format!(
        "Model '{}' cached: {} files downloaded ({downloaded} bytes, {throughput:.1} MB/s), {reused} already cached.",
        model.name,
        model.files.len() - reused
    );
    Ok((folder, summary))
}
