//! Jobs (`jobs`) and their log lines (`job_logs`): queueing, what users read and cancel,
//! and the leased work queue. A claim is one atomic statement (PostgreSQL skips rows
//! other claimers hold locked, SQLite serialises writers), so no job is ever handed to
//! two workers; a lease no heartbeat renews expires and the job goes back to the queue.

use sqlx::any::AnyRow;
use sqlx::{AnyConnection, Row};
use tessera_api::jobs::{Job, JobSpec, JobState, LogLine};
use tessera_api::train::TrainProgress;
use uuid::Uuid;

use super::db::{self, now_ms, Backend, Db};
use super::slices::Free;
use super::{parse_json, parse_uuid, Result, Scope, StoreError};

pub(super) const JOB_COLUMNS: &str = "j.id, j.name, j.spec, j.state, j.message, j.attempts, j.max_attempts, j.worker_id, \
     j.lease_expires_at, j.created_at, j.updated_at, j.started_at, j.finished_at, j.progress_step, j.preemptions, u.username AS owner";

/// The states in which a worker holds a job's lease.
const LIVE: &str = "state IN ('leased', 'running')";

/// The states in which a job waits for a claim: queued, or preempted (issue 16), which is
/// claimed alike and resumes from the checkpoint it stopped at.
pub(super) const WAITING: &str = "('queued', 'preempted')";

/// The states of a job that has not ended.
pub(super) const UNFINISHED: &str = "('queued', 'preempted', 'leased', 'running')";

/// Decodes a `state` column.
fn parse_state(text: &str) -> Result<JobState> {
    JobState::parse(text).ok_or_else(|| StoreError::Corrupt {
        table: "jobs",
        column: "state",
        value: text.into(),
        reason: "not a job state".into(),
    })
}

pub(super) fn job_from_row(row: &AnyRow) -> Result<Job> {
    let state: String = row.try_get("state")?;
    let spec: JobSpec = parse_json("jobs", "spec", &row.try_get::<String, _>("spec")?)?;
    let worker: Option<String> = row.try_get("worker_id")?;
    let progress = match &spec {
        JobSpec::Train(train) => Some(TrainProgress {
            step: row.try_get::<Option<i64>, _>("progress_step")?.unwrap_or(0).max(0) as u64,
            max_steps: train.max_steps,
        }),
        _ => None,
    };
    Ok(Job {
        id: parse_uuid("jobs", "id", &row.try_get::<String, _>("id")?)?,
        name: row.try_get("name")?,
        owner: row.try_get("owner")?,
        spec,
        state: parse_state(&state)?,
        message: row.try_get("message")?,
        attempts: row.try_get::<i64, _>("attempts")? as u32,
        max_attempts: row.try_get::<i64, _>("max_attempts")? as u32,
        preemptions: row.try_get::<i64, _>("preemptions")?.max(0) as u32,
        worker_id: worker.as_deref().map(|w| parse_uuid("jobs", "worker_id", w)).transpose()?,
        lease_expires_at: db::opt_time(row.try_get("lease_expires_at")?),
        created_at: db::time(row.try_get("created_at")?),
        updated_at: db::time(row.try_get("updated_at")?),
        started_at: db::opt_time(row.try_get("started_at")?),
        finished_at: db::opt_time(row.try_get("finished_at")?),
        progress,
    })
}

/// A job to queue, with what it belongs to besides its owner.
#[derive(Debug, Clone)]
pub struct NewJob<'a> {
    pub owner: Uuid,
    pub name: &'a str,
    pub spec: &'a JobSpec,
    pub max_attempts: u32,
    /// The deployment a serving replica belongs to.
    pub deployment: Option<Uuid>,
    /// The dataset a training job reads (a dataset in use cannot be deleted).
    pub dataset: Option<Uuid>,
    /// The slice the planner placed a replica on; it waits for that slice.
    pub pinned_slice: Option<&'a str>,
}

