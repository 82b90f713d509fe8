//! Per-operator precision plans of hybrid data-parallel training (QSync): the precisions an
//! operator can run at, what each rank measured (its cost table and fitted cast model), the
//! plan the allocator chose per rank with its indicator values, and the allocator's trace.
//! `GET /api/v1/jobs/{id}/precision-plan` returns a [`PrecisionPlanReport`].

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// The precision an operator computes in. Master weights and the all-reduced gradients stay
/// f32 whatever the plan; an int8 operator dequantises its output to f32 and runs its
/// backward at 16 bits, as QSync does.
///
/// Ordered from least to most accurate (`Int8 < Bf16 < F16 < F32`): bf16 keeps 7 mantissa
/// bits, f16 10, so "raising" an operator's precision walks this order.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, ToSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Symmetric per-tensor int8 forward (int8 GEMM, i32 sums, dequantised to f32); the
    /// backward at 16 bits (the worker's CPU ops: bf16) from the saved quantised input.
    Int8,
    /// Operands rounded to bf16, sums in f32, forward and backward.
    Bf16,
    /// Operands rounded to IEEE f16, sums in f32. The planner and profiler know it; the
    /// worker's trainable operators (`train::precision`) refuse it.
    F16,
    F32,
}

impl Precision {
    pub const ALL: [Precision; 4] = [
        Precision::Int8,
        Precision::Bf16,
        Precision::F16,
        Precision::F32,
    ];

    /// Bits of one element.
    pub fn bits(self) -> u32 {
        match self {
            Precision::Int8 => 8,
            Precision::Bf16 | Precision::F16 => 16,
            Precision::F32 => 32,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Precision::Int8 => "int8",
            Precision::Bf16 => "bf16",
            Precision::F16 => "f16",
            Precision::F32 => "f32",
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What an operator is, for the indicator's formula (weighted or single-input) and the
/// keep-list ([`KeepRule::qsync_defaults`] sets the lowest precision each kind may take).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum OpKind {
    /// A GEMM with a weight (`x Wᵀ + b`): the encoder's projections and feed-forward
    /// layers. Any precision.
    Linear,
    /// Token, position and type embeddings: 16-bit or more.
    Embedding,
    /// LayerNorm: 16-bit or more.
    LayerNorm,
    /// Single-input operators without weights (GELU, softmax, …).
    Activation,
    /// The task head (classifier or regressor): always f32.
    Head,
}

/// Which operators a [`KeepRule`] covers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum OpSelector {
    Kind(OpKind),
    /// One operator by its name in the cost table.
    Name(String),
}

/// A floor on an operator's precision: the allocator never plans the operators it selects
/// below `at_least`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct KeepRule {
    pub select: OpSelector,
    pub at_least: Precision,
}

impl KeepRule {
    /// QSync's keep-list (`qsync/LpTorch`: normalisation and embeddings never go to int8,
    /// the head stays f32): LayerNorm and embeddings at 16 bits or more, the head at f32.
    pub fn qsync_defaults() -> Vec<KeepRule> {
        vec![
            KeepRule {
                select: OpSelector::Kind(OpKind::LayerNorm),
                at_least: Precision::Bf16,
            },
            KeepRule {
                select: OpSelector::Kind(OpKind::Embedding),
                at_least: Precision::Bf16,
            },
            KeepRule {
                select: OpSelector::Kind(OpKind::Head),
                at_least: Precision::F32,
            },
        ]
    }

    /// Whether this rule covers the operator `name` of kind `kind`.
    pub fn selects(&self, name: &str, kind: OpKind) -> bool {
        match &self.select {
            OpSelector::Kind(k) => *k == kind,
            OpSelector::Name(n) => n == name,
        }
    }

    /// The lowest precision `rules` allow the operator `name` of kind `kind`: the highest
    /// floor among the rules that cover it, int8 when none does.
    pub fn floor(rules: &[KeepRule], name: &str, kind: OpKind) -> Precision {
        rules
            .iter()
            .filter(|rule| rule.selects(name, kind))
            .map(|rule| rule.at_least)
            .max()
            .unwrap_or(Precision::Int8)
    }
}

/// One operator's measured time at one precision on one rank, milliseconds (median of
/// the profiled steps).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct OpTiming {
    pub precision: Precision,
    pub forward_ms: f64,
    pub backward_ms: f64,
}

/// One operator of the job's model as a rank profiled it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct OpCost {
    pub op: String,
    pub kind: OpKind,
    /// One entry per precision the rank can run this operator at.
    pub timings: Vec<OpTiming>,
}

/// What one rank measured: every operator at every precision on the job's real shapes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CostTable {
    /// The rank's device in words (`cpu:4 threads`, `cuda:0 H100`, a MIG profile).
    pub device: String,
    /// In the model's forward order.
    pub ops: Vec<OpCost>,
    /// Per-iteration time outside the profiled operators (data, loss), milliseconds. With
    /// the operators' times, at the rank's typical batch (a worker scales what it measured
    /// on the traced batch by the profiled batches' median work).
    #[serde(default)]
    pub overhead_ms: f64,
    /// The optimizer step after the all-reduce, milliseconds.
    #[serde(default)]
    pub optimizer_ms: f64,
    /// The operators' times already include casting their inputs and weights (they take
    /// f32 and cast inside), so the predictor adds no separate casts.
    #[serde(default)]
    pub casts_in_op_time: bool,
}

