//! QSync's per-operator precision on the CPU: the trainable linear layer
//! (`tessera_worker::train::precision::linear`) at f32, bf16 and int8, forward and backward,
//! on all-MiniLM-L6-v2's and BERT-base's linear shapes at a training batch (16 sequences of
//! 128 tokens = 2048 rows), and the f32 layer as it ran before on candle's matmul and
//! autograd beside it. f32 is `gemm_nt_f32` (the engine's AVX-512/AVX2 kernel); bf16 `gemm_nt_bf16`
//! (the AVX512-BF16 kernel, or the AVX-512 f32 one on rounded values where that is faster);
//! int8 `gemm_nt_i8` (the AVX512-VNNI GEMM, or the f32 kernel in exact passes without it)
//! with per-tensor quantisation, backward at bf16.
//!
//! The layer timings include what the layer does besides the GEMM (casting or quantising
//! the master weights and the input, dequantising, packing), since that is what a plan pays.
//! A second table times the bare kernels on ready operands. Backward is timed alone
//! (`Tensor::backward` of the layer's output, its gradient all ones: dX, dW and db).
//! Then the encoder's one-op self-attention, GELU and LayerNorm
//! (`tessera_worker::train::model::fused`) against candle's tensor expressions for them,
//! forward and backward, on MiniLM's shapes at that batch. Last, a whole all-MiniLM-L6-v2
//! encoder step per uniform plan ($TESSERA_ASSETS). Median of
//! `--runs` runs after one warm-up. Prints one line per figure; writes
//! bench/results/qsync_gemm.{json,md}.
//!
//! Run: cargo run --release -p tessera-bench --bin qsync_gemm

use std::collections::BTreeMap;
use std::time::Instant;

use anyhow::Result;
use candle_core::{Device, Tensor, Var};
use candle_transformers::models::bert::Config;
use clap::Parser;
use serde_json::{json, Value};
use tessera_bench::machine;
use tessera_worker::engine::ops::{gemm_nt_bf16, gemm_nt_f32, gemm_nt_i8, has_avx512_vnni, GemmInputs, MatRef};
use tessera_worker::train::model::encoder::Encoder;
use tessera_worker::train::model::fused;
use tessera_worker::train::precision::{linear, Precision, PrecisionPlan, IMPLEMENTED};

#[derive(Parser)]
struct Args {
    /// Timed runs per figure (the median is reported).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Rows of the activations: sequences × tokens of a training batch.
    #[arg(long, default_value_t = 2048)]
    rows: usize,
}

/// `(model, layer, in, out)`.
const SHAPES: [(&str, &str, usize, usize); 6] = [
    ("MiniLM-L6", "attention q/k/v/o", 384, 384),
    ("MiniLM-L6", "intermediate", 384, 1536),
    ("MiniLM-L6", "output", 1536, 384),
    ("BERT-base", "attention q/k/v/o", 768, 768),
    ("BERT-base", "intermediate", 768, 3072),
    ("BERT-base", "output", 3072, 768),
];

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Median milliseconds of `f` over `runs` runs after a warm-up; `f` returns the seconds it
/// wants counted (so set-up inside it stays out).
fn time(runs: usize, mut f: impl FnMut() -> Result<f64>) -> Result<f64> {
    f()?;
    let mut all = Vec::with_capacity(runs);
    for _ in 0..runs {
        all.push(f()? * 1e3);
    }
    Ok(median(all))
}

/// Median forward and backward milliseconds of a layer: `layer()` timed, then
/// `Tensor::backward` of a fresh output timed alone.
fn forward_backward(runs: usize, layer: impl Fn() -> Result<Tensor>) -> Result<(f64, f64)> {
    let forward = time(runs, || {
        let start = Instant::now();
        let y = layer()?;
        Ok((start.elapsed().as_secs_f64(), y).0)
    })?;
    let backward = time(runs, || {
        let y = layer()?;
        let start = Instant::now();
        let grads = y.backward()?;
        Ok((start.elapsed().as_secs_f64(), grads).0)
    })?;
    Ok((forward, backward))
}

fn uniform(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            let u = (s.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 24) as f32;
            (u * 2.0 - 1.0) * scale
        })
        .collect()
}

fn has(flag: &str) -> bool {
    std::fs::read_to_string("/proc/cpuinfo").map(|s| s.split_whitespace().any(|w| w == flag)).unwrap_or(false)
}

