//! What a model folder says about itself: the Hugging Face `config.json` of a BERT-family
//! encoder, and the sentence-transformers files that choose pooling, normalisation and the
//! input length limit (`modules.json`, `1_Pooling/config.json`, `sentence_bert_config.json`).

use super::error::EngineError;
use super::ops::Pooling;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

/// `config.json` of a BERT-family encoder (the fields candle-transformers' `bert::Config`
/// reads, plus the classification labels).
#[derive(Debug, Clone, Deserialize)]
pub struct EncoderConfig {
    #[serde(default)]
    pub model_type: Option<String>,
    #[serde(default)]
    pub architectures: Vec<String>,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    #[serde(default = "default_hidden_act")]
    pub hidden_act: String,
    pub max_position_embeddings: usize,
    #[serde(default = "default_type_vocab_size")]
    pub type_vocab_size: usize,
    #[serde(default = "default_layer_norm_eps")]
    pub layer_norm_eps: f64,
    #[serde(default)]
    pub position_embedding_type: Option<String>,
    /// Class index (as a string key, as transformers writes it) to label.
    #[serde(default)]
    pub id2label: Option<BTreeMap<String, String>>,
}

fn default_hidden_act() -> String {
    "gelu".into()
}
fn default_type_vocab_size() -> usize {
    2
}
fn default_layer_norm_eps() -> f64 {
    1e-12
}

impl EncoderConfig {
    pub fn from_file(path: &Path) -> Result<Self, EngineError> {
        let config: Self = read_json(path)?;
        config.validate(path)?;
        Ok(config)
    }

    fn validate(&self, path: &Path) -> Result<(), EngineError> {
        let model_type = self.model_type.as_deref().unwrap_or("bert");
        if model_type != "bert" {
            return Err(EngineError::Unsupported(format!(
                "model_type {model_type:?} (this engine runs BERT encoders)"
            )));
        }
        if self.hidden_act != "gelu" {
            return Err(EngineError::Unsupported(format!(
                "hidden_act {:?} (only exact \"gelu\")",
                self.hidden_act
            )));
        }
        if let Some(kind) = self.position_embedding_type.as_deref() {
            if kind != "absolute" {
                return Err(EngineError::Unsupported(format!(
                    "position_embedding_type {kind:?}"
                )));
            }
        }
        if self.num_attention_heads == 0
            || !self.hidden_size.is_multiple_of(self.num_attention_heads)
        {
            return Err(EngineError::InvalidModel {
                path: path.to_owned(),
                reason: format!(
                    "hidden_size {} is not a multiple of num_attention_heads {}",
                    self.hidden_size, self.num_attention_heads
                ),
            });
        }
        Ok(())
    }

    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    /// Labels in class order, `LABEL_i` where the config names none.
    pub fn labels(&self, num_classes: usize) -> Vec<String> {
        (0..num_classes)
            .map(|i| {
                self.id2label
                    .as_ref()
                    .and_then(|m| m.get(&i.to_string()).cloned())
                    .unwrap_or_else(|| format!("LABEL_{i}"))
            })
            .collect()
    }
}

/// The sentence-transformers pipeline around the encoder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SentenceConfig {
    pub pooling: Pooling,
    pub normalize: bool,
    /// `max_seq_length` from `sentence_bert_config.json`: sentence-transformers truncates
    /// to this, which can be shorter than the position table (256 of 512 for MiniLM).
    pub max_seq_length: Option<usize>,
}

impl Default for SentenceConfig {
    fn default() -> Self {
        Self {
            pooling: Pooling::Mean,
            normalize: false,
            max_seq_length: None,
        }
    }
}

#[derive(Deserialize)]
struct Module {
    #[serde(default)]
    path: String,
    #[serde(rename = "type")]
    kind: String,
}

#[derive(Deserialize)]
struct PoolingFile {
    #[serde(default)]
    pooling_mode_cls_token: bool,
    #[serde(default)]
    pooling_mode_mean_tokens: bool,
    #[serde(default)]
    pooling_mode_max_tokens: bool,
    #[serde(default)]
    pooling_mode_mean_sqrt_len_tokens: bool,
    #[serde(default)]
    pooling_mode_weightedmean_tokens: bool,
    #[serde(default)]
    pooling_mode_lasttoken: bool,
}

#[derive(Deserialize)]
struct SentenceBertFile {
    max_seq_length: Option<usize>,
}

