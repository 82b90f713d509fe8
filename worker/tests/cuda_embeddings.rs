//! End to end on a GPU: the engine on CUDA (candle's cuBLAS GEMMs and our kernels) in f32,
//! f16 and bf16 gives the sentence embeddings the CPU engine gives, cosine ≥ 0.999 for every
//! input, on ragged batches from one token to 512, for all-MiniLM-L6-v2 and a BERT-base-sized
//! model with random weights.
//!
//! Needs a CUDA GPU (skips with a reason without one, fails with TESSERA_REQUIRE_GPU=1) and
//! the demo model (scripts/fetch-assets.sh; TESSERA_ASSETS, TESSERA_REQUIRE_ASSETS=1 as in
//! the CPU tests).
#![cfg(feature = "cuda")]

mod gpu_support;

use candle_core::{DType, Device};
use gpu_support::{gpu, Rng};
use std::path::PathBuf;
use tessera_worker::engine::synthetic::RandomBert;
use tessera_worker::engine::{EmbeddingModel, LoadOptions};

const MIN_COSINE: f64 = 0.999;

fn minilm_dir() -> Option<PathBuf> {
    let assets = std::env::var_os("TESSERA_ASSETS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.assets"));
    let dir = assets.join("all-MiniLM-L6-v2");
    if dir.join("model.safetensors").is_file() {
        return Some(dir);
    }
    assert!(
        std::env::var("TESSERA_REQUIRE_ASSETS").as_deref() != Ok("1"),
        "TESSERA_REQUIRE_ASSETS=1 but {} has no model.safetensors",
        dir.display()
    );
    eprintln!(
        "skipping: {} is missing (scripts/fetch-assets.sh)",
        dir.display()
    );
    None
}

/// Token-id sequences of lengths 1..=512 (1 and 512 included), [CLS] … [SEP] framed, ids
/// drawn from the ordinary-word part of the BERT vocabulary.
fn ragged_ids(rng: &mut Rng, count: usize) -> Vec<Vec<u32>> {
    rng.lengths(count, 512)
        .into_iter()
        .map(|len| {
            let mut ids: Vec<u32> = (0..len).map(|_| 1996 + rng.below(28_000) as u32).collect();
            ids[0] = 101;
            if len > 1 {
                ids[len - 1] = 102;
            }
            ids
        })
        .collect()
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let norm = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (norm(a) * norm(b))
}

/// Loads `dir` on the CPU and on `gpu` in each storage type and compares the embeddings of
/// the same packed batch.
fn gpu_agrees_with_cpu(name: &str, dir: &std::path::Path, gpu: &Device, sequences: &[Vec<u32>]) {
    let options = |device: Option<Device>, dtype: Option<DType>| LoadOptions {
        max_input_tokens: Some(512),
        device,
        dtype,
    };
    let cpu = EmbeddingModel::load_with(dir, &options(None, Some(DType::F32))).unwrap();
    let batch = cpu.pack(sequences, false).unwrap();
    let want = cpu.embed_batch(&batch).unwrap();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let model =
            EmbeddingModel::load_with(dir, &options(Some(gpu.clone()), Some(dtype))).unwrap();
        let got = model.embed_batch(&batch).unwrap();
        assert_eq!(got.len(), want.len());
        let mut worst = (f64::INFINITY, 0);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let c = cosine(g, w);
            if !(c >= worst.0) {
                worst = (c, i);
            }
        }
        let (c, i) = worst;
        println!(
            "{name} {dtype:?}: lowest cosine {c:.6} (input {i}, {} tokens)",
            batch.seq_len(i)
        );
        assert!(
            c >= MIN_COSINE,
            "{name} {dtype:?}: input {i} ({} tokens) has cosine {c} between GPU and CPU",
            batch.seq_len(i)
        );
    }
}

#[test]
fn minilm_embeds_the_same_on_gpu_as_on_cpu() {
    let Some(gpu) = gpu() else { return };
    let Some(dir) = minilm_dir() else { return };
    let mut rng = Rng::new(11);
    let mut sequences = ragged_ids(&mut rng, 40);
    // Real text too, so the tokenizer's ids and real sentence structure are covered.
    let model = EmbeddingModel::load(&dir).unwrap();
    for text in [
        "hi",
        "The quick brown fox jumps over the lazy dog.",
        "Padding-free batches keep every token real: no position is computed only to be masked.",
    ] {
        sequences.push(model.tokenize(text, true).unwrap());
    }
    gpu_agrees_with_cpu("all-MiniLM-L6-v2", &dir, &gpu, &sequences);
}

#[test]
fn a_bert_base_sized_model_embeds_the_same_on_gpu_as_on_cpu() {
    let Some(gpu) = gpu() else { return };
    let Some(minilm) = minilm_dir() else { return };
    let dir = tempfile::tempdir().unwrap();
    RandomBert::BASE.write(dir.path(), 5, &minilm).unwrap();
    let mut rng = Rng::new(12);
    let sequences = ragged_ids(&mut rng, 16);
    gpu_agrees_with_cpu("BERT-base (random weights)", dir.path(), &gpu, &sequences);
}
