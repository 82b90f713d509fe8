//! Trainable networks. A network owns its parameters as candle `Var`s under stable names
//! (the names its checkpoints use) and turns a batch of rows into outputs: class logits
//! `[batch, classes]` or regression predictions `[batch, 1]`.
//!
//! Per-operator precision (QSync): a network lists the operators a plan may name
//! (`precision_ops`) and runs each at the plan's precision (`set_precision`, checked against
//! the keep-list); its master weights stay f32 (`crate::train::precision`).

pub mod bert;
pub mod encoder;
pub mod mlp;

use candle_core::{Result, Tensor, Var};

use super::data::Examples;
use super::precision::{OpKind, PlanError, PrecisionPlan};

pub trait Network: Send {
    /// Outputs for `rows` of `examples`.
    fn forward(&self, examples: &Examples, rows: &[usize], train: bool) -> Result<Tensor>;

    /// Every trainable parameter with its checkpoint name, in a fixed order.
    fn parameters(&self) -> &[(String, Var)];

    /// The operators a precision plan may name, with their kinds, in forward order.
    /// None by default: the network runs at f32 throughout.
    fn precision_ops(&self) -> Vec<(String, OpKind)> {
        Vec::new()
    }

    /// Runs each operator at the plan's precision from the next forward on (unnamed ones at
    /// f32); a plan that names an unknown operator or breaks the keep-list changes nothing.
    fn set_precision(&mut self, plan: &PrecisionPlan) -> std::result::Result<(), PlanError> {
        match plan.0.is_empty() {
            true => Ok(()),
            false => Err(PlanError::Unsupported),
        }
    }
}
