//! QSync predictor benchmark (issue 12): how close the replayer's predicted iteration time
//! comes to the measured one, over uniform, random and allocator-chosen precision plans of
//! a real CPU model.
//!
//! The model is a chain of linear layers and ReLUs at MiniLM's widths (384 ↔ 1536, 256
//! tokens) trained with plain SGD. Until the project's own bf16/int8 ops merge, each
//! precision is a candle stand-in: f32 and bf16 are candle's matmuls in that dtype; "int8"
//! quantises input and weight per tensor (amax/127, rounded, held in f32), multiplies them
//! with candle's f32 matmul and rescales, and runs its backward in bf16 from the dequantised
//! saved input, as QSync's int8 ops do. The predictor sees only what a rank would profile:
//! every operator alone at every precision (`profile_ops`), the casts fitted to
//! `t = a·numel + b` (`profile_casts`), and the optimizer step; it never sees a whole
//! iteration. Single rank: no all-reduce is measured here.
//!
//! Run: cargo run --release -p tessera-bench --bin qsync_predictor
//! Writes bench/results/qsync_predictor.{json,md}. candle runs on one thread unless
//! RAYON_NUM_THREADS says otherwise: on a shared machine a two-thread GEMM waits for
//! whichever core another process holds, which is noise, not the predictor.

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use serde_json::json;
use tessera_api::precision::{OpKind, Precision};
use tessera_bench::machine;
use tessera_worker::train::qsync::{
    fit_cast_model, greedy, measure_casts, profile_ops, GraphOp, IndicatorConfig, Indicators,
    OpStats, Pass, Prediction, ProfileConfig, ProfiledCast, ProfiledOp, QsyncError, RankProfile,
    Statistic, TrainingGraph,
};

const TOKENS: usize = 256;
const WIDTHS: [usize; 5] = [384, 1536, 384, 1536, 384];
const LR: f64 = 1e-4;
/// Timed iterations per run, runs per plan (the figure is the median of the run medians).
const ITERATIONS: usize = 7;
const RUNS: usize = 3;
/// Random mixed plans besides the three uniform ones.
const RANDOM_PLANS: usize = 7;

type Result<T> = candle_core::Result<T>;

/// A value in a precision's representation: int8 is integers held in f32 with a scale.
#[derive(Clone)]
struct Value {
    t: Tensor,
    precision: Precision,
    scale: f64,
}

fn dtype(p: Precision) -> DType {
    match p {
        Precision::Bf16 => DType::BF16,
        Precision::F16 => DType::F16,
        Precision::F32 | Precision::Int8 => DType::F32,
    }
}

/// The precision an operator's backward runs in.
fn backward_precision(p: Precision) -> Precision {
    if p == Precision::Int8 {
        Precision::Bf16
    } else {
        p
    }
}

/// Casts between representations; int8 quantises per tensor (a host sync for the amax).
fn cast(v: &Value, to: Precision) -> Result<Value> {
    if v.precision == to {
        return Ok(v.clone());
    }
    let real = if v.precision == Precision::Int8 {
        v.t.affine(v.scale, 0.0)?
    } else {
        v.t.clone()
    };
    if to == Precision::Int8 {
        let real = real.to_dtype(DType::F32)?;
        let amax = real.abs()?.max_all()?.to_scalar::<f32>()? as f64;
        let scale = if amax > 0.0 { amax / 127.0 } else { 1.0 };
        return Ok(Value {
            t: real.affine(1.0 / scale, 0.0)?.round()?,
            precision: to,
            scale,
        });
    }
    Ok(Value {
        t: real.to_dtype(dtype(to))?,
        precision: to,
        scale: 1.0,
    })
}

#[derive(Clone, Copy, PartialEq)]
enum Layer {
    Linear { inputs: usize, outputs: usize },
    Relu { width: usize },
}

impl Layer {
    fn kind(self) -> OpKind {
        match self {
            Layer::Linear { .. } => OpKind::Linear,
            Layer::Relu { .. } => OpKind::Activation,
        }
    }

    fn precisions(self) -> Vec<Precision> {
        match self {
            Layer::Linear { .. } => vec![Precision::Int8, Precision::Bf16, Precision::F32],
            Layer::Relu { .. } => vec![Precision::Bf16, Precision::F32],
        }
    }

