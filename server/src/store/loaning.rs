//! Capacity loaning (issue 16): each slice's loan state, the training gangs the scheduling
//! round places on slices, and what the round leaves for the dashboard (loan and reclaim
//! history, per-round slice counts, the training queue with predicted JCT). Also the
//! scheduler lease (one server runs the round) and each server's measured request rates.
//!
//! A training rank holds a slice the way a replica does: its row names the slice
//! (`slice_uuid`, pinned) while queued for it, leased or running, so the serving side's
//! claim (`slices::free_for`) skips it. Only the round pins ranks to slices.

use std::collections::HashMap;

use sqlx::any::AnyRow;
use sqlx::{AnyConnection, Row};
use tessera_api::jobs::JobSpec;
use tessera_api::loaning::{
    LoanRound, LoanState, PredictedFrom, QueuedTraining, ReclaimEvent, SliceEvent,
};
use tessera_api::train::TrainJob;
use uuid::Uuid;

use super::db::{self, now_ms, Db};
use super::jobs::{self, NewJob};
use super::{deployments, parse_json, parse_uuid, Result, RowLock, Scope, StoreError};

/// Jobs holding a slice (the same rule as `slices`' HOLDING).
const HOLDING: &str =
    "(j.state IN ('leased', 'running') OR (j.state = 'queued' AND j.slice_pinned = 1))";

fn loan_state(text: &str) -> Result<LoanState> {
    LoanState::parse(text).ok_or_else(|| StoreError::Corrupt {
        table: "slices",
        column: "loan_state",
        value: text.to_string(),
        reason: "not a loan state".into(),
    })
}

/// What holds a slice now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Holder {
    Free,
    /// A serve job of `deployment`.
    Replica {
        job: Uuid,
        deployment: Uuid,
    },
    /// A rank of the training job `gang`.
    Rank {
        job: Uuid,
        gang: Uuid,
    },
}

/// A slice of an online worker, as the round sees it.
#[derive(Debug, Clone)]
pub struct FleetSlice {
    pub uuid: String,
    pub worker: Uuid,
    pub gpu_model: Option<String>,
    pub profile: Option<String>,
    pub loan_state: LoanState,
    pub lender: Option<Uuid>,
    pub holder: Holder,
}

/// The slices of workers seen since `online_since`, by worker, GPU and start.
pub async fn fleet(db: &Db, online_since: i64) -> Result<Vec<FleetSlice>> {
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT s.uuid, s.worker_id, s.gpu_model, s.profile, s.loan_state, s.lender_id, \
           j.id AS job_id, j.kind, j.deployment_id, j.gang_id \
         FROM slices s JOIN workers w ON w.id = s.worker_id \
         LEFT JOIN jobs j ON j.slice_uuid = s.uuid AND {HOLDING} \
         WHERE w.last_seen_at >= $1 ORDER BY w.name, s.gpu_index, s.start, s.uuid, j.created_at"
    )))
    .bind(online_since)
    .fetch_all(db.pool())
    .await?;
    let mut out: Vec<FleetSlice> = Vec::new();
    for row in &rows {
        let uuid: String = row.try_get("uuid")?;
        if out.last().is_some_and(|s| s.uuid == uuid) {
            continue;
        }
        let job: Option<String> = row.try_get("job_id")?;
        let holder = match job {
            None => Holder::Free,
            Some(job) => {
                let job = parse_uuid("jobs", "id", &job)?;
                let deployment: Option<String> = row.try_get("deployment_id")?;
                let gang: Option<String> = row.try_get("gang_id")?;
                match (deployment, gang) {
                    (Some(d), _) => Holder::Replica {
                        job,
                        deployment: parse_uuid("jobs", "deployment_id", &d)?,
                    },
                    (None, Some(g)) => Holder::Rank {
                        job,
                        gang: parse_uuid("jobs", "gang_id", &g)?,
                    },
                    // Nothing else binds slices; treat an unknown holder as a replica of nobody.
                    (None, None) => Holder::Replica {
                        job,
                        deployment: Uuid::nil(),
                    },
                }
            }
        };
        let lender: Option<String> = row.try_get("lender_id")?;
        out.push(FleetSlice {
            uuid,
            worker: parse_uuid(
                "slices",
                "worker_id",
                &row.try_get::<String, _>("worker_id")?,
            )?,
            gpu_model: row.try_get("gpu_model")?,
            profile: row.try_get("profile")?,
            loan_state: loan_state(&row.try_get::<String, _>("loan_state")?)?,
            lender: lender
                .map(|l| parse_uuid("slices", "lender_id", &l))
                .transpose()?,
            holder,
        });
    }
    Ok(out)
}

/// One rank row of a gang.
#[derive(Debug, Clone)]
pub struct GangRank {
    pub job: Uuid,
    pub rank: u32,
    pub state: String,
    pub placement: String,
    /// The slice it is pinned to (or bound to while live).
    pub slice: Option<String>,
    /// It leaves its gang at the regroup under way (its slice is free once that forms).
    pub leaving: bool,
}

