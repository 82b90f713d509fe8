//! In-place resizes of running gangs, "regroups" (issue 16): the ranks keep their
//! processes and their training state, stop at one step and re-form their ring at the new
//! world; a stop and a restart (a preemption) would reload everything.
//!
//! The loaning round asks for one ([`request`]): the gang's job gets `regroup_world` and a
//! deadline, ranks that leave are marked `gang_leaving`, and ranks that join are queued
//! `gang_joining`, pinned to their slices, claimable while the gang runs. Every rank's
//! ring address is cleared: each posts a new one at `…/regroup` ([`post`]). A joining rank
//! posts once it fetched the data and model; once every joining rank has, the heartbeat
//! asks the gang's ranks to stop (`jobs::preempt_requested`), they agree on the step
//! through their all-reduce as for a preemption, rank 0 checkpoints, and each rank posts.
//! A leaving rank posts too and is told to leave: its slice is handed back only once its
//! process stopped using it. When every rank has posted, the regroup *forms* in one
//! transaction: the leaving rows go, the others are numbered afresh (those
//! of the gang in their order, then the joining ones) with the new world in their specs,
//! and the gang's `regroups` grows, which makes a new ring generation. Joining ranks load
//! the checkpoint; the others go on from memory.
//!
//! A regroup that does not form by its deadline becomes a stop and restart at the new
//! size (`gangs::sweep`); a preemption or a lost rank cancels it ([`cancel_in`]). A
//! reclaim cuts it back ([`cut`]): the gang gives up the slices serving needs without
//! stopping whole.

use sqlx::{AnyConnection, Row};
use tessera_api::jobs::JobSpec;
use tessera_api::parallel::RankJob;
use uuid::Uuid;

use super::db::{now_ms, Db};
use super::gangs::{insert_ranks, lock_gang_of, LIVE};
use super::jobs::append_logs;
use super::loaning::event;
use super::{parse_json, parse_uuid, Result};

/// A rank that joins a running gang: its placement, its spec (`joining` set) and the MIG
/// slice it is pinned to, if it runs on one.
pub struct Joiner {
    pub placement: String,
    pub spec: RankJob,
    pub slice: Option<String>,
}

/// Asks running `gang` to change its world in place to `world`: `leaving` (rank rows of
/// it) leave, `joining` are queued pinned to their slices. It must form by `deadline`.
/// False, changing nothing, unless the gang runs with no regroup or preemption under way
/// and holds every rank in `leaving`.
pub async fn request(
    db: &Db,
    gang: Uuid,
    world: u32,
    leaving: &[Uuid],
    joining: &[Joiner],
    deadline: i64,
) -> Result<bool> {
    let now = now_ms();
    let mut tx = db.begin().await?;
    let row = sqlx::query(
        "UPDATE jobs SET regroup_world = $1, gang_deadline = $2 WHERE id = $3 AND kind = 'train_gang' \
         AND state = 'running' AND regroup_world IS NULL AND preempt_reason IS NULL \
         RETURNING owner_id, name, dataset_id",
    )
    .bind(world as i64)
    .bind(deadline)
    .bind(gang.to_string())
    .fetch_optional(&mut *tx)
    .await?;
    let Some(row) = row else {
        return Ok(false);
    };
    let mut marked = 0;
    for rank in leaving {
        marked += sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE jobs SET gang_leaving = 1 WHERE id = $1 AND gang_id = $2 AND gang_joining = 0 AND state IN {LIVE}"
        )))
        .bind(rank.to_string())
        .bind(gang.to_string())
        .execute(&mut *tx)
        .await?
        .rows_affected();
    }
    if marked != leaving.len() as u64 {
        tx.rollback().await?;
        return Ok(false);
    }
    sqlx::query("UPDATE jobs SET gang_address = NULL WHERE gang_id = $1").bind(gang.to_string()).execute(&mut *tx).await?;
    let owner = parse_uuid("jobs", "owner_id", &row.try_get::<String, _>("owner_id")?)?;
    let name: String = row.try_get("name")?;
    let dataset: Option<String> = row.try_get("dataset_id")?;
    let dataset = dataset.as_deref().map(|d| parse_uuid("jobs", "dataset_id", d)).transpose()?;
    let ranks: Vec<(String, RankJob)> = joining.iter().map(|j| (j.placement.clone(), j.spec.clone())).collect();
    let ids = insert_ranks(&mut tx, gang, owner, &name, dataset, &ranks).await?;
    for (id, joiner) in ids.iter().zip(joining) {
        sqlx::query("UPDATE jobs SET gang_joining = 1, slice_uuid = $1, slice_pinned = $2 WHERE id = $3")
            .bind(&joiner.slice)
            .bind(i64::from(joiner.slice.is_some()))
            .bind(id.to_string())
            .execute(&mut *tx)
            .await?;
        if let Some(slice) = &joiner.slice {
            event(&mut tx, now, slice, "training", None, Some(gang), "a rank joining its running gang was placed on it")
                .await?;
        }
    }
    tx.commit().await?;
    Ok(true)
}