    /// Forward from an input and weight already in `p`'s representation.
    fn forward(self, x: &Value, w: Option<&Value>) -> Result<Value> {
        match self {
            Layer::Linear { .. } => {
                let w = w.expect("linear has a weight");
                let y = x.t.matmul(&w.t)?;
                if x.precision == Precision::Int8 {
                    Ok(Value {
                        t: y.affine(x.scale * w.scale, 0.0)?,
                        precision: Precision::F32,
                        scale: 1.0,
                    })
                } else {
                    Ok(Value {
                        t: y,
                        precision: x.precision,
                        scale: 1.0,
                    })
                }
            }
            Layer::Relu { .. } => Ok(Value {
                t: x.t.relu()?,
                precision: x.precision,
                scale: 1.0,
            }),
        }
    }

    /// Backward from the saved input/weight (in `p`'s representation) and the output
    /// gradient in `p`'s backward precision: (input gradient, weight gradient).
    fn backward(
        self,
        x: &Value,
        w: Option<&Value>,
        gy: &Tensor,
    ) -> Result<(Tensor, Option<Tensor>)> {
        match self {
            Layer::Linear { .. } => {
                let w = w.expect("linear has a weight");
                // int8 runs its backward in bf16 from the dequantised saved tensors.
                let b = backward_precision(x.precision);
                let (x, w) = (cast(x, b)?.t, cast(w, b)?.t);
                Ok((gy.matmul(&w.t()?)?, Some(x.t()?.matmul(gy)?)))
            }
            Layer::Relu { .. } => Ok(((gy * x.t.gt(0f64)?.to_dtype(gy.dtype())?)?, None)),
        }
    }

    fn shapes(self) -> (usize, usize, usize) {
        match self {
            Layer::Linear { inputs, outputs } => {
                (TOKENS * inputs, inputs * outputs, TOKENS * outputs)
            }
            Layer::Relu { width } => (TOKENS * width, 0, TOKENS * width),
        }
    }
}

struct Model {
    layers: Vec<Layer>,
    /// f32 master weights (`None` for ReLUs).
    weights: Vec<Option<Tensor>>,
    batch: Tensor,
    names: Vec<String>,
}

impl Model {
    fn new(device: &Device) -> Result<Model> {
        let mut layers = Vec::new();
        for pair in WIDTHS.windows(2) {
            layers.push(Layer::Linear {
                inputs: pair[0],
                outputs: pair[1],
            });
            layers.push(Layer::Relu { width: pair[1] });
        }
        layers.pop();
        let weights = layers
            .iter()
            .map(|l| match *l {
                Layer::Linear { inputs, outputs } => {
                    let bound = (1.0 / inputs as f64).sqrt() as f32;
                    Tensor::rand(-bound, bound, (inputs, outputs), device).map(Some)
                }
                Layer::Relu { .. } => Ok(None),
            })
            .collect::<Result<_>>()?;
        let names = layers
            .iter()
            .enumerate()
            .map(|(i, l)| match l {
                Layer::Linear { .. } => format!("linear{i}"),
                Layer::Relu { .. } => format!("relu{i}"),
            })
            .collect();
        Ok(Model {
            layers,
            weights,
            batch: Tensor::rand(-1f32, 1f32, (TOKENS, WIDTHS[0]), device)?,
            names,
        })
    }

    fn graph(&self) -> TrainingGraph {
        TrainingGraph {
            ops: self
                .layers
                .iter()
                .enumerate()
                .map(|(i, l)| {
                    let (input_numel, weight_numel, output_numel) = l.shapes();
                    GraphOp {
                        name: self.names[i].clone(),
                        kind: l.kind(),
                        input: i.checked_sub(1),
                        input_numel,
                        weight_numel,
                        output_numel,
                    }
                })
                .collect(),
            buckets: vec![],
        }
    }