/// A training job run as a gang whose ranks all run on MIG slices: what the round places.
#[derive(Debug, Clone)]
pub struct SliceGang {
    pub id: Uuid,
    pub name: String,
    pub owner: Uuid,
    /// `queued` (waiting, or forming) or `running`.
    pub state: String,
    pub train: TrainJob,
    pub progress_step: u64,
    pub created_at: i64,
    /// When the gang's current attempt formed (`updated_at` of a running gang) or its last
    /// checkpoint was stored, whichever is later: the work a preemption loses starts there.
    pub last_safe_at: i64,
    /// When a running gang last formed or was asked to stop (`updated_at`); `None` while
    /// it waits. The round's resize hysteresis counts from it.
    pub formed_at: Option<i64>,
    /// A preemption (or a resize) was asked of the running gang and it has not stopped yet.
    pub stopping: bool,
    /// The rank count the round stopped it to restart at (a resize), until placed again.
    pub resize_ranks: Option<u32>,
    /// Running, it grows or shrinks in place (`store::regroup`) and has not re-formed yet.
    pub regrouping: bool,
    /// Rank 0 has reported step timings (of any attempt): `step_secs_by_count` finds some.
    pub measured: bool,
    /// A reclaim split a move of it between pools and the shrink formed: it may grow back
    /// now, without the cooldown (`set_regrow`); false once it formed again or restarted.
    pub regrow: bool,
    pub ranks: Vec<GangRank>,
}

impl SliceGang {
    /// The MIG profile every rank asks for, when they agree.
    pub fn profile(&self) -> Option<&str> {
        let first = self.ranks.first()?.placement.strip_prefix("slice:")?;
        self.ranks
            .iter()
            .all(|r| r.placement.strip_prefix("slice:") == Some(first))
            .then_some(first)
    }

    /// Ranks it runs with, or will once its regroup forms: all but those leaving.
    pub fn world(&self) -> u32 {
        self.ranks.iter().filter(|r| !r.leaving).count() as u32
    }

    /// No rank is held by a worker: the round may re-place (and resize) it.
    pub fn waiting(&self) -> bool {
        matches!(self.state.as_str(), "queued" | "preempted") && self.ranks.iter().all(|r| r.state == "queued")
    }
}

/// The live gangs' states, by which the round reads them (`slice_gangs`).
const LIVE_GANGS: &str = "g.kind = 'train_gang' AND g.state IN ('queued', 'preempted', 'running')";
/// Whether a rank row in `state` is of its gang's current attempt. Checked here, not in
/// SQL: with a state condition beside `gang_id`, PostgreSQL without fresh statistics
/// intersected the `jobs_queue` index with `jobs_gang` for every gang (0.5 s at 1,000
/// gangs, bench `loaning_round`); by `gang_id` alone it reads a few rows a gang.
fn live_rank(state: &str) -> bool {
    matches!(state, "queued" | "leased" | "running")
}

/// Unfinished gangs whose every rank asks for a MIG slice, oldest first. Three reads
/// however many gangs there are: the gangs, all their ranks, and which gangs have step
/// timings (the round reads those gangs' timings, `step_secs_by_count`).
pub async fn slice_gangs(db: &Db) -> Result<Vec<SliceGang>> {
    let gangs = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT g.id, g.name, g.owner_id, g.state, g.spec, g.progress_step, g.created_at, g.updated_at, \
           g.preempt_reason, g.resize_ranks, g.regroup_world, \
           CAST(CASE WHEN g.regrow = g.attempts + g.preemptions + g.regroups THEN 1 ELSE 0 END AS BIGINT) AS regrow, \
           (SELECT MAX(c.created_at) FROM checkpoints c WHERE c.job_id = g.id) AS checkpointed_at, \
           CAST(CASE WHEN EXISTS (SELECT 1 FROM rank_steps s WHERE s.job_id = g.id AND s.rank = 0 AND s.world > 0) \
             THEN 1 ELSE 0 END AS BIGINT) AS measured \
         FROM jobs g WHERE {LIVE_GANGS} \
         AND NOT EXISTS (SELECT 1 FROM jobs r WHERE r.gang_id = g.id AND r.gang_placement NOT LIKE 'slice:%') \
         ORDER BY g.created_at, g.id"
    )))
    .fetch_all(db.pool())
    .await?;
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT r.gang_id, r.id, r.gang_rank, r.state, r.gang_placement, r.slice_uuid, r.gang_leaving FROM jobs r \
         JOIN jobs g ON g.id = r.gang_id WHERE {LIVE_GANGS} \
         ORDER BY r.gang_id, r.gang_rank"
    )))
    .fetch_all(db.pool())
    .await?;
    let mut ranks_of: HashMap<String, Vec<GangRank>> = HashMap::new();
    for r in &rows {
        let rank = gang_rank(r)?;
        if live_rank(&rank.state) {
            ranks_of.entry(r.try_get("gang_id")?).or_default().push(rank);
        }
    }
    let mut out = Vec::new();
    for g in &gangs {
        let id: String = g.try_get("id")?;
        let spec: JobSpec = parse_json("jobs", "spec", &g.try_get::<String, _>("spec")?)?;
        let JobSpec::Train(train) = spec else {
            continue;
        };
        let Some(ranks) = ranks_of.remove(&id) else {
            continue;
        };
        let state: String = g.try_get("state")?;
        let updated: i64 = g.try_get("updated_at")?;
        let created: i64 = g.try_get("created_at")?;
        let checkpointed: Option<i64> = g.try_get("checkpointed_at")?;
        let running = state == "running";
        let formed = if running { updated } else { created };
        out.push(SliceGang {
            id: parse_uuid("jobs", "id", &id)?,
            name: g.try_get("name")?,
            owner: parse_uuid("jobs", "owner_id", &g.try_get::<String, _>("owner_id")?)?,
            state,
            train,
            progress_step: g
                .try_get::<Option<i64>, _>("progress_step")?
                .unwrap_or(0)
                .max(0) as u64,
            created_at: created,
            last_safe_at: checkpointed.map_or(formed, |c| c.max(formed)),
            formed_at: running.then_some(updated),
            stopping: g.try_get::<Option<String>, _>("preempt_reason")?.is_some(),
            resize_ranks: g
                .try_get::<Option<i64>, _>("resize_ranks")?
                .filter(|&n| n > 0)
                .map(|n| n as u32),
            regrouping: g.try_get::<Option<i64>, _>("regroup_world")?.is_some(),
            // An integer on both databases (EXISTS is a boolean on PostgreSQL only).
            measured: g.try_get::<i64, _>("measured")? != 0,
            regrow: g.try_get::<i64, _>("regrow")? != 0,
            ranks,
        });
    }
    Ok(out)
}

