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
