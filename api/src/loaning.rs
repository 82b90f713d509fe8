//! Capacity loaning (issue 16): the loan state of a slice, and what
//! `GET /api/v1/fleet/loaning` shows of the scheduling rounds: loaned capacity over time,
//! reclaim events with the jobs they hit, slice history, and the training queue with
//! predicted job completion times.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

/// Who a slice belongs to now: the serving side, lent to training, or on its way back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum LoanState {
    /// A replica holds it, or any replica may take it (and training when free).
    #[default]
    Serving,
    /// Lent by a loanable deployment; only preemptible training ranks take it.
    Loaned,
    /// Demand returned: the ranks on it are being stopped, then a replica takes it back.
    Reclaiming,
}

impl LoanState {
    pub fn as_str(self) -> &'static str {
        match self {
            LoanState::Serving => "serving",
            LoanState::Loaned => "loaned",
            LoanState::Reclaiming => "reclaiming",
        }
    }

    pub fn parse(text: &str) -> Option<LoanState> {
        match text {
            "serving" => Some(LoanState::Serving),
            "loaned" => Some(LoanState::Loaned),
            "reclaiming" => Some(LoanState::Reclaiming),
            _ => None,
        }
    }
}

/// One scheduling round's count of the fleet's slices.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct LoanRound {
    pub at: DateTime<Utc>,
    /// Slices on the serving side (held by a replica or free).
    pub serving: u32,
    /// Slices lent to training.
    pub loaned: u32,
    pub reclaiming: u32,
    /// Slices a training rank holds (loaned or not).
    pub training: u32,
    /// Training jobs waiting for slices.
    pub waiting: u32,
}

/// A reclaim decision: the deployment whose demand returned and the job it hit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ReclaimEvent {
    pub at: DateTime<Utc>,
    pub deployment: String,
    /// The job hit; `None` when it is another user's (its name reads "another user's job").
    pub job_id: Option<Uuid>,
    pub job_name: String,
    /// Slices the job gave back.
    pub ranks: u32,
    /// Stopped and requeued (true), or only shrunk (false).
    pub preempted: bool,
    pub reason: String,
}

/// One change of a slice: its loan state, or a training rank taking or leaving it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SliceEvent {
    pub at: DateTime<Utc>,
    pub slice: String,
    /// `serving`, `loaned`, `reclaiming`, `training` (a rank took it) or `idle` (it left).
    pub state: String,
    pub detail: String,
}

/// A training job the scheduling round places on slices, as it saw it last.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct QueuedTraining {
    pub job_id: Uuid,
    pub name: String,
    /// `queued`, `running`, …
    pub state: String,
    /// Place in the queue: running jobs first, then waiting ones by predicted start (0
    /// runs or starts first).
    pub position: u32,
    /// Ranks it runs or will start with (an elastic job waiting: its minimum).
    pub ranks: u32,
    pub min_ranks: u32,
    pub max_ranks: u32,
    pub preemptible: bool,
    /// Predicted seconds of running left at `ranks` (waiting time not included), from its
    /// measured step times; `None` before any step was measured.
    pub predicted_secs: Option<f64>,
    /// When the round predicts it starts: its slices free as the jobs ahead end (ahead:
    /// running, or shorter); now when the round places it; after the restart pause when the
    /// round stops it to resize or move it. `None` while it runs on, or never fits.
    pub predicted_start_at: Option<DateTime<Utc>>,
    /// When it is predicted to finish at the ranks it runs or starts with; `None` when it
    /// asks for more slices than its pools hold (it starts only if the fleet grows).
    pub predicted_finish_at: Option<DateTime<Utc>>,
    /// Predicted job completion time: the predicted finish less its submission, seconds.
    /// The forecast assumes no job arrives, no loan changes and no elastic job grows after
    /// this round. `None` with `predicted_finish_at`.
    pub predicted_jct_secs: Option<f64>,
    /// What the prediction rests on; `None` for a plan stored before forecasts existed.
    pub predicted_from: Option<PredictedFrom>,
    pub note: String,
}

/// What a queue entry's predicted start and JCT rest on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum PredictedFrom {
    /// Its step times were measured, and so were those of every job whose end its start
    /// waits for.
    Measured,
    /// Some of those step times are the prior's (a job nothing was measured of borrows a
    /// measured peer's, else one second a step at one rank).
    Prior,
}

impl PredictedFrom {
    pub fn as_str(self) -> &'static str {
        match self {
            PredictedFrom::Measured => "measured",
            PredictedFrom::Prior => "prior",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "measured" => Some(PredictedFrom::Measured),
            "prior" => Some(PredictedFrom::Prior),
            _ => None,
        }
    }
}

/// `GET /api/v1/fleet/loaning`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct LoanOverview {
    /// Oldest first, the last hour at most.
    pub rounds: Vec<LoanRound>,
    /// Newest first.
    pub reclaims: Vec<ReclaimEvent>,
    /// Newest first.
    pub slice_events: Vec<SliceEvent>,
    pub queue: Vec<QueuedTraining>,
}