/// The current attempt's ranks of `gang`, by rank.
pub async fn gang_ranks(db: &Db, gang: Uuid) -> Result<Vec<GangRank>> {
    let rows = sqlx::query(
        "SELECT r.id, r.gang_rank, r.state, r.gang_placement, r.slice_uuid, r.gang_leaving FROM jobs r WHERE r.gang_id = $1 \
         ORDER BY r.gang_rank",
    )
    .bind(gang.to_string())
    .fetch_all(db.pool())
    .await?;
    let ranks: Vec<GangRank> = rows.iter().map(gang_rank).collect::<Result<_>>()?;
    Ok(ranks.into_iter().filter(|r| live_rank(&r.state)).collect())
}

fn gang_rank(r: &AnyRow) -> Result<GangRank> {
    Ok(GangRank {
        job: parse_uuid("jobs", "id", &r.try_get::<String, _>("id")?)?,
        rank: r.try_get::<i64, _>("gang_rank")? as u32,
        state: r.try_get("state")?,
        placement: r.try_get("gang_placement")?,
        slice: r.try_get("slice_uuid")?,
        leaving: r.try_get::<i64, _>("gang_leaving")? != 0,
    })
}

/// A gang's step timings by rank count, each count's `per_count` newest steps whatever
/// their age (a count the gang ran at long ago keeps its measurement instead of falling back
/// to the prior): `(ranks, seconds)`, counts from the largest down, newest step first within
/// a count. Rank 0's seconds (in a synchronous step every rank waits for the slowest, so
/// rank 0's step is the gang's); steps stored before the rank count was recorded with them
/// are left out. Bounded: one read per count the gang ran at, plus one finding none left,
/// each a descending range of the `rank_steps_world` index that stops after `per_count`
/// rows, never a scan of a long job's steps.
pub async fn step_secs_by_count(db: &Db, gang: Uuid, per_count: usize) -> Result<Vec<(u32, f64)>> {
    let mut out = Vec::new();
    let mut below = i64::MAX;
    loop {
        let found = sqlx::query(
            "SELECT world, iter_ms FROM rank_steps WHERE job_id = $1 AND rank = 0 AND world > 0 AND world < $2 \
             ORDER BY world DESC, step DESC LIMIT $3",
        )
        .bind(gang.to_string())
        .bind(below)
        .bind(per_count.max(1) as i64)
        .fetch_all(db.pool())
        .await?;
        let Some(first) = found.first() else {
            return Ok(out);
        };
        // The largest count below the last one; rows of smaller counts wait for their read.
        let world: i64 = first.try_get("world")?;
        for row in &found {
            if row.try_get::<i64, _>("world")? != world {
                break;
            }
            let ms: f64 = row.try_get("iter_ms")?;
            out.push((world as u32, ms / 1000.0));
        }
        below = world;
    }
}

