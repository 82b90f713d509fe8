//! Serving benchmark (issue 3, "Performance"): the real all-MiniLM-L6-v2 on a fixed, seeded
//! mix of real texts (mostly one clause or sentence, a tail of paragraphs up to the model's
//! 256 tokens), all in one run so the ratios share this machine's noise:
//!
//! 1. in process, batches of 32 texts in arrival order, tokenization included: the packed
//!    engine (as the worker loads it by default, and with the other of f32 and bf16 GEMMs
//!    where the CPU has both) against candle-transformers' padded `BertModel` (each batch
//!    padded to its longest, masked mean pooling, L2 normalisation); then all at batch
//!    sizes equal to the HTTP concurrency levels;
//! 2. sentence-transformers on PyTorch CPU over the same texts (bench/scripts/
//!    sentence_transformers_baseline.py as a subprocess), when a Python with it is found;
//! 3. the release `tessera-server` and `tessera-worker` on loopback, one deployment with the
//!    default batching limits: closed-loop clients, one text per `POST /v1/embeddings`;
//! 4. the gateway's cost: one short text at concurrency 1, straight to the worker's engine
//!    endpoint and through the server, interleaved request by request.
//!
//! Throughput is in real tokens (after truncation, [CLS]/[SEP] included; padding never
//! counts). Prints one line per figure; writes bench/results/serving.json and serving.md.
//!
//! Run: cargo build --release -p tessera-server -p tessera-worker &&
//!      cargo run --release -p tessera-bench --bin serving -- [--python VENV/bin/python]
//! `--only gateway` measures step 4 alone and rewrites only its section (and its goal) in
//! the result files of an earlier full run, saying when and how it was re-measured.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::bert::{BertModel, Config as BertConfig};
use clap::{Parser, ValueEnum};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use tessera_worker::engine::{EmbeddingModel, EngineError, LoadOptions};

/// Serving benchmark: packed engine vs padded candle vs sentence-transformers, and the
/// real server + worker over HTTP.
#[derive(Debug, Parser)]
struct Cli {
    /// The all-MiniLM-L6-v2 folder (default: .assets/all-MiniLM-L6-v2 in the workspace).
    #[arg(long, env = "TESSERA_BENCH_MODEL")]
    model: Option<PathBuf>,
    /// Texts in the workload.
    #[arg(long, default_value_t = 512)]
    texts: usize,
    #[arg(long, default_value_t = 20_251_122)]
    seed: u64,
    /// Batch size of the in-process comparison (and of sentence-transformers).
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Passes over the workload per implementation in process, alternating which goes first.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Client concurrency levels over HTTP.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64")]
    concurrency: Vec<usize>,
    /// Batch sizes of the in-process sweep (the padded baseline at 64 alone would take minutes).
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    sweep_batches: Vec<usize>,
    /// Texts of the workload (from its start) used by the in-process batch-size sweep.
    #[arg(long, default_value_t = 192)]
    sweep_texts: usize,
    /// Passes of sentence-transformers over the workload (each: arrival order, then sorted).
    #[arg(long, default_value_t = 1)]
    st_rounds: usize,
    /// Python with sentence-transformers and torch (default: /tmp/tessera-st-venv/bin/python,
    /// the venv scripts/make-embedding-fixture.py makes, then python3).
    #[arg(long, env = "TESSERA_BENCH_PYTHON")]
    python: Option<PathBuf>,
    /// Folder holding the release tessera-server and tessera-worker (default: this binary's).
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// Measured request triples (direct, gateway with an API token, gateway with a session).
    #[arg(long, default_value_t = 400)]
    overhead_requests: usize,
    /// Skip the HTTP part (steps 3 and 4).
    #[arg(long)]
    no_http: bool,
    /// Measure one part alone and update its section of the existing result files.
    #[arg(long, value_enum, conflicts_with = "no_http")]
    only: Option<Only>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Only {
    /// Step 4, the gateway's overhead over calling the worker directly.
    Gateway,
}

fn main() -> Result<()> {
    // The in-process engines run in a heap set up as the worker's (`tessera_worker::memory`).
    tessera_worker::memory::keep_freed_memory();
    let cli = Cli::parse();
    let workspace = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let model_dir = cli.model.clone().unwrap_or_else(|| workspace.join(".assets/all-MiniLM-L6-v2"));
    ensure!(model_dir.join("model.safetensors").exists(), "{} has no model.safetensors; run scripts/fetch-assets.sh", model_dir.display());
    let started = Instant::now();
    let mut report = Report { load_at_start: load_average(), ..Report::default() };

    let engine = EmbeddingModel::load(&model_dir).context("loading the engine")?;
    let workload = Workload::build(&model_dir, &engine, cli.texts, cli.seed)?;
    if cli.only == Some(Only::Gateway) {
        drop(engine);
        run_http(&cli, &model_dir, &workload, &mut report)?;
        return report.update_gateway(&workspace.join("bench/results"), started.elapsed().as_secs_f64());
    }
    report.workload(&workload, cli.batch);

    let inprocess = InProcess::load(&model_dir, engine)?;
    report.in_process(&inprocess.compare(&workload, cli.batch, cli.rounds)?);
    let sweep = workload.prefix(cli.sweep_texts);
    for &batch in &cli.sweep_batches {
        report.sweep(batch, &sweep, &inprocess.compare(&sweep, batch, 1)?);
    }
    drop(inprocess);

    report.sentence_transformers(sentence_transformers(&cli, &model_dir, &workload));

    if !cli.no_http {
        run_http(&cli, &model_dir, &workload, &mut report)?;
    }

    report.goals();
    let seconds = started.elapsed().as_secs_f64();
    println!("total benchmark time: {seconds:.0} s");
    report.write(&workspace.join("bench/results"), seconds)
}

// ---------------------------------------------------------------------------------------
// The workload: real text, a fixed seeded mix of lengths, in arrival order.
// ---------------------------------------------------------------------------------------

/// License texts every Debian machine has, plus the model's own README.
const LICENSES: &[&str] = &["Apache-2.0", "Artistic", "BSD", "CC0-1.0", "GFDL-1.3", "GPL-2", "GPL-3", "LGPL-2.1", "MPL-2.0"];

/// Shares of each kind of text, in order: a clause (a sentence cut at , ; :), one sentence,
/// 2–3 consecutive sentences, 1–2 consecutive paragraphs (cut at the model's 256 tokens).
const MIX: [(f64, &str); 4] = [(0.40, "clause"), (0.30, "sentence"), (0.15, "2-3 sentences"), (0.15, "1-2 paragraphs")];

struct Workload {
    texts: Vec<String>,
    /// Real tokens of each text after truncation.
    tokens: Vec<usize>,
    sources: Vec<String>,
}

impl Workload {
    fn build(model_dir: &Path, engine: &EmbeddingModel, count: usize, seed: u64) -> Result<Workload> {
        let mut paragraphs = Vec::new();
        let mut sources = Vec::new();
        for name in LICENSES {
            let path = Path::new("/usr/share/common-licenses").join(name);
            if let Ok(text) = std::fs::read_to_string(&path) {
                paragraphs.extend(split_paragraphs(&text));
                sources.push(path.display().to_string());
            }
        }
        let readme = model_dir.join("README.md");
        if let Ok(text) = std::fs::read_to_string(&readme) {
            paragraphs.extend(split_paragraphs(&markdown_prose(&text)));
            sources.push(readme.display().to_string());
        }
        let sentences: Vec<String> = paragraphs.iter().flat_map(|p| split_after(p, &['.', '?', '!'])).collect();
        let clauses: Vec<String> = sentences.iter().flat_map(|s| split_after(s, &[',', ';', ':', '.', '?', '!'])).collect();
        ensure!(paragraphs.len() >= 50, "found too little text ({} paragraphs in {sources:?})", paragraphs.len());

        let mut rng = StdRng::seed_from_u64(seed);
        let mut texts = Vec::with_capacity(count);
        for _ in 0..count {
            let mut u: f64 = rng.gen();
            let kind = MIX.iter().position(|&(share, _)| {
                u -= share;
                u < 0.0
            });
            let text = match kind.unwrap_or(MIX.len() - 1) {
                0 => clauses[rng.gen_range(0..clauses.len())].clone(),
                1 => sentences[rng.gen_range(0..sentences.len())].clone(),
                2 => consecutive(&sentences, rng.gen_range(0..sentences.len()), rng.gen_range(2..=3)),
                _ => consecutive(&paragraphs, rng.gen_range(0..paragraphs.len()), rng.gen_range(1..=2)),
            };
            texts.push(text);
        }
        let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
        let tokens = engine.tokenize_all(&refs, true)?.iter().map(Vec::len).collect();
        Ok(Workload { texts, tokens, sources })
    }

