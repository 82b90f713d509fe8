//! The leased work queue. A worker claims the oldest queued job it can run; the claim
//! is one atomic statement (PostgreSQL skips rows other claimers hold locked, SQLite
//! serialises writers), so no job is ever handed to two workers. A lease that no
//! heartbeat renews expires, and the job goes back to the queue with its attempt count.

use sqlx::Row;
use uuid::Uuid;

use crate::store::db::{now_ms, Backend, Db};
use crate::error::Result;
use crate::fleet::slices::Free;

pub struct Claimed {
    pub job_id: Uuid,
    pub spec: String,
    pub attempt: u32,
    pub lease_expires_at: i64,
}

/// Leases the oldest queued job of one of `kinds` to `worker_id`, taking only the serve
/// jobs the worker's free slices allow (see `fleet::slices`).
pub async fn claim(db: &Db, worker_id: Uuid, kinds: &[String], lease_ttl_ms: i64, slices: &Free) -> Result<Option<Claimed>> {
    if kinds.is_empty() {
        return Ok(None);
    }
    let now = now_ms();
    let kind_params: Vec<String> = (0..kinds.len()).map(|i| format!("${}", i + 4)).collect();
    let lock = match db.backend() {
        Backend::Postgres => "FOR UPDATE SKIP LOCKED",
        Backend::Sqlite => "",
    };
    let (slice_condition, slice_params) = slices.condition(4 + kinds.len());
    let sql = format!(
        "UPDATE jobs SET state = 'leased', worker_id = $1, lease_expires_at = $2, attempts = attempts + 1, \
         updated_at = $3, message = NULL \
         WHERE state = 'queued' AND id = (SELECT id FROM jobs WHERE state = 'queued' AND kind IN ({}) \
         AND {slice_condition} ORDER BY created_at, id LIMIT 1 {lock}) \
         RETURNING id, spec, attempts, lease_expires_at",
        kind_params.join(", ")
    );
    let mut query = sqlx::query(&sql).bind(worker_id.to_string()).bind(now + lease_ttl_ms).bind(now);
    for kind in kinds {
        query = query.bind(kind);
    }
    for slice in slice_params {
        query = query.bind(slice);
    }
    let Some(row) = query.fetch_optional(db.pool()).await? else {
        return Ok(None);
    };
    let id: String = row.try_get("id")?;
    Ok(Some(Claimed {
        job_id: id.parse().map_err(|e| anyhow::anyhow!("bad job id {id}: {e}"))?,
        spec: row.try_get("spec")?,
        attempt: row.try_get::<i64, _>("attempts")? as u32,
        lease_expires_at: row.try_get("lease_expires_at")?,
    }))
}

/// Extends the leases `worker_id` still holds among `jobs`; returns the ids it no longer
/// holds (cancelled, expired and requeued, or never its own), which it must stop.
pub async fn renew(db: &Db, worker_id: Uuid, jobs: &[Uuid], lease_ttl_ms: i64) -> Result<Vec<Uuid>> {
    let mut lost = Vec::new();
    let expires = now_ms() + lease_ttl_ms;
    for job in jobs {
        let renewed = sqlx::query(
            "UPDATE jobs SET lease_expires_at = $1 WHERE id = $2 AND worker_id = $3 AND state IN ('leased', 'running')",
        )
        .bind(expires)
        .bind(job.to_string())
        .bind(worker_id.to_string())
        .execute(db.pool())
        .await?
        .rows_affected();
        if renewed == 0 {
            lost.push(*job);
        }
    }
    Ok(lost)
}

/// Requeues every job whose lease has expired, or fails it once its attempts are spent.
/// Returns how many jobs were touched.
pub async fn expire_leases(db: &Db) -> Result<u64> {
    let now = now_ms();
    let touched = sqlx::query(
        "UPDATE jobs SET \
           state = CASE WHEN attempts >= max_attempts THEN 'failed' ELSE 'queued' END, \
           message = CASE WHEN attempts >= max_attempts \
             THEN 'The lease expired on the last allowed attempt; the worker stopped responding.' \
             ELSE 'The lease expired (the worker stopped responding); the job was requeued.' END, \
           finished_at = CASE WHEN attempts >= max_attempts THEN $1 ELSE NULL END, \
           worker_id = NULL, lease_expires_at = NULL, updated_at = $1 \
         WHERE state IN ('leased', 'running') AND lease_expires_at < $1",
    )
    .bind(now)
    .execute(db.pool())
    .await?
    .rows_affected();
    Ok(touched)
}

/// Jobs waiting in the queue (a Prometheus gauge and the dashboard use it).
pub async fn depth(db: &Db) -> Result<i64> {
    Ok(sqlx::query_scalar("SELECT COUNT(*) FROM jobs WHERE state = 'queued'").fetch_one(db.pool()).await?)
}
