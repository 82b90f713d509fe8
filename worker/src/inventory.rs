//! What this host offers the scheduler: CPU cores, memory, and NVIDIA GPUs with their MIG
//! instances. The worker reports it when it registers. GPUs come from NVML; a host
//! without the NVIDIA driver (every CI machine) reports none, which is not an error.

use tessera_api::workers::{Gpu, Inventory, MigInstance};

use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};
use tracing::{debug, warn};

/// Looks at the host once. Never fails: what cannot be read is reported as absent
/// (no GPUs, 0 bytes of memory) and logged.
pub fn detect() -> Inventory {
    let gpus = gpus();
    Inventory {
        hostname: hostname(),
        cpu_cores: cpu_cores(),
        memory_bytes: memory_bytes(),
        slices: crate::slices::from_gpus(&gpus),
        gpus,
    }
}

fn cpu_cores() -> u32 {
    // Respects the affinity mask and cgroup quota, so a container reports what it may use.
    std::thread::available_parallelism().map_or(1, |n| u32::try_from(n.get()).unwrap_or(u32::MAX))
}

fn memory_bytes() -> u64 {
    match std::fs::read_to_string("/proc/meminfo") {
        Ok(text) => parse_mem_total(&text).unwrap_or_else(|| {
            warn!("no MemTotal line in /proc/meminfo; reporting 0 bytes of memory");
            0
        }),
        Err(error) => {
            debug!(%error, "cannot read /proc/meminfo; reporting 0 bytes of memory");
            0
        }
    }
}

/// The `MemTotal` line of `/proc/meminfo`, in bytes. The kernel writes it in "kB", which
/// are KiB.
fn parse_mem_total(meminfo: &str) -> Option<u64> {
    meminfo.lines().find_map(|line| {
        let mut fields = line.strip_prefix("MemTotal:")?.split_whitespace();
        let value: u64 = fields.next()?.parse().ok()?;
        match fields.next() {
            Some("kB") => value.checked_mul(1024),
            None => Some(value),
            Some(_) => None,
        }
    })
}

fn hostname() -> String {
    let from_kernel = std::fs::read_to_string("/proc/sys/kernel/hostname").ok();
    let from_env = std::env::var("HOSTNAME").ok();
    [from_kernel, from_env]
        .into_iter()
        .flatten()
        .map(|name| name.trim().to_owned())
        .find(|name| !name.is_empty())
        .unwrap_or_else(|| "unknown".to_owned())
}

fn gpus() -> Vec<Gpu> {
    let nvml = match Nvml::init() {
        Ok(nvml) => nvml,
        Err(error) => {
            debug!(%error, "NVML is not available; reporting no GPUs");
            return Vec::new();
        }
    };
    let count = match nvml.device_count() {
        Ok(count) => count,
        Err(error) => {
            warn!(%error, "NVML loaded but cannot count devices; reporting no GPUs");
            return Vec::new();
        }
    };
    (0..count)
        .filter_map(|index| match describe_gpu(&nvml, index) {
            Ok(gpu) => Some(gpu),
            Err(error) => {
                warn!(index, %error, "skipping a GPU that NVML cannot describe");
                None
            }
        })
        .collect()
}

fn describe_gpu(nvml: &Nvml, index: u32) -> Result<Gpu, NvmlError> {
    let device = nvml.device_by_index(index)?;
    let uuid = device.uuid()?;
    let compute_capability = match device.cuda_compute_capability() {
        Ok(cc) => (
            u32::try_from(cc.major).unwrap_or(0),
            u32::try_from(cc.minor).unwrap_or(0),
        ),
        Err(error) => {
            warn!(%uuid, %error, "unknown compute capability");
            (0, 0)
        }
    };
    let mig_enabled = match device.mig_mode() {
        // NVML_DEVICE_MIG_ENABLE
        Ok(mode) => mode.current == 1,
        // GPUs before Ampere, and consumer parts, have no MIG.
        Err(NvmlError::NotSupported) => false,
        Err(error) => {
            debug!(%uuid, %error, "cannot read MIG mode; assuming it is off");
            false
        }
    };
    let mig_instances = if mig_enabled { mig_instances(&device) } else { Vec::new() };
    let memory_bytes = match device.memory_info() {
        Ok(memory) => memory.total,
        // In MIG mode NVML gives the whole GPU's figures only to privileged callers;
        // the instances' own memory is what can be scheduled anyway.
        Err(error) if mig_enabled => {
            debug!(%uuid, %error, "no whole-GPU memory figure in MIG mode; summing instances");
            mig_instances.iter().map(|mig| mig.memory_bytes).sum()
        }
        Err(error) => return Err(error),
    };
    Ok(Gpu {
        index,
        name: device.name()?,
        memory_bytes,
        compute_capability,
        mig_enabled,
        mig_instances,
        uuid,
    })
}

