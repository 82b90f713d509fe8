use std::path::PathBuf;

use clap::Parser;
use tessera_worker::agent::{Agent, AgentConfig};
use tessera_worker::serve::batcher::Admission;
use tessera_worker::serve::binding::{CpuPrecision, Policy};
use tessera_worker::serve::endpoint::Endpoint;
use tessera_worker::serve::process::{run_engine, EngineArgs};

/// Tessera worker: offers this host's devices to a Tessera server and runs the work it leases.
#[derive(Debug, Parser)]
#[command(name = "tessera-worker", version)]
struct Cli {
    /// Base URL of the Tessera server.
    #[arg(long, env = "TESSERA_SERVER_URL", default_value = "http://127.0.0.1:8080")]
    server: String,
    /// Shared secret the server was started with.
    #[arg(long, env = "TESSERA_WORKER_TOKEN", hide_env_values = true)]
    worker_token: String,
    /// Name this worker registers under (default: the hostname). Keep it stable: a worker
    /// that restarts under the same name is the same worker.
    #[arg(long, env = "TESSERA_WORKER_NAME")]
    name: Option<String>,
    /// Where the worker caches model files and datasets.
    #[arg(long, env = "TESSERA_WORKER_DATA_DIR", default_value = ".tessera-worker")]
    data_dir: PathBuf,
    /// Batch jobs run at the same time.
    #[arg(long, env = "TESSERA_WORKER_SLOTS", default_value_t = 1)]
    slots: usize,
    /// Address the engine endpoint listens on (the server's gateway calls it).
    #[arg(long, env = "TESSERA_WORKER_LISTEN", default_value = "127.0.0.1:0")]
    listen: String,
    /// URL the server should use to reach the engine endpoint (default: the listen
    /// address); set it when the worker is behind NAT or in a container.
    #[arg(long, env = "TESSERA_WORKER_ADVERTISE_URL")]
    advertise_url: Option<String>,
    /// Offer simulated GPUs instead of the real ones, e.g.
    /// `H100-80GB:mig=3g.40gb+2g.20gb+2g.20gb,A100-80GB` (MODEL[:mig=PROFILE+…], a profile
    /// may carry its start as `3g.40gb@4`). Replicas bound to simulated slices run the CPU
    /// engine; tests and demos use it to run the MIG flow without a GPU.
    #[arg(long, env = "TESSERA_SIMULATE_GPUS")]
    simulate_gpus: Option<String>,
    /// Let the server's scheduler change this worker's MIG partitions to fit throughput
    /// SLOs (applied to simulated GPUs; for real GPUs it shows the steps it would take).
    #[arg(long, env = "TESSERA_ALLOW_REPARTITION")]
    allow_repartition: bool,
    /// Run each replica bound to a simulated slice in its own CPU engine process, as the
    /// cuda build runs replicas on real slices (the flow tests and demos exercise).
    #[arg(long, env = "TESSERA_SLICE_PROCESSES")]
    slice_processes: bool,
    /// What the CPU engine's matrix multiplications take as inputs (always accumulating in
    /// f32): `auto` is bf16 on CPUs with AVX512-BF16 where a timing at start finds it at
    /// least 1.3× as fast (AMD Zen 4: about 2.4×; embeddings within cosine 0.9999 of f32 on
    /// MiniLM), f32 elsewhere. `f32` keeps every step in f32.
    #[arg(long, env = "TESSERA_CPU_PRECISION", value_enum, default_value_t = CpuPrecision::Auto)]
    cpu_precision: CpuPrecision,
    /// Test-only: data-parallel training ranks on this worker compute this many times slower
    /// (sleeping in proportion to their compute), so tests of precision planning can run
    /// unequal ranks on one host. Never use it for measurements.
    #[arg(long, env = "TESSERA_TEST_SLOWDOWN", hide = true)]
    test_slowdown: Option<f64>,
    /// What each replica takes on before it refuses work (README, "Limits").
    #[command(flatten)]
    admission: Admission,
}

/// `tessera-worker engine …`: one replica's engine, started by a worker for a slice
/// (`serve::process`); not meant to be run by hand.
#[derive(Debug, Parser)]
#[command(name = "tessera-worker engine")]
struct EngineCli {
    #[command(flatten)]
    args: EngineArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let kept = tessera_worker::memory::keep_freed_memory();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    if !kept {
        tracing::warn!("heap settings not applied (not glibc, or glibc refused them): CPU training may spend its time zeroing pages");
    }
    if std::env::args().nth(1).as_deref() == Some("engine") {
        let engine = EngineCli::parse_from(std::env::args().skip(1));
        // Exits here: the runtime would wait for its stdin read, which cannot be cancelled
        // and ends only when the worker closes the pipe.
        let code = match run_engine(engine.args).await {
            Ok(()) => 0,
            Err(error) => {
                eprintln!("Error: {error}");
                1
            }
        };
        std::process::exit(code);
    }
    let cli = Cli::parse();
    #[cfg(feature = "cuda")]
    check_gpu()?;
    let mut inventory = tessera_worker::inventory::detect();
    let name = cli.name.unwrap_or_else(|| inventory.hostname.clone());
    if let Some(spec) = &cli.simulate_gpus {
        let (gpus, slices) = tessera_worker::slices::simulate(spec, &name)?;
        tracing::info!(gpus = gpus.len(), slices = slices.len(), "offering simulated GPUs instead of this host's");
        (inventory.gpus, inventory.slices) = (gpus, slices);
    }
    // One replica per slice; a worker without slices serves one replica on its CPU.
    let replica_slots = inventory.slices.len().max(1);
    std::fs::create_dir_all(&cli.data_dir)?;
    let endpoint = Endpoint::start(&cli.listen, cli.advertise_url).await?;
    let agent = Agent::new(AgentConfig {
        server: cli.server,
        worker_token: cli.worker_token,
        name,
        data_dir: cli.data_dir,
        slots: cli.slots.max(1),
        replica_slots,
        inventory,
        allow_repartition: cli.allow_repartition,
        endpoint,
        binding: Policy::of_build(cli.slice_processes, cli.cpu_precision, cli.admission),
        test_slowdown: cli.test_slowdown,
    })?;
    tokio::select! {
        refused = agent.run() => return Err(refused.into()),
        _ = tokio::signal::ctrl_c() => {
            tracing::info!("stopping; leased jobs go back to the queue when their leases expire");
        }
    }
    Ok(())
}

/// A cuda build on the wrong GPU or driver would fail only at its first kernel launch, with
/// the driver's terse error: check at start and say what to rebuild.
#[cfg(feature = "cuda")]
fn check_gpu() -> anyhow::Result<()> {
    use tessera_worker::engine::ops::cuda::compute_cap;
    let report = compute_cap::probe(0).map_err(|reason| anyhow::anyhow!(reason))?;
    if let Some(advice) = &report.advice {
        tracing::warn!("{advice}");
    }
    tracing::info!(
        gpu = %report.name,
        compute_capability = format!("{}.{}", report.compute_cap.0, report.compute_cap.1),
        driver = report.driver,
        built_for = compute_cap::built_for(),
        "CUDA kernels load on this GPU"
    );
    Ok(())
}
