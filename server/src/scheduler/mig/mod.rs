//! MIG-aware serving, the pure part: NVIDIA's MIG profiles and placement rules, the
//! partition planner of MIG-serving (Tan et al., "Serving DNN Models with Multi-Instance
//! GPUs: A Case of the Reconfigurable Machine Scheduling Problem", arXiv 2109.11067) with
//! an exact solver and a lower bound beside it, and safe transitions between layouts.
//! No I/O except in `input` (JSON) and `cli`; the rest are functions over plain data.
//! The paper's full text was not available (see `shared/research/mig_aryl.md`), so the doc
//! comments cite it by stage, not by section, and mark what follows the research note's
//! reading of it.
//!
//! Map: `catalog` (profiles) → `partition` (legal layouts of one GPU) → `plan` (problem
//! and answer) → `space` (the search space the planners share) → `greedy`, `genetic`,
//! `mcts`, `exact`, `bound`, `compact` → `planner` (running them) → `transition`
//! (getting there safely) → `input`/`cli`.

pub mod bound;
pub mod catalog;
pub mod cli;
pub mod compact;
pub mod exact;
pub mod genetic;
pub mod greedy;
pub mod input;
pub mod mcts;
pub mod partition;
pub mod plan;
pub mod planner;
mod simplex;
mod space;
pub mod transition;

pub use catalog::{GpuModel, Profile, ProfileId};
pub use partition::{arrange, enumerate_legal, enumerate_maximal, parse_partition, validate, PartitionError, Placed};
pub use plan::{Assigned, GpuLayout, Plan, PlanError, Problem, Service};
pub use planner::{best_homogeneous, plan, Algorithm, Homogeneous, Options, Outcome};
pub use transition::{plan_transition, replay, Demands, Step, Transition, TransitionError};