pub(super) async fn event(
    conn: &mut AnyConnection,
    at: i64,
    slice: &str,
    state: &str,
    deployment: Option<Uuid>,
    job: Option<Uuid>,
    detail: &str,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO loan_events (id, at, slice_uuid, state, deployment_id, job_id, detail) VALUES ($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(Uuid::new_v4().to_string())
    .bind(at)
    .bind(slice)
    .bind(state)
    .bind(deployment.map(|d| d.to_string()))
    .bind(job.map(|j| j.to_string()))
    .bind(detail)
    .execute(conn)
    .await?;
    Ok(())
}

/// Lends `slice` of `deployment` to training: the replica on it (if any) stops at its
/// worker's next heartbeat, and only training ranks may take the slice. False when the
/// slice was no longer the serving side's.
pub async fn lend(
    db: &Db,
    slice: &str,
    deployment: Uuid,
    replica: Option<Uuid>,
    detail: &str,
) -> Result<bool> {
    let now = now_ms();
    let mut tx = db.begin().await?;
    // The round read the deployment earlier; one deleted since lends nothing.
    if !deployments::lock(&mut tx, db.backend(), deployment, RowLock::Share).await? {
        return Ok(false);
    }
    let changed = sqlx::query(
        "UPDATE slices SET loan_state = 'loaned', lender_id = $1 WHERE uuid = $2 AND loan_state = 'serving'",
    )
    .bind(deployment.to_string())
    .bind(slice)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    if changed == 0 {
        return Ok(false);
    }
    if let Some(replica) = replica {
        sqlx::query(
            "UPDATE jobs SET state = 'cancelled', message = 'Its slice was lent to training.', finished_at = $1, \
             updated_at = $1, lease_expires_at = NULL, endpoint = NULL WHERE id = $2 AND state IN ('queued', 'leased', 'running')",
        )
        .bind(now)
        .bind(replica.to_string())
        .execute(&mut *tx)
        .await?;
    }
    event(
        &mut tx,
        now,
        slice,
        "loaned",
        Some(deployment),
        None,
        detail,
    )
    .await?;
    tx.commit().await?;
    Ok(true)
}

/// Starts taking a loaned slice back: no rank may take it any more.
pub async fn start_reclaim(db: &Db, slice: &str, detail: &str) -> Result<bool> {
    let now = now_ms();
    let mut tx = db.begin().await?;
    let lender: Option<Option<String>> =
        sqlx::query_scalar("UPDATE slices SET loan_state = 'reclaiming' WHERE uuid = $1 AND loan_state = 'loaned' RETURNING lender_id")
            .bind(slice)
            .fetch_optional(&mut *tx)
            .await?;
    let Some(lender) = lender else {
        return Ok(false);
    };
    let lender = lender
        .map(|l| parse_uuid("slices", "lender_id", &l))
        .transpose()?;
    event(&mut tx, now, slice, "reclaiming", lender, None, detail).await?;
    tx.commit().await?;
    Ok(true)
}

/// Gives a reclaiming slice back to `lender` once no rank holds it: the slice serves
/// again and `replica` (a serve job of the lender pinned to the slice) is queued in the
/// same transaction. A lender deleted since the round read it gets no replica; the slice
/// serves again empty. False while a rank still holds it.
pub async fn finish_reclaim(
    db: &Db,
    slice: &str,
    lender: Uuid,
    replica: &NewJob<'_>,
) -> Result<bool> {
    let now = now_ms();
    let mut tx = db.begin().await?;
    let lender_exists = deployments::lock(&mut tx, db.backend(), lender, RowLock::Share).await?;
    let held: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM jobs j WHERE j.slice_uuid = $1 AND {HOLDING}"
    )))
    .bind(slice)
    .fetch_one(&mut *tx)
    .await?;
    if held > 0 {
        return Ok(false);
    }
    let changed = sqlx::query(
        "UPDATE slices SET loan_state = 'serving', lender_id = NULL WHERE uuid = $1 AND lender_id = $2 \
         AND loan_state IN ('reclaiming', 'loaned')",
    )
    .bind(slice)
    .bind(lender.to_string())
    .execute(&mut *tx)
    .await?
    .rows_affected();
    if changed == 0 {
        return Ok(false);
    }
    let detail = if lender_exists {
        jobs::insert_in(&mut tx, replica).await?;
        "back to serving; a replica was queued on it"
    } else {
        "back to serving; its deployment was deleted"
    };
    event(&mut tx, now, slice, "serving", Some(lender), None, detail).await?;
    tx.commit().await?;
    Ok(true)
}

/// Returns every loaned or reclaiming slice of `deployment` to plain serving state (the
/// deployment was deleted or stopped lending), without queueing replicas.
pub async fn release_lender(db: &Db, deployment: Uuid) -> Result<u64> {
    Ok(sqlx::query(
        "UPDATE slices SET loan_state = 'serving', lender_id = NULL WHERE lender_id = $1",
    )
    .bind(deployment.to_string())
    .execute(db.pool())
    .await?
    .rows_affected())
}

/// Gives up `count` of the slices `deployment` lent, those being reclaimed first: back to
/// serving with no lender, the training on them going on. Returns how many.
pub async fn give_up_loans(conn: &mut AnyConnection, deployment: Uuid, count: u32) -> Result<u64> {
    Ok(sqlx::query(
        "UPDATE slices SET loan_state = 'serving', lender_id = NULL WHERE uuid IN (SELECT uuid FROM slices \
         WHERE lender_id = $1 ORDER BY CASE WHEN loan_state = 'reclaiming' THEN 0 ELSE 1 END, uuid LIMIT $2)",
    )
    .bind(deployment.to_string())
    .bind(i64::from(count))
    .execute(conn)
    .await?
    .rows_affected())
}

/// Loaned or reclaiming slices whose lender is gone (deleted deployment): back to serving.
pub async fn release_orphans(db: &Db) -> Result<u64> {
    Ok(sqlx::query(
        "UPDATE slices SET loan_state = 'serving', lender_id = NULL WHERE loan_state <> 'serving' \
         AND (lender_id IS NULL OR NOT EXISTS (SELECT 1 FROM deployments d WHERE d.id = slices.lender_id))",
    )
    .execute(db.pool())
    .await?
    .rows_affected())
}

