//! Fine-tuning the real all-MiniLM-L6-v2 with a classification head on a small text task, and
//! our trainable encoder against candle-transformers' BERT (skipped when the model asset is
//! missing: scripts/fetch-assets.sh).

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use candle_core::{DType, Device, Var};
use candle_transformers::models::bert::{BertModel, Config};
use tessera_api::train::LrSchedule;
use tessera_worker::train::data::{prepare, Table, TaskColumns, TaskKind};
use tessera_worker::train::model::bert::BertClassifier;
use tessera_worker::train::model::encoder::Encoder;
use tessera_worker::train::model::Network;
use tessera_worker::train::optim::OptimizerKind;
use tessera_worker::train::policy;
use tessera_worker::train::precision::{OpKind, PlanError, Precision, PrecisionPlan};
use tessera_worker::train::session::{Event, Limits, Session};
use tessera_worker::train::trainer::Trainer;

fn minilm() -> Option<PathBuf> {
    let root = std::env::var("TESSERA_ASSETS")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.assets"));
    let dir = root.join("all-MiniLM-L6-v2");
    if dir.join("model.safetensors").exists() {
        return Some(dir);
    }
    assert!(
        std::env::var("TESSERA_REQUIRE_ASSETS").as_deref() != Ok("1"),
        "{} is missing; run scripts/fetch-assets.sh",
        dir.display()
    );
    eprintln!("skipping: {} is missing", dir.display());
    None
}

/// Reviews whose label is their sentiment, as JSONL.
fn reviews() -> String {
    let good = ["wonderful", "great", "delightful", "excellent", "lovely", "superb", "brilliant", "enjoyable"];
    let bad = ["terrible", "awful", "boring", "dreadful", "horrible", "dull", "disappointing", "painful"];
    let things = ["film", "meal", "concert", "book", "hotel", "game"];
    let mut lines = String::new();
    for (i, thing) in things.iter().enumerate() {
        for j in 0..8 {
            lines += &format!("{{\"text\": \"the {thing} was {}\", \"label\": \"positive\"}}\n", good[(i + j) % 8]);
            lines += &format!("{{\"text\": \"the {thing} was {}\", \"label\": \"negative\"}}\n", bad[(i + j) % 8]);
        }
    }
    lines
}

fn session(folder: &PathBuf, seed: u64, max_steps: u64, precision: Precision) -> Session {
    let task = TaskColumns {
        kind: TaskKind::Classification,
        label: "label".into(),
        features: None,
        text: Some("text".into()),
        validation_split: 0.25,
    };
    let data = Arc::new(prepare(&Table::parse(reviews().as_bytes()).unwrap(), &task, seed).unwrap());
    let mut network = BertClassifier::load(folder, &data, task.kind, seed, &Device::Cpu).unwrap();
    network.set_precision(&PrecisionPlan::uniform(&network.precision_ops(), precision)).unwrap();
    let adamw = OptimizerKind::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
    let trainer = Trainer::new(Box::new(network), adamw, data, task.kind, 16, seed, Device::Cpu).unwrap();
    // Twelve steps over 72 reviews, the whole encoder trained: an LR at the top of the usual
    // 2e-5..1e-4 of BERT fine-tunes (3e-4 also learns; 1e-3 and above diverge).
    let schedule = LrSchedule::Constant { lr: 1e-4 };
    Session::new(
        trainer,
        policy::build(&schedule, max_steps, seed),
        Limits { max_steps, eval_every: max_steps, checkpoint_every: 1000 },
    )
}

/// The twelve step losses and the final validation accuracy.
fn fine_tune(folder: &PathBuf, precision: Precision) -> (Vec<f64>, f64) {
    let mut losses = Vec::new();
    let evaluation = session(folder, 1, 12, precision)
        .run(&AtomicBool::new(false), &mut |event| {
            if let Event::Step(row) = event {
                losses.push(row.values["loss"]);
            }
        })
        .unwrap();
    (losses, evaluation.accuracy.unwrap())
}

#[test]
fn minilm_fine_tunes_at_low_precision_plans() {
    let Some(folder) = minilm() else { return };
    // Every linear at bf16, then at int8 (embeddings and LayerNorms at bf16, the head f32).
    for precision in [Precision::Bf16, Precision::Int8] {
        let (losses, accuracy) = fine_tune(&folder, precision);
        assert!(accuracy >= 0.9, "{precision}: validation accuracy {accuracy} after 12 steps; losses {losses:?}");
        assert!(losses[11] < losses[0] * 0.5, "{precision}: {losses:?}");
    }
}

