//! The engine on small random BERT checkpoints written by the test itself, so loading,
//! classification heads, dtypes and pooling modes are checked without any downloaded model.
//! Each result is compared with candle-transformers' padded `BertModel` on the same file.

use candle_core::{DType, Device, Tensor};
use candle_nn::{Module, VarBuilder};
use candle_transformers::models::bert::{BertModel, Config};
use std::collections::HashMap;
use std::path::Path;
use tessera_worker::engine::{EmbeddingModel, EngineError, LoadOptions, Pooling};
use tessera_worker::engine::synthetic::word_level_tokenizer;
use tessera_worker::train::rng::Rng;

const HIDDEN: usize = 64;
const HEADS: usize = 4;
const INTERMEDIATE: usize = 128;
const LAYERS: usize = 2;
const MAX_POSITIONS: usize = 64;
const WORDS: &[&str] = &[
    "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "far", "away", "quickly", "home",
];
const LABELS: &[&str] = &["negative", "neutral", "positive"];

fn config_json() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["BertForSequenceClassification"],
        "model_type": "bert",
        "vocab_size": WORDS.len() + 4,
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "intermediate_size": INTERMEDIATE,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "max_position_embeddings": MAX_POSITIONS,
        "type_vocab_size": 2,
        "initializer_range": 0.02,
        "layer_norm_eps": 1e-12,
        "pad_token_id": 0,
        "id2label": LABELS.iter().enumerate().map(|(i, l)| (i.to_string(), *l)).collect::<HashMap<_, _>>(),
    })
}

/// Random weights with BERT's names, under `prefix`, plus a pooler and classifier.
fn random_weights(prefix: &str) -> HashMap<String, Tensor> {
    let p = prefix;
    // (name, shape, mean, std)
    let mut specs: Vec<(String, Vec<usize>, f32, f32)> = vec![
        (
            format!("{p}embeddings.word_embeddings.weight"),
            vec![WORDS.len() + 4, HIDDEN],
            0.0,
            1.0,
        ),
        (
            format!("{p}embeddings.position_embeddings.weight"),
            vec![MAX_POSITIONS, HIDDEN],
            0.0,
            0.5,
        ),
        (
            format!("{p}embeddings.token_type_embeddings.weight"),
            vec![2, HIDDEN],
            0.0,
            0.5,
        ),
        (
            format!("{p}pooler.dense.weight"),
            vec![HIDDEN, HIDDEN],
            0.0,
            0.125,
        ),
        (format!("{p}pooler.dense.bias"), vec![HIDDEN], 0.0, 0.1),
        (
            "classifier.weight".into(),
            vec![LABELS.len(), HIDDEN],
            0.0,
            0.125,
        ),
        ("classifier.bias".into(), vec![LABELS.len()], 0.0, 0.1),
    ];
    let mut norms = vec![format!("{p}embeddings.LayerNorm")];
    for l in 0..LAYERS {
        let l = format!("{p}encoder.layer.{l}");
        for (name, out, inp) in [
            ("attention.self.query", HIDDEN, HIDDEN),
            ("attention.self.key", HIDDEN, HIDDEN),
            ("attention.self.value", HIDDEN, HIDDEN),
            ("attention.output.dense", HIDDEN, HIDDEN),
            ("intermediate.dense", INTERMEDIATE, HIDDEN),
            ("output.dense", HIDDEN, INTERMEDIATE),
        ] {
            let std = 1.0 / (inp as f32).sqrt();
            specs.push((format!("{l}.{name}.weight"), vec![out, inp], 0.0, std));
            specs.push((format!("{l}.{name}.bias"), vec![out], 0.0, 0.1));
        }
        norms.push(format!("{l}.attention.output.LayerNorm"));
        norms.push(format!("{l}.output.LayerNorm"));
    }
    for norm in norms {
        specs.push((format!("{norm}.weight"), vec![HIDDEN], 1.0, 0.1));
        specs.push((format!("{norm}.bias"), vec![HIDDEN], 0.0, 0.1));
    }
    // From a fixed seed, so a run's weights are the last run's.
    let mut rng = Rng::derive(44, prefix);
    specs
        .into_iter()
        .map(|(name, shape, mean, std)| {
            let values = (0..shape.iter().product())
                .map(|_| mean + std * rng.next_gaussian() as f32)
                .collect();
            (
                name,
                Tensor::from_vec(values, shape.as_slice(), &Device::Cpu).unwrap(),
            )
        })
        .collect()
}