    fn prefix(&self, count: usize) -> Workload {
        let count = count.min(self.texts.len());
        Workload { texts: self.texts[..count].to_vec(), tokens: self.tokens[..count].to_vec(), sources: self.sources.clone() }
    }

    fn total_tokens(&self) -> usize {
        self.tokens.iter().sum()
    }

    /// Tokens a padded implementation computes with batches of `batch` in arrival order.
    fn padded_tokens(&self, batch: usize) -> usize {
        self.tokens.chunks(batch).map(|c| c.len() * c.iter().max().unwrap_or(&0)).sum()
    }
}

/// Paragraphs separated by blank lines, whitespace collapsed; fragments under 3 words dropped.
fn split_paragraphs(text: &str) -> Vec<String> {
    text.split("\n\n")
        .map(|p| p.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|p| p.split(' ').count() >= 3)
        .collect()
}

/// Pieces of `text` ending at a word that ends with one of `marks`; pieces under 3 words dropped.
fn split_after(text: &str, marks: &[char]) -> Vec<String> {
    let mut pieces = Vec::new();
    let mut current: Vec<&str> = Vec::new();
    for word in text.split_whitespace() {
        current.push(word);
        if word.ends_with(marks) {
            pieces.push(std::mem::take(&mut current));
        }
    }
    pieces.push(current);
    pieces.into_iter().filter(|p| p.len() >= 3).map(|p| p.join(" ")).collect()
}

fn consecutive(items: &[String], start: usize, count: usize) -> String {
    items[start..(start + count).min(items.len())].join(" ")
}

/// The prose of a Markdown file: no front matter, code blocks, tables, headings or HTML.
fn markdown_prose(text: &str) -> String {
    let mut lines = Vec::new();
    let mut in_code = false;
    let mut in_front_matter = text.starts_with("---");
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        if in_front_matter {
            in_front_matter = i == 0 || trimmed != "---";
            continue;
        }
        if trimmed.starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code || ['|', '#', '<', '!'].iter().any(|&c| trimmed.starts_with(c)) {
            lines.push("");
            continue;
        }
        lines.push(line);
    }
    lines.join("\n")
}

// ---------------------------------------------------------------------------------------
// In process: the packed engine and the padded candle-transformers baseline.
// ---------------------------------------------------------------------------------------

/// candle-transformers' `BertModel`, padded per batch to its longest sequence, with the mean
/// pooling over the attention mask and the normalisation sentence-transformers applies.
struct PaddedBert {
    model: BertModel,
}

impl PaddedBert {
    fn load(dir: &Path) -> Result<PaddedBert> {
        let config: BertConfig = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
        // SAFETY: the weights file is not modified while the benchmark runs.
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[dir.join("model.safetensors")], DType::F32, &Device::Cpu)? };
        Ok(PaddedBert { model: BertModel::load(vb, &config)? })
    }

    fn embed(&self, sequences: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
        let n = sequences.len();
        let max = sequences.iter().map(Vec::len).max().unwrap_or(0);
        let mut ids = vec![0u32; n * max];
        let mut mask = vec![0f32; n * max];
        for (i, seq) in sequences.iter().enumerate() {
            ids[i * max..i * max + seq.len()].copy_from_slice(seq);
            mask[i * max..i * max + seq.len()].fill(1.0);
        }
        let ids = Tensor::from_vec(ids, (n, max), &Device::Cpu)?;
        let mask = Tensor::from_vec(mask, (n, max), &Device::Cpu)?;
        let hidden = self.model.forward(&ids, &ids.zeros_like()?, Some(&mask))?;
        let summed = hidden.broadcast_mul(&mask.unsqueeze(2)?)?.sum(1)?;
        let mean = summed.broadcast_div(&mask.sum_keepdim(1)?)?;
        let norm = mean.sqr()?.sum_keepdim(1)?.sqrt()?;
        Ok(mean.broadcast_div(&norm)?.to_vec2()?)
    }
}

/// One implementation's passes over a workload.
#[derive(Debug, Default)]
struct Timed {
    tokens: usize,
    seconds: Vec<f64>,
    batch_ms: Vec<f64>,
}

impl Timed {
    fn tokens_per_s(&self) -> f64 {
        (self.tokens * self.seconds.len()) as f64 / self.seconds.iter().sum::<f64>()
    }

    fn json(&self) -> Value {
        json!({
            "tokens_per_s": round(self.tokens_per_s(), 0),
            "tokens_per_s_by_round": self.seconds.iter().map(|s| round(self.tokens as f64 / s, 0)).collect::<Vec<_>>(),
            "batch_latency_ms": latency_json(&self.batch_ms),
            "batches": self.batch_ms.len(),
        })
    }
}

struct Comparison {
    batch: usize,
    /// One per engine, in `InProcess::engines` order.
    engines: Vec<EngineRun>,
    padded: Timed,
    background_cores: f64,
}

struct EngineRun {
    /// What its GEMMs multiply in.
    gemm: &'static str,
    timed: Timed,
    /// Smallest cosine between its embeddings and the padded baseline's, over every text.
    min_cosine: f64,
}

impl Comparison {
    /// The engine as the worker loads it by default.
    fn default_engine(&self) -> &EngineRun {
        &self.engines[0]
    }

    fn ratio(&self, engine: &EngineRun) -> f64 {
        engine.timed.tokens_per_s() / self.padded.tokens_per_s()
    }
}

struct InProcess {
    /// The engine as the worker loads it by default (bf16 GEMMs where the CPU has AVX512-BF16
    /// and runs them clearly faster, else f32), then with the other of the two where the CPU
    /// has it.
    engines: Vec<EmbeddingModel>,
    padded: PaddedBert,
}

impl InProcess {
    fn load(model_dir: &Path, default: EmbeddingModel) -> Result<InProcess> {
        let other = if default.gemm_dtype() == "f32" { DType::BF16 } else { DType::F32 };
        let mut engines = vec![default];
        match EmbeddingModel::load_with(model_dir, &LoadOptions { dtype: Some(other), ..LoadOptions::default() }) {
            Ok(engine) => engines.push(engine),
            Err(EngineError::Unsupported(why)) => println!("engine with {other:?} GEMMs not measured: {why}"),
            Err(e) => return Err(e).context(format!("loading the engine with {other:?} GEMMs")),
        }
        Ok(InProcess { engines, padded: PaddedBert::load(model_dir)? })
    }

    /// `rounds` passes of each implementation over `workload` in batches of `batch`, the
    /// order rotating between rounds; the first pass of each also checks agreement.
    fn compare(&self, workload: &Workload, batch: usize, rounds: usize) -> Result<Comparison> {
        let meter = CpuMeter::start(&[]);
        let texts: Vec<&str> = workload.texts.iter().map(String::as_str).collect();
        let batches: Vec<&[&str]> = texts.chunks(batch).collect();
        let tokenizer = &self.engines[0];
        // Warm-up: one batch each (allocator, thread pool, page cache of the weights).
        for engine in &self.engines {
            engine.embed(batches[0])?;
        }
        self.padded.embed(&tokenizer.tokenize_all(batches[0], true)?)?;

        // Contestants 0..n are the engines, n the padded baseline.
        let n = self.engines.len();
        let mut timed: Vec<Timed> = (0..=n).map(|_| Timed { tokens: workload.total_tokens(), ..Timed::default() }).collect();
        let mut outputs: Vec<Vec<Vec<f32>>> = vec![Vec::new(); n + 1];
        for round in 0..rounds {
            for turn in 0..=n {
                let who = (turn + round) % (n + 1);
                let started = Instant::now();
                for texts in &batches {
                    let t = Instant::now();
                    let vectors = match self.engines.get(who) {
                        Some(engine) => engine.embed(texts)?,
                        None => self.padded.embed(&tokenizer.tokenize_all(texts, true)?)?,
                    };
                    timed[who].batch_ms.push(t.elapsed().as_secs_f64() * 1e3);
                    if round == 0 {
                        outputs[who].extend(vectors);
                    }
                }
                timed[who].seconds.push(started.elapsed().as_secs_f64());
            }
        }
        let padded = timed.pop().expect("the padded baseline's timing");
        let engines = self
            .engines
            .iter()
            .zip(timed)
            .zip(&outputs)
            .map(|((engine, timed), out)| {
                let min_cosine = out.iter().zip(&outputs[n]).map(|(a, b)| cosine(a, b)).fold(1.0, f64::min);
                EngineRun { gemm: engine.gemm_dtype(), timed, min_cosine }
            })
            .collect();
        Ok(Comparison { batch, engines, padded, background_cores: meter.background_cores() })
    }
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let norm = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (norm(a) * norm(b))
}