pub async fn set_calm(db: &Db, deployment: Uuid, calm: u32) -> Result<()> {
    sqlx::query("UPDATE deployments SET loan_calm = $1 WHERE id = $2 AND loan_calm <> $1")
        .bind(calm as i64)
        .bind(deployment.to_string())
        .execute(db.pool())
        .await?;
    Ok(())
}

/// Sets a deployment's loaning settings (`None` leaves one as it is).
pub async fn set_loanable(
    db: &Db,
    deployment: Uuid,
    loanable: Option<bool>,
    headroom: Option<f64>,
) -> Result<()> {
    // Prepared afresh each time: sqlx's Any driver binds a NULL f64 as a PostgreSQL float4
    // (sqlx-core 0.9 `AnyArguments`, Real and Double swapped), and a statement kept from a
    // change without a headroom then refuses the f64 of a later one ("incorrect binary data
    // format in bind parameter": a 500; see `gangs::upsert_rank_steps`).
    sqlx::query(
        "UPDATE deployments SET loanable = COALESCE($1, loanable), reclaim_headroom = COALESCE($2, reclaim_headroom), \
         loan_calm = 0, updated_at = $3 WHERE id = $4",
    )
    .persistent(false)
    .bind(loanable.map(i64::from))
    .bind(headroom)
    .bind(now_ms())
    .bind(deployment.to_string())
    .execute(db.pool())
    .await?;
    Ok(())
}

/// Pins the ranks of a waiting gang to slices (`ranks[i]` ↔ `slices[i]`), recording a
/// `training` event per slice. Ranks a worker already claimed are left alone.
pub async fn pin_ranks(db: &Db, gang: Uuid, pins: &[(Uuid, String)]) -> Result<()> {
    let now = now_ms();
    let mut tx = db.begin().await?;
    for (rank, slice) in pins {
        let changed = sqlx::query(
            "UPDATE jobs SET slice_uuid = $1, slice_pinned = 1, updated_at = $2 WHERE id = $3 AND state = 'queued' \
             AND (slice_uuid IS NULL OR slice_uuid <> $1 OR slice_pinned = 0)",
        )
        .bind(slice)
        .bind(now)
        .bind(rank.to_string())
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if changed > 0 {
            event(
                &mut tx,
                now,
                slice,
                "training",
                None,
                Some(gang),
                "a rank was placed on it",
            )
            .await?;
        }
    }
    tx.commit().await?;
    Ok(())
}

/// Unpins the queued ranks of a gang (it waits for the next round's placement).
pub async fn unpin_ranks(db: &Db, gang: Uuid) -> Result<()> {
    let mut tx = db.begin().await?;
    unpin(&mut tx, gang, now_ms(), "the waiting job was placed elsewhere").await?;
    tx.commit().await?;
    Ok(())
}

/// Clears the slice pins of `gang`'s queued ranks and records each slice they held as idle,
/// `detail` saying why.
async fn unpin(conn: &mut AnyConnection, gang: Uuid, now: i64, detail: &str) -> Result<()> {
    let pinned: Vec<String> = sqlx::query_scalar(
        "SELECT slice_uuid FROM jobs WHERE gang_id = $1 AND state = 'queued' AND slice_uuid IS NOT NULL",
    )
    .bind(gang.to_string())
    .fetch_all(&mut *conn)
    .await?;
    sqlx::query("UPDATE jobs SET slice_uuid = NULL, slice_pinned = 0 WHERE gang_id = $1 AND state = 'queued'")
        .bind(gang.to_string())
        .execute(&mut *conn)
        .await?;
    for slice in pinned {
        event(conn, now, &slice, "idle", None, Some(gang), detail).await?;
    }
    Ok(())
}

/// A preempted gang's slices are free (its ranks were just requeued): the pins go, and the
/// round re-pins the gang when it places it again.
pub(super) async fn free_preempted_slices(conn: &mut AnyConnection, gang: &str, now: i64) -> Result<()> {
    unpin(conn, parse_uuid("jobs", "id", gang)?, now, "its rank was preempted").await
}

/// Records that the round stops running gang `gang` to restart it at `ranks` (a resize);
/// false when the gang is no longer running.
pub async fn set_resize(db: &Db, gang: Uuid, ranks: u32) -> Result<bool> {
    let changed = sqlx::query(
        "UPDATE jobs SET resize_ranks = $1 WHERE id = $2 AND kind = 'train_gang' AND state = 'running'",
    )
    .bind(ranks as i64)
    .bind(gang.to_string())
    .execute(db.pool())
    .await?
    .rows_affected();
    Ok(changed > 0)
}

/// Marks running `gang`, whose regroup under way is the shrink of a move between pools a
/// reclaim forced: once that shrink formed (the gang's next ring generation), the round
/// may grow it back. The mark holds for that generation only, so a later regroup ends it,
/// and a stop clears it.
pub async fn set_regrow(db: &Db, gang: Uuid) -> Result<()> {
    sqlx::query(
        "UPDATE jobs SET regrow = attempts + preemptions + regroups + 1 WHERE id = $1 AND kind = 'train_gang' \
         AND state = 'running'",
    )
        .bind(gang.to_string())
        .execute(db.pool())
        .await?;
    Ok(())
}