/// Where a regroup stands for one rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Regroup {
    /// The worker does not hold this rank (released, cancelled, its regroup called off).
    NotHeld,
    Waiting,
    Formed { generation: u32, rank: u32, world: u32, peers: Vec<String> },
    /// Not in the new world: the rank ends (its row goes when the regroup forms).
    Leave,
    /// The gang was asked to preempt: the rank reports `preempted`.
    Stop,
}

/// `worker`'s rank `job` posts `address` for the regroup under way; `generation` is the
/// ring generation it last ran in (0 for a joining rank). A rank of the gang that stopped
/// with no regroup under way (a stop request that reached it late) starts one at the
/// same world, due by `deadline`, so the gang re-forms rather than waits.
pub async fn post(db: &Db, worker: Uuid, job: Uuid, address: &str, generation: u32, deadline: i64) -> Result<Regroup> {
    let now = now_ms();
    let mut tx = db.begin().await?;
    lock_gang_of(&mut tx, db.backend(), job).await?;
    let rank = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT gang_id, gang_rank, gang_joining, gang_leaving FROM jobs WHERE id = $1 AND worker_id = $2 \
         AND state IN {LIVE} \
         AND gang_id IS NOT NULL"
    )))
    .bind(job.to_string())
    .bind(worker.to_string())
    .fetch_optional(&mut *tx)
    .await?;
    let Some(rank) = rank else {
        return Ok(Regroup::NotHeld);
    };
    let gang: String = rank.try_get("gang_id")?;
    let joining = rank.try_get::<i64, _>("gang_joining")? != 0;
    let g = sqlx::query(
        "SELECT state, preempt_reason, regroup_world, attempts + preemptions + regroups AS generation \
         FROM jobs WHERE id = $1",
    )
    .bind(&gang)
    .fetch_one(&mut *tx)
    .await?;
    let state: String = g.try_get("state")?;
    let current = g.try_get::<i64, _>("generation")? as u32;
    let under_way = g.try_get::<Option<i64>, _>("regroup_world")?.is_some();
    if state != "running" {
        return Ok(Regroup::NotHeld);
    }
    if g.try_get::<Option<String>, _>("preempt_reason")?.is_some() {
        return Ok(Regroup::Stop);
    }
    let leaving = rank.try_get::<i64, _>("gang_leaving")? != 0;
    if !under_way && !leaving {
        if joining {
            return Ok(Regroup::NotHeld);
        }
        if current > generation {
            // The regroup this rank waited for formed since its last poll.
            tx.commit().await?;
            return formed(db, &gang, job, current).await;
        }
        sqlx::query(
            "UPDATE jobs SET regroup_world = (SELECT COUNT(*) FROM jobs r WHERE r.gang_id = $1), gang_deadline = $2 \
             WHERE id = $1",
        )
        .bind(&gang)
        .bind(deadline)
        .execute(&mut *tx)
        .await?;
        sqlx::query("UPDATE jobs SET gang_address = NULL WHERE gang_id = $1").bind(&gang).execute(&mut *tx).await?;
    }
    sqlx::query("UPDATE jobs SET gang_address = $1, updated_at = $2 WHERE id = $3")
        .bind(address)
        .bind(now)
        .bind(job.to_string())
        .execute(&mut *tx)
        .await?;
    // A leaving rank that posted has stopped: its lease may lapse before the others post.
    let missing: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM jobs WHERE gang_id = $1 \
         AND (gang_address IS NULL OR (gang_leaving = 0 AND state NOT IN {LIVE}))"
    )))
    .bind(&gang)
    .fetch_one(&mut *tx)
    .await?;
    if missing == 0 {
        form(&mut tx, &gang, now).await?;
    }
    tx.commit().await?;
    match (leaving, missing) {
        (true, _) => {
            // Said here, not by the worker: once the regroup forms, the rank's row is gone
            // and a line it sent after this answer would find no job to land on.
            let line = format!("rank {}: left the gang, which shrank in place", rank.try_get::<i64, _>("gang_rank")?);
            append_logs(db, parse_uuid("jobs", "gang_id", &gang)?, &[line], now).await?;
            Ok(Regroup::Leave)
        }
        (false, 0) => formed(db, &gang, job, current + 1).await,
        (false, _) => Ok(Regroup::Waiting),
    }
}