// ---------------------------------------------------------------------------------------
// How busy the machine was with other work while a phase ran.
// ---------------------------------------------------------------------------------------

/// CPU used by other processes during a phase: all busy time in /proc/stat (steal included)
/// less what this benchmark and the processes it started used. The machine is shared, so
/// each figure carries it; a slow figure under background load is noise, not the code.
struct CpuMeter {
    busy: u64,
    own: u64,
    pids: Vec<u32>,
    started: Instant,
}

/// Linux reports CPU times in USER_HZ, 100 per second on every architecture it runs on.
const TICKS_PER_S: f64 = 100.0;

fn machine_busy_ticks() -> u64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let fields: Vec<u64> = stat.lines().next().unwrap_or_default().split_whitespace().skip(1).filter_map(|f| f.parse().ok()).collect();
    // user nice system idle iowait irq softirq steal
    [0, 1, 2, 5, 6, 7].iter().filter_map(|&i| fields.get(i)).sum()
}

/// utime + stime of `pid` (with `children`, also of its waited-for children).
fn process_ticks(pid: &str, children: bool) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name, which ends at the last ')': state is field 3, utime 14.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<u64> = after.split_whitespace().skip(1).map(|f| f.parse().unwrap_or(0)).collect();
    let take = if children { 4 } else { 2 };
    fields.iter().skip(10).take(take).sum()
}

impl CpuMeter {
    /// Starts measuring; `pids` are running children of this benchmark (server, worker).
    fn start(pids: &[u32]) -> CpuMeter {
        let mut meter = CpuMeter { busy: 0, own: 0, pids: pids.to_vec(), started: Instant::now() };
        (meter.busy, meter.own) = meter.sample();
        meter
    }

    fn sample(&self) -> (u64, u64) {
        let own = process_ticks("self", true) + self.pids.iter().map(|p| process_ticks(&p.to_string(), false)).sum::<u64>();
        (machine_busy_ticks(), own)
    }

    /// Cores' worth of other processes' work, on average, since `start`.
    fn background_cores(&self) -> f64 {
        let (busy, own) = self.sample();
        let other = (busy - self.busy) as f64 - (own - self.own) as f64;
        (other / TICKS_PER_S / self.started.elapsed().as_secs_f64()).max(0.0)
    }
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg").unwrap_or_default().split_whitespace().take(3).collect::<Vec<_>>().join(" ")
}

/// Steps 3 and 4 (only 4 with `--only gateway`) against the release binaries.
fn run_http(cli: &Cli, model_dir: &Path, workload: &Workload, report: &mut Report) -> Result<()> {
    let bin_dir = match &cli.bin_dir {
        Some(dir) => dir.clone(),
        None => std::env::current_exe()?.parent().context("the benchmark's folder")?.to_path_buf(),
    };
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(http(cli, &bin_dir, model_dir, workload, report))
}

// ---------------------------------------------------------------------------------------
// sentence-transformers on PyTorch CPU, as a subprocess.
// ---------------------------------------------------------------------------------------

/// The script's JSON, or why it was not measured.
fn sentence_transformers(cli: &Cli, model_dir: &Path, workload: &Workload) -> Result<Value, String> {
    let candidates: Vec<PathBuf> = match &cli.python {
        Some(python) => vec![python.clone()],
        None => vec![PathBuf::from("/tmp/tessera-st-venv/bin/python"), PathBuf::from("python3")],
    };
    let python = candidates
        .iter()
        .find(|p| {
            Command::new(p)
                .args(["-c", "import sentence_transformers, torch"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
        .ok_or_else(|| format!("no Python with sentence-transformers and torch among {candidates:?}; pass --python"))?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let texts = dir.path().join("texts.json");
    std::fs::write(&texts, serde_json::to_vec(&workload.texts).expect("strings serialise")).map_err(|e| e.to_string())?;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/sentence_transformers_baseline.py");
    let meter = CpuMeter::start(&[]);
    let output = Command::new(python)
        .arg(&script)
        .arg("--model")
        .arg(model_dir)
        .arg("--texts")
        .arg(&texts)
        .args(["--batch", &cli.batch.to_string(), "--rounds", &cli.st_rounds.to_string()])
        .output()
        .map_err(|e| format!("{}: {e}", python.display()))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        return Err(format!("{} failed: {}", script.display(), String::from_utf8_lossy(&output.stderr).trim()));
    }
    let mut result: Value = serde_json::from_str(stdout.lines().last().unwrap_or_default()).map_err(|e| format!("unreadable output of the script: {e}"))?;
    result["python"] = json!(python.display().to_string());
    result["background_cores"] = json!(round(meter.background_cores(), 2));
    Ok(result)
}

// ---------------------------------------------------------------------------------------
// Over HTTP: the release server and worker on loopback.
// ---------------------------------------------------------------------------------------

const WORKER_TOKEN: &str = "serving-bench-worker-token-at-least-32-bytes";
const ADMIN_PASSWORD: &str = "serving-bench-admin-password";
const DEPLOYMENT: &str = "minilm-bench";
const MODEL_FILES: &[&str] = &[
    "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
    "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json", "1_Pooling/config.json",
];

/// A child process whose output lines are collected; killed (by its own id) when dropped.
struct Process {
    name: &'static str,
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Process {
    fn spawn(name: &'static str, command: &mut Command) -> Result<Process> {
        let mut child = command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().with_context(|| format!("starting {name}"))?;
        let lines = Arc::new(Mutex::new(Vec::new()));
        let streams: [Box<dyn std::io::Read + Send>; 2] = [Box::new(child.stdout.take().expect("piped")), Box::new(child.stderr.take().expect("piped"))];
        for stream in streams {
            let lines = lines.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    lines.lock().expect("output lock").push(line);
                }
            });
        }
        Ok(Process { name, child, lines })
    }

    async fn wait_for_line(&mut self, needle: &str, timeout: Duration) -> Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(line) = self.lines.lock().expect("output lock").iter().find(|l| l.contains(needle)) {
                return Ok(line.clone());
            }
            if let Some(status) = self.child.try_wait()? {
                bail!("{} exited ({status}) before printing {needle:?}:\n{}", self.name, self.tail(40));
            }
            if Instant::now() > deadline {
                bail!("{} did not print {needle:?} in {timeout:?}:\n{}", self.name, self.tail(40));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn tail(&self, count: usize) -> String {
        let lines = self.lines.lock().expect("output lock");
        lines[lines.len().saturating_sub(count)..].join("\n")
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn ok_json(response: reqwest::Response, what: &str) -> Result<Value> {
    let status = response.status();
    let body = response.text().await?;
    ensure!(status.is_success(), "{what}: {status} {body}");
    Ok(serde_json::from_str(&body)?)
}

/// Reads `name`'s mean from the Prometheus text: `_sum` and `_count` for the deployment.
fn histogram_totals(metrics: &str, name: &str) -> (f64, f64) {
    let value = |suffix: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(&format!("{name}{suffix}{{")) && l.contains(&format!("deployment=\"{DEPLOYMENT}\"")))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (value("_sum"), value("_count"))
}

struct Level {
    concurrency: usize,
    requests: usize,
    tokens: usize,
    seconds: f64,
    latency_ms: Vec<f64>,
    queue_ms: Vec<f64>,
    inference_ms: Vec<f64>,
    mean_batch_size: f64,
    mean_batch_tokens: f64,
    background_cores: f64,
}

impl Level {
    fn tokens_per_s(&self) -> f64 {
        self.tokens as f64 / self.seconds
    }
}

/// Server-side timing header in milliseconds.
fn header_ms(response: &reqwest::Response, name: &str) -> f64 {
    response.headers().get(name).and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok()).unwrap_or(f64::NAN)
}

/// The running server and worker, as the load generators reach them.
struct Target {
    http: reqwest::Client,
    /// The server's base URL.
    url: String,
    api_token: String,
    session: String,
    /// The replica's engine endpoint and the worker's engine token.
    replica: (String, String),
    /// Server and worker, whose CPU time is this benchmark's own.
    pids: [u32; 2],
}

/// `concurrency` clients, each sending its next text as soon as its previous answer came,
/// until every text of the workload was sent once.
async fn closed_loop(target: &Target, workload: &Arc<Workload>, concurrency: usize) -> Result<Level> {
    let Target { http, url, api_token: token, .. } = target;
    let meter = CpuMeter::start(&target.pids);
    let metrics_before = http.get(format!("{url}/metrics")).send().await?.text().await?;
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let (http, url, token, workload, next) = (http.clone(), url.to_string(), token.to_string(), workload.clone(), next.clone());
        clients.spawn(async move {
            let mut samples = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(text) = workload.texts.get(i) else { return Ok::<_, anyhow::Error>(samples) };
                let t = Instant::now();
                let response = http
                    .post(format!("{url}/v1/embeddings"))
                    .bearer_auth(&token)
                    .json(&json!({"model": DEPLOYMENT, "input": text, "encoding_format": "float"}))
                    .send()
                    .await?;
                let (queue, inference) = (header_ms(&response, "x-queue-time"), header_ms(&response, "x-inference-time"));
                let body: Value = ok_json(response, "POST /v1/embeddings").await?;
                let ms = t.elapsed().as_secs_f64() * 1e3;
                let tokens = body["usage"]["prompt_tokens"].as_u64().context("usage.prompt_tokens")? as usize;
                ensure!(tokens == workload.tokens[i], "text {i}: the server counted {tokens} tokens, the engine {}", workload.tokens[i]);
                samples.push((ms, tokens, queue, inference));
            }
        });
    }
    let mut samples = Vec::new();
    while let Some(done) = clients.join_next().await {
        samples.extend(done??);
    }
    let seconds = started.elapsed().as_secs_f64();
    let metrics_after = http.get(format!("{url}/metrics")).send().await?.text().await?;
    let mean = |name: &str| {
        let (sum0, count0) = histogram_totals(&metrics_before, name);
        let (sum1, count1) = histogram_totals(&metrics_after, name);
        (sum1 - sum0) / (count1 - count0).max(1.0)
    };
    Ok(Level {
        concurrency,
        requests: samples.len(),
        tokens: samples.iter().map(|s| s.1).sum(),
        seconds,
        latency_ms: samples.iter().map(|s| s.0).collect(),
        queue_ms: samples.iter().map(|s| s.2).collect(),
        inference_ms: samples.iter().map(|s| s.3).collect(),
        mean_batch_size: mean("tessera_inference_batch_size"),
        mean_batch_tokens: mean("tessera_inference_batch_tokens"),
        background_cores: meter.background_cores(),
    })
}