    /// One SGD iteration under `plan`, every cast done where the replayer assumes one.
    /// Returns the f32 tensors the indicator reads: (input, weight, weight grad, output).
    #[allow(clippy::type_complexity)]
    fn iteration(
        &mut self,
        plan: &[Precision],
    ) -> Result<Vec<(Tensor, Option<Tensor>, Option<Tensor>, Tensor)>> {
        let mut x = Value {
            t: self.batch.clone(),
            precision: Precision::F32,
            scale: 1.0,
        };
        let mut saved = Vec::with_capacity(self.layers.len());
        for (i, layer) in self.layers.iter().enumerate() {
            let input = cast(&x, plan[i])?;
            let w = match &self.weights[i] {
                Some(w) => Some(cast(
                    &Value {
                        t: w.clone(),
                        precision: Precision::F32,
                        scale: 1.0,
                    },
                    plan[i],
                )?),
                None => None,
            };
            x = layer.forward(&input, w.as_ref())?;
            saved.push((input, w, x.t.clone()));
        }
        let mut gy = Value {
            t: x.t
                .ones_like()?
                .to_dtype(DType::F32)?
                .affine(1.0 / TOKENS as f64, 0.0)?,
            precision: Precision::F32,
            scale: 1.0,
        };
        let mut stats = Vec::with_capacity(self.layers.len());
        let mut grads = vec![None; self.layers.len()];
        for i in (0..self.layers.len()).rev() {
            let b = backward_precision(plan[i]);
            let g = cast(&gy, b)?;
            let (input, w, y) = &saved[i];
            let (dx, dw) = self.layers[i].backward(input, w.as_ref(), &g.t)?;
            let dw = dw.map(|d| d.to_dtype(DType::F32)).transpose()?;
            stats.push((input.t.clone(), None, dw.clone(), y.clone()));
            grads[i] = dw;
            gy = Value {
                t: dx,
                precision: b,
                scale: 1.0,
            };
        }
        stats.reverse();
        self.sgd(&grads)?;
        for (i, s) in stats.iter_mut().enumerate() {
            s.1 = self.weights[i].clone();
        }
        Ok(stats)
    }

    fn sgd(&mut self, grads: &[Option<Tensor>]) -> Result<()> {
        for (w, g) in self.weights.iter_mut().zip(grads) {
            if let (Some(w), Some(g)) = (w.as_mut(), g) {
                *w = (&*w - g.affine(LR, 0.0)?)?;
            }
        }
        Ok(())
    }
}

/// One layer alone for the profiling harness: input, weight and output gradient prepared
/// in every precision's representation beforehand, so only the operator is timed.
struct LayerOp {
    name: String,
    layer: Layer,
    inputs: Vec<(Precision, Value, Option<Value>, Tensor)>,
    saved: Option<Value>,
}

impl LayerOp {
    fn new(name: &str, layer: Layer, weight: Option<&Tensor>, device: &Device) -> Result<LayerOp> {
        let (input_numel, _, output_numel) = layer.shapes();
        let x = Value {
            t: Tensor::rand(-1f32, 1f32, (TOKENS, input_numel / TOKENS), device)?,
            precision: Precision::F32,
            scale: 1.0,
        };
        let gy = Tensor::rand(-1f32, 1f32, (TOKENS, output_numel / TOKENS), device)?;
        let inputs = layer
            .precisions()
            .into_iter()
            .map(|p| {
                let w = weight
                    .map(|w| {
                        cast(
                            &Value {
                                t: w.clone(),
                                precision: Precision::F32,
                                scale: 1.0,
                            },
                            p,
                        )
                    })
                    .transpose()?;
                Ok((
                    p,
                    cast(&x, p)?,
                    w,
                    gy.to_dtype(dtype(backward_precision(p)))?,
                ))
            })
            .collect::<Result<_>>()?;
        Ok(LayerOp {
            name: name.into(),
            layer,
            inputs,
            saved: None,
        })
    }
}

impl ProfiledOp for LayerOp {
    fn name(&self) -> &str {
        &self.name
    }
    fn kind(&self) -> OpKind {
        self.layer.kind()
    }
    fn precisions(&self) -> Vec<Precision> {
        self.layer.precisions()
    }
    fn run(&mut self, precision: Precision, pass: Pass) -> Result<()> {
        let (_, x, w, gy) = self
            .inputs
            .iter()
            .find(|i| i.0 == precision)
            .expect("prepared");
        match pass {
            Pass::Forward => {
                std::hint::black_box(self.layer.forward(x, w.as_ref())?);
                self.saved = Some(x.clone());
            }
            Pass::Backward => {
                let x = self.saved.take().expect("forward before backward");
                let (dx, dw) = self.layer.backward(&x, w.as_ref(), gy)?;
                // The weight gradient's cast to f32 is the replayer's, not the operator's.
                std::hint::black_box((dx, dw));
            }
        }
        Ok(())
    }
}

/// The casts this model does, timed on fresh tensors.
struct Casts {
    device: Device,
    prepared: Option<(Value, Precision)>,
}