/// The regroup of `gang` forms (every rank that stays posted): see the module comment.
async fn form(conn: &mut AnyConnection, gang: &str, now: i64) -> Result<()> {
    let freed: Vec<Option<String>> =
        sqlx::query_scalar("SELECT slice_uuid FROM jobs WHERE gang_id = $1 AND gang_leaving = 1")
            .bind(gang)
            .fetch_all(&mut *conn)
            .await?;
    sqlx::query("DELETE FROM jobs WHERE gang_id = $1 AND gang_leaving = 1").bind(gang).execute(&mut *conn).await?;
    let rows = sqlx::query("SELECT id, spec FROM jobs WHERE gang_id = $1 ORDER BY gang_joining, gang_rank")
        .bind(gang)
        .fetch_all(&mut *conn)
        .await?;
    let world = rows.len() as u32;
    for (rank, row) in rows.iter().enumerate() {
        let id: String = row.try_get("id")?;
        let spec = match parse_json::<JobSpec>("jobs", "spec", &row.try_get::<String, _>("spec")?)? {
            JobSpec::TrainRank(spec) => JobSpec::TrainRank(RankJob { rank: rank as u32, world, joining: false, ..spec }),
            other => other,
        };
        sqlx::query(
            "UPDATE jobs SET gang_rank = $1, spec = $2, gang_joining = 0, state = 'running', \
             started_at = COALESCE(started_at, $3), updated_at = $3 WHERE id = $4",
        )
        .bind(rank as i64)
        .bind(serde_json::to_string(&spec)?)
        .bind(now)
        .bind(&id)
        .execute(&mut *conn)
        .await?;
    }
    sqlx::query(
        "UPDATE jobs SET regroups = regroups + 1, regroup_world = NULL, gang_deadline = NULL, updated_at = $1 \
         WHERE id = $2",
    )
    .bind(now)
    .bind(gang)
    .execute(&mut *conn)
    .await?;
    let id = parse_uuid("jobs", "id", gang)?;
    for slice in freed.into_iter().flatten() {
        event(conn, now, &slice, "idle", None, Some(id), "its rank left the gang, which shrank in place").await?;
    }
    Ok(())
}

/// The formed answer for `job` of `gang` at `generation`: its rank, the world and every
/// rank's address.
async fn formed(db: &Db, gang: &str, job: Uuid, generation: u32) -> Result<Regroup> {
    let rows = sqlx::query("SELECT id, gang_address FROM jobs WHERE gang_id = $1 AND gang_joining = 0 ORDER BY gang_rank")
        .bind(gang)
        .fetch_all(db.pool())
        .await?;
    let mut peers = Vec::new();
    let mut rank = None;
    for row in &rows {
        if row.try_get::<String, _>("id")? == job.to_string() {
            rank = Some(peers.len() as u32);
        }
        peers.push(row.try_get::<Option<String>, _>("gang_address")?.unwrap_or_default());
    }
    Ok(match rank {
        Some(rank) => Regroup::Formed { generation, rank, world: peers.len() as u32, peers },
        None => Regroup::NotHeld,
    })
}

