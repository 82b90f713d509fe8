//! Deployments (`deployments`) and their replicas, which are serve jobs linked to the
//! deployment: the replica list the status is built from, scaling down, deleting with
//! the deployment, the stored SLO plan, and the gateway's routing table.

use chrono::{DateTime, Utc};
use sqlx::any::AnyRow;
use sqlx::{AnyConnection, Row};
use tessera_api::deployments::{BatchLimits, Replica, ServingState};
use tessera_api::jobs::JobState;
use tessera_api::mig::SloStatus;
use uuid::Uuid;

use super::db::{self, now_ms, Backend, Db};
use super::{parse_json, parse_uuid, Result, RowLock, Scope, StoreError};

/// A deployment row with its model's and owner's names.
#[derive(Debug, Clone)]
pub struct StoredDeployment {
    pub id: Uuid,
    pub name: String,
    pub model_id: Uuid,
    pub model_name: String,
    pub owner_id: Uuid,
    pub owner: String,
    /// Replicas asked for (for an SLO deployment, the planned slices).
    pub replicas: u32,
    pub limits: BatchLimits,
    pub slo: Option<SloStatus>,
    /// It lends the slices its traffic leaves idle (issue 16), keeping this headroom.
    pub loanable: bool,
    pub reclaim_headroom: f64,
    /// Rounds in a row its rate allowed a larger loan.
    pub loan_calm: u32,
    /// Slices it has lent now (loaned or being reclaimed).
    pub loaned_slices: u32,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

const COLUMNS: &str = "d.id, d.name, d.model_id, m.name AS model_name, d.owner_id, u.username AS owner, d.replicas, \
     d.max_batch_tokens, d.max_batch_requests, d.slo, d.created_at, d.updated_at, d.loanable, d.reclaim_headroom, \
     d.loan_calm, (SELECT COUNT(*) FROM slices s WHERE s.lender_id = d.id) AS loaned_slices";

/// Decodes a count column the schema keeps as a 64-bit integer.
fn count(row: &AnyRow, column: &'static str) -> Result<u32> {
    let value: i64 = row.try_get(column)?;
    u32::try_from(value).map_err(|e| StoreError::Corrupt {
        table: "deployments",
        column,
        value: value.to_string(),
        reason: e.to_string(),
    })
}

fn from_row(row: &AnyRow) -> Result<StoredDeployment> {
    let slo: Option<String> = row.try_get("slo")?;
    Ok(StoredDeployment {
        id: parse_uuid("deployments", "id", &row.try_get::<String, _>("id")?)?,
        name: row.try_get("name")?,
        model_id: parse_uuid("deployments", "model_id", &row.try_get::<String, _>("model_id")?)?,
        model_name: row.try_get("model_name")?,
        owner_id: parse_uuid("deployments", "owner_id", &row.try_get::<String, _>("owner_id")?)?,
        owner: row.try_get("owner")?,
        replicas: count(row, "replicas")?,
        limits: BatchLimits {
            max_batch_tokens: count(row, "max_batch_tokens")?,
            max_batch_requests: count(row, "max_batch_requests")?,
        },
        slo: slo.map(|text| parse_json("deployments", "slo", &text)).transpose()?,
        loanable: row.try_get::<i64, _>("loanable")? != 0,
        reclaim_headroom: row.try_get("reclaim_headroom")?,
        loan_calm: count(row, "loan_calm")?,
        loaned_slices: count(row, "loaned_slices")?,
        created_at: db::time(row.try_get("created_at")?),
        updated_at: db::time(row.try_get("updated_at")?),
    })
}

/// A deployment in `scope`, by id or by name.
pub async fn get(db: &Db, scope: &Scope, id_or_name: &str) -> Result<Option<StoredDeployment>> {
    get_in(&mut *db.pool().acquire().await?, scope, id_or_name).await
}

/// [`get`], read inside the caller's transaction. An id wins over a name that spells it
/// (such names are refused since; older rows may hold one).
pub async fn get_in(conn: &mut AnyConnection, scope: &Scope, id_or_name: &str) -> Result<Option<StoredDeployment>> {
    if !db::storable(id_or_name) {
        return Ok(None);
    }
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM deployments d JOIN models m ON m.id = d.model_id \
         JOIN users u ON u.id = d.owner_id WHERE (d.id = $1 OR d.name = $1) AND ($2 IS NULL OR d.owner_id = $2) \
         ORDER BY CASE WHEN d.id = $1 THEN 0 ELSE 1 END LIMIT 1"
    )))
    .bind(id_or_name)
    .bind(scope.owner_filter())
    .fetch_optional(conn)
    .await?;
    row.as_ref().map(from_row).transpose()
}

