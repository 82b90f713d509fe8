//! The device slices workers offer (`slices`) and which replica holds each. A slice is
//! held while a leased or running replica is bound to it, and by a queued replica the
//! planner pinned to it; the claim reads what is free through [`Free`].

use std::collections::HashMap;

use sqlx::any::AnyRow;
use sqlx::{AnyConnection, Row};
use tessera_api::loaning::LoanState;
use tessera_api::mig::{Slice, SliceStatus};
use uuid::Uuid;

use super::db::Db;
use super::Backend;
use super::{parse_uuid, Result, Scope};

/// Jobs holding a slice: live replicas, and queued replicas pinned to it.
const HOLDING: &str = "(j.state IN ('leased', 'running') OR (j.state = 'queued' AND j.slice_pinned = 1))";

const COLUMNS: &str = "s.uuid, s.gpu_uuid, s.gpu_index, s.gpu_model, s.profile, s.start, s.memory_bytes, s.simulated";

fn slice_from_row(row: &AnyRow) -> Result<Slice> {
    Ok(Slice {
        uuid: row.try_get("uuid")?,
        gpu_uuid: row.try_get("gpu_uuid")?,
        gpu_index: row.try_get::<i64, _>("gpu_index")? as u32,
        gpu_model: row.try_get("gpu_model")?,
        profile: row.try_get("profile")?,
        start: row.try_get::<Option<i64>, _>("start")?.map(|s| s as u8),
        memory_bytes: row.try_get::<i64, _>("memory_bytes")? as u64,
        simulated: row.try_get::<i64, _>("simulated")? != 0,
    })
}

/// The first of `slices` another worker online since `online_since` (ms) offers, and that
/// worker's name: a slice has one worker, and a live one keeps it.
pub async fn offered_by_another(
    db: &Db,
    name: &str,
    slices: &[Slice],
    online_since: i64,
) -> Result<Option<(String, String)>> {
    for slice in slices {
        let other: Option<String> = sqlx::query_scalar(
            "SELECT w.name FROM slices s JOIN workers w ON w.id = s.worker_id \
             WHERE s.uuid = $1 AND w.name <> $2 AND w.last_seen_at >= $3",
        )
        .bind(&slice.uuid)
        .bind(name)
        .bind(online_since)
        .fetch_optional(db.pool())
        .await?;
        if let Some(other) = other {
            return Ok(Some((slice.uuid.clone(), other)));
        }
    }
    Ok(None)
}

/// Replaces what a registering worker offers. A simulated GPU the scheduler
/// repartitioned keeps the partition the server applied (the server's record is that
/// GPU's truth) as long as the worker still allows repartitioning. `slices` come with
/// their MIG starts filled in.
pub async fn record(db: &Db, worker: Uuid, allow_repartition: bool, slices: &[Slice]) -> Result<()> {
    let mut tx = db.begin().await?;
    sqlx::query("UPDATE workers SET allow_repartition = $1 WHERE id = $2")
        .bind(allow_repartition as i64)
        .bind(worker.to_string())
        .execute(&mut *tx)
        .await?;
    let recorded: Vec<String> = if allow_repartition {
        sqlx::query_scalar("SELECT DISTINCT gpu_uuid FROM slices WHERE worker_id = $1 AND simulated = 1")
            .bind(worker.to_string())
            .fetch_all(&mut *tx)
            .await?
    } else {
        Vec::new()
    };
    let kept: Vec<&String> =
        recorded.iter().filter(|g| slices.iter().any(|s| &s.gpu_uuid == *g && s.simulated)).collect();
    let reported: Vec<&Slice> = slices.iter().filter(|s| !kept.contains(&&s.gpu_uuid)).collect();
    // A slice offered again keeps its row, and with it its loan (lent to training, being
    // reclaimed) and lender: a worker restarting does not end a loan the round made.
    let stale: Vec<(String, String)> = sqlx::query_as("SELECT uuid, gpu_uuid FROM slices WHERE worker_id = $1")
        .bind(worker.to_string())
        .fetch_all(&mut *tx)
        .await?;
    for (uuid, gpu) in &stale {
        if !kept.contains(&gpu) && !reported.iter().any(|s| &s.uuid == uuid) {
            sqlx::query("DELETE FROM slices WHERE uuid = $1").bind(uuid).execute(&mut *tx).await?;
        }
    }
    for s in reported {
        insert(&mut tx, worker, s).await?;
    }
    tx.commit().await?;
    Ok(())
}

