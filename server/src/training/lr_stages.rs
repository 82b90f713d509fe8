//! AutoLRS stage records: what each stage's search tried (candidate LRs with their
//! forecast and observed losses) and the LR it chose. The worker reports a stage when
//! its search ends and again when its exploitation ends; the later report replaces the
//! earlier one.

use tessera_api::train::{LrStage, LrStageRecord};
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::store::db::{now_ms, Db};
use crate::store::training as store;

fn invalid(message: impl Into<String>) -> Error {
    Error::invalid("invalid_lr_stage", message)
}

fn check(record: &LrStageRecord) -> Result<()> {
    let positive = |lr: f64| lr > 0.0 && lr.is_finite();
    if !positive(record.chosen_lr) {
        return Err(invalid("chosen_lr must be a positive number."));
    }
    // A last stage fitted to the budget may have no search (τ' = 0), and one the budget
    // cut short (`run_end`) may have ended before its first candidate finished.
    let searchless = record.tau_prime == 0 || record.run_end.is_some();
    if (record.candidates.is_empty() && !searchless) || record.candidates.len() > 1000 {
        return Err(invalid("A stage has 1 to 1000 candidates (none only with tau_prime 0 or run_end set)."));
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
    Ok(store::upsert_lr_stage(db, job, record, now_ms()).await?)
}

pub async fn read(db: &Db, job: Uuid) -> Result<Vec<LrStage>> {
    Ok(store::lr_stages(db, job).await?)
}