impl ProfiledCast for Casts {
    fn pairs(&self) -> Vec<(Precision, Precision)> {
        use Precision::*;
        vec![(F32, Bf16), (Bf16, F32), (F32, Int8), (Bf16, Int8)]
    }
    fn prepare(&mut self, from: Precision, to: Precision, numel: usize) -> Result<()> {
        let t = Tensor::rand(-1f32, 1f32, numel, &self.device)?.to_dtype(dtype(from))?;
        self.prepared = Some((
            Value {
                t,
                precision: from,
                scale: 1.0,
            },
            to,
        ));
        Ok(())
    }
    fn cast(&mut self) -> Result<()> {
        let (v, to) = self.prepared.as_ref().expect("prepared");
        std::hint::black_box(cast(v, *to)?);
        Ok(())
    }
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

fn percentile(values: &[f64], q: f64) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = (q * (v.len() - 1) as f64).round() as usize;
    v[rank]
}

/// One run of a plan: the fastest of `ITERATIONS` iterations after a warm-up (the least
/// disturbed by the processes sharing the cores, as the profile keeps each operator's).
fn run_plan(model: &mut Model, plan: &[Precision]) -> Result<f64> {
    model.iteration(plan)?;
    let mut best = f64::INFINITY;
    for _ in 0..ITERATIONS {
        let start = Instant::now();
        model.iteration(plan)?;
        best = best.min(start.elapsed().as_secs_f64() * 1e3);
    }
    Ok(best)
}

fn plan_label(plan: &[Precision]) -> String {
    plan.iter()
        .map(|p| p.as_str())
        .collect::<Vec<_>>()
        .join(" ")
}

extern "C" {
    /// glibc's allocator tuning (`malloc.h`).
    fn mallopt(param: std::ffi::c_int, value: std::ffi::c_int) -> std::ffi::c_int;
}

/// Keeps freed memory in the process. By default glibc returns every large freed block to
/// the kernel, so each large temporary is page-faulted in afresh: an operator timed alone
/// in a loop pays that on every run while the training loop, holding its activations,
/// mostly does not, and the difference is the allocator's, not the operators'. A training
/// engine reuses its buffers (PyTorch's caching allocator); this is the nearest without one.
fn keep_freed_memory() {
    const M_TRIM_THRESHOLD: std::ffi::c_int = -1;
    const M_MMAP_THRESHOLD: std::ffi::c_int = -3;
    // SAFETY: mallopt only sets two of glibc's allocator parameters; called before any
    // other thread exists.
    unsafe {
        mallopt(M_MMAP_THRESHOLD, 32 << 20);
        mallopt(M_TRIM_THRESHOLD, 1 << 30);
    }
}

