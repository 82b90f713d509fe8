//! The padding-free engine against two references on the real all-MiniLM-L6-v2:
//! candle-transformers' padded `BertModel` (same weights, masked attention, mean pooling done
//! the same way) and sentence-transformers' own embeddings, committed as a fixture by
//! `scripts/make-embedding-fixture.py`. Every text must reach cosine ≥ 0.9999, with the
//! GEMMs in f32 and, on a CPU with AVX512-BF16, in bf16 (the default there).
//!
//! The model is read from `$TESSERA_ASSETS/all-MiniLM-L6-v2` (default `<repo>/.assets`); the
//! tests skip with a note when it is missing, unless `TESSERA_REQUIRE_ASSETS=1`.

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::bert::{BertModel, Config};
use serde::Deserialize;
use std::path::{Path, PathBuf};
use tessera_worker::engine::ops::GemmInputs;
use tessera_worker::engine::{Batch, EmbeddingModel, EngineError, LoadOptions, Pooling};

const MIN_COSINE: f32 = 0.9999;

fn model_dir() -> Option<PathBuf> {
    let assets = std::env::var_os("TESSERA_ASSETS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.assets"));
    let dir = assets.join("all-MiniLM-L6-v2");
    if dir.join("model.safetensors").is_file() {
        return Some(dir);
    }
    if std::env::var("TESSERA_REQUIRE_ASSETS").as_deref() == Ok("1") {
        panic!(
            "TESSERA_REQUIRE_ASSETS=1 but {} has no model.safetensors",
            dir.display()
        );
    }
    eprintln!(
        "skipped: {} is missing (scripts/fetch-assets.sh fetches it)",
        dir.display()
    );
    None
}

/// The engine with each GEMM precision this CPU has: f32, and bf16 where the CPU has
/// AVX512-BF16 (what `EmbeddingModel::load` picks where it is also clearly faster).
fn engines(dir: &Path, max_input_tokens: Option<usize>) -> Vec<EmbeddingModel> {
    let mut engines = Vec::new();
    for dtype in [DType::F32, DType::BF16] {
        let options = LoadOptions {
            dtype: Some(dtype),
            max_input_tokens,
            ..LoadOptions::default()
        };
        match EmbeddingModel::load_with(dir, &options) {
            Ok(engine) => engines.push(engine),
            Err(EngineError::Unsupported(why)) => eprintln!("not tested here: {why}"),
            Err(e) => panic!("loading with {dtype:?} GEMMs: {e}"),
        }
    }
    let default = match GemmInputs::fastest() {
        GemmInputs::F32 => "f32",
        GemmInputs::Bf16 => "bf16",
    };
    assert_eq!(
        EmbeddingModel::load(dir).unwrap().gemm_dtype(),
        default,
        "by default the CPU computes in the precision GemmInputs::fastest measured"
    );
    engines
}

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
    dot / (norm(a) * norm(b))
}

/// candle-transformers' padded BERT: every sequence padded to the longest, masked attention,
/// then mean pooling over the mask and L2 normalisation, as sentence-transformers does.
struct PaddedReference {
    model: BertModel,
}

impl PaddedReference {
    fn load(dir: &std::path::Path) -> Self {
        let config: Config =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        // SAFETY: the test only reads the file.
        let vb = unsafe {
            VarBuilder::from_mmaped_safetensors(
                &[dir.join("model.safetensors")],
                DType::F32,
                &Device::Cpu,
            )
        }
        .unwrap();
        Self {
            model: BertModel::load(vb, &config).unwrap(),
        }
    }

    fn embed(&self, sequences: &[Vec<u32>]) -> Vec<Vec<f32>> {
        let (n, max) = (
            sequences.len(),
            sequences.iter().map(Vec::len).max().unwrap(),
        );
        let mut ids = vec![0u32; n * max];
        let mut mask = vec![0f32; n * max];
        for (i, seq) in sequences.iter().enumerate() {
            ids[i * max..i * max + seq.len()].copy_from_slice(seq);
            mask[i * max..i * max + seq.len()].fill(1.0);
        }
        let ids = Tensor::from_vec(ids, (n, max), &Device::Cpu).unwrap();
        let mask = Tensor::from_vec(mask, (n, max), &Device::Cpu).unwrap();
        let hidden = self
            .model
            .forward(&ids, &ids.zeros_like().unwrap(), Some(&mask))
            .unwrap();
        let summed = hidden
            .broadcast_mul(&mask.unsqueeze(2).unwrap())
            .unwrap()
            .sum(1)
            .unwrap();
        let mean = summed.broadcast_div(&mask.sum_keepdim(1).unwrap()).unwrap();
        let norm = mean.sqr().unwrap().sum_keepdim(1).unwrap().sqrt().unwrap();
        mean.broadcast_div(&norm).unwrap().to_vec2().unwrap()
    }
}

fn typical_texts() -> Vec<String> {
    let paragraph = "Padding-free inference packs every sequence of a batch end to end, so the \
        linear layers only ever multiply rows that hold real tokens, and attention is computed \
        per sequence over that sequence's own tokens. ";
    vec![
        String::new(),
        "a".into(),
        "What is the tallest mountain in Europe?".into(),
        "Mount Elbrus in the Caucasus is usually named as the highest peak in Europe.".into(),
        "The committee will publish its findings after the summer recess.".into(),
        paragraph.repeat(3),
        // Far beyond 512 tokens: truncated to the limit.
        paragraph.repeat(40),
        "ok".into(),
    ]
}

#[test]
fn packed_batch_matches_the_padded_candle_reference_from_one_token_to_512() {
    let Some(dir) = model_dir() else { return };
    let reference = PaddedReference::load(&dir);
    for engine in engines(&dir, Some(512)) {
        packed_matches_padded(&engine, &reference);
    }
}

