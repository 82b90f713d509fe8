//! What training jobs leave behind: metric points (`job_metrics`, one row per job,
//! series, name and step, last write wins), AutoLRS stage records (`lr_stages`), and
//! checkpoints (`checkpoints`, `checkpoint_files`; the files are blobs by digest).

use std::collections::HashMap;

use sqlx::Row;
use tessera_api::train::{Checkpoint, CheckpointFile, LrStage, LrStageRecord, StepPhase};
use uuid::Uuid;

use super::db::{self, Db};
use super::{parse_json, Result};

/// Which series a point belongs to: one per training step, or one per evaluation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Series {
    Step,
    Eval,
}

impl Series {
    pub fn as_str(self) -> &'static str {
        match self {
            Series::Step => "step",
            Series::Eval => "eval",
        }
    }

    fn parse(text: &str) -> Series {
        if text == Series::Eval.as_str() {
            Series::Eval
        } else {
            Series::Step
        }
    }
}

/// One metric value at one step.
#[derive(Debug, Clone, PartialEq)]
pub struct Point {
    pub series: Series,
    pub name: String,
    pub step: i64,
    pub value: f64,
    /// Epoch milliseconds.
    pub at: i64,
    /// AutoLRS's tag of the step (`search` or `exploit`), on each of its points.
    pub phase: Option<StepPhase>,
}

/// Rows per INSERT statement: 7 parameters each stays far below both databases' limits.
const ROWS_PER_STATEMENT: usize = 500;

/// Stores points (last write wins per job, series, name and step) and raises the job's
/// progress to the highest training step among them, in one transaction.
pub async fn upsert_metrics(db: &Db, job: Uuid, points: &[Point]) -> Result<()> {
    // One statement may not upsert the same row twice (PostgreSQL refuses), so the
    // batch's own repeats are settled here: the later point wins.
    let mut latest: HashMap<(Series, &str, i64), &Point> = HashMap::with_capacity(points.len());
    for point in points {
        latest.insert((point.series, point.name.as_str(), point.step), point);
    }
    let unique: Vec<&Point> = latest.into_values().collect();
    let job_id = job.to_string();
    let mut tx = db.begin().await?;
    for chunk in unique.chunks(ROWS_PER_STATEMENT) {
        let values: Vec<String> = (0..chunk.len())
            .map(|i| {
                let p = i * 7;
                format!("(${}, ${}, ${}, ${}, ${}, ${}, ${})", p + 1, p + 2, p + 3, p + 4, p + 5, p + 6, p + 7)
            })
            .collect();
        let sql = format!(
            "INSERT INTO job_metrics (job_id, series, name, step, value, at, phase) VALUES {} \
             ON CONFLICT (job_id, series, name, step) DO UPDATE SET value = excluded.value, at = excluded.at, \
             phase = excluded.phase",
            values.join(", ")
        );
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for point in chunk {
            query = query
                .bind(job_id.clone())
                .bind(point.series.as_str())
                .bind(point.name.clone())
                .bind(point.step)
                .bind(point.value)
                .bind(point.at)
                .bind(point.phase.map(StepPhase::as_str));
        }
        query.execute(&mut *tx).await?;
    }
    if let Some(step) = points.iter().filter(|p| p.series == Series::Step).map(|p| p.step).max() {
        sqlx::query(
            "UPDATE jobs SET progress_step = $1 WHERE id = $2 AND (progress_step IS NULL OR progress_step < $1)",
        )
        .bind(step)
        .bind(&job_id)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(())
}

/// Every point of a job as `(series, name, step, value, phase)`, ordered by series, name,
/// step.
pub async fn metrics(db: &Db, job: Uuid) -> Result<Vec<(Series, String, i64, f64, Option<StepPhase>)>> {
    let rows = sqlx::query(
        "SELECT series, name, step, value, phase FROM job_metrics WHERE job_id = $1 ORDER BY series, name, step",
    )
    .bind(job.to_string())
    .fetch_all(db.pool())
    .await?;
    rows.iter()
        .map(|row| {
            Ok((
                Series::parse(&row.try_get::<String, _>("series")?),
                row.try_get("name")?,
                row.try_get("step")?,
                row.try_get("value")?,
                row.try_get::<Option<String>, _>("phase")?.as_deref().and_then(StepPhase::parse),
            ))
        })
        .collect()
}

/// The best evaluation of metric `name` so far as `(step, value)`: the highest when
/// `highest`, else the lowest.
pub async fn best_eval(db: &Db, job: Uuid, name: &str, highest: bool) -> Result<Option<(i64, f64)>> {
    let order = if highest { "DESC" } else { "ASC" };
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT step, value FROM job_metrics WHERE job_id = $1 AND series = 'eval' AND name = $2 ORDER BY value {order} LIMIT 1"
    )))
    .bind(job.to_string())
    .bind(name)
    .fetch_optional(db.pool())
    .await?;
    row.map(|row| Ok((row.try_get("step")?, row.try_get("value")?))).transpose()
}