fn main() -> Result<()> {
    // As the worker runs its ranks (`tessera_worker::memory`): on glibc's defaults the
    // layers' large temporaries come back as fresh pages every call (page faults and TLB
    // shootdowns were ~15 % of this bench's profile).
    tessera_worker::memory::keep_freed_memory();
    let args = Args::parse();
    // Other work on the machine (a shared host) shows in the load average; recorded with the figures.
    let load = || {
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    };
    let load_before = load();
    let device = Device::Cpu;
    let m = args.rows;
    let flags: Vec<&str> =
        ["avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni"].into_iter().filter(|f| has(f)).collect();
    let mut rows = Vec::new();
    for (model, layer, k, n) in SHAPES {
        let x = Var::from_tensor(&Tensor::from_vec(uniform(1, m * k, 2.0), (m, k), &device)?)?;
        let w = Var::from_tensor(&Tensor::from_vec(uniform(2, n * k, 0.05), (n, k), &device)?)?;
        let b = Var::from_tensor(&Tensor::from_vec(uniform(3, n, 0.1), n, &device)?)?;
        let flops = 2.0 * (m * n * k) as f64;
        let mut layer_ms = Vec::new();
        for precision in IMPLEMENTED {
            let (fwd, bwd) =
                forward_backward(args.runs, || Ok(linear(x.as_tensor(), w.as_tensor(), b.as_tensor(), precision)?))?;
            layer_ms.push((precision, fwd, bwd));
        }
        // The f32 layer as it was before it ran on the engine's GEMM: candle's matmul and autograd.
        let candle_layer = forward_backward(args.runs, || {
            Ok(x.as_tensor().matmul(&w.as_tensor().t()?)?.broadcast_add(b.as_tensor())?)
        })?;

        // The bare kernels on ready operands: the f32 GEMM (packing W is part of it) and
        // candle's f32 matmul, the bf16 GEMM from f32 (it rounds while packing), the int8
        // GEMM on i8.
        let xs = x.as_tensor().flatten_all()?.to_vec1::<f32>()?;
        let ws = w.as_tensor().flatten_all()?.to_vec1::<f32>()?;
        let qx: Vec<i8> = xs.iter().map(|v| (v / 2.0 * 127.0).round() as i8).collect();
        let qw: Vec<i8> = ws.iter().map(|v| (v / 0.05 * 127.0).round() as i8).collect();
        let wt = w.as_tensor().t()?;
        let kernel_candle = time(args.runs, || {
            let start = Instant::now();
            let y = x.as_tensor().matmul(&wt)?;
            Ok((start.elapsed().as_secs_f64(), y).0)
        })?;
        let kernel_f32 = time(args.runs, || {
            let start = Instant::now();
            let y = gemm_nt_f32(MatRef::row_major(&xs, m, k)?, MatRef::row_major(&ws, n, k)?, None)?;
            Ok((start.elapsed().as_secs_f64(), y).0)
        })?;
        let kernel_bf16 = time(args.runs, || {
            let start = Instant::now();
            let y = gemm_nt_bf16(MatRef::row_major(&xs, m, k)?, MatRef::row_major(&ws, n, k)?, None)?;
            Ok((start.elapsed().as_secs_f64(), y).0)
        })?;
        let kernel_int8 = time(args.runs, || {
            let start = Instant::now();
            let y = gemm_nt_i8(&qx, &qw, (m, k, n))?;
            Ok((start.elapsed().as_secs_f64(), y).0)
        })?;

        let (_, f32_fwd, f32_bwd) = *layer_ms.iter().find(|(p, ..)| *p == Precision::F32).expect("f32 is timed");
        let mut row = json!({
            "model": model, "layer": layer, "m": m, "k": k, "n": n,
            "kernel_ms": {"f32": kernel_f32, "bf16": kernel_bf16, "int8": kernel_int8, "f32_candle": kernel_candle},
            "f32_candle": {"forward_ms": candle_layer.0, "backward_ms": candle_layer.1},
        });
        for (precision, fwd, bwd) in &layer_ms {
            let p = precision.as_str();
            row[p] = json!({
                "forward_ms": fwd, "backward_ms": bwd,
                "forward_gflops": flops / fwd / 1e6, "backward_gflops": 2.0 * flops / bwd / 1e6,
                "forward_speedup": f32_fwd / fwd, "backward_speedup": f32_bwd / bwd,
            });
            println!(
                "{model} {layer} [{m}x{k}]·[{k}x{n}] {p}: forward {fwd:.2} ms ({:.0} GFLOP/s, {:.2}x f32), backward {bwd:.2} ms ({:.0} GFLOP/s, {:.2}x f32)",
                flops / fwd / 1e6,
                f32_fwd / fwd,
                2.0 * flops / bwd / 1e6,
                f32_bwd / bwd
            );
        }
        println!(
            "{model} {layer} f32 on candle's matmul: forward {:.2} ms ({:.2}x the engine GEMM's time), backward {:.2} ms ({:.2}x), bare {kernel_candle:.2} ms ({:.2}x)",
            candle_layer.0,
            candle_layer.0 / f32_fwd,
            candle_layer.1,
            candle_layer.1 / f32_bwd,
            kernel_candle / kernel_f32
        );
        println!(
            "{model} {layer} kernels: f32 {kernel_f32:.2} ms, bf16 {kernel_bf16:.2} ms ({:.2}x), int8 {kernel_int8:.2} ms ({:.2}x)",
            kernel_f32 / kernel_bf16,
            kernel_f32 / kernel_int8
        );
        rows.push(row);
    }

    let ops = fused_ops(&args)?;
    let encoder = encoder_steps(&args)?;

    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let date = chrono::Utc::now().format("%Y-%m-%d %H:%M UTC").to_string();
    let result = json!({
        "machine": machine(), "flags": flags, "date": date, "command": command,
        "runs": args.runs, "rows": m, "shapes": rows, "fused_ops": ops, "encoder_steps": encoder, "load_average_before": load_before, "load_average_after": load(),
        "bf16_kernel": format!("{:?}", GemmInputs::fastest()).to_lowercase(),
        "int8_kernel": if has_avx512_vnni() { "the AVX512-VNNI kernel" } else { "the f32 kernel in exact passes of 1024 depths: no AVX512-VNNI" },
    });
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/results");
    std::fs::write(format!("{dir}/qsync_gemm.json"), serde_json::to_string_pretty(&result)? + "\n")?;
    std::fs::write(format!("{dir}/qsync_gemm.md"), markdown(&result))?;
    Ok(())
}

