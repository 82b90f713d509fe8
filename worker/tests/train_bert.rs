//! Fine-tuning the real all-MiniLM-L6-v2 with a classification head on a small text task
//! (skipped when the model asset is missing: scripts/fetch-assets.sh).

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use candle_core::Device;
use tessera_api::train::LrSchedule;
use tessera_worker::train::data::{prepare, Table, TaskColumns, TaskKind};
use tessera_worker::train::model::bert::BertClassifier;
use tessera_worker::train::optim::OptimizerKind;
use tessera_worker::train::policy;
use tessera_worker::train::session::{Event, Limits, Session};
use tessera_worker::train::trainer::Trainer;

fn minilm() -> Option<PathBuf> {
    let root = std::env::var("TESSERA_ASSETS").map(PathBuf::from).unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.assets"));
    let dir = root.join("all-MiniLM-L6-v2");
    if dir.join("model.safetensors").exists() {
        return Some(dir);
    }
    assert!(std::env::var("TESSERA_REQUIRE_ASSETS").as_deref() != Ok("1"), "{} is missing; run scripts/fetch-assets.sh", dir.display());
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

fn session(folder: &PathBuf, seed: u64, max_steps: u64) -> Session {
    let task = TaskColumns {
        kind: TaskKind::Classification,
        label: "label".into(),
        features: None,
        text: Some("text".into()),
        validation_split: 0.25,
    };
    let data = Arc::new(prepare(&Table::parse(reviews().as_bytes()).unwrap(), &task, seed).unwrap());
    let network = BertClassifier::load(folder, &data, task.kind, seed, &Device::Cpu).unwrap();
    let adamw = OptimizerKind::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
    let trainer = Trainer::new(Box::new(network), adamw, data, task.kind, 16, seed, Device::Cpu).unwrap();
    // Twelve steps over 72 reviews: an LR well above the usual 2e-5..1e-4 of long fine-tunes
    // (2e-4 barely moves the loss in that time; 3e-3 halves it by step 12).
    let schedule = LrSchedule::Constant { lr: 3e-3 };
    Session::new(trainer, policy::build(&schedule, max_steps, seed), Limits { max_steps, eval_every: max_steps, checkpoint_every: 1000 })
}

#[test]
fn minilm_fine_tunes_to_classify_sentiment_deterministically() {
    let Some(folder) = minilm() else { return };
    let mut losses = Vec::new();
    let evaluation = session(&folder, 1, 12)
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
    session(&folder, 1, 3)
        .run(&AtomicBool::new(false), &mut |event| {
            if let Event::Step(row) = event {
                again.push(row.values["loss"]);
            }
        })
        .unwrap();
    assert_eq!(again, losses[..3], "the same seed repeats the same losses");
}