/// Calls off the regroup under way in `gang`, if any: the joining ranks go (their workers
/// learn at their next post or heartbeat), the leaving ones stay, but for those told to
/// leave already: their processes stopped at the agreed step, so they stay stopped, as
/// preempted ranks, their leases lapsed or not (the gang, which stops or restarts whenever
/// a regroup is called off, would otherwise wait on them and count them lost). Returns
/// the world it was forming.
pub(super) async fn cancel_in(conn: &mut AnyConnection, gang: &str, now: i64) -> Result<Option<u32>> {
    let world: Option<i64> = sqlx::query_scalar("SELECT regroup_world FROM jobs WHERE id = $1")
        .bind(gang)
        .fetch_optional(&mut *conn)
        .await?
        .flatten();
    let Some(world) = world else {
        return Ok(None);
    };
    sqlx::query("UPDATE jobs SET regroup_world = NULL, gang_deadline = NULL WHERE id = $1")
        .bind(gang)
        .execute(&mut *conn)
        .await?;
    let joiners: Vec<(String, Option<String>)> =
        sqlx::query_as("SELECT id, slice_uuid FROM jobs WHERE gang_id = $1 AND gang_joining = 1")
            .bind(gang)
            .fetch_all(&mut *conn)
            .await?;
    let detail = "the in-place resize that placed a rank on it was called off";
    drop_joiners(conn, gang, &joiners, now, detail).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE jobs SET state = 'preempted', worker_id = NULL, lease_expires_at = NULL, updated_at = $1, \
         message = 'Left the gang at the agreed stop, before the in-place resize was called off.' \
         WHERE gang_id = $2 AND gang_leaving = 1 AND gang_address IS NOT NULL AND state IN {STAYING}"
    )))
    .bind(now)
    .bind(gang)
    .execute(&mut *conn)
    .await?;
    sqlx::query("UPDATE jobs SET gang_leaving = 0 WHERE gang_id = $1").bind(gang).execute(&mut *conn).await?;
    Ok(Some(world as u32))
}

/// Deletes joining rank rows `joiners` (id, slice) of `gang`; each slice is idle again.
async fn drop_joiners(
    conn: &mut AnyConnection,
    gang: &str,
    joiners: &[(String, Option<String>)],
    now: i64,
    detail: &str,
) -> Result<()> {
    let id = parse_uuid("jobs", "id", gang)?;
    for (rank, slice) in joiners {
        sqlx::query("DELETE FROM jobs WHERE id = $1 AND gang_joining = 1").bind(rank).execute(&mut *conn).await?;
        if let Some(slice) = slice {
            event(conn, now, slice, "idle", None, Some(id), detail).await?;
        }
    }
    Ok(())
}

/// States of a rank row in a running gang's new world: joining ones may still be queued.
const STAYING: &str = "('queued', 'leased', 'running')";

/// A regroup cut back by [`cut`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cut {
    /// The world the gang forms at now (its world as it runs, when `called_off`).
    pub world: u32,
    /// Nothing was left to change: the regroup was called off and the gang runs on.
    pub called_off: bool,
    /// Rank rows that go: joining ones dropped, running ones leaving.
    pub gone: Vec<Uuid>,
}

