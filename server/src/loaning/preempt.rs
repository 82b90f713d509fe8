//! The seam to preemption (issue 16's reclaim step): how the loaning round asks a training
//! job to give its slices back.
//!
//! a-preempt provides `preempt_job(state, job, reason)`: the job checkpoints now on a
//! heartbeat signal, stops, and is requeued in the `preempted` state (not a failed
//! attempt). Until that lands, [`preempt_job`] stops the job at once and requeues it to
//! resume from its last checkpoint (the gang's lost-rank path, without spending an
//! attempt), so a preemption costs the steps since that checkpoint.

use uuid::Uuid;

use crate::error::Result;
use crate::state::AppState;
use crate::store::loaning as store;

/// Asks training job `job` (a gang) to stop and requeue; true when it was stopped.
// a-preempt provides: replace the body with its `preempt_job(state, job, reason)`.
pub async fn preempt_job(state: &AppState, job: Uuid, reason: &str) -> Result<bool> {
    let message = format!("Preempted: {reason}; requeued to resume from its last checkpoint.");
    Ok(store::requeue_preempted(&state.db, job, &message).await?)
}
