//! A trainable BERT encoder whose every operator runs at the precision a plan gives it
//! (`crate::train::precision`): the linears (attention q/k/v/o, intermediate, output) at
//! f32, bf16 or int8, the embeddings and LayerNorms at f32 or bf16 (QSync's keep-list).
//!
//! It computes what candle-transformers' `BertModel` computes (same graph, mask and GELU;
//! `worker/tests/train_bert.rs` checks the outputs agree at all-f32), with two differences
//! that training needs: its layers are ours, so each one can change precision, and its
//! LayerNorm is written with differentiable tensor ops. candle-nn's fused LayerNorm (which
//! `BertModel` uses) has no backward, so with it no gradient reached the encoder's weights.
//! A bf16 embedding or LayerNorm rounds its output to bf16 (QSync's 16-bit kernels store
//! 16-bit outputs); on the CPU that buys no speed, only the numerics.

use std::collections::BTreeMap;

use candle_core::{DType, Result, Tensor, Var, D};
use candle_transformers::models::bert::{Config, HiddenAct, PositionEmbeddingType};

use crate::train::precision::{self, OpKind, PlanError, Precision, PrecisionPlan};

/// A dense layer `x Wᵀ + b`, named by its weights' prefix.
struct Dense {
    name: String,
    weight: Tensor,
    bias: Tensor,
    precision: Precision,
}

impl Dense {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        precision::linear(x, &self.weight, &self.bias, self.precision)
    }
}

struct Norm {
    name: String,
    weight: Tensor,
    bias: Tensor,
    eps: f64,
    precision: Precision,
}

impl Norm {
    /// LayerNorm over the last dimension, as candle-nn's unfused path computes it.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let hidden = x.dim(D::Minus1)? as f64;
        let centred = x.broadcast_sub(&(x.sum_keepdim(D::Minus1)? / hidden)?)?;
        let variance = (centred.sqr()?.sum_keepdim(D::Minus1)? / hidden)?;
        let normed = centred.broadcast_div(&(variance + self.eps)?.sqrt()?)?;
        round(normed.broadcast_mul(&self.weight)?.broadcast_add(&self.bias)?, self.precision)
    }
}

/// `x` rounded to bf16 and back when `precision` asks for it (candle differentiates the
/// casts as the identity: a straight-through rounding). The keep-list holds these operators
/// at bf16 or more, so int8 never reaches here; were it to, it rounds as bf16.
fn round(x: Tensor, precision: Precision) -> Result<Tensor> {
    match precision {
        Precision::F32 => Ok(x),
        Precision::Bf16 | Precision::Int8 => x.to_dtype(DType::BF16)?.to_dtype(DType::F32),
        Precision::F16 => candle_core::bail!("f16 is not implemented by the training operators; use bf16 or f32"),
    }
}

struct Embeddings {
    word: Tensor,
    position: Tensor,
    token_type: Tensor,
    norm: Norm,
    precision: Precision,
}

impl Embeddings {
    fn forward(&self, ids: &Tensor, types: &Tensor) -> Result<Tensor> {
        let (_, len) = ids.dims2()?;
        let lookup = |table: &Tensor, ids: &Tensor| -> Result<Tensor> {
            let mut dims = ids.dims().to_vec();
            dims.push(table.dim(1)?);
            round(table.index_select(&ids.flatten_all()?, 0)?.reshape(dims)?, self.precision)
        };
        let positions = Tensor::arange(0u32, len as u32, ids.device())?;
        let sum = (lookup(&self.word, ids)? + lookup(&self.token_type, types)?)?
            .broadcast_add(&lookup(&self.position, &positions)?)?;
        self.norm.forward(&sum)
    }
}

struct Layer {
    query: Dense,
    key: Dense,
    value: Dense,
    attention_output: Dense,
    attention_norm: Norm,
    intermediate: Dense,
    output: Dense,
    output_norm: Norm,
}

/// The trainable encoder: token ids to hidden states `[batch, tokens, hidden]`.
pub struct Encoder {
    embeddings: Embeddings,
    layers: Vec<Layer>,
    heads: usize,
    activation: HiddenAct,
    /// The weight names it reads, sorted.
    names: Vec<String>,
}