/// The encoder's one-pass ops against candle's expressions for the same functions, forward
/// and backward (of the output alone, its gradient all ones), on a MiniLM layer's tensors at
/// 16 sequences of 128 tokens: self-attention over q, k, v `[16, 128, 384]` (12 heads of
/// 32, masked), the intermediate activations `[16, 128, 1536]`, the hidden states
/// `[16, 128, 384]`.
fn fused_ops(args: &Args) -> Result<Value> {
    let device = Device::Cpu;
    let var = |seed, dims: &[usize], scale| -> Result<Var> {
        let n = dims.iter().product();
        Ok(Var::from_tensor(&Tensor::from_vec(uniform(seed, n, scale), dims, &device)?)?)
    };
    let (q, k, v) = (var(4, &[16, 128, 384], 2.0)?, var(9, &[16, 128, 384], 2.0)?, var(10, &[16, 128, 384], 1.0)?);
    let (q, k, v) = (q.as_tensor(), k.as_tensor(), v.as_tensor());
    // The padding mask of sequences of 128 down to 68 tokens (the most negative f32 on padding).
    let mask: Vec<f32> = (0..16 * 128).map(|i| if i % 128 >= 128 - (i / 128) * 4 { f32::MIN } else { 0.0 }).collect();
    let mask = Tensor::from_vec(mask, (16, 1, 1, 128), &device)?;
    let inner = var(5, &[16, 128, 1536], 3.0)?;
    let (hidden, weight, bias) = (var(6, &[16, 128, 384], 2.0)?, var(7, &[384], 1.0)?, var(8, &[384], 0.1)?);
    let (x, w, b) = (hidden.as_tensor(), weight.as_tensor(), bias.as_tensor());
    let pairs = [
        (
            "self-attention, 12 heads",
            "[16, 128, 384]",
            forward_backward(args.runs, || Ok(fused::self_attention(q, k, v, &mask, 12)?))?,
            forward_backward(args.runs, || Ok(fused::self_attention_expression(q, k, v, &mask, 12)?))?,
        ),
        (
            "GELU (erf)",
            "[16, 128, 1536]",
            forward_backward(args.runs, || Ok(fused::gelu_erf(inner.as_tensor())?))?,
            forward_backward(args.runs, || Ok(inner.as_tensor().gelu_erf()?))?,
        ),
        (
            "LayerNorm",
            "[16, 128, 384]",
            forward_backward(args.runs, || Ok(fused::layer_norm(x, w, b, 1e-12)?))?,
            forward_backward(args.runs, || Ok(fused::layer_norm_expression(x, w, b, 1e-12)?))?,
        ),
    ];
    let mut out = Vec::new();
    for (op, shape, ours, candle) in pairs {
        println!(
            "{op} {shape}: forward {:.2} ms (candle's expression {:.2}, {:.2}x), backward {:.2} ms (candle's {:.2}, {:.2}x)",
            ours.0,
            candle.0,
            candle.0 / ours.0,
            ours.1,
            candle.1,
            candle.1 / ours.1
        );
        out.push(json!({
            "op": op, "shape": shape,
            "forward_ms": ours.0, "backward_ms": ours.1,
            "candle_forward_ms": candle.0, "candle_backward_ms": candle.1,
        }));
    }
    Ok(Value::Array(out))
}

