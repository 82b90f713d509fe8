//! Checkpoints of training jobs. A worker uploads one every `checkpoint_every` steps
//! and at the end; the files (weights, optimizer and loader state, RNG, LR-tuner state)
//! are opaque to the server and stored as blobs in the registry's content-addressed
//! store. A worker that claims a job again after its previous worker died fetches the
//! latest checkpoint and resumes from it. Only the newest `KEEP` checkpoints of a job
//! are kept, which bounds the storage a long run takes.

use axum::body::Body;
use axum::extract::Multipart;
use axum::http::header;
use axum::response::Response;
use sqlx::Row;
use tessera_api::train::{Checkpoint, CheckpointFile};
use uuid::Uuid;

use crate::app::AppState;
use crate::store::db::{self, now_ms};
use crate::error::{Error, Result};
use crate::registry::{self, blobs::TempBlob, staging};

/// Checkpoints kept per job (the newest by step).
pub const KEEP: i64 = 5;

const TOO_LARGE: &str = "The checkpoint is larger than this server's upload limit (TESSERA_MAX_UPLOAD_BYTES).";

fn check_file_name(name: &str) -> Result<()> {
    let ok = (1..=100).contains(&name.len())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
        && !name.starts_with('.');
    if ok {
        Ok(())
    } else {
        Err(Error::invalid(
            "invalid_checkpoint",
            format!("Checkpoint file names have 1 to 100 letters, digits, '_', '-' or '.'; got {name:?}."),
        ))
    }
}

/// Reads the upload: a text field `step`, then one part `files` per file, named by its
/// filename. Files stream into temp blobs.
async fn receive(multipart: &mut Multipart, state: &AppState) -> Result<(i64, Vec<(String, TempBlob, String)>)> {
    let mut step = None;
    let mut files: Vec<(String, TempBlob, String)> = Vec::new();
    let mut budget = state.config.max_upload_bytes;
    while let Some(mut field) = multipart.next_field().await? {
        match field.name() {
            Some("step") => {
                let text = field.text().await?;
                step = Some(text.trim().parse::<i64>().ok().filter(|s| *s >= 0).ok_or_else(|| {
                    Error::invalid(
                        "invalid_checkpoint",
                        format!("The step must be a whole number, 0 or more; got {text:?}."),
                    )
                })?);
            }
            Some("files") => {
                let name = field.file_name().unwrap_or_default().to_string();
                check_file_name(&name)?;
                if files.iter().any(|(n, _, _)| *n == name) {
                    return Err(Error::invalid("invalid_checkpoint", format!("The file {name:?} was sent twice.")));
                }
                let (blob, digest) = staging::stream_to_blob(&mut field, &state.blobs, &mut budget, TOO_LARGE).await?;
                files.push((name, blob, digest));
            }
            other => {
                return Err(Error::BadRequest(format!(
                    "Unexpected form field {:?}; send a text field 'step' and file parts named 'files'.",
                    other.unwrap_or("")
                )))
            }
        }
    }
    let step =
        step.ok_or_else(|| Error::invalid("invalid_checkpoint", "Send the checkpoint's step in a text field 'step'."))?;
    if files.is_empty() {
        return Err(Error::invalid("invalid_checkpoint", "A checkpoint needs at least one file part named 'files'."));
    }
    Ok((step, files))
}

/// Digests of the files of `job`'s checkpoints matching `filter` (a SQL condition on `step`).
async fn digests_where(state: &AppState, job: &str, condition: &str, bound: i64) -> Result<Vec<String>> {
    let rows = sqlx::query(&format!("SELECT digest FROM checkpoint_files WHERE job_id = $1 AND {condition}"))
        .bind(job)
        .bind(bound)
        .fetch_all(state.db.pool())
        .await?;
    rows.iter().map(|r| Ok(r.try_get("digest")?)).collect()
}

