//! The seam to preemption (issue 16's reclaim step): how the loaning round asks a training
//! job to give its slices back. `jobs::preempt_job` does it: the job checkpoints at the
//! step it is on (a heartbeat signal), stops and waits as `preempted`, its rank pins
//! cleared, so the reclaim finishes once the slices are free. A resize of a running
//! elastic gang is the same stop, with the size to restart at recorded first.

use uuid::Uuid;

use crate::error::{Error, Result};
use crate::state::AppState;

/// Asks training job `job` (a gang) to checkpoint now and stop; true when it was asked (or
/// a gang still forming was sent back to the queue), false when there is nothing to stop.
pub async fn preempt_job(state: &AppState, job: Uuid, reason: &str) -> Result<bool> {
    match crate::jobs::preempt_job(&state.db, job, reason).await {
        Ok(_) => Ok(true),
        // Not running (it ended or was preempted since the round read it), or not
        // preemptible (the round only picks preemptible jobs, so a spec read in between).
        Err(Error::Conflict(_)) => Ok(false),
        Err(e) => Err(e),
    }
}
