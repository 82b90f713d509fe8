//! GPU serving benchmark (issue 4), everything in one run on one GPU so the ratios share its
//! state:
//!
//! 1. this engine on CUDA: packed batches (no padding anywhere), our kernels, cuBLAS GEMMs;
//! 2. our own padded path: candle-transformers' `BertEncoder` under our own embeddings and
//!    attention mask (see [`PaddedBert`]) on the same GPU, each batch padded to its longest
//!    sequence, masked mean pooling and L2 normalisation;
//! 3. HF `transformers` on PyTorch, fp16, SDPA attention, padded to the longest in batch
//!    (bench/scripts/hf_transformers_gpu.py, a subprocess), when a Python with them is found;
//! 4. the GEMMs alone: the encoder's four projections per layer at each batch's token count,
//!    in the benchmark's dtype, as a share of the GPU's dense bf16 tensor peak (the same
//!    datasheet figure as dense fp16 on the GPUs in [`peak_tflops`]);
//! 5. one layer's attention alone: the kernel the engine's plan takes for the batch, and where
//!    that is the tensor-core kernel, the same batch on the CUDA-core kernels beside it.
//!
//! Models: a BERT-base-sized encoder with random weights (shapes are what speed depends on)
//! and all-MiniLM-L6-v2. Batches of 1 to 256 sequences with lengths uniform in [1, max] for
//! max in {64, 128, 256, 512}, ids from the BERT vocabulary; the same batches go to all three.
//! Throughput counts real tokens only (padding never counts); latency is one call from host
//! token ids to host embeddings. The engine's embeddings of each batch's first two sequences
//! are compared (cosine) with the padded path's and HF's, so a fast wrong answer cannot pass
//! unseen: a missing baseline or a cosine below [`AGREEMENT`] is listed in the closing summary
//! and makes the exit status non-zero.
//!
//! Prints one line per figure; rewrites bench/results/gpu_serving.{json,md} after every
//! measured config, so a run cut short keeps what it measured ("complete": false). Run from
//! the repository root (the exact command, with the toolchain and the run on the GPU machine,
//! is in bench/README.md):
//!   gpu_serving --minilm .assets/all-MiniLM-L6-v2 --python python3

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::{embedding, layer_norm, Embedding, LayerNorm, Module, VarBuilder};
use candle_transformers::models::bert::{BertEncoder, Config as BertConfig};
use clap::Parser;
use serde_json::{json, Value};
use tessera_worker::engine::ops::cuda::compute_cap;
use tessera_worker::engine::ops::varlen_attention::cuda::{attention_plan, AttentionKernel};
use tessera_worker::engine::ops::VarlenAttention;
use tessera_worker::engine::synthetic::RandomBert;
use tessera_worker::engine::{Batch, EmbeddingModel, LoadOptions, Pooling};

/// Lowest cosine between the engine's embedding of a sequence and another implementation's
/// that still counts as the same answer. f16 runs agree to about 0.9999; a masking or
/// pooling bug drops far below this.
const AGREEMENT: f64 = 0.995;

#[derive(Debug, Parser)]
struct Cli {
    /// The all-MiniLM-L6-v2 folder (its tokenizer also goes with the random BERT-base).
    #[arg(
        long,
        env = "TESSERA_BENCH_MODEL",
        default_value = ".assets/all-MiniLM-L6-v2"
    )]
    minilm: PathBuf,
    /// Python with torch and transformers for the HF baseline; "none" skips it.
    #[arg(long, default_value = "python3")]
    python: String,
    /// The HF baseline script, relative to the working directory (the repository root).
    #[arg(long, default_value = "bench/scripts/hf_transformers_gpu.py")]
    hf_script: PathBuf,
    /// What scripts/gpu-bundle.sh recorded about the build (git commit, dirty flag, date),
    /// copied into the results; missing is allowed and recorded as unknown.
    #[arg(
        long,
        env = "TESSERA_BUILD_INFO",
        default_value = ".gpu-bundle/build-info.json"
    )]
    build_info: PathBuf,
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64,128,256")]
    batches: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_value = "64,128,256,512")]
    max_lens: Vec<usize>,
    /// Storage type of the engine, the padded path, HF and the GEMMs alone: f16 or bf16.
    #[arg(long, default_value = "f16")]
    dtype: String,
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Each measurement repeats until both limits are reached.
    #[arg(long, default_value_t = 0.3)]
    min_seconds: f64,
    #[arg(long, default_value_t = 5)]
    min_iters: usize,
    /// Dense bf16 peak of the GPU in TFLOPS (default: from the GPU's name, see `peak_tflops`).
    #[arg(long)]
    peak_tflops: Option<f64>,
    #[arg(long, default_value_t = 20_261_122)]
    seed: u64,
    /// Where gpu_serving.json and gpu_serving.md go.
    #[arg(long, default_value = "bench/results")]
    out: PathBuf,
}