impl<'a> NewJob<'a> {
    /// A job that belongs to nothing but its owner.
    pub fn new(owner: Uuid, name: &'a str, spec: &'a JobSpec, max_attempts: u32) -> NewJob<'a> {
        NewJob { owner, name, spec, max_attempts, deployment: None, dataset: None, pinned_slice: None }
    }
}

/// Queues a job; returns its id.
pub async fn insert(db: &Db, job: &NewJob<'_>) -> Result<Uuid> {
    insert_in(&mut *db.pool().acquire().await?, job).await
}

/// Queues a job inside the caller's transaction.
pub async fn insert_in(conn: &mut AnyConnection, job: &NewJob<'_>) -> Result<Uuid> {
    let id = Uuid::new_v4();
    let now = now_ms();
    sqlx::query(
        "INSERT INTO jobs (id, owner_id, name, kind, spec, state, attempts, max_attempts, created_at, updated_at, \
         deployment_id, dataset_id, slice_uuid, slice_pinned) \
         VALUES ($1, $2, $3, $4, $5, 'queued', 0, $6, $7, $7, $8, $9, $10, $11)",
    )
    .bind(id.to_string())
    .bind(job.owner.to_string())
    .bind(job.name)
    .bind(job.spec.kind())
    .bind(serde_json::to_string(job.spec)?)
    .bind(job.max_attempts as i64)
    .bind(now)
    .bind(job.deployment.map(|d| d.to_string()))
    .bind(job.dataset.map(|d| d.to_string()))
    .bind(job.pinned_slice)
    .bind(job.pinned_slice.is_some() as i64)
    .execute(conn)
    .await?;
    Ok(id)
}

/// A job `scope` may see.
pub async fn get(db: &Db, scope: &Scope, id: Uuid) -> Result<Option<Job>> {
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {JOB_COLUMNS} FROM jobs j JOIN users u ON u.id = j.owner_id WHERE j.id = $1 AND ($2 IS NULL OR j.owner_id = $2)"
    )))
    .bind(id.to_string())
    .bind(scope.owner_filter())
    .fetch_optional(db.pool())
    .await?;
    row.as_ref().map(job_from_row).transpose()
}

/// The most jobs one read of the list returns.
pub const LIST_LIMIT: u32 = 500;

/// The kinds of job [`list`] shows: serving replicas are listed with their deployment and
/// the ranks of data-parallel jobs are their job's.
pub const LISTED_KINDS: [&str; 3] = ["prefetch", "profile", "train"];

/// Which jobs [`list`] shows: all, or those in one state, of one kind, or both.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ListFilter {
    pub state: Option<JobState>,
    /// One of [`LISTED_KINDS`]; `train` takes in data-parallel jobs (stored as `train_gang`).
    pub kind: Option<&'static str>,
}

/// Jobs `scope` may see that pass `filter`, newest first, without serving replicas or the
/// ranks of data-parallel jobs (see [`LISTED_KINDS`]): at most `limit`, and with `before`
/// only those listed after that job,
/// so a caller pages by passing the last job it got. `Ok(None)` when `before` names no job
/// `scope` may see. Jobs of one millisecond keep the order they were queued in.
pub async fn list(
    db: &Db,
    scope: &Scope,
    filter: ListFilter,
    before: Option<Uuid>,
    limit: u32,
) -> Result<Option<Vec<Job>>> {
    let cursor: Option<(i64, i64)> = match before {
        None => None,
        Some(id) => {
            let found = sqlx::query_as(
                "SELECT created_at, queue_seq FROM jobs WHERE id = $1 AND ($2 IS NULL OR owner_id = $2)",
            )
            .bind(id.to_string())
            .bind(scope.owner_filter())
            .fetch_optional(db.pool())
            .await?;
            match found {
                Some(cursor) => Some(cursor),
                None => return Ok(None),
            }
        }
    };
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {JOB_COLUMNS} FROM jobs j JOIN users u ON u.id = j.owner_id \
         WHERE ($1 IS NULL OR j.owner_id = $1) AND ($2 IS NULL OR j.state = $2) \
         AND ($3 IS NULL OR j.kind = $3 OR (j.kind = 'train_gang' AND $3 = 'train')) \
         AND j.deployment_id IS NULL AND j.gang_id IS NULL \
         AND ($4 IS NULL OR j.created_at < $4 OR (j.created_at = $4 AND j.queue_seq < $5)) \
         ORDER BY j.created_at DESC, j.queue_seq DESC LIMIT $6"
    )))
    .bind(scope.owner_filter())
    .bind(filter.state.map(JobState::as_str))
    .bind(filter.kind)
    .bind(cursor.map(|c| c.0))
    .bind(cursor.map(|c| c.1))
    .bind(limit as i64)
    .fetch_all(db.pool())
    .await?;
    rows.iter().map(job_from_row).collect::<Result<_>>().map(Some)
}

