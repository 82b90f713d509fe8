//! The device slices this worker offers: each MIG instance of a GPU in MIG mode, or the
//! whole GPU when MIG is off (from NVML), or a simulated inventory given on the command
//! line so tests and demos run the MIG flow on a CPU-only host.
//!
//! `--simulate-gpus` takes GPUs separated by commas, each `MODEL[:mig=PROFILE+PROFILE…]`:
//! `H100-80GB:mig=3g.40gb+2g.20gb+2g.20gb,A100-80GB` is an H100 split into three MIG
//! instances and an A100 with MIG off. `mig=` with no profiles is MIG mode with no
//! instances. A profile may give its start (`3g.40gb@4`); without one the server arranges
//! the instances legally when the worker registers (and refuses an illegal partition).
//! Simulated slices are advertised like real ones; replicas bound to them run the CPU
//! engine (see `serve::binding`).

use tessera_api::mig::Slice;
use tessera_api::workers::{Gpu, MigInstance};

/// GPU models the MIG catalog knows, with their memory in GB.
const MODELS: [(&str, u64); 4] = [
    ("A100-40GB", 40),
    ("A100-80GB", 80),
    ("H100-80GB", 80),
    ("H200-141GB", 141),
];

const GIB: u64 = 1 << 30;

/// The catalog name of an NVIDIA GPU from NVML's name and memory ("NVIDIA H100 80GB HBM3"
/// → `H100-80GB`); `None` for GPUs the planner does not know.
pub fn catalog_model(name: &str, memory_bytes: u64) -> Option<String> {
    let upper = name.to_ascii_uppercase();
    let gb = (memory_bytes as f64 / 1e9).round() as u64;
    let family = ["H200", "H100", "A100"]
        .into_iter()
        .find(|f| upper.contains(f))?;
    // The memory size is in the name on most parts; otherwise NVML's byte count (a little
    // under the nominal size) decides.
    MODELS
        .iter()
        .filter(|(model, _)| model.starts_with(family))
        .filter(|(_, size)| size.abs_diff(gb) * 100 <= size * 12)
        .min_by_key(|(_, size)| (!upper.contains(&format!("{size}GB")), size.abs_diff(gb)))
        .map(|(model, _)| model.to_string())
}

/// The MIG profile in an instance's NVML name ("NVIDIA H100 80GB HBM3 MIG 1g.10gb" →
/// `1g.10gb`).
pub fn profile_of(instance_name: &str) -> Option<String> {
    let (_, profile) = instance_name.rsplit_once("MIG ")?;
    let profile = profile.trim();
    (profile.contains('g') && profile.contains('.')).then(|| profile.to_string())
}

