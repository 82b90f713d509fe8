//! Reading a `model.safetensors` file through a memory map: each tensor is checked against the
//! shape the architecture expects and converted to the engine's element type (f32 on the CPU,
//! whatever the file holds; f32, f16 or bf16 on a GPU).

use super::error::EngineError;
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use std::path::{Path, PathBuf};

pub(crate) struct Weights {
    file: MmapedSafetensors,
    path: PathBuf,
    device: Device,
    dtype: DType,
}

impl Weights {
    pub fn open(path: &Path, device: &Device, dtype: DType) -> Result<Self, EngineError> {
        if !path.is_file() {
            return Err(EngineError::Io {
                path: path.to_owned(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
            });
        }
        // SAFETY: the map is read-only; the model folder must not be rewritten while the
        // engine loads from it (the registry writes new versions to new folders).
        let file = unsafe { MmapedSafetensors::new(path) }.map_err(|e| self_invalid(path, e))?;
        Ok(Self {
            file,
            path: path.to_owned(),
            device: device.clone(),
            dtype,
        })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.file.get(name).is_ok()
    }

    /// The shape of tensor `name` as stored.
    pub fn shape(&self, name: &str) -> Result<Vec<usize>, EngineError> {
        self.file
            .get(name)
            .map(|view| view.shape().to_vec())
            .map_err(|_| self.missing(name))
    }

    fn missing(&self, name: &str) -> EngineError {
        EngineError::InvalidModel {
            path: self.path.clone(),
            reason: format!("missing tensor {name}"),
        }
    }

    /// The tensor `name` in the engine's element type, which must have exactly `shape`.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor, EngineError> {
        let view = self.file.get(name).map_err(|_| self.missing(name))?;
        if view.shape() != shape {
            return Err(EngineError::InvalidModel {
                path: self.path.clone(),
                reason: format!("tensor {name} is {:?}, expected {shape:?}", view.shape()),
            });
        }
        let tensor = self
            .file
            .load(name, &self.device)
            .map_err(|e| self_invalid(&self.path, e))?;
        match tensor.dtype() {
            DType::F32 | DType::F16 | DType::BF16 | DType::F64 => Ok(tensor.to_dtype(self.dtype)?),
            other => Err(EngineError::InvalidModel {
                path: self.path.clone(),
                reason: format!("tensor {name} has dtype {other:?}; expected a float type"),
            }),
        }
    }
}

fn self_invalid(path: &Path, e: candle_core::Error) -> EngineError {
    EngineError::InvalidModel {
        path: path.to_owned(),
        reason: e.to_string(),
    }
}
