//! The slices workers offer, as the server records them: replaced when a worker
//! registers (with legal MIG starts, arranged when the worker could not read them),
//! listed with the replica holding each, and handed out when a worker claims a replica.
//!
//! Binding rules: a replica the planner pinned to a slice waits for that slice's worker
//! and that slice to be free; any other replica, claimed by a worker with slices, takes
//! a free slice nobody is waiting for, and by a worker without slices runs on its CPU.
//! One replica per slice: a slice is busy while a leased or running replica holds it.

use std::collections::{BTreeMap, HashMap};

use sqlx::any::AnyRow;
use sqlx::Row;
use tessera_api::mig::{Slice, SliceStatus};
use uuid::Uuid;

use crate::store::db::Db;
use crate::error::{Error, Result};
use crate::scheduler::mig::{arrange, validate, GpuModel, Placed};

/// Jobs holding a slice: live replicas, and queued replicas pinned to it.
pub const HOLDING: &str =
    "(j.state IN ('leased', 'running') OR (j.state = 'queued' AND j.slice_pinned = 1))";

const COLUMNS: &str =
    "s.uuid, s.gpu_uuid, s.gpu_index, s.gpu_model, s.profile, s.start, s.memory_bytes, s.simulated";

pub fn slice_from_row(row: &AnyRow) -> Result<Slice> {
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

/// Fills in legal starts for the MIG slices of each known GPU model, or says what is
/// wrong with the reported partition.
pub fn with_starts(slices: &[Slice]) -> Result<Vec<Slice>> {
    let mut by_gpu: BTreeMap<&str, Vec<&Slice>> = BTreeMap::new();
    for s in slices {
        by_gpu.entry(s.gpu_uuid.as_str()).or_default().push(s);
    }
    let mut out = Vec::with_capacity(slices.len());
    for (gpu_uuid, group) in by_gpu {
        let model = group[0].gpu_model.as_deref().and_then(GpuModel::parse);
        let mig: Vec<&Slice> = group
            .iter()
            .copied()
            .filter(|s| s.profile.is_some())
            .collect();
        let Some(model) = model.filter(|_| !mig.is_empty()) else {
            out.extend(group.into_iter().cloned());
            continue;
        };
        let invalid =
            |what: String| Error::invalid("invalid_slices", format!("GPU {gpu_uuid}: {what}"));
        let mut ids = Vec::with_capacity(mig.len());
        for s in &mig {
            let name = s.profile.as_deref().unwrap_or_default();
            ids.push(model.profile_id(name).ok_or_else(|| {
                invalid(format!(
                    "{model} has no MIG profile \"{name}\"; its profiles are {}",
                    model.profile_names()
                ))
            })?);
        }
        let starts: Vec<Option<u8>> = mig.iter().map(|s| s.start).collect();
        let placed: Vec<Placed> = if starts.iter().all(Option::is_some) {
            let placed: Vec<Placed> = ids
                .iter()
                .zip(&starts)
                .map(|(&profile, s)| Placed {
                    profile,
                    start: s.unwrap(),
                })
                .collect();
            validate(model, &placed)
                .map_err(|e| invalid(format!("not a legal MIG partition: {e}")))?;
            placed
        } else if starts.iter().all(Option::is_none) {
            // Arranged in order of the sorted placement, then matched back by profile.
            let mut arranged = arrange(model, &ids)
                .map_err(|e| invalid(format!("not a legal MIG partition: {e}")))?;
            ids.iter()
                .map(|&p| {
                    let i = arranged
                        .iter()
                        .position(|a| a.profile == p)
                        .expect("arrange keeps every profile");
                    arranged.remove(i)
                })
                .collect()
        } else {
            return Err(invalid(
                "give a start for every MIG instance or for none".into(),
            ));
        };
        for (s, p) in mig.iter().zip(placed) {
            out.push(Slice {
                start: Some(p.start),
                ..(*s).clone()
            });
        }
        out.extend(
            group
                .iter()
                .filter(|s| s.profile.is_none())
                .map(|s| (*s).clone()),
        );
    }
    Ok(out)
}

/// Records what a registering worker offers. A simulated GPU the scheduler repartitioned
/// keeps the partition the server applied (the server's record is that GPU's truth) as
/// long as the worker still allows repartitioning.
pub async fn record(
    db: &Db,
    worker: Uuid,
    allow_repartition: bool,
    slices: &[Slice],
) -> Result<()> {
    let slices = with_starts(slices)?;
    let mut tx = db.begin().await?;
    sqlx::query("UPDATE workers SET allow_repartition = $1 WHERE id = $2")
        .bind(allow_repartition as i64)
        .bind(worker.to_string())
        .execute(&mut *tx)
        .await?;
    let recorded: Vec<String> = if allow_repartition {
        sqlx::query_scalar(
            "SELECT DISTINCT gpu_uuid FROM slices WHERE worker_id = $1 AND simulated = 1",
        )
        .bind(worker.to_string())
        .fetch_all(&mut *tx)
        .await?
    } else {
        Vec::new()
    };
    let kept: Vec<&String> = recorded
        .iter()
        .filter(|g| slices.iter().any(|s| &s.gpu_uuid == *g && s.simulated))
        .collect();
    let stale: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT gpu_uuid FROM slices WHERE worker_id = $1")
            .bind(worker.to_string())
            .fetch_all(&mut *tx)
            .await?;
    for gpu in stale.iter().filter(|g| !kept.contains(g)) {
        sqlx::query("DELETE FROM slices WHERE worker_id = $1 AND gpu_uuid = $2")
            .bind(worker.to_string())
            .bind(gpu)
            .execute(&mut *tx)
            .await?;
    }
    for s in slices.iter().filter(|s| !kept.contains(&&s.gpu_uuid)) {
        insert(&mut tx, worker, s).await?;
    }
    tx.commit().await?;
    Ok(())
}

pub async fn insert(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    worker: Uuid,
    s: &Slice,
) -> Result<()> {
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
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Every worker's slices with what holds each, by worker id.
pub async fn by_worker(db: &Db) -> Result<HashMap<Uuid, Vec<SliceStatus>>> {
    let rows = sqlx::query(&format!(
        "SELECT s.worker_id, {COLUMNS}, j.id AS job_id, d.name AS deployment FROM slices s \
         LEFT JOIN jobs j ON j.slice_uuid = s.uuid AND {HOLDING} \
         LEFT JOIN deployments d ON d.id = j.deployment_id \
         ORDER BY s.worker_id, s.gpu_index, s.start, s.uuid"
    ))
    .fetch_all(db.pool())
    .await?;
    let mut out: HashMap<Uuid, Vec<SliceStatus>> = HashMap::new();
    for row in &rows {
        let worker: String = row.try_get("worker_id")?;
        let job: Option<String> = row.try_get("job_id")?;
        let status = SliceStatus {
            slice: slice_from_row(row)?,
            replica: job
                .map(|j| j.parse())
                .transpose()
                .map_err(|e| anyhow::anyhow!("bad job id: {e}"))?,
            deployment: row.try_get("deployment")?,
        };
        let worker: Uuid = worker
            .parse()
            .map_err(|e| anyhow::anyhow!("bad worker id {worker}: {e}"))?;
        let list = out.entry(worker).or_default();
        // A slice appears once even if two jobs claim it (they should not).
        if !list.iter().any(|s| s.slice.uuid == status.slice.uuid) {
            list.push(status);
        }
    }
    Ok(out)
}

/// What a claiming worker may take: its slices that no live replica holds, and those of
/// them no queued replica is pinned to.
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
         FROM slices s WHERE s.worker_id = $1 ORDER BY s.gpu_index, s.start, s.uuid",
    )
    .bind(worker.to_string())
    .fetch_all(db.pool())
    .await?;
    let mut free = Free {
        has_slices: !rows.is_empty(),
        ..Free::default()
    };
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
    /// The claim's condition on serve jobs, with its parameters numbered from `first`.
    pub fn condition(&self, first: usize) -> (String, Vec<String>) {
        let pinned = if self.free.is_empty() {
            "1 = 0".to_string()
        } else {
            let params: Vec<String> = (0..self.free.len())
                .map(|i| format!("${}", first + i))
                .collect();
            format!("slice_uuid IN ({})", params.join(", "))
        };
        let unpinned = if !self.has_slices || !self.unreserved.is_empty() {
            "1 = 1"
        } else {
            "1 = 0"
        };
        (
            format!("(kind <> 'serve' OR (slice_pinned = 1 AND {pinned}) OR (slice_pinned = 0 AND {unpinned}))"),
            self.free.clone(),
        )
    }
}

