//! Workers (`workers`): one row per host agent, keyed by its name, with its inventory,
//! the digest of its secret, the token its engines accept, and when it was last heard;
//! and what a worker holds (the specs of its leased jobs), which bounds what it may fetch.

use sqlx::any::AnyRow;
use sqlx::Row;
use tessera_api::workers::{Inventory, Worker, WorkerStatus};
use uuid::Uuid;

use tessera_api::jobs::JobSpec;

use super::db::{self, now_ms, Db};
use super::{parse_json, parse_uuid, Result};

fn from_row(row: &AnyRow, online_since: i64) -> Result<Worker> {
    let last_seen: i64 = row.try_get("last_seen_at")?;
    Ok(Worker {
        id: parse_uuid("workers", "id", &row.try_get::<String, _>("id")?)?,
        name: row.try_get("name")?,
        version: row.try_get("version")?,
        status: if last_seen >= online_since { WorkerStatus::Online } else { WorkerStatus::Offline },
        inventory: parse_json("workers", "inventory", &row.try_get::<String, _>("inventory")?)?,
        slices: Vec::new(),
        allow_repartition: row.try_get::<i64, _>("allow_repartition")? != 0,
        registered_at: db::time(row.try_get("registered_at")?),
        last_seen_at: db::time(last_seen),
    })
}

/// Every worker by name, online when last seen at or after `online_since`; their
/// `slices` are left empty (`store::slices::by_worker` has them).
pub async fn list(db: &Db, online_since: i64) -> Result<Vec<Worker>> {
    let rows = sqlx::query(
        "SELECT id, name, version, inventory, allow_repartition, registered_at, last_seen_at FROM workers \
         WHERE retired_at IS NULL ORDER BY name",
    )
    .fetch_all(db.pool())
    .await?;
    rows.iter().map(|row| from_row(row, online_since)).collect()
}

pub async fn count_online(db: &Db, online_since: i64) -> Result<i64> {
    Ok(sqlx::query_scalar("SELECT COUNT(*) FROM workers WHERE last_seen_at >= $1")
        .bind(online_since)
        .fetch_one(db.pool())
        .await?)
}

/// What a joining worker is recorded with.
#[derive(Debug, Clone)]
pub struct Registration<'a> {
    pub name: &'a str,
    pub version: &'a str,
    pub inventory: &'a Inventory,
    pub secret_digest: &'a str,
    pub engine_token: &'a str,
    /// Digest of the worker token it joined with.
    pub join_digest: &'a str,
    /// Digest of the secret the worker presents from its last registration, if any.
    pub previous_digest: Option<&'a str>,
    /// A worker of the same name last heard before this (ms) is gone and may be replaced.
    pub online_since: i64,
}

/// Records a joining worker; one that rejoins under its name keeps its id, and its old
/// secret stops working. A name whose worker is still online (heard at or after
/// `online_since`) is taken over only by one presenting that worker's secret; otherwise
/// nothing changes and `None` comes back. In one statement, so two joining at once
/// cannot both win.
pub async fn register(db: &Db, worker: &Registration<'_>) -> Result<Option<Uuid>> {
    let now = now_ms();
    let id: Option<String> = sqlx::query_scalar(
        "INSERT INTO workers (id, name, version, inventory, secret_hash, engine_token, registered_at, last_seen_at, \
           join_digest) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $7, $10) \
         ON CONFLICT (name) DO UPDATE SET version = excluded.version, inventory = excluded.inventory, \
           secret_hash = excluded.secret_hash, engine_token = excluded.engine_token, \
           last_seen_at = excluded.last_seen_at, join_digest = excluded.join_digest, retired_at = NULL \
         WHERE workers.last_seen_at < $8 OR workers.secret_hash = $9 \
         RETURNING id",
    )
    .bind(Uuid::new_v4().to_string())
    .bind(worker.name)
    .bind(worker.version)
    .bind(serde_json::to_string(worker.inventory)?)
    .bind(worker.secret_digest)
    .bind(worker.engine_token)
    .bind(now)
    .bind(worker.online_since)
    .bind(worker.previous_digest)
    .bind(worker.join_digest)
    .fetch_optional(db.pool())
    .await?;
    id.map(|id| parse_uuid("workers", "id", &id)).transpose()
}

