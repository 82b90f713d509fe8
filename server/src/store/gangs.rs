//! Gangs: data-parallel training jobs whose ranks are placed all or none (issue 12).
//!
//! A gang is one job row users see (kind `train_gang`, never claimed itself) and one row
//! per rank (kind `train_rank`, `gang_id` pointing at it) that workers claim and lease
//! like any job, so heartbeats, lease expiry and worker restarts work unchanged. The
//! choice: a claimed rank is only held while its gang forms. Claiming the first rank sets
//! the gang's deadline (the rendezvous time-out); each rank posts its ring address; when
//! every rank is claimed and posted, the gang *forms* in one conditional update (its job
//! `running`, its attempts + 1, the ranks `running`). A gang not formed by its deadline
//! is released: every rank goes back to the queue and no attempt is spent.
//!
//! Once formed, a rank that stops (its lease expired, its worker restarted) ends the
//! attempt: every rank is requeued and the gang forms again and resumes from its last
//! checkpoint, or fails once its attempts are spent. A rank that reports a failure fails
//! the job, as a one-process job's failure does; the job succeeds when every rank has.
//! Rank rows get a `max_attempts` no requeue reaches: the gang's job counts attempts.
//!
//! Preemption (issue 16): a formed gang asked to preempt (its job's `preempt_reason`)
//! tells every rank at its heartbeat; the ranks agree on a step through their all-reduce,
//! rank 0 checkpoints, and each rank reports `preempted`. Once every rank has, the gang
//! waits as `preempted` (claimed like `queued`, no attempt spent) with its ranks queued.
//! While it waits an elastic gang may be [`reshape`]d to another rank count.

use sqlx::{AnyConnection, Row};
use tessera_api::jobs::{JobSpec, JobState};
use tessera_api::parallel::{RankJob, RankStep};
use uuid::Uuid;

use super::db::{now_ms, Backend, Db};
use super::jobs::{self, Claimed, NewJob, UNFINISHED, WAITING};
use super::{parse_json, parse_uuid, Result};

/// A rank row's attempts are claims, which a gang that does not form repeats; the gang's
/// job holds the real count, so this is only a bound no rank reaches.
const RANK_MAX_ATTEMPTS: i64 = 1 << 40;

/// The states in which a worker holds a rank.
pub(super) const LIVE: &str = "('leased', 'running')";

/// Queues a gang inside the caller's transaction: its job (what users see) and one row per rank.
/// `ranks[i]` is rank i's placement (`cpu`, `cuda`, `slice:<profile>`) and spec.
pub async fn insert_in(conn: &mut AnyConnection, job: &NewJob<'_>, ranks: &[(String, RankJob)]) -> Result<Uuid> {
    let gang = jobs::insert_in(conn, job).await?;
    sqlx::query("UPDATE jobs SET kind = 'train_gang' WHERE id = $1").bind(gang.to_string()).execute(&mut *conn).await?;
    insert_ranks(conn, gang, job.owner, job.name, job.dataset, ranks).await?;
    Ok(gang)
}

/// One queued rank row per entry of `ranks`, in `gang`; their ids.
pub(super) async fn insert_ranks(
    conn: &mut AnyConnection,
    gang: Uuid,
    owner: Uuid,
    gang_name: &str,
    dataset: Option<Uuid>,
    ranks: &[(String, RankJob)],
) -> Result<Vec<Uuid>> {
    let mut ids = Vec::new();
    for (placement, rank) in ranks {
        let spec = JobSpec::TrainRank(RankJob { gang, ..rank.clone() });
        let name = format!("{gang_name} rank {}", rank.rank);
        let row = NewJob { dataset, ..NewJob::new(owner, &name, &spec, 1) };
        let id = jobs::insert_in(&mut *conn, &row).await?;
        sqlx::query(
            "UPDATE jobs SET gang_id = $1, gang_rank = $2, gang_placement = $3, max_attempts = $4 WHERE id = $5",
        )
        .bind(gang.to_string())
        .bind(rank.rank as i64)
        .bind(placement)
        .bind(RANK_MAX_ATTEMPTS)
        .bind(id.to_string())
        .execute(&mut *conn)
        .await?;
        ids.push(id);
    }
    Ok(ids)
}

