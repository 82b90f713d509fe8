//! GPU serving benchmark (issue 4), everything in one run on one GPU so the ratios share its
//! state:
//!
//! 1. this engine on CUDA: packed batches (no padding anywhere), our kernels, cuBLAS GEMMs;
//! 2. our own padded path: candle-transformers' `BertModel` on the same GPU, each batch
//!    padded to its longest sequence, masked mean pooling and L2 normalisation;
//! 3. HF `transformers` on PyTorch, fp16, SDPA attention, padded to the longest in batch
//!    (bench/scripts/hf_transformers_gpu.py, a subprocess), when a Python with them is found;
//! 4. the GEMMs alone: the encoder's four projections per layer at each batch's token count,
//!    to say what share of the GPU's bf16 dense peak they reach.
//!
//! Models: a BERT-base-sized encoder with random weights (shapes are what speed depends on)
//! and all-MiniLM-L6-v2. Batches of 1 to 256 sequences with lengths uniform in [1, max] for
//! max in {64, 128, 256, 512}, ids from the BERT vocabulary; the same batches go to all three.
//! Throughput counts real tokens only (padding never counts); latency is one call from host
//! token ids to host embeddings. The engine's and HF's embeddings of each batch's first two
//! sequences are compared (cosine), so a fast wrong answer cannot pass unseen.
//!
//! Prints one line per figure; writes bench/results/gpu_serving.{json,md}. Run (the exact
//! command, with the toolchain and the run on the GPU machine, is in bench/README.md):
//!   gpu_serving --minilm .assets/all-MiniLM-L6-v2 --python python3

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::bert::{BertModel, Config as BertConfig};
use clap::Parser;
use serde_json::{json, Value};
use tessera_worker::engine::ops::cuda::compute_cap;
use tessera_worker::engine::synthetic::RandomBert;
use tessera_worker::engine::{Batch, EmbeddingModel, LoadOptions};

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
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64,128,256")]
    batches: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_value = "64,128,256,512")]
    max_lens: Vec<usize>,
    /// Storage type of the engine, the padded path and HF: f16 or bf16.
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

/// NVIDIA's datasheet dense (no sparsity) BF16 tensor-core peak, by GPU name.
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

/// candle-transformers' padded BERT on the GPU, pooled and normalised like the engine.
struct PaddedBert {
    model: BertModel,
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
        Ok(Self {
            model: BertModel::load(vb, &config)?,
            device: device.clone(),
        })
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
        let hidden = self
            .model
            .forward(&ids, &ids.zeros_like()?, Some(&mask))?
            .to_dtype(DType::F32)?;
        let summed = hidden.broadcast_mul(&mask.unsqueeze(2)?)?.sum(1)?;
        let mean = summed.broadcast_div(&mask.sum_keepdim(1)?)?;
        let norm = mean.sqr()?.sum_keepdim(1)?.sqrt()?;
        Ok(mean.broadcast_div(&norm)?.to_vec2()?)
    }
}

/// The encoder's GEMMs alone at `tokens` rows: per layer QKV `[T,H]×[H,3H]`, attention output
/// `[T,H]×[H,H]`, FFN in `[T,H]×[H,I]`, FFN out `[T,I]×[I,H]`, all through candle's cuBLAS
/// matmul as in the engine. Returns (FLOPs, per-call ms).
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