/// How many of the jobs [`list`] pages through `scope` may see in each state; states
/// with none are left out.
pub async fn count_by_state(db: &Db, scope: &Scope) -> Result<Vec<(JobState, i64)>> {
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT state, COUNT(*) FROM jobs WHERE ($1 IS NULL OR owner_id = $1) AND deployment_id IS NULL \
         AND gang_id IS NULL GROUP BY state",
    )
    .bind(scope.owner_filter())
    .fetch_all(db.pool())
    .await?;
    rows.iter().map(|(state, count)| Ok((parse_state(state)?, *count))).collect()
}

/// The newest [`LIST_LIMIT`] training jobs `scope` may see (the dashboard's run comparison).
pub async fn newest_training(db: &Db, scope: &Scope) -> Result<Vec<Job>> {
    let filter = ListFilter { state: None, kind: Some("train") };
    Ok(list(db, scope, filter, None, LIST_LIMIT).await?.unwrap_or_default())
}

/// The spec of a job (any owner's: for the worker holding it).
pub async fn spec(db: &Db, id: Uuid) -> Result<Option<JobSpec>> {
    let text: Option<String> = sqlx::query_scalar("SELECT spec FROM jobs WHERE id = $1")
        .bind(id.to_string())
        .fetch_optional(db.pool())
        .await?;
    text.map(|text| parse_json("jobs", "spec", &text)).transpose()
}

/// Cancels a job `scope` may see unless it already ended; false when there was nothing
/// to cancel. A worker running it learns at its next heartbeat.
pub async fn cancel(db: &Db, scope: &Scope, id: Uuid, message: &str) -> Result<bool> {
    let now = now_ms();
    let changed = sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE jobs SET state = 'cancelled', message = $1, finished_at = $2, updated_at = $2, lease_expires_at = NULL, \
         preempt_reason = NULL WHERE id = $3 AND ($4 IS NULL OR owner_id = $4) AND state IN {UNFINISHED}"
    )))
    .bind(message)
    .bind(now)
    .bind(id.to_string())
    .bind(scope.owner_filter())
    .execute(db.pool())
    .await?
    .rows_affected();
    Ok(changed > 0)
}

/// How many unfinished jobs read `dataset`.
pub async fn unfinished_reading(conn: &mut AnyConnection, dataset: Uuid) -> Result<i64> {
    Ok(sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM jobs WHERE dataset_id = $1 AND state IN {UNFINISHED}"
    )))
    .bind(dataset.to_string())
    .fetch_one(conn)
    .await?)
}

/// The unfinished jobs (id and kind) that read registered model `model`: training,
/// prefetch and profile jobs, each data-parallel job once (its ranks left out, as are
/// serving replicas, which their deployment answers for).
pub async fn unfinished_using_model(conn: &mut AnyConnection, model: Uuid) -> Result<Vec<(Uuid, &'static str)>> {
    // The spec names the model by its id: the LIKE narrows the rows, the spec decides.
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT id, spec FROM jobs WHERE deployment_id IS NULL AND gang_id IS NULL AND state IN {UNFINISHED} \
         AND spec LIKE $1 ORDER BY created_at, id"
    )))
    .bind(format!("%{model}%"))
    .fetch_all(conn)
    .await?;
    let mut using = Vec::new();
    for row in &rows {
        let spec: JobSpec = parse_json("jobs", "spec", &row.try_get::<String, _>("spec")?)?;
        if spec.model() == Some(model) {
            using.push((parse_uuid("jobs", "id", &row.try_get::<String, _>("id")?)?, spec.kind()));
        }
    }
    Ok(using)
}

