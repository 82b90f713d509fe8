//! The inference engine: BERT-family encoders run padding-free on packed batches (every
//! sequence's tokens laid end to end, `cu_seqlens` marking the boundaries), producing
//! sentence embeddings or class logits. Batching, queues and HTTP live elsewhere and call
//! [`EmbeddingModel`] with a [`Batch`].
//!
//! The model code (`bert`, `layer`) is device-neutral candle; the fused kernels in `ops` are
//! candle `CustomOp`s with CPU implementations, to which a CUDA build adds `cuda_fwd`.

mod batch;
mod bert;
mod config;
mod error;
mod layer;
mod model;
pub mod ops;
pub mod synthetic;
mod weights;

pub use batch::Batch;
pub use config::{EncoderConfig, SentenceConfig};
pub use error::EngineError;
pub use model::{EmbeddingModel, LoadOptions, Prediction};
pub use ops::Pooling;