/// Replaces a waiting gang's ranks by `ranks` (an elastic job resized while it waits:
/// its next formation runs at `ranks.len()`). Only while the gang is queued or preempted
/// and none of its ranks is claimed: false otherwise, changing nothing. The gang's job
/// keeps its metrics, checkpoints and logs; the rank rows hold nothing else.
pub async fn reshape(db: &Db, gang: Uuid, ranks: &[(String, RankJob)]) -> Result<bool> {
    let mut tx = db.begin().await?;
    // Taking the gang's row first makes reshapes of one gang wait for each other.
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE jobs SET updated_at = $1 WHERE id = $2 AND kind = 'train_gang' AND state IN {WAITING} \
         RETURNING owner_id, name, dataset_id"
    )))
    .bind(now_ms())
    .bind(gang.to_string())
    .fetch_optional(&mut *tx)
    .await?;
    let Some(row) = row else {
        return Ok(false);
    };
    let total: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM jobs WHERE gang_id = $1")
        .bind(gang.to_string())
        .fetch_one(&mut *tx)
        .await?;
    // Only unclaimed ranks go: a rank claimed meanwhile keeps its row and the reshape is off.
    let deleted = sqlx::query("DELETE FROM jobs WHERE gang_id = $1 AND state = 'queued'")
        .bind(gang.to_string())
        .execute(&mut *tx)
        .await?
        .rows_affected();
    if deleted as i64 != total {
        tx.rollback().await?;
        return Ok(false);
    }
    let owner = parse_uuid("jobs", "owner_id", &row.try_get::<String, _>("owner_id")?)?;
    let name: String = row.try_get("name")?;
    let dataset: Option<String> = row.try_get("dataset_id")?;
    let dataset = dataset.as_deref().map(|d| parse_uuid("jobs", "dataset_id", d)).transpose()?;
    insert_ranks(&mut tx, gang, owner, &name, dataset, ranks).await?;
    tx.commit().await?;
    Ok(true)
}

/// What `worker` can host: `cpu` always, `cuda` with a GPU, `slice:<profile>` per MIG
/// profile it offers.
pub async fn placements(db: &Db, worker: Uuid) -> Result<Vec<String>> {
    let inventory: Option<String> = sqlx::query_scalar("SELECT inventory FROM workers WHERE id = $1")
        .bind(worker.to_string())
        .fetch_optional(db.pool())
        .await?;
    let mut offered = vec!["cpu".to_string()];
    if let Some(text) = inventory {
        let inventory: tessera_api::workers::Inventory = parse_json("workers", "inventory", &text)?;
        if !inventory.gpus.is_empty() {
            offered.push("cuda".into());
        }
        for slice in &inventory.slices {
            if let Some(profile) = &slice.profile {
                let placement = format!("slice:{profile}");
                if !offered.contains(&placement) {
                    offered.push(placement);
                }
            }
        }
    }
    Ok(offered)
}

