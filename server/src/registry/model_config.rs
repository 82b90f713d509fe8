//! Reads a Hugging Face `config.json` and checks it against the uploaded weights and
//! tokenizer. Only encoder families the serving engine can run are accepted, and the sizes
//! found here feed memory planning, so they must agree with the weights.

use serde_json::{Map, Value};

use super::safetensors::TensorInfo;

/// What the registry keeps from `config.json`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelConfig {
    pub model_type: String,
    /// `architectures[0]` when present (e.g. `BertModel`), else the model type.
    pub architecture: String,
    pub hidden_size: u64,
    pub num_hidden_layers: u64,
    pub num_attention_heads: u64,
    pub vocab_size: u64,
    pub max_position_embeddings: u64,
    pub intermediate_size: u64,
    /// Number of entries in `id2label`, when the config has one.
    pub num_labels: Option<u64>,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(
        "config.json is not valid JSON ({detail}); upload the config.json saved with the model."
    )]
    NotJson { detail: String },
    #[error("config.json must be a JSON object; upload the config.json saved with the model.")]
    NotObject,
    #[error("config.json has no `model_type` string; the serving engine runs `model_type` {supported}.", supported = supported_types())]
    MissingModelType,
    #[error("config.json has `model_type` `{model_type}`, which the serving engine cannot run; it runs `model_type` {supported} only.", supported = supported_types())]
    UnsupportedModelType { model_type: String },
    #[error(
        "config.json has no `{key}`, which a {model_type} config must give as a positive integer."
    )]
    MissingSize {
        key: &'static str,
        model_type: String,
    },
    #[error("config.json gives `{key}` as {value}; it must be a positive integer.")]
    BadSize { key: &'static str, value: String },
    #[error("config.json has hidden size {hidden_size}, which is not divisible by its {num_attention_heads} attention heads; fix one of the two.")]
    HeadsDoNotDivide {
        hidden_size: u64,
        num_attention_heads: u64,
    },
    #[error("config.json has an `id2label` that is not an object of label names; make it map each label id to a name, or remove it.")]
    BadLabels,
    #[error("config.json's `architectures[0]` is over 200 characters or contains a control character; give the class name transformers saved, e.g. `BertModel`.")]
    BadArchitecture,
    #[error("config.json sets `{key}` to {value}; the serving engine runs `{supported}` only.")]
    UnsupportedSetting {
        key: &'static str,
        value: String,
        supported: &'static str,
    },
    #[error("The weights have no word-embedding tensor; expected one named {expected}.")]
    MissingEmbeddings { expected: String },
    #[error("Tensor `{tensor}` has shape {found:?} but config.json implies [vocab_size, hidden_size] = {expected:?}; upload the config.json that belongs to these weights.")]
    EmbeddingShape {
        tensor: String,
        found: Vec<u64>,
        expected: [u64; 2],
    },
    #[error("tokenizer.json could not be used: {detail}; upload the tokenizer.json saved with the model (the `tokenizers` format).")]
    Tokenizer { detail: String },
    #[error("The pooling config (`<N>_Pooling/config.json`) is not a JSON object ({detail}); upload the one sentence-transformers saved.")]
    PoolingNotJson { detail: String },
    #[error("The pooling config sets {found}; exactly one of `pooling_mode_mean_tokens`, `pooling_mode_cls_token` or `pooling_mode_max_tokens` must be true.")]
    PoolingMode { found: String },
}

/// Where a family keeps its sizes in `config.json` (DistilBERT, for one, says `dim`,
/// `n_layers` and `n_heads`).
struct SizeKeys {
    hidden_size: &'static str,
    num_hidden_layers: &'static str,
    num_attention_heads: &'static str,
}

const BERT_KEYS: SizeKeys = SizeKeys {
    hidden_size: "hidden_size",
    num_hidden_layers: "num_hidden_layers",
    num_attention_heads: "num_attention_heads",
};

/// An encoder family the serving engine runs.
struct Family {
    model_type: &'static str,
    sizes: SizeKeys,
    /// What `transformers` puts before the embeddings when the weights were saved from a
    /// task head wrapped around the bare model (`bert.` in `BertForSequenceClassification`).
    head_prefix: &'static str,
}

