//! Data-parallel training (issue 12): the ranks a training job asks for, one rank's job
//! as a worker claims it, the rendezvous through the server that forms the gang, and the
//! timings each rank reports per step.
//!
//! A job with `"parallel": {"ranks": [...]}` runs as a gang: every rank is claimed, or
//! none is. The ranks all-reduce their gradients every step over a fixed global batch of
//! `batch_size` rows, each rank taking its own contiguous share of it. With
//! `"precision"` the ranks plan per-operator precision (QSync) after profiling: ranks slower
//! than the fastest run some operators at a lower precision so they keep pace. A list of
//! one rank is how a single-device job asks for a device or a MIG slice (issue 16: the
//! loaning round then places it like any gang).

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

use crate::precision::Precision;
use crate::train::{SpecError, TrainJob};

/// Ranks one job may ask for.
pub const MAX_RANKS: usize = 64;

/// `"parallel"` of a training spec.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ParallelSpec {
    /// One entry per rank, rank 0 first (rank 0 evaluates and checkpoints).
    pub ranks: Vec<RankSpec>,
    /// How the ranks choose per-operator precision; left out, every rank trains at f32.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precision: Option<PrecisionSpec>,
}

/// Profiled steps a precision plan may ask for.
pub const MAX_PROFILE_STEPS: u32 = 50;

/// `"parallel": {"precision": {"policy": "qsync", "low": "int8", "profile_steps": 8}}`: after
/// `profile_steps` steps at f32 every rank times each operator of the model at each
/// precision down to `low`, and rank 0 plans which operators each slower rank lowers
/// (`GET /api/v1/jobs/{id}/precision-plan` shows the plan).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PrecisionSpec {
    pub policy: PrecisionPolicy,
    /// The lowest precision an operator may take: `int8` (default) or `bf16`.
    #[serde(default = "PrecisionSpec::default_low")]
    pub low: Precision,
    /// Training steps at f32 before the plan (the operators are timed as often), 1 to 50.
    #[serde(default = "PrecisionSpec::default_profile_steps")]
    pub profile_steps: u32,
    /// Plan again when the ranks' speeds, measured under the plan, have drifted apart by
    /// more than this fraction of what the plan predicted (each rank's measured compute
    /// over its predicted; the largest of those ratios over the smallest, less 1), in two
    /// checks in a row, [`REPLAN_CHECK_STEPS`] steps apart; at most [`MAX_REPLANS`] times a
    /// run, and only while a new plan would run a check's worth of steps. 0 to 10, default
    /// 0.5; 0 keeps the first plan.
    #[serde(default = "PrecisionSpec::default_replan_drift")]
    pub replan_drift: f64,
}

/// Steps between two checks of the ranks' drift from the plan in force.
pub const REPLAN_CHECK_STEPS: u64 = 16;
/// Plans a run makes after its first, at most (`PrecisionSpec::replan_drift`).
pub const MAX_REPLANS: usize = 3;
/// The largest `replan_drift`.
pub const MAX_REPLAN_DRIFT: f64 = 10.0;

/// Which operators the slower ranks lower.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum PrecisionPolicy {
    /// QSync: the fewest, least sensitive operators (gradient-variance indicator) that let
    /// the rank keep pace with the fastest.
    Qsync,
    /// The ablation: QSync's search over indicator values shuffled with the job's seed.
    Random,
    /// Every operator the keep-list allows at `low` on every rank slower than the fastest.
    Uniform,
}

impl PrecisionSpec {
    fn default_low() -> Precision {
        Precision::Int8
    }

    /// Eight: enough for the planner to read the rest of a step as the median of the warm
    /// ones (`worker::train::hybrid::step_reading`), which predicted steps closer than the
    /// fastest of 3 or of 8 did on a shared 2-core host (`bench/results/qsync.md`).
    fn default_profile_steps() -> u32 {
        8
    }

    /// A half. In-process the predictor's error relative to a plan timed beside it stayed
    /// within 10% at p90 (`bench/results/qsync.md`), but two worker processes on a 2-core
    /// host beside other gangs (`tests/data_parallel.rs` in CI) drifted more than 25% apart
    /// in two checks in a row with nothing changed. A rank whose speed against the others
    /// changed by half is a changed device.
    fn default_replan_drift() -> f64 {
        0.5
    }

