//! The engine's one error type. Input mistakes (too long, empty, unknown token ids) are kept
//! apart from broken model folders and compute failures, so the HTTP layer can answer
//! 413/422 for the first and log the rest.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    InvalidModel { path: PathBuf, reason: String },
    #[error("unsupported model: {0}")]
    Unsupported(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error(
        "input {index} is {tokens} tokens long, more than this model's limit of {max}; \
         shorten it or allow truncation"
    )]
    InputTooLong {
        index: usize,
        tokens: usize,
        max: usize,
    },
    #[error("input {index} has no tokens; send a text with at least one word in it")]
    EmptyInput { index: usize },
    #[error("input {index} contains token id {token}, outside this model's vocabulary of {vocab}")]
    TokenOutOfRange {
        index: usize,
        token: u32,
        vocab: usize,
    },
    #[error("this model has no classification head")]
    NoClassifier,
    #[error(transparent)]
    Compute(#[from] candle_core::Error),
}

impl EngineError {
    /// Whether the caller's input caused this error (answer 4xx), rather than the model or
    /// the machine (answer 5xx and log).
    pub fn is_input_error(&self) -> bool {
        matches!(
            self,
            Self::InputTooLong { .. }
                | Self::EmptyInput { .. }
                | Self::TokenOutOfRange { .. }
                | Self::NoClassifier
        )
    }
}