/// The names of the deployments that serve `model`, whoever owns them.
pub async fn names_serving(conn: &mut AnyConnection, model: Uuid) -> Result<Vec<String>> {
    Ok(sqlx::query_scalar("SELECT name FROM deployments WHERE model_id = $1 ORDER BY name")
        .bind(model.to_string())
        .fetch_all(conn)
        .await?)
}

/// The deployments in `scope`, by name.
pub async fn list(db: &Db, scope: &Scope) -> Result<Vec<StoredDeployment>> {
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM deployments d JOIN models m ON m.id = d.model_id \
         JOIN users u ON u.id = d.owner_id WHERE ($1 IS NULL OR d.owner_id = $1) ORDER BY d.name"
    )))
    .bind(scope.owner_filter())
    .fetch_all(db.pool())
    .await?;
    rows.iter().map(from_row).collect()
}

fn replica_state(state: JobState) -> ServingState {
    match state {
        JobState::Queued | JobState::Preempted => ServingState::Pending,
        JobState::Leased => ServingState::Loading,
        JobState::Running => ServingState::Ready,
        JobState::Succeeded | JobState::Failed | JobState::Cancelled => ServingState::Failed,
    }
}

/// A deployment's replicas, oldest first. Cancelled ones were scaled away: they are
/// history, not status.
pub async fn replicas(db: &Db, deployment: Uuid) -> Result<Vec<Replica>> {
    replicas_in(&mut *db.pool().acquire().await?, deployment).await
}

/// [`replicas`], read inside the caller's transaction.
pub async fn replicas_in(conn: &mut AnyConnection, deployment: Uuid) -> Result<Vec<Replica>> {
    let rows = sqlx::query(
        "SELECT id, state, worker_id, message, attempts, endpoint, slice_uuid, slice_pinned, updated_at FROM jobs \
         WHERE deployment_id = $1 AND state <> 'cancelled' ORDER BY created_at",
    )
    .bind(deployment.to_string())
    .fetch_all(conn)
    .await?;
    rows.iter()
        .map(|row| {
            let state: String = row.try_get("state")?;
            let state = JobState::parse(&state).ok_or_else(|| StoreError::Corrupt {
                table: "jobs",
                column: "state",
                value: state.clone(),
                reason: "not a job state".into(),
            })?;
            let worker: Option<String> = row.try_get("worker_id")?;
            // A slice the planner chose is the replica's while it waits; one picked at
            // claim time only while the replica holds its lease.
            let bound = row.try_get::<i64, _>("slice_pinned")? != 0 || matches!(state, JobState::Leased | JobState::Running);
            Ok(Replica {
                id: parse_uuid("jobs", "id", &row.try_get::<String, _>("id")?)?,
                state: replica_state(state),
                worker_id: worker.map(|w| parse_uuid("jobs", "worker_id", &w)).transpose()?,
                message: row.try_get("message")?,
                attempts: row.try_get::<i64, _>("attempts")? as u32,
                endpoint: row.try_get("endpoint")?,
                slice: if bound { row.try_get("slice_uuid")? } else { None },
                updated_at: db::time(row.try_get("updated_at")?),
            })
        })
        .collect()
}