/// Exactly the `model_type`s the serving engine loads (`EncoderConfig::validate` in the
/// worker); a family registered here but not there would be accepted and then fail on
/// every replica. Adding a family the engine has learnt is a line here.
const FAMILIES: &[Family] = &[Family { model_type: "bert", sizes: BERT_KEYS, head_prefix: "bert." }];

const WORD_EMBEDDINGS: &str = "embeddings.word_embeddings.weight";

fn supported_types() -> String {
    quoted(FAMILIES.iter().map(|family| family.model_type))
}

fn family(model_type: &str) -> Option<&'static Family> {
    FAMILIES.iter().find(|family| family.model_type == model_type)
}

fn quoted<'a>(names: impl Iterator<Item = &'a str>) -> String {
    names
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Parses `config.json`, keeping the sizes under their BERT names whatever the family
/// calls them.
pub fn parse_config(bytes: &[u8]) -> Result<ModelConfig, ConfigError> {
    let value: Value = serde_json::from_slice(bytes).map_err(|e| ConfigError::NotJson {
        detail: e.to_string(),
    })?;
    let Value::Object(config) = value else {
        return Err(ConfigError::NotObject);
    };
    let Some(model_type) = config.get("model_type").and_then(Value::as_str) else {
        return Err(ConfigError::MissingModelType);
    };
    let Some(keys) = family(model_type).map(|family| &family.sizes) else {
        return Err(ConfigError::UnsupportedModelType {
            model_type: model_type.to_owned(),
        });
    };

    let size = |key: &'static str| positive_int(&config, key, model_type);
    let hidden_size = size(keys.hidden_size)?;
    let num_hidden_layers = size(keys.num_hidden_layers)?;
    let num_attention_heads = size(keys.num_attention_heads)?;
    let vocab_size = size("vocab_size")?;
    let max_position_embeddings = size("max_position_embeddings")?;
    let intermediate_size = size("intermediate_size")?;
    // The settings the engine runs one way of (`EncoderConfig::validate` in the worker).
    for (key, supported) in [("hidden_act", "gelu"), ("position_embedding_type", "absolute")] {
        match config.get(key) {
            None | Some(Value::Null) => {}
            Some(Value::String(value)) if value == supported => {}
            Some(value) => {
                let value = value.to_string().chars().take(100).collect();
                return Err(ConfigError::UnsupportedSetting { key, value, supported });
            }
        }
    }
    if hidden_size % num_attention_heads != 0 {
        return Err(ConfigError::HeadsDoNotDivide {
            hidden_size,
            num_attention_heads,
        });
    }

    let architecture = config
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(Value::as_str)
        .unwrap_or(model_type)
        .to_owned();
    // Kept as a column and shown back: a NUL would fail PostgreSQL's insert, an escape a terminal.
    if architecture.chars().count() > 200 || architecture.chars().any(char::is_control) {
        return Err(ConfigError::BadArchitecture);
    }
    let num_labels = match config.get("id2label") {
        None | Some(Value::Null) => None,
        Some(Value::Object(labels)) => Some(labels.len() as u64),
        Some(_) => return Err(ConfigError::BadLabels),
    };

    Ok(ModelConfig {
        model_type: model_type.to_owned(),
        architecture,
        hidden_size,
        num_hidden_layers,
        num_attention_heads,
        vocab_size,
        max_position_embeddings,
        intermediate_size,
        num_labels,
    })
}

fn positive_int(
    config: &Map<String, Value>,
    key: &'static str,
    model_type: &str,
) -> Result<u64, ConfigError> {
    match config.get(key) {
        None => Err(ConfigError::MissingSize {
            key,
            model_type: model_type.to_owned(),
        }),
        Some(value) => match value.as_u64() {
            Some(n) if n > 0 => Ok(n),
            _ => Err(ConfigError::BadSize {
                key,
                value: value.to_string(),
            }),
        },
    }
}

/// Checks that the word-embedding matrix has the shape the config promises. A mismatch
/// means config and weights come from different checkpoints, which would otherwise only
/// surface as a load failure on a worker.
pub fn check_weights(cfg: &ModelConfig, tensors: &[TensorInfo]) -> Result<(), ConfigError> {
    let prefixes = ["", family(&cfg.model_type).map_or("", |family| family.head_prefix)];
    let is_word_embeddings =
        |name: &str| prefixes.iter().any(|prefix| name.strip_prefix(prefix) == Some(WORD_EMBEDDINGS));
    let Some(tensor) = tensors.iter().find(|t| is_word_embeddings(&t.name)) else {
        let names: Vec<String> = prefixes.iter().map(|p| format!("{p}{WORD_EMBEDDINGS}")).collect();
        return Err(ConfigError::MissingEmbeddings {
            expected: quoted(names.iter().map(String::as_str)),
        });
    };
    let expected = [cfg.vocab_size, cfg.hidden_size];
    if tensor.shape != expected {
        return Err(ConfigError::EmbeddingShape {
            tensor: tensor.name.clone(),
            found: tensor.shape.clone(),
            expected,
        });
    }
    Ok(())
}

/// Loads `tokenizer.json` and encodes a short text once, which catches files that parse
/// but cannot run (e.g. a model section referring to a missing vocabulary). The file's
/// padding and truncation are set aside first, as the engine sets them aside: they are a
/// training setup, and a hostile one (padding to 10¹¹ tokens, a stride past the length)
/// would abort or panic the encode. A panic elsewhere in the tokenizer is a refusal too.
pub fn check_tokenizer(bytes: &[u8]) -> Result<(), ConfigError> {
    let refused = |detail: String| ConfigError::Tokenizer { detail };
    let encoded = std::panic::catch_unwind(|| {
        let mut tokenizer = tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| refused(e.to_string()))?;
        tokenizer.with_padding(None);
        tokenizer.with_truncation(None).map_err(|e| refused(e.to_string()))?;
        tokenizer.encode("hello world", true).map_err(|e| refused(e.to_string()))?;
        Ok(())
    });
    encoded.unwrap_or_else(|_| Err(refused("the tokenizer broke down encoding \"hello world\"".into())))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn assets() -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../.assets/all-MiniLM-L6-v2")
    }

    fn read_asset(name: &str) -> Option<Vec<u8>> {
        let path = assets().join(name);
        let bytes = std::fs::read(&path).ok();
        if bytes.is_none() {
            eprintln!("skipping: {} not present", path.display());
        }
        bytes
    }

    fn bert() -> Value {
        json!({
            "model_type": "bert",
            "architectures": ["BertForSequenceClassification"],
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "vocab_size": 100,
            "max_position_embeddings": 128,
            "intermediate_size": 256,
            "id2label": {"0": "NEGATIVE", "1": "NEUTRAL", "2": "POSITIVE"},
        })
    }

    fn parse(value: &Value) -> Result<ModelConfig, ConfigError> {
        parse_config(value.to_string().as_bytes())
    }

    fn with(mut value: Value, key: &str, field: Value) -> Value {
        value[key] = field;
        value
    }

    fn without(mut value: Value, key: &str) -> Value {
        if let Value::Object(map) = &mut value {
            map.remove(key);
        }
        value
    }

    fn tensor(name: &str, shape: &[u64]) -> TensorInfo {
        TensorInfo {
            name: name.into(),
            dtype: "F32".into(),
            shape: shape.to_vec(),
            data_offsets: (0, 0),
        }
    }

    #[test]
    fn accepts_bert_config() {
        let cfg = parse(&bert()).expect("valid config");
        assert_eq!(
            cfg,
            ModelConfig {
                model_type: "bert".into(),
                architecture: "BertForSequenceClassification".into(),
                hidden_size: 64,
                num_hidden_layers: 2,
                num_attention_heads: 4,
                vocab_size: 100,
                max_position_embeddings: 128,
                intermediate_size: 256,
                num_labels: Some(3),
            }
        );
    }

    #[test]
    fn architecture_falls_back_to_model_type_and_labels_are_optional() {
        let config = without(without(bert(), "architectures"), "id2label");
        let cfg = parse(&config).expect("valid config");
        assert_eq!(cfg.architecture, "bert");
        assert_eq!(cfg.num_labels, None);
    }

    #[test]
    fn refuses_encoder_families_the_engine_cannot_run() {
        // Well-formed configs of these families would register, then fail on every replica.
        for model_type in ["roberta", "xlm-roberta", "distilbert", "camembert"] {
            let err = parse(&with(bert(), "model_type", json!(model_type))).expect_err(model_type);
            assert!(
                matches!(&err, ConfigError::UnsupportedModelType { model_type: m } if m == model_type),
                "{err:?}"
            );
            let message = err.to_string();
            assert!(message.contains(&format!("`{model_type}`")) && message.contains("`bert`"), "{message}");
        }
    }

    #[test]
    fn rejects_non_json_and_non_object() {
        assert!(matches!(
            parse_config(b"{not json"),
            Err(ConfigError::NotJson { .. })
        ));
        assert!(matches!(
            parse_config(b"[1, 2]"),
            Err(ConfigError::NotObject)
        ));
    }

    #[test]
    fn rejects_missing_model_type() {
        let err = parse(&without(bert(), "model_type")).expect_err("no model_type");
        assert!(matches!(err, ConfigError::MissingModelType));
        assert!(err.to_string().contains("`bert`"));
    }

    #[test]
    fn rejects_unsupported_model_type_listing_supported_ones() {
        let err = parse(&with(bert(), "model_type", json!("gpt2"))).expect_err("gpt2");
        assert!(
            matches!(&err, ConfigError::UnsupportedModelType { model_type } if model_type == "gpt2")
        );
        let message = err.to_string();
        assert!(message.contains("`gpt2`") && message.contains("`bert`"), "{message}");
    }

    #[test]
    fn rejects_missing_zero_or_non_integer_sizes() {
        let err = parse(&without(bert(), "vocab_size")).expect_err("no vocab");
        assert!(matches!(
            err,
            ConfigError::MissingSize {
                key: "vocab_size",
                ..
            }
        ));
        for bad in [json!(0), json!(-4), json!(64.5), json!("64")] {
            let err = parse(&with(bert(), "hidden_size", bad.clone())).expect_err("bad size");
            assert!(
                matches!(
                    err,
                    ConfigError::BadSize {
                        key: "hidden_size",
                        ..
                    }
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn rejects_hidden_size_not_divisible_by_heads() {
        let err = parse(&with(bert(), "num_attention_heads", json!(5))).expect_err("64 % 5");
        assert!(matches!(
            err,
            ConfigError::HeadsDoNotDivide {
                hidden_size: 64,
                num_attention_heads: 5
            }
        ));
    }

    /// What the engine refuses to load is refused at upload, not on every replica after.
    #[test]
    fn rejects_settings_the_engine_does_not_run() {
        let err = parse(&without(bert(), "intermediate_size")).expect_err("no intermediate size");
        assert!(matches!(err, ConfigError::MissingSize { key: "intermediate_size", .. }), "{err:?}");
        for (key, value) in [("hidden_act", json!("relu")), ("position_embedding_type", json!("relative_key"))] {
            let err = parse(&with(bert(), key, value)).expect_err(key);
            assert!(matches!(err, ConfigError::UnsupportedSetting { key: found, .. } if found == key), "{err:?}");
        }
        let config = with(with(bert(), "hidden_act", json!("gelu")), "position_embedding_type", json!("absolute"));
        parse(&config).expect("the settings the engine runs");
    }

    #[test]
    fn rejects_an_architecture_with_a_control_character() {
        let long = "B".repeat(201);
        for name in ["Bert\u{0}Model", "BertModel\n", "\u{1b}[31mBertModel", &long] {
            let err = parse(&with(bert(), "architectures", json!([name]))).expect_err(name);
            assert!(matches!(err, ConfigError::BadArchitecture), "{name:?}: {err:?}");
            assert!(err.to_string().contains("architectures[0]"));
        }
    }

    #[test]
    fn rejects_id2label_that_is_not_an_object() {
        let err = parse(&with(bert(), "id2label", json!(["a", "b"]))).expect_err("list labels");
        assert!(matches!(err, ConfigError::BadLabels));
    }

    #[test]
    fn accepts_word_embeddings_with_or_without_model_prefix() {
        let cfg = parse(&bert()).expect("valid config");
        for name in ["embeddings.word_embeddings.weight", "bert.embeddings.word_embeddings.weight"] {
            let tensors = [
                tensor("pooler.dense.weight", &[64, 64]),
                tensor(name, &[100, 64]),
            ];
            check_weights(&cfg, &tensors).expect(name);
        }
    }

    #[test]
    fn rejects_weights_without_word_embeddings() {
        let cfg = parse(&bert()).expect("valid config");
        // Another family's prefix is not where the engine looks for a BERT's embeddings.
        for name in ["gpt.wte.weight", "roberta.embeddings.word_embeddings.weight"] {
            let err = check_weights(&cfg, &[tensor(name, &[100, 64])]).expect_err(name);
            assert!(matches!(err, ConfigError::MissingEmbeddings { .. }));
            assert!(err.to_string().contains("`bert.embeddings.word_embeddings.weight`"));
        }
    }

    #[test]
    fn rejects_word_embeddings_of_another_shape() {
        let cfg = parse(&bert()).expect("valid config");
        let tensors = [tensor(
            "bert.embeddings.word_embeddings.weight",
            &[30522, 384],
        )];
        let err = check_weights(&cfg, &tensors).expect_err("shape mismatch");
        let message = err.to_string();
        assert!(
            message.contains("[30522, 384]") && message.contains("[100, 64]"),
            "{message}"
        );
    }

    #[test]
    fn rejects_broken_tokenizer_with_its_error_text() {
        let err = check_tokenizer(b"{\"model\": 3}").expect_err("not a tokenizer");
        let ConfigError::Tokenizer { detail } = &err else {
            panic!("{err:?}")
        };
        assert!(!detail.is_empty());
        assert!(err.to_string().contains(detail.as_str()));
        assert!(check_tokenizer(b"\xff").is_err());
    }

    fn minimal_tokenizer() -> serde_json::Value {
        json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": [],
            "normalizer": null,
            "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": null,
            "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hello": 1, "world": 2}, "unk_token": "[UNK]"},
        })
    }

    #[test]
    fn accepts_minimal_word_level_tokenizer() {
        check_tokenizer(minimal_tokenizer().to_string().as_bytes()).expect("valid tokenizer");
    }

    /// Padding to 10¹¹ tokens would abort the process on its allocation, a stride past the
    /// truncation length panics: the check sets both aside, as the engine does.
    #[test]
    fn a_hostile_padding_or_truncation_setup_is_set_aside() {
        let mut padded = minimal_tokenizer();
        padded["padding"] = json!({"strategy": {"Fixed": 100_000_000_000u64}, "direction": "Right",
            "pad_to_multiple_of": null, "pad_id": 0, "pad_type_id": 0, "pad_token": "[UNK]"});
        check_tokenizer(padded.to_string().as_bytes()).expect("padding set aside");
        let mut truncated = minimal_tokenizer();
        truncated["truncation"] = json!({"max_length": 1, "stride": 1, "strategy": "LongestFirst", "direction": "Right"});
        check_tokenizer(truncated.to_string().as_bytes()).expect("truncation set aside");
    }

    #[test]
    fn accepts_real_minilm_config_and_tokenizer() {
        let (Some(config), Some(tokenizer)) =
            (read_asset("config.json"), read_asset("tokenizer.json"))
        else {
            return;
        };
        let cfg = parse_config(&config).expect("MiniLM config is valid");
        assert_eq!(cfg.architecture, "BertModel");
        assert_eq!(
            (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size),
            (384, 6, 30522)
        );
        check_tokenizer(&tokenizer).expect("MiniLM tokenizer is valid");
        check_weights(
            &cfg,
            &[tensor("embeddings.word_embeddings.weight", &[30522, 384])],
        )
        .expect("shapes agree");
    }
}