fn packed_matches_padded(engine: &EmbeddingModel, reference: &PaddedReference) {
    assert_eq!(engine.max_input_tokens(), 512);

    let texts = typical_texts();
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let mut ids = engine.tokenize_all(&refs, true).unwrap();
    // A single-token sequence and the empty text's [CLS] [SEP] are the shortest inputs.
    ids.push(vec![101]);
    let lengths: Vec<usize> = ids.iter().map(Vec::len).collect();
    assert!(
        lengths.contains(&1) && lengths.contains(&2) && lengths.contains(&512),
        "{lengths:?}"
    );
    let long = ids.iter().find(|s| s.len() == 512).unwrap();
    assert_eq!(
        (long[0], long[511]),
        (101, 102),
        "truncation keeps [CLS] and [SEP]"
    );

    let batch = engine.pack(&ids, false).unwrap();
    assert_eq!(batch.total_tokens(), lengths.iter().sum::<usize>());
    let got = engine.embed_batch(&batch).unwrap();
    let want = reference.embed(&ids);
    let worst = got
        .iter()
        .zip(&want)
        .map(|(g, w)| cosine(g, w))
        .fold(1.0, f32::min);
    let gemm = engine.gemm_dtype();
    eprintln!(
        "{gemm} GEMMs: lowest cosine against the padded reference, lengths {lengths:?}: {worst}"
    );
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let c = cosine(g, w);
        assert!(
            c >= MIN_COSINE,
            "{gemm} GEMMs, sequence {i} ({} tokens): cosine {c}",
            lengths[i]
        );
        let norm = g.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!(
            (norm - 1.0).abs() < 1e-5,
            "sequence {i} is not normalised: {norm}"
        );
    }
}

#[test]
fn a_text_embeds_the_same_alone_and_inside_a_mixed_batch() {
    let Some(dir) = model_dir() else { return };
    let texts = typical_texts();
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    for engine in engines(&dir, None) {
        let together = engine.embed(&refs).unwrap();
        for (i, text) in refs.iter().enumerate() {
            let alone = engine.embed(&[text]).unwrap();
            let c = cosine(&alone[0], &together[i]);
            assert!(
                c >= 0.99999,
                "{} GEMMs, text {i}: cosine {c} between alone and batched",
                engine.gemm_dtype()
            );
        }
    }
}

#[derive(Deserialize)]
struct Fixture {
    max_seq_length: usize,
    texts: Vec<FixtureText>,
}

#[derive(Deserialize)]
struct FixtureText {
    text: String,
    input_ids: Vec<u32>,
    embedding: Vec<f32>,
}

fn fixture() -> Fixture {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/minilm_reference.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn embeddings_match_sentence_transformers() {
    let Some(dir) = model_dir() else { return };
    for engine in engines(&dir, None) {
        matches_sentence_transformers(&engine);
    }
}

fn matches_sentence_transformers(engine: &EmbeddingModel) {
    let fixture = fixture();
    assert_eq!(engine.max_input_tokens(), fixture.max_seq_length);
    assert_eq!(engine.pooling(), Pooling::Mean);
    assert!(engine.normalizes());

    let texts: Vec<&str> = fixture.texts.iter().map(|t| t.text.as_str()).collect();
    let ids = engine.tokenize_all(&texts, true).unwrap();
    for (i, (ours, theirs)) in ids.iter().zip(&fixture.texts).enumerate() {
        assert_eq!(
            ours, &theirs.input_ids,
            "text {i} tokenises differently: {:?}",
            theirs.text
        );
    }
    let got = engine.embed(&texts).unwrap();
    let worst = got
        .iter()
        .zip(&fixture.texts)
        .map(|(g, w)| cosine(g, &w.embedding))
        .fold(1.0, f32::min);
    let gemm = engine.gemm_dtype();
    eprintln!("{gemm} GEMMs: lowest cosine against sentence-transformers: {worst}");
    for (i, (g, want)) in got.iter().zip(&fixture.texts).enumerate() {
        assert_eq!(g.len(), engine.dimension());
        let c = cosine(g, &want.embedding);
        assert!(
            c >= MIN_COSINE,
            "{gemm} GEMMs, text {i} ({} tokens): cosine {c}",
            want.input_ids.len()
        );
    }
}

#[test]
fn a_too_long_text_is_refused_when_truncation_is_off() {
    let Some(dir) = model_dir() else { return };
    let engine = EmbeddingModel::load(&dir).unwrap();
    let long = "word ".repeat(300);
    let err = engine.tokenize_all(&["fine", &long], false).unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::InputTooLong {
                index: 1,
                tokens: 302,
                max: 256
            }
        ),
        "{err:?}"
    );
    assert!(err.is_input_error());
    assert_eq!(engine.tokenize(&long, true).unwrap().len(), 256);
}

#[test]
fn token_ids_outside_the_vocabulary_are_an_input_error() {
    let Some(dir) = model_dir() else { return };
    let engine = EmbeddingModel::load(&dir).unwrap();
    let batch = Batch::pack(&[vec![101, 102], vec![101, 999_999, 102]], 256, true).unwrap();
    let err = engine.embed_batch(&batch).unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::TokenOutOfRange {
                index: 1,
                token: 999_999,
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn a_model_without_a_classification_head_refuses_to_classify() {
    let Some(dir) = model_dir() else { return };
    let engine = EmbeddingModel::load(&dir).unwrap();
    assert!(engine.labels().is_none());
    assert!(matches!(
        engine.classify(&["hello"]),
        Err(EngineError::NoClassifier)
    ));
}