/// Binds a just-claimed serve job to its slice: the pinned one, or the first free slice
/// nobody waits for; none on a worker without slices.
pub async fn bind_claimed(db: &Db, job: Uuid, free: &Free) -> Result<Option<Slice>> {
    let row = sqlx::query("SELECT kind, slice_uuid, slice_pinned FROM jobs WHERE id = $1")
        .bind(job.to_string())
        .fetch_one(db.pool())
        .await?;
    if row.try_get::<String, _>("kind")? != "serve" {
        return Ok(None);
    }
    let uuid = if row.try_get::<i64, _>("slice_pinned")? != 0 {
        row.try_get::<Option<String>, _>("slice_uuid")?
    } else {
        let uuid = free.unreserved.first().cloned();
        sqlx::query("UPDATE jobs SET slice_uuid = $1 WHERE id = $2")
            .bind(&uuid)
            .bind(job.to_string())
            .execute(db.pool())
            .await?;
        uuid
    };
    let Some(uuid) = uuid else { return Ok(None) };
    let row = sqlx::query(&format!("SELECT {COLUMNS} FROM slices s WHERE s.uuid = $1"))
        .bind(&uuid)
        .fetch_one(db.pool())
        .await?;
    Ok(Some(slice_from_row(&row)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(gpu: &str, profile: Option<&str>, start: Option<u8>) -> Slice {
        Slice {
            uuid: format!("{gpu}-{profile:?}-{start:?}"),
            gpu_uuid: gpu.into(),
            gpu_index: 0,
            gpu_model: Some("H100-80GB".into()),
            profile: profile.map(Into::into),
            start,
            memory_bytes: 0,
            simulated: true,
        }
    }

    #[test]
    fn starts_are_arranged_when_none_were_reported() {
        let out = with_starts(&[
            slice("g", Some("2g.20gb"), None),
            slice("g", Some("3g.40gb"), None),
            slice("g", Some("2g.20gb"), None),
        ])
        .unwrap();
        let placed: Vec<Placed> = out
            .iter()
            .map(|s| Placed {
                profile: GpuModel::H100_80GB
                    .profile_id(s.profile.as_deref().unwrap())
                    .unwrap(),
                start: s.start.unwrap(),
            })
            .collect();
        validate(GpuModel::H100_80GB, &placed).unwrap();
        assert_eq!(
            out.iter()
                .filter(|s| s.profile.as_deref() == Some("2g.20gb"))
                .count(),
            2
        );
    }

    #[test]
    fn an_illegal_or_unknown_partition_is_refused_with_the_reason() {
        let err = with_starts(&[
            slice("g", Some("4g.40gb"), None),
            slice("g", Some("4g.40gb"), None),
        ])
        .unwrap_err();
        assert!(
            err.to_string().contains("GPU g: not a legal MIG partition"),
            "{err}"
        );
        let err = with_starts(&[slice("g", Some("1g.5gb"), None)]).unwrap_err();
        assert!(
            err.to_string()
                .contains("H100-80GB has no MIG profile \"1g.5gb\""),
            "{err}"
        );
        let err = with_starts(&[
            slice("g", Some("3g.40gb"), Some(0)),
            slice("g", Some("3g.40gb"), None),
        ])
        .unwrap_err();
        assert!(err.to_string().contains("every MIG instance or for none"));
        let err = with_starts(&[slice("g", Some("3g.40gb"), Some(2))]).unwrap_err();
        assert!(
            err.to_string().contains("not a legal MIG partition"),
            "{err}"
        );
    }

    #[test]
    fn the_claim_condition_lets_pinned_replicas_wait_for_their_slice() {
        let none = Free {
            has_slices: true,
            free: vec![],
            unreserved: vec![],
        };
        assert_eq!(
            none.condition(5).0,
            "(kind <> 'serve' OR (slice_pinned = 1 AND 1 = 0) OR (slice_pinned = 0 AND 1 = 0))"
        );
        let cpu = Free::default();
        assert!(cpu
            .condition(5)
            .0
            .ends_with("(slice_pinned = 0 AND 1 = 1))"));
        let two = Free {
            has_slices: true,
            free: vec!["a".into(), "b".into()],
            unreserved: vec![],
        };
        let (sql, binds) = two.condition(5);
        assert!(
            sql.contains("slice_uuid IN ($5, $6)")
                && sql.ends_with("(slice_pinned = 0 AND 1 = 0))")
        );
        assert_eq!(binds, vec!["a", "b"]);
    }
}
