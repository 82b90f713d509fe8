//! Is this binary's CUDA code right for the GPU and driver it runs on? Users of CUDA serving
//! images trip over this often (TEI #15, #34, #268), and the driver's own error ("no kernel
//! image", "Unsupported .version") does not say what to do, so the worker checks at start and
//! names the rebuild.
//!
//! Rules: the kernels are PTX for `compute_XY` (`CUDA_COMPUTE_CAP` at build time). The driver
//! JIT-compiles PTX for its GPU when the GPU's capability is at least XY, never below. A
//! newer GPU therefore runs the binary, but without code tuned for it; an older one cannot
//! load it. PTX also needs a driver at least as new as the nvcc that emitted it.

/// The outcome of comparing the build's compute capability with the GPU's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CapCheck {
    /// Built for exactly this GPU generation.
    Match,
    /// Runs, through the driver's JIT, but a rebuild would suit the GPU better.
    Runs { advice: String },
    /// Cannot run here; the message says what to rebuild.
    Refuse { reason: String },
}

/// `(9, 0)` → 90, the form `CUDA_COMPUTE_CAP` takes.
fn as_number(major: u32, minor: u32) -> u32 {
    major * 10 + minor
}

/// The command that rebuilds the worker for compute capability `cap`.
pub fn rebuild_command(cap: u32) -> String {
    format!(
        "eval \"$(CUDA_COMPUTE_CAP={cap} scripts/cuda-toolchain.sh)\" && \
         cargo build --release -p tessera-worker --features cuda \
         (or: docker build --build-arg CUDA_COMPUTE_CAP={cap} -f docker/Dockerfile.worker-cuda .)"
    )
}

/// Compares the capability the binary was built for (`built`, e.g. 90) with the GPU's
/// `(major, minor)`; `gpu` names the device in messages.
pub fn check(built: u32, device: (u32, u32), gpu: &str) -> CapCheck {
    let have = as_number(device.0, device.1);
    if have == built {
        CapCheck::Match
    } else if have < built {
        CapCheck::Refuse {
            reason: format!(
                "this tessera-worker was built for compute capability {built} but {gpu} has \
                 {have}: its kernels cannot load on an older GPU. Rebuild for this GPU: {}",
                rebuild_command(have)
            ),
        }
    } else {
        CapCheck::Runs {
            advice: format!(
                "this tessera-worker was built for compute capability {built} and {gpu} has \
                 {have}: the driver JIT-compiles its kernels at first use (slower start, no \
                 code tuned for this GPU). For best performance rebuild: {}",
                rebuild_command(have)
            ),
        }
    }
}

/// PTX from nvcc `release` (e.g. "13.0") needs a driver for that CUDA version or newer;
/// `driver` is what `cuDriverGetVersion` reports (13000 for 13.0). `None` when they fit.
pub fn check_driver(release: &str, driver: i32) -> Option<String> {
    let mut parts = release.split('.').map(|p| p.parse::<i32>().ok());
    let (Some(Some(major)), Some(Some(minor))) = (parts.next(), parts.next()) else {
        return Some(format!(
            "unreadable CUDA release {release:?} recorded at build time"
        ));
    };
    let needed = major * 1000 + minor * 10;
    (driver < needed).then(|| {
        format!(
            "the NVIDIA driver supports CUDA {}.{} but this tessera-worker's kernels were \
             compiled by nvcc {release} and need a driver for CUDA {release} or newer: update \
             the driver, or rebuild with a toolkit no newer than the driver (pin the nvcc \
             wheels in scripts/cuda-toolchain.sh to that release)",
            driver / 1000,
            driver % 1000 / 10
        )
    })
}

/// What the probe found on GPU 0.
#[derive(Debug, Clone)]
pub struct GpuReport {
    pub name: String,
    pub compute_cap: (u32, u32),
    pub driver: i32,
    /// `Runs` advice to log as a warning, if any.
    pub advice: Option<String>,
}

