//! The real datasets the benchmarks train on, from the assets folder
//! (`scripts/fetch-datasets.sh`, `scripts/fetch-assets.sh`): digits and wine as CSV, and the
//! rotten-tomatoes reviews as all-MiniLM-L6-v2 sentence embeddings computed once and cached.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use tessera_worker::engine::EmbeddingModel;
use tessera_worker::train::data::Table;

/// The assets folder: `explicit`, else `$TESSERA_ASSETS`, else the repository's `.assets`.
pub fn assets_dir(explicit: Option<PathBuf>) -> PathBuf {
    explicit.unwrap_or_else(|| {
        std::env::var("TESSERA_ASSETS")
            .map(PathBuf::from)
            .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.assets"))
    })
}

/// A CSV of `assets/datasets/`, parsed.
pub fn dataset(assets: &Path, file: &str) -> anyhow::Result<Table> {
    let path = assets.join("datasets").join(file);
    let bytes = std::fs::read(&path).with_context(|| format!("{}: run scripts/fetch-datasets.sh", path.display()))?;
    Ok(Table::parse(&bytes)?)
}

/// Every k-th row of `table`, `rows` of them (all when `rows` is 0 or at least the table's).
pub fn every_kth_row(mut table: Table, rows: usize) -> Table {
    if rows > 0 && rows < table.rows.len() {
        let stride = table.rows.len() as f64 / rows as f64;
        table.rows = (0..rows).map(|i| table.rows[(i as f64 * stride) as usize].clone()).collect();
    }
    table
}

/// The sentence embeddings of every review, cached beside the dataset as a CSV of
/// `e0..e383,label` (keyed by the corpus's and the model's bytes), so the frozen encoder
/// runs once.
pub fn embedded_reviews(assets: &Path) -> anyhow::Result<Table> {
    let corpus = assets.join("datasets/rotten_tomatoes.csv");
    let model_dir = assets.join("all-MiniLM-L6-v2");
    let bytes =
        std::fs::read(&corpus).with_context(|| format!("{}: run scripts/fetch-datasets.sh", corpus.display()))?;
    let weights = std::fs::metadata(model_dir.join("model.safetensors"))
        .with_context(|| format!("{}: run scripts/fetch-assets.sh", model_dir.display()))?;
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut hasher);
    weights.len().hash(&mut hasher);
    let cache = assets.join(format!("cache/rotten_tomatoes.minilm.{:016x}.csv", hasher.finish()));
    if let Ok(cached) = std::fs::read(&cache) {
        return Ok(Table::parse(&cached)?);
    }
    let table = Table::parse(&bytes)?;
    let (text, label) = (table.column("text")?, table.column("label")?);
    let engine = EmbeddingModel::load(&model_dir)?;
    let started = Instant::now();
    let mut csv = String::new();
    for chunk in table.rows.chunks(64) {
        let texts: Vec<&str> = chunk.iter().map(|r| r[text].as_str()).collect();
        for (vector, row) in engine.embed(&texts)?.into_iter().zip(chunk) {
            if csv.is_empty() {
                let names: Vec<String> = (0..vector.len()).map(|i| format!("e{i}")).collect();
                csv += &format!("{},label\n", names.join(","));
            }
            let values: Vec<String> = vector.iter().map(|v| format!("{v:.6}")).collect();
            csv += &format!("{},{}\n", values.join(","), row[label]);
        }
    }
    println!(
        "embedded {} reviews with the frozen encoder ({} GEMMs) in {:.1} s",
        table.rows.len(),
        engine.gemm_dtype(),
        started.elapsed().as_secs_f64()
    );
    std::fs::create_dir_all(cache.parent().expect("cache folder"))?;
    std::fs::write(&cache, &csv)?;
    Ok(Table::parse(csv.as_bytes())?)
}