    fn validate(&self) -> Result<(), SpecError> {
        if !(0.0..=MAX_REPLAN_DRIFT).contains(&self.replan_drift) {
            return Err(SpecError::new(
                "parallel.precision.replan_drift",
                format!("must be 0 (keep the first plan) to {MAX_REPLAN_DRIFT}"),
            ));
        }
        if !matches!(self.low, Precision::Int8 | Precision::Bf16) {
            return Err(SpecError::new(
                "parallel.precision.low",
                "give \"int8\" or \"bf16\" (the training operators run f32, bf16 and int8)",
            ));
        }
        if !(1..=MAX_PROFILE_STEPS).contains(&self.profile_steps) {
            return Err(SpecError::new(
                "parallel.precision.profile_steps",
                format!("must be 1 to {MAX_PROFILE_STEPS}"),
            ));
        }
        Ok(())
    }
}

/// Where one rank runs: `{"device": "cpu", "threads": 4}`, `{"device": "cuda"}`, or
/// `{"slice": "1g.10gb"}` (a MIG slice of that profile).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RankSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<RankDevice>,
    /// CPU ranks: threads of the rank's matrix work (default: the host's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub threads: Option<u32>,
    /// A MIG profile (`1g.10gb`); the rank waits for a worker offering one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slice: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum RankDevice {
    Cpu,
    Cuda,
}

impl RankSpec {
    /// What a worker must offer to claim this rank: `cpu`, `cuda` or `slice:<profile>`.
    pub fn placement(&self) -> String {
        match (&self.device, &self.slice) {
            (_, Some(profile)) => format!("slice:{profile}"),
            (Some(RankDevice::Cuda), None) => "cuda".into(),
            _ => "cpu".into(),
        }
    }

    fn validate(&self, field: &str) -> Result<(), SpecError> {
        match (&self.device, &self.slice) {
            (Some(_), Some(_)) | (None, None) => {
                return Err(SpecError::new(field, "give either a device (\"cpu\" or \"cuda\") or a MIG slice profile"))
            }
            (None, Some(profile)) => {
                let valid = !profile.is_empty()
                    && profile.len() <= 32
                    && profile.chars().all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '+');
                if !valid {
                    return Err(SpecError::new(format!("{field}.slice"), "give a MIG profile such as \"1g.10gb\""));
                }
            }
            (Some(_), None) => {}
        }
        if let Some(threads) = self.threads {
            if self.device != Some(RankDevice::Cpu) {
                return Err(SpecError::new(format!("{field}.threads"), "only a CPU rank takes a thread count"));
            }
            if !(1..=1024).contains(&threads) {
                return Err(SpecError::new(format!("{field}.threads"), "must be 1 to 1024"));
            }
        }
        Ok(())
    }
}

impl ParallelSpec {
    /// Checks the ranks against the job's global batch (every rank needs rows of it).
    pub fn validate(&self, batch_size: u32) -> Result<(), SpecError> {
        // One rank is a single-device job that names its device or MIG slice: as a gang of
        // one it is placed like any other (on slices, by the loaning round).
        if !(1..=MAX_RANKS).contains(&self.ranks.len()) {
            return Err(SpecError::new(
                "parallel.ranks",
                format!("give 1 to {MAX_RANKS} ranks (one names the device or MIG slice a single-device job runs on)"),
            ));
        }
        for (i, rank) in self.ranks.iter().enumerate() {
            rank.validate(&format!("parallel.ranks[{i}]"))?;
        }
        if (batch_size as usize) < self.ranks.len() {
            return Err(SpecError::new(
                "batch_size",
                format!("the global batch must give each of the {} ranks at least one row", self.ranks.len()),
            ));
        }
        match &self.precision {
            Some(precision) => precision.validate(),
            None => Ok(()),
        }
    }
}

