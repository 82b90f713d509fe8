//! QSync predictor benchmark (issue 12): how close the replayer's predicted iteration time
//! comes to the measured one, over uniform, random and allocator-chosen precision plans of
//! a real CPU model on the project's own training operators.
//!
//! The model is a chain of linear layers and ReLUs at MiniLM's widths (384 ↔ 1536, 256
//! tokens) trained with plain SGD. Every linear is `train::precision::linear` at the plan's
//! precision (f32: the engine's f32 GEMM; bf16: the AVX512-BF16 GEMM; int8: per-tensor quantised
//! VNNI GEMM, backward at bf16), which takes f32, casts or quantises inside and returns f32;
//! ReLUs stay f32. The predictor sees only what a rank of a hybrid job profiles, through the
//! worker's own pieces (`train::hybrid::ops`): one traced f32 forward, each traced operator
//! rerun at each precision it runs at inside rounds of the traced operators in iteration
//! order (`qsync::profile_ops`), the casts fitted to `t = a·numel + b`, plus the optimizer
//! step and the loss timed alone; it never times a whole iteration. Single rank: no
//! all-reduce is measured here.
//!
//! Run: cargo run --release -p tessera-bench --bin qsync_predictor
//! Writes bench/results/qsync_predictor.{json,md}. The GEMMs run on one thread unless
//! RAYON_NUM_THREADS says otherwise: on a shared machine a two-thread GEMM waits for
//! whichever core another process holds, which is noise, not the predictor.

use std::time::Instant;

use candle_core::backprop::GradStore;
use candle_core::{bail, Device, Result, Tensor, Var};
use serde_json::json;
use tessera_api::precision::{CastModel, CostTable, OpKind, Precision};
use tessera_bench::machine;
use tessera_worker::train::hybrid::ops;
use tessera_worker::train::model::{OpTrace, Rerun};
use tessera_worker::train::precision::linear;
use tessera_worker::train::qsync::{
    greedy, IndicatorConfig, Indicators, OpStats, Prediction, QsyncError, RankProfile,
};
use tessera_worker::train::trainer::Slowdown;

const TOKENS: usize = 256;
const WIDTHS: [usize; 5] = [384, 1536, 384, 1536, 384];
const LR: f64 = 1e-4;
/// Timed iterations per run, runs per plan (the figure is the median of the runs).
const ITERATIONS: usize = 7;
const RUNS: usize = 3;
/// Timed rounds of the profile per precision (the fastest round kept, as the in-job planner
/// does).
const PROFILE_ITERATIONS: usize = 15;
/// Random mixed plans besides the three uniform ones.
const RANDOM_PLANS: usize = 7;

enum Layer {
    /// `weight [out, in]`, `bias [out]`: f32 master copies.
    Linear {
        weight: Var,
        bias: Var,
    },
    Relu,
}

struct Model {
    layers: Vec<Layer>,
    names: Vec<String>,
    batch: Tensor,
}

impl Model {
    fn new(device: &Device) -> Result<Model> {
        let mut layers = Vec::new();
        let mut names = Vec::new();
        for pair in WIDTHS.windows(2) {
            let (inputs, outputs) = (pair[0], pair[1]);
            let bound = (1.0 / inputs as f64).sqrt() as f32;
            names.push(format!("linear{}", layers.len()));
            layers.push(Layer::Linear {
                weight: Var::rand(-bound, bound, (outputs, inputs), device)?,
                bias: Var::rand(-bound, bound, outputs, device)?,
            });
            names.push(format!("relu{}", layers.len()));
            layers.push(Layer::Relu);
        }
        layers.pop();
        names.pop();
        Ok(Model {
            layers,
            names,
            batch: Tensor::rand(-1f32, 1f32, (TOKENS, WIDTHS[0]), device)?,
        })
    }