/// A deployment about to be created.
pub struct NewDeployment<'a> {
    pub id: Uuid,
    pub owner: Uuid,
    pub name: &'a str,
    pub model: Uuid,
    pub replicas: u32,
    pub limits: BatchLimits,
    pub loanable: bool,
    pub reclaim_headroom: f64,
}

/// Adds a deployment inside the caller's transaction; a taken name is a unique violation
/// (`StoreError::is_unique_violation`).
pub async fn insert(conn: &mut AnyConnection, deployment: &NewDeployment<'_>) -> Result<()> {
    sqlx::query(
        "INSERT INTO deployments (id, owner_id, name, model_id, replicas, max_batch_tokens, max_batch_requests, \
         created_at, updated_at, loanable, reclaim_headroom) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $8, $9, $10)",
    )
    .bind(deployment.id.to_string())
    .bind(deployment.owner.to_string())
    .bind(deployment.name)
    .bind(deployment.model.to_string())
    .bind(i64::from(deployment.replicas))
    .bind(i64::from(deployment.limits.max_batch_tokens))
    .bind(i64::from(deployment.limits.max_batch_requests))
    .bind(now_ms())
    .bind(i64::from(deployment.loanable))
    .bind(deployment.reclaim_headroom)
    .execute(conn)
    .await?;
    Ok(())
}

/// Sets a deployment's replica count; false when the deployment is gone. The update locks
/// the row until the caller's transaction ends, so a deletion waits for the replicas it
/// queues (and removes them with the row), or has removed the row first.
pub async fn set_replicas(conn: &mut AnyConnection, id: Uuid, replicas: u32) -> Result<bool> {
    let changed = sqlx::query("UPDATE deployments SET replicas = $1, updated_at = $2 WHERE id = $3")
        .bind(i64::from(replicas))
        .bind(now_ms())
        .bind(id.to_string())
        .execute(conn)
        .await?
        .rows_affected();
    Ok(changed > 0)
}

/// Stores an SLO deployment's plan and the replica count it chose.
pub async fn set_slo(conn: &mut AnyConnection, id: Uuid, replicas: u32, slo: &SloStatus) -> Result<()> {
    sqlx::query("UPDATE deployments SET replicas = $1, slo = $2, updated_at = $3 WHERE id = $4")
        .bind(i64::from(replicas))
        .bind(serde_json::to_string(slo)?)
        .bind(now_ms())
        .bind(id.to_string())
        .execute(conn)
        .await?;
    Ok(())
}

/// The key of the PostgreSQL advisory lock SLO planning holds. Advisory keys are the whole
/// database's, so it is spelt out to stay clear of any other user of the database.
const SLO_PLANNING_LOCK: i64 = i64::from_be_bytes(*b"SLO plan");

/// Holds, until `conn`'s transaction ends, the lock under which every server sharing this
/// PostgreSQL database plans an SLO deployment and applies the plan; waits while another
/// transaction holds it. PostgreSQL only: a SQLite file has one server, whose own lock does.
pub async fn lock_slo_planning(conn: &mut AnyConnection) -> Result<()> {
    sqlx::query("SELECT pg_advisory_xact_lock($1)").bind(SLO_PLANNING_LOCK).execute(conn).await?;
    Ok(())
}

/// Deployments whose live replicas and lent slices do not add up to their replica count:
/// what the repair tick looks at. Read without locks, so a tick with nothing to do takes none.
pub async fn out_of_step(db: &Db) -> Result<Vec<Uuid>> {
    let ids: Vec<String> = sqlx::query_scalar(
        "SELECT d.id FROM deployments d WHERE d.replicas <> (SELECT COUNT(*) FROM slices s WHERE s.lender_id = d.id) \
           + (SELECT COUNT(*) FROM jobs j WHERE j.deployment_id = d.id AND j.state IN ('queued', 'preempted', 'leased', 'running'))",
    )
    .fetch_all(db.pool())
    .await?;
    ids.iter().map(|id| parse_uuid("jobs", "deployment_id", id)).collect()
}

