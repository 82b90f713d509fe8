//! Serving replicas on this worker: each replica is a loaded model behind a batching
//! queue, reachable through the worker's one engine endpoint at `/replicas/{id}/…`.

pub mod batcher;
pub mod binding;
pub mod endpoint;
