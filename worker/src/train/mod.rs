//! The training engine: datasets into tensors, networks, optimizers with saveable state,
//! and the loop that trains under a learning-rate policy with checkpoints. Pure of I/O;
//! `jobs::train` connects it to the server.

pub mod checkpoint;
pub mod data;
pub mod hybrid;
pub mod loader;
pub mod lr;
pub mod model;
pub mod optim;
pub mod policy;
pub mod precision;
pub mod qsync;
pub mod rng;
pub mod session;
pub mod trainer;
