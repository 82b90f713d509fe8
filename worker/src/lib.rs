//! tessera-worker: registers this host's devices with the server, heartbeats, leases
//! jobs and runs them.

pub mod agent;
pub mod cache;
pub mod client;
pub mod collective;
pub mod engine;
pub mod inventory;
pub mod jobs;
pub mod memory;
pub mod serve;
pub mod slices;
pub mod train;
