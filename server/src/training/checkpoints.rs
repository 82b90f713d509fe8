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
use tessera_api::jobs::Job;
use tessera_api::train::{Checkpoint, CheckpointFile};
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::registry::{blobs::TempBlob, staging};
use crate::state::AppState;
use crate::store::db::{self, now_ms};
use crate::store::training::{self as store, Stored};

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
                let text = staging::read_text(&mut field).await?;
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

/// Stores an uploaded checkpoint of `job` (replacing one at the same step) and drops
/// checkpoints beyond the newest `KEEP`; `worker` uploads it under its lease of `held`
/// (the job, or its rank of the job's gang), and must still hold it once it is in.
pub async fn upload(
    state: &AppState,
    job: Uuid,
    worker: Uuid,
    held: Uuid,
    multipart: &mut Multipart,
) -> Result<Checkpoint> {
    let (step, files) = receive(multipart, state).await?;
    let size: u64 = files.iter().map(|(_, blob, _)| blob.size()).sum();
    let mut stored = Vec::with_capacity(files.len());
    let mut blobs = Vec::with_capacity(files.len());
    for (name, blob, digest) in files {
        stored.push(CheckpointFile { name, digest, size_bytes: blob.size() });
        blobs.push(blob);
    }
    state.blobs.commit(&state.db, blobs).await?;
    let checkpoint =
        Checkpoint { job_id: job, step: step as u64, size_bytes: size, files: stored, created_at: db::time(now_ms()) };
    // The blobs of a replaced or dropped checkpoint are released in the ledger and
    // collected after the grace period.
    match store::replace_checkpoint(&state.db, &checkpoint, worker, held).await? {
        Stored::Yes => {}
        Stored::JobEnded => {
            return Err(Error::Conflict("The job ended while its checkpoint was uploading; it was not stored.".into()))
        }
        Stored::LeaseLost => {
            return Err(Error::Conflict(
                "This worker lost the job's lease while its checkpoint was uploading (it expired or the job moved to \
                 another worker); it was not stored: stop the job."
                    .into(),
            ))
        }
    }
    // The step below which checkpoints are dropped: the KEEP-th newest.
    if let Some(cutoff) = store::nth_newest_checkpoint(&state.db, job, KEEP).await? {
        store::delete_checkpoints_before(&state.db, job, cutoff).await?;
    }
    Ok(checkpoint)
}

/// Deletes every checkpoint of an ended job (their blobs are released as a pruned one's
/// are) and says how many; a job that may still resume from them (queued, preempted,
/// running) keeps them: 409.
pub async fn delete_ended(state: &AppState, job: &Job) -> Result<u64> {
    if !job.state.is_terminal() {
        return Err(Error::Conflict(format!(
            "The job is {}; it may still resume from its checkpoints. Cancel it first, or wait for it to end.",
            job.state.as_str()
        )));
    }
    Ok(store::delete_checkpoints_before(&state.db, job.id, i64::MAX).await?)
}

/// A job's checkpoints, oldest step first.
pub async fn list(state: &AppState, job: Uuid) -> Result<Vec<Checkpoint>> {
    Ok(store::checkpoints(&state.db, job).await?)
}

pub async fn latest(state: &AppState, job: Uuid) -> Result<Option<Checkpoint>> {
    Ok(list(state, job).await?.pop())
}

/// One file of one checkpoint, streamed from the blob store.
pub async fn file_response(state: &AppState, job: Uuid, step: u64, name: &str) -> Result<Response> {
    let file = store::checkpoint_file(&state.db, job, step, name)
        .await?
        .ok_or_else(|| Error::not_found(&format!("Checkpoint file '{name}' at step {step}")))?;
    let stream = state.blobs.read(&file.digest).await?;
    Response::builder()
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(header::CONTENT_LENGTH, file.size_bytes)
        .header(header::ETAG, format!("\"{}\"", file.digest))
        .header(header::CONTENT_DISPOSITION, format!("attachment; filename=\"step{step}-{name}\""))
        .body(Body::from_stream(stream))
        .map_err(|_| Error::Invariant("a file response's headers are valid"))
}
