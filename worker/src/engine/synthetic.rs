//! Model folders with random weights in a real architecture's shapes, for tests and
//! benchmarks where the agreement of two paths or the speed matters and the trained values do
//! not (a BERT-base checkpoint is 440 MB and none ships with the repository). The weights
//! follow BERT's initialisation (`initializer_range` 0.02: N(0, 0.02²) matrices, LayerNorm
//! gamma 1 and beta 0), so activations have the scale of a real model; biases get small
//! random values rather than BERT's zeros, so the kernels' bias paths are exercised.

use super::error::EngineError;
use candle_core::{Device, Tensor};
use std::collections::HashMap;
use std::path::Path;

/// The sizes of a BERT encoder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RandomBert {
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub intermediate: usize,
    pub vocab: usize,
    pub max_positions: usize,
}

impl RandomBert {
    /// bert-base-uncased's shapes (its vocabulary is the one MiniLM's tokenizer uses).
    pub const BASE: Self = Self {
        hidden: 768,
        layers: 12,
        heads: 12,
        intermediate: 3072,
        vocab: 30522,
        max_positions: 512,
    };

    /// Writes `config.json` and `model.safetensors` into `dir` (created if needed) and copies
    /// `tokenizer.json` from `tokenizer_dir`, whose vocabulary must be at most `vocab` ids.
    /// The same seed writes the same weights.
    pub fn write(&self, dir: &Path, seed: u64, tokenizer_dir: &Path) -> Result<(), EngineError> {
        let io = |path: &Path| {
            let path = path.to_owned();
            move |source| EngineError::Io { path, source }
        };
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let config = serde_json::json!({
            "architectures": ["BertModel"],
            "model_type": "bert",
            "hidden_act": "gelu",
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "intermediate_size": self.intermediate,
            "vocab_size": self.vocab,
            "max_position_embeddings": self.max_positions,
            "type_vocab_size": 2,
            "layer_norm_eps": 1e-12,
            "hidden_dropout_prob": 0.1,
            "attention_probs_dropout_prob": 0.1,
            "initializer_range": 0.02,
            "position_embedding_type": "absolute",
            "pad_token_id": 0,
        });
        let config_path = dir.join("config.json");
        std::fs::write(&config_path, format!("{config:#}\n")).map_err(io(&config_path))?;
        let tokenizer = tokenizer_dir.join("tokenizer.json");
        std::fs::copy(&tokenizer, dir.join("tokenizer.json")).map_err(io(&tokenizer))?;

        let mut rng = Normal::new(seed);
        let mut tensors = HashMap::new();
        let (h, i) = (self.hidden, self.intermediate);
        let mut add = |name: String, shape: &[usize], init: Init| -> Result<(), EngineError> {
            tensors.insert(name, rng.tensor(shape, init)?);
            Ok(())
        };
        let norm = |add: &mut dyn FnMut(String, &[usize], Init) -> Result<(), EngineError>,
                    prefix: &str| {
            add(format!("{prefix}.weight"), &[h], Init::Ones)?;
            add(format!("{prefix}.bias"), &[h], Init::Zeros)
        };
        add(
            "embeddings.word_embeddings.weight".into(),
            &[self.vocab, h],
            Init::Weight,
        )?;
        add(
            "embeddings.position_embeddings.weight".into(),
            &[self.max_positions, h],
            Init::Weight,
        )?;
        add(
            "embeddings.token_type_embeddings.weight".into(),
            &[2, h],
            Init::Weight,
        )?;
        norm(&mut add, "embeddings.LayerNorm")?;
        for layer in 0..self.layers {
            let l = format!("encoder.layer.{layer}");
            for (name, out, inp) in [
                ("attention.self.query", h, h),
                ("attention.self.key", h, h),
                ("attention.self.value", h, h),
                ("attention.output.dense", h, h),
                ("intermediate.dense", i, h),
                ("output.dense", h, i),
            ] {
                add(format!("{l}.{name}.weight"), &[out, inp], Init::Weight)?;
                add(format!("{l}.{name}.bias"), &[out], Init::Bias)?;
            }
            norm(&mut add, &format!("{l}.attention.output.LayerNorm"))?;
            norm(&mut add, &format!("{l}.output.LayerNorm"))?;
        }
        let weights = dir.join("model.safetensors");
        candle_core::safetensors::save(&tensors, &weights)?;
        Ok(())
    }
}

