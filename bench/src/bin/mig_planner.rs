//! MIG planner benchmark: GPUs each planner needs on reproducible workloads, against one
//! whole GPU per service and the best single homogeneous partition, with the gap to the
//! optimum where the exact search proves it, else to the lower bound, and planning time.
//!
//! Workloads are generated from a fixed seed: services drawn from model archetypes whose
//! throughput scales non-linearly with the slice size (as MIG-serving observes: several
//! small slices often beat one large one for small models, large models need big slices),
//! demands skewed (log-normal or Zipf). Prints one line per figure; writes
//! bench/results/mig_planner.json.
//!
//! Run: cargo run --release -p tessera-bench --bin mig_planner

use std::time::Instant;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use tessera_bench::machine;
use tessera_server::scheduler::mig::{best_homogeneous, plan, Algorithm, GpuModel, Options, Outcome, Problem, Service};

/// How a model's throughput grows with compute slices 1, 2, 3, 4, 7, relative to 1g.
struct Archetype {
    name: &'static str,
    curve: [f64; 5],
    /// Smallest instance memory (GB) the model fits in.
    min_memory_gb: u16,
    /// Throughput on the smallest slice it fits, req/s (range).
    base: (f64, f64),
}

const ARCHETYPES: [Archetype; 6] = [
    // Small CNNs (ResNet-50, Inception-v3 class): two 1g beat one 2g.
    Archetype { name: "cnn-small", curve: [1.0, 1.75, 2.45, 3.05, 4.5], min_memory_gb: 5, base: (250.0, 600.0) },
    Archetype { name: "inception", curve: [1.0, 1.7, 2.35, 2.9, 4.2], min_memory_gb: 5, base: (200.0, 450.0) },
    // Encoder transformers: close to linear.
    Archetype { name: "bert-base", curve: [1.0, 1.95, 2.85, 3.7, 6.0], min_memory_gb: 5, base: (120.0, 300.0) },
    Archetype { name: "linear", curve: [1.0, 2.0, 3.0, 4.0, 6.9], min_memory_gb: 5, base: (80.0, 250.0) },
    // Larger models: small slices starve the batch, big ones scale super-linearly.
    Archetype { name: "bert-large", curve: [1.0, 2.25, 3.6, 5.0, 9.2], min_memory_gb: 10, base: (40.0, 110.0) },
    Archetype { name: "gpt2-xl", curve: [1.0, 2.4, 3.9, 5.5, 10.5], min_memory_gb: 20, base: (8.0, 30.0) },
];

fn curve_at(a: &Archetype, compute: u8) -> f64 {
    match compute {
        1 => a.curve[0],
        2 => a.curve[1],
        3 => a.curve[2],
        4 => a.curve[3],
        _ => a.curve[4],
    }
}

/// A throughput table for one service on `gpu`: every profile big enough in memory, the
/// two-memory-slice 1g a little faster than the plain 1g, ±4% noise per profile.
fn table(rng: &mut StdRng, gpu: GpuModel, a: &Archetype) -> Vec<f64> {
    let base = rng.gen_range(a.base.0..a.base.1);
    gpu.profiles()
        .iter()
        .map(|p| {
            if p.name.ends_with("+me") || p.memory_gb < a.min_memory_gb {
                return 0.0;
            }
            let extra_memory = if p.compute == 1 && p.memory == 2 { 1.08 } else { 1.0 };
            (base * curve_at(a, p.compute) * extra_memory * rng.gen_range(0.96..1.04)).round()
        })
        .collect()
}

/// Demand skew.
enum Skew {
    /// Demand in whole-GPU units, log-normal with this median and σ, clipped.
    LogNormal { median: f64, sigma: f64, max: f64 },
    /// Zipf with exponent s over the services, scaled to `total` whole GPUs.
    Zipf { s: f64, total: f64 },
}

struct Workload {
    name: &'static str,
    gpu: GpuModel,
    services: usize,
    skew: Skew,
    seed: u64,
    /// Archetypes to draw from (indices into ARCHETYPES).
    mix: &'static [usize],
}