/// Cuts the regroup under way in running `gang` back for a reclaim: the rank rows in `out`
/// go, a joining one dropped at once, a running one leaving when the regroup forms. When a
/// running rank leaves, joining ranks not yet ready go too (the newest first, the world
/// kept at `floor` or more), so the ring stops now instead of after their warm-up; the
/// round may grow the gang again later. A regroup left with nothing to change is called
/// off. `None`, changing nothing, unless the gang runs a regroup with no preemption asked
/// and `out` are ranks of it that stay in its new world.
///
/// A dropped joiner's row goes at once, as in [`cancel_in`]: its worker hears at its next
/// heartbeat, so a joiner still building its session may hold its slice's memory for a
/// few seconds after the slice is free to the round (and, for a reclaim, to a replica).
pub async fn cut(db: &Db, gang: Uuid, out: &[Uuid], floor: u32) -> Result<Option<Cut>> {
    let now = now_ms();
    let gang = gang.to_string();
    let mut tx = db.begin().await?;
    // Locks the gang's row (PostgreSQL) against a regroup forming meanwhile (`post`).
    let under_way = sqlx::query(
        "UPDATE jobs SET regroup_world = regroup_world WHERE id = $1 AND kind = 'train_gang' AND state = 'running' \
         AND regroup_world IS NOT NULL AND preempt_reason IS NULL",
    )
    .bind(&gang)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    if under_way == 0 {
        return Ok(None);
    }
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT id, state, slice_uuid, gang_joining, gang_address FROM jobs WHERE gang_id = $1 AND gang_leaving = 0 \
         AND state IN {STAYING} ORDER BY gang_rank DESC"
    )))
    .bind(&gang)
    .fetch_all(&mut *tx)
    .await?;
    struct Rank {
        id: String,
        slice: Option<String>,
        joining: bool,
        ready: bool,
    }
    let ranks: Vec<Rank> = rows
        .iter()
        .map(|r| {
            Ok(Rank {
                id: r.try_get("id")?,
                slice: r.try_get("slice_uuid")?,
                joining: r.try_get::<i64, _>("gang_joining")? != 0,
                // Posted from a process that still holds its lease.
                ready: r.try_get::<Option<String>, _>("gang_address")?.is_some()
                    && matches!(r.try_get::<String, _>("state")?.as_str(), "leased" | "running"),
            })
        })
        .collect::<Result<_>>()?;
    let out: Vec<String> = out.iter().map(Uuid::to_string).collect();
    if !out.iter().all(|id| ranks.iter().any(|r| &r.id == id)) {
        return Ok(None);
    }
    let leaves = |r: &&Rank| !r.joining && out.contains(&r.id);
    let unready = match ranks.iter().any(|r| leaves(&r)) {
        true => (ranks.len() - out.len()).saturating_sub(floor as usize),
        false => 0,
    };
    let dropped: Vec<&Rank> = ranks
        .iter()
        .filter(|r| r.joining && out.contains(&r.id))
        .chain(ranks.iter().filter(|r| r.joining && !r.ready && !out.contains(&r.id)).take(unready))
        .collect();
    let joiners: Vec<(String, Option<String>)> = dropped.iter().map(|r| (r.id.clone(), r.slice.clone())).collect();
    drop_joiners(&mut tx, &gang, &joiners, now, "the in-place resize that placed a rank on it was cut back for a reclaim")
        .await?;
    for r in ranks.iter().filter(leaves) {
        sqlx::query("UPDATE jobs SET gang_leaving = 1 WHERE id = $1").bind(&r.id).execute(&mut *tx).await?;
    }
    let gone: Vec<&Rank> = dropped.iter().copied().chain(ranks.iter().filter(leaves)).collect();
    let world = (ranks.len() - gone.len()) as u32;
    let changes: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM jobs WHERE gang_id = $1 AND (gang_joining = 1 OR gang_leaving = 1)",
    )
    .bind(&gang)
    .fetch_one(&mut *tx)
    .await?;
    let called_off = changes == 0;
    if called_off {
        cancel_in(&mut tx, &gang, now).await?;
    } else {
        sqlx::query("UPDATE jobs SET regroup_world = $1 WHERE id = $2")
            .bind(world as i64)
            .bind(&gang)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    let gone = gone.iter().map(|r| parse_uuid("jobs", "id", &r.id)).collect::<Result<_>>()?;
    Ok(Some(Cut { world, called_off, gone }))
}
