//! With the `cuda` feature, compiles every op's kernel (`src/engine/ops/<op>/*.cu`, with the
//! shared `src/engine/ops/cuda/common.cuh`) to PTX for the compute capability in
//! `CUDA_COMPUTE_CAP` (each op embeds its PTX and the driver JIT-compiles it when the kernels
//! are first used), and records that capability and nvcc's release so the worker can
//! check them against the GPU and driver at start. Without the feature it does nothing: the
//! CPU build needs no CUDA toolkit.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=CARGO_FEATURE_CUDA");
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    println!("cargo::rerun-if-changed={OPS}");
    for var in ["CUDA_COMPUTE_CAP", "NVCC", "CUDA_ROOT", "CUDA_PATH"] {
        println!("cargo::rerun-if-env-changed={var}");
    }

    let compute_cap = env::var("CUDA_COMPUTE_CAP").unwrap_or_default();
    if compute_cap.is_empty() || !compute_cap.chars().all(|c| c.is_ascii_digit()) {
        fail(&format!(
            "CUDA_COMPUTE_CAP must name the GPU generation to build for, as digits (90 for \
             H100/H200, 80 for A100, 89 for L4/L40), got {compute_cap:?}. \
             `eval \"$(scripts/cuda-toolchain.sh)\"` sets it (default 90)."
        ));
    }
    if compute_cap.parse::<u32>().is_ok_and(|cap| cap < 80) {
        fail(&format!(
            "CUDA_COMPUTE_CAP {compute_cap}: the kernels need compute capability 8.0 or newer \
             (bf16, and the tensor-core attention's bf16 tiles): A100, L4/L40, H100/H200"
        ));
    }
    let nvcc = find_nvcc();
    let release = nvcc_release(&nvcc);

    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let sources = kernel_sources();
    for source in &sources {
        let stem = source
            .file_stem()
            .and_then(|s| s.to_str())
            .expect("a UTF-8 name");
        let ptx = out_dir.join(format!("{stem}.ptx"));
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", "-std=c++17"])
            .arg(format!("-arch=compute_{compute_cap}"))
            .arg("-I")
            .arg(Path::new(OPS).join("cuda"))
            .arg(source)
            .arg("-o")
            .arg(&ptx)
            .status()
            .unwrap_or_else(|e| fail(&format!("cannot run {}: {e}", nvcc.display())));
        if !status.success() {
            fail(&format!("nvcc failed on {} ({status})", source.display()));
        }
    }
    println!("cargo::rustc-env=TESSERA_CUDA_COMPUTE_CAP={compute_cap}");
    println!("cargo::rustc-env=TESSERA_CUDA_RELEASE={release}");
}

/// Where the ops live, one folder each.
const OPS: &str = "src/engine/ops";

/// The `.cu` files in the ops' folders, in a stable order.
fn kernel_sources() -> Vec<PathBuf> {
    let list = |dir: &Path| -> Vec<PathBuf> {
        std::fs::read_dir(dir)
            .unwrap_or_else(|e| fail(&format!("cannot list {}: {e}", dir.display())))
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            .collect()
    };
    let mut sources: Vec<PathBuf> = list(Path::new(OPS))
        .into_iter()
        .filter(|p| p.is_dir())
        .flat_map(|dir| list(&dir))
        .filter(|p| p.extension().is_some_and(|ext| ext == "cu"))
        .collect();
    sources.sort();
    sources
}

/// `$NVCC`, else `$CUDA_ROOT/bin/nvcc` or `$CUDA_PATH/bin/nvcc`, else `nvcc` on the PATH.
fn find_nvcc() -> PathBuf {
    if let Some(nvcc) = env::var_os("NVCC") {
        return nvcc.into();
    }
    for root in ["CUDA_ROOT", "CUDA_PATH"] {
        if let Some(root) = env::var_os(root) {
            let nvcc = Path::new(&root).join("bin/nvcc");
            if nvcc.is_file() {
                return nvcc;
            }
        }
    }
    "nvcc".into()
}

/// The "release X.Y" nvcc reports: the PTX it emits needs a driver of that CUDA version.
fn nvcc_release(nvcc: &Path) -> String {
    let output = Command::new(nvcc)
        .arg("--version")
        .output()
        .unwrap_or_else(|e| {
            fail(&format!(
                "cannot run {} ({e}): the cuda feature needs the CUDA toolkit; \
             `eval \"$(scripts/cuda-toolchain.sh)\"` installs one",
                nvcc.display()
            ))
        });
    let text = String::from_utf8_lossy(&output.stdout);
    text.split("release ")
        .nth(1)
        .and_then(|rest| rest.split(',').next())
        .map(|r| r.trim().to_string())
        .unwrap_or_else(|| fail(&format!("unexpected `nvcc --version` output: {text}")))
}

fn fail(message: &str) -> ! {
    eprintln!("error: {message}");
    panic!("{message}");
}
