//! Which relative paths an uploaded model folder may contain, and what each file is for.
//! Paths come straight from the client, so anything that could escape the model's folder
//! or that the engine would never read is refused before it touches the disk.

use serde_json::Value;

use super::model_config::ConfigError;

/// Files every model upload must include.
pub const REQUIRED: &[&str] = &["config.json", "model.safetensors", "tokenizer.json"];

/// Longer paths than this are refused; no allowed name comes close.
const MAX_PATH_LEN: usize = 255;

/// The role an allowed file plays in a model folder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelFile {
    /// `config.json`: architecture and sizes.
    Config,
    /// `model.safetensors`.
    Weights,
    /// `tokenizer.json` and the files older tokenizers are built from.
    Tokenizer,
    /// `<N>_Pooling/config.json` from sentence-transformers.
    Pooling,
    /// Kept for people and tools, not read by the engine.
    Other,
}

/// Exact names allowed at the top of a model folder, besides `<N>_Pooling/config.json`.
pub const ALLOWED: &[(&str, ModelFile)] = &[
    ("config.json", ModelFile::Config),
    ("model.safetensors", ModelFile::Weights),
    ("tokenizer.json", ModelFile::Tokenizer),
    ("tokenizer_config.json", ModelFile::Tokenizer),
    ("special_tokens_map.json", ModelFile::Tokenizer),
    ("vocab.txt", ModelFile::Tokenizer),
    ("merges.txt", ModelFile::Tokenizer),
    ("sentencepiece.bpe.model", ModelFile::Tokenizer),
    ("added_tokens.json", ModelFile::Tokenizer),
    ("modules.json", ModelFile::Other),
    ("sentence_bert_config.json", ModelFile::Other),
    ("config_sentence_transformers.json", ModelFile::Other),
    ("README.md", ModelFile::Other),
];

#[derive(Debug, thiserror::Error)]
pub enum PathError {
    #[error("A file in the model upload has an empty path; give each file its path inside the model folder, e.g. `config.json`.")]
    Empty,
    #[error("A path in the model upload is {len} bytes long, more than the {MAX_PATH_LEN} allowed; model files must use the standard names, e.g. `config.json`.")]
    TooLong { len: usize },
    #[error("The path `{path}` contains a control character; use one of the allowed model file names: {allowed}.", allowed = allowed_names())]
    ControlChar { path: String },
    #[error("The path `{path}` contains a backslash; separate folders with `/`, e.g. `1_Pooling/config.json`.")]
    Backslash { path: String },
    #[error("The path `{path}` is absolute; give the path relative to the model folder, e.g. `config.json`.")]
    Absolute { path: String },
    #[error("The path `{path}` has an empty, `.` or `..` segment; give a plain path inside the model folder, e.g. `1_Pooling/config.json`.")]
    BadSegment { path: String },
    #[error("`{path}` is not a file a model folder may contain; the allowed files are {allowed}.", allowed = allowed_names())]
    NotAllowed { path: String },
}

fn allowed_names() -> String {
    let mut names: Vec<String> = ALLOWED
        .iter()
        .map(|(name, _)| format!("`{name}`"))
        .collect();
    names.push("`<N>_Pooling/config.json`".to_owned());
    names.join(", ")
}

/// Checks one client-supplied path and says what the file is for.
pub fn check_path(path: &str) -> Result<ModelFile, PathError> {
    let owned = || path.to_owned();
    if path.is_empty() {
        return Err(PathError::Empty);
    }
    // Checked before any error echoes the path back, so messages and logs never carry a
    // NUL or a terminal escape.
    if path.chars().any(char::is_control) {
        return Err(PathError::ControlChar {
            path: path.escape_default().to_string(),
        });
    }
    if path.len() > MAX_PATH_LEN {
        return Err(PathError::TooLong { len: path.len() });
    }
    // Backslashes are separators on Windows and would let `..\x` or `C:\x` slip past the
    // `/` checks below if the path were ever joined there.
    if path.contains('\\') {
        return Err(PathError::Backslash { path: owned() });
    }
    if path.starts_with('/') {
        return Err(PathError::Absolute { path: owned() });
    }
    if path
        .split('/')
        .any(|segment| matches!(segment, "" | "." | ".."))
    {
        return Err(PathError::BadSegment { path: owned() });
    }

    if let Some((_, role)) = ALLOWED.iter().find(|(name, _)| *name == path) {
        return Ok(*role);
    }
    if is_pooling_config(path) {
        return Ok(ModelFile::Pooling);
    }
    Err(PathError::NotAllowed { path: owned() })
}

