//! QSync precision plans (`precision_plans`, issue 12): the report rank 0 of a
//! data-parallel job posts, one per job under the job users see (last write wins), who
//! may post it, and the jobs its dashboard compares it with.

use sqlx::Row;
use tessera_api::jobs::Job;
use tessera_api::precision::PrecisionPlanReport;
use uuid::Uuid;

use super::db::Db;
use super::jobs::{job_from_row, JOB_COLUMNS};
use super::{parse_json, parse_uuid, Result};

/// Stores `job`'s plan report, replacing an earlier one.
pub async fn upsert(db: &Db, job: Uuid, report: &PrecisionPlanReport, at: i64) -> Result<()> {
    sqlx::query(
        "INSERT INTO precision_plans (job_id, report, updated_at) VALUES ($1, $2, $3) \
         ON CONFLICT (job_id) DO UPDATE SET report = excluded.report, updated_at = excluded.updated_at",
    )
    .bind(job.to_string())
    .bind(serde_json::to_string(report)?)
    .bind(at)
    .execute(db.pool())
    .await?;
    Ok(())
}

/// `job`'s plan report and when it was last posted (epoch milliseconds).
pub async fn get(db: &Db, job: Uuid) -> Result<Option<(PrecisionPlanReport, i64)>> {
    let row = sqlx::query("SELECT report, updated_at FROM precision_plans WHERE job_id = $1")
        .bind(job.to_string())
        .fetch_optional(db.pool())
        .await?;
    row.map(|row| {
        let report = parse_json("precision_plans", "report", &row.try_get::<String, _>("report")?)?;
        Ok((report, row.try_get("updated_at")?))
    })
    .transpose()
}

/// What the server knows of the job row a worker posts a plan through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Poster {
    /// The gang's job and this row's rank, when the row is a rank of a data-parallel job.
    pub gang: Option<(Uuid, u32)>,
    /// The ranks of that gang.
    pub world: u32,
    /// The worker holding the row's lease now, if any.
    pub holder: Option<Uuid>,
}

/// The row `job` as a plan poster sees it; `None` when there is no such job.
pub async fn poster(db: &Db, job: Uuid) -> Result<Option<Poster>> {
    let row = sqlx::query(
        "SELECT j.gang_id, j.gang_rank, \
         CASE WHEN j.state IN ('leased', 'running') THEN j.worker_id END AS holder, \
         (SELECT COUNT(*) FROM jobs r WHERE j.gang_id IS NOT NULL AND r.gang_id = j.gang_id) AS world \
         FROM jobs j WHERE j.id = $1",
    )
    .bind(job.to_string())
    .fetch_optional(db.pool())
    .await?;
    let Some(row) = row else { return Ok(None) };
    let gang = match (row.try_get::<Option<String>, _>("gang_id")?, row.try_get::<Option<i64>, _>("gang_rank")?) {
        (Some(gang), Some(rank)) => Some((parse_uuid("jobs", "gang_id", &gang)?, rank.max(0) as u32)),
        _ => None,
    };
    let holder = row.try_get::<Option<String>, _>("holder")?;
    Ok(Some(Poster {
        gang,
        world: row.try_get::<i64, _>("world")?.max(0) as u32,
        holder: holder.as_deref().map(|w| parse_uuid("jobs", "worker_id", w)).transpose()?,
    }))
}

/// The other data-parallel jobs of `job`'s owner that read the same dataset, newest
/// first (at most `limit`): the candidates for its baselines, whose specs the caller
/// compares.
pub async fn sibling_gangs(db: &Db, job: Uuid, limit: i64) -> Result<Vec<Job>> {
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {JOB_COLUMNS} FROM jobs j JOIN users u ON u.id = j.owner_id JOIN jobs this ON this.id = $1 \
         WHERE j.owner_id = this.owner_id AND j.dataset_id = this.dataset_id AND j.kind = 'train_gang' \
         AND j.id <> this.id ORDER BY j.created_at DESC LIMIT $2"
    )))
    .bind(job.to_string())
    .bind(limit)
    .fetch_all(db.pool())
    .await?;
    rows.iter().map(job_from_row).collect()
}