fn main() -> anyhow::Result<()> {
    keep_freed_memory();
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        // Before any candle op reads it; no other thread runs yet.
        std::env::set_var("RAYON_NUM_THREADS", "1");
    }
    let threads = candle_core::utils::get_num_threads();
    let device = Device::Cpu;
    let started = chrono::Utc::now();
    let mut model = Model::new(&device)?;
    let graph = model.graph();

    // 1. What a rank profiles: each operator alone, the casts, the optimizer step.
    let config = ProfileConfig {
        warmup: 2,
        iterations: 15,
        statistic: Statistic::Min,
    };
    let mut ops: Vec<LayerOp> = model
        .layers
        .iter()
        .enumerate()
        .map(|(i, &l)| LayerOp::new(&model.names[i], l, model.weights[i].as_ref(), &device))
        .collect::<Result<_>>()?;
    let mut dyn_ops: Vec<&mut dyn ProfiledOp> =
        ops.iter_mut().map(|o| o as &mut dyn ProfiledOp).collect();
    let mut table = profile_ops("cpu", &mut dyn_ops, &config)?;
    // The sizes this model casts (activations, weights) and two between them.
    let sizes: Vec<usize> = vec![
        TOKENS * 192,
        TOKENS * 384,
        TOKENS * 768,
        TOKENS * 1536,
        384 * 1536,
    ];
    let cast_samples = measure_casts(
        &mut Casts {
            device: device.clone(),
            prepared: None,
        },
        &sizes,
        &config,
    )?;
    let casts = fit_cast_model(&cast_samples)?;
    let grads: Vec<Option<Tensor>> = model
        .weights
        .iter()
        .map(|w| w.as_ref().map(|w| w.zeros_like()).transpose())
        .collect::<Result<_>>()?;
    let mut sgd = Vec::new();
    for _ in 0..15 {
        let start = Instant::now();
        model.sgd(&grads)?;
        sgd.push(start.elapsed().as_secs_f64() * 1e3);
    }
    table.optimizer_ms = config.statistic.of(&mut sgd);
    // The loss gradient the backward starts from: the loop's only work outside the operators.
    let output = Tensor::zeros((TOKENS, WIDTHS[WIDTHS.len() - 1]), DType::F32, &device)?;
    let mut loss = Vec::new();
    for _ in 0..15 {
        let start = Instant::now();
        std::hint::black_box(output.ones_like()?.affine(1.0 / TOKENS as f64, 0.0)?);
        loss.push(start.elapsed().as_secs_f64() * 1e3);
    }
    table.overhead_ms = config.statistic.of(&mut loss);
    let rank = RankProfile::new(&graph, &table, &casts, Precision::Bf16)?;
    for fit in &casts.fits {
        println!(
            "cast {}->{}: {:.3e} ms/element + {:.4} ms, R² {:.4}",
            fit.from, fit.to, fit.ms_per_element, fit.fixed_ms, fit.r2
        );
    }

    // 2. The indicator from one f32 iteration's real tensors.
    let f32_plan = vec![Precision::F32; graph.ops.len()];
    let tensors = model.iteration(&f32_plan)?;
    let stats: Vec<OpStats> = tensors
        .iter()
        .map(|(x, w, g, y)| match (w, g) {
            (Some(w), Some(g)) => OpStats::weighted_tensors(x, w, g, y),
            _ => OpStats::single_input_tensor(x),
        })
        .collect::<std::result::Result<_, _>>()?;
    let depths: Vec<usize> = (1..=stats.len()).collect();
    let indicators =
        Indicators::gradient_variance(&stats, &depths, stats.len(), &IndicatorConfig::default())?;

    // 3. Plans: uniform and seeded random mixes.
    let levels: Vec<Vec<Precision>> = (0..graph.ops.len()).map(|i| rank.precisions(i)).collect();
    let uniform = |p: Precision| -> Vec<Precision> {
        levels
            .iter()
            .map(|l| {
                l.iter()
                    .copied()
                    .find(|&q| q >= p)
                    .unwrap_or(Precision::F32)
            })
            .collect()
    };
    let mut plans: Vec<(String, Vec<Precision>)> = vec![
        ("uniform f32".into(), uniform(Precision::F32)),
        ("uniform bf16".into(), uniform(Precision::Bf16)),
        ("uniform int8".into(), uniform(Precision::Int8)),
    ];
    let mut rng = tessera_worker::train::rng::Rng::new(12);
    for k in 0..RANDOM_PLANS {
        let plan = levels.iter().map(|l| l[rng.below(l.len())]).collect();
        plans.push((format!("random {k}"), plan));
    }
    let predict = |plan: &[Precision]| -> std::result::Result<Prediction, QsyncError> {
        let t = rank.replay(&graph, plan)?;
        let ms = t.compute_ms + t.optimizer_ms;
        Ok(Prediction {
            rank_ms: ms,
            step_ms: ms,
        })
    };
    // The allocator on this rank alone, from its fastest plan, at budgets between that plan's
    // and all-f32's predicted time (reported, not measured: it picks among plans like these).
    // No LayerNorm, embedding or head in this chain, so the keep-list floors nothing.
    let fastest = plans
        .iter()
        .map(|(_, p)| {
            (
                predict(p).map(|x| x.step_ms).unwrap_or(f64::INFINITY),
                p.clone(),
            )
        })
        .min_by(|a, b| a.0.total_cmp(&b.0))
        .expect("plans");
    let all_f32 = predict(&f32_plan)?.step_ms;
    let mut allocations = Vec::new();
    // With nothing between the fastest plan and all f32 there is one budget to try.
    let shares: &[f64] = if all_f32 > fastest.0 {
        &[0.25, 0.5, 0.75, 1.0]
    } else {
        &[1.0]
    };
    for &share in shares {
        let budget = fastest.0 + share * (all_f32 - fastest.0).max(0.0);
        let a = greedy(
            &model.names,
            &levels,
            &indicators,
            &fastest.1,
            budget,
            &mut |p| predict(p),
        )?;
        println!(
            "allocator, budget {budget:.2} ms: predicted {:.2} ms, Σω {:.3e} [{}]",
            a.predicted.step_ms,
            a.indicator_sum(&indicators),
            plan_label(&a.plan)
        );
        allocations.push(json!({
            "budget_ms": budget, "predicted_ms": a.predicted.step_ms, "precisions": a.plan,
            "indicator_sum": a.indicator_sum(&indicators),
            "raises": a.trace.iter().filter(|t| t.accepted).count(),
        }));
    }

    // 4. Predicted against measured.
    let mut rows = Vec::new();
    let mut errors = Vec::new();
    // Runs go round the plans, so a change in the machine's load falls on every plan alike.
    let mut runs = vec![Vec::with_capacity(RUNS); plans.len()];
    for _ in 0..RUNS {
        for (k, (_, plan)) in plans.iter().enumerate() {
            runs[k].push(run_plan(&mut model, plan)?);
        }
    }
    for ((label, plan), runs) in plans.iter().zip(runs) {
        let t = rank.replay(&graph, plan)?;
        let predicted = t.compute_ms + t.optimizer_ms;
        let measured = median(&mut runs.clone());
        let error = (predicted - measured) / measured;
        errors.push(error.abs());
        println!(
            "{label}: predicted {predicted:.2} ms, measured {measured:.2} ms (runs {:.2?}), error {:+.1}% [{}]",
            runs,
            100.0 * error,
            plan_label(plan)
        );
        rows.push(json!({
            "plan": label, "precisions": plan, "predicted_ms": predicted, "measured_ms": measured,
            "runs_ms": runs, "error": error, "cast_ms": t.cast_ms,
        }));
    }
    let signed: Vec<f64> = rows
        .iter()
        .map(|r| r["error"].as_f64().unwrap_or(f64::NAN))
        .collect();
    let under = signed.iter().filter(|&&e| e < 0.0).count();
    let mean_signed = signed.iter().sum::<f64>() / signed.len() as f64;
    let median_error = percentile(&errors, 0.5);
    let p90_error = percentile(&errors, 0.9);
    println!(
        "median |error| {:.1}%, p90 |error| {:.1}% over {} plans",
        100.0 * median_error,
        100.0 * p90_error,
        plans.len()
    );

    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let result = json!({
        "machine": machine(),
        "load_average": load.split_whitespace().take(3).collect::<Vec<_>>().join(" "),
        "date": started.to_rfc3339(),
        "command": "cargo run --release -p tessera-bench --bin qsync_predictor",
        "tokens": TOKENS, "widths": WIDTHS, "threads": threads,
        "cost_table": table, "cast_model": casts,
        "cast_samples": cast_samples.iter().map(|s| json!({"from": s.0, "to": s.1, "numel": s.2, "ms": s.3})).collect::<Vec<_>>(),
        "plans": rows,
        "median_abs_error": median_error, "p90_abs_error": p90_error,
        "predicted_below_measured": under, "mean_signed_error": mean_signed,
        "allocations": allocations,
    });
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("results");
    std::fs::write(
        dir.join("qsync_predictor.json"),
        serde_json::to_string_pretty(&result)?,
    )?;
    std::fs::write(
        dir.join("qsync_predictor.md"),
        markdown(&result, &table, &casts, &rows),
    )?;
    Ok(())
}