/// A whole all-MiniLM-L6-v2 encoder step (forward, mean-square loss, backward) on 16
/// sequences of 128 random tokens, per uniform plan (the keep-list holds: embeddings and
/// LayerNorms at bf16 under an int8 plan). Null when the model asset is missing.
fn encoder_steps(args: &Args) -> Result<Value> {
    let root =
        std::env::var("TESSERA_ASSETS").unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/../.assets").into());
    let folder = std::path::Path::new(&root).join("all-MiniLM-L6-v2");
    if !folder.join("model.safetensors").exists() {
        println!("encoder steps: skipped, {} is missing", folder.display());
        return Ok(Value::Null);
    }
    let config: Config = serde_json::from_slice(&std::fs::read(folder.join("config.json"))?)?;
    let weights = candle_core::safetensors::load(folder.join("model.safetensors"), &Device::Cpu)?;
    let mut vars = BTreeMap::new();
    for (name, tensor) in weights {
        vars.insert(name, Var::from_tensor(&tensor.to_dtype(candle_core::DType::F32)?)?);
    }
    let mut encoder = Encoder::new(&config, &vars)?;
    let (batch, tokens) = (16, 128);
    let ids: Vec<u32> = (0..batch * tokens).map(|i| 1000 + (i as u32 * 7919) % 20000).collect();
    let ids = Tensor::from_vec(ids, (batch, tokens), &Device::Cpu)?;
    let (types, mask) = (ids.zeros_like()?, ids.ones_like()?);
    let mut out = serde_json::Map::new();
    let mut f32_ms = (0.0, 0.0);
    for precision in [Precision::F32, Precision::Bf16, Precision::Int8] {
        encoder.set_precision(&PrecisionPlan::uniform(&encoder.precision_ops(), precision))?;
        let forward = time(args.runs, || {
            let start = Instant::now();
            let states = encoder.forward(&ids, &types, &mask)?;
            Ok((start.elapsed().as_secs_f64(), states).0)
        })?;
        let step = time(args.runs, || {
            let start = Instant::now();
            let loss = encoder.forward(&ids, &types, &mask)?.sqr()?.mean_all()?;
            let grads = loss.backward()?;
            Ok((start.elapsed().as_secs_f64(), grads).0)
        })?;
        if precision == Precision::F32 {
            f32_ms = (forward, step);
        }
        println!(
            "MiniLM-L6 encoder, {batch}x{tokens} tokens, uniform {precision}: forward {forward:.1} ms ({:.2}x f32), forward+backward {step:.1} ms ({:.2}x f32)",
            f32_ms.0 / forward,
            f32_ms.1 / step
        );
        out.insert(precision.as_str().into(), json!({"forward_ms": forward, "step_ms": step}));
    }
    Ok(json!({"batch": batch, "tokens": tokens, "plans": out}))
}