struct Overhead {
    text: String,
    tokens: usize,
    direct_ms: Vec<f64>,
    gateway_api_token_ms: Vec<f64>,
    gateway_session_ms: Vec<f64>,
    background_cores: f64,
}

/// The same short text at concurrency 1: to the engine endpoint with the worker's engine
/// token, and to `/v1/embeddings` with an API token and with a session token, rotating which
/// goes first so drift in the machine's load falls on all three alike.
async fn gateway_overhead(target: &Target, text: &str, tokens: usize, measured: usize) -> Result<Overhead> {
    const WARM_UP: usize = 30;
    let Target { http, url, api_token, session, replica: (endpoint, engine_token), .. } = target;
    let meter = CpuMeter::start(&target.pids);
    let mut times: [Vec<f64>; 3] = Default::default();
    for i in 0..WARM_UP + measured {
        for k in 0..3 {
            let which = (i + k) % 3;
            let request = match which {
                0 => http.post(format!("{endpoint}/embed")).bearer_auth(engine_token).json(&json!({"inputs": [text], "truncate": true})),
                1 => http.post(format!("{url}/v1/embeddings")).bearer_auth(api_token).json(&json!({"model": DEPLOYMENT, "input": text, "encoding_format": "float"})),
                _ => http.post(format!("{url}/v1/embeddings")).bearer_auth(session).json(&json!({"model": DEPLOYMENT, "input": text, "encoding_format": "float"})),
            };
            let t = Instant::now();
            let response = request.send().await?;
            let status = response.status();
            let body = response.bytes().await?;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            ensure!(status.is_success(), "overhead request {which}: {status} {}", String::from_utf8_lossy(&body));
            if i >= WARM_UP {
                times[which].push(ms);
            }
        }
    }
    let [direct_ms, gateway_api_token_ms, gateway_session_ms] = times;
    Ok(Overhead { text: text.to_string(), tokens, direct_ms, gateway_api_token_ms, gateway_session_ms, background_cores: meter.background_cores() })
}

