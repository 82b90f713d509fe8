//! A model being received: its files land in temp blobs (from a multipart upload or a
//! folder on disk), then the whole set is validated before anything is registered.

use std::collections::BTreeMap;
use std::path::Path;

use axum::extract::multipart::Field;
use axum::extract::Multipart;
use tokio::io::AsyncReadExt;

use super::blobs::{BlobStore, TempBlob};
use super::model_config::{self, ModelConfig};
use super::model_files::{self, ModelFile, Pooling};
use super::safetensors;
use crate::error::{Error, Result};
use crate::multipart::{MultipartLimit, MAX_TEXT_FIELD_BYTES};

pub struct StagedFile {
    pub role: ModelFile,
    pub blob: TempBlob,
    pub digest: String,
}

/// Files by path, plus the `name` the client gave.
pub struct Staged {
    pub name: Option<String>,
    pub files: BTreeMap<String, StagedFile>,
    budget: u64,
}

/// What validation learnt about an accepted model.
pub struct Validated {
    pub config: ModelConfig,
    pub pooling: Option<Pooling>,
}

const TOO_LARGE: &str = "The model is larger than this server's upload limit (TESSERA_MAX_UPLOAD_BYTES).";

/// Takes `bytes` from what an upload may still send; `too_large` is the 413's sentence.
fn spend(budget: &mut u64, bytes: usize, too_large: &str) -> Result<()> {
    *budget = budget.checked_sub(bytes as u64).ok_or_else(|| Error::PayloadTooLarge(too_large.into()))?;
    Ok(())
}

/// Streams one multipart part into a temp blob, hashing as it goes and stopping with a
/// 413 once `budget` is spent. Shared by every upload (models, datasets, checkpoints);
/// the blob is deleted if the caller drops it without committing it.
pub async fn stream_to_blob(
    field: &mut Field<'_>,
    blobs: &BlobStore,
    budget: &mut u64,
    too_large: &str,
) -> Result<(TempBlob, String)> {
    let mut blob = blobs.begin().await?;
    while let Some(chunk) = field.chunk().await? {
        spend(budget, chunk.len(), too_large)?;
        blob.write(&chunk).await?;
    }
    let digest = blob.finish().await?;
    Ok((blob, digest))
}

/// Reads a text field (`name`, `step`) of at most [`MAX_TEXT_FIELD_BYTES`]; a longer
/// one is a 413 as soon as it passes the limit, before the parser holds the rest.
pub async fn read_text(field: &mut Field<'_>) -> Result<String> {
    let name = field.name().unwrap_or_default().to_string();
    let mut bytes = Vec::new();
    while let Some(chunk) = field.chunk().await? {
        if bytes.len() + chunk.len() > MAX_TEXT_FIELD_BYTES {
            return Err(Error::PayloadTooLarge(MultipartLimit::TextField { field: name }.to_string()));
        }
        bytes.extend_from_slice(&chunk);
    }
    String::from_utf8(bytes)
        .map_err(|_| Error::BadRequest(format!("The text field '{name}' is not valid UTF-8; send it as UTF-8 text.")))
}

fn invalid(message: impl Into<String>) -> Error {
    Error::invalid("invalid_model", message)
}

impl Staged {
    pub fn new(max_bytes: u64) -> Staged {
        Staged { name: None, files: BTreeMap::new(), budget: max_bytes }
    }

    pub fn size_bytes(&self) -> u64 {
        self.files.values().map(|f| f.blob.size()).sum()
    }

    fn check_new_path(&self, path: &str) -> Result<ModelFile> {
        let role = model_files::check_path(path).map_err(|e| invalid(e.to_string()))?;
        if self.files.contains_key(path) {
            return Err(invalid(format!("The file '{path}' was sent twice; send each file once.")));
        }
        Ok(role)
    }

    fn spend(&mut self, bytes: usize) -> Result<()> {
        spend(&mut self.budget, bytes, TOO_LARGE)
    }

    /// Reads `multipart/form-data`: a text field `name` and one `files` part per file,
    /// whose filename is the path inside the model folder. Parts stream to disk.
    pub async fn receive(multipart: &mut Multipart, blobs: &BlobStore, max_bytes: u64) -> Result<Staged> {
        let mut staged = Staged::new(max_bytes);
        while let Some(mut field) = multipart.next_field().await? {
            match field.name() {
                Some("name") => {
                    let text = read_text(&mut field).await?;
                    staged.name = Some(text.trim().to_string());
                }
                Some("files") => {
                    let path = field.file_name().map(str::to_string).ok_or_else(|| {
                        Error::BadRequest("Each 'files' part needs a filename: the file's path in the model folder.".into())
                    })?;
                    let role = staged.check_new_path(&path)?;
                    let (blob, digest) = stream_to_blob(&mut field, blobs, &mut staged.budget, TOO_LARGE).await?;
                    staged.files.insert(path, StagedFile { role, blob, digest });
                }
                other => {
                    return Err(Error::BadRequest(format!(
                        "Unexpected form field {:?}; send a text field 'name' and file parts named 'files'.",
                        other.unwrap_or("")
                    )))
                }
            }
        }
        Ok(staged)
    }

