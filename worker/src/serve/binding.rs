//! Where a replica's engine runs, given the slice the server bound it to.
//!
//! The design (DESIGN.md, "one engine per device slice") is one engine process per GPU
//! slice, started with `CUDA_VISIBLE_DEVICES=<slice uuid>` (`MIG-…` for a MIG instance,
//! `GPU-…` for a whole GPU) so CUDA in that process sees exactly that slice as device 0:
//! CUDA contexts never share a slice and a crash stays in its slice. The CUDA build runs
//! a replica bound to a real slice that way (`serve::process`). A build without CUDA
//! serves such a replica with the CPU engine and says so. Replicas on simulated slices run
//! in the worker's process on the CPU, or each in its own CPU engine process when the
//! worker is started with `--slice-processes` (so tests and demos exercise the process
//! path without a GPU).

use tessera_api::mig::Slice;

use super::batcher::Admission;

/// How a replica's engine is run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Binding {
    /// In this process, on the CPU thread pool.
    Cpu {
        /// Why, for the replica's log and status ("" when there is no slice at all).
        note: String,
    },
    /// A child engine process confined to one slice with this environment, computing on
    /// the slice's GPU (`gpu`) or on the CPU (a simulated slice).
    Process { env: Vec<(String, String)>, gpu: bool, note: String },
}

/// What this build and this worker can do with slices, and how its CPU engines compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Policy {
    /// The build serves on GPUs (the `cuda` feature): real slices get GPU processes.
    pub gpu_processes: bool,
    /// Simulated slices get their own (CPU) engine process too.
    pub simulated_processes: bool,
    pub cpu_precision: CpuPrecision,
    /// What each replica's queue takes on (the worker's limits flags).
    pub admission: Admission,
}

impl Policy {
    /// This build, with the worker's `--slice-processes`, `--cpu-precision` and limits.
    pub fn of_build(simulated_processes: bool, cpu_precision: CpuPrecision, admission: Admission) -> Policy {
        Policy { gpu_processes: cfg!(feature = "cuda"), simulated_processes, cpu_precision, admission }
    }
}

/// What the CPU engine's GEMMs multiply in (they accumulate in f32 either way; see
/// `engine::LoadOptions::dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum CpuPrecision {
    /// bf16 where the CPU has AVX512-BF16 and runs it clearly faster, else f32
    /// (`GemmInputs::fastest`).
    #[default]
    Auto,
    F32,
    /// Refused at load on a CPU without AVX512-BF16.
    Bf16,
}

impl CpuPrecision {
    pub fn dtype(self) -> Option<candle_core::DType> {
        match self {
            CpuPrecision::Auto => None,
            CpuPrecision::F32 => Some(candle_core::DType::F32),
            CpuPrecision::Bf16 => Some(candle_core::DType::BF16),
        }
    }

    /// The value of `--cpu-precision` that asks for this.
    pub fn arg(self) -> &'static str {
        match self {
            CpuPrecision::Auto => "auto",
            CpuPrecision::F32 => "f32",
            CpuPrecision::Bf16 => "bf16",
        }
    }
}

/// The environment that confines a CUDA process to `slice`.
pub fn slice_env(slice: &Slice) -> Vec<(String, String)> {
    vec![("CUDA_VISIBLE_DEVICES".to_string(), slice.uuid.clone())]
}

/// Chooses how to run a replica bound to `slice` (none on a CPU-only worker).
pub fn bind(slice: Option<&Slice>, policy: Policy) -> Binding {
    match slice {
        None => Binding::Cpu { note: String::new() },
        Some(slice) if slice.simulated && policy.simulated_processes => Binding::Process {
            env: slice_env(slice),
            gpu: false,
            note: format!(
                "bound to simulated slice {} ({}); its own CPU engine process serves it",
                slice.uuid,
                describe(slice)
            ),
        },
        Some(slice) if slice.simulated => Binding::Cpu {
            note: format!("bound to simulated slice {} ({}); the CPU engine serves it", slice.uuid, describe(slice)),
        },
        Some(slice) if policy.gpu_processes => Binding::Process {
            env: slice_env(slice),
            gpu: true,
            note: format!("bound to {} ({}); a GPU engine process serves it", slice.uuid, describe(slice)),
        },
        Some(slice) => Binding::Cpu {
            note: format!(
                "bound to {} ({}); this build has no GPU serving engine, so the CPU engine serves it \
                 (the cuda build runs it as a process with CUDA_VISIBLE_DEVICES={})",
                slice.uuid,
                describe(slice),
                slice.uuid
            ),
        },
    }
}

