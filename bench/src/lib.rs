//! What the benchmark programs share: the machine's description, the real datasets they
//! train on (`datasets`), paired statistics over seeds (`stats`) and result files several
//! benchmarks write into (`report`).

pub mod datasets;
pub mod report;
pub mod stats;

/// The CPU model and the cores this process may use, for a result file's header.
pub fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    format!("{cpu}, {cores} cores available")
}

/// The CPU flags that decide which GEMMs run (AVX2/FMA for candle's f32, AVX512-BF16 and
/// AVX512-VNNI for the training ops' bf16 and int8), for a result file's header.
pub fn cpu_flags() -> String {
    let flags = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("flags")).map(|l| l.to_string()))
        .unwrap_or_default();
    let wanted = ["avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16"];
    let present: Vec<&str> = wanted.iter().copied().filter(|w| flags.split_whitespace().any(|f| f == *w)).collect();
    if present.is_empty() {
        "none of avx2/fma/avx512f".into()
    } else {
        present.join(", ")
    }
}

/// How many tasks candle's f32 GEMM is split into (`RAYON_NUM_THREADS`, which it reads at
/// every matmul; by default the host's physical cores, whatever pool it runs in), for a
/// benchmark whose ranks run in pools of `threads` threads. Unless given, set to the least
/// common multiple of those counts, so that every rank's pool runs whole rounds of tasks (12
/// tasks: 1 round on 12 threads, 3 on 4); a split of 8 (an 8-core default) would leave a
/// 12-thread rank's f32 GEMMs 8-way. Call it before any other thread starts.
pub fn split_gemms_for(threads: &[usize]) -> usize {
    if let Some(given) = std::env::var("RAYON_NUM_THREADS").ok().and_then(|v| v.parse().ok()).filter(|&n: &usize| n > 0)
    {
        return given;
    }
    let gcd = |mut a: usize, mut b: usize| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    let lcm = threads.iter().fold(1, |l, &t| l / gcd(l, t) * t);
    // Edition 2021, and no other thread has started yet.
    std::env::set_var("RAYON_NUM_THREADS", lcm.to_string());
    lcm
}