/// Leases `worker` the next queued rank it can host, oldest gang first and lowest rank
/// first (so claimers fill one gang before the next): a rank of a waiting gang, or one
/// joining a running gang that grows in place (`store::regroup`). For a waiting gang it
/// starts the rendezvous clock: unless every rank is claimed and posted by `deadline`, all are released. A rank
/// on a MIG slice is claimed only by the worker of the slice the loaning round pinned it
/// to (`store::loaning`), so training never lands on a slice serving holds, not while the
/// slice is being reclaimed, and only once no other job holds the slice (the round may pin
/// it to a slice a rank leaving its gang in place still runs on, whose row goes when its
/// regroup forms, or a replica claimed since the round read the fleet may run there).
pub async fn claim_rank(
    db: &Db,
    worker: Uuid,
    placements: &[String],
    lease_ttl_ms: i64,
    deadline: i64,
) -> Result<Option<Claimed>> {
    if placements.is_empty() {
        return Ok(None);
    }
    let now = now_ms();
    let params: Vec<String> = (0..placements.len()).map(|i| format!("${}", i + 4)).collect();
    let lock = match db.backend() {
        Backend::Postgres => "FOR UPDATE OF r SKIP LOCKED",
        Backend::Sqlite => "",
    };
    let sql = format!(
        "UPDATE jobs SET state = 'leased', worker_id = $1, lease_expires_at = $2, attempts = attempts + 1, \
         updated_at = $3, message = NULL, gang_address = NULL, preempted_by = NULL \
         WHERE state = 'queued' AND id = (SELECT r.id FROM jobs r JOIN jobs g ON g.id = r.gang_id \
         WHERE r.state = 'queued' AND r.kind = 'train_rank' AND r.gang_placement IN ({}) \
         AND (g.state IN {WAITING} OR (g.state = 'running' AND r.gang_joining = 1)) \
         AND (r.gang_placement NOT LIKE 'slice:%' OR (r.slice_pinned = 1 AND r.slice_uuid IN \
           (SELECT s.uuid FROM slices s WHERE s.worker_id = $1 AND s.loan_state <> 'reclaiming') \
           AND NOT EXISTS (SELECT 1 FROM jobs o WHERE o.slice_uuid = r.slice_uuid AND o.state IN ('leased', 'running')))) \
         ORDER BY g.created_at, g.id, r.gang_rank LIMIT 1 {lock}) \
         RETURNING id, spec, attempts, lease_expires_at, gang_id",
        params.join(", ")
    );
    let mut query = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(worker.to_string()).bind(now + lease_ttl_ms).bind(now);
    for placement in placements {
        query = query.bind(placement);
    }
    let Some(row) = query.fetch_optional(db.pool()).await? else {
        return Ok(None);
    };
    let gang: String = row.try_get("gang_id")?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE jobs SET gang_deadline = $1 WHERE id = $2 AND state IN {WAITING} AND gang_deadline IS NULL"
    )))
    .bind(deadline)
    .bind(&gang)
    .execute(db.pool())
    .await?;
    Ok(Some(Claimed {
        job_id: parse_uuid("jobs", "id", &row.try_get::<String, _>("id")?)?,
        spec: parse_json("jobs", "spec", &row.try_get::<String, _>("spec")?)?,
        attempt: row.try_get::<i64, _>("attempts")? as u32,
        lease_expires_at: row.try_get("lease_expires_at")?,
    }))
}

/// A rank row: its gang and rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankOf {
    pub gang: Uuid,
    pub rank: u32,
}

/// The gang and rank of `job` when it is a rank row.
pub async fn rank_of(db: &Db, job: Uuid) -> Result<Option<RankOf>> {
    let row = sqlx::query("SELECT gang_id, gang_rank FROM jobs WHERE id = $1 AND gang_id IS NOT NULL")
        .bind(job.to_string())
        .fetch_optional(db.pool())
        .await?;
    row.map(|row| {
        Ok(RankOf {
            gang: parse_uuid("jobs", "gang_id", &row.try_get::<String, _>("gang_id")?)?,
            rank: row.try_get::<i64, _>("gang_rank")? as u32,
        })
    })
    .transpose()
}

/// Where the rendezvous stands for one rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rendezvous {
    /// The worker does not hold this rank (released, requeued, cancelled).
    NotHeld,
    Waiting,
    /// The gang formed: its attempt number and every rank's address, by rank.
    Formed {
        generation: u32,
        peers: Vec<String>,
    },
}

struct RankRow {
    state: String,
    address: Option<String>,
    message: Option<String>,
    rank: u32,
    /// Joins the running gang at the regroup under way (not in its ring yet).
    joining: bool,
    /// Leaves the gang at the regroup under way.
    leaving: bool,
}

impl RankRow {
    /// In the gang's ring now: neither joining nor (for a lost rank's check) leaving.
    fn in_ring(&self) -> bool {
        !self.joining && !self.leaving
    }
}

async fn ranks_in(conn: &mut AnyConnection, gang: &str) -> Result<Vec<RankRow>> {
    let rows =
        sqlx::query(
            "SELECT gang_rank, state, gang_address, message, gang_joining, gang_leaving FROM jobs WHERE gang_id = $1 \
             ORDER BY gang_rank",
        )
            .bind(gang)
            .fetch_all(conn)
            .await?;
    rows.iter()
        .map(|r| {
            Ok(RankRow {
                rank: r.try_get::<i64, _>("gang_rank")? as u32,
                state: r.try_get("state")?,
                address: r.try_get("gang_address")?,
                message: r.try_get("message")?,
                joining: r.try_get::<i64, _>("gang_joining")? != 0,
                leaving: r.try_get::<i64, _>("gang_leaving")? != 0,
            })
        })
        .collect()
}