fn markdown(r: &Value) -> String {
    let mut s = String::from("# QSync's linear layer at f32, bf16 and int8 on the CPU\n\n");
    s += &format!(
        "Machine: {}; CPU flags of note: {}. Date: {}. Command: `{}` (release profile). Median of {} runs after a warm-up. \
         Load average (1, 5, 15 min) before: {}, after: {} (a shared host: other builds ran meanwhile).\n\n",
        r["machine"].as_str().unwrap_or(""),
        r["flags"].as_array().map(|f| f.iter().filter_map(|v| v.as_str()).collect::<Vec<_>>().join(", ")).unwrap_or_default(),
        r["date"].as_str().unwrap_or(""),
        r["command"].as_str().unwrap_or(""),
        r["runs"],
        r["load_average_before"].as_str().unwrap_or(""),
        r["load_average_after"].as_str().unwrap_or(""),
    );
    s += &format!(
        "Each layer is `y = x Wᵀ + b` with x `[{} × in]` (a training batch of 16 × 128 tokens), W `[out × in]` f32 master weights. \
         f32 runs the engine's f32 GEMM (forward and backward); bf16 rounds x and W to bf16 on every call and runs the bf16 GEMM ({} kernel; backward: dX and dW at bf16); \
         int8 quantises x and W per tensor on every call, runs the int8 GEMM ({}) and dequantises (backward at bf16 from the saved int8 input, as QSync). \
         Layer times include those casts; backward is `Tensor::backward` of the output alone (dX, dW, db). \
         Speed-up is f32 time / this time (above 1 = faster than f32).\n\n",
        r["rows"],
        r["bf16_kernel"].as_str().unwrap_or("?"),
        r["int8_kernel"].as_str().unwrap_or("the AVX512-VNNI kernel")
    );
    s += "| model | layer | in → out | f32 fwd ms | bf16 fwd ms (×) | int8 fwd ms (×) | f32 bwd ms | bf16 bwd ms (×) | int8 bwd ms (×) |\n";
    s += "|---|---|---|---|---|---|---|---|---|\n";
    for row in r["shapes"].as_array().into_iter().flatten() {
        let f = |p: &str, what: &str| row[p][what].as_f64().unwrap_or(f64::NAN);
        s += &format!(
            "| {} | {} | {} → {} | {:.2} | {:.2} ({:.2}×) | {:.2} ({:.2}×) | {:.2} | {:.2} ({:.2}×) | {:.2} ({:.2}×) |\n",
            row["model"].as_str().unwrap_or(""),
            row["layer"].as_str().unwrap_or(""),
            row["k"],
            row["n"],
            f("f32", "forward_ms"),
            f("bf16", "forward_ms"),
            f("bf16", "forward_speedup"),
            f("int8", "forward_ms"),
            f("int8", "forward_speedup"),
            f("f32", "backward_ms"),
            f("bf16", "backward_ms"),
            f("bf16", "backward_speedup"),
            f("int8", "backward_ms"),
            f("int8", "backward_speedup"),
        );
    }
    s += "\n## The bare GEMMs (forward, ready operands)\n\n";
    s += &format!(
        "f32: `gemm_nt_f32` (packing W is part of it; candle's `matmul` of x by Wᵀ in the last table). bf16: `gemm_nt_bf16` from f32 operands (it rounds while packing), here on the {} kernel (`GemmInputs::fastest`). int8: `gemm_nt_i8` on int8 operands, i32 out, on {}.\n\n",
        r["bf16_kernel"].as_str().unwrap_or("?"),
        r["int8_kernel"].as_str().unwrap_or("the AVX512-VNNI kernel")
    );
    s += "| model | layer | in → out | f32 ms | bf16 ms (×) | int8 ms (×) | f32 GFLOP/s | bf16 GFLOP/s | int8 GOP/s |\n|---|---|---|---|---|---|---|---|---|\n";
    for row in r["shapes"].as_array().into_iter().flatten() {
        let t = |p: &str| row["kernel_ms"][p].as_f64().unwrap_or(f64::NAN);
        let flops = 2.0
            * row["m"].as_f64().unwrap_or(0.0)
            * row["k"].as_f64().unwrap_or(0.0)
            * row["n"].as_f64().unwrap_or(0.0);
        s += &format!(
            "| {} | {} | {} → {} | {:.2} | {:.2} ({:.2}×) | {:.2} ({:.2}×) | {:.0} | {:.0} | {:.0} |\n",
            row["model"].as_str().unwrap_or(""),
            row["layer"].as_str().unwrap_or(""),
            row["k"],
            row["n"],
            t("f32"),
            t("bf16"),
            t("f32") / t("bf16"),
            t("int8"),
            t("f32") / t("int8"),
            flops / t("f32") / 1e6,
            flops / t("bf16") / 1e6,
            flops / t("int8") / 1e6,
        );
    }
    s += "\n## The f32 layer: the engine's GEMM against candle's matmul\n\n";
    s += "The same f32 layer on candle's `matmul` and autograd (how it ran before) beside the engine's f32 GEMM, in the same run; \
          × is candle's time over the engine's (above 1 = the engine's is faster).\n\n";
    s += "| model | layer | in → out | forward ms, engine | candle (×) | backward ms, engine | candle (×) | bare GEMM ms, engine | candle (×) |\n|---|---|---|---|---|---|---|---|---|\n";
    for row in r["shapes"].as_array().into_iter().flatten() {
        let v = |a: &str, b: &str| row[a][b].as_f64().unwrap_or(f64::NAN);
        let pair = |ours: f64, theirs: f64| format!("{ours:.2} | {theirs:.2} ({:.2}×)", theirs / ours);
        s += &format!(
            "| {} | {} | {} → {} | {} | {} | {} |\n",
            row["model"].as_str().unwrap_or(""),
            row["layer"].as_str().unwrap_or(""),
            row["k"],
            row["n"],
            pair(v("f32", "forward_ms"), v("f32_candle", "forward_ms")),
            pair(v("f32", "backward_ms"), v("f32_candle", "backward_ms")),
            pair(v("kernel_ms", "f32"), v("kernel_ms", "f32_candle")),
        );
    }
    s += "\n## The encoder's one-pass ops against candle's expressions\n\n";
    s += "Self-attention (the heads' `softmax(q kᵀ/√d + mask) v` with its padding mask), GELU (erf) and LayerNorm as the trainable encoder runs them \
          (`fused`: one op forward, one backward) beside candle's tensor expressions for the same functions \
          (heads split by copies, batched `matmul`, `candle_nn::ops::softmax`, heads joined; `Tensor::gelu_erf`; LayerNorm as candle-nn's unfused path), \
          which autograd differentiates op by op; on a MiniLM layer's tensors at 16 × 128 tokens. \
          × is candle's time over ours (above 1 = ours is faster).\n\n";
    s += "| op | shape | forward ms, ours | candle (×) | backward ms, ours | candle (×) |\n|---|---|---|---|---|---|\n";
    for row in r["fused_ops"].as_array().into_iter().flatten() {
        let v = |what: &str| row[what].as_f64().unwrap_or(f64::NAN);
        s += &format!(
            "| {} | {} | {:.2} | {:.2} ({:.2}×) | {:.2} | {:.2} ({:.2}×) |\n",
            row["op"].as_str().unwrap_or(""),
            row["shape"].as_str().unwrap_or(""),
            v("forward_ms"),
            v("candle_forward_ms"),
            v("candle_forward_ms") / v("forward_ms"),
            v("backward_ms"),
            v("candle_backward_ms"),
            v("candle_backward_ms") / v("backward_ms"),
        );
    }
    if let Some(plans) = r["encoder_steps"]["plans"].as_object() {
        s += "\n## A whole MiniLM-L6 encoder step\n\n";
        s += &format!(
            "all-MiniLM-L6-v2 (our trainable encoder), {} sequences × {} tokens: forward, and forward + mean-square loss + backward, \
             every linear at the plan's precision (under int8 the embeddings and LayerNorms run at bf16, QSync's keep-list). \
             The attention's own matmuls, softmax and GELU stay f32 in every plan.\n\n",
            r["encoder_steps"]["batch"], r["encoder_steps"]["tokens"]
        );
        s += "| plan | forward ms | × f32 | forward + backward ms | × f32 |\n|---|---|---|---|---|\n";
        let base = |what: &str| plans["f32"][what].as_f64().unwrap_or(f64::NAN);
        for p in ["f32", "bf16", "int8"] {
            let (f, st) =
                (plans[p]["forward_ms"].as_f64().unwrap_or(f64::NAN), plans[p]["step_ms"].as_f64().unwrap_or(f64::NAN));
            s += &format!(
                "| uniform {p} | {f:.1} | {:.2}× | {st:.1} | {:.2}× |\n",
                base("forward_ms") / f,
                base("step_ms") / st
            );
        }
    }
    s
}
