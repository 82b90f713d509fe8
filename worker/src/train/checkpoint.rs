//! Checkpoint files: `model.safetensors` (the network's parameters under their names, so
//! the weights load anywhere), `optimizer.safetensors` (optimizer moments, plus the
//! AutoLRS stage snapshot when a stage is under way) and `state.json` (step, optimizer
//! step count, loader position with its RNG, the LR policy's own state).

use std::collections::HashMap;

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

use super::loader::LoaderPosition;
use super::optim::OptimizerState;
use super::trainer::Snapshot;

pub const MODEL_FILE: &str = "model.safetensors";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const STATE_FILE: &str = "state.json";

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint file {0} is missing")]
    MissingFile(&'static str),
    #[error("checkpoint tensor {0} is missing")]
    MissingTensor(String),
    #[error("checkpoint state.json is invalid: {0}")]
    State(#[from] serde_json::Error),
    #[error("checkpoint tensors: {0}")]
    Tensor(#[from] candle_core::Error),
    #[error("checkpoint serialisation: {0}")]
    Safetensors(#[from] safetensors::SafeTensorError),
}

/// Where a snapshot's non-tensor parts go in `state.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotState {
    pub optimizer_steps: u64,
    pub loader: LoaderPosition,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointState {
    /// Training steps done (search steps included).
    pub step: u64,
    pub current: SnapshotState,
    /// The AutoLRS stage's starting point, when the checkpoint falls inside a stage.
    #[serde(default)]
    pub stage: Option<SnapshotState>,
    /// The LR policy's state, as its module serialises it.
    pub lr_policy: serde_json::Value,
}

/// A checkpoint in memory: the files, by name.
#[derive(Debug, Clone)]
pub struct CheckpointFiles {
    pub step: u64,
    pub files: Vec<(&'static str, Vec<u8>)>,
}

/// What a checkpoint restores: the current state, the stage snapshot, the LR policy state.
#[derive(Debug, Clone)]
pub struct Restored {
    pub step: u64,
    pub current: Snapshot,
    pub stage: Option<Snapshot>,
    pub lr_policy: serde_json::Value,
}

fn serialize(tensors: Vec<(String, Tensor)>) -> Result<Vec<u8>, CheckpointError> {
    Ok(safetensors::serialize(tensors, None)?)
}

pub fn encode(
    step: u64,
    parameter_names: &[String],
    moment_names: &[String],
    current: &Snapshot,
    stage: Option<&Snapshot>,
    lr_policy: serde_json::Value,
) -> Result<CheckpointFiles, CheckpointError> {
    let named = |prefix: &str, names: &[String], tensors: &[Tensor]| -> Vec<(String, Tensor)> {
        names.iter().zip(tensors).map(|(n, t)| (format!("{prefix}{n}"), t.clone())).collect()
    };
    let model = serialize(named("", parameter_names, &current.parameters))?;
    let mut optimizer = named("", moment_names, &current.optimizer.moments);
    if let Some(stage) = stage {
        optimizer.extend(named("stage.", parameter_names, &stage.parameters));
        optimizer.extend(named("stage.", moment_names, &stage.optimizer.moments));
    }
    let part = |s: &Snapshot| SnapshotState { optimizer_steps: s.optimizer.steps, loader: s.loader.clone() };
    let state = CheckpointState { step, current: part(current), stage: stage.map(part), lr_policy };
    Ok(CheckpointFiles {
        step,
        files: vec![
            (MODEL_FILE, model),
            (OPTIMIZER_FILE, serialize(optimizer)?),
            (STATE_FILE, serde_json::to_vec_pretty(&state)?),
        ],
    })
}

pub fn decode(
    files: &HashMap<String, Vec<u8>>,
    parameter_names: &[String],
    moment_names: &[String],
    device: &Device,
) -> Result<Restored, CheckpointError> {
    let file = |name: &'static str| files.get(name).ok_or(CheckpointError::MissingFile(name));
    let state: CheckpointState = serde_json::from_slice(file(STATE_FILE)?)?;
    let model = candle_core::safetensors::load_buffer(file(MODEL_FILE)?, device)?;
    let optimizer = candle_core::safetensors::load_buffer(file(OPTIMIZER_FILE)?, device)?;
    let take =
        |map: &HashMap<String, Tensor>, prefix: &str, names: &[String]| -> Result<Vec<Tensor>, CheckpointError> {
            names
                .iter()
                .map(|n| {
                    map.get(&format!("{prefix}{n}"))
                        .cloned()
                        .ok_or_else(|| CheckpointError::MissingTensor(format!("{prefix}{n}")))
                })
                .collect()
        };
    let current = Snapshot {
        parameters: take(&model, "", parameter_names)?,
        optimizer: OptimizerState {
            steps: state.current.optimizer_steps,
            moments: take(&optimizer, "", moment_names)?,
        },
        loader: state.current.loader.clone(),
    };
    let stage = match &state.stage {
        Some(stage) => Some(Snapshot {
            parameters: take(&optimizer, "stage.", parameter_names)?,
            optimizer: OptimizerState {
                steps: stage.optimizer_steps,
                moments: take(&optimizer, "stage.", moment_names)?,
            },
            loader: stage.loader.clone(),
        }),
        None => None,
    };
    Ok(Restored { step: state.step, current, stage, lr_policy: state.lr_policy })
}
