//! The fleet's GPU slices as the platform sees them: what workers offer (`slices`,
//! checked and given legal MIG starts before the store records them) and the throughput
//! tables the SLO planner reads (`profiles`). Deployments sized by a throughput SLO are
//! `deployments::slo`; the decisions themselves are pure code in `scheduler::placement`,
//! `scheduler::mig` and `scheduler::throughput`.

pub mod profiles;
pub mod slices;
