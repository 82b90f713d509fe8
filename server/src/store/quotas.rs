//! What one user uses of the resources the per-user quotas bound: unfinished jobs,
//! serving replicas and stored bytes, counted from the database (so every server sees
//! the same use), plus the lock that makes a check and the insert after it one step.

use sqlx::AnyConnection;
use uuid::Uuid;

use super::Result;

/// Jobs of `owner` that are queued, preempted (waiting to resume) or hold a lease. Serving replicas are left out (they
/// count against the replica quota), and so are a data-parallel job's ranks: the job
/// the user submitted counts once.
pub async fn unfinished_jobs(conn: &mut AnyConnection, owner: Uuid) -> Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT COUNT(*) FROM jobs WHERE owner_id = $1 AND deployment_id IS NULL AND gang_id IS NULL \
         AND state IN ('queued', 'preempted', 'leased', 'running')",
    )
    .bind(owner.to_string())
    .fetch_one(conn)
    .await?)
}

/// Replicas the deployments of `owner` ask for, leaving out deployment `except` (the
/// one being resized).
pub async fn replicas(conn: &mut AnyConnection, owner: Uuid, except: Option<Uuid>) -> Result<i64> {
    let total: Option<i64> = sqlx::query_scalar(
        "SELECT CAST(SUM(replicas) AS BIGINT) FROM deployments WHERE owner_id = $1 AND ($2 IS NULL OR id <> $2)",
    )
    .bind(owner.to_string())
    .bind(except.map(|id| id.to_string()))
    .fetch_one(conn)
    .await?;
    Ok(total.unwrap_or(0))
}

/// Bytes `owner` stores: models, datasets and the checkpoints of their jobs, each
/// counted at its full size (blobs shared between them are stored once, but a quota
/// that depended on what others uploaded would be a riddle).
pub async fn stored_bytes(conn: &mut AnyConnection, owner: Uuid) -> Result<i64> {
    let total: Option<i64> = sqlx::query_scalar(
        "SELECT CAST(COALESCE((SELECT SUM(size_bytes) FROM models WHERE owner_id = $1), 0) \
           + COALESCE((SELECT SUM(size_bytes) FROM datasets WHERE owner_id = $1), 0) \
           + COALESCE((SELECT SUM(c.size_bytes) FROM checkpoints c JOIN jobs j ON j.id = c.job_id \
                       WHERE j.owner_id = $1), 0) AS BIGINT)",
    )
    .bind(owner.to_string())
    .fetch_one(conn)
    .await?;
    Ok(total.unwrap_or(0))
}

/// Holds `owner`'s row until the caller's transaction ends, so two requests of one user,
/// on this server or another, cannot both pass a quota check before either inserts.
/// On PostgreSQL this is the row lock (read committed: the counts read after it see what
/// the previous holder committed); SQLite's write transactions (`Db::begin`) are serial
/// already.
pub async fn lock_owner(conn: &mut AnyConnection, owner: Uuid) -> Result<()> {
    sqlx::query("UPDATE users SET role = role WHERE id = $1")
        .bind(owner.to_string())
        .execute(conn)
        .await?;
    Ok(())
}
