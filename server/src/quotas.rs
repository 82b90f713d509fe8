//! Per-user quotas, so one user cannot take the whole platform: jobs queued or running,
//! serving replicas, stored bytes (limits in `config`, use counted by `store::quotas`).
//! A request past a quota gets a 403 `quota_exceeded` naming the quota, its limit and
//! the user's current use. Admins, who run the server, are not bound. Each check runs in
//! the transaction that inserts what it counts, holding the user's row (`lock_owner`),
//! so concurrent requests, on one server or several, cannot together pass a quota.

use sqlx::AnyConnection;
use uuid::Uuid;

use crate::auth::Principal;
use crate::error::{Error, Result};
use crate::state::AppState;
use crate::store::quotas as usage;

/// Refuses one more job for `owner` when they already have as many queued or running
/// as `TESSERA_QUOTA_JOBS` allows. Call inside the transaction that inserts the job: it
/// holds `owner`'s row until that transaction ends.
pub async fn check_jobs(
    state: &AppState,
    conn: &mut AnyConnection,
    owner: &Principal,
) -> Result<()> {
    if owner.is_admin() {
        return Ok(());
    }
    usage::lock_owner(conn, owner.id).await?;
    let limit = state.config.quota_jobs;
    let unfinished = usage::unfinished_jobs(conn, owner.id).await?.max(0) as u64;
    if unfinished >= limit {
        return Err(Error::QuotaExceeded(format!(
            "You have {unfinished} jobs queued or running, the most one user may have (quota TESSERA_QUOTA_JOBS = \
             {limit}); cancel one or wait for one to end."
        )));
    }
    Ok(())
}

/// Refuses a deployment asking for `wanted` replicas when, with the replicas `owner`'s
/// other deployments ask for (every one but `resized`), the total would pass
/// `TESSERA_QUOTA_REPLICAS`. Call inside the transaction that stores the replica count:
/// it holds `owner`'s row until that transaction ends.
pub async fn check_replicas(
    state: &AppState,
    conn: &mut AnyConnection,
    owner: &Principal,
    wanted: u32,
    resized: Option<Uuid>,
) -> Result<()> {
    if owner.is_admin() || wanted == 0 {
        return Ok(());
    }
    usage::lock_owner(conn, owner.id).await?;
    let limit = state.config.quota_replicas;
    let others = usage::replicas(conn, owner.id, resized).await?.max(0) as u64;
    if others + u64::from(wanted) > limit {
        return Err(Error::QuotaExceeded(format!(
            "This would give your deployments {} serving replicas ({others} in use, {wanted} asked for here), more than \
             the {limit} one user may have (quota TESSERA_QUOTA_REPLICAS); scale a deployment down or delete one first.",
            others + u64::from(wanted)
        )));
    }
    Ok(())
}

/// Refuses to store `adding` more bytes for `owner` when what they store already (models,
/// datasets, checkpoints) plus those bytes would pass `TESSERA_QUOTA_STORAGE_BYTES`. Call
/// inside the transaction that inserts the rows naming those bytes: it holds `owner`'s
/// row until that transaction ends, so uploads through any server are counted one after
/// the other.
pub async fn check_storage(
    state: &AppState,
    conn: &mut AnyConnection,
    owner: &Principal,
    adding: u64,
) -> Result<()> {
    if owner.is_admin() {
        return Ok(());
    }
    usage::lock_owner(conn, owner.id).await?;
    storage_fits(state, conn, owner, adding).await
}

/// Refuses a training job for `owner` when what they store already reaches
/// `TESSERA_QUOTA_STORAGE_BYTES`: the job's checkpoints would add to it, and a running
/// job's checkpoint upload is never refused (it must be able to save its progress), so
/// storage is bounded here, before the job is queued. Call inside the transaction that
/// inserts the job: it holds `owner`'s row until that transaction ends.
pub async fn check_checkpoint_room(
    state: &AppState,
    conn: &mut AnyConnection,
    owner: &Principal,
) -> Result<()> {
    if owner.is_admin() {
        return Ok(());
    }
    usage::lock_owner(conn, owner.id).await?;
    let limit = state.config.quota_storage_bytes;
    let stored = usage::stored_bytes(conn, owner.id).await?.max(0) as u64;
    if stored >= limit {
        return Err(Error::QuotaExceeded(format!(
            "You store {stored} bytes (models, datasets and checkpoints), the {limit} bytes one user may store (quota \
             TESSERA_QUOTA_STORAGE_BYTES), and a training job's checkpoints would add to them. {FREE_STORAGE}"
        )));
    }
    Ok(())
}

/// How a user past the storage quota makes room, the end of each refusal's sentence.
const FREE_STORAGE: &str = "Delete models or datasets you no longer need, or the checkpoints of ended jobs \
                            (DELETE /api/v1/jobs/{id}/checkpoints).";

/// [`check_storage`] without holding the user's row, for an upload to call before it
/// commits its blobs: a user already past the quota is refused before their bytes go
/// into the store. Only the check in the inserting transaction is binding.
pub async fn precheck_storage(state: &AppState, owner: &Principal, adding: u64) -> Result<()> {
    if owner.is_admin() {
        return Ok(());
    }
    storage_fits(state, &mut *state.db.pool().acquire().await?, owner, adding).await
}

async fn storage_fits(
    state: &AppState,
    conn: &mut AnyConnection,
    owner: &Principal,
    adding: u64,
) -> Result<()> {
    let limit = state.config.quota_storage_bytes;
    let stored = usage::stored_bytes(conn, owner.id).await?.max(0) as u64;
    if stored.saturating_add(adding) > limit {
        return Err(Error::QuotaExceeded(format!(
            "You store {stored} bytes (models, datasets and checkpoints); this upload of {adding} bytes would pass the \
             {limit} bytes one user may store (quota TESSERA_QUOTA_STORAGE_BYTES). {FREE_STORAGE}"
        )));
    }
    Ok(())
}
