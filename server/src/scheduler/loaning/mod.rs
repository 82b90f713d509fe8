//! Capacity loaning and elastic training, the pure part of Aryl (Li et al., "Aryl: An
//! Elastic Cluster Scheduler for Deep Learning", arXiv 2202.07896; EuroSys '23 as "Lyra"):
//! serving lends idle slices to training and takes them back at the least preemption cost,
//! waiting jobs start shortest-first, elastic jobs grow by a multiple-choice knapsack.
//! The paper's full text was not available (see `shared/research/mig_aryl.md` §3), so the
//! doc comments cite it by mechanism and mark where the code follows our own reading.
//!
//! Map: `capacity` (what a deployment may lend, with hysteresis) → `round` (one scheduling
//! round: `reclaim`, then `shortest_first`, then `elastic` over `knapsack`, valued from
//! `step_times`), and `forecast` (when each job of the plan starts and ends).

pub mod capacity;
pub mod elastic;
pub mod forecast;
pub mod knapsack;
pub mod reclaim;
pub mod round;
pub mod shortest_first;
pub mod step_times;

pub use capacity::{next_loan, Deployment, LoanPolicy, LoanState};
pub use forecast::{forecast, Forecast, Outlook};
pub use round::{plan_round, Job, Placement, Plan, Pool, ReclaimEvent, Round};
pub use step_times::StepTimes;