    /// Stages every allowed file of a model folder on disk; returns the paths skipped
    /// because a model folder may not hold them (READMEs of other tools, git files, …).
    pub async fn from_dir(dir: &Path, blobs: &BlobStore, max_bytes: u64) -> Result<(Staged, Vec<String>)> {
        let mut staged = Staged::new(max_bytes);
        let mut skipped = Vec::new();
        for relative in walk(dir)? {
            let Ok(role) = staged.check_new_path(&relative) else {
                skipped.push(relative);
                continue;
            };
            let mut source = tokio::fs::File::open(dir.join(&relative)).await?;
            let mut blob = blobs.begin().await?;
            let mut buffer = vec![0u8; 1 << 20];
            loop {
                let n = source.read(&mut buffer).await?;
                if n == 0 {
                    break;
                }
                staged.spend(n)?;
                blob.write(&buffer[..n]).await?;
            }
            let digest = blob.finish().await?;
            staged.files.insert(relative, StagedFile { role, blob, digest });
        }
        Ok((staged, skipped))
    }

    /// Checks the set of files as one model: required files present, weights, config,
    /// tokenizer and pooling readable and consistent with each other.
    pub fn validate(&self) -> Result<Validated> {
        let missing: Vec<&str> =
            model_files::REQUIRED.iter().copied().filter(|p| !self.files.contains_key(*p)).collect();
        if !missing.is_empty() {
            return Err(invalid(format!(
                "The model is missing {}; a model needs {}.",
                missing.join(", "),
                model_files::REQUIRED.join(", ")
            )));
        }
        let read = |path: &str| read_capped(path, &self.files[path]);
        let config = model_config::parse_config(&read("config.json")?).map_err(|e| invalid(e.to_string()))?;
        let mut weights = std::fs::File::open(self.files["model.safetensors"].blob.path())?;
        let tensors = safetensors::validate(&mut weights).map_err(|e| match e {
            safetensors::SafetensorsError::Io(io) => Error::Io(io),
            over @ (safetensors::SafetensorsError::HeaderOverBudget { .. }
            | safetensors::SafetensorsError::EntryOverBudget { .. }) => Error::PayloadTooLarge(over.to_string()),
            other => invalid(other.to_string()),
        })?;
        model_config::check_weights(&config, &tensors).map_err(|e| invalid(e.to_string()))?;
        model_config::check_tokenizer(&read("tokenizer.json")?).map_err(|e| invalid(e.to_string()))?;
        // The engine pools one way; sentence-transformers would chain several modules.
        let poolings: Vec<&str> =
            self.files.iter().filter(|(_, f)| f.role == ModelFile::Pooling).map(|(p, _)| p.as_str()).collect();
        if poolings.len() > 1 {
            return Err(invalid(format!(
                "A model folder holds at most one pooling config; this one has {}. Keep the one modules.json names.",
                poolings.join(", ")
            )));
        }
        let mut pooling = None;
        for (path, file) in &self.files {
            if file.role == ModelFile::Pooling {
                let bytes = read_capped(path, file)?;
                pooling = Some(model_files::parse_pooling(&bytes).map_err(|e| invalid(format!("{path}: {e}")))?);
            }
        }
        // The engine follows modules.json to the pooling config, and refuses what it cannot run.
        if self.files.contains_key("modules.json") {
            let folder = poolings.first().and_then(|path| path.strip_suffix("/config.json"));
            model_files::check_modules(&read("modules.json")?, folder).map_err(invalid)?;
        }
        if self.files.contains_key("sentence_bert_config.json") {
            model_files::check_sentence_config(&read("sentence_bert_config.json")?).map_err(invalid)?;
        }
        Ok(Validated { config, pooling })
    }
}

/// The most bytes of a model's JSON file that validation reads whole: the tokenizer
/// (real ones run to some 30 MB), and every other (a config is a few KB).
const TOKENIZER_MAX_BYTES: u64 = 64 << 20;
const CONFIG_MAX_BYTES: u64 = 1 << 20;

/// A staged JSON file's bytes, refused with a 413 past its cap rather than read whole into
/// memory (the upload budget alone would let one config take gigabytes).
fn read_capped(path: &str, file: &StagedFile) -> Result<Vec<u8>> {
    let cap = if path == "tokenizer.json" { TOKENIZER_MAX_BYTES } else { CONFIG_MAX_BYTES };
    if file.blob.size() > cap {
        return Err(Error::PayloadTooLarge(format!(
            "{path} is {} bytes; a model's {path} may have at most {cap} bytes.",
            file.blob.size()
        )));
    }
    Ok(std::fs::read(file.blob.path())?)
}

/// Relative paths of every regular file under `dir`, with `/` separators.
fn walk(dir: &Path) -> Result<Vec<String>> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(current) = stack.pop() {
        for entry in std::fs::read_dir(&current)? {
            let entry = entry?;
            let kind = entry.file_type()?;
            if kind.is_dir() {
                stack.push(entry.path());
            } else if kind.is_file() {
                let relative = entry.path().strip_prefix(dir).expect("walked under dir").to_path_buf();
                let parts: Vec<String> = relative.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
                out.push(parts.join("/"));
            }
        }
    }
    out.sort();
    Ok(out)
}