async fn http(cli: &Cli, bin_dir: &Path, model_dir: &Path, workload: &Workload, report: &mut Report) -> Result<()> {
    for name in ["tessera-server", "tessera-worker"] {
        ensure!(bin_dir.join(name).exists(), "{} is missing; run cargo build --release -p tessera-server -p tessera-worker (or pass --bin-dir)", bin_dir.join(name).display());
    }
    let data = tempfile::tempdir()?;
    let server_dir = data.path().join("server");
    let http = reqwest::Client::builder().tcp_nodelay(true).pool_idle_timeout(Duration::from_secs(90)).build()?;

    let mut server = Process::spawn(
        "tessera-server",
        Command::new(bin_dir.join("tessera-server"))
            .args(["--bind", "127.0.0.1:0", "--data-dir"])
            .arg(&server_dir)
            .env("TESSERA_ADMIN_PASSWORD", ADMIN_PASSWORD)
            .env("TESSERA_WORKER_TOKEN", WORKER_TOKEN)
            .env("TESSERA_HEARTBEAT_SECS", "1")
            .env_remove("TESSERA_DATABASE_URL"),
    )?;
    let line = server.wait_for_line("listening on http://", Duration::from_secs(60)).await?;
    let url = line.rsplit(' ').next().context("the server's URL")?.trim().to_string();

    let login = http.post(format!("{url}/api/v1/auth/login")).json(&json!({"username": "admin", "password": ADMIN_PASSWORD})).send().await?;
    let session = ok_json(login, "login").await?["token"].as_str().context("session token")?.to_string();
    let mut form = reqwest::multipart::Form::new().text("name", "minilm");
    for path in MODEL_FILES {
        let bytes = std::fs::read(model_dir.join(path)).with_context(|| format!("reading {path}"))?;
        form = form.part("files", reqwest::multipart::Part::bytes(bytes).file_name(path.to_string()));
    }
    ok_json(http.post(format!("{url}/api/v1/models")).bearer_auth(&session).multipart(form).send().await?, "model upload").await?;
    let created = http.post(format!("{url}/api/v1/tokens")).bearer_auth(&session).json(&json!({"name": "serving-bench"})).send().await?;
    let api_token = ok_json(created, "API token").await?["token"].as_str().context("API token")?.to_string();

    let worker = Process::spawn(
        "tessera-worker",
        Command::new(bin_dir.join("tessera-worker"))
            .args(["--server", &url, "--name", "bench-worker", "--data-dir"])
            .arg(data.path().join("worker"))
            .env("TESSERA_WORKER_TOKEN", WORKER_TOKEN),
    )?;
    let online = Instant::now();
    while !ok_json(http.get(format!("{url}/api/v1/workers")).bearer_auth(&session).send().await?, "workers").await?[0]["status"].eq("online") {
        ensure!(online.elapsed() < Duration::from_secs(60), "the worker did not come online:\n{}", worker.tail(20));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // A replica can fail to start for a reason that has nothing to do with serving (the
    // server sometimes answers a worker's log line with 500 "database is locked"); such a
    // deployment is deleted and created again, and the failures are reported.
    let mut failures = Vec::new();
    let (deployment, ready_s) = loop {
        let deploy_started = Instant::now();
        let created = http.post(format!("{url}/api/v1/deployments")).bearer_auth(&session).json(&json!({"name": DEPLOYMENT, "model": "minilm", "replicas": 1})).send().await?;
        let deployment = ok_json(created, "create deployment").await?;
        let state = loop {
            let d = ok_json(http.get(format!("{url}/api/v1/deployments/{DEPLOYMENT}")).bearer_auth(&session).send().await?, "deployment").await?;
            if d["state"] == "ready" || d["state"] == "failed" {
                break d;
            }
            ensure!(deploy_started.elapsed() < Duration::from_secs(300), "deployment not ready in 300 s: {d}\nworker:\n{}", worker.tail(20));
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        if state["state"] == "ready" {
            break (deployment, deploy_started.elapsed().as_secs_f64());
        }
        let reason = state["reason"].as_str().unwrap_or("no reason given").to_string();
        let server_errors: Vec<String> = server.tail(200).lines().filter(|l| l.contains("ERROR")).map(str::to_string).collect();
        println!("http: the deployment failed ({reason}); server errors: {}; deleting and creating it again", server_errors.join(" | "));
        failures.push(json!({"reason": reason, "server_errors": server_errors}));
        ensure!(failures.len() < 3, "the deployment failed 3 times:\nworker:\n{}\nserver:\n{}", worker.tail(20), server.tail(20));
        let deleted = http.delete(format!("{url}/api/v1/deployments/{DEPLOYMENT}")).bearer_auth(&session).send().await?;
        ensure!(deleted.status().is_success(), "deleting the failed deployment: {}", deleted.status());
        tokio::time::sleep(Duration::from_secs(2)).await;
    };

    // The replica's engine endpoint and the worker's engine token, where the gateway reads them.
    let db = format!("sqlite://{}?mode=ro", server_dir.join("tessera.db").display());
    let mut conn = <sqlx::SqliteConnection as sqlx::Connection>::connect(&db).await?;
    let replica: (String, String) = sqlx::query_as(
        "SELECT j.endpoint, w.engine_token FROM jobs j JOIN workers w ON w.id = j.worker_id \
         JOIN deployments d ON d.id = j.deployment_id \
         WHERE d.name = ?1 AND j.state = 'running' AND j.endpoint IS NOT NULL",
    )
    .bind(DEPLOYMENT)
    .fetch_one(&mut conn)
    .await
    .context("the ready replica's endpoint")?;
    drop(conn);
    let limits = (deployment["max_batch_tokens"].as_u64().unwrap_or(0), deployment["max_batch_requests"].as_u64().unwrap_or(0));
    println!(
        "http: server {url}, worker replica at {} (ready {ready_s:.1} s after the deployment was created); batching limits {} tokens, {} requests",
        replica.0, limits.0, limits.1
    );
    report.http_setup(&url, &replica.0, ready_s, limits, failures);

    // Warm-up through the gateway (connections, allocator, the gateway's route cache).
    let target = Target { http, url, api_token, session, replica, pids: [server.child.id(), worker.child.id()] };
    let warm = Arc::new(workload.prefix(64));
    closed_loop(&target, &warm, 4).await?;

    let shared = Arc::new(workload.prefix(workload.texts.len()));
    let levels: &[usize] = if cli.only == Some(Only::Gateway) { &[] } else { &cli.concurrency };
    for &concurrency in levels {
        let level = closed_loop(&target, &shared, concurrency).await?;
        report.level(&level);
    }

    let short = workload
        .texts
        .iter()
        .zip(&workload.tokens)
        .find(|(_, &t)| (10..=16).contains(&t))
        .map(|(text, &t)| (text.clone(), t))
        .context("a short text in the workload")?;
    let overhead = gateway_overhead(&target, &short.0, short.1, cli.overhead_requests).await?;
    report.overhead(&overhead);
    drop(worker);
    drop(server);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Figures: printed as they come, collected into the result files.
// ---------------------------------------------------------------------------------------

fn round(value: f64, digits: i32) -> f64 {
    let scale = 10f64.powi(digits);
    (value * scale).round() / scale
}

/// Nearest-rank percentile.
fn percentile(values: &[f64], p: f64) -> f64 {
    let mut sorted: Vec<f64> = values.iter().copied().filter(|v| !v.is_nan()).collect();
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank - 1]
}

/// Where, when and how this run happened, for the result files.
struct RunFacts {
    cpu: String,
    cores: usize,
    date: String,
    command: String,
}

impl RunFacts {
    fn now() -> RunFacts {
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| s.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split(':').nth(1)).map(|m| m.trim().to_string()))
            .unwrap_or_else(|| "unknown CPU".into());
        let args: Vec<String> = std::env::args().skip(1).collect();
        RunFacts {
            cpu,
            cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
            date: chrono::Utc::now().format("%Y-%m-%d %H:%M UTC").to_string(),
            command: format!(
                "cargo build --release -p tessera-server -p tessera-worker && cargo run --release -p tessera-bench --bin serving{}",
                if args.is_empty() { String::new() } else { format!(" -- {}", args.join(" ")) }
            ),
        }
    }
}

fn latency_json(ms: &[f64]) -> Value {
    json!({"p50": round(percentile(ms, 50.0), 2), "p99": round(percentile(ms, 99.0), 2)})
}

#[derive(Default)]
struct Report {
    json: serde_json::Map<String, Value>,
    /// Markdown sections in order.
    md: Vec<String>,
    /// The default engine's in-process figures at the comparison's batch size.
    engine_tokens_per_s: f64,
    padded_ratio: f64,
    /// Every engine's (GEMM dtype, tokens/s, ratio over padded) there, the default first.
    engines: Vec<(&'static str, f64, f64)>,
    st_arrival: Option<f64>,
    st_sorted: Option<f64>,
    st_missing: Option<String>,
    overhead_ms: Option<f64>,
    overhead_session_ms: Option<f64>,
    levels: Vec<Value>,
    /// /proc/loadavg when the run began.
    load_at_start: String,
    /// The engine's highest throughput of the run: tokens/s, where, other processes' cores.
    best_engine: Option<(f64, String, f64)>,
}

impl Report {
    fn engine_figure(&mut self, tokens_per_s: f64, place: String, background_cores: f64) {
        if self.best_engine.as_ref().is_none_or(|best| tokens_per_s > best.0) {
            self.best_engine = Some((tokens_per_s, place, background_cores));
        }
    }

    fn workload(&mut self, w: &Workload, batch: usize) {
        let tokens: Vec<f64> = w.tokens.iter().map(|&t| t as f64).collect();
        let mean = tokens.iter().sum::<f64>() / tokens.len() as f64;
        let (p50, p90, p99) = (percentile(&tokens, 50.0), percentile(&tokens, 90.0), percentile(&tokens, 99.0));
        let max = w.tokens.iter().max().copied().unwrap_or(0);
        let short = w.tokens.iter().filter(|&&t| t <= 32).count() as f64 / w.tokens.len() as f64;
        let padded = w.padded_tokens(batch);
        println!(
            "workload: {} texts, {} real tokens; tokens per text mean {mean:.1}, p50 {p50}, p90 {p90}, p99 {p99}, max {max}; {:.0}% of texts ≤ 32 tokens",
            w.texts.len(),
            w.total_tokens(),
            short * 100.0
        );
        println!("workload: padded to each batch's longest (batch {batch}, arrival order) = {padded} tokens, {:.2}× the real ones", padded as f64 / w.total_tokens() as f64);
        let mix: Vec<Value> = MIX.iter().map(|(share, kind)| json!({"kind": kind, "share": share})).collect();
        self.json.insert(
            "workload".into(),
            json!({
                "texts": w.texts.len(), "real_tokens": w.total_tokens(), "sources": w.sources, "mix": mix,
                "tokens_per_text": {"mean": round(mean, 1), "p50": p50, "p90": p90, "p99": p99, "max": max},
                "share_at_most_32_tokens": round(short, 3),
                "padded_tokens_batch": {"batch": batch, "tokens": padded, "times_real": round(padded as f64 / w.total_tokens() as f64, 2)},
            }),
        );
        let shares: Vec<String> = MIX.iter().map(|(s, k)| format!("{:.0}% {k}", s * 100.0)).collect();
        self.md.push(format!(
            "## Workload\n\n{} texts in a fixed, seeded arrival order, cut from {} (real text): {}. \
             Tokens per text (after truncation to 256, [CLS]/[SEP] included): mean {mean:.1}, p50 {p50}, p90 {p90}, p99 {p99}, max {max}; \
             {:.0}% of texts have ≤ 32 tokens. {} real tokens in all; padded to each batch's longest in batches of {batch} they are {padded} ({:.2}×).\n",
            w.texts.len(),
            w.sources.iter().map(|s| format!("`{}`", s.rsplit('/').next().unwrap_or(s))).collect::<Vec<_>>().join(", "),
            shares.join(", "),
            short * 100.0,
            w.total_tokens(),
            padded as f64 / w.total_tokens() as f64
        ));
    }