/// The last evaluation of metric `name` as `(step, value)`: where the run ended.
pub async fn last_eval(db: &Db, job: Uuid, name: &str) -> Result<Option<(i64, f64)>> {
    let row = sqlx::query(
        "SELECT step, value FROM job_metrics WHERE job_id = $1 AND series = 'eval' AND name = $2 ORDER BY step DESC LIMIT 1",
    )
    .bind(job.to_string())
    .bind(name)
    .fetch_optional(db.pool())
    .await?;
    row.map(|row| Ok((row.try_get("step")?, row.try_get("value")?))).transpose()
}

/// Stores one AutoLRS stage, replacing an earlier report of the same stage.
pub async fn upsert_lr_stage(db: &Db, job: Uuid, record: &LrStageRecord, at: i64) -> Result<()> {
    // serde_json writes non-finite floats (a diverged forecast) as null.
    let text = serde_json::to_string(record)?;
    sqlx::query(
        "INSERT INTO lr_stages (job_id, stage, record, updated_at) VALUES ($1, $2, $3, $4) \
         ON CONFLICT (job_id, stage) DO UPDATE SET record = excluded.record, updated_at = excluded.updated_at",
    )
    .bind(job.to_string())
    .bind(record.stage as i64)
    .bind(text)
    .bind(at)
    .execute(db.pool())
    .await?;
    Ok(())
}

/// A job's AutoLRS stages in order.
pub async fn lr_stages(db: &Db, job: Uuid) -> Result<Vec<LrStage>> {
    let rows = sqlx::query("SELECT record, updated_at FROM lr_stages WHERE job_id = $1 ORDER BY stage")
        .bind(job.to_string())
        .fetch_all(db.pool())
        .await?;
    rows.iter()
        .map(|row| {
            let record = parse_json("lr_stages", "record", &row.try_get::<String, _>("record")?)?;
            Ok(LrStage { record, updated_at: db::time(row.try_get("updated_at")?) })
        })
        .collect()
}

/// Whether a checkpoint was stored.
#[derive(Debug, PartialEq, Eq)]
pub enum Stored {
    Yes,
    /// The job ended while its checkpoint streamed in.
    JobEnded,
    /// The uploading worker lost the lease it uploads under (it expired, the job or rank
    /// moved to another worker) while its checkpoint streamed in.
    LeaseLost,
}