/// A job's log lines after sequence number `after`, oldest first, at most `limit`.
pub async fn logs(db: &Db, job: Uuid, after: i64, limit: i64) -> Result<Vec<LogLine>> {
    let rows = sqlx::query("SELECT seq, at, line FROM job_logs WHERE job_id = $1 AND seq > $2 ORDER BY seq LIMIT $3")
        .bind(job.to_string())
        .bind(after)
        .bind(limit)
        .fetch_all(db.pool())
        .await?;
    rows.iter()
        .map(|r| Ok(LogLine { seq: r.try_get("seq")?, at: db::time(r.try_get("at")?), line: r.try_get("line")? }))
        .collect()
}

/// The last `limit` lines of a job's log, oldest first, and how many came before them
/// (lines are numbered from 1 and never removed while the job exists).
pub async fn log_tail(db: &Db, job: Uuid, limit: i64) -> Result<(Vec<LogLine>, u64)> {
    let rows = sqlx::query("SELECT seq, at, line FROM job_logs WHERE job_id = $1 ORDER BY seq DESC LIMIT $2")
        .bind(job.to_string())
        .bind(limit)
        .fetch_all(db.pool())
        .await?;
    let mut lines = rows
        .iter()
        .map(|r| Ok(LogLine { seq: r.try_get("seq")?, at: db::time(r.try_get("at")?), line: r.try_get("line")? }))
        .collect::<Result<Vec<_>>>()?;
    lines.reverse();
    let earlier = lines.first().map_or(0, |l| l.seq.saturating_sub(1).max(0) as u64);
    Ok((lines, earlier))
}

/// Appends lines to a job's log, numbered on from its last line, stamped `at`. The
/// numbers come from the job's own counter, bumped under its row lock, so concurrent
/// appends to one job never take the same number (`MAX(seq) + 1` read by two writers
/// at once did, on PostgreSQL). Lines for a job that no longer exists are dropped.
pub async fn append_logs(db: &Db, job: Uuid, lines: &[String], at: i64) -> Result<()> {
    append_batch(db, job, lines, at, None).await.map(drop)
}

/// [`append_logs`] for a batch a worker named: a batch whose id the job's log holds
/// already (it was sent again after its answer was lost) is dropped; answers whether
/// the lines were appended.
pub async fn append_batch(db: &Db, job: Uuid, lines: &[String], at: i64, batch: Option<Uuid>) -> Result<bool> {
    if lines.is_empty() {
        return Ok(false);
    }
    let mut tx = db.begin().await?;
    let last: Option<i64> = sqlx::query_scalar("UPDATE jobs SET log_seq = log_seq + $1 WHERE id = $2 RETURNING log_seq")
        .bind(lines.len() as i64)
        .bind(job.to_string())
        .fetch_optional(&mut *tx)
        .await?;
    let Some(last) = last else {
        return Ok(false);
    };
    let first = last - lines.len() as i64 + 1;
    for (i, line) in lines.iter().enumerate() {
        // The batch's id goes on its first line, where the unique index finds a repeat.
        let batch = if i == 0 { batch.map(|b| b.to_string()) } else { None };
        let added = sqlx::query(
            "INSERT INTO job_logs (job_id, seq, at, line, batch) VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
        )
        .bind(job.to_string())
        .bind(first + i as i64)
        .bind(at)
        .bind(line)
        .bind(batch)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if added == 0 {
            // Only a repeated batch id conflicts (the numbers are the job's own); dropping
            // the transaction takes its counter back too.
            return Ok(false);
        }
    }
    tx.commit().await?;
    Ok(true)
}

/// A job a worker just leased.
#[derive(Debug, Clone)]
pub struct Claimed {
    pub job_id: Uuid,
    pub spec: JobSpec,
    pub attempt: u32,
    pub lease_expires_at: i64,
}