impl Encoder {
    /// The encoder over `vars` (checkpoint names without a `bert.` prefix); the tensors are
    /// the `Var`s' own, so gradients land on them.
    pub fn new(config: &Config, vars: &BTreeMap<String, Var>) -> Result<Encoder> {
        if config.position_embedding_type != PositionEmbeddingType::Absolute {
            candle_core::bail!("only absolute position embeddings are supported");
        }
        if config.hidden_size % config.num_attention_heads != 0 {
            candle_core::bail!(
                "hidden_size {} is not a multiple of {} heads",
                config.hidden_size,
                config.num_attention_heads
            );
        }
        let mut names = Vec::new();
        let mut get = |name: String, dims: &[usize]| -> Result<Tensor> {
            let Some(var) = vars.get(&name) else { candle_core::bail!("model.safetensors has no tensor '{name}'") };
            if var.dims() != dims {
                candle_core::bail!("'{name}' is {:?}, the config asks for {dims:?}", var.dims());
            }
            names.push(name);
            Ok(var.as_tensor().clone())
        };
        let (h, inner) = (config.hidden_size, config.intermediate_size);
        let mut dense = |name: String, outputs: usize, inputs: usize| -> Result<Dense> {
            Ok(Dense {
                weight: get(format!("{name}.weight"), &[outputs, inputs])?,
                bias: get(format!("{name}.bias"), &[outputs])?,
                name,
                precision: Precision::F32,
            })
        };
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        let norm_eps = config.layer_norm_eps;
        for i in 0..config.num_hidden_layers {
            let p = format!("encoder.layer.{i}");
            layers.push((
                dense(format!("{p}.attention.self.query"), h, h)?,
                dense(format!("{p}.attention.self.key"), h, h)?,
                dense(format!("{p}.attention.self.value"), h, h)?,
                dense(format!("{p}.attention.output.dense"), h, h)?,
                dense(format!("{p}.intermediate.dense"), inner, h)?,
                dense(format!("{p}.output.dense"), h, inner)?,
            ));
        }
        let mut norm = |name: String| -> Result<Norm> {
            Ok(Norm {
                weight: get(format!("{name}.weight"), &[h])?,
                bias: get(format!("{name}.bias"), &[h])?,
                name,
                eps: norm_eps,
                precision: Precision::F32,
            })
        };
        let layers = layers
            .into_iter()
            .enumerate()
            .map(|(i, (query, key, value, attention_output, intermediate, output))| {
                let p = format!("encoder.layer.{i}");
                Ok(Layer {
                    query,
                    key,
                    value,
                    attention_output,
                    attention_norm: norm(format!("{p}.attention.output.LayerNorm"))?,
                    intermediate,
                    output,
                    output_norm: norm(format!("{p}.output.LayerNorm"))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let embedding_norm = norm("embeddings.LayerNorm".into())?;
        let embeddings = Embeddings {
            word: get("embeddings.word_embeddings.weight".into(), &[config.vocab_size, h])?,
            position: get("embeddings.position_embeddings.weight".into(), &[config.max_position_embeddings, h])?,
            token_type: get("embeddings.token_type_embeddings.weight".into(), &[config.type_vocab_size, h])?,
            norm: embedding_norm,
            precision: Precision::F32,
        };
        names.sort();
        Ok(Encoder { embeddings, layers, heads: config.num_attention_heads, activation: config.hidden_act, names })
    }

    /// The checkpoint names of the weights it reads, sorted.
    pub fn parameter_names(&self) -> &[String] {
        &self.names
    }

    /// The operators a precision plan may name: `embeddings`, then per layer its six linears
    /// (by weight prefix, e.g. `encoder.layer.0.attention.self.query`) and two LayerNorms, in
    /// the order the forward runs them.
    pub fn precision_ops(&self) -> Vec<(String, OpKind)> {
        let mut ops =
            vec![("embeddings".to_string(), OpKind::Embedding), (self.embeddings.norm.name.clone(), OpKind::LayerNorm)];
        for layer in &self.layers {
            for dense in [&layer.query, &layer.key, &layer.value, &layer.attention_output] {
                ops.push((dense.name.clone(), OpKind::Linear));
            }
            ops.push((layer.attention_norm.name.clone(), OpKind::LayerNorm));
            ops.push((layer.intermediate.name.clone(), OpKind::Linear));
            ops.push((layer.output.name.clone(), OpKind::Linear));
            ops.push((layer.output_norm.name.clone(), OpKind::LayerNorm));
        }
        ops
    }

    /// Runs each operator at the plan's precision from the next forward on; a plan that
    /// names an unknown operator or breaks the keep-list changes nothing.
    pub fn set_precision(&mut self, plan: &PrecisionPlan) -> std::result::Result<(), PlanError> {
        plan.check(&self.precision_ops())?;
        self.embeddings.precision = plan.get("embeddings");
        self.embeddings.norm.precision = plan.get(&self.embeddings.norm.name);
        for layer in &mut self.layers {
            for dense in [
                &mut layer.query,
                &mut layer.key,
                &mut layer.value,
                &mut layer.attention_output,
                &mut layer.intermediate,
                &mut layer.output,
            ] {
                dense.precision = plan.get(&dense.name);
            }
            for norm in [&mut layer.attention_norm, &mut layer.output_norm] {
                norm.precision = plan.get(&norm.name);
            }
        }
        Ok(())
    }

    /// Hidden states `[batch, tokens, hidden]` for `ids` and `types` `[batch, tokens]` (u32)
    /// and the attention mask (1 for a token, 0 for padding).
    pub fn forward(&self, ids: &Tensor, types: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let mut hidden = self.embeddings.forward(ids, types)?;
        // HF's extended mask: 0 where attended, the most negative f32 where padded.
        let mask = mask.to_dtype(DType::F32)?.unsqueeze(1)?.unsqueeze(1)?;
        let mask = ((mask.ones_like()? - &mask)? * f32::MIN as f64)?;
        for layer in &self.layers {
            hidden = self.layer(layer, &hidden, &mask)?;
        }
        Ok(hidden)
    }

    fn layer(&self, layer: &Layer, hidden: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let (batch, tokens, width) = hidden.dims3()?;
        let head_dim = width / self.heads;
        let split = |x: Tensor| x.reshape((batch, tokens, self.heads, head_dim))?.transpose(1, 2)?.contiguous();
        let q = split(layer.query.forward(hidden)?)?;
        let k = split(layer.key.forward(hidden)?)?;
        let v = split(layer.value.forward(hidden)?)?;
        let scores = (q.matmul(&k.t()?)? / (head_dim as f64).sqrt())?.broadcast_add(mask)?;
        let probs = candle_nn::ops::softmax(&scores, D::Minus1)?;
        let context = probs.matmul(&v)?.transpose(1, 2)?.contiguous()?.flatten_from(D::Minus2)?;
        let attended = layer.attention_norm.forward(&(layer.attention_output.forward(&context)? + hidden)?)?;
        let inner = layer.intermediate.forward(&attended)?;
        let inner = match self.activation {
            HiddenAct::Gelu => inner.gelu_erf()?,
            HiddenAct::GeluApproximate => inner.gelu()?,
            HiddenAct::Relu => inner.relu()?,
        };
        layer.output_norm.forward(&(layer.output.forward(&inner)? + attended)?)
    }
}