/// Stores an uploaded checkpoint of `job` (replacing one at the same step) and drops
/// checkpoints beyond the newest `KEEP`.
pub async fn upload(state: &AppState, job: Uuid, multipart: &mut Multipart) -> Result<Checkpoint> {
    let (step, files) = receive(multipart, state).await?;
    let job_id = job.to_string();
    let now = now_ms();
    let size: u64 = files.iter().map(|(_, blob, _)| blob.size()).sum();
    let _guard = state.registry_lock.lock().await;
    let mut stored = Vec::with_capacity(files.len());
    for (name, blob, digest) in files {
        stored.push(CheckpointFile { name, digest, size_bytes: blob.size() });
        state.blobs.commit(blob).await?;
    }
    let mut released = digests_where(state, &job_id, "step = $2", step).await?;
    let mut tx = state.db.begin().await?;
    sqlx::query("DELETE FROM checkpoints WHERE job_id = $1 AND step = $2")
        .bind(&job_id)
        .bind(step)
        .execute(&mut *tx)
        .await?;
    sqlx::query("INSERT INTO checkpoints (job_id, step, size_bytes, created_at) VALUES ($1, $2, $3, $4)")
        .bind(&job_id)
        .bind(step)
        .bind(size as i64)
        .bind(now)
        .execute(&mut *tx)
        .await?;
    for file in &stored {
        sqlx::query(
            "INSERT INTO checkpoint_files (job_id, step, name, digest, size_bytes) VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(&job_id)
        .bind(step)
        .bind(&file.name)
        .bind(&file.digest)
        .bind(file.size_bytes as i64)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    // The step below which checkpoints are dropped: the KEEP-th newest.
    let cutoff: Option<i64> =
        sqlx::query_scalar("SELECT step FROM checkpoints WHERE job_id = $1 ORDER BY step DESC LIMIT 1 OFFSET $2")
            .bind(&job_id)
            .bind(KEEP - 1)
            .fetch_optional(state.db.pool())
            .await?;
    if let Some(cutoff) = cutoff {
        released.extend(digests_where(state, &job_id, "step < $2", cutoff).await?);
        sqlx::query("DELETE FROM checkpoints WHERE job_id = $1 AND step < $2")
            .bind(&job_id)
            .bind(cutoff)
            .execute(state.db.pool())
            .await?;
    }
    registry::collect_garbage(state, released).await?;
    Ok(Checkpoint { job_id: job, step: step as u64, size_bytes: size, files: stored, created_at: db::time(now) })
}

/// A job's checkpoints, oldest step first.
pub async fn list(state: &AppState, job: Uuid) -> Result<Vec<Checkpoint>> {
    let job_id = job.to_string();
    let rows = sqlx::query("SELECT step, size_bytes, created_at FROM checkpoints WHERE job_id = $1 ORDER BY step")
        .bind(&job_id)
        .fetch_all(state.db.pool())
        .await?;
    let files = sqlx::query(
        "SELECT step, name, digest, size_bytes FROM checkpoint_files WHERE job_id = $1 ORDER BY step, name",
    )
    .bind(&job_id)
    .fetch_all(state.db.pool())
    .await?;
    let mut checkpoints = Vec::with_capacity(rows.len());
    for row in &rows {
        let step: i64 = row.try_get("step")?;
        let mut own = Vec::new();
        for file in &files {
            if file.try_get::<i64, _>("step")? == step {
                own.push(CheckpointFile {
                    name: file.try_get("name")?,
                    digest: file.try_get("digest")?,
                    size_bytes: file.try_get::<i64, _>("size_bytes")? as u64,
                });
            }
        }
        checkpoints.push(Checkpoint {
            job_id: job,
            step: step as u64,
            size_bytes: row.try_get::<i64, _>("size_bytes")? as u64,
            files: own,
            created_at: db::time(row.try_get("created_at")?),
        });
    }
    Ok(checkpoints)
}

pub async fn latest(state: &AppState, job: Uuid) -> Result<Option<Checkpoint>> {
    Ok(list(state, job).await?.pop())
}

/// One file of one checkpoint, streamed from the blob store.
pub async fn file_response(state: &AppState, job: Uuid, step: u64, name: &str) -> Result<Response> {
    let row =
        sqlx::query("SELECT digest, size_bytes FROM checkpoint_files WHERE job_id = $1 AND step = $2 AND name = $3")
            .bind(job.to_string())
            .bind(step as i64)
            .bind(name)
            .fetch_optional(state.db.pool())
            .await?
            .ok_or_else(|| Error::not_found(&format!("Checkpoint file '{name}' at step {step}")))?;
    let digest: String = row.try_get("digest")?;
    let size: i64 = row.try_get("size_bytes")?;
    let path = state.blobs.path(&digest).ok_or_else(|| anyhow::anyhow!("malformed digest {digest}"))?;
    let stream = tokio_util::io::ReaderStream::new(tokio::fs::File::open(path).await?);
    Response::builder()
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(header::CONTENT_LENGTH, size)
        .header(header::ETAG, format!("\"{digest}\""))
        .header(header::CONTENT_DISPOSITION, format!("attachment; filename=\"step{step}-{name}\""))
        .body(Body::from_stream(stream))
        .map_err(|e| Error::Internal(e.into()))
}
