//! Placement decisions made by pure algorithms over plain data: the MIG partition planner
//! and its transitions (`mig`), throughput tables with their cost model (`throughput`),
//! and placing a throughput SLO on the fleet's slices (`placement`); lending idle serving
//! capacity to training and growing elastic jobs (`loaning`, Aryl; not yet called by the
//! server: the simulator in bench/src/bin/aryl.rs drives it).

pub mod loaning;
pub mod mig;
pub mod placement;
pub mod throughput;