/// Forgets a gang's resize target (it was placed again, or its stop was not asked).
pub async fn clear_resize(db: &Db, gang: Uuid) -> Result<()> {
    sqlx::query("UPDATE jobs SET resize_ranks = NULL WHERE id = $1")
        .bind(gang.to_string())
        .execute(db.pool())
        .await?;
    Ok(())
}

/// A reclaim decision to record.
pub struct NewReclaim<'a> {
    pub deployment: Option<Uuid>,
    pub deployment_name: &'a str,
    pub job: Uuid,
    pub job_name: &'a str,
    pub owner: Uuid,
    pub ranks: u32,
    pub preempted: bool,
    pub reason: &'a str,
}

pub async fn record_reclaim(db: &Db, at: i64, r: &NewReclaim<'_>) -> Result<()> {
    sqlx::query(
        "INSERT INTO reclaim_events (id, at, deployment_id, deployment, job_id, job_name, owner_id, ranks, preempted, reason) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
    )
    .bind(Uuid::new_v4().to_string())
    .bind(at)
    .bind(r.deployment.map(|d| d.to_string()))
    .bind(r.deployment_name)
    .bind(r.job.to_string())
    .bind(r.job_name)
    .bind(r.owner.to_string())
    .bind(r.ranks as i64)
    .bind(r.preempted as i64)
    .bind(r.reason)
    .execute(db.pool())
    .await?;
    Ok(())
}

/// Reclaim events, newest first; jobs `scope` cannot see are named "another user's job".
pub async fn reclaims(db: &Db, scope: &Scope, since: i64, limit: i64) -> Result<Vec<ReclaimEvent>> {
    let rows = sqlx::query(
        "SELECT r.at, r.deployment, r.job_id, r.job_name, r.owner_id, r.ranks, r.preempted, r.reason, \
           d.owner_id AS lender_owner_id FROM reclaim_events r \
           LEFT JOIN deployments d ON d.id = r.deployment_id \
         WHERE r.at >= $1 ORDER BY r.at DESC, r.id LIMIT $2",
    )
    .bind(since)
    .bind(limit)
    .fetch_all(db.pool())
    .await?;
    rows.iter()
        .map(|r| {
            let owner: Option<String> = r.try_get("owner_id")?;
            let owner = owner
                .map(|o| parse_uuid("reclaim_events", "owner_id", &o))
                .transpose()?;
            let visible = owner.is_some_and(|o| scope.sees(o));
            let job: Option<String> = r.try_get("job_id")?;
            let mut deployment: String = r.try_get("deployment")?;
            let mut reason: String = r.try_get("reason")?;
            if !sees_lender(scope, r.try_get("lender_owner_id")?)? {
                // The reason was written as "<deployment> needs its … slices back; …".
                reason = reason.replacen(&deployment, ANOTHER_USERS_DEPLOYMENT, 1);
                deployment = ANOTHER_USERS_DEPLOYMENT.into();
            }
            Ok(ReclaimEvent {
                at: db::time(r.try_get("at")?),
                deployment,
                job_id: if visible {
                    job.map(|j| parse_uuid("reclaim_events", "job_id", &j))
                        .transpose()?
                } else {
                    None
                },
                job_name: if visible {
                    r.try_get("job_name")?
                } else {
                    "another user's job".into()
                },
                ranks: r.try_get::<i64, _>("ranks")? as u32,
                preempted: r.try_get::<i64, _>("preempted")? != 0,
                reason,
            })
        })
        .collect()
}

/// The newest `limit` slice events since `since`, newest first. An event of a deployment
/// `scope` does not see keeps its state but not its detail, which names the deployment.
pub async fn slice_events(db: &Db, scope: &Scope, since: i64, limit: i64) -> Result<Vec<SliceEvent>> {
    let rows = sqlx::query(
        "SELECT e.at, e.slice_uuid, e.state, e.detail, e.deployment_id, d.owner_id AS lender_owner_id \
         FROM loan_events e LEFT JOIN deployments d ON d.id = e.deployment_id \
         WHERE e.at >= $1 ORDER BY e.at DESC, e.id DESC LIMIT $2",
    )
    .bind(since)
    .bind(limit)
    .fetch_all(db.pool())
    .await?;
    rows.iter()
        .map(|r| {
            let lender: Option<String> = r.try_get("deployment_id")?;
            let hidden = lender.is_some() && !sees_lender(scope, r.try_get("lender_owner_id")?)?;
            Ok(SliceEvent {
                at: db::time(r.try_get("at")?),
                slice: r.try_get("slice_uuid")?,
                state: r.try_get("state")?,
                detail: if hidden { ANOTHER_USERS_DEPLOYMENT.into() } else { r.try_get("detail")? },
            })
        })
        .collect()
}

/// What a user reads in place of the name of another user's deployment.
pub const ANOTHER_USERS_DEPLOYMENT: &str = "another user's deployment";

/// Whether `scope` may see the name of a deployment owned by `owner` (none: deleted since,
/// so only the server's own scope and admins see it).
fn sees_lender(scope: &Scope, owner: Option<String>) -> Result<bool> {
    match owner {
        Some(owner) => Ok(scope.sees(parse_uuid("deployments", "owner_id", &owner)?)),
        None => Ok(scope.sees_everything()),
    }
}