    fn in_process(&mut self, c: &Comparison) {
        let rounds = c.padded.seconds.len();
        let rows = c.engines.iter().map(|e| (format!("engine (packed, {} GEMMs)", e.gemm), &e.timed));
        for (name, t) in rows.chain([("padded candle BertModel".to_string(), &c.padded)]) {
            println!(
                "in-process batch {} {name}: {:.0} real tokens/s (rounds: {}), batch latency p50 {:.1} ms, p99 {:.1} ms",
                c.batch,
                t.tokens_per_s(),
                t.seconds.iter().map(|s| format!("{:.0}", t.tokens as f64 / s)).collect::<Vec<_>>().join(", "),
                percentile(&t.batch_ms, 50.0),
                percentile(&t.batch_ms, 99.0)
            );
        }
        for e in &c.engines {
            println!(
                "in-process batch {} engine ({} GEMMs)/padded throughput: {:.2}×; min cosine vs padded {:.6} (other processes used {:.2} cores meanwhile)",
                c.batch,
                e.gemm,
                c.ratio(e),
                e.min_cosine,
                c.background_cores
            );
        }
        let default = c.default_engine();
        self.engine_tokens_per_s = default.timed.tokens_per_s();
        self.padded_ratio = c.ratio(default);
        self.engines = c.engines.iter().map(|e| (e.gemm, e.timed.tokens_per_s(), c.ratio(e))).collect();
        self.engine_figure(default.timed.tokens_per_s(), format!("in process at batch {}", c.batch), c.background_cores);
        let engines: Vec<Value> = c
            .engines
            .iter()
            .map(|e| json!({"gemm": e.gemm, "timing": e.timed.json(), "over_padded": round(c.ratio(e), 2), "min_cosine_vs_padded": round(e.min_cosine, 6)}))
            .collect();
        self.json.insert(
            "in_process".into(),
            json!({
                "batch": c.batch, "order": "arrival", "rounds": rounds, "tokenization_included": true,
                "engine": default.timed.json(), "engine_gemm": default.gemm, "engines": engines, "padded_candle": c.padded.json(),
                "engine_over_padded": round(c.ratio(default), 2), "min_cosine_engine_vs_padded": round(default.min_cosine, 6),
                "background_cores": round(c.background_cores, 2),
            }),
        );
        let mut table = String::from("| | real tokens/s | batch p50 (ms) | batch p99 (ms) | / padded | lowest cosine vs padded |\n|---|---:|---:|---:|---:|---:|\n");
        for e in &c.engines {
            let t = &e.timed;
            table.push_str(&format!(
                "| engine (packed), {} GEMMs | {:.0} | {:.1} | {:.1} | **{:.2}×** | {:.6} |\n",
                e.gemm,
                t.tokens_per_s(),
                percentile(&t.batch_ms, 50.0),
                percentile(&t.batch_ms, 99.0),
                c.ratio(e),
                e.min_cosine
            ));
        }
        table.push_str(&format!(
            "| padded candle `BertModel` (f32) | {:.0} | {:.1} | {:.1} | 1× | |\n",
            c.padded.tokens_per_s(),
            percentile(&c.padded.batch_ms, 50.0),
            percentile(&c.padded.batch_ms, 99.0)
        ));
        self.md.push(format!(
            "## In process, batch {b}, arrival order\n\nEvery implementation gets the same batches of {b} consecutive texts; \
             tokenization is inside the timing; {rounds} rounds each, the order rotating between rounds. The first engine row is the worker's \
             default on this CPU ({gemm} GEMMs: see README, \"CPU precision\"); GEMMs accumulate in f32 either way and every other op is f32.\n\n{table}\n\
             Other processes used {:.2} cores on average meanwhile.\n",
            c.background_cores,
            b = c.batch,
            gemm = default.gemm,
        ));
    }

    fn sweep(&mut self, batch: usize, w: &Workload, c: &Comparison) {
        // One table row per engine; stdout gets the same rows.
        let rows: Vec<String> = c
            .engines
            .iter()
            .map(|e| {
                format!(
                    "| {batch} | {} | {:.0} | {:.1} / {:.1} | {:.0} | {:.1} / {:.1} | {:.2}× | {:.2} |\n",
                    e.gemm,
                    e.timed.tokens_per_s(),
                    percentile(&e.timed.batch_ms, 50.0),
                    percentile(&e.timed.batch_ms, 99.0),
                    c.padded.tokens_per_s(),
                    percentile(&c.padded.batch_ms, 50.0),
                    percentile(&c.padded.batch_ms, 99.0),
                    c.ratio(e),
                    c.background_cores
                )
            })
            .collect();
        for row in &rows {
            print!("in-process sweep, {} texts (n | GEMMs | engine tokens/s | engine batch p50 / p99 ms | padded tokens/s | padded batch p50 / p99 ms | engine / padded | background cores): {row}", w.texts.len());
        }
        let default = c.default_engine();
        self.engine_figure(default.timed.tokens_per_s(), format!("in process at batch {batch}"), c.background_cores);
        let engines: Vec<Value> = c.engines.iter().map(|e| json!({"gemm": e.gemm, "timing": e.timed.json(), "over_padded": round(c.ratio(e), 2)})).collect();
        let entry = json!({"batch": batch, "texts": w.texts.len(), "engines": engines, "padded_candle": c.padded.json(), "background_cores": round(c.background_cores, 2)});
        let sweep = self.json.entry("in_process_batch_sweep").or_insert_with(|| json!([]));
        sweep.as_array_mut().expect("an array").push(entry);
        if self.md.last().is_none_or(|s| !s.starts_with("## In process by batch size")) {
            self.md.push(format!(
                "## In process by batch size\n\nThe first {} texts, batches of n consecutive texts (what a server batches from n concurrent \
                 single-text clients), one pass each. \
                 At n = 1 nothing is padded, so those rows compare the implementations alone.\n\n| n | GEMMs | engine tokens/s | engine batch p50 / p99 (ms) | padded tokens/s | padded batch p50 / p99 (ms) | engine / padded | background cores |\n|---:|---|---:|---:|---:|---:|---:|---:|\n",
                w.texts.len()
            ));
        }
        let section = self.md.last_mut().expect("the section was just added");
        rows.iter().for_each(|row| section.push_str(row));
    }

    fn sentence_transformers(&mut self, result: Result<Value, String>) {
        match result {
            Ok(r) => {
                let arrival = r["arrival"]["tokens_per_s"].as_f64().unwrap_or(f64::NAN);
                let sorted = r["sorted"]["tokens_per_s"].as_f64().unwrap_or(f64::NAN);
                let versions = format!("sentence-transformers {}, torch {}, {} threads", r["sentence_transformers"].as_str().unwrap_or("?"), r["torch"].as_str().unwrap_or("?"), r["torch_threads"]);
                println!(
                    "sentence-transformers batch {} arrival order ({versions}): {arrival:.0} real tokens/s, batch p50 {} ms, p99 {} ms",
                    r["batch"], r["arrival"]["batch_latency_ms"]["p50"].as_f64().map_or(f64::NAN, |v| round(v, 1)), r["arrival"]["batch_latency_ms"]["p99"].as_f64().map_or(f64::NAN, |v| round(v, 1))
                );
                println!("sentence-transformers encode(all, batch_size={}) sorted by length: {sorted:.0} real tokens/s (background {} cores)", r["batch"], r["background_cores"]);
                for &(gemm, tokens_per_s, _) in &self.engines {
                    println!("engine ({gemm} GEMMs) / sentence-transformers: {:.2}× (arrival order), {:.2}× (its own length-sorted encode)", tokens_per_s / arrival, tokens_per_s / sorted);
                }
                let header: String = self.engines.iter().map(|(gemm, ..)| format!(" engine ({gemm} GEMMs) / this |")).collect();
                let ratios = |st: f64| -> String { self.engines.iter().map(|(_, tokens_per_s, _)| format!(" {:.2}× |", tokens_per_s / st)).collect() };
                self.md.push(format!(
                    "## sentence-transformers on PyTorch CPU\n\n{versions}, f32; `{}` over the same texts, batch {}. \
                     *Arrival order*: `encode` on each batch of consecutive texts, the batches the engine got. \
                     *Sorted*: one `encode(all_texts, batch_size={})`, which sorts all texts by length first — an offline advantage a server does not have. \
                     Other processes used {} cores on average meanwhile.\n\n\
                     | | real tokens/s |{header}\n|---|---:|{}\n| arrival order | {arrival:.0} |{}\n| sorted by length | {sorted:.0} |{}\n",
                    r["python"].as_str().unwrap_or("?"),
                    r["batch"],
                    r["batch"],
                    r["background_cores"],
                    "---:|".repeat(self.engines.len()),
                    ratios(arrival),
                    ratios(sorted),
                ));
                self.st_arrival = Some(arrival);
                self.st_sorted = Some(sorted);
                self.json.insert("sentence_transformers".into(), r);
            }
            Err(reason) => {
                println!("sentence-transformers: not measured ({reason})");
                self.md.push(format!("## sentence-transformers on PyTorch CPU\n\nNot measured in this run: {reason}.\n"));
                self.json.insert("sentence_transformers".into(), json!({"measured": false, "reason": reason}));
                self.st_missing = Some(reason);
            }
        }
    }