impl SentenceConfig {
    /// Reads the sentence-transformers files of `dir`; a folder without `modules.json` gets
    /// mean pooling and no normalisation.
    pub fn from_dir(dir: &Path) -> Result<Self, EngineError> {
        let mut config = Self::default();
        let st_path = dir.join("sentence_bert_config.json");
        if st_path.is_file() {
            config.max_seq_length = read_json::<SentenceBertFile>(&st_path)?.max_seq_length;
        }
        let modules_path = dir.join("modules.json");
        if !modules_path.is_file() {
            return Ok(config);
        }
        let modules: Vec<Module> = read_json(&modules_path)?;
        for module in modules {
            match module.kind.rsplit('.').next().unwrap_or_default() {
                "Transformer" => {}
                "Normalize" => config.normalize = true,
                "Pooling" => {
                    // A folder inside the model's: a path with `..` or a root would read elsewhere.
                    let inside = Path::new(&module.path).components().all(|c| matches!(c, Component::Normal(_) | Component::CurDir));
                    if !inside {
                        return Err(EngineError::InvalidModel {
                            path: modules_path.clone(),
                            reason: format!("the Pooling module's path {:?} leaves the model folder", module.path),
                        });
                    }
                    let path = dir.join(&module.path).join("config.json");
                    config.pooling = pooling_mode(&path, read_json(&path)?)?;
                }
                other => {
                    return Err(EngineError::Unsupported(format!(
                        "sentence-transformers module {other} in {}",
                        modules_path.display()
                    )))
                }
            }
        }
        Ok(config)
    }
}

fn pooling_mode(path: &Path, file: PoolingFile) -> Result<Pooling, EngineError> {
    if file.pooling_mode_mean_sqrt_len_tokens
        || file.pooling_mode_weightedmean_tokens
        || file.pooling_mode_lasttoken
    {
        return Err(EngineError::Unsupported(format!(
            "pooling mode in {} (mean, cls and max are supported)",
            path.display()
        )));
    }
    match (
        file.pooling_mode_mean_tokens,
        file.pooling_mode_cls_token,
        file.pooling_mode_max_tokens,
    ) {
        (true, false, false) => Ok(Pooling::Mean),
        (false, true, false) => Ok(Pooling::Cls),
        (false, false, true) => Ok(Pooling::Max),
        (false, false, false) => Ok(Pooling::Mean),
        _ => Err(EngineError::Unsupported(format!(
            "several pooling modes at once in {}",
            path.display()
        ))),
    }
}

pub(crate) fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, EngineError> {
    let text = std::fs::read_to_string(path).map_err(|source| EngineError::Io {
        path: PathBuf::from(path),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| EngineError::InvalidModel {
        path: path.to_owned(),
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) {
        let path = dir.join(name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }

    #[test]
    fn reads_pooling_normalisation_and_length_from_sentence_transformers_files() {
        let dir = tempfile::tempdir().unwrap();
        write(
            dir.path(),
            "modules.json",
            r#"[{"idx":0,"name":"0","path":"","type":"sentence_transformers.models.Transformer"},
                {"idx":1,"name":"1","path":"1_Pooling","type":"sentence_transformers.models.Pooling"},
                {"idx":2,"name":"2","path":"2_Normalize","type":"sentence_transformers.models.Normalize"}]"#,
        );
        write(
            dir.path(),
            "1_Pooling/config.json",
            r#"{"pooling_mode_cls_token": true}"#,
        );
        write(
            dir.path(),
            "sentence_bert_config.json",
            r#"{"max_seq_length": 128}"#,
        );
        let config = SentenceConfig::from_dir(dir.path()).unwrap();
        assert_eq!(
            config,
            SentenceConfig {
                pooling: Pooling::Cls,
                normalize: true,
                max_seq_length: Some(128)
            }
        );
    }

    #[test]
    fn a_plain_transformers_folder_gets_mean_pooling_without_normalisation() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            SentenceConfig::from_dir(dir.path()).unwrap(),
            SentenceConfig::default()
        );
    }

    #[test]
    fn refuses_a_dense_module_rather_than_skipping_it() {
        let dir = tempfile::tempdir().unwrap();
        write(
            dir.path(),
            "modules.json",
            r#"[{"idx":0,"name":"0","path":"2_Dense","type":"sentence_transformers.models.Dense"}]"#,
        );
        assert!(matches!(
            SentenceConfig::from_dir(dir.path()),
            Err(EngineError::Unsupported(_))
        ));
    }

    #[test]
    fn refuses_a_pooling_path_that_leaves_the_model_folder() {
        let root = tempfile::tempdir().unwrap();
        write(root.path(), "elsewhere/config.json", r#"{"pooling_mode_cls_token": true}"#);
        let dir = root.path().join("model");
        let outside = root.path().join("elsewhere").display().to_string();
        for path in ["../elsewhere", outside.as_str()] {
            let modules = serde_json::json!([{"path": path, "type": "sentence_transformers.models.Pooling"}]);
            write(&dir, "modules.json", &modules.to_string());
            let refused = SentenceConfig::from_dir(&dir);
            assert!(matches!(refused, Err(EngineError::InvalidModel { .. })), "{path}: {refused:?}");
        }
    }
}