/// The MIG devices (compute instances) that exist on `parent` now. Slots up to the
/// maximum count can be empty; NVML answers those with an error, so they are skipped.
fn mig_instances(parent: &Device<'_>) -> Vec<MigInstance> {
    let max = match parent.mig_device_count() {
        Ok(max) => max,
        Err(error) => {
            debug!(%error, "cannot count MIG devices; reporting none");
            return Vec::new();
        }
    };
    (0..max)
        .filter_map(|slot| {
            let device = parent.mig_device_by_index(slot).ok()?;
            let describe = || -> Result<MigInstance, NvmlError> {
                Ok(MigInstance {
                    uuid: device.uuid()?,
                    name: device.name()?,
                    memory_bytes: device.memory_info()?.total,
                })
            };
            describe()
                .map_err(|error| debug!(slot, %error, "skipping a MIG device"))
                .ok()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MEMINFO: &str = "\
MemTotal:       131891268 kB
MemFree:        98765432 kB
MemAvailable:   120000000 kB
Buffers:          123456 kB
";

    #[test]
    fn mem_total_is_converted_from_kib_to_bytes() {
        assert_eq!(parse_mem_total(MEMINFO), Some(131_891_268 * 1024));
    }

    #[test]
    fn mem_total_is_found_anywhere_in_the_file() {
        let text = "MemFree: 1 kB\nSwapTotal: 5 kB\nMemTotal: 2048 kB\n";
        assert_eq!(parse_mem_total(text), Some(2048 * 1024));
    }

    #[test]
    fn mem_total_without_a_unit_is_taken_as_bytes() {
        assert_eq!(parse_mem_total("MemTotal: 4096\n"), Some(4096));
    }

    #[test]
    fn meminfo_without_mem_total_gives_none() {
        assert_eq!(parse_mem_total("MemFree: 1 kB\n"), None);
        assert_eq!(parse_mem_total(""), None);
    }

    #[test]
    fn malformed_or_overflowing_mem_total_gives_none() {
        assert_eq!(parse_mem_total("MemTotal: lots kB\n"), None);
        assert_eq!(parse_mem_total("MemTotal: 12 MB\n"), None);
        assert_eq!(parse_mem_total("MemTotal: 18446744073709551615 kB\n"), None);
    }

    #[test]
    fn detect_reports_this_host_without_a_gpu_driver_being_required() {
        let inventory = detect();
        assert!(inventory.cpu_cores >= 1);
        assert!(!inventory.hostname.is_empty());
        if std::path::Path::new("/proc/meminfo").exists() {
            assert!(inventory.memory_bytes > 0);
        }
        for gpu in &inventory.gpus {
            assert!(!gpu.uuid.is_empty());
            assert!(gpu.mig_enabled || gpu.mig_instances.is_empty());
        }
    }

    #[test]
    fn inventory_round_trips_through_json() {
        let inventory = Inventory {
            slices: Vec::new(),
            hostname: "gpu-1".into(),
            cpu_cores: 16,
            memory_bytes: 128 << 30,
            gpus: vec![Gpu {
                index: 0,
                uuid: "GPU-0f0e".into(),
                name: "NVIDIA H100 80GB HBM3".into(),
                memory_bytes: 80 << 30,
                compute_capability: (9, 0),
                mig_enabled: true,
                mig_instances: vec![MigInstance {
                    uuid: "MIG-1a2b".into(),
                    name: "NVIDIA H100 80GB HBM3 MIG 1g.10gb".into(),
                    memory_bytes: 10 << 30,
                }],
            }],
        };
        let json = serde_json::to_string(&inventory).unwrap();
        assert_eq!(serde_json::from_str::<Inventory>(&json).unwrap(), inventory);
    }
}
