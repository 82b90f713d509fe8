//! `EmbeddingModel`: a model folder turned into something that answers "embed these texts"
//! and "classify these texts": tokenizer, encoder, sentence-transformers pooling and
//! normalisation, and the classification head when the checkpoint has one.

use super::batch::Batch;
use super::bert::Bert;
use super::config::{EncoderConfig, SentenceConfig};
use super::error::EngineError;
use super::ops::{has_avx512_bf16, GemmInputs, Pooling, SegmentedPool};
use super::weights::Weights;
use candle_core::{DType, Device, Tensor};
use std::path::Path;
use tokenizers::{Tokenizer, TruncationParams};

/// Choices made when loading, beyond what the folder says.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// Longest input in tokens (specials included). Defaults to sentence-transformers'
    /// `max_seq_length` when the folder has one, else the position table's size; never more
    /// than the position table.
    pub max_input_tokens: Option<usize>,
    /// Where the weights live and the forward pass runs; the CPU when unset. A CUDA device
    /// needs a build with the `cuda` feature (the ops' `cuda_fwd`).
    pub device: Option<Device>,
    /// Element type the GEMMs multiply in, always accumulating in f32. On a CUDA device it is
    /// also the weights' and activations' type (f32, f16 or bf16; f32 when unset). On the CPU
    /// it is f32, or bf16 on a CPU with AVX512-BF16 (weights and the GEMMs' inputs rounded to
    /// bf16, everything else f32); unset, the CPU takes bf16 where it has it and runs it
    /// clearly faster (`GemmInputs::fastest`), as OpenVINO's CPU plugin does.
    pub dtype: Option<DType>,
}

fn unsupported(dtype: DType, device: &Device) -> EngineError {
    EngineError::Unsupported(format!(
        "computing in {dtype:?} on {device:?}: the CPU computes in f32, or in bf16 where it has \
         AVX512-BF16; a CUDA device in f32, f16 or bf16"
    ))
}

fn gemm_name(gemm: GemmInputs) -> &'static str {
    match gemm {
        GemmInputs::F32 => "f32",
        GemmInputs::Bf16 => "bf16",
    }
}

/// One text's classification.
#[derive(Debug, Clone, PartialEq)]
pub struct Prediction {
    pub logits: Vec<f32>,
    /// Index of the largest logit.
    pub label_index: usize,
    /// Its name from `id2label`.
    pub label: String,
}

pub struct EmbeddingModel {
    encoder: Bert,
    /// What the GEMMs multiply in ("f32", "bf16", "f16").
    gemm: &'static str,
    config: EncoderConfig,
    /// Encodes without truncation or padding, so the real length is known.
    tokenizer: Tokenizer,
    /// The same, truncating to `max_input_tokens` (special tokens kept).
    truncating: Tokenizer,
    pooling: Pooling,
    normalize: bool,
    max_input_tokens: usize,
    /// Most tokens one forward pass holds (`pass_tokens`); `None`: no limit.
    pass_tokens: Option<usize>,
}

/// The widest activation of one CPU forward pass (the feed-forward's `[tokens,
/// intermediate]`, f32), at most. Passes whose activations stay under about 12 MB reuse the
/// allocator's memory from pass to pass; past that (2,464 tokens and up for MiniLM, here)
/// every pass maps and page-faults fresh memory, and 13k-token batches ran at about 0.7 of
/// the tokens per CPU-second of 1.4k-token passes, and got less CPU besides
/// (bench/results/overload.md). 8 MiB keeps a margin under that edge.
const CPU_PASS_ACTIVATION_BYTES: usize = 8 << 20;

impl EmbeddingModel {
    /// Loads `config.json`, `model.safetensors`, `tokenizer.json` and the optional
    /// sentence-transformers files from `dir`.
    pub fn load(dir: &Path) -> Result<Self, EngineError> {
        Self::load_with(dir, &LoadOptions::default())
    }