async fn insert(conn: &mut AnyConnection, worker: Uuid, s: &Slice) -> Result<()> {
    sqlx::query(
        "INSERT INTO slices (uuid, worker_id, gpu_uuid, gpu_index, gpu_model, profile, start, memory_bytes, simulated) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
         ON CONFLICT (uuid) DO UPDATE SET worker_id = excluded.worker_id, gpu_uuid = excluded.gpu_uuid, \
           gpu_index = excluded.gpu_index, gpu_model = excluded.gpu_model, profile = excluded.profile, \
           start = excluded.start, memory_bytes = excluded.memory_bytes, simulated = excluded.simulated",
    )
    .bind(&s.uuid)
    .bind(worker.to_string())
    .bind(&s.gpu_uuid)
    .bind(s.gpu_index as i64)
    .bind(&s.gpu_model)
    .bind(&s.profile)
    .bind(s.start.map(i64::from))
    .bind(s.memory_bytes as i64)
    .bind(s.simulated as i64)
    .execute(conn)
    .await?;
    Ok(())
}

/// The index the worker gave a GPU, read from any of its slices.
pub async fn gpu_index(conn: &mut AnyConnection, gpu_uuid: &str) -> Result<u32> {
    let index: i64 = sqlx::query_scalar("SELECT gpu_index FROM slices WHERE gpu_uuid = $1 LIMIT 1")
        .bind(gpu_uuid)
        .fetch_one(conn)
        .await?;
    Ok(index as u32)
}

/// Repartitions a GPU: its slices become `slices` (all on `gpu_uuid`).
pub async fn replace_gpu(conn: &mut AnyConnection, worker: Uuid, gpu_uuid: &str, slices: &[Slice]) -> Result<()> {
    sqlx::query("DELETE FROM slices WHERE gpu_uuid = $1").bind(gpu_uuid).execute(&mut *conn).await?;
    for slice in slices {
        insert(conn, worker, slice).await?;
    }
    Ok(())
}

/// Every worker's slices with what holds each, by worker id. Slices are shared by every
/// tenant, so all are listed; the replica, deployment, lender and training job are named
/// only when `scope` sees their owner (others read "in use").
pub async fn by_worker(db: &Db, scope: &Scope) -> Result<HashMap<Uuid, Vec<SliceStatus>>> {
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT s.worker_id, {COLUMNS}, s.loan_state, l.name AS lender, l.owner_id AS lender_owner, \
           j.id AS job_id, j.owner_id, j.gang_id, d.name AS deployment FROM slices s \
         LEFT JOIN jobs j ON j.slice_uuid = s.uuid AND {HOLDING} \
         LEFT JOIN deployments d ON d.id = j.deployment_id \
         LEFT JOIN deployments l ON l.id = s.lender_id \
         ORDER BY s.worker_id, s.gpu_index, s.start, s.uuid"
    )))
    .fetch_all(db.pool())
    .await?;
    let mut out: HashMap<Uuid, Vec<SliceStatus>> = HashMap::new();
    for row in &rows {
        let job: Option<String> = row.try_get("job_id")?;
        let owner: Option<String> = row.try_get("owner_id")?;
        let owner = owner.map(|o| parse_uuid("jobs", "owner_id", &o)).transpose()?;
        let visible = owner.is_some_and(|o| scope.sees(o));
        let gang: Option<String> = row.try_get("gang_id")?;
        let lender_owner: Option<String> = row.try_get("lender_owner")?;
        let lender_owner = lender_owner.map(|o| parse_uuid("deployments", "owner_id", &o)).transpose()?;
        let loan_state: String = row.try_get("loan_state")?;
        let status = SliceStatus {
            slice: slice_from_row(row)?,
            replica: job.as_deref().filter(|_| visible && gang.is_none()).map(|j| parse_uuid("jobs", "id", j)).transpose()?,
            deployment: if visible { row.try_get("deployment")? } else { None },
            in_use: job.is_some(),
            loan_state: LoanState::parse(&loan_state).unwrap_or_default(),
            lender: if lender_owner.is_some_and(|o| scope.sees(o)) { row.try_get("lender")? } else { None },
            training_job: gang.as_deref().filter(|_| visible).map(|g| parse_uuid("jobs", "gang_id", g)).transpose()?,
        };
        let worker = parse_uuid("slices", "worker_id", &row.try_get::<String, _>("worker_id")?)?;
        let list = out.entry(worker).or_default();
        // A slice appears once even if two jobs claim it (they should not).
        if !list.iter().any(|s| s.slice.uuid == status.slice.uuid) {
            list.push(status);
        }
    }
    Ok(out)
}