/// `JobSpec::TrainRank`: one rank of a data-parallel training job (the gang), as the
/// worker claiming it receives it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RankJob {
    /// The training job the rank belongs to (what users see; metrics and checkpoints are
    /// kept under it).
    pub gang: Uuid,
    pub rank: u32,
    pub world: u32,
    pub device: RankSpec,
    pub train: TrainJob,
    /// A rank added to a running gang that grows in place (issue 16): it prepares (data,
    /// model) before it posts at `…/regroup`, and loads the checkpoint the gang takes when
    /// it stops for the new world.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub joining: bool,
}

/// `POST /api/v1/agent/jobs/{id}/rendezvous`: where this rank accepts its ring neighbour's
/// connection for the all-reduce. Posted again (same address) to poll.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RendezvousRequest {
    /// `host:port`.
    pub address: String,
}

/// The rendezvous answer. A gang that does not form in time is released (every rank
/// back to the queue, no attempt spent): the server then answers 409, as for any lease
/// the worker lost.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "state", rename_all = "lowercase")]
pub enum RendezvousResponse {
    /// Not every rank is claimed and posted yet: ask again shortly.
    Waiting,
    /// Every rank is here. `peers[r]` is rank r's address; `generation` counts the gang's
    /// attempts, so ranks of an earlier attempt never connect to this one.
    Formed { generation: u32, peers: Vec<String> },
}

/// `POST /api/v1/agent/jobs/{id}/regroup`: a rank of a running gang that changes its world
/// in place (issue 16). A rank of the gang posts once it stopped at the step the ranks
/// agreed (after the heartbeat asked it to stop), a joining rank once it is ready to load
/// the checkpoint; both post again (same address) to poll.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RegroupRequest {
    /// Where this rank accepts its ring neighbour for the new world: `host:port`.
    pub address: String,
    /// The ring generation this rank last ran in (0 for a joining rank): a rank whose
    /// regroup formed since its last poll learns it from a newer one.
    #[serde(default)]
    pub generation: u32,
}

/// The regroup answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "state", rename_all = "lowercase")]
pub enum RegroupResponse {
    /// Not every rank of the new world has posted yet: ask again shortly.
    Waiting,
    /// The new world formed: this rank is `rank` of `world`, `peers[r]` is rank r's
    /// address and `generation` the ring's new generation. A joining rank loads the gang's
    /// latest checkpoint; the others go on from the step they stopped at.
    Formed { generation: u32, rank: u32, world: u32, peers: Vec<String> },
    /// This rank is not in the new world: it ends here (its row is gone).
    Leave,
    /// No regroup: the gang was asked to preempt (or its regroup was cancelled and became
    /// one). Report `preempted`, as a stopped rank does.
    Stop,
}

