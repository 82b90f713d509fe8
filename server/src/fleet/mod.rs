//! The fleet's GPU slices in the platform: what workers offer (`slices`), which replica
//! is bound to which slice, deployments sized by a throughput SLO (`slo`), and the
//! throughput tables the planner reads (`profiles`). The decisions themselves are pure
//! code in `scheduler::fleet`, `scheduler::mig` and `scheduler::throughput`.

pub mod profiles;
pub mod slices;
pub mod slo;