/// A slice of an online worker, as the SLO planner sees it.
pub struct FleetSliceRow {
    pub worker: Uuid,
    /// The worker lets the server repartition its simulated GPUs.
    pub allow_repartition: bool,
    pub slice: Slice,
    /// The deployment whose replica holds the slice, if any; [`TRAINING`] for a slice
    /// lent to training, being reclaimed, or held by a training rank.
    pub holder: Option<String>,
}

/// The holder the planner sees for a slice training has: not a deployment name (those
/// are letters, digits, `_`, `-` and `.`), so the planner neither takes the slice nor
/// repartitions its GPU.
pub const TRAINING: &str = "(training)";

/// The slices of workers seen since `online_since` (ms), by worker name, GPU and start.
pub async fn online(db: &Db, online_since: i64) -> Result<Vec<FleetSliceRow>> {
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT s.worker_id, w.allow_repartition, {COLUMNS}, s.loan_state, \
           (SELECT d.name FROM jobs j JOIN deployments d ON d.id = j.deployment_id WHERE j.slice_uuid = s.uuid AND {HOLDING} \
            LIMIT 1) AS holder, \
           (SELECT COUNT(*) FROM jobs j WHERE j.slice_uuid = s.uuid AND {HOLDING} AND j.deployment_id IS NULL) AS ranks \
         FROM slices s JOIN workers w ON w.id = s.worker_id WHERE w.last_seen_at >= $1 \
         ORDER BY w.name, s.gpu_index, s.start"
    )))
    .bind(online_since)
    .fetch_all(db.pool())
    .await?;
    rows.iter()
        .map(|row| {
            let lent = row.try_get::<String, _>("loan_state")? != LoanState::Serving.as_str();
            let ranks = row.try_get::<i64, _>("ranks")? > 0;
            let holder: Option<String> = row.try_get("holder")?;
            Ok(FleetSliceRow {
                worker: parse_uuid("slices", "worker_id", &row.try_get::<String, _>("worker_id")?)?,
                allow_repartition: row.try_get::<i64, _>("allow_repartition")? != 0,
                slice: slice_from_row(row)?,
                holder: if lent || ranks { Some(TRAINING.to_string()) } else { holder },
            })
        })
        .collect()
}

/// What a claiming worker may take: its serving-side slices (not lent to training, not
/// being reclaimed) that no live replica or rank holds, and those of them no queued job is
/// pinned to.
#[derive(Debug, Clone, Default)]
pub struct Free {
    pub has_slices: bool,
    pub free: Vec<String>,
    pub unreserved: Vec<String>,
}

pub async fn free_for(db: &Db, worker: Uuid) -> Result<Free> {
    let rows = sqlx::query(
        "SELECT s.uuid, \
           (SELECT COUNT(*) FROM jobs j WHERE j.slice_uuid = s.uuid AND j.state IN ('leased', 'running')) AS busy, \
           (SELECT COUNT(*) FROM jobs j WHERE j.slice_uuid = s.uuid AND j.state = 'queued' AND j.slice_pinned = 1) AS waiting \
         FROM slices s WHERE s.worker_id = $1 AND s.loan_state = 'serving' ORDER BY s.gpu_index, s.start, s.uuid",
    )
    .bind(worker.to_string())
    .fetch_all(db.pool())
    .await?;
    // A worker whose slices are all lent still has slices: its unpinned replicas wait.
    let offered: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM slices WHERE worker_id = $1")
        .bind(worker.to_string())
        .fetch_one(db.pool())
        .await?;
    let mut free = Free { has_slices: offered > 0, ..Free::default() };
    for row in &rows {
        if row.try_get::<i64, _>("busy")? == 0 {
            let uuid: String = row.try_get("uuid")?;
            if row.try_get::<i64, _>("waiting")? == 0 {
                free.unreserved.push(uuid.clone());
            }
            free.free.push(uuid);
        }
    }
    Ok(free)
}

impl Free {
    /// The claim's condition on serve jobs, with its parameters numbered from `first`:
    /// a replica the planner pinned to a slice waits for that slice to be free; any
    /// other replica needs a free slice nobody waits for, or a worker without slices
    /// (it runs on the CPU).
    pub fn condition(&self, first: usize) -> (String, Vec<String>) {
        let pinned = if self.free.is_empty() {
            "1 = 0".to_string()
        } else {
            let params: Vec<String> = (0..self.free.len()).map(|i| format!("${}", first + i)).collect();
            format!("slice_uuid IN ({})", params.join(", "))
        };
        let unpinned = if !self.has_slices || !self.unreserved.is_empty() { "1 = 1" } else { "1 = 0" };
        (
            format!("(kind <> 'serve' OR (slice_pinned = 1 AND {pinned}) OR (slice_pinned = 0 AND {unpinned}))"),
            self.free.clone(),
        )
    }
}