/// One rank's timing of one step (`GET /api/v1/jobs/{id}/metrics`, `ranks`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RankStep {
    pub rank: u32,
    pub step: u64,
    /// The whole step: forward, backward, all-reduce, optimizer.
    pub iter_ms: f64,
    /// Waiting for the slowest rank: from entering the all-reduce to the first bytes
    /// from the ring neighbour.
    pub wait_ms: f64,
    /// The rest of the all-reduce: transfers and sums.
    pub allreduce_ms: f64,
    /// What the precision planner predicted `iter_ms` to be under the plans in force (the
    /// synchronous step); absent without a plan (no `precision`, or still profiling).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted_ms: Option<f64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(json: serde_json::Value) -> ParallelSpec {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn ranks_name_a_device_or_a_slice() {
        let parallel = spec(
            serde_json::json!({"ranks": [{"device": "cpu", "threads": 1}, {"device": "cuda"}, {"slice": "1g.10gb"}]}),
        );
        parallel.validate(8).unwrap();
        let placements: Vec<String> = parallel.ranks.iter().map(RankSpec::placement).collect();
        assert_eq!(placements, ["cpu", "cuda", "slice:1g.10gb"]);
    }

    #[test]
    fn mistakes_name_the_rank_and_field() {
        let both = spec(serde_json::json!({"ranks": [{"device": "cpu"}, {"device": "cuda", "slice": "1g.10gb"}]}));
        assert_eq!(both.validate(8).unwrap_err().field, "parallel.ranks[1]");
        let threads = spec(serde_json::json!({"ranks": [{"device": "cpu"}, {"device": "cuda", "threads": 2}]}));
        assert_eq!(threads.validate(8).unwrap_err().field, "parallel.ranks[1].threads");
        let none = spec(serde_json::json!({"ranks": []}));
        assert_eq!(none.validate(8).unwrap_err().field, "parallel.ranks");
        spec(serde_json::json!({"ranks": [{"slice": "1g.10gb"}]})).validate(8).unwrap();
        let many = spec(serde_json::json!({"ranks": [{"device": "cpu"}, {"device": "cpu"}, {"device": "cpu"}]}));
        assert_eq!(many.validate(2).unwrap_err().field, "batch_size");
        let error = serde_json::from_value::<ParallelSpec>(serde_json::json!({"ranks": [{"gpu": 1}]})).unwrap_err();
        assert!(error.to_string().contains("gpu"), "{error}");
    }

    #[test]
    fn precision_defaults_to_int8_after_eight_profiled_steps() {
        let parallel = spec(serde_json::json!({
            "ranks": [{"device": "cpu"}, {"device": "cpu"}],
            "precision": {"policy": "qsync"}
        }));
        parallel.validate(8).unwrap();
        let precision = parallel.precision.unwrap();
        let expected =
            PrecisionSpec { policy: PrecisionPolicy::Qsync, low: Precision::Int8, profile_steps: 8, replan_drift: 0.5 };
        assert_eq!(precision, expected);
        let plain = spec(serde_json::json!({"ranks": [{"device": "cpu"}, {"device": "cpu"}]}));
        assert_eq!(plain.precision, None);
        assert!(!serde_json::to_string(&plain).unwrap().contains("precision"));
    }

    #[test]
    fn precision_mistakes_name_the_field() {
        let with = |precision: serde_json::Value| {
            spec(serde_json::json!({"ranks": [{"device": "cpu"}, {"device": "cpu"}], "precision": precision}))
        };
        let f32_low = with(serde_json::json!({"policy": "uniform", "low": "f32"})).validate(8).unwrap_err();
        assert_eq!(f32_low.field, "parallel.precision.low");
        assert!(f32_low.message.contains("bf16"), "{f32_low}");
        assert_eq!(
            with(serde_json::json!({"policy": "random", "low": "f16"})).validate(8).unwrap_err().field,
            "parallel.precision.low"
        );
        for steps in [0, 51] {
            let error = with(serde_json::json!({"policy": "qsync", "profile_steps": steps})).validate(8).unwrap_err();
            assert_eq!(error.field, "parallel.precision.profile_steps");
        }
        with(serde_json::json!({"policy": "random", "low": "bf16", "profile_steps": 50})).validate(8).unwrap();
        for drift in [-0.1, 10.5] {
            let error = with(serde_json::json!({"policy": "qsync", "replan_drift": drift})).validate(8).unwrap_err();
            assert_eq!(error.field, "parallel.precision.replan_drift");
        }
        with(serde_json::json!({"policy": "qsync", "replan_drift": 0})).validate(8).unwrap();
        let unknown = serde_json::from_value::<ParallelSpec>(serde_json::json!({
            "ranks": [{"device": "cpu"}, {"device": "cpu"}], "precision": {"policy": "qsync", "budget": 3}
        }))
        .unwrap_err();
        assert!(unknown.to_string().contains("budget"), "{unknown}");
        let policy = serde_json::from_value::<ParallelSpec>(serde_json::json!({
            "ranks": [{"device": "cpu"}, {"device": "cpu"}], "precision": {"policy": "fastest"}
        }))
        .unwrap_err();
        assert!(policy.to_string().contains("fastest"), "{policy}");
    }

    #[test]
    fn a_rendezvous_answer_is_tagged_by_state() {
        let formed = RendezvousResponse::Formed { generation: 2, peers: vec!["127.0.0.1:1".into()] };
        let json = serde_json::to_value(&formed).unwrap();
        assert_eq!(json, serde_json::json!({"state": "formed", "generation": 2, "peers": ["127.0.0.1:1"]}));
        assert_eq!(serde_json::to_value(RendezvousResponse::Waiting).unwrap(), serde_json::json!({"state": "waiting"}));
    }
}