fn normal(rng: &mut StdRng) -> f64 {
    // Box–Muller.
    let u: f64 = rng.gen_range(f64::EPSILON..1.0);
    let v: f64 = rng.gen_range(0.0..1.0);
    (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
}

fn generate(w: &Workload) -> Problem {
    let mut rng = StdRng::seed_from_u64(w.seed);
    let whole = w.gpu.whole_gpu_profile();
    let zipf_norm: f64 = (1..=w.services)
        .map(|i| {
            (i as f64).powf(-match w.skew {
                Skew::Zipf { s, .. } => s,
                _ => 1.0,
            })
        })
        .sum();
    let services = (0..w.services)
        .map(|i| {
            let a = &ARCHETYPES[w.mix[rng.gen_range(0..w.mix.len())]];
            let throughput = table(&mut rng, w.gpu, a);
            let gpus = match w.skew {
                Skew::LogNormal { median, sigma, max } => (median * (sigma * normal(&mut rng)).exp()).clamp(0.02, max),
                Skew::Zipf { s, total } => total * ((i + 1) as f64).powf(-s) / zipf_norm,
            };
            let demand = (gpus * throughput[whole]).round().max(1.0);
            Service { name: format!("{}-{i}", a.name), demand, latency_ms: Some(50.0), throughput }
        })
        .collect();
    Problem { gpu: w.gpu, services }
}

fn timed(problem: &Problem, algorithm: Algorithm, repeats: usize) -> (Outcome, f64) {
    let mut times = Vec::new();
    let mut outcome = None;
    for _ in 0..repeats {
        let started = Instant::now();
        let o = plan(problem, algorithm, &Options::default());
        times.push(started.elapsed().as_secs_f64() * 1000.0);
        outcome = Some(o);
    }
    times.sort_by(f64::total_cmp);
    (outcome.unwrap(), times[times.len() / 2])
}

fn pct(a: usize, b: usize) -> f64 {
    100.0 * (b as f64 - a as f64) / b as f64
}

fn main() {
    let all_mix: &[usize] = &[0, 1, 2, 3, 4, 5];
    let workloads = [
        Workload {
            name: "small-a",
            gpu: GpuModel::A100_40GB,
            services: 10,
            skew: Skew::LogNormal { median: 0.3, sigma: 0.9, max: 1.5 },
            seed: 1,
            mix: all_mix,
        },
        Workload {
            name: "small-b",
            gpu: GpuModel::A100_80GB,
            services: 10,
            skew: Skew::LogNormal { median: 0.3, sigma: 0.9, max: 1.5 },
            seed: 2,
            mix: all_mix,
        },
        Workload {
            name: "small-c",
            gpu: GpuModel::H100_80GB,
            services: 10,
            skew: Skew::LogNormal { median: 0.35, sigma: 1.0, max: 2.0 },
            seed: 3,
            mix: all_mix,
        },
        Workload {
            name: "small-d",
            gpu: GpuModel::H200_141GB,
            services: 12,
            skew: Skew::LogNormal { median: 0.3, sigma: 0.8, max: 1.5 },
            seed: 4,
            mix: all_mix,
        },
        Workload {
            name: "paper-mix-24",
            gpu: GpuModel::A100_40GB,
            services: 24,
            skew: Skew::LogNormal { median: 0.5, sigma: 1.0, max: 6.0 },
            seed: 2109,
            mix: all_mix,
        },
        Workload {
            name: "zipf-30",
            gpu: GpuModel::A100_80GB,
            services: 30,
            skew: Skew::Zipf { s: 1.1, total: 28.0 },
            seed: 5,
            mix: all_mix,
        },
        Workload {
            name: "mixed-40",
            gpu: GpuModel::H100_80GB,
            services: 40,
            skew: Skew::LogNormal { median: 0.6, sigma: 1.2, max: 8.0 },
            seed: 6,
            mix: all_mix,
        },
        Workload {
            name: "large-50",
            gpu: GpuModel::A100_80GB,
            services: 50,
            skew: Skew::LogNormal { median: 0.5, sigma: 1.1, max: 8.0 },
            seed: 7,
            mix: all_mix,
        },
        Workload {
            name: "large-50-h200",
            gpu: GpuModel::H200_141GB,
            services: 50,
            skew: Skew::Zipf { s: 0.9, total: 45.0 },
            seed: 8,
            mix: all_mix,
        },
    ];

    let mut records = Vec::new();
    let mut worst_gap: std::collections::BTreeMap<&str, f64> = std::collections::BTreeMap::new();
    let mut slowest_50: f64 = 0.0;
    let mut paper_saving = 0.0;
    for w in &workloads {
        let problem = generate(w);
        let whole = problem.whole_gpu_count().expect("every archetype runs on a whole GPU");
        let homogeneous = best_homogeneous(&problem).expect("some partition serves every service");
        // The exact search alone, with its full node budget, tells whether the optimum is known.
        let (exact, _) = timed(&problem, Algorithm::Exact, 1);
        let optimum = exact.optimal.then_some(exact.plan.gpu_count());
        let mut algos = serde_json::Map::new();
        let mut lower_bound = 0;
        let algorithms = Algorithm::ALL;
        for algorithm in algorithms {
            let (outcome, ms) = timed(&problem, algorithm, 3);
            outcome.plan.check(&problem).expect("plans meet every demand");
            let gpus = outcome.plan.gpu_count();
            lower_bound = lower_bound.max(outcome.lower_bound);
            let reference = optimum.unwrap_or(outcome.lower_bound);
            let gap = 100.0 * (gpus as f64 - reference as f64) / reference as f64;
            let against = if optimum.is_some() { "optimum" } else { "lower bound" };
            println!(
                "{:<14} {:<10} services={:<2} {:<8} gpus={:<3} whole={:<3} ({:+.1}%) homogeneous={:<3} ({:+.1}%) gap={:.1}% vs {} {} time={:.1} ms",
                w.name,
                w.gpu.name(),
                w.services,
                algorithm.name(),
                gpus,
                whole,
                -pct(gpus, whole),
                homogeneous.gpus,
                -pct(gpus, homogeneous.gpus),
                gap,
                against,
                reference,
                ms
            );
            if optimum.is_some() {
                let worst = worst_gap.entry(algorithm.name()).or_insert(0.0f64);
                *worst = worst.max(gap);
            }
            if w.services >= 50 && algorithm == Algorithm::Best {
                slowest_50 = slowest_50.max(ms);
            }
            if w.name == "paper-mix-24" && algorithm == Algorithm::Best {
                paper_saving = pct(gpus, whole);
            }
            algos.insert(
                algorithm.name().into(),
                json!({"gpus": gpus, "time_ms": (ms * 1000.0).round() / 1000.0, "gap_percent": (gap * 100.0).round() / 100.0,
                       "found_by": outcome.found_by.name(), "proven_optimal": outcome.optimal}),
            );
        }
        records.push(json!({
            "workload": w.name, "gpu": w.gpu.name(), "services": w.services, "seed": w.seed,
            "total_demand_req_s": problem.services.iter().map(|s| s.demand).sum::<f64>().round(),
            "whole_gpu": whole,
            "best_homogeneous": {"partition": homogeneous.partition, "gpus": homogeneous.gpus},
            "lower_bound": lower_bound, "optimum": optimum,
            "algorithms": Value::Object(algos),
        }));
    }
    println!(
        "goal fewer-gpus-than-whole on paper-mix-24: best saves {paper_saving:.1}% (target >= 35%) {}",
        verdict(paper_saving >= 35.0)
    );
    let worst_best = worst_gap.get("best").copied().unwrap_or(0.0);
    let known = records.iter().filter(|r| !r["optimum"].is_null()).count();
    println!(
        "goal within-3%-of-optimum where known ({known} of {} workloads): worst gap of best {worst_best:.1}% {}",
        records.len(),
        verdict(worst_best <= 3.0)
    );
    for (name, worst) in &worst_gap {
        println!("worst gap to a known optimum: {name:<8} {worst:.1}%");
    }
    println!("goal under-1s-for-50-services: slowest best {slowest_50:.0} ms {}", verdict(slowest_50 < 1000.0));

    let out = json!({
        "benchmark": "mig_planner",
        "command": "cargo run --release -p tessera-bench --bin mig_planner",
        "machine": machine(),
        "date": chrono::Utc::now().format("%Y-%m-%d %H:%M UTC").to_string(),
        "time_is": "median of 3 runs of the planner (bound included), single thread",
        "workloads": records,
        "goals": {
            "paper_mix_saving_vs_whole_percent": (paper_saving * 10.0).round() / 10.0,
            "worst_gap_to_known_optimum_percent": worst_gap.iter().map(|(k, v)| (k.to_string(), json!((v * 10.0).round() / 10.0))).collect::<serde_json::Map<_, _>>(),
            "slowest_best_50_services_ms": slowest_50.round(),
        },
    });
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/results");
    std::fs::create_dir_all(dir).unwrap();
    let path = format!("{dir}/mig_planner.json");
    std::fs::write(&path, serde_json::to_string_pretty(&out).unwrap() + "\n").unwrap();
    println!("wrote {path}");
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "MET"
    } else {
        "NOT MET"
    }
}