/// The order claims take queued jobs in: first those of the owner who holds the fewest
/// live leases now (serving replicas included), then the oldest. A user who floods the
/// queue thus waits behind every other user's next job instead of starving them; among
/// owners who hold as many, and within one owner, the queue stays oldest-first, in the
/// order jobs were queued where they share a millisecond (`queue_seq`, migration 0017).
const FAIR_ORDER: &str = "(SELECT COUNT(*) FROM jobs live WHERE live.owner_id = jobs.owner_id \
     AND live.state IN ('leased', 'running')), created_at, queue_seq";

/// Leases a queued job of one of `kinds` to `worker`, in [`FAIR_ORDER`], taking only the
/// serve jobs the worker's free slices allow (see [`Free::condition`]).
pub async fn claim(
    db: &Db,
    worker: Uuid,
    kinds: &[String],
    lease_ttl_ms: i64,
    slices: &Free,
) -> Result<Option<Claimed>> {
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
         updated_at = $3, message = NULL, preempt_reason = NULL, preempted_by = NULL \
         WHERE state IN {WAITING} AND id = (SELECT id FROM jobs WHERE state IN {WAITING} AND kind IN ({}) \
         AND {slice_condition} ORDER BY {FAIR_ORDER} LIMIT 1 {lock}) \
         RETURNING id, spec, attempts, lease_expires_at",
        kind_params.join(", ")
    );
    let mut query = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(worker.to_string()).bind(now + lease_ttl_ms).bind(now);
    for kind in kinds {
        query = query.bind(kind);
    }
    for slice in slice_params {
        query = query.bind(slice);
    }
    let Some(row) = query.fetch_optional(db.pool()).await? else {
        return Ok(None);
    };
    Ok(Some(Claimed {
        job_id: parse_uuid("jobs", "id", &row.try_get::<String, _>("id")?)?,
        spec: parse_json("jobs", "spec", &row.try_get::<String, _>("spec")?)?,
        attempt: row.try_get::<i64, _>("attempts")? as u32,
        lease_expires_at: row.try_get("lease_expires_at")?,
    }))
}

/// Extends the leases `worker` still holds among `jobs`; returns the ids it no longer
/// holds (cancelled, expired and requeued, or never its own), which it must stop.
pub async fn renew(db: &Db, worker: Uuid, jobs: &[Uuid], lease_ttl_ms: i64) -> Result<Vec<Uuid>> {
    let mut lost = Vec::new();
    let expires = now_ms() + lease_ttl_ms;
    for job in jobs {
        let renewed =
            sqlx::query(sqlx::AssertSqlSafe(format!("UPDATE jobs SET lease_expires_at = $1 WHERE id = $2 AND worker_id = $3 AND {LIVE}")))
                .bind(expires)
                .bind(job.to_string())
                .bind(worker.to_string())
                .execute(db.pool())
                .await?
                .rows_affected();
        if renewed == 0 {
            lost.push(*job);
        }
    }
    Ok(lost)
}

/// True while `worker` holds the lease on `job`.
pub async fn holds_lease(db: &Db, worker: Uuid, job: Uuid) -> Result<bool> {
    let held: i64 =
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT COUNT(*) FROM jobs WHERE id = $1 AND worker_id = $2 AND {LIVE}")))
            .bind(job.to_string())
            .bind(worker.to_string())
            .fetch_one(db.pool())
            .await?;
    Ok(held > 0)
}

/// Whether `worker` ended `job` in `state` already: its report of that end was stored
/// and is being sent again, its answer lost.
pub async fn ended_by(db: &Db, worker: Uuid, job: Uuid, state: JobState) -> Result<bool> {
    let ended: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM jobs WHERE id = $1 AND worker_id = $2 AND state = $3")
        .bind(job.to_string())
        .bind(worker.to_string())
        .bind(state.as_str())
        .fetch_one(db.pool())
        .await?;
    Ok(ended > 0)
}