/// The state of each slice just before `at` from its events (the timeline's left edge).
pub async fn slice_states_before(db: &Db, at: i64) -> Result<HashMap<String, String>> {
    let rows = sqlx::query(
        "SELECT e.slice_uuid, e.state FROM loan_events e WHERE e.at < $1 AND e.at = \
         (SELECT MAX(f.at) FROM loan_events f WHERE f.slice_uuid = e.slice_uuid AND f.at < $1)",
    )
    .bind(at)
    .fetch_all(db.pool())
    .await?;
    rows.iter()
        .map(|r| Ok((r.try_get("slice_uuid")?, r.try_get("state")?)))
        .collect()
}

pub async fn record_round(db: &Db, round: &LoanRound) -> Result<()> {
    sqlx::query(
        "INSERT INTO loan_rounds (at, serving, loaned, reclaiming, training, waiting) VALUES ($1, $2, $3, $4, $5, $6) \
         ON CONFLICT (at) DO NOTHING",
    )
    .bind(round.at.timestamp_millis())
    .bind(round.serving as i64)
    .bind(round.loaned as i64)
    .bind(round.reclaiming as i64)
    .bind(round.training as i64)
    .bind(round.waiting as i64)
    .execute(db.pool())
    .await?;
    Ok(())
}

/// When the newest `n` rounds were recorded, newest first (the resize hysteresis counts
/// the rounds since a gang formed).
pub async fn newest_rounds(db: &Db, n: u32) -> Result<Vec<i64>> {
    Ok(sqlx::query_scalar("SELECT at FROM loan_rounds ORDER BY at DESC LIMIT $1")
        .bind(n as i64)
        .fetch_all(db.pool())
        .await?)
}

/// Rounds since `since`, oldest first.
pub async fn rounds(db: &Db, since: i64) -> Result<Vec<LoanRound>> {
    let rows = sqlx::query(
        "SELECT at, serving, loaned, reclaiming, training, waiting FROM loan_rounds WHERE at >= $1 ORDER BY at",
    )
    .bind(since)
    .fetch_all(db.pool())
    .await?;
    rows.iter()
        .map(|r| {
            let n = |c: &str| r.try_get::<i64, _>(c).map(|v| v.max(0) as u32);
            Ok(LoanRound {
                at: db::time(r.try_get("at")?),
                serving: n("serving")?,
                loaned: n("loaned")?,
                reclaiming: n("reclaiming")?,
                training: n("training")?,
                waiting: n("waiting")?,
            })
        })
        .collect()
}

/// Drops round rows and events older than `before` (the history is kept for a day).
pub async fn prune(db: &Db, before: i64) -> Result<()> {
    for table in ["loan_rounds", "loan_events", "reclaim_events"] {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DELETE FROM {table} WHERE at < $1"
        )))
        .bind(before)
        .execute(db.pool())
        .await?;
    }
    Ok(())
}

/// The round's view of one training job.
pub struct TrainingPlan {
    pub job: Uuid,
    pub position: u32,
    pub ranks: u32,
    pub min_ranks: u32,
    pub max_ranks: u32,
    pub preemptible: bool,
    pub predicted_secs: Option<f64>,
    /// The forecast (epoch ms): `None` start while it runs on, `None` finish when it never
    /// fits; and what it rests on.
    pub predicted_start_at: Option<i64>,
    pub predicted_finish_at: Option<i64>,
    pub predicted_from: Option<PredictedFrom>,
    pub note: String,
}

/// Rows per INSERT of `replace_plans` (12 parameters each, far below either database's
/// limit): a round writes a plan for every queued job, one statement per row was most of
/// a round's time at 1,000 jobs (bench `loaning_round`).
const PLAN_ROWS_PER_INSERT: usize = 100;

/// Replaces the stored plans with `plans` (jobs no longer scheduled drop out).
pub async fn replace_plans(db: &Db, plans: &[TrainingPlan]) -> Result<()> {
    let now = now_ms();
    let mut tx = db.begin().await?;
    sqlx::query("DELETE FROM training_plans")
        .execute(&mut *tx)
        .await?;
    // Rows with a predicted time and rows without go in separate statements, not one
    // binding a NULL: on PostgreSQL a statement first prepared with a NULL there keeps
    // that parameter's type, and a later float is refused.
    let (timed, untimed): (Vec<&TrainingPlan>, Vec<&TrainingPlan>) =
        plans.iter().partition(|p| p.predicted_secs.is_some_and(f64::is_finite));
    for (rows, with_secs) in [(timed, true), (untimed, false)] {
        for chunk in rows.chunks(PLAN_ROWS_PER_INSERT) {
            let columns = if with_secs { 12 } else { 11 };
            let values: Vec<String> = (0..chunk.len())
                .map(|r| {
                    let params: Vec<String> = (1..=columns).map(|c| format!("${}", r * columns + c)).collect();
                    format!("({})", params.join(", "))
                })
                .collect();
            let sql = format!(
                "INSERT INTO training_plans (job_id, position, ranks, min_ranks, max_ranks, preemptible, note, updated_at, \
                 predicted_start_at, predicted_finish_at, predicted_from{}) VALUES {}",
                if with_secs { ", predicted_secs" } else { "" },
                values.join(", ")
            );
            let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
            for p in chunk {
                query = query
                    .bind(p.job.to_string())
                    .bind(p.position as i64)
                    .bind(p.ranks as i64)
                    .bind(p.min_ranks as i64)
                    .bind(p.max_ranks as i64)
                    .bind(p.preemptible as i64)
                    .bind(p.note.clone())
                    .bind(now)
                    // NULL integers and texts are bound with their own types; only a NULL f64 is not.
                    .bind(p.predicted_start_at)
                    .bind(p.predicted_finish_at)
                    .bind(p.predicted_from.map(PredictedFrom::as_str));
                if with_secs {
                    query = query.bind(p.predicted_secs);
                }
            }
            query.execute(&mut *tx).await?;
        }
    }
    tx.commit().await?;
    Ok(())
}

