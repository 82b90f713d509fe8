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