/// The slices of real GPUs: every MIG instance of a GPU in MIG mode, the GPU itself
/// otherwise. NVML's safe API gives no instance placement, so starts are left to the
/// server to arrange.
pub fn from_gpus(gpus: &[Gpu]) -> Vec<Slice> {
    let mut slices = Vec::new();
    for gpu in gpus {
        let model = catalog_model(&gpu.name, gpu.memory_bytes);
        let slice = |uuid: &str, profile: Option<String>, memory_bytes: u64| Slice {
            uuid: uuid.to_string(),
            gpu_uuid: gpu.uuid.clone(),
            gpu_index: gpu.index,
            gpu_model: model.clone(),
            profile,
            start: None,
            memory_bytes,
            simulated: false,
        };
        if gpu.mig_enabled {
            for mig in &gpu.mig_instances {
                slices.push(slice(&mig.uuid, profile_of(&mig.name), mig.memory_bytes));
            }
        } else {
            slices.push(slice(&gpu.uuid, None, gpu.memory_bytes));
        }
    }
    slices
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SimulateError {
    #[error("--simulate-gpus names GPU model \"{0}\"; use one of A100-40GB, A100-80GB, H100-80GB, H200-141GB")]
    UnknownModel(String),
    #[error("--simulate-gpus: \"{0}\" is not MODEL or MODEL:mig=PROFILE+PROFILE…")]
    Syntax(String),
    #[error("--simulate-gpus: \"{0}\" is not a MIG profile name such as 1g.10gb or 3g.40gb@4")]
    Profile(String),
    #[error("--simulate-gpus lists no GPUs")]
    Empty,
}

/// The memory of a profile from its name (`2g.20gb` → 20 GiB).
fn profile_memory(profile: &str) -> Option<u64> {
    let (_, memory) = profile.split_once('.')?;
    let gb: u64 = memory
        .trim_end_matches("+me")
        .strip_suffix("gb")?
        .parse()
        .ok()?;
    Some(gb * GIB)
}

/// Parses `--simulate-gpus` into GPUs and their slices. Uuids start with `GPU-sim-` and
/// `MIG-sim-` and include the worker's name, so two simulated workers never share one.
pub fn simulate(spec: &str, worker: &str) -> Result<(Vec<Gpu>, Vec<Slice>), SimulateError> {
    let mut gpus = Vec::new();
    let mut slices = Vec::new();
    for (index, item) in spec
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .enumerate()
    {
        let (model, mig) = match item.split_once(':') {
            None => (item, None),
            Some((model, rest)) => {
                let profiles = rest
                    .strip_prefix("mig=")
                    .ok_or_else(|| SimulateError::Syntax(item.into()))?;
                (model, Some(profiles))
            }
        };
        let &(model, gb) = MODELS
            .iter()
            .find(|(m, _)| m.eq_ignore_ascii_case(model.trim()))
            .ok_or_else(|| SimulateError::UnknownModel(model.trim().into()))?;
        let gpu_uuid = format!("GPU-sim-{worker}-{index}");
        let slice =
            |uuid: String, profile: Option<String>, start: Option<u8>, memory_bytes: u64| Slice {
                uuid,
                gpu_uuid: gpu_uuid.clone(),
                gpu_index: index as u32,
                gpu_model: Some(model.to_string()),
                profile,
                start,
                memory_bytes,
                simulated: true,
            };
        let mut instances = Vec::new();
        match mig {
            None => slices.push(slice(gpu_uuid.clone(), None, None, gb * GIB)),
            Some(profiles) => {
                for (i, p) in profiles
                    .split('+')
                    .map(str::trim)
                    .filter(|p| !p.is_empty())
                    .enumerate()
                {
                    let (name, start) = match p.split_once('@') {
                        None => (p, None),
                        Some((name, start)) => (
                            name,
                            Some(
                                start
                                    .parse::<u8>()
                                    .map_err(|_| SimulateError::Profile(p.into()))?,
                            ),
                        ),
                    };
                    let memory =
                        profile_memory(name).ok_or_else(|| SimulateError::Profile(p.into()))?;
                    let uuid = format!("MIG-sim-{worker}-{index}-{i}");
                    instances.push(MigInstance {
                        uuid: uuid.clone(),
                        name: format!("Simulated {model} MIG {name}"),
                        memory_bytes: memory,
                    });
                    slices.push(slice(uuid, Some(name.to_string()), start, memory));
                }
            }
        }
        gpus.push(Gpu {
            index: index as u32,
            uuid: gpu_uuid.clone(),
            name: format!("Simulated {model}"),
            memory_bytes: gb * GIB,
            compute_capability: (0, 0),
            mig_enabled: mig.is_some(),
            mig_instances: instances,
        });
    }
    if gpus.is_empty() {
        return Err(SimulateError::Empty);
    }
    Ok((gpus, slices))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_documented_example_gives_three_mig_slices_and_one_whole_gpu() {
        let (gpus, slices) =
            simulate("H100-80GB:mig=3g.40gb+2g.20gb+2g.20gb,A100-80GB", "w1").unwrap();
        assert_eq!(gpus.len(), 2);
        assert!(gpus[0].mig_enabled && !gpus[1].mig_enabled);
        assert_eq!(slices.len(), 4);
        assert_eq!(slices[0].profile.as_deref(), Some("3g.40gb"));
        assert_eq!(slices[0].memory_bytes, 40 * GIB);
        assert_eq!(slices[0].uuid, "MIG-sim-w1-0-0");
        assert_eq!(
            (slices[3].uuid.as_str(), slices[3].profile.as_deref()),
            ("GPU-sim-w1-1", None)
        );
        assert!(slices.iter().all(|s| s.simulated));
        assert_eq!(slices[3].gpu_model.as_deref(), Some("A100-80GB"));
    }

    #[test]
    fn starts_may_be_given_and_mig_mode_may_have_no_instances() {
        let (gpus, slices) =
            simulate("a100-40gb:mig=3g.20gb@4+4g.20gb@0, H200-141GB:mig=", "w").unwrap();
        assert_eq!(slices[0].start, Some(4));
        assert_eq!(slices[1].start, Some(0));
        assert!(gpus[1].mig_enabled);
        assert_eq!(slices.len(), 2);
    }

    #[test]
    fn bad_specs_say_what_to_fix() {
        assert_eq!(
            simulate("V100", "w").unwrap_err(),
            SimulateError::UnknownModel("V100".into())
        );
        assert!(simulate("H100-80GB:3g.40gb", "w")
            .unwrap_err()
            .to_string()
            .contains("MODEL:mig="));
        assert!(simulate("H100-80GB:mig=big", "w")
            .unwrap_err()
            .to_string()
            .contains("\"big\""));
        assert_eq!(simulate(" , ", "w").unwrap_err(), SimulateError::Empty);
    }

    #[test]
    fn nvml_names_map_to_catalog_models_and_profiles() {
        assert_eq!(
            catalog_model("NVIDIA H100 80GB HBM3", 85_520_000_000).as_deref(),
            Some("H100-80GB")
        );
        assert_eq!(
            catalog_model("NVIDIA A100-SXM4-40GB", 42_949_672_960).as_deref(),
            Some("A100-40GB")
        );
        assert_eq!(
            catalog_model("NVIDIA A100 80GB PCIe", 85_899_345_920).as_deref(),
            Some("A100-80GB")
        );
        assert_eq!(
            catalog_model("NVIDIA H200", 150_000_000_000).as_deref(),
            Some("H200-141GB")
        );
        assert_eq!(catalog_model("NVIDIA GeForce RTX 4090", 24 * GIB), None);
        // An H100 NVL (94 GB) has other MIG profiles than the catalog's H100-80GB.
        assert_eq!(catalog_model("NVIDIA H100 NVL", 99_900_000_000), None);
        assert_eq!(
            profile_of("NVIDIA H100 80GB HBM3 MIG 1g.10gb").as_deref(),
            Some("1g.10gb")
        );
        assert_eq!(profile_of("NVIDIA H100 80GB HBM3"), None);
    }

    #[test]
    fn a_gpu_without_mig_is_one_whole_gpu_slice() {
        let gpu = Gpu {
            index: 0,
            uuid: "GPU-1".into(),
            name: "NVIDIA H100 80GB HBM3".into(),
            memory_bytes: 80 * GIB,
            compute_capability: (9, 0),
            mig_enabled: false,
            mig_instances: vec![],
        };
        let mut mig = gpu.clone();
        mig.mig_enabled = true;
        mig.mig_instances = vec![MigInstance {
            uuid: "MIG-a".into(),
            name: "NVIDIA H100 80GB HBM3 MIG 3g.40gb".into(),
            memory_bytes: 40 * GIB,
        }];
        let whole = from_gpus(&[gpu]);
        assert_eq!(
            (whole[0].uuid.as_str(), whole[0].profile.as_deref()),
            ("GPU-1", None)
        );
        let split = from_gpus(&[mig]);
        assert_eq!(
            (split[0].uuid.as_str(), split[0].profile.as_deref()),
            ("MIG-a", Some("3g.40gb"))
        );
        assert_eq!(split[0].gpu_model.as_deref(), Some("H100-80GB"));
    }
}