/// The training queue as the last round saw it, in its order, for jobs `scope` sees.
pub async fn queue(db: &Db, scope: &Scope) -> Result<Vec<QueuedTraining>> {
    let rows = sqlx::query(
        "SELECT p.job_id, j.name, j.state, p.position, p.ranks, p.min_ranks, p.max_ranks, p.preemptible, \
           p.predicted_secs, p.predicted_start_at, p.predicted_finish_at, p.predicted_from, p.note, \
           j.created_at FROM training_plans p JOIN jobs j ON j.id = p.job_id \
         WHERE ($1 IS NULL OR j.owner_id = $1) ORDER BY p.position",
    )
    .bind(scope.owner_filter())
    .fetch_all(db.pool())
    .await?;
    rows.iter()
        .map(|r| {
            let n = |c: &str| r.try_get::<i64, _>(c).map(|v| v.max(0) as u32);
            let submitted: i64 = r.try_get("created_at")?;
            let start: Option<i64> = r.try_get("predicted_start_at")?;
            let finish: Option<i64> = r.try_get("predicted_finish_at")?;
            let from: Option<String> = r.try_get("predicted_from")?;
            let from = from
                .map(|f| {
                    PredictedFrom::parse(&f).ok_or_else(|| StoreError::Corrupt {
                        table: "training_plans",
                        column: "predicted_from",
                        value: f.clone(),
                        reason: "not 'measured' or 'prior'".into(),
                    })
                })
                .transpose()?;
            Ok(QueuedTraining {
                job_id: parse_uuid(
                    "training_plans",
                    "job_id",
                    &r.try_get::<String, _>("job_id")?,
                )?,
                name: r.try_get("name")?,
                state: r.try_get("state")?,
                position: n("position")?,
                ranks: n("ranks")?,
                min_ranks: n("min_ranks")?,
                max_ranks: n("max_ranks")?,
                preemptible: r.try_get::<i64, _>("preemptible")? != 0,
                predicted_secs: r.try_get("predicted_secs")?,
                predicted_start_at: start.map(db::time),
                predicted_finish_at: finish.map(db::time),
                predicted_jct_secs: finish.map(|f| (f - submitted) as f64 / 1000.0),
                predicted_from: from,
                note: r.try_get("note")?,
            })
        })
        .collect()
}

/// This server's measured request rate of each deployment.
pub async fn record_rates(db: &Db, server: Uuid, rates: &[(Uuid, f64)]) -> Result<()> {
    let now = now_ms();
    for (deployment, rate) in rates {
        sqlx::query(
            "INSERT INTO serving_rates (server_id, deployment_id, rate, measured_at) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (server_id, deployment_id) DO UPDATE SET rate = excluded.rate, measured_at = excluded.measured_at",
        )
        .bind(server.to_string())
        .bind(deployment.to_string())
        .bind(rate)
        .bind(now)
        .execute(db.pool())
        .await?;
    }
    Ok(())
}

/// Each deployment's request rate summed over the servers that measured it since `since`.
pub async fn rates(db: &Db, since: i64) -> Result<HashMap<Uuid, f64>> {
    let rows = sqlx::query("SELECT deployment_id, SUM(rate) AS rate FROM serving_rates WHERE measured_at >= $1 GROUP BY deployment_id")
        .bind(since)
        .fetch_all(db.pool())
        .await?;
    let mut out = HashMap::new();
    for r in &rows {
        let id = parse_uuid(
            "serving_rates",
            "deployment_id",
            &r.try_get::<String, _>("deployment_id")?,
        )?;
        out.insert(id, r.try_get::<f64, _>("rate")?);
    }
    Ok(out)
}

/// Takes or renews the lease on the periodic task `name` for `holder` until
/// `expires_at`; true when `holder` has it (no one had it, it expired, or it was
/// `holder`'s). One conditional upsert, so two servers never both get it.
pub async fn lead(db: &Db, name: &str, holder: Uuid, now: i64, expires_at: i64) -> Result<bool> {
    let changed = sqlx::query(
        "INSERT INTO scheduler_leases (name, holder, expires_at) VALUES ($1, $2, $3) \
         ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, expires_at = excluded.expires_at \
         WHERE scheduler_leases.holder = excluded.holder OR scheduler_leases.expires_at < $4",
    )
    .bind(name)
    .bind(holder.to_string())
    .bind(expires_at)
    .bind(now)
    .execute(db.pool())
    .await?
    .rows_affected();
    Ok(changed > 0)
}
