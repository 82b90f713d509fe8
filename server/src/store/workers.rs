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
        "SELECT id, name, version, inventory, allow_repartition, registered_at, last_seen_at FROM workers ORDER BY name",
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
        "INSERT INTO workers (id, name, version, inventory, secret_hash, engine_token, registered_at, last_seen_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $7) \
         ON CONFLICT (name) DO UPDATE SET version = excluded.version, inventory = excluded.inventory, \
           secret_hash = excluded.secret_hash, engine_token = excluded.engine_token, \
           last_seen_at = excluded.last_seen_at \
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

/// The worker whose secret has this digest, marked as seen now; `None` for an unknown
/// secret.
pub async fn touch_by_secret(db: &Db, secret_digest: &str) -> Result<Option<Uuid>> {
    let id: Option<String> =
        sqlx::query_scalar("UPDATE workers SET last_seen_at = $1 WHERE secret_hash = $2 RETURNING id")
            .bind(now_ms())
            .bind(secret_digest)
            .fetch_optional(db.pool())
            .await?;
    id.map(|id| parse_uuid("workers", "id", &id)).transpose()
}