/// Locks the gang row of rank `job` for the caller's transaction. The ranks of a gang post
/// at once. On PostgreSQL each would lock its own row, and the one forming the gang then
/// the gang's and every rank's row: two ranks both seeing the gang complete deadlocked
/// (each holding its row, one waiting on the gang's). So every post of a gang's rank first
/// locks the gang's row, and they run one after another (SQLite's writers do anyway); each
/// then reads what the earlier ones posted.
pub(super) async fn lock_gang_of(conn: &mut AnyConnection, backend: Backend, job: Uuid) -> Result<()> {
    if backend == Backend::Postgres {
        sqlx::query("SELECT g.id FROM jobs g WHERE g.id = (SELECT r.gang_id FROM jobs r WHERE r.id = $1) FOR UPDATE")
            .bind(job.to_string())
            .fetch_optional(conn)
            .await?;
    }
    Ok(())
}

/// Records the address `worker`'s rank `job` accepts its ring neighbour on, and forms the
/// gang when it was the last rank missing.
pub async fn rendezvous(db: &Db, worker: Uuid, job: Uuid, address: &str) -> Result<Rendezvous> {
    let now = now_ms();
    let mut tx = db.begin().await?;
    lock_gang_of(&mut tx, db.backend(), job).await?;
    let posted = sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE jobs SET gang_address = $1, updated_at = $2 WHERE id = $3 AND worker_id = $4 AND state IN {LIVE} \
         AND gang_id IS NOT NULL RETURNING gang_id"
    )))
    .bind(address)
    .bind(now)
    .bind(job.to_string())
    .bind(worker.to_string())
    .fetch_optional(&mut *tx)
    .await?;
    let Some(posted) = posted else {
        return Ok(Rendezvous::NotHeld);
    };
    let gang: String = posted.try_get("gang_id")?;
    let ranks = ranks_in(&mut tx, &gang).await?;
    let all_here = ranks.iter().all(|r| matches!(r.state.as_str(), "leased" | "running") && r.address.is_some());
    if all_here {
        // Conditional: of ranks posting at once, one forms the gang, the others see it formed.
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE jobs SET state = 'running', attempts = attempts + 1, started_at = COALESCE(started_at, $1), \
             updated_at = $1, gang_deadline = NULL, message = NULL, preempt_reason = NULL \
             WHERE id = $2 AND state IN {WAITING}"
        )))
        .bind(now)
        .bind(&gang)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "UPDATE jobs SET state = 'running', started_at = COALESCE(started_at, $1), updated_at = $1 \
             WHERE gang_id = $2 AND state = 'leased'",
        )
        .bind(now)
        .bind(&gang)
        .execute(&mut *tx)
        .await?;
    }
    // Preempted runs give their attempt back, so the sum (with the in-place regroups) is
    // what grows with every formation.
    let formed =
        sqlx::query("SELECT attempts + preemptions + regroups AS generation FROM jobs WHERE id = $1 AND state = 'running'")
            .bind(&gang)
            .fetch_optional(&mut *tx)
            .await?;
    let this_running: Option<String> = sqlx::query_scalar("SELECT state FROM jobs WHERE id = $1")
        .bind(job.to_string())
        .fetch_optional(&mut *tx)
        .await?;
    tx.commit().await?;
    match formed {
        Some(row) if this_running.as_deref() == Some("running") => {
            let ranks = ranks_in(&mut *db.pool().acquire().await?, &gang).await?;
            Ok(Rendezvous::Formed {
                generation: row.try_get::<i64, _>("generation")? as u32,
                peers: ranks.into_iter().map(|r| r.address.unwrap_or_default()).collect(),
            })
        }
        _ => Ok(Rendezvous::Waiting),
    }
}

/// What a sweep did to gangs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Swept {
    /// Gangs not formed by their deadline, their ranks released.
    pub released: u64,
    /// Formed gangs that lost a rank and went back to the queue.
    pub requeued: u64,
    /// Formed gangs whose every rank checkpointed and stopped when asked to preempt.
    pub preempted: u64,
    /// Gangs that ended (succeeded, failed) or whose ranks were stopped after the job ended.
    pub settled: u64,
}

