//! Launch geometry shared by the kernels, decided on the host from sizes the batcher already
//! knows, so a forward pass never reads anything back from the GPU. The constants mirror
//! those in the `.cu` files beside the ops; attention's own plan is in
//! `varlen_attention/cuda.rs`.

/// Shared memory any block may use without opting in to more (48 KiB on every CUDA GPU).
pub const SHARED_LIMIT: usize = 48 * 1024;
/// Threads per block of the row-wise kernels (LayerNorm, pooling) and the element-wise ones.
pub const ROW_THREADS: u32 = 128;
pub const POOL_THREADS: u32 = 256;
pub const ELEMENTWISE_THREADS: u32 = 256;
/// Grid-stride kernels never need more blocks than this to fill a GPU.
const MAX_ELEMENTWISE_BLOCKS: usize = 1 << 16;

/// Shared memory of a row-wise kernel that keeps one f32 row plus 32 floats of reduction
/// scratch, or an error when the row is too wide for it.
pub fn row_shared_bytes(cols: usize) -> Result<u32, String> {
    let bytes = (cols + 32) * 4;
    if bytes > SHARED_LIMIT {
        return Err(format!(
            "rows of {cols} values do not fit the kernel's shared memory (at most {})",
            SHARED_LIMIT / 4 - 32
        ));
    }
    Ok(bytes as u32)
}

/// Blocks for a grid-stride kernel over `n` elements.
pub fn elementwise_blocks(n: usize) -> u32 {
    n.div_ceil(ELEMENTWISE_THREADS as usize)
        .clamp(1, MAX_ELEMENTWISE_BLOCKS) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_kernels_take_rows_up_to_the_shared_limit() {
        assert_eq!(row_shared_bytes(768).unwrap(), (768 + 32) * 4);
        assert!(row_shared_bytes(SHARED_LIMIT / 4 - 32).is_ok());
        assert!(row_shared_bytes(SHARED_LIMIT / 4 - 31).is_err());
        assert_eq!(elementwise_blocks(0), 1);
        assert_eq!(elementwise_blocks(257), 2);
        assert_eq!(elementwise_blocks(usize::MAX / 2), 1 << 16);
    }
}