fn write_model(dir: &Path, weights: &HashMap<String, Tensor>, dtype: DType) {
    std::fs::write(dir.join("config.json"), config_json().to_string()).unwrap();
    std::fs::write(dir.join("tokenizer.json"), word_level_tokenizer(WORDS, Some(8)).to_string()).unwrap();
    let converted: HashMap<String, Tensor> = weights
        .iter()
        .map(|(k, v)| (k.clone(), v.to_dtype(dtype).unwrap()))
        .collect();
    candle_core::safetensors::save(&converted, dir.join("model.safetensors")).unwrap();
}

/// candle-transformers on the same file, padded, returning the hidden states, the mask and
/// the classifier's logits.
fn padded_reference(dir: &Path, sequences: &[Vec<u32>], prefix: &str) -> (Tensor, Tensor, Tensor) {
    let config: Config = serde_json::from_value(config_json()).unwrap();
    // SAFETY: the test only reads the file.
    let vb = unsafe {
        VarBuilder::from_mmaped_safetensors(
            &[dir.join("model.safetensors")],
            DType::F32,
            &Device::Cpu,
        )
    }
    .unwrap();
    let encoder_vb = if prefix.is_empty() {
        vb.clone()
    } else {
        vb.pp(prefix.trim_end_matches('.'))
    };
    let model = BertModel::load(encoder_vb.clone(), &config).unwrap();
    let pooler = candle_nn::linear(HIDDEN, HIDDEN, encoder_vb.pp("pooler.dense")).unwrap();
    let classifier = candle_nn::linear(HIDDEN, LABELS.len(), vb.pp("classifier")).unwrap();

    let (n, max) = (
        sequences.len(),
        sequences.iter().map(Vec::len).max().unwrap(),
    );
    let mut ids = vec![0u32; n * max];
    let mut mask = vec![0f32; n * max];
    for (i, s) in sequences.iter().enumerate() {
        ids[i * max..i * max + s.len()].copy_from_slice(s);
        mask[i * max..i * max + s.len()].fill(1.0);
    }
    let ids = Tensor::from_vec(ids, (n, max), &Device::Cpu).unwrap();
    let mask = Tensor::from_vec(mask, (n, max), &Device::Cpu).unwrap();
    let hidden = model
        .forward(&ids, &ids.zeros_like().unwrap(), Some(&mask))
        .unwrap();
    let cls = hidden.narrow(1, 0, 1).unwrap().squeeze(1).unwrap();
    let logits = classifier
        .forward(&pooler.forward(&cls).unwrap().tanh().unwrap())
        .unwrap();
    (hidden, mask, logits)
}

fn texts() -> Vec<&'static str> {
    vec![
        "",
        "cat",
        "the cat sat on the mat",
        "a dog ran far away quickly",
        "the dog ran home and the cat sat on a mat far away",
        "unknown words become unk tokens",
    ]
}

/// The engine with f32 GEMMs: these tests compare the model code with an f32 reference to
/// 1e-4 (the bf16 kernel has its own tests, and engine_exactness.rs runs the real model both
/// ways).
fn load_f32(dir: &Path) -> EmbeddingModel {
    let options = LoadOptions {
        dtype: Some(DType::F32),
        ..LoadOptions::default()
    };
    EmbeddingModel::load_with(dir, &options).unwrap()
}

fn assert_close(got: &[f32], want: &[f32], tolerance: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tolerance * (1.0 + w.abs()),
            "{what}[{k}]: {g} vs {w}"
        );
    }
}

#[test]
fn classifier_logits_match_the_padded_reference_and_name_the_labels() {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), &random_weights("bert."), DType::F32);
    let engine = load_f32(dir.path());
    assert_eq!(engine.labels().unwrap(), LABELS);
    // Without sentence-transformers files: the position table is the limit, mean pooling.
    assert_eq!(engine.max_input_tokens(), MAX_POSITIONS);
    assert_eq!(
        (engine.pooling(), engine.normalizes()),
        (Pooling::Mean, false)
    );

    let texts = texts();
    let ids = engine.tokenize_all(&texts, true).unwrap();
    // The tokenizer.json's own truncation (8) is not applied; [UNK] fills unknown words.
    assert_eq!(ids[4].len(), 15);
    assert_eq!(ids[5], vec![2, 1, 1, 1, 1, 1, 3]);

    let predictions = engine.classify(&texts).unwrap();
    let (_, _, want) = padded_reference(dir.path(), &ids, "bert.");
    let want = want.to_vec2::<f32>().unwrap();
    for (i, (p, w)) in predictions.iter().zip(&want).enumerate() {
        assert_close(&p.logits, w, 1e-4, &format!("logits of text {i}"));
        let best = w
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0;
        assert_eq!((p.label_index, p.label.as_str()), (best, LABELS[best]));
    }
}

