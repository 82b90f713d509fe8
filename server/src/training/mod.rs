//! Training jobs on the server side: checking and resolving a submitted spec, the
//! metric series workers report (stored per step, read back downsampled), AutoLRS stage
//! records, checkpoints, and QSync precision plans. The training loop itself runs on the
//! worker.

pub mod checkpoints;
pub mod downsample;
pub mod lr_stages;
pub mod metrics;
pub mod precision;
pub mod routes;
pub mod spec;