fn markdown(
    result: &serde_json::Value,
    table: &tessera_api::precision::CostTable,
    casts: &tessera_api::precision::CastModel,
    rows: &[serde_json::Value],
) -> String {
    let mut md = String::from("# QSync predictor benchmark\n\n");
    md += &format!(
        "- Command: `{}` (writes `qsync_predictor.json` beside this file)\n",
        result["command"].as_str().unwrap_or("")
    );
    md += &format!(
        "- Machine: {}; candle on {} thread(s); load average at the end {} (other builds share the cores)\n",
        result["machine"].as_str().unwrap_or(""),
        result["threads"],
        result["load_average"].as_str().unwrap_or("")
    );
    md += &format!("- Date: {}\n", result["date"].as_str().unwrap_or(""));
    md += &format!(
        "- Model: linear + ReLU chain at widths {WIDTHS:?}, {TOKENS} tokens, SGD; one rank, no all-reduce. Each precision is a candle stand-in \
         (f32 and bf16 candle matmuls; int8 = per-tensor quantised values in f32 through candle's f32 matmul, backward in bf16) until the project's own ops merge.\n"
    );
    md += &format!(
        "- Measured: median of {RUNS} runs (taken round the plans), each the fastest of {ITERATIONS} iterations after a warm-up. Predicted: the replayer over the operators \
         profiled alone (fastest of 15, the same statistic), the fitted casts, the loss gradient and the optimizer step, each timed alone; it never sees a whole iteration.\n\n"
    );
    md += &format!(
        "**Median |error| {:.1}%, p90 |error| {:.1}%** over {} plans (goal: median ≤ 5%, p90 ≤ 10%).\n\n",
        100.0 * result["median_abs_error"].as_f64().unwrap_or(f64::NAN),
        100.0 * result["p90_abs_error"].as_f64().unwrap_or(f64::NAN),
        rows.len()
    );
    md += &format!(
        "Predicted below measured on {} of {} plans; mean signed error {:+.1}%. What the loop does besides the profiled pieces \
         (tensor bookkeeping, caches cooled between a layer's forward and its backward) is not in the model.\n\n",
        result["predicted_below_measured"],
        rows.len(),
        100.0 * result["mean_signed_error"].as_f64().unwrap_or(f64::NAN)
    );
    md += "| plan | predicted ms | measured ms | error | of which casts (predicted) | precisions |\n|---|---|---|---|---|---|\n";
    for r in rows {
        let precisions: Vec<String> = r["precisions"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|p| p.as_str().unwrap_or("").to_string())
                    .collect()
            })
            .unwrap_or_default();
        md += &format!(
            "| {} | {:.2} | {:.2} | {:+.1}% | {:.2} | {} |\n",
            r["plan"].as_str().unwrap_or(""),
            r["predicted_ms"].as_f64().unwrap_or(f64::NAN),
            r["measured_ms"].as_f64().unwrap_or(f64::NAN),
            100.0 * r["error"].as_f64().unwrap_or(f64::NAN),
            r["cast_ms"].as_f64().unwrap_or(f64::NAN),
            precisions.join(" ")
        );
    }
    md += "\n## Operators profiled alone (forward / backward ms)\n\n| op | int8 | bf16 | f32 |\n|---|---|---|---|\n";
    for op in &table.ops {
        let cell = |p: Precision| {
            op.timings
                .iter()
                .find(|t| t.precision == p)
                .map(|t| format!("{:.2} / {:.2}", t.forward_ms, t.backward_ms))
                .unwrap_or_else(|| "–".into())
        };
        md += &format!(
            "| {} | {} | {} | {} |\n",
            op.op,
            cell(Precision::Int8),
            cell(Precision::Bf16),
            cell(Precision::F32)
        );
    }
    md += &format!("\nLoss gradient: {:.3} ms; optimizer step: {:.2} ms.\n\n## Cast model `t = a·numel + b`\n\n| cast | a (ms/element) | b (ms) | R² |\n|---|---|---|---|\n", table.overhead_ms, table.optimizer_ms);
    for f in &casts.fits {
        md += &format!(
            "| {} → {} | {:.3e} | {:.4} | {:.4} |\n",
            f.from, f.to, f.ms_per_element, f.fixed_ms, f.r2
        );
    }
    md += "\n## Allocator on this rank\n\nFrom the fastest plan above, at budgets between its predicted time and all-f32's. \
           With these candle stand-ins bf16 and int8 are not faster than f32 on this CPU, so the fastest plan is all f32 \
           and there is nothing to allocate; the speed-up figure waits for the real ops and unequal ranks.\n\n\
           | budget ms | predicted ms | raises | Σω | precisions |\n|---|---|---|---|---|\n";
    for a in result["allocations"].as_array().into_iter().flatten() {
        let precisions: Vec<String> = a["precisions"]
            .as_array()
            .map(|v| {
                v.iter()
                    .map(|p| p.as_str().unwrap_or("").to_string())
                    .collect()
            })
            .unwrap_or_default();
        md += &format!(
            "| {:.2} | {:.2} | {} | {:.3e} | {} |\n",
            a["budget_ms"].as_f64().unwrap_or(f64::NAN),
            a["predicted_ms"].as_f64().unwrap_or(f64::NAN),
            a["raises"],
            a["indicator_sum"].as_f64().unwrap_or(f64::NAN),
            precisions.join(" ")
        );
    }
    md
}