#[test]
fn f16_checkpoint_matches_the_reference_on_the_same_rounded_weights() {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), &random_weights(""), DType::F16);
    let engine = load_f32(dir.path());
    let texts = texts();
    let ids = engine.tokenize_all(&texts, true).unwrap();
    let got = engine.embed(&texts).unwrap();

    let (hidden, mask, _) = padded_reference(dir.path(), &ids, "");
    let mean = hidden
        .broadcast_mul(&mask.unsqueeze(2).unwrap())
        .unwrap()
        .sum(1)
        .unwrap()
        .broadcast_div(&mask.sum_keepdim(1).unwrap())
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    for (i, (g, w)) in got.iter().zip(&mean).enumerate() {
        assert_close(g, w, 1e-4, &format!("mean-pooled text {i}"));
    }
}

#[test]
fn sentence_transformers_cls_pooling_and_normalisation_are_applied() {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), &random_weights("bert."), DType::BF16);
    std::fs::write(
        dir.path().join("modules.json"),
        r#"[{"idx":0,"name":"0","path":"","type":"sentence_transformers.models.Transformer"},
            {"idx":1,"name":"1","path":"1_Pooling","type":"sentence_transformers.models.Pooling"},
            {"idx":2,"name":"2","path":"2_Normalize","type":"sentence_transformers.models.Normalize"}]"#,
    )
    .unwrap();
    std::fs::create_dir(dir.path().join("1_Pooling")).unwrap();
    std::fs::write(
        dir.path().join("1_Pooling/config.json"),
        r#"{"word_embedding_dimension": 64, "pooling_mode_cls_token": true, "pooling_mode_mean_tokens": false}"#,
    )
    .unwrap();
    std::fs::write(
        dir.path().join("sentence_bert_config.json"),
        r#"{"max_seq_length": 10}"#,
    )
    .unwrap();

    let engine = load_f32(dir.path());
    assert_eq!(
        (engine.pooling(), engine.normalizes()),
        (Pooling::Cls, true)
    );
    assert_eq!(engine.max_input_tokens(), 10);
    let texts = texts();
    let ids = engine.tokenize_all(&texts, true).unwrap();
    assert_eq!(ids[4].len(), 10);
    assert_eq!(ids[4][9], 3, "truncation keeps [SEP]");
    assert!(matches!(
        engine.tokenize_all(&texts, false),
        Err(EngineError::InputTooLong {
            index: 4,
            tokens: 15,
            max: 10
        })
    ));

    let got = engine.embed(&texts).unwrap();
    let (hidden, _, _) = padded_reference(dir.path(), &ids, "bert.");
    let cls = hidden.narrow(1, 0, 1).unwrap().squeeze(1).unwrap();
    let norm = cls.sqr().unwrap().sum_keepdim(1).unwrap().sqrt().unwrap();
    let want = cls.broadcast_div(&norm).unwrap().to_vec2::<f32>().unwrap();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_close(g, w, 1e-4, &format!("CLS-pooled text {i}"));
    }
}

#[test]
fn a_missing_tensor_is_reported_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let mut weights = random_weights("");
    weights.remove("encoder.layer.1.output.dense.bias");
    write_model(dir.path(), &weights, DType::F32);
    let err = EmbeddingModel::load(dir.path())
        .err()
        .expect("load must fail");
    assert!(
        matches!(&err, EngineError::InvalidModel { reason, .. } if reason.contains("encoder.layer.1.output.dense.bias")),
        "{err}"
    );
    assert!(!err.is_input_error());
}

#[test]
fn a_tensor_of_the_wrong_shape_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut weights = random_weights("");
    weights.insert(
        "encoder.layer.0.intermediate.dense.weight".into(),
        Tensor::zeros((INTERMEDIATE, HIDDEN + 1), DType::F32, &Device::Cpu).unwrap(),
    );
    write_model(dir.path(), &weights, DType::F32);
    let err = EmbeddingModel::load(dir.path())
        .err()
        .expect("load must fail");
    assert!(
        err.to_string().contains("intermediate.dense.weight"),
        "{err}"
    );
}