/// Stores a checkpoint and its files, replacing one at the same step (the ledger's
/// triggers move the blob references), if the job is unfinished and `worker` still holds
/// `held` (the job, or the rank of its gang it uploads for).
pub async fn replace_checkpoint(db: &Db, checkpoint: &Checkpoint, worker: Uuid, held: Uuid) -> Result<Stored> {
    let job_id = checkpoint.job_id.to_string();
    let step = checkpoint.step as i64;
    let mut tx = db.begin().await?;
    // Under the job's row lock, so a cancel (and a delete of its checkpoints after it)
    // comes wholly before or after: a job that ended while this streamed stores nothing.
    // The same for the lease: a worker that claims the job (or rank) after it expired
    // fetches the latest checkpoint only once this is in or refused.
    super::lock_row(&mut tx, db.backend(), "jobs", checkpoint.job_id, super::RowLock::Share).await?;
    if held != checkpoint.job_id {
        super::lock_row(&mut tx, db.backend(), "jobs", held, super::RowLock::Share).await?;
    }
    let unfinished: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM jobs WHERE id = $1 AND state NOT IN ('succeeded', 'failed', 'cancelled')",
    )
    .bind(&job_id)
    .fetch_one(&mut *tx)
    .await?;
    if unfinished == 0 {
        return Ok(Stored::JobEnded);
    }
    let holds: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM jobs WHERE id = $1 AND worker_id = $2 AND state IN ('leased', 'running')",
    )
    .bind(held.to_string())
    .bind(worker.to_string())
    .fetch_one(&mut *tx)
    .await?;
    if holds == 0 {
        return Ok(Stored::LeaseLost);
    }
    sqlx::query("DELETE FROM checkpoints WHERE job_id = $1 AND step = $2")
        .bind(&job_id)
        .bind(step)
        .execute(&mut *tx)
        .await?;
    sqlx::query("INSERT INTO checkpoints (job_id, step, size_bytes, created_at) VALUES ($1, $2, $3, $4)")
        .bind(&job_id)
        .bind(step)
        .bind(checkpoint.size_bytes as i64)
        .bind(checkpoint.created_at.timestamp_millis())
        .execute(&mut *tx)
        .await?;
    for file in &checkpoint.files {
        sqlx::query(
            "INSERT INTO checkpoint_files (job_id, step, name, digest, size_bytes) VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(&job_id)
        .bind(step)
        .bind(&file.name)
        .bind(&file.digest)
        .bind(file.size_bytes as i64)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(Stored::Yes)
}

/// The step of `job`'s `n`-th newest checkpoint (1 = the newest), if it has that many.
pub async fn nth_newest_checkpoint(db: &Db, job: Uuid, n: i64) -> Result<Option<i64>> {
    Ok(sqlx::query_scalar("SELECT step FROM checkpoints WHERE job_id = $1 ORDER BY step DESC LIMIT 1 OFFSET $2")
        .bind(job.to_string())
        .bind(n - 1)
        .fetch_optional(db.pool())
        .await?)
}

/// Deletes `job`'s checkpoints before `step` (their files go with them).
pub async fn delete_checkpoints_before(db: &Db, job: Uuid, step: i64) -> Result<u64> {
    let deleted = sqlx::query("DELETE FROM checkpoints WHERE job_id = $1 AND step < $2")
        .bind(job.to_string())
        .bind(step)
        .execute(db.pool())
        .await?
        .rows_affected();
    Ok(deleted)
}

/// A job's checkpoints, oldest step first.
pub async fn checkpoints(db: &Db, job: Uuid) -> Result<Vec<Checkpoint>> {
    let job_id = job.to_string();
    let rows = sqlx::query("SELECT step, size_bytes, created_at FROM checkpoints WHERE job_id = $1 ORDER BY step")
        .bind(&job_id)
        .fetch_all(db.pool())
        .await?;
    let files = sqlx::query(
        "SELECT step, name, digest, size_bytes FROM checkpoint_files WHERE job_id = $1 ORDER BY step, name",
    )
    .bind(&job_id)
    .fetch_all(db.pool())
    .await?;
    let mut checkpoints = Vec::with_capacity(rows.len());
    for row in &rows {
        let step: i64 = row.try_get("step")?;
        let mut own = Vec::new();
        for file in &files {
            if file.try_get::<i64, _>("step")? == step {
                own.push(CheckpointFile {
                    name: file.try_get("name")?,
                    digest: file.try_get("digest")?,
                    size_bytes: file.try_get::<i64, _>("size_bytes")? as u64,
                });
            }
        }
        checkpoints.push(Checkpoint {
            job_id: job,
            step: step as u64,
            size_bytes: row.try_get::<i64, _>("size_bytes")? as u64,
            files: own,
            created_at: db::time(row.try_get("created_at")?),
        });
    }
    Ok(checkpoints)
}

/// One file of one of `job`'s checkpoints.
pub async fn checkpoint_file(db: &Db, job: Uuid, step: u64, name: &str) -> Result<Option<CheckpointFile>> {
    let row =
        sqlx::query("SELECT digest, size_bytes FROM checkpoint_files WHERE job_id = $1 AND step = $2 AND name = $3")
            .bind(job.to_string())
            .bind(step as i64)
            .bind(name)
            .fetch_optional(db.pool())
            .await?;
    row.map(|row| {
        Ok(CheckpointFile {
            name: name.to_string(),
            digest: row.try_get("digest")?,
            size_bytes: row.try_get::<i64, _>("size_bytes")? as u64,
        })
    })
    .transpose()
}