/// A fitted cast cost `t = a·numel + b` (QSync's casting model) with its fit quality.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CastFit {
    pub from: Precision,
    pub to: Precision,
    /// Milliseconds per element.
    pub ms_per_element: f64,
    /// Fixed milliseconds per cast.
    pub fixed_ms: f64,
    /// Coefficient of determination of the least-squares fit over the samples.
    pub r2: f64,
    pub samples: u32,
}

/// The casts one rank measured.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CastModel {
    pub fits: Vec<CastFit>,
}

/// One operator of a rank's plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct PlannedOp {
    pub op: String,
    pub kind: OpKind,
    pub precision: Precision,
    /// The indicator ω at the chosen precision (0 at f32): the gradient variance the
    /// precision adds, weighted by the operator's depth.
    pub indicator: f64,
}

/// One step of the allocator's search: raising one operator's precision by one level.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct AllocationStep {
    pub op: String,
    pub from: Precision,
    pub to: Precision,
    /// How much the indicator drops: ω(from) − ω(to).
    pub gain: f64,
    /// How much the raise adds to the rank's predicted iteration time, milliseconds.
    pub cost_ms: f64,
    /// The predicted synchronous step time after the raise, milliseconds.
    pub predicted_ms: f64,
    /// The plan includes this raise (the plan is the search's longest prefix within budget).
    pub accepted: bool,
}

/// Which indicator ranked the operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum IndicatorKind {
    /// QSync's gradient-variance indicator with depth weighting.
    GradientVariance,
    /// The ablation: the same values shuffled across operators with a seed.
    Random { seed: u64 },
}

/// The plan of one rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RankPlan {
    pub rank: u32,
    pub device: String,
    pub ops: Vec<PlannedOp>,
    /// The rank's own predicted iteration time (forward, backward, casts), milliseconds.
    pub predicted_ms: f64,
    /// Sum of the indicator over the rank's operators.
    pub indicator_sum: f64,
}

/// `GET /api/v1/jobs/{id}/precision-plan`: what each rank measured, what the allocator
/// chose, and how it got there.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct PrecisionPlanReport {
    pub indicator: IndicatorKind,
    pub cost_tables: Vec<CostTable>,
    pub cast_models: Vec<CastModel>,
    pub ranks: Vec<RankPlan>,
    /// The step time the slow rank had to stay within, milliseconds.
    pub budget_ms: f64,
    /// The predicted synchronous step time of the chosen plans, milliseconds.
    pub predicted_step_ms: f64,
    /// Measured median step time once the job runs, milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured_step_ms: Option<f64>,
    pub trace: Vec<AllocationStep>,
    /// The run's earlier plans, oldest first, each dropped when the ranks' speeds drifted
    /// apart from its prediction (`parallel.precision.replan_drift`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replaced: Vec<ReplacedPlan>,
}

/// A plan the run dropped, and the drift it was dropped for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ReplacedPlan {
    /// The step after which the ranks went back to f32 to profile again.
    pub step: u64,
    /// Per rank, by rank: the compute the plan predicted for a typical batch, ms.
    pub predicted_ms: Vec<f64>,
    /// Per rank: the median compute measured under it in the last check's steps, scaled to
    /// that typical batch, ms.
    pub measured_ms: Vec<f64>,
    /// Per rank: how many of its operators the plan ran below f32.
    pub lowered: Vec<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precisions_order_by_accuracy_and_serialise_lowercase() {
        assert!(Precision::Int8 < Precision::Bf16);
        assert!(Precision::Bf16 < Precision::F16);
        assert!(Precision::F16 < Precision::F32);
        assert_eq!(serde_json::to_string(&Precision::Bf16).unwrap(), "\"bf16\"");
        let rule: KeepRule =
            serde_json::from_str(r#"{"select":{"kind":"layer_norm"},"at_least":"f16"}"#).unwrap();
        assert_eq!(rule.select, OpSelector::Kind(OpKind::LayerNorm));
        assert_eq!(rule.at_least, Precision::F16);
    }

    #[test]
    fn floors_take_the_highest_rule_that_covers_an_operator() {
        let defaults = KeepRule::qsync_defaults();
        assert_eq!(KeepRule::floor(&defaults, "q", OpKind::Linear), Precision::Int8);
        assert_eq!(KeepRule::floor(&defaults, "gelu", OpKind::Activation), Precision::Int8);
        assert_eq!(KeepRule::floor(&defaults, "emb", OpKind::Embedding), Precision::Bf16);
        assert_eq!(KeepRule::floor(&defaults, "norm", OpKind::LayerNorm), Precision::Bf16);
        assert_eq!(KeepRule::floor(&defaults, "head", OpKind::Head), Precision::F32);
        let mut rules = defaults;
        rules.push(KeepRule {
            select: OpSelector::Name("q".into()),
            at_least: Precision::F16,
        });
        assert_eq!(KeepRule::floor(&rules, "q", OpKind::Linear), Precision::F16);
        assert_eq!(KeepRule::floor(&rules, "k", OpKind::Linear), Precision::Int8);
    }
}
