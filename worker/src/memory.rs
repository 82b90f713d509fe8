//! The worker's heap. candle's CPU ops allocate every output, so a training step frees and
//! allocates tensors of the same large sizes over and over. On glibc's defaults a freed block
//! above the (dynamic) mmap threshold goes back to the kernel, and so does a heap top above
//! 128 KiB; the next step's tensors then come back as fresh pages the kernel zeroes on first
//! touch. On a MiniLM fine-tune's CPU rank that zeroing took more time than the f32 GEMMs
//! (perf: `clear_page_erms`). These two settings cut a run of `qsync_throughput --threads 1,1`
//! from 204 s to 178 s on a 2-core Xeon, after the fused CPU AdamW (`train::optim`) had cut it
//! from 224 s (one run each; jemalloc was 2× slower than glibc, mimalloc about equal).
//!
//! The cost, chosen knowingly: the worker keeps up to `TRIM_THRESHOLD` of freed heap resident
//! between jobs instead of handing it back at once (blocks above `MMAP_THRESHOLD`, such as a
//! 47 MB embedding gradient, are still mapped and unmapped each time).

/// Blocks at least this large are mapped on their own (glibc's largest allowed value).
const MMAP_THRESHOLD: i32 = 32 << 20;
/// Free heap top kept before glibc trims it back to the kernel.
const TRIM_THRESHOLD: i32 = 1 << 30;

/// Sets glibc's allocator to keep freed memory for reuse (see the module doc); `false` where
/// the C library refused a setting or is not glibc. Call it early in `main`.
pub fn keep_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt takes the allocator's lock and only changes its tunables (glibc makes it
    // safe to call while other threads allocate).
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
            && libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    false
}

#[cfg(test)]
mod tests {
    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn glibc_takes_the_settings() {
        assert!(super::keep_freed_memory());
    }
}