/// NVIDIA's datasheet dense (no sparsity) BF16 tensor-core peak, by GPU name. On these GPUs
/// the dense FP16 peak is the same figure, so it serves both dtypes.
fn peak_tflops(name: &str) -> Option<f64> {
    let table: [(&str, &str, f64); 6] = [
        ("H100", "PCIe", 756.0),
        ("H100", "NVL", 835.0),
        ("H100", "", 989.0),
        ("H200", "", 989.0),
        ("A100", "", 312.0),
        ("L40S", "", 362.0),
    ];
    table
        .iter()
        .find(|(gpu, variant, _)| name.contains(gpu) && name.contains(variant))
        .map(|(_, _, peak)| *peak)
}

/// One batch shape of the sweep, with its sequences.
struct Config {
    name: String,
    max_len: usize,
    sequences: Vec<Vec<u32>>,
}

impl Config {
    fn tokens(&self) -> usize {
        self.sequences.iter().map(Vec::len).sum()
    }

    fn padded_tokens(&self) -> usize {
        self.sequences.len() * self.sequences.iter().map(Vec::len).max().unwrap_or(0)
    }
}

/// xorshift64*: the same seed gives every implementation, and every run, the same batches.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) as usize % n
    }
}

fn workload(cli: &Cli) -> Vec<Config> {
    let mut rng = Rng(cli.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut configs = Vec::new();
    for &max_len in &cli.max_lens {
        for &batch in &cli.batches {
            let sequences = (0..batch)
                .map(|_| {
                    let len = 1 + rng.below(max_len);
                    // [CLS] ordinary-word ids … [SEP]
                    let mut ids: Vec<u32> =
                        (0..len).map(|_| 1996 + rng.below(28_000) as u32).collect();
                    ids[0] = 101;
                    if len > 1 {
                        ids[len - 1] = 102;
                    }
                    ids
                })
                .collect();
            configs.push(Config {
                name: format!("max{max_len}-b{batch}"),
                max_len,
                sequences,
            });
        }
    }
    configs
}

/// Per-call milliseconds of `f` after `warmup` calls, repeated to both limits.
fn measure(cli: &Cli, mut f: impl FnMut() -> Result<()>) -> Result<Vec<f64>> {
    for _ in 0..cli.warmup {
        f()?;
    }
    let start = Instant::now();
    let mut ms = Vec::new();
    while ms.len() < cli.min_iters || start.elapsed().as_secs_f64() < cli.min_seconds {
        let t = Instant::now();
        f()?;
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    Ok(ms)
}

fn median(ms: &[f64]) -> f64 {
    percentile(ms, 0.5)
}

fn percentile(ms: &[f64], p: f64) -> f64 {
    let mut sorted = ms.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn round(v: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (v * f).round() / f
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let norm = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (norm(a) * norm(b))
}

/// The lower of two cosines, NaN if either is: `f64::min` drops a NaN, and a NaN embedding is
/// exactly what the cosine checks are for.
fn worse(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.min(b)
    }
}

/// The lowest cosine over pairs of embeddings.
fn worst_cosine(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| cosine(x, y))
        .fold(f64::INFINITY, worse)
}

/// JSON has no NaN: a cosine that is not a number is recorded as the string "NaN".
fn cosine_json(c: f64) -> Value {
    if c.is_finite() {
        json!(round(c, 6))
    } else {
        json!(c.to_string())
    }
}

/// Our own padded BERT on the GPU, pooled and normalised like the engine: candle-transformers'
/// `BertEncoder` under embeddings and an attention mask built here. `BertModel::forward`
/// is not used because its mask is `(1 - mask) · f32::MIN` converted to the model's dtype:
/// f32::MIN is −∞ in f16/bf16, so every real token gets 0 · (−∞) = NaN (candle-transformers
/// 0.11, `get_extended_attention_mask`).
struct PaddedBert {
    word: Embedding,
    position: Embedding,
    token_type: Embedding,
    norm: LayerNorm,
    encoder: BertEncoder,
    dtype: DType,
    device: Device,
}

impl PaddedBert {
    fn load(dir: &Path, dtype: DType, device: &Device) -> Result<Self> {
        let config: BertConfig =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
        // SAFETY: the weights file is not modified while the benchmark runs.
        let vb = unsafe {
            VarBuilder::from_mmaped_safetensors(&[dir.join("model.safetensors")], dtype, device)?
        };
        // Checkpoints of BertFor* heads keep the encoder under "bert."; plain ones do not.
        let vb = if vb.contains_tensor("bert.embeddings.word_embeddings.weight") {
            vb.pp("bert")
        } else {
            vb
        };
        let e = vb.pp("embeddings");
        let h = config.hidden_size;
        Ok(Self {
            word: embedding(config.vocab_size, h, e.pp("word_embeddings"))?,
            position: embedding(
                config.max_position_embeddings,
                h,
                e.pp("position_embeddings"),
            )?,
            token_type: embedding(config.type_vocab_size, h, e.pp("token_type_embeddings"))?,
            norm: layer_norm(h, config.layer_norm_eps, e.pp("LayerNorm"))?,
            encoder: BertEncoder::load(vb.pp("encoder"), &config)?,
            dtype,
            device: device.clone(),
        })
    }

    /// What padding keys add to the attention scores: half the dtype's lowest finite value
    /// (f16's is −65504; bf16 has f32's range), so it stays finite when a score is added and
    /// softmax gives those keys zero weight.
    fn padding_bias(&self) -> f64 {
        match self.dtype {
            DType::F16 => -65504.0 / 2.0,
            _ => f64::from(f32::MIN) / 2.0,
        }
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
        let ids = Tensor::from_vec(ids, (n, max), &self.device)?;
        let mask = Tensor::from_vec(mask, (n, max), &self.device)?;
        let positions = Tensor::arange(0u32, max as u32, &self.device)?;
        let x = (self.word.forward(&ids)? + self.token_type.forward(&ids.zeros_like()?)?)?
            .broadcast_add(&self.position.forward(&positions)?)?;
        let x = self.norm.forward(&x)?;
        // (1 − mask) · bias in f32, where 1 − 1 is exactly 0, then to the dtype: [n, 1, 1, max].
        let bias = self.padding_bias();
        let extended = mask
            .affine(-bias, bias)?
            .reshape((n, 1, 1, max))?
            .to_dtype(self.dtype)?;
        let hidden = self.encoder.forward(&x, &extended)?.to_dtype(DType::F32)?;
        let summed = hidden.broadcast_mul(&mask.unsqueeze(2)?)?.sum(1)?;
        let mean = summed.broadcast_div(&mask.sum_keepdim(1)?)?;
        let norm = mean.sqr()?.sum_keepdim(1)?.sqrt()?;
        Ok(mean.broadcast_div(&norm)?.to_vec2()?)
    }
}

/// The encoder's GEMMs alone at `tokens` rows: per layer QKV `[T,H]×[H,3H]`, attention output
/// `[T,H]×[H,H]`, FFN in `[T,H]×[H,I]`, FFN out `[T,I]×[I,H]`, all in `dtype` through candle's
/// cuBLAS matmul as in the engine. Returns (FLOPs, per-call ms).
fn gemms(
    cli: &Cli,
    shape: &RandomBert,
    tokens: usize,
    dtype: DType,
    device: &Device,
) -> Result<(f64, Vec<f64>)> {
    let (h, i) = (shape.hidden, shape.intermediate);
    let w =
        |rows: usize, cols: usize| Tensor::randn(0f32, 0.02, (rows, cols), device)?.to_dtype(dtype);
    let x = Tensor::randn(0f32, 1.0, (tokens, h), device)?.to_dtype(dtype)?;
    let (qkv, out, ffn_in, ffn_out) = (w(h, 3 * h)?, w(h, h)?, w(h, i)?, w(i, h)?);
    let ms = measure(cli, || {
        for _ in 0..shape.layers {
            let _ = x.matmul(&qkv)?;
            let _ = x.matmul(&out)?;
            let mid = x.matmul(&ffn_in)?;
            let _ = mid.matmul(&ffn_out)?;
        }
        device.synchronize()?;
        Ok(())
    })?;
    let flops = 2.0 * tokens as f64 * (h * 3 * h + h * h + 2 * h * i) as f64 * shape.layers as f64;
    Ok((flops, ms))
}

/// One layer's attention alone (the engine's op, one launch) on the config's packed batch:
/// the kernel the engine's plan takes and its median ms, and where that is the tensor-core
/// kernel, the median ms of the same batch kept on the CUDA-core kernels, side by side.
fn attention_alone(
    cli: &Cli,
    shape: &RandomBert,
    config: &Config,
    dtype: DType,
    device: &Device,
) -> Result<(&'static str, f64, Option<f64>)> {
    let (tokens, hidden) = (config.tokens(), shape.hidden);
    let qkv = Tensor::randn(0f32, 1.0, (tokens, 3 * hidden), device)?.to_dtype(dtype)?;
    let bias = Tensor::zeros(3 * hidden, dtype, device)?;
    let mut cu = vec![0u32];
    for s in &config.sequences {
        cu.push(cu.last().copied().unwrap_or(0) + s.len() as u32);
    }
    let cu = Tensor::new(cu.as_slice(), device)?;
    let longest = config.sequences.iter().map(Vec::len).max().unwrap_or(1);
    let op = VarlenAttention {
        num_heads: shape.heads,
        head_dim: hidden / shape.heads,
        max_seqlen: longest,
        tensor_cores: true,
    };
    let sequences = config.sequences.len();
    let kernel = attention_plan(sequences, longest, op.num_heads, op.head_dim, dtype.size_in_bytes())
        .map_err(anyhow::Error::msg)?
        .kernel;
    let time = |op: &VarlenAttention| -> Result<f64> {
        let ms = measure(cli, || {
            qkv.apply_op3_no_bwd(&bias, &cu, op)?;
            device.synchronize()?;
            Ok(())
        })?;
        Ok(median(&ms))
    };
    let chosen = time(&op)?;
    let cuda_cores = if kernel == AttentionKernel::Mma {
        Some(time(&VarlenAttention { tensor_cores: false, ..op })?)
    } else {
        None
    };
    Ok((kernel.name(), chosen, cuda_cores))
}

/// Model FLOPs of a packed forward: the GEMMs plus attention's QKᵀ and PV per sequence.
fn model_flops(shape: &RandomBert, config: &Config) -> f64 {
    let (h, i) = (shape.hidden as f64, shape.intermediate as f64);
    let tokens = config.tokens() as f64;
    let attention: f64 = config
        .sequences
        .iter()
        .map(|s| 4.0 * (s.len() as f64).powi(2) * h)
        .sum();
    shape.layers as f64 * (2.0 * tokens * (4.0 * h * h + 2.0 * h * i) + attention)
}

/// Runs the HF script over all `configs` and hands each config's result to `on_config` as
/// soon as the script prints it. Returns the script's versions line, or why it did not run
/// or stopped early.
fn hf_baseline(
    cli: &Cli,
    model_dir: &Path,
    configs: &[Config],
    dtype: DType,
    mut on_config: impl FnMut(usize, &Value) -> Result<()>,
) -> Result<Value, String> {
    if cli.python == "none" {
        return Err("skipped (--python none)".into());
    }
    if !cli.hf_script.is_file() {
        return Err(format!(
            "no {} (relative to {}): run from the repository root or pass --hf-script",
            cli.hf_script.display(),
            std::env::current_dir().map_or("?".into(), |d| d.display().to_string())
        ));
    }
    let probe = Command::new(&cli.python)
        .args(["-c", "import torch, transformers"])
        .output();
    if !probe.as_ref().is_ok_and(|o| o.status.success()) {
        return Err(format!(
            "{} cannot import torch and transformers; pass --python",
            cli.python
        ));
    }
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let path = dir.path().join("workload.json");
    let body = json!({"configs": configs.iter().map(|c| json!({"name": c.name, "sequences": c.sequences})).collect::<Vec<_>>()});
    std::fs::write(&path, body.to_string()).map_err(|e| e.to_string())?;
    let torch_dtype = if dtype == DType::BF16 {
        "bfloat16"
    } else {
        "float16"
    };
    // stderr goes to ours, so the script's progress and any traceback land in the run's log.
    let mut child = Command::new(&cli.python)
        .arg(&cli.hf_script)
        .arg("--model")
        .arg(model_dir)
        .arg("--workload")
        .arg(&path)
        .args(["--dtype", torch_dtype])
        .args([
            "--warmup",
            &cli.warmup.to_string(),
            "--min-seconds",
            &cli.min_seconds.to_string(),
            "--min-iters",
            &cli.min_iters.to_string(),
        ])
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{}: {e}", cli.python))?;
    let stdout = child.stdout.take().expect("stdout is piped");
    let read = || -> Result<(Option<Value>, usize), String> {
        let (mut versions, mut done) = (None, 0);
        for line in BufReader::new(stdout).lines() {
            let line = line.map_err(|e| format!("reading the script's output: {e}"))?;
            // Libraries may print to stdout too; the script's own lines are JSON objects.
            let Ok(record) = serde_json::from_str::<Value>(&line) else {
                continue;
            };
            if versions.is_none() {
                versions = Some(record);
            } else if done < configs.len() && record["name"] == configs[done].name.as_str() {
                on_config(done, &record).map_err(|e| format!("recording HF results: {e:#}"))?;
                done += 1;
            }
        }
        Ok((versions, done))
    };
    let outcome = read();
    if outcome.is_err() {
        let _ = child.kill();
    }
    let status = child.wait().map_err(|e| e.to_string())?;
    let (versions, done) = outcome?;
    match versions {
        Some(versions) if status.success() && done == configs.len() => Ok(versions),
        _ => Err(format!(
            "{} {} ended ({status}) after {done} of {} configs; its stderr is above",
            cli.python,
            cli.hf_script.display(),
            configs.len()
        )),
    }
}

fn latency(ms: &[f64]) -> Value {
    json!({"median": round(median(ms), 4), "p90": round(percentile(ms, 0.9), 4), "min": round(ms.iter().cloned().fold(f64::INFINITY, f64::min), 4), "calls": ms.len()})
}

/// The results so far, rewritten to disk after every measured config. `report["problems"]`
/// lists what the closing summary reports as wrong: missing baselines, disagreeing embeddings.
struct Results {
    report: Value,
    out: PathBuf,
}

impl Results {
    fn save(&self) -> Result<()> {
        std::fs::create_dir_all(&self.out)
            .with_context(|| format!("creating {}", self.out.display()))?;
        std::fs::write(
            self.out.join("gpu_serving.json"),
            format!("{:#}\n", self.report),
        )?;
        std::fs::write(self.out.join("gpu_serving.md"), markdown(&self.report))?;
        Ok(())
    }

    fn model(&mut self, index: usize) -> &mut Value {
        &mut self.report["models"][index]
    }

    fn problem(&mut self, what: String) {
        self.report["problems"]
            .as_array_mut()
            .expect("problems is an array")
            .push(json!(what));
    }

    fn check(&mut self, what: &str, worst: f64) {
        if worst.is_nan() || worst < AGREEMENT {
            self.problem(format!(
                "{what}: cosine with the engine {worst:.5} (below {AGREEMENT})"
            ));
        }
    }
}

/// How many of each batch's embeddings are compared across implementations.
const CHECKED: usize = 2;

/// One model's sweep: the engine, the padded path and the GEMMs over every config, then the
/// HF baseline over every config, each result saved as soon as it is measured.
#[allow(clippy::too_many_arguments)]
fn run_model(
    cli: &Cli,
    results: &mut Results,
    label: &str,
    dir: &Path,
    shape: &RandomBert,
    configs: &[Config],
    dtype: DType,
    device: &Device,
    peak: Option<f64>,
) -> Result<()> {
    let engine = EmbeddingModel::load_with(
        dir,
        &LoadOptions {
            max_input_tokens: Some(512),
            device: Some(device.clone()),
            dtype: Some(dtype),
        },
    )
    .with_context(|| format!("loading {label} on the GPU"))?;
    let padded = PaddedBert::load(dir, dtype, device)?;
    let share =
        |flops: f64, ms: f64| peak.map(|p| round(flops / (ms * 1e-3) / (p * 1e12) * 100.0, 1));

    let m = results.report["models"].as_array().map_or(0, Vec::len);
    results.report["models"]
        .as_array_mut()
        .expect("models is an array")
        .push(json!({
            "model": label,
            "shape": {"hidden": shape.hidden, "layers": shape.layers, "heads": shape.heads, "intermediate": shape.intermediate},
            "hf_transformers": {"status": "pending"},
            "configs": [],
        }));
    let mut engine_checks = Vec::new();
    let mut engine_tps = Vec::new();
    let mut worst_padded = f64::INFINITY;
    for config in configs {
        let batch = Batch::pack(&config.sequences, 512, false)?;
        let tokens = config.tokens() as f64;
        let mut engine_out = Vec::new();
        let engine_ms = measure(cli, || {
            engine_out = engine.embed_batch_with(&batch, Pooling::Mean, true)?;
            Ok(())
        })?;
        engine_out.truncate(CHECKED);
        let mut padded_out = Vec::new();
        let padded_ms = measure(cli, || {
            padded_out = padded.embed(&config.sequences)?;
            Ok(())
        })?;
        let padded_agreement = worst_cosine(&padded_out, &engine_out);
        worst_padded = worse(worst_padded, padded_agreement);
        let (gemm_flops, gemm_ms) = gemms(cli, shape, config.tokens(), dtype, device)?;
        let gemm_tflops = gemm_flops / (median(&gemm_ms) * 1e-3) / 1e12;
        let (kernel, attention_ms, cuda_cores_ms) =
            attention_alone(cli, shape, config, dtype, device)?;

        let tps = tokens / (median(&engine_ms) * 1e-3);
        let padded_tps = tokens / (median(&padded_ms) * 1e-3);
        let row = json!({
            "config": config.name,
            "max_len": config.max_len,
            "batch": config.sequences.len(),
            "real_tokens": config.tokens(),
            "padded_tokens": config.padded_tokens(),
            "engine": {"latency_ms": latency(&engine_ms), "tokens_per_s": round(tps, 0),
                       "model_flops_share_of_dense_bf16_peak_pct": share(model_flops(shape, config), median(&engine_ms))},
            "candle_padded": {"latency_ms": latency(&padded_ms), "tokens_per_s": round(padded_tps, 0),
                              "cosine_with_engine": cosine_json(padded_agreement)},
            "gemms_alone": {"dtype": cli.dtype, "ms": round(median(&gemm_ms), 4), "tflops": round(gemm_tflops, 1),
                            "share_of_dense_bf16_peak_pct": share(gemm_flops, median(&gemm_ms))},
            "attention_alone": {"kernel": kernel, "ms_one_layer": round(attention_ms, 4),
                                "cuda_cores_ms_one_layer": cuda_cores_ms.map(|ms| round(ms, 4))},
        });
        println!(
            "{label} {}: engine {tps:.0} tok/s ({:.3} ms), candle padded {padded_tps:.0} tok/s \
             (cosine {padded_agreement:.5}), GEMMs in {} {gemm_tflops:.0} TFLOPS ({} of dense bf16 peak)",
            config.name,
            median(&engine_ms),
            cli.dtype,
            share(gemm_flops, median(&gemm_ms)).map_or("?".into(), |p| format!("{p}%")),
        );
        results.model(m)["configs"]
            .as_array_mut()
            .expect("configs is an array")
            .push(row);
        results.save()?;
        engine_checks.push(engine_out);
        engine_tps.push(tps);
    }
    results.check(&format!("{label}: candle padded"), worst_padded);

    let mut worst_hf = f64::INFINITY;
    let hf = hf_baseline(cli, dir, configs, dtype, |index, result| {
        let config = &configs[index];
        let ms: Vec<f64> = serde_json::from_value(result["ms"].clone())?;
        let check: Vec<Vec<f32>> = serde_json::from_value(result["check"].clone())?;
        let agreement = worst_cosine(&check, &engine_checks[index]);
        worst_hf = worse(worst_hf, agreement);
        let hf_tps = config.tokens() as f64 / (median(&ms) * 1e-3);
        let row = &mut results.model(m)["configs"][index];
        row["hf_transformers"] = json!({"latency_ms": latency(&ms), "tokens_per_s": round(hf_tps, 0),
                                        "cosine_with_engine": cosine_json(agreement)});
        row["engine_over_hf"] = json!(round(engine_tps[index] / hf_tps, 2));
        println!(
            "{label} {}: HF {hf_tps:.0} tok/s ({:.3} ms), engine/HF {:.2}×, cosine {agreement:.5}",
            config.name,
            median(&ms),
            engine_tps[index] / hf_tps
        );
        results.save()
    });
    let status = match &hf {
        Ok(v) => {
            results.check(&format!("{label}: HF transformers"), worst_hf);
            json!({"status": "ran", "torch": v["torch"], "transformers": v["transformers"], "dtype": v["dtype"], "attention": v["attention"]})
        }
        Err(why) => {
            println!("{label}: HF transformers baseline NOT RUN: {why}");
            results.problem(format!("{label}: HF transformers baseline not run: {why}"));
            json!({"status": "not run", "why": why})
        }
    };
    results.model(m)["hf_transformers"] = status;
    results.save()
}

/// A JSON value as a table cell: strings bare, missing values as a dash.
fn cell(v: &Value) -> String {
    match v {
        Value::Null => "–".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn markdown(report: &Value) -> String {
    let device = &report["device"];
    let build = &report["build"];
    let mut md = format!(
        "# GPU serving benchmark\n\n{}\
         Device: {} (compute capability {}), NVIDIA driver {} (CUDA {}); dense bf16 peak used: {} TFLOPS.\n\
         Build: commit {}{}, built {} for compute capability {}.\n\
         Run: {}, dtype {}. Command: `{}`\n\n\
         Real tokens only; latency is one call from host ids to host embeddings (median). \
         Cosines compare the engine's embeddings of each batch's first {CHECKED} sequences.\n",
        if report["complete"] == true {
            ""
        } else {
            "**Incomplete: the run stopped before the end; the tables hold what was measured.**\n\n"
        },
        cell(&device["name"]),
        cell(&device["compute_capability"]),
        cell(&device["nvidia_driver"]),
        cell(&device["cuda_driver_api"]),
        cell(&report["peak_dense_bf16_tflops"]),
        cell(&build["git_commit"]),
        if build["git_dirty"] == true {
            " (with uncommitted changes)"
        } else {
            ""
        },
        cell(&build["date"]),
        cell(&device["built_for"]),
        cell(&report["date"]),
        cell(&report["dtype"]),
        cell(&report["command"]),
    );
    for model in report["models"].as_array().into_iter().flatten() {
        md += &format!("\n## {}\n\n", cell(&model["model"]));
        let hf = &model["hf_transformers"];
        md += &match hf["status"].as_str() {
            Some("ran") => format!(
                "HF transformers {} on torch {}, {}, {} attention.\n\n",
                cell(&hf["transformers"]),
                cell(&hf["torch"]),
                cell(&hf["dtype"]),
                cell(&hf["attention"])
            ),
            Some("not run") => format!(
                "**HF transformers baseline not run:** {}\n\n",
                cell(&hf["why"])
            ),
            _ => "HF transformers baseline: not reached.\n\n".into(),
        };
        md += &format!(
            "| config | real tokens | padded tokens | engine tok/s | engine ms | candle padded tok/s | HF tok/s | engine/HF | \
             GEMMs alone in {} TFLOPS (% of dense bf16 peak) | attention alone, one layer: kernel, ms (on CUDA cores) | \
             cosine vs candle padded | cosine vs HF |\n\
             |---|---|---|---|---|---|---|---|---|---|---|---|\n",
            cell(&report["dtype"])
        );
        for row in model["configs"].as_array().into_iter().flatten() {
            md += &format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} ({}) | {} {}{} | {} | {} |\n",
                cell(&row["config"]),
                cell(&row["real_tokens"]),
                cell(&row["padded_tokens"]),
                cell(&row["engine"]["tokens_per_s"]),
                cell(&row["engine"]["latency_ms"]["median"]),
                cell(&row["candle_padded"]["tokens_per_s"]),
                cell(&row["hf_transformers"]["tokens_per_s"]),
                cell(&row["engine_over_hf"]),
                cell(&row["gemms_alone"]["tflops"]),
                cell(&row["gemms_alone"]["share_of_dense_bf16_peak_pct"]),
                cell(&row["attention_alone"]["kernel"]),
                cell(&row["attention_alone"]["ms_one_layer"]),
                row["attention_alone"]["cuda_cores_ms_one_layer"]
                    .as_f64()
                    .map_or(String::new(), |ms| format!(" ({ms})")),
                cell(&row["candle_padded"]["cosine_with_engine"]),
                cell(&row["hf_transformers"]["cosine_with_engine"]),
            );
        }
    }
    if let Some(problems) = report["problems"].as_array().filter(|p| !p.is_empty()) {
        md += "\n## Problems\n\n";
        for p in problems {
            md += &format!("- {}\n", cell(p));
        }
    }
    md
}

/// The NVIDIA driver's version as nvidia-smi reports it (e.g. "580.159.04"); the CUDA driver
/// API version from the probe says only which CUDA release the driver supports.
fn nvidia_driver() -> Value {
    let output = Command::new("nvidia-smi")
        .args([
            "--query-gpu=driver_version",
            "--format=csv,noheader",
            "--id=0",
        ])
        .output();
    match output {
        Ok(o) if o.status.success() => {
            json!(String::from_utf8_lossy(&o.stdout).trim().to_string())
        }
        Ok(o) => json!(format!(
            "unknown (nvidia-smi: {})",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => json!(format!("unknown (nvidia-smi: {e})")),
    }
}

/// The build's provenance written by scripts/gpu-bundle.sh, or why it is unknown.
fn build_info(path: &Path) -> Value {
    let read = std::fs::read_to_string(path)
        .map_err(|e| e.to_string())
        .and_then(|text| serde_json::from_str(&text).map_err(|e| e.to_string()));
    read.unwrap_or_else(|e| json!({"git_commit": format!("unknown ({}: {e})", path.display())}))
}

/// The command line as a shell would take it back.
fn command_line() -> String {
    std::env::args()
        .map(|a| {
            if !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=,:+@".contains(c))
            {
                a
            } else {
                format!("'{}'", a.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let dtype = match cli.dtype.as_str() {
        "f16" => DType::F16,
        "bf16" => DType::BF16,
        other => bail!("--dtype {other}: use f16 or bf16"),
    };
    if !cli.minilm.join("model.safetensors").is_file() {
        bail!(
            "{} has no model.safetensors: pass --minilm (scripts/fetch-assets.sh fetches it)",
            cli.minilm.display()
        );
    }
    let gpu = compute_cap::probe(0).map_err(|reason| anyhow::anyhow!(reason))?;
    let device = Device::new_cuda(0)?;
    let peak = cli.peak_tflops.or_else(|| peak_tflops(&gpu.name));
    let driver = nvidia_driver();
    println!(
        "device: {} (compute capability {}.{}), NVIDIA driver {}, dense bf16 peak {}",
        gpu.name,
        gpu.compute_cap.0,
        gpu.compute_cap.1,
        cell(&driver),
        peak.map_or("unknown (pass --peak-tflops)".into(), |p| format!(
            "{p} TFLOPS"
        ))
    );
    let configs = workload(&cli);

    let mut results = Results {
        report: json!({
            "benchmark": "gpu_serving",
            "complete": false,
            "date": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            "command": command_line(),
            "working_directory": std::env::current_dir().map(|d| d.display().to_string()).unwrap_or_default(),
            "build": build_info(&cli.build_info),
            "device": {"name": gpu.name, "compute_capability": format!("{}.{}", gpu.compute_cap.0, gpu.compute_cap.1),
                       "nvidia_driver": driver,
                       "cuda_driver_api": format!("{}.{}", gpu.driver / 1000, gpu.driver % 1000 / 10),
                       "built_for": compute_cap::built_for()},
            "dtype": cli.dtype,
            "gemms_dtype": cli.dtype,
            "peak_dense_bf16_tflops": peak,
            "seed": cli.seed,
            "models": [],
            "problems": [],
        }),
        out: cli.out.clone(),
    };
    results.save()?;

    let base_dir = tempfile::tempdir()?;
    RandomBert::BASE.write(base_dir.path(), cli.seed, &cli.minilm)?;
    let minilm_shape: Value =
        serde_json::from_str(&std::fs::read_to_string(cli.minilm.join("config.json"))?)?;
    let field = |name: &str| -> Result<usize> {
        Ok(minilm_shape[name].as_u64().context(name.to_string())? as usize)
    };
    let minilm = RandomBert {
        hidden: field("hidden_size")?,
        layers: field("num_hidden_layers")?,
        heads: field("num_attention_heads")?,
        intermediate: field("intermediate_size")?,
        vocab: field("vocab_size")?,
        max_positions: field("max_position_embeddings")?,
    };
    let models: [(&str, &Path, &RandomBert); 2] = [
        (
            "BERT-base (random weights)",
            base_dir.path(),
            &RandomBert::BASE,
        ),
        ("all-MiniLM-L6-v2", &cli.minilm, &minilm),
    ];
    for (label, dir, shape) in models {
        run_model(
            &cli,
            &mut results,
            label,
            dir,
            shape,
            &configs,
            dtype,
            &device,
            peak,
        )?;
    }
    results.report["complete"] = json!(true);
    results.save()?;
    println!("wrote {}", cli.out.join("gpu_serving.{json,md}").display());

    println!("\n==> summary");
    let problems = results.report["problems"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    if problems.is_empty() {
        println!("all baselines ran and every cosine with the engine is at least {AGREEMENT}");
        return Ok(());
    }
    for problem in &problems {
        println!("PROBLEM: {}", cell(problem));
    }
    bail!(
        "{} problem(s), listed above (the results were written all the same)",
        problems.len()
    )
}
