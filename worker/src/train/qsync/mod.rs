//! QSync's planner (Zhao et al., IPDPS'24): which operators a slower data-parallel rank runs
//! at lower precision so it keeps pace with the fast ranks. Pure code over plain data: the
//! caller profiles and measures, these modules rank and predict.
//!
//! - [`indicator`]: the gradient-variance indicator ω per operator and precision, from the
//!   job's real tensors, with depth weighting; and the seeded random ablation.
//! - [`profile`]: the harness that times each operator at each precision through a trait
//!   object, inside iteration-ordered rounds of all of them, and the least-squares cast
//!   model `t = a·numel + b`.
//! - [`replay`]: a rank's iteration timeline for any plan (forward, backward, casts) and the
//!   synchronous step across ranks with the bucketed all-reduce overlapping the backward.
//! - [`allocate`]: the greedy search that raises precision by indicator gain per unit of
//!   predicted cost within the fast rank's budget, with its trace.
//!
//! The wire types (plans, cost tables, cast models, the trace) are `tessera_api::precision`.

pub mod allocate;
pub mod indicator;
pub mod profile;
pub mod replay;

pub use allocate::{greedy, plan_rank, Allocation, Prediction, RankPlanRequest};
pub use indicator::{IndicatorConfig, Indicators, OpStats};
pub use profile::{
    fit_cast_model, measure_casts, profile_casts, profile_ops, CandleCasts, LinearFit, Pass,
    ProfileConfig, ProfiledCast, ProfiledOp, Statistic,
};
pub use replay::{
    replay_step, GradBucket, GraphOp, RankProfile, RankStep, RankTimeline, StepPrediction,
    TrainingGraph,
};

use tessera_api::precision::Precision;

/// Why a plan cannot be predicted or profiled: inputs that do not fit together. These are
/// the caller's mistakes (a cost table from another model, a cast never measured).
#[derive(Debug, thiserror::Error)]
pub enum QsyncError {
    #[error("operator `{op}` has no measured time at {precision}")]
    MissingTiming { op: String, precision: Precision },
    #[error("the cost table has no operator `{0}` of the training graph")]
    MissingOp(String),
    #[error(
        "operator `{0}` has no f32 timing; every operator must run at f32 (master weights are f32)"
    )]
    NoF32(String),
    #[error("no fitted cast from {from} to {to}")]
    MissingCast { from: Precision, to: Precision },
    #[error("the plan has {got} precisions for {expected} operators")]
    PlanLength { expected: usize, got: usize },
    #[error(
        "gradient bucket {bucket} names operator index {op}, past the graph's {ops} operators"
    )]
    BucketOp {
        bucket: usize,
        op: usize,
        ops: usize,
    },
    #[error("operator `{op}` reads the output of operator {input}, which does not come before it")]
    InputOrder { op: String, input: usize },
    #[error("rank {rank} does not exist ({ranks} ranks)")]
    NoRank { rank: usize, ranks: usize },
    #[error("indicator values for {got} operators, the graph has {expected}")]
    IndicatorLength { expected: usize, got: usize },
    #[error("a cast fit needs at least two distinct sizes, got {0} sample(s)")]
    TooFewSamples(usize),
    #[error("profiling `{op}` at {precision}: {source}")]
    Op {
        op: String,
        precision: Precision,
        source: candle_core::Error,
    },
    #[error("tensor statistics: {0}")]
    Tensor(#[from] candle_core::Error),
}