    /// The loss of one forward under `plan` (one precision per layer; a ReLU's is f32).
    /// With `traces`, records every layer as the in-job planner's traced forward does: its
    /// detached input and output, its weight, and a rerun at any precision.
    fn forward(&self, plan: &[Precision], mut traces: Option<&mut Vec<OpTrace>>) -> Result<Tensor> {
        let mut x = self.batch.clone();
        for (i, layer) in self.layers.iter().enumerate() {
            let y = match layer {
                Layer::Linear { weight, bias } => linear(&x, weight, bias, plan[i])?,
                Layer::Relu => x.relu()?,
            };
            if let Some(traces) = traces.as_deref_mut() {
                let input = x.detach();
                let (kind, weight, rerun): (OpKind, Option<Tensor>, Rerun) = match layer {
                    Layer::Linear { weight, bias } => {
                        let (x, w, b) = (
                            input.clone(),
                            weight.as_tensor().clone(),
                            bias.as_tensor().clone(),
                        );
                        (
                            OpKind::Linear,
                            Some(w.clone()),
                            Box::new(move |p| linear(&x, &w, &b, p)),
                        )
                    }
                    Layer::Relu => {
                        // A variable, so the harness's backward reaches the ReLU as the
                        // iteration's does (its input there is a linear's tracked output).
                        let x = Var::from_tensor(&input)?.as_tensor().clone();
                        (
                            OpKind::Activation,
                            None,
                            Box::new(move |p| match p {
                                Precision::F32 => x.relu(),
                                // The trainable ops give activations no lower precision.
                                _ => bail!("relu runs at f32 only"),
                            }),
                        )
                    }
                };
                traces.push(OpTrace {
                    name: self.names[i].clone(),
                    kind,
                    input,
                    output: y.detach(),
                    weight,
                    reads: i.checked_sub(1),
                    rerun,
                });
            }
            x = y;
        }
        loss(&x)
    }

    /// One SGD iteration under `plan`, timed: (whole, forward with the loss, backward) ms.
    fn iteration(&self, plan: &[Precision]) -> Result<(f64, f64, f64)> {
        let start = Instant::now();
        let loss = self.forward(plan, None)?;
        let forward = start.elapsed();
        let grads = loss.backward()?;
        let backward = start.elapsed();
        self.sgd(&grads)?;
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        Ok((ms(start.elapsed()), ms(forward), ms(backward - forward)))
    }

