//! Learning-rate policy: the fixed schedules, and AutoLRS (ICLR 2021), which tunes the
//! LR on the fly by Bayesian optimisation over stages. Pure code over plain data, no
//! tensors: the trainer asks for the LR of each step, or follows the AutoLRS
//! controller's actions (snapshot, try candidates, restore, train a stage).
//!
//! AutoLRS's parts, each with its choices and departures in its own doc comment:
//! [`gp`] (Matérn 5/2 GP with normalised targets and noise, skopt's hyper-parameters),
//! [`bayesopt`] (LCB with κ = 1e6 over log-LR, as the authors configure skopt),
//! [`smoothing`] and [`forecast`] (outlier passes, spline smoothing, `a·e^{bt} + c` fit
//! with `b = −e^β` by Nelder–Mead), and [`autolrs`] (the stage controller).

pub mod autolrs;
pub mod bayesopt;
pub mod forecast;
pub mod gp;
mod linalg;
mod nelder_mead;
pub mod schedule;
pub mod smoothing;

pub use autolrs::{Action, AutoLrs, AutoLrsConfig, AutoLrsError, Measure, Report};
pub use schedule::Schedule;

use serde::{Deserialize, Serialize};
use tessera_api::train::LrSchedule;

/// How a run's LR is decided: a fixed schedule, or the AutoLRS controller (whose state
/// belongs in the run's checkpoints).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum LrPlan {
    Fixed { schedule: Schedule },
    AutoLrs { tuner: AutoLrs },
}

impl LrPlan {
    /// `spec` must have passed `LrSchedule::validate`.
    pub fn from_spec(spec: &LrSchedule, max_steps: u64, seed: u64) -> LrPlan {
        match (
            Schedule::from_spec(spec, max_steps),
            AutoLrsConfig::from_spec(spec),
        ) {
            (Some(schedule), _) => LrPlan::Fixed { schedule },
            (None, Some(config)) => LrPlan::AutoLrs {
                tuner: AutoLrs::new(config, seed),
            },
            (None, None) => unreachable!("every LrSchedule is fixed or AutoLRS"),
        }
    }
}
