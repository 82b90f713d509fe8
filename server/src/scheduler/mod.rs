//! Placement decisions made by pure algorithms over plain data. Today: the MIG partition
//! planner and its transitions (`mig`).

pub mod mig;