    pub fn load_with(dir: &Path, options: &LoadOptions) -> Result<Self, EngineError> {
        let device = options.device.clone().unwrap_or(Device::Cpu);
        let (dtype, gemm) = if device.is_cpu() {
            match options.dtype {
                None => (DType::F32, GemmInputs::fastest()),
                Some(DType::F32) => (DType::F32, GemmInputs::F32),
                Some(DType::BF16) if has_avx512_bf16() => (DType::F32, GemmInputs::Bf16),
                Some(other) => return Err(unsupported(other, &device)),
            }
        } else {
            match options.dtype.unwrap_or(DType::F32) {
                dtype @ (DType::F32 | DType::F16 | DType::BF16) => (dtype, GemmInputs::F32),
                other => return Err(unsupported(other, &device)),
            }
        };
        let config = EncoderConfig::from_file(&dir.join("config.json"))?;
        let sentence = SentenceConfig::from_dir(dir)?;
        let weights = Weights::open(&dir.join("model.safetensors"), &device, dtype)?;
        let encoder = Bert::load(&weights, &config, &device, gemm)?;

        let max_input_tokens = options
            .max_input_tokens
            .or(sentence.max_seq_length)
            .unwrap_or(config.max_position_embeddings)
            .min(config.max_position_embeddings);

        let tokenizer_path = dir.join("tokenizer.json");
        let mut tokenizer =
            Tokenizer::from_file(&tokenizer_path).map_err(|e| EngineError::InvalidModel {
                path: tokenizer_path.clone(),
                reason: e.to_string(),
            })?;
        // tokenizer.json files often carry a padding/truncation setup from training
        // (MiniLM's pads to 128); the engine packs and limits lengths itself.
        tokenizer.with_padding(None);
        tokenizer
            .with_truncation(None)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))?;
        let mut truncating = tokenizer.clone();
        truncating
            .with_truncation(Some(TruncationParams {
                max_length: max_input_tokens,
                ..Default::default()
            }))
            .map_err(|e| EngineError::Tokenizer(e.to_string()))?;

        let widest = config.intermediate_size.max(config.hidden_size) * std::mem::size_of::<f32>();
        let pass_tokens = device.is_cpu().then(|| (CPU_PASS_ACTIVATION_BYTES / widest).max(1));
        Ok(Self {
            encoder,
            gemm: if device.is_cpu() {
                gemm_name(gemm)
            } else {
                dtype.as_str()
            },
            config,
            tokenizer,
            truncating,
            pooling: sentence.pooling,
            normalize: sentence.normalize,
            max_input_tokens,
            pass_tokens,
        })
    }

    /// What the GEMMs multiply in ("f32", "bf16" or "f16"; they accumulate in f32).
    pub fn gemm_dtype(&self) -> &'static str {
        self.gemm
    }

    /// Length of the vectors `embed` returns.
    pub fn dimension(&self) -> usize {
        self.config.hidden_size
    }

    /// Token ids must be below this (ids given directly, rather than text, are checked).
    pub fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    pub fn max_input_tokens(&self) -> usize {
        self.max_input_tokens
    }

    pub fn pooling(&self) -> Pooling {
        self.pooling
    }

    /// Whether embeddings are L2-normalised (the folder has a `Normalize` module).
    pub fn normalizes(&self) -> bool {
        self.normalize
    }

    /// Class labels in logit order; `None` when the checkpoint has no classification head.
    pub fn labels(&self) -> Option<&[String]> {
        self.encoder.labels()
    }

    /// Token ids of `text`, special tokens included. Longer than `max_input_tokens()`, the
    /// text is truncated (keeping the closing special token) or refused.
    pub fn tokenize(&self, text: &str, truncate: bool) -> Result<Vec<u32>, EngineError> {
        self.tokenize_indexed(0, text, truncate)
    }

    fn tokenize_indexed(
        &self,
        index: usize,
        text: &str,
        truncate: bool,
    ) -> Result<Vec<u32>, EngineError> {
        let tokenizer_error = |e: tokenizers::Error| EngineError::Tokenizer(e.to_string());
        let mut ids = self
            .tokenizer
            .encode_fast(text, true)
            .map_err(tokenizer_error)?
            .get_ids()
            .to_vec();
        if ids.len() > self.max_input_tokens {
            if !truncate {
                return Err(EngineError::InputTooLong {
                    index,
                    tokens: ids.len(),
                    max: self.max_input_tokens,
                });
            }
            ids = self
                .truncating
                .encode_fast(text, true)
                .map_err(tokenizer_error)?
                .get_ids()
                .to_vec();
        }
        self.check_tokens(index, &ids)?;
        Ok(ids)
    }

    /// Input `index` as token ids is something the model can embed: at least one token
    /// (a tokenizer that adds no special tokens gives none for a blank text), each within
    /// the vocabulary (a tokenizer may know more words than the embedding table).
    /// Checked per request, so one bad input is refused alone rather than failing the
    /// batch it would have joined.
    pub fn check_tokens(&self, index: usize, ids: &[u32]) -> Result<(), EngineError> {
        if ids.is_empty() {
            return Err(EngineError::EmptyInput { index });
        }
        let vocab = self.vocab_size();
        match ids.iter().find(|&&t| t as usize >= vocab) {
            Some(&token) => Err(EngineError::TokenOutOfRange { index, token, vocab }),
            None => Ok(()),
        }
    }

    /// Tokenises several texts; an error names the offending input's index.
    pub fn tokenize_all(
        &self,
        texts: &[&str],
        truncate: bool,
    ) -> Result<Vec<Vec<u32>>, EngineError> {
        texts
            .iter()
            .enumerate()
            .map(|(i, text)| self.tokenize_indexed(i, text, truncate))
            .collect()
    }

    /// Most tokens worth computing in one forward pass on this model's device: a batch
    /// with more is best computed as several passes (the serving queue does). `None` on a
    /// GPU, where bigger passes only fill the device better.
    pub fn pass_tokens(&self) -> Option<usize> {
        self.pass_tokens
    }

    /// Packs token-id sequences for this model (see [`Batch::pack`]).
    pub fn pack<S: AsRef<[u32]>>(
        &self,
        sequences: &[S],
        truncate: bool,
    ) -> Result<Batch, EngineError> {
        Batch::pack(sequences, self.max_input_tokens, truncate)
    }

    /// Sentence embeddings of `texts`, truncated to the model's limit, in input order.
    pub fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>, EngineError> {
        let ids = self.tokenize_all(texts, true)?;
        self.embed_batch(&self.pack(&ids, true)?)
    }

    /// Sentence embeddings of a packed batch, pooled and normalised as the model folder says.
    pub fn embed_batch(&self, batch: &Batch) -> Result<Vec<Vec<f32>>, EngineError> {
        self.embed_batch_with(batch, self.pooling, self.normalize)
    }

    /// As [`Self::embed_batch`] with the pooling and normalisation chosen by the caller.
    pub fn embed_batch_with(
        &self,
        batch: &Batch,
        pooling: Pooling,
        normalize: bool,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let (hidden, packing) = self.forward(batch)?;
        let pooled =
            hidden.apply_op2_no_bwd(&packing.cu_seqlens, &SegmentedPool { pooling, normalize })?;
        Ok(pooled.to_dtype(DType::F32)?.to_vec2::<f32>()?)
    }

    /// Every token's last hidden state, `[total_tokens, hidden]` in packed order.
    pub fn token_embeddings(&self, batch: &Batch) -> Result<Tensor, EngineError> {
        Ok(self.forward(batch)?.0)
    }

    /// Classification of `texts` (truncated to the model's limit).
    pub fn classify(&self, texts: &[&str]) -> Result<Vec<Prediction>, EngineError> {
        let ids = self.tokenize_all(texts, true)?;
        self.classify_batch(&self.pack(&ids, true)?)
    }

    pub fn classify_batch(&self, batch: &Batch) -> Result<Vec<Prediction>, EngineError> {
        let labels = self.labels().ok_or(EngineError::NoClassifier)?;
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let (hidden, packing) = self.forward(batch)?;
        let logits = self
            .encoder
            .classify(&hidden, &packing)
            .ok_or(EngineError::NoClassifier)??
            .to_dtype(DType::F32)?
            .to_vec2::<f32>()?;
        Ok(logits
            .into_iter()
            .map(|logits| {
                let label_index = logits
                    .iter()
                    .enumerate()
                    .max_by(|a, b| a.1.total_cmp(b.1))
                    .map_or(0, |(i, _)| i);
                Prediction {
                    label: labels[label_index].clone(),
                    label_index,
                    logits,
                }
            })
            .collect())
    }

    fn forward(&self, batch: &Batch) -> Result<(Tensor, super::layer::Packing), EngineError> {
        self.check(batch)?;
        Ok(self.encoder.forward(batch)?)
    }

    /// Inputs that would index past the embedding tables are refused before any compute.
    fn check(&self, batch: &Batch) -> Result<(), EngineError> {
        for i in 0..batch.len() {
            if batch.seq_len(i) > self.config.max_position_embeddings {
                return Err(EngineError::InputTooLong {
                    index: i,
                    tokens: batch.seq_len(i),
                    max: self.config.max_position_embeddings,
                });
            }
            if let Some(&token) = batch
                .sequence(i)
                .iter()
                .find(|&&t| t as usize >= self.config.vocab_size)
            {
                return Err(EngineError::TokenOutOfRange {
                    index: i,
                    token,
                    vocab: self.config.vocab_size,
                });
            }
        }
        Ok(())
    }
}
