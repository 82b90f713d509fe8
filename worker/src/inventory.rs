//! What this host offers the scheduler: CPU cores, memory, and NVIDIA GPUs with their MIG
//! instances. The worker reports it when it registers. GPUs come from NVML; a host
//! without the NVIDIA driver (every CI machine) reports none, which is not an error.

// ---- Wire types. They belong in `tessera_api::workers`; once they are there, replace
// ---- this block with `use tessera_api::workers::{Gpu, Inventory, MigInstance};`.
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Inventory {
    pub hostname: String,
    pub cpu_cores: u32,
    pub memory_bytes: u64,
    pub gpus: Vec<Gpu>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gpu {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub memory_bytes: u64,
    pub compute_capability: (u32, u32),
    pub mig_enabled: bool,
    pub mig_instances: Vec<MigInstance>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigInstance {
    pub uuid: String,
    pub name: String,
    pub memory_bytes: u64,
}
// ---- End of wire types.

use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};
use tracing::{debug, warn};

/// Looks at the host once. Never fails: what cannot be read is reported as absent
/// (no GPUs, 0 bytes of memory) and logged.
pub fn detect() -> Inventory {
    Inventory {
        hostname: hostname(),
        cpu_cores: cpu_cores(),
        memory_bytes: memory_bytes(),
        gpus: gpus(),
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
    let mig = mig_calls::MigCalls::load();
    (0..count)
        .filter_map(|index| match describe_gpu(&nvml, index, mig.as_ref()) {
            Ok(gpu) => Some(gpu),
            Err(error) => {
                warn!(index, %error, "skipping a GPU that NVML cannot describe");
                None
            }
        })
        .collect()
}

fn describe_gpu(
    nvml: &Nvml,
    index: u32,
    mig: Option<&mig_calls::MigCalls>,
) -> Result<Gpu, NvmlError> {
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
    let mig_instances = match (mig_enabled, mig) {
        (true, Some(mig)) => mig_instances(&device, mig),
        (true, None) => {
            warn!(%uuid, "MIG is on but this NVML cannot enumerate MIG devices");
            Vec::new()
        }
        (false, _) => Vec::new(),
    };
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
fn mig_instances(parent: &Device<'_>, mig: &mig_calls::MigCalls) -> Vec<MigInstance> {
    let max = match mig.max_mig_device_count(parent) {
        Ok(max) => max,
        Err(code) => {
            debug!(
                code,
                "nvmlDeviceGetMaxMigDeviceCount failed; reporting no MIG devices"
            );
            return Vec::new();
        }
    };
    (0..max)
        .filter_map(|slot| {
            let device = mig.mig_device_by_index(parent, slot).ok()?;
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

/// nvml-wrapper 0.11 wraps `nvmlDeviceGetMigMode` but not the two calls that enumerate a
/// GPU's MIG devices (0.13 has them as `Device::mig_device_count` and
/// `Device::mig_device_by_index`). Until the workspace moves to 0.13, this looks the two
/// symbols up in the libnvidia-ml that `Nvml::init` has already loaded; after the move,
/// delete this module and call those methods.
mod mig_calls {
    use std::ffi::{c_char, c_int, c_uint, c_void};

    use nvml_wrapper::Device;

    /// `nvmlReturn_t`; 0 is `NVML_SUCCESS`.
    type NvmlReturn = c_uint;
    /// `nvmlDevice_t`, an opaque pointer.
    type DeviceHandle = *mut c_void;
    type MaxCountFn = unsafe extern "C" fn(DeviceHandle, *mut c_uint) -> NvmlReturn;
    type ByIndexFn = unsafe extern "C" fn(DeviceHandle, c_uint, *mut DeviceHandle) -> NvmlReturn;

    const RTLD_NOW: c_int = 2;
    const RTLD_NOLOAD: c_int = 4;

    extern "C" {
        fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
        fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
        fn dlclose(handle: *mut c_void) -> c_int;
    }

    pub(super) struct MigCalls {
        library: *mut c_void,
        max_count: MaxCountFn,
        by_index: ByIndexFn,
    }

    impl MigCalls {
        /// `None` unless libnvidia-ml is loaded (call after `Nvml::init`) and exports both
        /// symbols (drivers since R450 do).
        pub(super) fn load() -> Option<Self> {
            // SAFETY: RTLD_NOLOAD only takes a reference on a library already in the
            // process; the symbols are checked for null and have these C signatures in
            // nvml.h.
            unsafe {
                let library = dlopen(c"libnvidia-ml.so.1".as_ptr(), RTLD_NOW | RTLD_NOLOAD);
                if library.is_null() {
                    return None;
                }
                let max_count = dlsym(library, c"nvmlDeviceGetMaxMigDeviceCount".as_ptr());
                let by_index = dlsym(library, c"nvmlDeviceGetMigDeviceHandleByIndex".as_ptr());
                if max_count.is_null() || by_index.is_null() {
                    dlclose(library);
                    return None;
                }
                Some(Self {
                    library,
                    max_count: std::mem::transmute::<*mut c_void, MaxCountFn>(max_count),
                    by_index: std::mem::transmute::<*mut c_void, ByIndexFn>(by_index),
                })
            }
        }

        /// How many MIG devices `parent` can hold; `Err` carries the `nvmlReturn_t`.
        pub(super) fn max_mig_device_count(&self, parent: &Device<'_>) -> Result<u32, u32> {
            let mut count: c_uint = 0;
            // SAFETY: `parent` holds a live handle from the same library instance.
            let code = unsafe { (self.max_count)(parent.handle() as DeviceHandle, &raw mut count) };
            if code == 0 {
                Ok(count)
            } else {
                Err(code)
            }
        }

        /// The MIG device in `slot` of `parent`; `Err` carries the `nvmlReturn_t`
        /// (`NVML_ERROR_NOT_FOUND` for an empty slot).
        pub(super) fn mig_device_by_index<'nvml>(
            &self,
            parent: &Device<'nvml>,
            slot: u32,
        ) -> Result<Device<'nvml>, u32> {
            let mut handle: DeviceHandle = std::ptr::null_mut();
            // SAFETY: as above; on success NVML fills `handle` with a MIG device handle,
            // valid as long as the `Nvml` that `parent` borrows.
            unsafe {
                let code = (self.by_index)(parent.handle() as DeviceHandle, slot, &raw mut handle);
                if code != 0 || handle.is_null() {
                    return Err(code);
                }
                Ok(Device::new(handle.cast(), parent.nvml()))
            }
        }
    }

    impl Drop for MigCalls {
        fn drop(&mut self) {
            // SAFETY: balances the reference taken in `load`; NVML stays loaded by `Nvml`.
            unsafe {
                dlclose(self.library);
            }
        }
    }
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