/// When the worker called `name` was last heard from (ms), if there is one.
pub async fn last_seen(db: &Db, name: &str) -> Result<Option<i64>> {
    Ok(sqlx::query_scalar("SELECT last_seen_at FROM workers WHERE name = $1")
        .bind(name)
        .fetch_optional(db.pool())
        .await?)
}

/// The specs of the jobs `worker` holds a live lease on (leased or running).
pub async fn held_specs(db: &Db, worker: Uuid) -> Result<Vec<JobSpec>> {
    let specs: Vec<String> =
        sqlx::query_scalar("SELECT spec FROM jobs WHERE worker_id = $1 AND state IN ('leased', 'running')")
            .bind(worker.to_string())
            .fetch_all(db.pool())
            .await?;
    specs.iter().map(|text| parse_json("jobs", "spec", text)).collect()
}

/// The worker whose secret has this digest, with the digest of the worker token it
/// joined with (`None` for one registered before that was kept); `None` for an unknown
/// secret. A read (by the `workers_secret` index): anyone may send a bogus secret, and on
/// SQLite every write waits for the one write lock.
pub async fn by_secret(db: &Db, secret_digest: &str) -> Result<Option<(Uuid, Option<String>)>> {
    let row = sqlx::query("SELECT id, join_digest FROM workers WHERE secret_hash = $1")
        .bind(secret_digest)
        .fetch_optional(db.pool())
        .await?;
    let Some(row) = row else { return Ok(None) };
    let id = parse_uuid("workers", "id", &row.try_get::<String, _>("id")?)?;
    Ok(Some((id, row.try_get("join_digest")?)))
}

/// Marks worker `id` as seen now; false when its secret changed since it was read (it
/// registered again: the old secret no longer works).
pub async fn touch(db: &Db, id: Uuid, secret_digest: &str) -> Result<bool> {
    let touched = sqlx::query("UPDATE workers SET last_seen_at = $1 WHERE id = $2 AND secret_hash = $3")
        .bind(now_ms())
        .bind(id.to_string())
        .bind(secret_digest)
        .execute(db.pool())
        .await?;
    Ok(touched.rows_affected() > 0)
}

/// What retiring a worker found.
#[derive(Debug, PartialEq, Eq)]
pub enum Retired {
    Yes,
    /// Heard from at or after `online_since`: it would only register again.
    Online,
    Unknown,
}

/// Retires the worker `id`, last heard before `online_since`: it leaves the fleet's list,
/// its secret stops working and its slices' loans end; its row stays for the jobs it ran,
/// and a worker joining under its name again brings it back.
pub async fn retire(db: &Db, id: Uuid, online_since: i64) -> Result<Retired> {
    let retired = sqlx::query(
        "UPDATE workers SET retired_at = $1, secret_hash = '', engine_token = '' \
         WHERE id = $2 AND retired_at IS NULL AND last_seen_at < $3",
    )
    .bind(now_ms())
    .bind(id.to_string())
    .bind(online_since)
    .execute(db.pool())
    .await?;
    if retired.rows_affected() > 0 {
        // Its slices lent to training are no longer lent: the lender counts a replica
        // short, and the repair tick queues one elsewhere.
        sqlx::query("UPDATE slices SET loan_state = 'serving', lender_id = NULL WHERE worker_id = $1")
            .bind(id.to_string())
            .execute(db.pool())
            .await?;
        return Ok(Retired::Yes);
    }
    let online: Option<i64> =
        sqlx::query_scalar("SELECT last_seen_at FROM workers WHERE id = $1 AND retired_at IS NULL")
            .bind(id.to_string())
            .fetch_optional(db.pool())
            .await?;
    Ok(if online.is_some() { Retired::Online } else { Retired::Unknown })
}