/// Brings every gang's job and ranks into agreement: releases gangs not formed by their
/// deadline (no attempt spent), requeues or fails formed gangs that lost a rank, ends
/// gangs whose ranks all ended, and stops the ranks of gangs that ended (cancelled).
/// `only` limits it to one gang. Each gang is read again under its row lock in the
/// transaction that changes it, so a rank's rendezvous or a sweep running at once (several
/// servers) cannot change it between the reading and the writing.
pub async fn sweep(db: &Db, now: i64, only: Option<Uuid>) -> Result<Swept> {
    let ids: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT g.id FROM jobs g \
         WHERE g.kind = 'train_gang' AND ($1 IS NULL OR g.id = $1) AND (g.state IN {UNFINISHED} OR EXISTS \
         (SELECT 1 FROM jobs r WHERE r.gang_id = g.id AND r.state IN {UNFINISHED}))"
    )))
    .bind(only.map(|id| id.to_string()))
    .fetch_all(db.pool())
    .await?;
    // SQLite's transactions hold the database's write lock from their start.
    let lock = if db.backend() == Backend::Postgres { " FOR UPDATE" } else { "" };
    let mut swept = Swept::default();
    for id in ids {
        let mut tx = db.begin().await?;
        let gang = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT state, attempts, max_attempts, gang_deadline, preempt_reason, regroup_world FROM jobs \
             WHERE id = $1{lock}"
        )))
        .bind(&id)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(gang) = gang else {
            continue;
        };
        let state: String = gang.try_get("state")?;
        let attempts: i64 = gang.try_get("attempts")?;
        let max_attempts: i64 = gang.try_get("max_attempts")?;
        let deadline: Option<i64> = gang.try_get("gang_deadline")?;
        let preempt_reason: Option<String> = gang.try_get("preempt_reason")?;
        let regrouping = gang.try_get::<Option<i64>, _>("regroup_world")?.is_some();
        let ranks = ranks_in(&mut tx, &id).await?;
        let failed = ranks.iter().find(|r| r.state == "failed");
        match state.as_str() {
            // A rank that failed before or after the gang formed fails the job.
            "queued" | "preempted" | "running" if failed.is_some() => {
                let failed = failed.expect("checked");
                let message =
                    format!("Rank {} failed: {}", failed.rank, failed.message.as_deref().unwrap_or("no message"));
                end(&mut tx, &id, JobState::Failed, &message, now).await?;
                stop_ranks(&mut tx, &id, now).await?;
                swept.settled += 1;
            }
            "queued" | "preempted" if deadline.is_some_and(|d| d < now) => {
                release(&mut tx, &id, now, "The gang did not form within the rendezvous time-out; released.").await?;
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "UPDATE jobs SET gang_deadline = NULL WHERE id = $1 AND state IN {WAITING}"
                )))
                .bind(&id)
                .execute(&mut *tx)
                .await?;
                swept.released += 1;
            }
            "running" if regrouping && deadline.is_some_and(|d| d < now) => {
                // Not formed in time: the gang stops at a checkpoint and restarts at the size.
                let world = super::regroup::cancel_in(&mut tx, &id, now).await?;
                sqlx::query(
                    "UPDATE jobs SET preempt_reason = COALESCE(preempt_reason, $1), resize_ranks = $2, regrow = 0 \
                     WHERE id = $3",
                )
                .bind("The in-place resize did not form within the rendezvous time-out; the gang stops at a checkpoint and restarts at the new size.")
                .bind(world.map(|w| w as i64))
                .bind(&id)
                .execute(&mut *tx)
                .await?;
                swept.released += 1;
            }
            "running" => {
                let lost = ranks.iter().find(|r| r.in_ring() && (r.state == "queued" || r.state == "cancelled"));
                if let Some(lost) = lost {
                    super::regroup::cancel_in(&mut tx, &id, now).await?;
                    let why = lost.message.as_deref().unwrap_or("its worker stopped responding").trim_end_matches('.');
                    if attempts >= max_attempts {
                        let message = format!("Rank {} was lost on the last allowed attempt ({why}).", lost.rank);
                        end(&mut tx, &id, JobState::Failed, &message, now).await?;
                        stop_ranks(&mut tx, &id, now).await?;
                    } else {
                        let message = format!(
                            "Rank {} was lost ({why}); the gang was requeued and resumes from its last checkpoint.",
                            lost.rank
                        );
                        release(&mut tx, &id, now, &message).await?;
                        sqlx::query(
                            "UPDATE jobs SET state = 'queued', message = $1, updated_at = $2, preempt_reason = NULL, \
                             regrow = 0 WHERE id = $3 AND state = 'running'",
                        )
                        .bind(&message)
                        .bind(now)
                        .bind(&id)
                        .execute(&mut *tx)
                        .await?;
                    }
                    swept.requeued += 1;
                } else if preempt_reason.is_some() && ranks.iter().filter(|r| !r.joining).all(|r| r.state == "preempted") {
                    // Rank 0 reported after its checkpoint was stored: the gang resumes from it.
                    let message = ranks.first().and_then(|r| r.message.clone()).unwrap_or_default();
                    release(&mut tx, &id, now, &message).await?;
                    sqlx::query(
                        "UPDATE jobs SET state = 'preempted', message = $1, updated_at = $2, preempt_reason = NULL, \
                         attempts = attempts - 1, preemptions = preemptions + 1 WHERE id = $3 AND state = 'running'",
                    )
                    .bind(&message)
                    .bind(now)
                    .bind(&id)
                    .execute(&mut *tx)
                    .await?;
                    super::loaning::free_preempted_slices(&mut tx, &id, now).await?;
                    swept.preempted += 1;
                } else if ranks.iter().filter(|r| !r.joining).all(|r| r.state == "succeeded") {
                    let message = ranks.first().and_then(|r| r.message.clone()).unwrap_or_default();
                    end(&mut tx, &id, JobState::Succeeded, &message, now).await?;
                    swept.settled += 1;
                }
            }
            "queued" | "preempted" => {}
            _ => {
                stop_ranks(&mut tx, &id, now).await?;
                swept.settled += 1;
            }
        }
        tx.commit().await?;
    }
    Ok(swept)
}