    fn http_setup(&mut self, url: &str, endpoint: &str, ready_s: f64, limits: (u64, u64), failures: Vec<Value>) {
        let retried = if failures.is_empty() {
            String::new()
        } else {
            format!(" The deployment failed to start {} time(s) and was created again (reasons in serving.json).", failures.len())
        };
        self.json.insert(
            "http_setup".into(),
            json!({"server": url, "replica_endpoint": endpoint, "deployment_ready_s": round(ready_s, 1),
                   "max_batch_tokens": limits.0, "max_batch_requests": limits.1, "client": "one text per request, closed loop, API token, encoding_format float",
                   "failed_deployment_attempts": failures}),
        );
        self.md.push(format!(
            "## Over HTTP: release `tessera-server` + `tessera-worker` on loopback\n\n\
             One deployment, one replica, default batching limits ({} tokens, {} requests per batch). Closed-loop clients each send one text per \
             `POST /v1/embeddings` (API token, `encoding_format: float`) until every text of the workload was sent once. The clients, the server and \
             the worker share the same cores. Latency is the client's; queue (from the worker receiving the request, tokenization included, to its batch \
             starting) and inference are the worker's timing headers; the batch is the mean, over requests, of the batch each was computed in \
             (the server's Prometheus histograms). The worker runs with its default `--cpu-precision auto`.{retried}\n\n\
             | clients | requests | real tokens/s | p50 (ms) | p99 (ms) | queue p50 (ms) | inference p50 (ms) | batch per request (texts / tokens) | background cores |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
            limits.0,
            limits.1
        ));
    }

    fn level(&mut self, l: &Level) {
        println!(
            "http concurrency {}: {:.0} real tokens/s ({} requests, {:.1} req/s), latency p50 {:.1} ms, p99 {:.1} ms; worker queue p50 {:.1} ms, inference p50 {:.1} ms; batch a request rode in: mean {:.1} texts, {:.0} tokens (background {:.2} cores)",
            l.concurrency,
            l.tokens_per_s(),
            l.requests,
            l.requests as f64 / l.seconds,
            percentile(&l.latency_ms, 50.0),
            percentile(&l.latency_ms, 99.0),
            percentile(&l.queue_ms, 50.0),
            percentile(&l.inference_ms, 50.0),
            l.mean_batch_size,
            l.mean_batch_tokens,
            l.background_cores
        );
        let entry = json!({
            "concurrency": l.concurrency, "requests": l.requests, "real_tokens": l.tokens, "seconds": round(l.seconds, 2),
            "tokens_per_s": round(l.tokens_per_s(), 0), "requests_per_s": round(l.requests as f64 / l.seconds, 1),
            "latency_ms": latency_json(&l.latency_ms), "worker_queue_ms": latency_json(&l.queue_ms), "worker_inference_ms": latency_json(&l.inference_ms),
            "mean_batch_size": round(l.mean_batch_size, 2), "mean_batch_tokens": round(l.mean_batch_tokens, 0),
            "background_cores": round(l.background_cores, 2),
        });
        self.levels.push(entry);
        self.engine_figure(l.tokens_per_s(), format!("over HTTP with {} clients", l.concurrency), l.background_cores);
        self.json.insert("http".into(), json!(self.levels));
        let section = self.md.last_mut().expect("http_setup came first");
        section.push_str(&format!(
            "| {} | {} | {:.0} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} / {:.0} | {:.2} |\n",
            l.concurrency,
            l.requests,
            l.tokens_per_s(),
            percentile(&l.latency_ms, 50.0),
            percentile(&l.latency_ms, 99.0),
            percentile(&l.queue_ms, 50.0),
            percentile(&l.inference_ms, 50.0),
            l.mean_batch_size,
            l.mean_batch_tokens,
            l.background_cores
        ));
    }

    fn overhead(&mut self, o: &Overhead) {
        let p50 = |v: &[f64]| percentile(v, 50.0);
        let paired = |gateway: &[f64]| {
            let diffs: Vec<f64> = gateway.iter().zip(&o.direct_ms).map(|(g, d)| g - d).collect();
            percentile(&diffs, 50.0)
        };
        let api = p50(&o.gateway_api_token_ms) - p50(&o.direct_ms);
        let session = p50(&o.gateway_session_ms) - p50(&o.direct_ms);
        println!(
            "gateway overhead ({} requests each, a {}-token text, concurrency 1): direct to the worker p50 {:.2} ms (p99 {:.2}); through the server with an API token p50 {:.2} ms (p99 {:.2}), with a session token p50 {:.2} ms (p99 {:.2})",
            o.direct_ms.len(),
            o.tokens,
            p50(&o.direct_ms),
            percentile(&o.direct_ms, 99.0),
            p50(&o.gateway_api_token_ms),
            percentile(&o.gateway_api_token_ms, 99.0),
            p50(&o.gateway_session_ms),
            percentile(&o.gateway_session_ms, 99.0)
        );
        println!(
            "gateway p50 overhead: {api:.2} ms with an API token (median paired difference {:.2} ms), {session:.2} ms with a session token (paired {:.2} ms) (background {:.2} cores)",
            paired(&o.gateway_api_token_ms),
            paired(&o.gateway_session_ms),
            o.background_cores
        );
        self.overhead_ms = Some(api);
        self.overhead_session_ms = Some(session);
        self.json.insert(
            "gateway_overhead".into(),
            json!({
                "text": o.text, "tokens": o.tokens, "requests_each": o.direct_ms.len(), "concurrency": 1,
                "direct_ms": latency_json(&o.direct_ms), "gateway_api_token_ms": latency_json(&o.gateway_api_token_ms), "gateway_session_ms": latency_json(&o.gateway_session_ms),
                "p50_overhead_api_token_ms": round(api, 3), "p50_overhead_session_ms": round(session, 3),
                "median_paired_difference_api_token_ms": round(paired(&o.gateway_api_token_ms), 3),
                "median_paired_difference_session_ms": round(paired(&o.gateway_session_ms), 3),
                "background_cores": round(o.background_cores, 2),
            }),
        );
        self.md.push(format!(
            "## Gateway overhead\n\nThe text {:?} ({} tokens), one request at a time, {} times each way, the three ways interleaved: straight to the \
             worker's engine endpoint (`POST <replica>/embed` with the worker's engine token, as the gateway calls it), and `POST /v1/embeddings` \
             through the server with an API token and with a session token.\n\n\
             | path | p50 (ms) | p99 (ms) |\n|---|---:|---:|\n| direct to the worker | {:.2} | {:.2} |\n| gateway, API token | {:.2} | {:.2} |\n| gateway, session token | {:.2} | {:.2} |\n\n\
             p50 added by the server: **{api:.2} ms** with an API token (median of paired differences {:.2} ms), {session:.2} ms with a session token. \
             Other processes used {:.2} cores on average meanwhile.\n",
            o.text,
            o.tokens,
            o.direct_ms.len(),
            p50(&o.direct_ms),
            percentile(&o.direct_ms, 99.0),
            p50(&o.gateway_api_token_ms),
            percentile(&o.gateway_api_token_ms, 99.0),
            p50(&o.gateway_session_ms),
            percentile(&o.gateway_session_ms, 99.0),
            paired(&o.gateway_api_token_ms),
            o.background_cores,
        ));
    }

