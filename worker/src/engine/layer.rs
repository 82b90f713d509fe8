//! One post-LayerNorm transformer encoder layer over packed tokens, shared by the BERT family
//! (BERT, RoBERTa/XLM-R and DistilBERT differ in names and embeddings, not here).
//!
//! Per layer: fused QKV GEMM → varlen attention → output GEMM → bias+residual+LayerNorm →
//! FFN-in GEMM → bias+GELU → FFN-out GEMM → bias+residual+LayerNorm. On an AVX2 CPU the GEMMs
//! are the packed-weight `Linear` op with bias (and GELU) in its epilogue; elsewhere they are
//! candle's matmul and the biases ride on the fused ops that follow.

use super::ops::{
    has_avx2_fma, Activation, BiasGelu, BiasResidualLayerNorm, GemmInputs, Linear, PackedWeight,
    VarlenAttention,
};
use candle_core::{Result, Tensor};
use std::sync::Arc;

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
    /// Q, K and V biases concatenated like their weights, `[3H]`.
    qkv_bias: Tensor,
    attention_out_bias: Tensor,
    ffn_in_bias: Tensor,
    ffn_out_bias: Tensor,
    /// `[3, H]` each: bias of the preceding projection, LayerNorm gamma, beta.
    attention_norm: Tensor,
    ffn_norm: Tensor,
    projections: Projections,
    attention: VarlenAttention,
    norm: BiasResidualLayerNorm,
}

/// How the four GEMMs run.
enum Projections {
    /// The CPU kernel with weights packed at load; the bias (and GELU) are applied in the
    /// GEMM's epilogue, so the attention and LayerNorm ops get zero biases.
    Packed {
        qkv: Linear,
        attention_out: Linear,
        ffn_in: Linear,
        ffn_out: Linear,
        zero_qkv_bias: Tensor,
        attention_norm: Tensor,
        ffn_norm: Tensor,
    },
    /// candle's matmul on `[in, out]` weights (any device, any CPU); the biases go to the
    /// fused ops that follow each GEMM.
    Matmul {
        qkv: Tensor,
        attention_out: Tensor,
        ffn_in: Tensor,
        ffn_out: Tensor,
    },
}

impl EncoderLayer {
    /// `gemm` says what the CPU kernel multiplies (bf16 needs AVX512-BF16); the GEMMs of
    /// other devices follow the weights' dtype.
    pub fn new(
        t: LayerTensors,
        (num_heads, head_dim): (usize, usize),
        eps: f64,
        gemm: GemmInputs,
    ) -> Result<Self> {
        let qkv = Tensor::cat(&[&t.query.0, &t.key.0, &t.value.0], 0)?;
        let qkv_bias = Tensor::cat(&[&t.query.1, &t.key.1, &t.value.1], 0)?;
        let attention_norm = Tensor::stack(
            &[&t.attention_out.1, &t.attention_norm.0, &t.attention_norm.1],
            0,
        )?;
        let ffn_norm = Tensor::stack(&[&t.ffn_out.1, &t.ffn_norm.0, &t.ffn_norm.1], 0)?;

        let packed_kernel = gemm == GemmInputs::Bf16 || has_avx2_fma();
        let projections = if qkv.device().is_cpu() && packed_kernel {
            let packed = |w: &Tensor, activation| -> Result<Linear> {
                Ok(Linear {
                    weight: Arc::new(PackedWeight::new(w, gemm)?),
                    activation,
                })
            };
            let without_bias = |norm: &Tensor| -> Result<Tensor> {
                let rows = norm.chunk(3, 0)?;
                Tensor::cat(&[&rows[0].zeros_like()?, &rows[1], &rows[2]], 0)
            };
            Projections::Packed {
                qkv: packed(&qkv, Activation::None)?,
                attention_out: packed(&t.attention_out.0, Activation::None)?,
                ffn_in: packed(&t.ffn_in.0, Activation::Gelu)?,
                ffn_out: packed(&t.ffn_out.0, Activation::None)?,
                zero_qkv_bias: qkv_bias.zeros_like()?,
                attention_norm: without_bias(&attention_norm)?,
                ffn_norm: without_bias(&ffn_norm)?,
            }
        } else {
            // `[in, out]` and contiguous: the layout the GEMM's right-hand side reads by rows.
            let transpose = |w: &Tensor| w.t()?.contiguous();
            Projections::Matmul {
                qkv: transpose(&qkv)?,
                attention_out: transpose(&t.attention_out.0)?,
                ffn_in: transpose(&t.ffn_in.0)?,
                ffn_out: transpose(&t.ffn_out.0)?,
            }
        };
        Ok(Self {
            qkv_bias,
            attention_out_bias: t.attention_out.1,
            ffn_in_bias: t.ffn_in.1,
            ffn_out_bias: t.ffn_out.1,
            attention_norm,
            ffn_norm,
            projections,
            attention: VarlenAttention {
                num_heads,
                head_dim,
                max_seqlen: 0,
                tensor_cores: true,
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
        let cu = &packing.cu_seqlens;
        match &self.projections {
            Projections::Packed {
                qkv,
                attention_out,
                ffn_in,
                ffn_out,
                zero_qkv_bias,
                attention_norm,
                ffn_norm,
            } => {
                let qkv = hidden.apply_op2_no_bwd(&self.qkv_bias, qkv)?;
                let context = qkv.apply_op3_no_bwd(zero_qkv_bias, cu, &attention)?;
                let projected =
                    context.apply_op2_no_bwd(&self.attention_out_bias, attention_out)?;
                let hidden = projected.apply_op3_no_bwd(hidden, attention_norm, &self.norm)?;
                let intermediate = hidden.apply_op2_no_bwd(&self.ffn_in_bias, ffn_in)?;
                let out = intermediate.apply_op2_no_bwd(&self.ffn_out_bias, ffn_out)?;
                out.apply_op3_no_bwd(&hidden, ffn_norm, &self.norm)
            }
            Projections::Matmul {
                qkv,
                attention_out,
                ffn_in,
                ffn_out,
            } => {
                let qkv = hidden.matmul(qkv)?;
                let context = qkv.apply_op3_no_bwd(&self.qkv_bias, cu, &attention)?;
                let projected = context.matmul(attention_out)?;
                let hidden =
                    projected.apply_op3_no_bwd(hidden, &self.attention_norm, &self.norm)?;
                let intermediate = hidden
                    .matmul(ffn_in)?
                    .apply_op2_no_bwd(&self.ffn_in_bias, &BiasGelu)?;
                let out = intermediate.matmul(ffn_out)?;
                out.apply_op3_no_bwd(&hidden, &self.ffn_norm, &self.norm)
            }
        }
    }
}