fn hf_baseline(
    cli: &Cli,
    model_dir: &Path,
    configs: &[Config],
    dtype: DType,
) -> Result<Value, String> {
    if cli.python == "none" {
        return Err("skipped (--python none)".into());
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
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/hf_transformers_gpu.py");
    let torch_dtype = if dtype == DType::BF16 {
        "bfloat16"
    } else {
        "float16"
    };
    let output = Command::new(&cli.python)
        .arg(&script)
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
        .output()
        .map_err(|e| format!("{}: {e}", cli.python))?;
    if !output.status.success() {
        return Err(format!(
            "{} failed: {}",
            script.display(),
            String::from_utf8_lossy(&output.stderr).trim()
        ));
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .map_err(|e| format!("unreadable output of the script: {e}"))
}

fn latency(ms: &[f64]) -> Value {
    json!({"median": round(median(ms), 4), "p90": round(percentile(ms, 0.9), 4), "min": round(ms.iter().cloned().fold(f64::INFINITY, f64::min), 4), "calls": ms.len()})
}

/// One model's sweep: every implementation over every config.
fn run_model(
    cli: &Cli,
    label: &str,
    dir: &Path,
    shape: &RandomBert,
    configs: &[Config],
    dtype: DType,
    device: &Device,
    peak: Option<f64>,
) -> Result<Value> {
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
    let hf = hf_baseline(cli, dir, configs, dtype);
    if let Err(why) = &hf {
        println!("{label}: HF transformers baseline not run: {why}");
    }
    let share =
        |flops: f64, ms: f64| peak.map(|p| round(flops / (ms * 1e-3) / (p * 1e12) * 100.0, 1));

    let mut rows = Vec::new();
    for (index, config) in configs.iter().enumerate() {
        let batch = Batch::pack(&config.sequences, 512, false)?;
        let tokens = config.tokens() as f64;
        let mut first_two = Vec::new();
        let engine_ms = measure(cli, || {
            first_two = engine.embed_batch(&batch)?;
            Ok(())
        })?;
        first_two.truncate(2);
        let padded_ms = measure(cli, || padded.embed(&config.sequences).map(drop))?;
        let (gemm_flops, gemm_ms) = gemms(cli, shape, config.tokens(), dtype, device)?;

        let engine_tps = tokens / (median(&engine_ms) * 1e-3);
        let padded_tps = tokens / (median(&padded_ms) * 1e-3);
        let mut row = json!({
            "config": config.name,
            "max_len": config.max_len,
            "batch": config.sequences.len(),
            "real_tokens": config.tokens(),
            "padded_tokens": config.padded_tokens(),
            "engine": {"latency_ms": latency(&engine_ms), "tokens_per_s": round(engine_tps, 0),
                       "model_flops_share_of_peak_pct": share(model_flops(shape, config), median(&engine_ms))},
            "candle_padded": {"latency_ms": latency(&padded_ms), "tokens_per_s": round(padded_tps, 0)},
            "gemms_alone": {"ms": round(median(&gemm_ms), 4), "tflops": round(gemm_flops / (median(&gemm_ms) * 1e-3) / 1e12, 1),
                            "share_of_bf16_peak_pct": share(gemm_flops, median(&gemm_ms))},
        });
        let mut line = format!(
            "{label} {}: engine {:.0} tok/s ({:.3} ms), candle padded {:.0} tok/s, GEMMs {:.0} TFLOPS",
            config.name,
            engine_tps,
            median(&engine_ms),
            padded_tps,
            gemm_flops / (median(&gemm_ms) * 1e-3) / 1e12
        );
        if let Ok(hf) = &hf {
            let result = &hf["configs"][index];
            let ms: Vec<f64> = serde_json::from_value(result["ms"].clone())?;
            let check: Vec<Vec<f32>> = serde_json::from_value(result["check"].clone())?;
            let agreement = check
                .iter()
                .zip(&first_two)
                .map(|(a, b)| cosine(a, b))
                .fold(f64::INFINITY, f64::min);
            let hf_tps = tokens / (median(&ms) * 1e-3);
            row["hf_transformers"] = json!({"latency_ms": latency(&ms), "tokens_per_s": round(hf_tps, 0),
                                            "cosine_with_engine": round(agreement, 6)});
            row["engine_over_hf"] = json!(round(engine_tps / hf_tps, 2));
            line += &format!(
                ", HF {hf_tps:.0} tok/s, engine/HF {:.2}×, cosine {agreement:.5}",
                engine_tps / hf_tps
            );
        }
        println!("{line}");
        rows.push(row);
    }
    let hf_info = match &hf {
        Ok(v) => {
            json!({"torch": v["torch"], "transformers": v["transformers"], "dtype": v["dtype"], "attention": v["attention"]})
        }
        Err(why) => json!({"not_run": why}),
    };
    Ok(
        json!({"model": label, "shape": {"hidden": shape.hidden, "layers": shape.layers, "heads": shape.heads, "intermediate": shape.intermediate},
              "hf_transformers": hf_info, "configs": rows}),
    )
}

fn markdown(report: &Value) -> String {
    let mut md = format!(
        "# GPU serving benchmark\n\nDevice: {} (compute capability {}, driver CUDA {}), {}; dense bf16 peak used: {} TFLOPS.\n\
         Command: `{}`\n\nReal tokens only; latency is one call from host ids to host embeddings (median).\n",
        report["device"]["name"].as_str().unwrap_or("?"),
        report["device"]["compute_capability"].as_str().unwrap_or("?"),
        report["device"]["driver"].as_str().unwrap_or("?"),
        report["date"].as_str().unwrap_or("?"),
        report["peak_bf16_tflops"],
        report["command"].as_str().unwrap_or("?"),
    );
    for model in report["models"].as_array().into_iter().flatten() {
        md += &format!(
            "\n## {}\n\n| config | real tokens | engine tok/s | engine ms | candle padded tok/s | HF tok/s | engine/HF | GEMMs TFLOPS (% peak) | cosine vs HF |\n|---|---|---|---|---|---|---|---|---|\n",
            model["model"].as_str().unwrap_or("?")
        );
        for row in model["configs"].as_array().into_iter().flatten() {
            md += &format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} ({}) | {} |\n",
                row["config"].as_str().unwrap_or("?"),
                row["real_tokens"],
                row["engine"]["tokens_per_s"],
                row["engine"]["latency_ms"]["median"],
                row["candle_padded"]["tokens_per_s"],
                row["hf_transformers"]["tokens_per_s"],
                row["engine_over_hf"],
                row["gemms_alone"]["tflops"],
                row["gemms_alone"]["share_of_bf16_peak_pct"],
                row["hf_transformers"]["cosine_with_engine"],
            );
        }
    }
    md
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
    println!(
        "device: {} (compute capability {}.{}), dense bf16 peak {}",
        gpu.name,
        gpu.compute_cap.0,
        gpu.compute_cap.1,
        peak.map_or("unknown (pass --peak-tflops)".into(), |p| format!(
            "{p} TFLOPS"
        ))
    );
    let configs = workload(&cli);

    let base_dir = tempfile::tempdir()?;
    RandomBert::BASE.write(base_dir.path(), cli.seed, &cli.minilm)?;
    let minilm_shape: Value =
        serde_json::from_str(&std::fs::read_to_string(cli.minilm.join("config.json"))?)?;
    let minilm = RandomBert {
        hidden: minilm_shape["hidden_size"]
            .as_u64()
            .context("hidden_size")? as usize,
        layers: minilm_shape["num_hidden_layers"]
            .as_u64()
            .context("num_hidden_layers")? as usize,
        heads: minilm_shape["num_attention_heads"]
            .as_u64()
            .context("num_attention_heads")? as usize,
        intermediate: minilm_shape["intermediate_size"]
            .as_u64()
            .context("intermediate_size")? as usize,
        vocab: minilm_shape["vocab_size"].as_u64().context("vocab_size")? as usize,
        max_positions: minilm_shape["max_position_embeddings"]
            .as_u64()
            .context("max_position_embeddings")? as usize,
    };
    let models = vec![
        run_model(
            &cli,
            "BERT-base (random weights)",
            base_dir.path(),
            &RandomBert::BASE,
            &configs,
            dtype,
            &device,
            peak,
        )?,
        run_model(
            &cli,
            "all-MiniLM-L6-v2",
            &cli.minilm,
            &minilm,
            &configs,
            dtype,
            &device,
            peak,
        )?,
    ];

    let report = json!({
        "benchmark": "gpu_serving",
        "date": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "device": {"name": gpu.name, "compute_capability": format!("{}.{}", gpu.compute_cap.0, gpu.compute_cap.1),
                   "driver": format!("{}.{}", gpu.driver / 1000, gpu.driver % 1000 / 10), "built_for": compute_cap::built_for()},
        "dtype": cli.dtype,
        "peak_bf16_tflops": peak,
        "seed": cli.seed,
        "models": models,
    });
    std::fs::create_dir_all(&cli.out)?;
    std::fs::write(cli.out.join("gpu_serving.json"), format!("{report:#}\n"))?;
    std::fs::write(cli.out.join("gpu_serving.md"), markdown(&report))?;
    println!("wrote {}", cli.out.join("gpu_serving.{json,md}").display());
    Ok(())
}