#[derive(Clone, Copy)]
enum Init {
    /// N(0, 0.02²), BERT's `initializer_range`.
    Weight,
    /// Uniform in ±0.02.
    Bias,
    Ones,
    Zeros,
}

/// xorshift64* with Box–Muller normals: reproducible from the seed without a dependency.
struct Normal(u64);

impl Normal {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// Uniform in (0, 1].
    fn unit(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        ((self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }

    fn tensor(&mut self, shape: &[usize], init: Init) -> candle_core::Result<Tensor> {
        let n: usize = shape.iter().product();
        let data: Vec<f32> = match init {
            Init::Ones => vec![1.0; n],
            Init::Zeros => vec![0.0; n],
            Init::Bias => (0..n)
                .map(|_| ((self.unit() * 2.0 - 1.0) * 0.02) as f32)
                .collect(),
            Init::Weight => (0..n)
                .map(|_| {
                    let (u, v) = (self.unit(), self.unit());
                    ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos() * 0.02) as f32
                })
                .collect(),
        };
        Tensor::from_vec(data, shape, &Device::Cpu)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::EmbeddingModel;

    #[test]
    fn a_small_random_bert_loads_and_embeds_deterministically() {
        // The tokenizer comes from the demo MiniLM folder.
        let tokenizer_dir = std::env::var_os("TESSERA_ASSETS")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.assets"))
            .join("all-MiniLM-L6-v2");
        if !tokenizer_dir.join("tokenizer.json").is_file() {
            assert!(
                std::env::var("TESSERA_REQUIRE_ASSETS").as_deref() != Ok("1"),
                "TESSERA_REQUIRE_ASSETS=1 but {} has no tokenizer.json",
                tokenizer_dir.display()
            );
            eprintln!(
                "skipped: {} is missing (scripts/fetch-assets.sh)",
                tokenizer_dir.display()
            );
            return;
        }
        let tiny = RandomBert {
            hidden: 64,
            layers: 2,
            heads: 2,
            intermediate: 128,
            vocab: 30522,
            max_positions: 64,
        };
        let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
        for dir in &dirs {
            tiny.write(dir.path(), 7, &tokenizer_dir).unwrap();
        }
        let a = EmbeddingModel::load(dirs[0].path()).unwrap();
        let b = EmbeddingModel::load(dirs[1].path()).unwrap();
        assert_eq!(a.dimension(), 64);
        let texts = ["a random model still embeds", "two"];
        let (ea, eb) = (a.embed(&texts).unwrap(), b.embed(&texts).unwrap());
        assert_eq!(ea, eb, "the same seed must write the same weights");
        assert!(ea[0].iter().all(|v| v.is_finite()));
        assert_ne!(ea[0], ea[1]);
    }
}

/// A word-level `tokenizer.json` for tiny models: `[PAD]` 0, `[UNK]` 1, `[CLS]` 2, `[SEP]` 3,
/// then `words`; lowercases, splits on whitespace and puts `[CLS] … [SEP]` around each text,
/// truncating to `max_length` tokens when given. A real tokenizer, with no vocabulary file.
pub fn word_level_tokenizer(words: &[&str], max_length: Option<usize>) -> serde_json::Value {
    let specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"];
    let vocab: serde_json::Map<String, serde_json::Value> = specials
        .iter()
        .chain(words)
        .enumerate()
        .map(|(id, token)| (token.to_string(), id.into()))
        .collect();
    let added: Vec<serde_json::Value> = specials
        .iter()
        .enumerate()
        .map(|(id, content)| {
            serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                               "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let truncation = max_length
        .map(|n| serde_json::json!({"max_length": n, "strategy": "LongestFirst", "stride": 0}));
    serde_json::json!({
        "version": "1.0",
        "truncation": truncation,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "Lowercase"},
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": {"type": "BertProcessing", "sep": ["[SEP]", 3], "cls": ["[CLS]", 2]},
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    })
}