/// Marks a job `worker` holds as running (a serving replica with the URL its engine
/// answers on); false when the worker does not hold it. A replica that serves has its
/// attempts counted afresh: they count the placements in a row that never came up, not
/// every worker restart over months of serving.
pub async fn mark_running(
    db: &Db,
    worker: Uuid,
    job: Uuid,
    message: Option<&str>,
    endpoint: Option<&str>,
) -> Result<bool> {
    let now = now_ms();
    let changed = sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE jobs SET state = 'running', message = $1, updated_at = $2, started_at = COALESCE(started_at, $2), \
         endpoint = $5, attempts = CASE WHEN kind = 'serve' THEN 1 ELSE attempts END \
         WHERE id = $3 AND worker_id = $4 AND {LIVE}"
    )))
    .bind(message)
    .bind(now)
    .bind(job.to_string())
    .bind(worker.to_string())
    .bind(endpoint)
    .execute(db.pool())
    .await?
    .rows_affected();
    Ok(changed > 0)
}

/// Ends a job `worker` holds in `state` (succeeded or failed); false when the worker
/// does not hold it.
pub async fn mark_finished(db: &Db, worker: Uuid, job: Uuid, state: JobState, message: Option<&str>) -> Result<bool> {
    let now = now_ms();
    let changed = sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE jobs SET state = $5, message = $1, updated_at = $2, finished_at = $2, lease_expires_at = NULL, \
         endpoint = NULL WHERE id = $3 AND worker_id = $4 AND {LIVE}"
    )))
    .bind(message)
    .bind(now)
    .bind(job.to_string())
    .bind(worker.to_string())
    .bind(state.as_str())
    .execute(db.pool())
    .await?
    .rows_affected();
    Ok(changed > 0)
}

/// Gives back a lease `worker` took on `job` and never ran: queued again, no attempt spent.
pub async fn unclaim(db: &Db, worker: Uuid, job: Uuid) -> Result<()> {
    sqlx::query(
        "UPDATE jobs SET state = 'queued', worker_id = NULL, lease_expires_at = NULL, attempts = attempts - 1, \
         updated_at = $1 WHERE id = $2 AND worker_id = $3 AND state = 'leased'",
    )
    .bind(now_ms())
    .bind(job.to_string())
    .bind(worker.to_string())
    .execute(db.pool())
    .await?;
    Ok(())
}

/// The `SET` list that takes a live job's lease back: queued again, or failed once its
/// attempts are spent. `$1` is the time, `$2` the message when requeued, `$3` when failed.
const RELEASE: &str = "state = CASE WHEN attempts >= max_attempts THEN 'failed' ELSE 'queued' END, \
    message = CASE WHEN attempts >= max_attempts THEN $3 ELSE $2 END, \
    finished_at = CASE WHEN attempts >= max_attempts THEN $1 ELSE NULL END, \
    worker_id = NULL, lease_expires_at = NULL, updated_at = $1, preempt_reason = NULL";

/// Takes back every job `worker` holds (it restarted: what its previous incarnation ran
/// is gone), requeued or failed as [`expire_leases`] does. Returns how many were touched.
pub async fn release_held_by(db: &Db, worker: Uuid) -> Result<u64> {
    let sql = format!("UPDATE jobs SET {RELEASE} WHERE worker_id = $4 AND {LIVE}");
    let touched = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(now_ms())
        .bind("The worker restarted; the job was requeued.")
        .bind("The worker restarted during the job's last allowed attempt.")
        .bind(worker.to_string())
        .execute(db.pool())
        .await?
        .rows_affected();
    Ok(touched)
}