/// A replica's run that ended: when it started (reported running) and ended, and how
/// many restarts in a row came before it.
#[derive(Debug, Clone)]
pub struct EndedReplica {
    pub id: Uuid,
    pub started_at: Option<i64>,
    pub finished_at: i64,
    pub restarts: u32,
}

/// The deployment's ended replicas, the latest to end first.
pub async fn ended_replicas_in(conn: &mut AnyConnection, deployment: Uuid) -> Result<Vec<EndedReplica>> {
    let rows = sqlx::query(
        "SELECT id, started_at, COALESCE(finished_at, updated_at) AS ended, restarts FROM jobs \
         WHERE deployment_id = $1 AND state IN ('failed', 'succeeded') ORDER BY ended DESC, id",
    )
    .bind(deployment.to_string())
    .fetch_all(conn)
    .await?;
    rows.iter()
        .map(|row| {
            Ok(EndedReplica {
                id: parse_uuid("jobs", "id", &row.try_get::<String, _>("id")?)?,
                started_at: row.try_get("started_at")?,
                finished_at: row.try_get("ended")?,
                restarts: row.try_get::<i64, _>("restarts")? as u32,
            })
        })
        .collect()
}

/// Queues an ended replica again in place (the same id, its attempts afresh) with its
/// `restarts` count; false when it did not end after all. A replica pinned to a slice that
/// is gone (the GPU was repartitioned), lent, or whose worker was not seen since
/// `online_since` (ms) is unpinned, so any free slice serves it.
pub async fn restart(conn: &mut AnyConnection, replica: Uuid, restarts: u32, online_since: i64) -> Result<bool> {
    let now = now_ms();
    let usable = "EXISTS (SELECT 1 FROM slices s JOIN workers w ON w.id = s.worker_id WHERE s.uuid = jobs.slice_uuid \
                  AND s.loan_state = 'serving' AND w.last_seen_at >= $4)";
    let sql = format!(
        "UPDATE jobs SET state = 'queued', attempts = 0, restarts = $1, worker_id = NULL, lease_expires_at = NULL, \
           endpoint = NULL, started_at = NULL, finished_at = NULL, updated_at = $2, \
           message = 'Restarted after it ended: ' || COALESCE(message, 'no reason given.'), \
           slice_uuid = CASE WHEN slice_pinned = 1 AND {usable} THEN slice_uuid ELSE NULL END, \
           slice_pinned = CASE WHEN slice_pinned = 1 AND {usable} THEN 1 ELSE 0 END \
         WHERE id = $3 AND state IN ('failed', 'succeeded')"
    );
    let changed = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(i64::from(restarts))
        .bind(now)
        .bind(replica.to_string())
        .bind(online_since)
        .execute(conn)
        .await?
        .rows_affected();
    Ok(changed > 0)
}

/// Stops a replica that is no longer wanted; one that already ended is left alone.
pub async fn scale_down(conn: &mut AnyConnection, replica: Uuid) -> Result<()> {
    let now = now_ms();
    sqlx::query(
        "UPDATE jobs SET state = 'cancelled', message = 'Scaled down.', finished_at = $1, updated_at = $1, \
         lease_expires_at = NULL, endpoint = NULL WHERE id = $2 AND state IN ('queued', 'leased', 'running')",
    )
    .bind(now)
    .bind(replica.to_string())
    .execute(conn)
    .await?;
    Ok(())
}