/// `<N>_Pooling/config.json`, the folder name sentence-transformers gives its pooling
/// module (N is the module's index in `modules.json`).
fn is_pooling_config(path: &str) -> bool {
    let Some(folder) = path.strip_suffix("/config.json") else {
        return false;
    };
    let Some(index) = folder.strip_suffix("_Pooling") else {
        return false;
    };
    !index.is_empty() && index.bytes().all(|b| b.is_ascii_digit())
}

/// How token vectors become one sentence vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    Mean,
    Cls,
    Max,
}

/// Modes the engine implements, by their sentence-transformers key.
const POOLING_MODES: &[(&str, Pooling)] = &[
    ("pooling_mode_mean_tokens", Pooling::Mean),
    ("pooling_mode_cls_token", Pooling::Cls),
    ("pooling_mode_max_tokens", Pooling::Max),
];

/// Reads a sentence-transformers pooling config. Exactly one supported mode must be on;
/// sentence-transformers would concatenate several, which the engine does not do, and a
/// mode it does not implement (e.g. `pooling_mode_mean_sqrt_len_tokens`) is refused
/// rather than silently replaced.
pub fn parse_pooling(bytes: &[u8]) -> Result<Pooling, ConfigError> {
    let value: Value = serde_json::from_slice(bytes).map_err(|e| ConfigError::PoolingNotJson {
        detail: e.to_string(),
    })?;
    let Value::Object(config) = value else {
        return Err(ConfigError::PoolingNotJson {
            detail: "found a JSON value that is not an object".into(),
        });
    };
    let enabled: Vec<&str> = config
        .iter()
        .filter(|(key, on)| key.starts_with("pooling_mode_") && on.as_bool() == Some(true))
        .map(|(key, _)| key.as_str())
        .collect();
    let found = if enabled.is_empty() {
        "no pooling mode".to_owned()
    } else {
        enabled
            .iter()
            .map(|k| format!("`{k}`"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    match enabled.as_slice() {
        [only] => POOLING_MODES
            .iter()
            .find(|(key, _)| key == only)
            .map(|(_, mode)| *mode)
            .ok_or(ConfigError::PoolingMode { found }),
        _ => Err(ConfigError::PoolingMode { found }),
    }
}

/// The sentence-transformers modules the engine runs, by the last part of their type.
const MODULES: &[&str] = &["Transformer", "Pooling", "Normalize"];

/// Checks `modules.json` as the engine reads it: a list of modules of the kinds it runs,
/// a Pooling one naming the folder of the uploaded pooling config (`pooling_folder`, e.g.
/// `1_Pooling`), so the pooling recorded here is the one every replica uses.
pub fn check_modules(bytes: &[u8], pooling_folder: Option<&str>) -> Result<(), String> {
    #[derive(serde::Deserialize)]
    struct Module {
        #[serde(default)]
        path: String,
        #[serde(rename = "type")]
        kind: String,
    }
    let modules: Vec<Module> = serde_json::from_slice(bytes).map_err(|e| {
        format!("modules.json is not a list of modules with a `type` each ({e}); upload the one sentence-transformers saved.")
    })?;
    for module in &modules {
        let kind = module.kind.rsplit('.').next().unwrap_or_default();
        if !MODULES.contains(&kind) {
            return Err(format!(
                "modules.json names the module `{}`; the serving engine runs {} modules only.",
                module.kind.chars().take(100).collect::<String>(),
                MODULES.join(", ")
            ));
        }
        if kind == "Pooling" && Some(module.path.trim_end_matches('/')) != pooling_folder {
            return Err(format!(
                "modules.json puts its Pooling module at `{}`, but the upload's pooling config is {}; upload the \
                 `<N>_Pooling/config.json` it names.",
                module.path.chars().take(100).collect::<String>(),
                pooling_folder.map_or("missing".to_string(), |f| format!("`{f}/config.json`"))
            ));
        }
    }
    Ok(())
}

/// Checks `sentence_bert_config.json` as the engine reads it: an object whose
/// `max_seq_length`, when given, is a whole number of tokens.
pub fn check_sentence_config(bytes: &[u8]) -> Result<(), String> {
    let fix = "upload the sentence_bert_config.json sentence-transformers saved";
    let value: Value = serde_json::from_slice(bytes).map_err(|e| format!("sentence_bert_config.json is not JSON ({e}); {fix}."))?;
    match value.get("max_seq_length") {
        _ if !value.is_object() => Err(format!("sentence_bert_config.json is not a JSON object; {fix}.")),
        None | Some(Value::Null) => Ok(()),
        Some(length) if length.as_u64().is_some() => Ok(()),
        Some(length) => Err(format!("sentence_bert_config.json gives `max_seq_length` as {length}; it must be a whole number.")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modules_json_may_name_only_modules_the_engine_runs_and_the_uploaded_pooling() {
        let minilm = br#"[{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]"#;
        check_modules(minilm, Some("1_Pooling")).expect("MiniLM's modules");
        let refused = |bytes: &[u8], folder: Option<&str>| check_modules(bytes, folder).expect_err("refused");
        assert!(refused(minilm, None).contains("pooling config is missing"));
        assert!(refused(minilm, Some("2_Pooling")).contains("`2_Pooling/config.json`"));
        let outside = br#"[{"path": "../../etc", "type": "sentence_transformers.models.Pooling"}]"#;
        assert!(refused(outside, Some("1_Pooling")).contains("../../etc"));
        let dense = br#"[{"path": "2_Dense", "type": "sentence_transformers.models.Dense"}]"#;
        assert!(refused(dense, None).contains("Dense"));
        assert!(refused(b"{}", None).contains("not a list"));
    }

    #[test]
    fn sentence_bert_config_needs_a_whole_max_seq_length() {
        check_sentence_config(br#"{"max_seq_length": 256, "do_lower_case": false}"#).expect("MiniLM's");
        check_sentence_config(b"{}").expect("no length");
        for bad in [&b"[1]"[..], br#"{"max_seq_length": "long"}"#, br#"{"max_seq_length": -1}"#, b"nope"] {
            check_sentence_config(bad).expect_err(std::str::from_utf8(bad).unwrap());
        }
    }

    #[test]
    fn accepts_every_allowed_name_with_its_role() {
        for (name, role) in ALLOWED {
            assert_eq!(check_path(name).expect(name), *role);
        }
        for name in REQUIRED {
            assert!(
                check_path(name).is_ok(),
                "required file {name} must be allowed"
            );
        }
        assert_eq!(check_path("config.json").ok(), Some(ModelFile::Config));
        assert_eq!(
            check_path("model.safetensors").ok(),
            Some(ModelFile::Weights)
        );
        assert_eq!(
            check_path("tokenizer.json").ok(),
            Some(ModelFile::Tokenizer)
        );
        assert_eq!(check_path("README.md").ok(), Some(ModelFile::Other));
    }

    #[test]
    fn accepts_numbered_pooling_config() {
        assert_eq!(
            check_path("1_Pooling/config.json").ok(),
            Some(ModelFile::Pooling)
        );
        assert_eq!(
            check_path("12_Pooling/config.json").ok(),
            Some(ModelFile::Pooling)
        );
    }

    #[test]
    fn rejects_pooling_lookalikes() {
        for path in [
            "_Pooling/config.json",
            "x_Pooling/config.json",
            "1_Pooling/other.json",
            "1_Pooling/sub/config.json",
            "a/1_Pooling/config.json",
            "1_Pooling",
            "2_Normalize/config.json",
        ] {
            assert!(
                matches!(check_path(path), Err(PathError::NotAllowed { .. })),
                "{path}"
            );
        }
    }

    #[test]
    fn rejects_path_traversal() {
        for path in [
            "../x",
            "a/../../b",
            "1_Pooling/../../x",
            "./config.json",
            "1_Pooling/./config.json",
        ] {
            assert!(
                matches!(check_path(path), Err(PathError::BadSegment { .. })),
                "{path}"
            );
        }
        assert!(matches!(
            check_path("/etc/passwd"),
            Err(PathError::Absolute { .. })
        ));
        assert!(matches!(
            check_path("C:\\x"),
            Err(PathError::Backslash { .. })
        ));
        assert!(matches!(
            check_path("..\\config.json"),
            Err(PathError::Backslash { .. })
        ));
    }

    #[test]
    fn rejects_empty_segments_and_paths() {
        assert!(matches!(check_path(""), Err(PathError::Empty)));
        for path in ["1_Pooling//config.json", "config.json/", "a//b"] {
            assert!(
                matches!(check_path(path), Err(PathError::BadSegment { .. })),
                "{path}"
            );
        }
    }

    #[test]
    fn rejects_control_characters_without_echoing_them() {
        for path in ["config.json\0", "config\n.json", "\u{1b}[31mconfig.json"] {
            let err = check_path(path).expect_err(path);
            assert!(matches!(err, PathError::ControlChar { .. }), "{path:?}");
            assert!(!err.to_string().chars().any(char::is_control), "{err}");
        }
    }

    #[test]
    fn rejects_overlong_path() {
        let path = format!("{}_Pooling/config.json", "1".repeat(300));
        assert!(matches!(check_path(&path), Err(PathError::TooLong { .. })));
    }

    #[test]
    fn rejects_unknown_file_listing_allowed_names() {
        for path in [
            "pytorch_model.bin",
            "Config.json",
            "data_config.json",
            "onnx/model.onnx",
        ] {
            let err = check_path(path).expect_err(path);
            assert!(matches!(err, PathError::NotAllowed { .. }), "{path}");
            let message = err.to_string();
            assert!(
                message.contains("`model.safetensors`") && message.contains("<N>_Pooling"),
                "{message}"
            );
        }
    }

    #[test]
    fn parses_each_pooling_mode() {
        let config = |mean: bool, cls: bool, max: bool| {
            serde_json::json!({
                "word_embedding_dimension": 384,
                "pooling_mode_cls_token": cls,
                "pooling_mode_mean_tokens": mean,
                "pooling_mode_max_tokens": max,
                "pooling_mode_mean_sqrt_len_tokens": false,
            })
            .to_string()
        };
        assert_eq!(
            parse_pooling(config(true, false, false).as_bytes()).ok(),
            Some(Pooling::Mean)
        );
        assert_eq!(
            parse_pooling(config(false, true, false).as_bytes()).ok(),
            Some(Pooling::Cls)
        );
        assert_eq!(
            parse_pooling(config(false, false, true).as_bytes()).ok(),
            Some(Pooling::Max)
        );
    }

    #[test]
    fn rejects_no_or_several_pooling_modes() {
        let none = br#"{"pooling_mode_mean_tokens": false, "pooling_mode_cls_token": false}"#;
        let err = parse_pooling(none).expect_err("no mode");
        assert!(err.to_string().contains("no pooling mode"), "{err}");

        let several = br#"{"pooling_mode_mean_tokens": true, "pooling_mode_cls_token": true}"#;
        let err = parse_pooling(several).expect_err("two modes");
        let message = err.to_string();
        assert!(message.contains("`pooling_mode_mean_tokens`"), "{message}");
        assert!(message.contains("`pooling_mode_cls_token`"), "{message}");
    }

    #[test]
    fn rejects_unsupported_or_malformed_pooling_config() {
        let sqrt =
            br#"{"pooling_mode_mean_tokens": false, "pooling_mode_mean_sqrt_len_tokens": true}"#;
        assert!(matches!(
            parse_pooling(sqrt),
            Err(ConfigError::PoolingMode { .. })
        ));
        assert!(matches!(
            parse_pooling(b"nope"),
            Err(ConfigError::PoolingNotJson { .. })
        ));
        assert!(matches!(
            parse_pooling(b"[true]"),
            Err(ConfigError::PoolingNotJson { .. })
        ));
    }

    #[test]
    fn parses_real_minilm_pooling_config() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../.assets/all-MiniLM-L6-v2/1_Pooling/config.json");
        let Ok(bytes) = std::fs::read(&path) else {
            eprintln!("skipping: {} not present", path.display());
            return;
        };
        assert_eq!(parse_pooling(&bytes).ok(), Some(Pooling::Mean));
    }
}
