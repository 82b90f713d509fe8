//! Wire types shared by the Tessera server, the worker and API clients.
//!
//! Everything that crosses a process boundary (REST bodies, the worker protocol, job
//! specs) is defined once here so the two binaries cannot drift apart.

pub mod accounts;
pub mod datasets;
pub mod deployments;
pub mod elastic;
pub mod engine;
pub mod error;
pub mod jobs;
pub mod loaning;
pub mod mig;
pub mod models;
pub mod parallel;
pub mod precision;
pub mod train;
pub mod workers;