/// Deletes a deployment with every replica it had. Its row is locked first, so a replica
/// the loaning round queues for it meanwhile (`loaning::finish_reclaim`) is either queued
/// before and deleted here, or finds the deployment gone.
pub async fn delete(db: &Db, id: Uuid) -> Result<()> {
    let mut tx = db.begin().await?;
    lock(&mut tx, db.backend(), id, RowLock::Update).await?;
    sqlx::query("DELETE FROM jobs WHERE deployment_id = $1").bind(id.to_string()).execute(&mut *tx).await?;
    sqlx::query("DELETE FROM deployments WHERE id = $1").bind(id.to_string()).execute(&mut *tx).await?;
    tx.commit().await?;
    Ok(())
}

/// Whether deployment `id` exists, locked for the caller's transaction (see [`RowLock`]).
pub async fn lock(conn: &mut AnyConnection, backend: Backend, id: Uuid, lock: RowLock) -> Result<bool> {
    super::lock_row(conn, backend, "deployments", id, lock).await
}

/// Another deployment sized by a throughput SLO, as the planner weighs it.
pub struct SloDeployment {
    pub name: String,
    pub model_id: Uuid,
    pub slo: SloStatus,
}

/// Every SLO deployment but `except`.
pub async fn with_slo_except(db: &Db, except: Uuid) -> Result<Vec<SloDeployment>> {
    let rows = sqlx::query("SELECT id, name, model_id, slo FROM deployments WHERE slo IS NOT NULL AND id <> $1")
        .bind(except.to_string())
        .fetch_all(db.pool())
        .await?;
    rows.iter()
        .map(|row| {
            Ok(SloDeployment {
                name: row.try_get("name")?,
                model_id: parse_uuid("deployments", "model_id", &row.try_get::<String, _>("model_id")?)?,
                slo: parse_json("deployments", "slo", &row.try_get::<String, _>("slo")?)?,
            })
        })
        .collect()
}

/// A ready replica the gateway may forward to.
pub struct RouteTarget {
    pub replica: Uuid,
    /// The worker's engine endpoint.
    pub endpoint: String,
    /// The worker's engine token (a secret: never logged).
    pub engine_token: String,
}

/// What the gateway needs to forward to a deployment.
pub struct RouteRecord {
    pub deployment_id: Uuid,
    pub owner_id: Uuid,
    pub architecture: String,
    /// The model's stored `config.json` summary, as text.
    pub config: String,
    pub targets: Vec<RouteTarget>,
}

/// The deployment called `name` with its running replicas that have an endpoint, for
/// every caller (the gateway checks the caller's scope against `owner_id`).
pub async fn route(db: &Db, name: &str) -> Result<Option<RouteRecord>> {
    if !db::storable(name) {
        return Ok(None);
    }
    let rows = sqlx::query(
        "SELECT d.id AS deployment_id, d.owner_id, m.architecture, m.config, j.id AS replica, j.endpoint, w.engine_token \
         FROM deployments d JOIN models m ON m.id = d.model_id \
         LEFT JOIN jobs j ON j.deployment_id = d.id AND j.state = 'running' AND j.endpoint IS NOT NULL \
         LEFT JOIN workers w ON w.id = j.worker_id WHERE d.name = $1",
    )
    .bind(name)
    .fetch_all(db.pool())
    .await?;
    let Some(first) = rows.first() else { return Ok(None) };
    let mut targets = Vec::new();
    for row in &rows {
        let replica: Option<String> = row.try_get("replica")?;
        let endpoint: Option<String> = row.try_get("endpoint")?;
        let engine_token: Option<String> = row.try_get("engine_token")?;
        if let (Some(replica), Some(endpoint), Some(engine_token)) = (replica, endpoint, engine_token) {
            targets.push(RouteTarget { replica: parse_uuid("jobs", "id", &replica)?, endpoint, engine_token });
        }
    }
    Ok(Some(RouteRecord {
        deployment_id: parse_uuid("deployments", "id", &first.try_get::<String, _>("deployment_id")?)?,
        owner_id: parse_uuid("deployments", "owner_id", &first.try_get::<String, _>("owner_id")?)?,
        architecture: first.try_get("architecture")?,
        config: first.try_get("config")?,
        targets,
    }))
}
