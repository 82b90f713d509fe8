//! Where a replica's engine runs, given the slice the server bound it to.
//!
//! The design (DESIGN.md, "one engine per device slice") is one engine process per GPU
//! slice, started with `CUDA_VISIBLE_DEVICES=<slice uuid>` (`MIG-…` for a MIG instance,
//! `GPU-…` for a whole GPU) so CUDA in that process sees exactly that slice as device 0.
//! This worker runs every engine in its own process on the CPU today: the serving
//! engine has no GPU path yet. When the CUDA build serves, a replica bound to a real
//! slice will be started as a child process (`tessera-worker` re-executed with the
//! environment below, its engine endpoint proxied by this one), one per slice, so that
//! CUDA contexts never share a slice and a crash stays in its slice. Until then such a
//! replica runs the CPU engine and says so in its status, and the planner's throughput
//! for it comes only from measurements of that engine (the profiler never records a CPU
//! measurement under a real GPU profile).

use tessera_api::mig::Slice;

/// How a replica's engine is run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Binding {
    /// In this process, on the CPU thread pool.
    Cpu {
        /// Why, for the replica's log and status ("" when there is no slice at all).
        note: String,
    },
    /// A child process per slice with this environment.
    Process { env: Vec<(String, String)> },
}

/// The environment that confines a CUDA process to `slice`.
pub fn slice_env(slice: &Slice) -> Vec<(String, String)> {
    vec![("CUDA_VISIBLE_DEVICES".to_string(), slice.uuid.clone())]
}

/// Chooses how to run a replica bound to `slice` (none on a CPU-only worker), on a build
/// that can (`gpu_processes`) or cannot start per-slice GPU engine processes.
pub fn bind(slice: Option<&Slice>, gpu_processes: bool) -> Binding {
    match slice {
        None => Binding::Cpu { note: String::new() },
        Some(slice) if slice.simulated => Binding::Cpu {
            note: format!("bound to simulated slice {} ({}); the CPU engine serves it", slice.uuid, describe(slice)),
        },
        Some(slice) if gpu_processes => Binding::Process { env: slice_env(slice) },
        Some(slice) => Binding::Cpu {
            note: format!(
                "bound to {} ({}); this build has no GPU serving engine, so the CPU engine serves it \
                 (a GPU build runs it as a process with CUDA_VISIBLE_DEVICES={})",
                slice.uuid,
                describe(slice),
                slice.uuid
            ),
        },
    }
}

/// Whether this build starts per-slice GPU engine processes (not yet: see the module doc).
pub const GPU_PROCESSES: bool = false;

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
        assert_eq!(
            bind(Some(&mig), true),
            Binding::Process {
                env: vec![(
                    "CUDA_VISIBLE_DEVICES".into(),
                    "MIG-4f1c2a9e-0000-5d6e-8a2b-1c3d5e7f9a0b".into()
                )]
            }
        );
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
            match bind(Some(&simulated), gpu_processes) {
                Binding::Cpu { note } => {
                    assert!(note.contains("simulated slice MIG-sim-w-0-0 (H100-80GB MIG 3g.40gb)"))
                }
                other => panic!("{other:?}"),
            }
            assert_eq!(
                bind(None, gpu_processes),
                Binding::Cpu {
                    note: String::new()
                }
            );
        }
    }

    #[test]
    fn a_real_slice_on_a_build_without_gpu_processes_says_it_runs_on_the_cpu() {
        let mig = slice("MIG-abc", Some("2g.20gb"), false);
        match bind(Some(&mig), false) {
            Binding::Cpu { note } => {
                assert!(note.contains("no GPU serving engine"));
                assert!(note.contains("CUDA_VISIBLE_DEVICES=MIG-abc"));
            }
            other => panic!("{other:?}"),
        }
    }
}
