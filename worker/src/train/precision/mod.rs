//! Per-operator precision for training (QSync, Zhao et al., IPDPS'24, §III: a weaker device
//! runs some operators at lower precision so it keeps pace): a plan naming each operator's
//! precision, its check against QSync's keep-list, and the trainable linear layer at each
//! precision. The precisions, kinds and keep-list are `tessera_api::precision`'s.
//!
//! Master weights and gradients stay f32: an op casts or quantises its operands on the fly
//! and returns f32 (`linear`). A network lists the operators a plan may name
//! (`Network::precision_ops`: its linears by weight prefix, e.g.
//! `encoder.layer.3.attention.self.query`, plus the embeddings, LayerNorms and head) and
//! checks a plan against the keep-list before it runs (`Network::set_precision`).

#[cfg(feature = "cuda")]
mod cuda;
mod linear;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tessera_api::precision::KeepRule;
// One `Precision` and one `OpKind` in the tree: the wire types the planner uses. Their doc
// comments say what each precision computes and each kind's keep-list floor.
pub use tessera_api::precision::{OpKind, Precision};

pub use linear::linear;

/// The precisions the trainable operators implement, lowest first. f16 is not among them:
/// a plan asking for it is refused (`PlanError::Unimplemented`) and `linear` errors.
pub const IMPLEMENTED: [Precision; 3] = [Precision::Int8, Precision::Bf16, Precision::F32];

/// The lowest precision QSync's keep-list ([`KeepRule::qsync_defaults`]) allows an operator.
fn lowest(name: &str, kind: OpKind) -> Precision {
    KeepRule::floor(&KeepRule::qsync_defaults(), name, kind)
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
        PrecisionPlan(ops.iter().map(|(name, kind)| (name.clone(), precision.max(lowest(name, *kind)))).collect())
    }

    pub fn get(&self, op: &str) -> Precision {
        self.0.get(op).copied().unwrap_or(Precision::F32)
    }

    /// Checks the plan against a network's operators: every name known, every precision one
    /// the operators implement, none below its kind's lowest precision.
    pub fn check(&self, ops: &[(String, OpKind)]) -> Result<(), PlanError> {
        for (name, precision) in &self.0 {
            let Some((_, kind)) = ops.iter().find(|(op, _)| op == name) else {
                return Err(PlanError::UnknownOp(name.clone()));
            };
            if !IMPLEMENTED.contains(precision) {
                return Err(PlanError::Unimplemented { op: name.clone(), precision: *precision });
            }
            let lowest = lowest(name, *kind);
            if *precision < lowest {
                return Err(PlanError::BelowKeepList { op: name.clone(), precision: *precision, lowest });
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
    #[error("the precision plan puts '{op}' at {precision}, which the training operators do not implement; use int8, bf16 or f32")]
    Unimplemented { op: String, precision: Precision },
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
    fn rejects_precisions_the_operators_do_not_implement() {
        let plan = PrecisionPlan([("layer.0.query".to_string(), Precision::F16)].into_iter().collect());
        let err = plan.check(&ops()).unwrap_err();
        assert_eq!(err, PlanError::Unimplemented { op: "layer.0.query".into(), precision: Precision::F16 });
        assert!(err.to_string().contains("use int8, bf16 or f32"), "{err}");
        // A uniform f16 plan is refused too, rather than silently run at another precision.
        assert!(matches!(PrecisionPlan::uniform(&ops(), Precision::F16).check(&ops()), Err(PlanError::Unimplemented { .. })));
    }

    #[test]
    fn plans_are_plain_json_maps() {
        let plan: PrecisionPlan = serde_json::from_str(r#"{"layer.0.query": "int8", "embeddings": "bf16"}"#).unwrap();
        assert_eq!(plan.get("layer.0.query"), Precision::Int8);
        assert_eq!(serde_json::to_string(&plan).unwrap(), r#"{"embeddings":"bf16","layer.0.query":"int8"}"#);
    }
}
