//! AutoLRS stage records: what each stage's search tried (candidate LRs with their
//! forecast and observed losses) and the LR it chose. The worker reports a stage when
//! its search ends and again when its exploitation ends; the later report replaces the
//! earlier one.

use sqlx::Row;
use tessera_api::train::{LrStage, LrStageRecord};
use uuid::Uuid;

use crate::store::db::{self, now_ms, Db};
use crate::error::{Error, Result};

fn invalid(message: impl Into<String>) -> Error {
    Error::invalid("invalid_lr_stage", message)
}

fn check(record: &LrStageRecord) -> Result<()> {
    let positive = |lr: f64| lr > 0.0 && lr.is_finite();
    if !positive(record.chosen_lr) {
        return Err(invalid("chosen_lr must be a positive number."));
    }
    if record.candidates.is_empty() || record.candidates.len() > 1000 {
        return Err(invalid("A stage has 1 to 1000 candidates."));
    }
    if record.candidates.iter().any(|c| !positive(c.lr)) {
        return Err(invalid("Every candidate's lr must be a positive number."));
    }
    if record.metric.is_empty() || record.metric.len() > 64 {
        return Err(invalid("metric names the loss the stage forecast, e.g. train_loss or val_loss."));
    }
    Ok(())
}

pub async fn store(db: &Db, job: Uuid, record: &LrStageRecord) -> Result<()> {
    check(record)?;
    // serde_json writes non-finite floats (a diverged forecast) as null.
    let text = serde_json::to_string(record).map_err(|e| anyhow::anyhow!(e))?;
    sqlx::query(
        "INSERT INTO lr_stages (job_id, stage, record, updated_at) VALUES ($1, $2, $3, $4) \
         ON CONFLICT (job_id, stage) DO UPDATE SET record = excluded.record, updated_at = excluded.updated_at",
    )
    .bind(job.to_string())
    .bind(record.stage as i64)
    .bind(text)
    .bind(now_ms())
    .execute(db.pool())
    .await?;
    Ok(())
}

pub async fn read(db: &Db, job: Uuid) -> Result<Vec<LrStage>> {
    let rows = sqlx::query("SELECT record, updated_at FROM lr_stages WHERE job_id = $1 ORDER BY stage")
        .bind(job.to_string())
        .fetch_all(db.pool())
        .await?;
    rows.iter()
        .map(|row| {
            let text: String = row.try_get("record")?;
            let record = serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("stored lr stage unreadable: {e}"))?;
            Ok(LrStage { record, updated_at: db::time(row.try_get("updated_at")?) })
        })
        .collect()
}