#[test]
fn minilm_fine_tunes_to_classify_sentiment_deterministically() {
    let Some(folder) = minilm() else { return };
    let mut losses = Vec::new();
    let evaluation = session(&folder, 1, 12, Precision::F32)
        .run(&AtomicBool::new(false), &mut |event| {
            if let Event::Step(row) = event {
                losses.push(row.values["loss"]);
            }
        })
        .unwrap();
    let accuracy = evaluation.accuracy.unwrap();
    assert!(accuracy >= 0.9, "validation accuracy {accuracy} after 12 steps; losses {losses:?}");
    assert!(losses[11] < losses[0] * 0.5, "{losses:?}");

    let mut again = Vec::new();
    session(&folder, 1, 3, Precision::F32)
        .run(&AtomicBool::new(false), &mut |event| {
            if let Event::Step(row) = event {
                again.push(row.values["loss"]);
            }
        })
        .unwrap();
    assert_eq!(again, losses[..3], "the same seed repeats the same losses");
}

/// Token ids, type ids and mask `[3, longest]` for three sentences of different lengths.
fn padded_batch(folder: &std::path::Path) -> [candle_core::Tensor; 3] {
    let mut tokenizer = tokenizers::Tokenizer::from_file(folder.join("tokenizer.json")).unwrap();
    tokenizer.with_padding(Some(tokenizers::PaddingParams::default()));
    let texts = ["the film was wonderful", "a dull and painful evening at the concert hall, too long by far", "ok"];
    let encodings = tokenizer.encode_batch(texts.to_vec(), true).unwrap();
    let stack = |f: &dyn Fn(&tokenizers::Encoding) -> &[u32]| {
        let rows: Vec<_> = encodings.iter().map(|e| candle_core::Tensor::new(f(e), &Device::Cpu).unwrap()).collect();
        candle_core::Tensor::stack(&rows, 0).unwrap()
    };
    [stack(&|e| e.get_ids()), stack(&|e| e.get_type_ids()), stack(&|e| e.get_attention_mask())]
}

fn encoder(folder: &std::path::Path) -> (Encoder, std::collections::BTreeMap<String, Var>) {
    let config: Config = serde_json::from_slice(&std::fs::read(folder.join("config.json")).unwrap()).unwrap();
    let weights = candle_core::safetensors::load(folder.join("model.safetensors"), &Device::Cpu).unwrap();
    let vars: std::collections::BTreeMap<String, Var> = weights
        .into_iter()
        .map(|(name, t)| (name, Var::from_tensor(&t.to_dtype(DType::F32).unwrap()).unwrap()))
        .collect();
    (Encoder::new(&config, &vars).unwrap(), vars)
}

/// Mean of the token states over the mask: what the classifier feeds its head.
fn pooled(states: &candle_core::Tensor, mask: &candle_core::Tensor) -> Vec<Vec<f32>> {
    let mask = mask.to_dtype(DType::F32).unwrap().unsqueeze(2).unwrap();
    let sum = states.broadcast_mul(&mask).unwrap().sum(1).unwrap();
    sum.broadcast_div(&mask.sum(1).unwrap()).unwrap().to_vec2::<f32>().unwrap()
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let norm = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (norm(a) * norm(b))
}