/// Sends the claimed ranks of a forming gang (waiting, some rank held) back to the queue,
/// its rendezvous clock stopped and its slice pins cleared (the round pins it again when it
/// places it); false when the gang is not forming.
pub async fn release_forming(db: &Db, gang: Uuid, now: i64, message: &str) -> Result<bool> {
    let mut tx = db.begin().await?;
    let forming = sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE jobs SET gang_deadline = NULL, updated_at = $1 WHERE id = $2 AND kind = 'train_gang' \
         AND state IN {WAITING} AND EXISTS (SELECT 1 FROM jobs r WHERE r.gang_id = $2 AND r.state IN {LIVE})"
    )))
    .bind(now)
    .bind(gang.to_string())
    .execute(&mut *tx)
    .await?
    .rows_affected();
    if forming > 0 {
        release(&mut tx, &gang.to_string(), now, message).await?;
        // As for a running gang preempted: its slices may be what the preemption frees.
        super::loaning::free_preempted_slices(&mut tx, &gang.to_string(), now).await?;
    }
    tx.commit().await?;
    Ok(forming > 0)
}

/// Every rank back to the queue, unheld and unposted (one that already finished too: the
/// gang reruns from its checkpoint as a whole).
async fn release(conn: &mut AnyConnection, gang: &str, now: i64, message: &str) -> Result<()> {
    sqlx::query(
        "UPDATE jobs SET state = 'queued', worker_id = NULL, lease_expires_at = NULL, gang_address = NULL, \
         message = $1, updated_at = $2, finished_at = NULL \
         WHERE gang_id = $3 AND state IN ('queued', 'preempted', 'leased', 'running', 'cancelled', 'succeeded')",
    )
    .bind(message)
    .bind(now)
    .bind(gang)
    .execute(conn)
    .await?;
    Ok(())
}

/// Cancels the ranks still queued or held: their workers learn at the next heartbeat.
async fn stop_ranks(conn: &mut AnyConnection, gang: &str, now: i64) -> Result<()> {
    sqlx::query(
        "UPDATE jobs SET state = 'cancelled', message = 'The training job ended.', worker_id = NULL, \
         lease_expires_at = NULL, finished_at = $1, updated_at = $1 \
         WHERE gang_id = $2 AND state IN ('queued', 'preempted', 'leased', 'running')",
    )
    .bind(now)
    .bind(gang)
    .execute(conn)
    .await?;
    Ok(())
}