fn describe(slice: &Slice) -> String {
    let model = slice.gpu_model.as_deref().unwrap_or("GPU");
    match &slice.profile {
        Some(profile) => format!("{model} MIG {profile}"),
        None => format!("whole {model}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(uuid: &str, profile: Option<&str>, simulated: bool) -> Slice {
        Slice {
            uuid: uuid.into(),
            gpu_uuid: "GPU-0".into(),
            gpu_index: 0,
            gpu_model: Some("H100-80GB".into()),
            profile: profile.map(Into::into),
            start: Some(0),
            memory_bytes: 10 << 30,
            simulated,
        }
    }

    #[test]
    fn a_mig_slice_gets_cuda_visible_devices_set_to_its_uuid() {
        let mig = slice(
            "MIG-4f1c2a9e-0000-5d6e-8a2b-1c3d5e7f9a0b",
            Some("1g.10gb"),
            false,
        );
        let gpu = Policy { gpu_processes: true, simulated_processes: false, ..Policy::default() };
        match bind(Some(&mig), gpu) {
            Binding::Process { env, gpu: true, note } => {
                assert_eq!(env, [("CUDA_VISIBLE_DEVICES".into(), "MIG-4f1c2a9e-0000-5d6e-8a2b-1c3d5e7f9a0b".into())]);
                assert!(note.contains("H100-80GB MIG 1g.10gb") && note.contains("GPU engine process"), "{note}");
            }
            other => panic!("{other:?}"),
        }
        let whole = slice("GPU-9d8c", None, false);
        assert_eq!(
            slice_env(&whole),
            vec![("CUDA_VISIBLE_DEVICES".to_string(), "GPU-9d8c".to_string())]
        );
    }

    #[test]
    fn simulated_slices_and_cpu_workers_run_in_process() {
        let simulated = slice("MIG-sim-w-0-0", Some("3g.40gb"), true);
        for gpu_processes in [false, true] {
            let policy = Policy { gpu_processes, simulated_processes: false, ..Policy::default() };
            match bind(Some(&simulated), policy) {
                Binding::Cpu { note } => {
                    assert!(note.contains("simulated slice MIG-sim-w-0-0 (H100-80GB MIG 3g.40gb)"))
                }
                other => panic!("{other:?}"),
            }
            assert_eq!(
                bind(None, policy),
                Binding::Cpu {
                    note: String::new()
                }
            );
        }
    }

    #[test]
    fn a_real_slice_on_a_build_without_gpu_processes_says_it_runs_on_the_cpu() {
        let mig = slice("MIG-abc", Some("2g.20gb"), false);
        match bind(Some(&mig), Policy::default()) {
            Binding::Cpu { note } => {
                assert!(note.contains("no GPU serving engine"));
                assert!(note.contains("CUDA_VISIBLE_DEVICES=MIG-abc"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn with_slice_processes_a_simulated_slice_gets_its_own_cpu_process() {
        let simulated = slice("MIG-sim-w-0-1", Some("2g.20gb"), true);
        let policy = Policy { gpu_processes: false, simulated_processes: true, ..Policy::default() };
        match bind(Some(&simulated), policy) {
            Binding::Process { env, gpu: false, note } => {
                assert_eq!(env, [("CUDA_VISIBLE_DEVICES".into(), "MIG-sim-w-0-1".into())]);
                assert!(note.contains("own CPU engine process"), "{note}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(bind(None, policy), Binding::Cpu { note: String::new() });
    }
}
