//! One post-LayerNorm transformer encoder layer over packed tokens, shared by the BERT family
//! (BERT, RoBERTa/XLM-R and DistilBERT differ in names and embeddings, not here).
//!
//! Per layer: four GEMMs (candle's matmul) and three fused kernels:
//! fused QKV GEMM → varlen attention (+QKV bias) → output GEMM → bias+residual+LayerNorm →
//! FFN-in GEMM → bias+GELU → FFN-out GEMM → bias+residual+LayerNorm.

use super::ops::{BiasGelu, BiasResidualLayerNorm, VarlenAttention};
use candle_core::{Result, Tensor};

/// The per-batch values every layer needs: sequence offsets (as a device tensor, for the
/// kernels) and the longest sequence.
pub(crate) struct Packing {
    pub cu_seqlens: Tensor,
    pub max_len: usize,
}

/// A layer's tensors in the checkpoint's (PyTorch `nn.Linear`) layout: weights `[out, in]`.
pub(crate) struct LayerTensors {
    pub query: (Tensor, Tensor),
    pub key: (Tensor, Tensor),
    pub value: (Tensor, Tensor),
    pub attention_out: (Tensor, Tensor),
    /// (gamma, beta) of the LayerNorm after attention.
    pub attention_norm: (Tensor, Tensor),
    pub ffn_in: (Tensor, Tensor),
    pub ffn_out: (Tensor, Tensor),
    pub ffn_norm: (Tensor, Tensor),
}

pub(crate) struct EncoderLayer {
    /// `[H, 3H]`: Q, K and V weights concatenated at load, so one GEMM projects all three.
    qkv_weight: Tensor,
    qkv_bias: Tensor,
    attention_out_weight: Tensor,
    /// `[3, H]`: bias of the output projection, LayerNorm gamma, beta.
    attention_norm: Tensor,
    ffn_in_weight: Tensor,
    ffn_in_bias: Tensor,
    ffn_out_weight: Tensor,
    ffn_norm: Tensor,
    attention: VarlenAttention,
    norm: BiasResidualLayerNorm,
}

impl EncoderLayer {
    pub fn new(t: LayerTensors, num_heads: usize, head_dim: usize, eps: f64) -> Result<Self> {
        // Weights are stored `[in, out]` and contiguous, the layout the GEMM's right-hand side
        // reads along rows.
        let transpose = |w: &Tensor| w.t()?.contiguous();
        let qkv = Tensor::cat(&[&t.query.0, &t.key.0, &t.value.0], 0)?;
        Ok(Self {
            qkv_weight: transpose(&qkv)?,
            qkv_bias: Tensor::cat(&[&t.query.1, &t.key.1, &t.value.1], 0)?,
            attention_out_weight: transpose(&t.attention_out.0)?,
            attention_norm: Tensor::stack(
                &[&t.attention_out.1, &t.attention_norm.0, &t.attention_norm.1],
                0,
            )?,
            ffn_in_weight: transpose(&t.ffn_in.0)?,
            ffn_in_bias: t.ffn_in.1,
            ffn_out_weight: transpose(&t.ffn_out.0)?,
            ffn_norm: Tensor::stack(&[&t.ffn_out.1, &t.ffn_norm.0, &t.ffn_norm.1], 0)?,
            attention: VarlenAttention {
                num_heads,
                head_dim,
                max_seqlen: 0,
            },
            norm: BiasResidualLayerNorm { eps: eps as f32 },
        })
    }

    /// `[T, H]` → `[T, H]`.
    pub fn forward(&self, hidden: &Tensor, packing: &Packing) -> Result<Tensor> {
        let attention = VarlenAttention {
            max_seqlen: packing.max_len,
            ..self.attention
        };
        let qkv = hidden.matmul(&self.qkv_weight)?;
        let context = qkv.apply_op3_no_bwd(&self.qkv_bias, &packing.cu_seqlens, &attention)?;
        let projected = context.matmul(&self.attention_out_weight)?;
        let hidden = projected.apply_op3_no_bwd(hidden, &self.attention_norm, &self.norm)?;
        let intermediate = hidden
            .matmul(&self.ffn_in_weight)?
            .apply_op2_no_bwd(&self.ffn_in_bias, &BiasGelu)?;
        let out = intermediate.matmul(&self.ffn_out_weight)?;
        out.apply_op3_no_bwd(&hidden, &self.ffn_norm, &self.norm)
    }
}
