//! Trainable networks. A network owns its parameters as candle `Var`s under stable names
//! (the names its checkpoints use) and turns a batch of rows into outputs: class logits
//! `[batch, classes]` or regression predictions `[batch, 1]`.
//!
//! Per-operator precision (QSync): a network lists the operators a plan may name
//! (`precision_ops`) and runs each at the plan's precision (`set_precision`, checked against
//! the keep-list); its master weights stay f32 (`crate::train::precision`). A traced forward
//! (`forward_traced`) records each of those operators on the real batch, so the planner
//! can time it at every precision and read its tensors ([`OpTrace`]).

pub mod bert;
pub mod encoder;
pub mod fused;
pub mod mlp;

use candle_core::{Result, Tensor, Var};

use super::data::Examples;
use super::precision::{OpKind, PlanError, Precision, PrecisionPlan};

/// Reruns one operator on the input it read, at any precision, differentiably (its
/// weights are the network's own `Var`s), so both passes can be timed.
pub type Rerun = Box<dyn FnMut(Precision) -> Result<Tensor> + Send>;

/// One operator a precision plan may name, as a traced forward ran it.
pub struct OpTrace {
    pub name: String,
    pub kind: OpKind,
    /// What the operator read (detached); an embedding: the rows it gathered.
    pub input: Tensor,
    /// What it wrote, at the precision it ran at (detached).
    pub output: Tensor,
    /// The parameter whose gradient QSync's indicator reads (the network's own tensor, so
    /// a `GradStore` of the traced loss holds its gradient); `None` for a LayerNorm, whose
    /// indicator reads its input alone.
    pub weight: Option<Tensor>,
    /// The traced operator whose output this one reads as it is; `None` when it reads
    /// anything else (the batch, a residual sum, an activation).
    pub reads: Option<usize>,
    pub rerun: Rerun,
}

pub trait Network: Send {
    /// Outputs for `rows` of `examples`.
    fn forward(&self, examples: &Examples, rows: &[usize], train: bool) -> Result<Tensor>;

    /// Every trainable parameter with its checkpoint name, in a fixed order.
    fn parameters(&self) -> &[(String, Var)];

    /// [`Network::forward`] in training mode that also records every operator of
    /// `precision_ops`, in that order. None recorded by default.
    fn forward_traced(&self, examples: &Examples, rows: &[usize]) -> Result<(Tensor, Vec<OpTrace>)> {
        Ok((self.forward(examples, rows, true)?, Vec::new()))
    }

    /// How much work a forward over `rows` is, in the units its time grows with: the rows
    /// by default; a text model's tokens after padding (rows × the longest of them). The
    /// precision planner compares steps on batches of different sizes with it.
    fn batch_work(&self, examples: &Examples, rows: &[usize]) -> Result<usize> {
        let _ = examples;
        Ok(rows.len())
    }

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