/// Takes back the leases `worker` holds on jobs it has not started and did not list in its
/// heartbeat (`listed`): a claim whose answer it never got (it timed out, the connection
/// broke), or a job that ended on the worker before it started. Requeued or failed at once,
/// as [`expire_leases`] would once the lease ran out (the attempt stays spent, so a job that
/// keeps ending early still fails); returns them. Ranks are left to their gang.
pub async fn release_unlisted(db: &Db, worker: Uuid, listed: &[Uuid]) -> Result<Vec<Uuid>> {
    let held: Vec<String> =
        sqlx::query_scalar("SELECT id FROM jobs WHERE worker_id = $1 AND state = 'leased' AND kind <> 'train_rank'")
            .bind(worker.to_string())
            .fetch_all(db.pool())
            .await?;
    let mut released = Vec::new();
    for job in held.iter().filter_map(|id| id.parse::<Uuid>().ok()).filter(|job| !listed.contains(job)) {
        let sql = format!("UPDATE jobs SET {RELEASE} WHERE id = $4 AND worker_id = $5 AND state = 'leased'");
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(now_ms())
            .bind("The worker was not running the job (it never got the claim back, or the job ended before it \
                   started); the job was requeued.")
            .bind("The worker was not running the job on its last allowed attempt.")
            .bind(job.to_string())
            .bind(worker.to_string())
            .execute(db.pool())
            .await?;
        released.push(job);
    }
    Ok(released)
}

/// Requeues every job whose lease has expired, or fails it once its attempts are spent.
/// Returns how many jobs were touched.
pub async fn expire_leases(db: &Db) -> Result<u64> {
    let sql = format!("UPDATE jobs SET {RELEASE} WHERE {LIVE} AND lease_expires_at < $1");
    let touched = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(now_ms())
        .bind("The lease expired (the worker stopped responding); the job was requeued.")
        .bind("The lease expired on the last allowed attempt; the worker stopped responding.")
        .execute(db.pool())
        .await?
        .rows_affected();
    Ok(touched)
}

/// The `scheduler_leases` row that says until when the leases are watched: a server's
/// lease sweep, or a starting server's grace, covers them up to its `expires_at`.
const WATCHED: &str = "lease-sweep";

/// Records that `server` swept the leases (or gave them grace) just now: they count as
/// watched until `until`. Every server's sweep writes it; the latest write wins.
pub async fn watched(db: &Db, server: Uuid, until: i64) -> Result<()> {
    sqlx::query(
        "INSERT INTO scheduler_leases (name, holder, expires_at) VALUES ($1, $2, $3) \
         ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, expires_at = excluded.expires_at",
    )
    .bind(WATCHED)
    .bind(server.to_string())
    .bind(until)
    .execute(db.pool())
    .await?;
    Ok(())
}

/// As `server` starts: when no server watched the leases (a sweep or a grace that covers
/// now, [`watched`]), no worker could renew its leases meanwhile, and expiring them at once
/// would requeue every job and replica that ran on through the outage (each an attempt
/// spent), so every live lease gets at least `ttl_ms` from now and the leases count as
/// watched for `watch_ms`. A worker that died meanwhile loses its jobs one lease later.
/// A server starting while another sweeps (a rolling restart), or again within `watch_ms`
/// of a grace (a crash loop), gives none: the leases of dead workers still run out.
/// Returns how many leases were extended, or `None` when the leases were being watched.
pub async fn grace_leases(db: &Db, server: Uuid, ttl_ms: i64, watch_ms: i64) -> Result<Option<u64>> {
    let now = now_ms();
    let until: Option<i64> = sqlx::query_scalar("SELECT expires_at FROM scheduler_leases WHERE name = $1")
        .bind(WATCHED)
        .fetch_optional(db.pool())
        .await?;
    if until.is_some_and(|until| until >= now) {
        return Ok(None);
    }
    let sql = format!("UPDATE jobs SET lease_expires_at = $1 WHERE {LIVE} AND lease_expires_at < $1");
    let extended = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(now + ttl_ms).execute(db.pool()).await?.rows_affected();
    watched(db, server, now + watch_ms).await?;
    Ok(Some(extended))
}

/// Jobs waiting in the queue, preempted ones included (a Prometheus gauge and the
/// dashboard use it).
pub async fn depth(db: &Db) -> Result<i64> {
    Ok(sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT COUNT(*) FROM jobs WHERE state IN {WAITING}")))
        .fetch_one(db.pool())
        .await?)
}