    fn sgd(&self, grads: &GradStore) -> Result<()> {
        for layer in &self.layers {
            if let Layer::Linear { weight, bias } = layer {
                for var in [weight, bias] {
                    if let Some(g) = grads.get(var) {
                        var.set(&(var.as_tensor() - g.affine(LR, 0.0)?)?)?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// The mean over tokens of the summed outputs: the loss gradient is `1/TOKENS` everywhere.
fn loss(output: &Tensor) -> Result<Tensor> {
    output.sum_all()?.affine(1.0 / TOKENS as f64, 0.0)
}

/// QSync's gradient-variance indicator from the traced f32 forward and its gradients, as
/// the in-job planner computes it; depths count the operators in forward order.
fn indicators(
    traces: &[OpTrace],
    grads: &GradStore,
) -> std::result::Result<Indicators, QsyncError> {
    let stats = traces
        .iter()
        .map(|t| match &t.weight {
            Some(w) => {
                let g = grads.get(w).ok_or_else(|| {
                    candle_core::Error::Msg(format!("{}: no weight gradient", t.name))
                })?;
                OpStats::weighted_tensors(&t.input, w, g, &t.output)
            }
            None => OpStats::single_input_tensor(&t.input),
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let depths: Vec<usize> = (1..=stats.len()).collect();
    Indicators::gradient_variance(&stats, &depths, stats.len(), &IndicatorConfig::default())
}

/// The fastest of `PROFILE_ITERATIONS` timed runs of `f`, milliseconds.
fn fastest(mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut best = f64::INFINITY;
    for _ in 0..PROFILE_ITERATIONS {
        let start = Instant::now();
        f()?;
        best = best.min(start.elapsed().as_secs_f64() * 1e3);
    }
    Ok(best)
}

fn percentile(values: &[f64], q: f64) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = (q * (v.len() - 1) as f64).round() as usize;
    v[rank]
}

/// One run of every plan: each plan's fastest of `ITERATIONS` iterations after a warm-up
/// (the least disturbed by the processes sharing the cores, as the profile keeps each
/// precision's least disturbed round), with that iteration's forward and backward, to show where a prediction
/// misses. The iterations go round the plans, so a slow spell of the host costs each plan
/// an iteration or two, which the minimum drops, never a whole run.
fn run_plans(model: &Model, plans: &[(String, Vec<Precision>)]) -> Result<Vec<(f64, f64, f64)>> {
    let mut best = vec![(f64::INFINITY, 0.0, 0.0); plans.len()];
    for iteration in 0..=ITERATIONS {
        for ((_, plan), best) in plans.iter().zip(&mut best) {
            let t = model.iteration(plan)?;
            // The first iteration warms up.
            if iteration > 0 && t.0 < best.0 {
                *best = t;
            }
        }
    }
    Ok(best)
}

/// Evicts the caches (32 MiB L3 here) by writing one byte per line of a larger buffer.
fn evict(buffer: &mut [u8], round: usize) {
    for (j, v) in buffer.iter_mut().enumerate().step_by(64) {
        *v = v.wrapping_add((j ^ round) as u8);
    }
    std::hint::black_box(&buffer[0]);
}

/// A diagnostic, not used by the prediction: each linear shape of the model alone at each
/// precision, forward and backward (fastest of `PROFILE_ITERATIONS`, as the profile), with
/// its operands hot in cache, as a harness rerunning it back to back finds them, and with
/// the caches evicted before each pass: the two bounds the iteration-ordered profile sits
/// between.
fn cache_effect(device: &Device) -> Result<Vec<serde_json::Value>> {
    let mut buffer = vec![0u8; 64 << 20];
    let mut rows = Vec::new();
    for (inputs, outputs) in [(WIDTHS[0], WIDTHS[1]), (WIDTHS[1], WIDTHS[2])] {
        let x = Tensor::rand(-1f32, 1f32, (TOKENS, inputs), device)?;
        let bound = (1.0 / inputs as f64).sqrt() as f32;
        let w = Var::rand(-bound, bound, (outputs, inputs), device)?;
        let b = Var::rand(-bound, bound, outputs, device)?;
        for precision in [Precision::F32, Precision::Bf16, Precision::Int8] {
            let mut row = json!({"inputs": inputs, "outputs": outputs, "precision": precision});
            for (evicted, key) in [(false, "hot"), (true, "evicted")] {
                let (mut forward, mut backward) = (f64::INFINITY, f64::INFINITY);
                for round in 0..=PROFILE_ITERATIONS {
                    if evicted {
                        evict(&mut buffer, round);
                    }
                    let start = Instant::now();
                    let y = linear(&x, &w, &b, precision)?;
                    let f = start.elapsed().as_secs_f64() * 1e3;
                    if evicted {
                        evict(&mut buffer, round);
                    }
                    let start = Instant::now();
                    drop(y.sum_all()?.backward()?);
                    let bw = start.elapsed().as_secs_f64() * 1e3;
                    // The first round warms up.
                    if round > 0 {
                        forward = forward.min(f);
                        backward = backward.min(bw);
                    }
                }
                row[key] = json!({"forward_ms": forward, "backward_ms": backward});
            }
            println!("cache effect {inputs}->{outputs} {precision}: {row}");
            rows.push(row);
        }
    }
    Ok(rows)
}

fn plan_label(plan: &[Precision]) -> String {
    plan.iter()
        .map(|p| p.as_str())
        .collect::<Vec<_>>()
        .join(" ")
}

fn main() -> anyhow::Result<()> {
    // An operator timed alone in a loop would otherwise page-fault its large temporaries in
    // afresh on every run, which the training loop (holding its activations) mostly does not.
    tessera_worker::memory::keep_freed_memory();
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        // Before any GEMM reads it; no other thread runs yet.
        std::env::set_var("RAYON_NUM_THREADS", "1");
    }
    let threads = candle_core::utils::get_num_threads();
    let device = Device::Cpu;
    let started = chrono::Utc::now();
    let model = Model::new(&device)?;
    let f32_plan = vec![Precision::F32; model.layers.len()];

    // 1. What a rank profiles: one traced f32 forward (whose tensors and gradients give the
    //    indicator), each traced operator at every precision it runs at, the casts, the
    //    optimizer step and the loss.
    let mut traces = Vec::with_capacity(model.layers.len());
    let grads = model.forward(&f32_plan, Some(&mut traces))?.backward()?;
    let indicators = indicators(&traces, &grads)?;
    let mut table = ops::profile(
        "cpu",
        &mut traces,
        Precision::Int8,
        PROFILE_ITERATIONS,
        Slowdown::none(),
    )?;
    let casts = ops::profile_cast_model(&device, &traces, PROFILE_ITERATIONS, Slowdown::none())?;
    table.optimizer_ms = fastest(|| model.sgd(&grads))?;
    let output = Tensor::zeros(
        (TOKENS, WIDTHS[WIDTHS.len() - 1]),
        candle_core::DType::F32,
        &device,
    )?;
    table.overhead_ms = fastest(|| loss(&output).map(|l| drop(std::hint::black_box(l))))?;
    let graph = ops::graph(&traces, 0.0);
    drop(traces);
    let rank = RankProfile::new(&graph, &table, &casts, Precision::Bf16)?;

    // 2. Plans: uniform and seeded random mixes.
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
    let fastest_plan = plans
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
    let shares: &[f64] = if all_f32 > fastest_plan.0 {
        &[0.25, 0.5, 0.75, 1.0]
    } else {
        &[1.0]
    };
    for &share in shares {
        let budget = fastest_plan.0 + share * (all_f32 - fastest_plan.0).max(0.0);
        let a = greedy(
            &model.names,
            &levels,
            &indicators,
            &fastest_plan.1,
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

    // 3. Predicted against measured.
    let load_before = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let mut rows = Vec::new();
    let mut errors = Vec::new();
    let mut runs = vec![Vec::with_capacity(RUNS); plans.len()];
    for _ in 0..RUNS {
        for (runs, run) in runs.iter_mut().zip(run_plans(&model, &plans)?) {
            runs.push(run);
        }
    }
    for ((label, plan), runs) in plans.iter().zip(runs) {
        let predicted = predict(plan)?.step_ms;
        let timeline = rank.replay(&graph, plan)?;
        // The run whose whole iteration is the median, with its forward and backward.
        let mut sorted = runs.clone();
        sorted.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (measured, forward, backward) = sorted[sorted.len() / 2];
        let error = (predicted - measured) / measured;
        errors.push(error.abs());
        println!(
            "{label}: predicted {predicted:.2} ms, measured {measured:.2} ms (runs {:.2?}), error {:+.1}%; forward {:.2}/{forward:.2}, backward {:.2}/{backward:.2} [{}]",
            runs.iter().map(|r| r.0).collect::<Vec<_>>(),
            100.0 * error,
            timeline.compute_ms - timeline.backward_ms,
            timeline.backward_ms,
            plan_label(plan)
        );
        rows.push(json!({
            "plan": label, "precisions": plan, "predicted_ms": predicted, "measured_ms": measured,
            "runs_ms": runs.iter().map(|r| r.0).collect::<Vec<_>>(), "error": error,
            "predicted_forward_ms": timeline.compute_ms - timeline.backward_ms, "measured_forward_ms": forward,
            "predicted_backward_ms": timeline.backward_ms, "measured_backward_ms": backward,
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
    let cache = cache_effect(&device)?;
    let loadavg = |s: &str| s.split_whitespace().take(3).collect::<Vec<_>>().join(" ");
    let result = json!({
        "machine": machine(),
        "load_average_before_measuring": loadavg(&load_before),
        "load_average": loadavg(&load),
        "date": started.to_rfc3339(),
        "command": "cargo run --release -p tessera-bench --bin qsync_predictor",
        "tokens": TOKENS, "widths": WIDTHS, "threads": threads,
        "cost_table": table, "cast_model": casts,
        "plans": rows,
        "median_abs_error": median_error, "p90_abs_error": p90_error,
        "predicted_below_measured": under, "mean_signed_error": mean_signed,
        "allocations": allocations,
        "cache_effect": cache,
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
    table: &CostTable,
    casts: &CastModel,
    rows: &[serde_json::Value],
) -> String {
    let mut md = String::from("# QSync predictor benchmark\n\n");
    md += &format!(
        "- Command: `{}` (writes `qsync_predictor.json` beside this file)\n",
        result["command"].as_str().unwrap_or("")
    );
    md += &format!(
        "- Machine: {}; GEMMs on {} thread(s); load average (1/5/15 min) before measuring {}, at the end {} (other processes share the cores)\n",
        result["machine"].as_str().unwrap_or(""),
        result["threads"],
        result["load_average_before_measuring"].as_str().unwrap_or(""),
        result["load_average"].as_str().unwrap_or("")
    );
    md += &format!("- Date: {}\n", result["date"].as_str().unwrap_or(""));
    md += &format!(
        "- Model: linear + ReLU chain at widths {WIDTHS:?}, {TOKENS} tokens, SGD; one rank, no all-reduce. Every linear is the project's \
         `train::precision::linear` at the plan's precision (f32: the engine's f32 GEMM; bf16: AVX512-BF16 GEMM; int8: per-tensor quantised VNNI GEMM, backward at bf16), \
         f32 in and out with the casts inside the op; ReLUs at f32.\n"
    );
    md += &format!(
        "- Measured: median of {RUNS} runs, each the fastest of {ITERATIONS} iterations after a warm-up, the iterations taken round the plans. Predicted: the replayer over the operators \
         profiled by the in-job planner's harness (`train::hybrid::ops::profile`: per precision, rounds of every traced operator's forward in model order \
         then every backward in reverse, the precisions' rounds taken in turn, each operator timed inside the round, each precision's fastest of {PROFILE_ITERATIONS} rounds as a whole kept), the loss and the optimizer step, each timed alone; \
         it never times a whole iteration.\n\n"
    );
    md += &format!(
        "**Median |error| {:.1}%, p90 |error| {:.1}%** over {} plans (goal: median ≤ 5%, p90 ≤ 10%).\n\n",
        100.0 * result["median_abs_error"].as_f64().unwrap_or(f64::NAN),
        100.0 * result["p90_abs_error"].as_f64().unwrap_or(f64::NAN),
        rows.len()
    );
    md += &format!(
        "Predicted below measured on {} of {} plans; mean signed error {:+.1}%.\n\n",
        result["predicted_below_measured"],
        rows.len(),
        100.0 * result["mean_signed_error"].as_f64().unwrap_or(f64::NAN)
    );
    md += "| plan | predicted ms | measured ms | error | forward predicted / measured | backward predicted / measured | precisions |\n|---|---|---|---|---|---|---|\n";
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
            "| {} | {:.2} | {:.2} | {:+.1}% | {:.2} / {:.2} | {:.2} / {:.2} | {} |\n",
            r["plan"].as_str().unwrap_or(""),
            r["predicted_ms"].as_f64().unwrap_or(f64::NAN),
            r["measured_ms"].as_f64().unwrap_or(f64::NAN),
            100.0 * r["error"].as_f64().unwrap_or(f64::NAN),
            r["predicted_forward_ms"].as_f64().unwrap_or(f64::NAN),
            r["measured_forward_ms"].as_f64().unwrap_or(f64::NAN),
            r["predicted_backward_ms"].as_f64().unwrap_or(f64::NAN),
            r["measured_backward_ms"].as_f64().unwrap_or(f64::NAN),
            precisions.join(" ")
        );
    }
    md += "\n## Operators as profiled (forward / backward ms)\n\n| op | int8 | bf16 | f32 |\n|---|---|---|---|\n";
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
    md += &format!("\nLoss: {:.3} ms; optimizer step: {:.2} ms.\n\n## Cast model `t = a·numel + b`\n\nFitted as a rank does; the replay adds none of it here, since the operators cast inside and their profiled times include it.\n\n| cast | a (ms/element) | b (ms) | R² |\n|---|---|---|---|\n", table.overhead_ms, table.optimizer_ms);
    for f in &casts.fits {
        md += &format!(
            "| {} → {} | {:.3e} | {:.4} | {:.4} |\n",
            f.from, f.to, f.ms_per_element, f.fixed_ms, f.r2
        );
    }
    md += "\n## Diagnostic: the linears alone, operands hot or evicted from cache\n\n\
           Not used by the prediction. Each linear shape alone (fastest of the runs), operands hot as a harness rerunning \
           it back to back finds them (the profile before it ran in iteration order), or with a 64 MiB buffer written before each pass, as a layer's tensors are evicted by the rest of an iteration.\n\n\
           | linear | precision | forward hot / evicted ms | backward hot / evicted ms |\n|---|---|---|---|\n";
    for c in result["cache_effect"].as_array().into_iter().flatten() {
        let f = |k: &str, pass: &str| c[k][pass].as_f64().unwrap_or(f64::NAN);
        md += &format!(
            "| {} → {} | {} | {:.2} / {:.2} | {:.2} / {:.2} |\n",
            c["inputs"],
            c["outputs"],
            c["precision"].as_str().unwrap_or(""),
            f("hot", "forward_ms"),
            f("evicted", "forward_ms"),
            f("hot", "backward_ms"),
            f("evicted", "backward_ms")
        );
    }
    md += "\n## Allocator on this rank\n\nFrom the fastest plan above, at budgets between its predicted time and all-f32's (predicted, not measured; \
           one budget when the fastest plan is all f32).\n\n\
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
