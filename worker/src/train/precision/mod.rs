//! Per-operator precision for training (QSync, Zhao et al., IPDPS'24, §III: a weaker device
//! runs some operators at lower precision so it keeps pace): the precisions, a plan naming
//! each operator's, QSync's keep-list, and the trainable linear layer at each precision.
//!
//! Master weights and gradients stay f32: an op casts or quantises its operands on the fly
//! and returns f32 (`linear`). A network lists the operators a plan may name
//! (`Network::precision_ops`: its linears by weight prefix, e.g.
//! `encoder.layer.3.attention.self.query`, plus the embeddings, LayerNorms and head) and
//! checks a plan against the keep-list before it runs (`Network::set_precision`).

mod linear;

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

pub use linear::linear;

/// What an operator computes in, lowest first (so `max` is "the more precise").
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Symmetric per-tensor int8 forward (int8 GEMM, i32 sums, dequantised to f32); the
    /// backward at bf16 from the saved quantised input.
    Int8,
    /// Operands rounded to bf16, sums in f32, forward and backward.
    Bf16,
    F32,
}

impl Precision {
    pub const ALL: [Precision; 3] = [Precision::Int8, Precision::Bf16, Precision::F32];

    pub fn bits(self) -> u32 {
        match self {
            Precision::Int8 => 8,
            Precision::Bf16 => 16,
            Precision::F32 => 32,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Precision::Int8 => "int8",
            Precision::Bf16 => "bf16",
            Precision::F32 => "f32",
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The kind of an operator a plan may name, which sets the lowest precision it may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpKind {
    /// A dense layer (`x Wᵀ + b`): any precision.
    Linear,
    /// Token, position and type embeddings: 16-bit or more.
    Embedding,
    /// LayerNorm: 16-bit or more.
    LayerNorm,
    /// The task head (classifier or regressor): always f32.
    Head,
}

impl OpKind {
    /// QSync's keep-list (`qsync/LpTorch`: normalisation and embeddings never go to int8, the
    /// classifier stays f32).
    pub fn lowest(self) -> Precision {
        match self {
            OpKind::Linear => Precision::Int8,
            OpKind::Embedding | OpKind::LayerNorm => Precision::Bf16,
            OpKind::Head => Precision::F32,
        }
    }
}

/// A per-operator precision plan: operator name → precision. Operators it does not name run
/// at f32, so the empty plan is all-f32.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct PrecisionPlan(pub BTreeMap<String, Precision>);

impl PrecisionPlan {
    /// Every operator in `ops` at `precision`, or at its kind's lowest where that is higher
    /// (so "uniform int8" keeps the LayerNorms at bf16 and the head at f32).
    pub fn uniform(ops: &[(String, OpKind)], precision: Precision) -> PrecisionPlan {
        PrecisionPlan(ops.iter().map(|(name, kind)| (name.clone(), precision.max(kind.lowest()))).collect())
    }

    pub fn get(&self, op: &str) -> Precision {
        self.0.get(op).copied().unwrap_or(Precision::F32)
    }

    /// Checks the plan against a network's operators: every name known, none below its
    /// kind's lowest precision.
    pub fn check(&self, ops: &[(String, OpKind)]) -> Result<(), PlanError> {
        for (name, precision) in &self.0 {
            let Some((_, kind)) = ops.iter().find(|(op, _)| op == name) else {
                return Err(PlanError::UnknownOp(name.clone()));
            };
            if *precision < kind.lowest() {
                return Err(PlanError::BelowKeepList {
                    op: name.clone(),
                    precision: *precision,
                    lowest: kind.lowest(),
                });
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("the precision plan names '{0}', which is not an operator of this network")]
    UnknownOp(String),
    #[error("the precision plan puts '{op}' at {precision}, below {lowest}, the lowest its kind may run at")]
    BelowKeepList { op: String, precision: Precision, lowest: Precision },
    #[error("this network has no per-operator precision; use an empty plan")]
    Unsupported,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ops() -> Vec<(String, OpKind)> {
        vec![
            ("embeddings".into(), OpKind::Embedding),
            ("layer.0.query".into(), OpKind::Linear),
            ("layer.0.norm".into(), OpKind::LayerNorm),
            ("head".into(), OpKind::Head),
        ]
    }

    #[test]
    fn uniform_plans_respect_the_keep_list() {
        let plan = PrecisionPlan::uniform(&ops(), Precision::Int8);
        assert_eq!(plan.get("embeddings"), Precision::Bf16);
        assert_eq!(plan.get("layer.0.query"), Precision::Int8);
        assert_eq!(plan.get("layer.0.norm"), Precision::Bf16);
        assert_eq!(plan.get("head"), Precision::F32);
        assert_eq!(plan.check(&ops()), Ok(()));
        assert_eq!(PrecisionPlan::default().get("layer.0.query"), Precision::F32);
    }

    #[test]
    fn rejects_unknown_ops_and_precisions_below_the_keep_list() {
        let plan = |op: &str, p| PrecisionPlan([(op.to_string(), p)].into_iter().collect());
        assert_eq!(
            plan("layer.9.query", Precision::Bf16).check(&ops()),
            Err(PlanError::UnknownOp("layer.9.query".into()))
        );
        for (op, p) in [("embeddings", Precision::Int8), ("layer.0.norm", Precision::Int8), ("head", Precision::Bf16)] {
            assert!(matches!(plan(op, p).check(&ops()), Err(PlanError::BelowKeepList { .. })), "{op} at {p}");
        }
        assert_eq!(plan("head", Precision::F32).check(&ops()), Ok(()));
    }

    #[test]
    fn plans_are_plain_json_maps() {
        let plan: PrecisionPlan = serde_json::from_str(r#"{"layer.0.query": "int8", "embeddings": "bf16"}"#).unwrap();
        assert_eq!(plan.get("layer.0.query"), Precision::Int8);
        assert_eq!(serde_json::to_string(&plan).unwrap(), r#"{"embeddings":"bf16","layer.0.query":"int8"}"#);
    }
}