/// Asks the worker holding `job` (a one-process job, or a formed gang's job) to preempt
/// it, keeping the first reason given; false when no worker runs it (queued, preempted,
/// a gang still forming, ended). The heartbeat answer carries the request (see
/// [`preempt_requested`]); the lease stays the worker's until it reports `preempted`.
pub async fn request_preemption(db: &Db, job: Uuid, reason: &str) -> Result<bool> {
    let now = now_ms();
    let mut tx = db.begin().await?;
    let changed = sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE jobs SET preempt_reason = COALESCE(preempt_reason, $1), updated_at = $2, regrow = 0 WHERE id = $3 \
         AND {LIVE}"
    )))
    .bind(reason)
    .bind(now)
    .bind(job.to_string())
    .execute(&mut *tx)
    .await?
    .rows_affected();
    if changed > 0 {
        // A gang growing or shrinking in place stops whole instead.
        super::regroup::cancel_in(&mut tx, &job.to_string(), now).await?;
    }
    tx.commit().await?;
    Ok(changed > 0)
}

/// The jobs `worker` holds that are asked to preempt: their own request, or for a rank,
/// its gang's; or asked to stop for a regroup (a rank of a gang resizing in place, once
/// every joining rank is ready: `store::regroup`), which the worker heeds the same way.
pub async fn preempt_requested(db: &Db, worker: Uuid) -> Result<Vec<Uuid>> {
    let ids: Vec<String> = sqlx::query_scalar(
        "SELECT j.id FROM jobs j LEFT JOIN jobs g ON g.id = j.gang_id WHERE j.worker_id = $1 \
         AND j.state IN ('leased', 'running') AND (j.preempt_reason IS NOT NULL OR g.preempt_reason IS NOT NULL \
           OR (g.regroup_world IS NOT NULL AND j.gang_joining = 0 AND NOT EXISTS (SELECT 1 FROM jobs x \
             WHERE x.gang_id = g.id AND x.gang_joining = 1 AND x.gang_address IS NULL)))",
    )
    .bind(worker.to_string())
    .fetch_all(db.pool())
    .await?;
    ids.iter().map(|id| parse_uuid("jobs", "id", id)).collect()
}

/// A job `worker` holds and was asked to preempt has checkpointed and stopped: a
/// one-process job waits as `preempted` for its next claim, its attempt given back; a
/// rank waits as `preempted` for its gang's other ranks (`gangs::sweep` then preempts the
/// gang). False when the worker does not hold it or no preemption was asked for. The lease
/// is freed, so the job is claimable; `preempted_by` keeps who stopped it until its next
/// claim ([`preempted_by`]).
pub async fn mark_preempted(db: &Db, worker: Uuid, job: Uuid, message: &str) -> Result<bool> {
    let changed = sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE jobs SET state = 'preempted', message = $1, updated_at = $2, worker_id = NULL, \
         lease_expires_at = NULL, endpoint = NULL, preempt_reason = NULL, preempted_by = $4, \
         attempts = CASE WHEN gang_id IS NULL THEN attempts - 1 ELSE attempts END, \
         preemptions = CASE WHEN gang_id IS NULL THEN preemptions + 1 ELSE preemptions END \
         WHERE id = $3 AND worker_id = $4 AND {LIVE} AND (preempt_reason IS NOT NULL OR EXISTS \
         (SELECT 1 FROM jobs g WHERE g.id = jobs.gang_id AND g.preempt_reason IS NOT NULL))"
    )))
    .bind(message)
    .bind(now_ms())
    .bind(job.to_string())
    .bind(worker.to_string())
    .execute(db.pool())
    .await?
    .rows_affected();
    Ok(changed > 0)
}

/// Whether `worker`'s `preempted` report on `job` was stored and nobody claimed the job
/// since: the report is being sent again, its answer lost. Still so once the job (or, for a
/// rank, its gang) moved on without a claim: requeued with its gang, cancelled.
pub async fn preempted_by(db: &Db, worker: Uuid, job: Uuid) -> Result<bool> {
    let stopped: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM jobs WHERE id = $1 AND preempted_by = $2 AND worker_id IS NULL")
            .bind(job.to_string())
            .bind(worker.to_string())
            .fetch_one(db.pool())
            .await?;
    Ok(stopped > 0)
}