/// What binding a just-claimed job to its slice found.
#[derive(Debug)]
pub enum Bound {
    /// The job runs on this slice, or on none (a job of another kind, a worker without slices).
    Job(Option<Slice>),
    /// The job was deleted since the claim (its deployment went), the slice it was to
    /// take was replaced (a repartition, the worker registering again), or every free
    /// slice was taken since: the lease was given back unspent and the worker has nothing
    /// to run.
    Gone,
}

/// Binds a just-claimed serve job to its slice: the pinned one, or the first free slice
/// nobody waits for (none left: the claim is given back); none on a worker without slices. A training rank the loaning round
/// pinned to a slice gets that slice.
pub async fn bind_claimed(db: &Db, worker: Uuid, job: Uuid, free: &Free) -> Result<Bound> {
    let row = sqlx::query("SELECT kind, slice_uuid, slice_pinned FROM jobs WHERE id = $1")
        .bind(job.to_string())
        .fetch_optional(db.pool())
        .await?;
    let Some(row) = row else { return Ok(Bound::Gone) };
    let kind: String = row.try_get("kind")?;
    let pinned = row.try_get::<i64, _>("slice_pinned")? != 0;
    if kind != "serve" && !(kind == "train_rank" && pinned) {
        return Ok(Bound::Job(None));
    }
    let uuid = if pinned {
        row.try_get::<Option<String>, _>("slice_uuid")?
    } else {
        // Chosen in the statement that takes it, not from `free`: a slice lent, or taken by
        // a replica claimed in between, since `free` was read is not handed out twice. On
        // PostgreSQL the worker's row is locked first, so two binds of one worker (a claim
        // the worker gave up on still running beside its next) take turns rather than both
        // reading the same slice as free under READ COMMITTED; SQLite's write lock does that.
        let mut tx = db.begin().await?;
        if db.backend() == Backend::Postgres {
            sqlx::query("SELECT id FROM workers WHERE id = $1 FOR UPDATE")
                .bind(worker.to_string())
                .execute(&mut *tx)
                .await?;
        }
        let sql = format!(
            "UPDATE jobs SET slice_uuid = (SELECT s.uuid FROM slices s WHERE s.worker_id = $1 AND s.loan_state = 'serving' \
               AND NOT EXISTS (SELECT 1 FROM jobs j WHERE j.slice_uuid = s.uuid AND j.id <> $2 AND {HOLDING}) \
               ORDER BY s.gpu_index, s.start, s.uuid LIMIT 1) \
             WHERE id = $2 RETURNING slice_uuid"
        );
        let bound: Option<Option<String>> = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .bind(worker.to_string())
            .bind(job.to_string())
            .fetch_optional(&mut *tx)
            .await?;
        tx.commit().await?;
        // Deleted since it was read above (its deployment went).
        let Some(uuid) = bound else { return Ok(Bound::Gone) };
        if uuid.is_none() && free.has_slices {
            // Its last free slice went since the claim: a replica of a worker with slices
            // runs on one, so it waits for the next claim rather than on the CPU.
            super::jobs::unclaim(db, worker, job).await?;
            return Ok(Bound::Gone);
        }
        uuid
    };
    let Some(uuid) = uuid else { return Ok(Bound::Job(None)) };
    let row = sqlx::query(sqlx::AssertSqlSafe(format!("SELECT {COLUMNS} FROM slices s WHERE s.uuid = $1")))
        .bind(&uuid)
        .fetch_optional(db.pool())
        .await?;
    match row {
        Some(row) => Ok(Bound::Job(Some(slice_from_row(&row)?))),
        None => {
            super::jobs::unclaim(db, worker, job).await?;
            Ok(Bound::Gone)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_claim_condition_lets_pinned_replicas_wait_for_their_slice() {
        let none = Free { has_slices: true, free: vec![], unreserved: vec![] };
        assert_eq!(
            none.condition(5).0,
            "(kind <> 'serve' OR (slice_pinned = 1 AND 1 = 0) OR (slice_pinned = 0 AND 1 = 0))"
        );
        let cpu = Free::default();
        assert!(cpu.condition(5).0.ends_with("(slice_pinned = 0 AND 1 = 1))"));
        let two = Free { has_slices: true, free: vec!["a".into(), "b".into()], unreserved: vec![] };
        let (sql, binds) = two.condition(5);
        assert!(sql.contains("slice_uuid IN ($5, $6)") && sql.ends_with("(slice_pinned = 0 AND 1 = 0))"));
        assert_eq!(binds, vec!["a", "b"]);
    }
}