#[test]
fn our_encoder_matches_candle_transformers_bert_at_f32() {
    let Some(folder) = minilm() else { return };
    let [ids, types, mask] = padded_batch(&folder);
    let (ours, _) = encoder(&folder);
    let config: Config = serde_json::from_slice(&std::fs::read(folder.join("config.json")).unwrap()).unwrap();
    let vb = unsafe {
        candle_nn::VarBuilder::from_mmaped_safetensors(&[folder.join("model.safetensors")], DType::F32, &Device::Cpu)
    }
    .unwrap();
    let theirs = BertModel::load(vb, &config).unwrap();
    let want = theirs.forward(&ids, &types, Some(&mask)).unwrap();
    let got = ours.forward(&ids, &types, &mask).unwrap();
    assert_eq!(got.dims(), want.dims());
    let diff = (got - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    // The same graph; only LayerNorm's summation order differs (candle-nn's fused kernel).
    assert!(diff < 1e-4, "max |ours - candle's BertModel| = {diff}");
}

#[test]
fn gradients_reach_every_encoder_weight() {
    let Some(folder) = minilm() else { return };
    let [ids, types, mask] = padded_batch(&folder);
    let (ours, vars) = encoder(&folder);
    let loss = ours.forward(&ids, &types, &mask).unwrap().sqr().unwrap().mean_all().unwrap();
    let grads = loss.backward().unwrap();
    for name in ours.parameter_names() {
        let grad = grads.get(vars[name].as_tensor()).unwrap_or_else(|| panic!("no gradient for {name}"));
        let norm = grad.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(norm > 0.0 && norm.is_finite(), "{name}: gradient norm² {norm}");
    }
}

#[test]
fn low_precision_plans_stay_close_to_f32_and_the_keep_list_holds() {
    let Some(folder) = minilm() else { return };
    let [ids, types, mask] = padded_batch(&folder);
    let (mut ours, _) = encoder(&folder);
    let f32 = pooled(&ours.forward(&ids, &types, &mask).unwrap(), &mask);
    let ops = ours.precision_ops();
    assert_eq!(ops.len(), 2 + 6 * 8, "embeddings + LayerNorm, then 6 linears and 2 LayerNorms per layer");
    // bf16 rounds every operand (2⁻⁹); int8 quantises every linear per tensor, six layers deep.
    // Per-tensor int8 on all 36 linears loses far more (0.81-0.96 measured, the shortest,
    // most padded sentence worst): one scale per batch, set by BERT's outlier channels, leaves
    // few levels for the rest. That is why QSync quantises only the layers it can afford to.
    for (precision, floor) in [(Precision::Bf16, 0.999), (Precision::Int8, 0.75)] {
        ours.set_precision(&PrecisionPlan::uniform(&ops, precision)).unwrap();
        let low = pooled(&ours.forward(&ids, &types, &mask).unwrap(), &mask);
        for (row, (a, b)) in low.iter().zip(&f32).enumerate() {
            let cos = cosine(a, b);
            eprintln!("{precision}: sentence {row} cosine to f32 {cos:.6}");
            assert!(cos >= floor && cos < 1.0 - 1e-9, "{precision}: sentence {row} cosine {cos}");
        }
    }
    let mut plan = PrecisionPlan::default();
    plan.0.insert("encoder.layer.2.output.LayerNorm".into(), Precision::Int8);
    assert!(matches!(ours.set_precision(&plan), Err(PlanError::BelowKeepList { .. })));
    plan.0.clear();
    plan.0.insert("encoder.layer.2.output.dense".into(), Precision::Int8);
    assert_eq!(ours.set_precision(&plan), Ok(()));
}

#[test]
fn a_traced_forward_records_every_planned_operator_on_its_real_input() {
    let Some(folder) = minilm() else { return };
    let [ids, types, mask] = padded_batch(&folder);
    let (ours, vars) = encoder(&folder);
    let mut traces = Vec::new();
    let traced = ours.forward_traced(&ids, &types, &mask, &mut traces).unwrap();
    let plain = ours.forward(&ids, &types, &mask).unwrap();
    let diff = (traced - plain).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    assert_eq!(diff, 0.0, "tracing changes nothing");
    let recorded: Vec<(String, OpKind)> = traces.iter().map(|t| (t.name.clone(), t.kind)).collect();
    assert_eq!(recorded, ours.precision_ops());
    let index = |name: &str| traces.iter().position(|t| t.name == name).unwrap();
    // q, k and v read the LayerNorm before them as it is; the intermediate the attention's.
    assert_eq!(traces[index("encoder.layer.0.attention.self.query")].reads, Some(index("embeddings.LayerNorm")));
    assert_eq!(
        traces[index("encoder.layer.3.attention.self.value")].reads,
        Some(index("encoder.layer.2.output.LayerNorm"))
    );
    assert_eq!(
        traces[index("encoder.layer.1.intermediate.dense")].reads,
        Some(index("encoder.layer.1.attention.output.LayerNorm"))
    );
    assert_eq!(traces[index("encoder.layer.1.output.dense")].reads, None, "it reads the GELU");
    assert_eq!(traces[index("embeddings.LayerNorm")].reads, Some(index("embeddings")));
    let word = vars["embeddings.word_embeddings.weight"].as_tensor();
    assert_eq!(traces[0].weight.as_ref().unwrap().id(), word.id());
    assert_eq!(traces[0].input.dims(), [ids.elem_count(), word.dim(1).unwrap()], "the gathered rows");
    for trace in traces.iter_mut() {
        let again = (trace.rerun)(Precision::F32).unwrap();
        let diff = (again - &trace.output).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(diff, 0.0, "{} reruns as it ran", trace.name);
    }
}
