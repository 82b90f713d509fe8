//! Trainable networks. A network owns its parameters as candle `Var`s under stable names
//! (the names its checkpoints use) and turns a batch of rows into outputs: class logits
//! `[batch, classes]` or regression predictions `[batch, 1]`.
//!
//! QSync seam (per-layer precision): each layer's `forward` is the one place a precision
//! plan would cast the layer's weights and input (bf16/f16/QDQ-int8) while the master
//! weights here stay f32; nothing casts today, every layer runs in f32.

pub mod bert;
pub mod mlp;

use candle_core::{Result, Tensor, Var};

use super::data::Examples;

pub trait Network: Send {
    /// Outputs for `rows` of `examples`.
    fn forward(&self, examples: &Examples, rows: &[usize], train: bool) -> Result<Tensor>;

    /// Every trainable parameter with its checkpoint name, in a fixed order.
    fn parameters(&self) -> &[(String, Var)];
}