/// The compute capability this binary's kernels were built for (`CUDA_COMPUTE_CAP`).
#[cfg(feature = "cuda")]
pub fn built_for() -> u32 {
    env!("TESSERA_CUDA_COMPUTE_CAP")
        .parse()
        .expect("build.rs records CUDA_COMPUTE_CAP as digits")
}

/// Opens GPU `ordinal` and checks it and its driver against this build, loading the kernels
/// once so a PTX the driver cannot take fails here rather than in the first request. The
/// error is a sentence for the operator.
#[cfg(feature = "cuda")]
pub fn probe(ordinal: usize) -> Result<GpuReport, String> {
    use candle_core::cuda_backend::cudarc::driver::{sys, CudaContext};

    let release = env!("TESSERA_CUDA_RELEASE");
    let context = CudaContext::new(ordinal).map_err(|e| {
        format!(
            "no usable CUDA GPU {ordinal} ({e}). This tessera-worker was built with the cuda \
             feature and needs an NVIDIA GPU with a driver for CUDA {release} or newer; on a \
             machine without one run the CPU build"
        )
    })?;
    let name = context.name().unwrap_or_else(|_| format!("GPU {ordinal}"));
    let (major, minor) = context
        .compute_capability()
        .map_err(|e| format!("cannot read {name}'s compute capability: {e}"))?;
    let mut driver = 0;
    // SAFETY: the context above initialised the driver API; the call only writes `driver`.
    let status = unsafe { sys::cuDriverGetVersion(&mut driver) };
    if status != sys::CUresult::CUDA_SUCCESS {
        return Err(format!("cannot read the driver version: {status:?}"));
    }
    if let Some(reason) = check_driver(release, driver) {
        return Err(reason);
    }
    let gpu = format!("GPU {ordinal} ({name})");
    let compute_cap = (major as u32, minor as u32);
    let advice = match check(built_for(), compute_cap, &gpu) {
        CapCheck::Match => None,
        CapCheck::Runs { advice } => Some(advice),
        CapCheck::Refuse { reason } => return Err(reason),
    };
    let device = candle_core::CudaDevice::new_with_stream(ordinal)
        .map_err(|e| format!("cannot open {gpu} for candle: {e}"))?;
    super::load_all(&device, &crate::engine::ops::CUDA_MODULES)
        .map_err(|e| format!("{gpu} cannot load this build's kernels: {e}"))?;
    Ok(GpuReport {
        name,
        compute_cap,
        driver,
        advice,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_generation_matches() {
        assert_eq!(check(90, (9, 0), "GPU 0 (H100)"), CapCheck::Match);
    }

    #[test]
    fn an_older_gpu_is_refused_with_the_rebuild_for_it() {
        let CapCheck::Refuse { reason } = check(90, (8, 0), "GPU 0 (A100)") else {
            panic!("an sm_80 GPU cannot run compute_90 PTX");
        };
        assert!(
            reason.contains("built for compute capability 90"),
            "{reason}"
        );
        assert!(reason.contains("GPU 0 (A100) has 80"), "{reason}");
        assert!(reason.contains("CUDA_COMPUTE_CAP=80"), "{reason}");
        assert!(reason.contains("--features cuda"), "{reason}");
    }

    #[test]
    fn a_newer_gpu_runs_but_is_advised_to_rebuild() {
        let CapCheck::Runs { advice } = check(80, (9, 0), "GPU 0 (H100)") else {
            panic!("compute_80 PTX JIT-compiles on sm_90");
        };
        assert!(advice.contains("CUDA_COMPUTE_CAP=90"), "{advice}");
        // Same major, newer minor (A100 build on an L40) also runs.
        assert!(matches!(check(80, (8, 9), "L40"), CapCheck::Runs { .. }));
    }

    #[test]
    fn a_driver_older_than_the_toolkit_is_named() {
        assert_eq!(check_driver("13.0", 13000), None);
        assert_eq!(check_driver("13.0", 13020), None);
        let reason = check_driver("13.0", 12080).unwrap();
        assert!(reason.contains("supports CUDA 12.8"), "{reason}");
        assert!(reason.contains("nvcc 13.0"), "{reason}");
        assert!(check_driver("garbage", 13000).is_some());
    }
}