async fn end(conn: &mut AnyConnection, gang: &str, state: JobState, message: &str, now: i64) -> Result<()> {
    sqlx::query(
        "UPDATE jobs SET state = $1, message = $2, finished_at = $3, updated_at = $3, gang_deadline = NULL, \
         preempt_reason = NULL WHERE id = $4 AND state IN ('queued', 'preempted', 'running')",
    )
    .bind(state.as_str())
    .bind(message)
    .bind(now)
    .bind(gang)
    .execute(conn)
    .await?;
    Ok(())
}

/// Stores ranks' step timings under the gang's job (a step reported again replaces it),
/// each with the gang's rank count now: a rank reports only while its gang runs, and a
/// gang changes its rank count only while none of its ranks is held or at a regroup,
/// after every rank flushed its timings and stopped (joining ranks are not counted).
pub async fn upsert_rank_steps(db: &Db, gang: Uuid, steps: &[RankStep]) -> Result<()> {
    let mut tx = db.begin().await?;
    let world: i64 = sqlx::query("SELECT COUNT(*) AS world FROM jobs WHERE gang_id = $1 AND gang_joining = 0")
        .bind(gang.to_string())
        .fetch_one(&mut *tx)
        .await?
        .try_get("world")?;
    for step in steps {
        // Prepared afresh each time: sqlx's Any driver binds a NULL f64 as a PostgreSQL float4
        // (sqlx-core 0.9 `AnyArguments`, Real and Double swapped), and a statement kept from a
        // step without a prediction then refuses the f64 of a later one ("incorrect binary
        // data format in bind parameter").
        sqlx::query(
            "INSERT INTO rank_steps (job_id, rank, step, iter_ms, wait_ms, allreduce_ms, predicted_ms, world) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8) \
             ON CONFLICT (job_id, rank, step) DO UPDATE SET iter_ms = excluded.iter_ms, wait_ms = excluded.wait_ms, \
             allreduce_ms = excluded.allreduce_ms, predicted_ms = excluded.predicted_ms, world = excluded.world",
        )
        .persistent(false)
        .bind(gang.to_string())
        .bind(step.rank as i64)
        .bind(step.step as i64)
        .bind(step.iter_ms)
        .bind(step.wait_ms)
        .bind(step.allreduce_ms)
        .bind(step.predicted_ms)
        .bind(world)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(())
}

/// The worker holding each rank of `gang` (none for a rank waiting for a claim), by rank;
/// ranks joining an in-place resize are left out.
pub async fn rank_workers(db: &Db, gang: Uuid) -> Result<Vec<(u32, Option<Uuid>)>> {
    let rows = sqlx::query("SELECT gang_rank, worker_id FROM jobs WHERE gang_id = $1 AND gang_joining = 0 ORDER BY gang_rank")
        .bind(gang.to_string())
        .fetch_all(db.pool())
        .await?;
    rows.iter()
        .map(|r| {
            let worker: Option<String> = r.try_get("worker_id")?;
            let worker = worker.map(|w| parse_uuid("jobs", "worker_id", &w)).transpose()?;
            Ok((r.try_get::<i64, _>("gang_rank")? as u32, worker))
        })
        .collect()
}

/// A gang's step timings, by rank then step.
pub async fn rank_steps(db: &Db, gang: Uuid) -> Result<Vec<RankStep>> {
    let rows = sqlx::query(
        "SELECT rank, step, iter_ms, wait_ms, allreduce_ms, predicted_ms FROM rank_steps WHERE job_id = $1 \
         ORDER BY rank, step",
    )
    .bind(gang.to_string())
    .fetch_all(db.pool())
    .await?;
    rows.iter()
        .map(|r| {
            Ok(RankStep {
                rank: r.try_get::<i64, _>("rank")? as u32,
                step: r.try_get::<i64, _>("step")?.max(0) as u64,
                iter_ms: r.try_get("iter_ms")?,
                wait_ms: r.try_get("wait_ms")?,
                allreduce_ms: r.try_get("allreduce_ms")?,
                predicted_ms: r.try_get("predicted_ms")?,
            })
        })
        .collect()
}