    fn goals(&mut self) {
        let met = |ok: bool| if ok { "met" } else { "NOT met" };
        let mut lines = Vec::new();
        let mut goals = serde_json::Map::new();

        // The figures of the engines other than the default, as " (f32 GEMMs: …)".
        let others = |figure: &dyn Fn(f64, f64) -> String| -> String {
            let parts: Vec<String> = self.engines.iter().skip(1).map(|&(gemm, tps, ratio)| format!("{gemm} GEMMs: {}", figure(tps, ratio))).collect();
            if parts.is_empty() { String::new() } else { format!(" ({})", parts.join("; ")) }
        };
        let default_gemm = self.engines.first().map_or("?", |e| e.0);

        let ok = self.padded_ratio >= 2.0;
        lines.push(format!(
            "≥ 2× the padded candle baseline's throughput on this mix (in process, batch 32): {} — {:.2}× with the default {default_gemm} GEMMs{}.",
            met(ok),
            self.padded_ratio,
            others(&|_, ratio| format!("{ratio:.2}×"))
        ));
        goals.insert("engine_over_padded".into(), json!({"value": round(self.padded_ratio, 2), "target": 2.0, "met": ok}));

        match (self.st_arrival, self.st_sorted) {
            (Some(arrival), Some(sorted)) => {
                let (ra, rs) = (self.engine_tokens_per_s / arrival, self.engine_tokens_per_s / sorted);
                lines.push(format!(
                    "≥ 2× sentence-transformers on PyTorch CPU, measured in this run: {} against the same arrival-order batches ({ra:.2}×), {} against its own length-sorted encode ({rs:.2}×), with the default {default_gemm} GEMMs{}.",
                    met(ra >= 2.0),
                    met(rs >= 2.0),
                    others(&|tps, _| format!("{:.2}× and {:.2}×", tps / arrival, tps / sorted))
                ));
                goals.insert("engine_over_sentence_transformers".into(), json!({"arrival_order": round(ra, 2), "length_sorted": round(rs, 2), "target": 2.0, "met_arrival_order": ra >= 2.0, "met_length_sorted": rs >= 2.0}));
            }
            _ => {
                let reason = self.st_missing.clone().unwrap_or_default();
                lines.push(format!("≥ 2× sentence-transformers on PyTorch CPU: not measured in this run ({reason})."));
                goals.insert("engine_over_sentence_transformers".into(), json!({"measured": false, "reason": reason}));
            }
        }

        let ok = self.engine_tokens_per_s >= 6500.0;
        let (best, place, background) = self.best_engine.clone().unwrap_or((f64::NAN, String::new(), f64::NAN));
        lines.push(format!(
            "≥ 6,500 real tokens/s (the issue's 2 × ~3,100 for sentence-transformers at batch 32): {} — {:.0} tokens/s in process at batch 32 with the default {default_gemm} GEMMs{}; \
             the default engine's best figure of the run was {best:.0} tokens/s ({place}, other processes using {background:.2} cores).",
            met(ok),
            self.engine_tokens_per_s,
            others(&|tps, _| format!("{tps:.0} tokens/s"))
        ));
        goals.insert(
            "engine_tokens_per_s".into(),
            json!({"value": round(self.engine_tokens_per_s, 0), "gemm": default_gemm, "target": 6500, "met": ok,
                   "best_of_run": {"tokens_per_s": round(best, 0), "where": place, "background_cores": round(background, 2)}}),
        );

        match self.gateway_goal() {
            Some((line, value)) => {
                lines.push(line);
                goals.insert("gateway_p50_overhead_ms".into(), value);
            }
            None => lines.push("The gateway adds < 1 ms p50: not measured (--no-http).".into()),
        }
        for line in &lines {
            println!("goal: {line}");
        }
        self.json.insert("goals".into(), Value::Object(goals));
        self.md.insert(0, format!("## Goals (issue 3, Performance)\n\n{}\n", lines.iter().map(|l| format!("- {l}")).collect::<Vec<_>>().join("\n")));
    }

    /// The gateway goal's line and JSON, once the overhead was measured.
    fn gateway_goal(&self) -> Option<(String, Value)> {
        let met = |ok: bool| if ok { "met" } else { "NOT met" };
        let api = self.overhead_ms?;
        let session = self.overhead_session_ms.unwrap_or(f64::NAN);
        let line = format!(
            "The gateway adds < 1 ms p50 over calling the worker directly: {} — {api:.2} ms with an API token ({} — {session:.2} ms with a session token).",
            met(api < 1.0),
            met(session < 1.0)
        );
        let value = json!({"api_token": round(api, 3), "session_token": round(session, 3), "target_below": 1.0, "met": api < 1.0, "met_with_session_token": session < 1.0});
        Some((line, value))
    }

    /// `--only gateway`: replaces the gateway section and goal of an earlier full run's
    /// files, noting when, how and under what load it was measured again.
    fn update_gateway(mut self, dir: &Path, seconds: f64) -> Result<()> {
        let (json_path, md_path) = (dir.join("serving.json"), dir.join("serving.md"));
        let earlier = "--only gateway updates the files of an earlier full run; run the whole benchmark first";
        let mut doc: Value = serde_json::from_str(&std::fs::read_to_string(&json_path).context(earlier)?)?;
        let mut md = std::fs::read_to_string(&md_path).context(earlier)?;
        let run = RunFacts::now();
        let load_at_end = load_average();
        let (goal_line, goal) = self.gateway_goal().context("the gateway was not measured")?;
        let mut overhead = self.json.remove("gateway_overhead").context("the gateway was not measured")?;
        overhead["measured_separately"] = json!({"date": run.date, "command": run.command, "run_seconds": round(seconds, 0),
            "machine": {"nproc": run.cores, "cpu": run.cpu, "load_average_at_start": self.load_at_start, "load_average_at_end": load_at_end}});
        doc["gateway_overhead"] = overhead;
        doc["goals"]["gateway_p50_overhead_ms"] = goal;
        std::fs::write(&json_path, serde_json::to_string_pretty(&doc)? + "\n")?;

        let section = self.md.iter().find(|s| s.starts_with("## Gateway overhead")).context("the gateway section")?;
        let (heading, body) = section.split_once("\n\n").context("the gateway section's heading")?;
        let section = format!(
            "{heading}\n\nMeasured again on its own on {} with `{}` ({:.0} s; load average {} at the start, {load_at_end} at the end); \
             the other sections are from the full run above.\n\n{body}",
            run.date, run.command, seconds, self.load_at_start
        );
        let start = md.find("## Gateway overhead").context("serving.md has no gateway section")?;
        let end = md[start + 2..].find("\n## ").map_or(md.len(), |i| start + 2 + i + 1);
        md.replace_range(start..end, &section);
        let goal_start = md.find("- The gateway adds").context("serving.md has no gateway goal")?;
        let goal_end = md[goal_start..].find('\n').map_or(md.len(), |i| goal_start + i);
        md.replace_range(goal_start..goal_end, &format!("- {goal_line} (Measured again on {}.)", run.date));
        std::fs::write(&md_path, md)?;
        println!("updated the gateway section of {} and serving.md", json_path.display());
        Ok(())
    }

    fn write(mut self, dir: &Path, seconds: f64) -> Result<()> {
        let RunFacts { cpu, cores, date, command } = RunFacts::now();
        let mut top = serde_json::Map::new();
        top.insert("benchmark".into(), json!("serving"));
        top.insert("model".into(), json!("all-MiniLM-L6-v2 (f32, max_seq_length 256)"));
        top.insert("command".into(), json!(command));
        top.insert("date".into(), json!(date));
        let load_at_end = load_average();
        top.insert("machine".into(), json!({"nproc": cores, "cpu": cpu, "load_average_at_start": self.load_at_start, "load_average_at_end": load_at_end}));
        top.insert("run_seconds".into(), json!(round(seconds, 0)));
        top.append(&mut self.json);
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("serving.json"), serde_json::to_string_pretty(&Value::Object(top))? + "\n")?;
        let md = format!(
            "# Serving benchmark: all-MiniLM-L6-v2\n\nMachine: {cpu}, {cores} cores (`nproc`), shared with other work: load average {} at the start, {load_at_end} at the end \
             (each section says how many cores other processes used while it ran). Date: {date}. Run time {seconds:.0} s.\n\nCommand:\n\n```\n{command}\n```\n\n{}",
            self.load_at_start,
            self.md.join("\n")
        );
        std::fs::write(dir.join("serving.md"), md)?;
        println!("wrote {} and serving.md", dir.join("serving.json").display());
        Ok(())
    }
}
