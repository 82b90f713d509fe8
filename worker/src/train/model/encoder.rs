//! A trainable BERT encoder whose every operator runs at the precision a plan gives it
//! (`crate::train::precision`): the linears (attention q/k/v/o, intermediate, output) at
//! f32, bf16 or int8, the embeddings and LayerNorms at f32 or bf16 (QSync's keep-list).
//!
//! It computes what candle-transformers' `BertModel` computes (same graph, mask and GELU;
//! `worker/tests/train_bert.rs` checks the outputs agree at all-f32), with two differences
//! that training needs: its layers are ours, so each one can change precision, and its
//! LayerNorm has a backward (`fused::layer_norm`). candle-nn's fused LayerNorm (which
//! `BertModel` uses) has none, so with it no gradient reached the encoder's weights.
//! A bf16 embedding or LayerNorm rounds its output to bf16 (QSync's 16-bit kernels store
//! 16-bit outputs); on the CPU that buys no speed, only the numerics. A traced forward
//! records each of these operators with what it read (`super::OpTrace`).

use std::collections::BTreeMap;

use candle_core::{DType, Result, Tensor, Var};
use candle_transformers::models::bert::{Config, HiddenAct, PositionEmbeddingType};

use super::{fused, OpTrace};
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
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        layer_norm(x, &self.weight, &self.bias, self.eps, self.precision)
    }
}

/// LayerNorm over the last dimension at `precision`.
fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64, precision: Precision) -> Result<Tensor> {
    round(fused::layer_norm(x, weight, bias, eps)?, precision)
}

/// Records the operators of a traced forward, in the order they run; a plain forward
/// records nothing.
struct Recorder<'a>(Option<&'a mut Vec<OpTrace>>);

impl Recorder<'_> {
    /// Adds the trace `make` builds and returns its index; `None` when not tracing.
    fn push(&mut self, make: impl FnOnce() -> OpTrace) -> Option<usize> {
        let traces = self.0.as_deref_mut()?;
        traces.push(make());
        Some(traces.len() - 1)
    }

    /// `dense` on `x` (the output of traced operator `reads`, if it is one).
    fn dense(&mut self, dense: &Dense, x: &Tensor, reads: Option<usize>) -> Result<(Tensor, Option<usize>)> {
        let y = dense.forward(x)?;
        let index = self.push(|| {
            let (input, weight, bias) = (x.detach(), dense.weight.clone(), dense.bias.clone());
            let (rerun_input, rerun_weight) = (input.clone(), weight.clone());
            OpTrace {
                name: dense.name.clone(),
                kind: OpKind::Linear,
                input,
                output: y.detach(),
                weight: Some(weight),
                reads,
                rerun: Box::new(move |p| precision::linear(&rerun_input, &rerun_weight, &bias, p)),
            }
        });
        Ok((y, index))
    }

    fn norm(&mut self, norm: &Norm, x: &Tensor, reads: Option<usize>) -> Result<(Tensor, Option<usize>)> {
        let y = norm.forward(x)?;
        let index = self.push(|| {
            let (input, weight, bias, eps) = (x.detach(), norm.weight.clone(), norm.bias.clone(), norm.eps);
            let rerun_input = input.clone();
            OpTrace {
                name: norm.name.clone(),
                kind: OpKind::LayerNorm,
                input,
                output: y.detach(),
                weight: None,
                reads,
                rerun: Box::new(move |p| layer_norm(&rerun_input, &weight, &bias, eps, p)),
            }
        });
        Ok((y, index))
    }
}

/// `x` rounded to bf16 and back when `precision` asks for it, its gradient rounded alike
/// (a straight-through rounding, as candle differentiates the two casts). The keep-list
/// holds these operators at bf16 or more, so int8 never reaches here; were it to, it rounds
/// as bf16.
fn round(x: Tensor, precision: Precision) -> Result<Tensor> {
    match precision {
        Precision::F32 => Ok(x),
        Precision::Bf16 | Precision::Int8 => fused::round_to_bf16(&x),
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

/// The rows of `table` at `ids`, `[ids…, width]`, rounded to `precision`.
fn lookup(table: &Tensor, ids: &Tensor, precision: Precision) -> Result<Tensor> {
    let mut dims = ids.dims().to_vec();
    dims.push(table.dim(1)?);
    round(table.index_select(&ids.flatten_all()?, 0)?.reshape(dims)?, precision)
}

/// The three lookups summed (before the embeddings' LayerNorm).
fn embed(
    word: &Tensor,
    position: &Tensor,
    token_type: &Tensor,
    ids: &Tensor,
    types: &Tensor,
    p: Precision,
) -> Result<Tensor> {
    let (_, len) = ids.dims2()?;
    let positions = Tensor::arange(0u32, len as u32, ids.device())?;
    (lookup(word, ids, p)? + lookup(token_type, types, p)?)?.broadcast_add(&lookup(position, &positions, p)?)
}

impl Embeddings {
    fn forward(&self, ids: &Tensor, types: &Tensor, recorder: &mut Recorder) -> Result<(Tensor, Option<usize>)> {
        let sum = embed(&self.word, &self.position, &self.token_type, ids, types, self.precision)?;
        let index = match recorder.0.is_some() {
            // QSync's indicator reads an embedding's gathered rows as its input.
            true => Some(self.word.index_select(&ids.flatten_all()?, 0)?.detach()),
            false => None,
        }
        .and_then(|rows| {
            recorder.push(|| {
                let (word, position, token_type) = (self.word.clone(), self.position.clone(), self.token_type.clone());
                let (ids, types) = (ids.clone(), types.clone());
                OpTrace {
                    name: "embeddings".into(),
                    kind: OpKind::Embedding,
                    input: rows,
                    output: sum.detach(),
                    weight: Some(self.word.clone()),
                    reads: None,
                    rerun: Box::new(move |p| embed(&word, &position, &token_type, &ids, &types, p)),
                }
            })
        });
        let (normed, norm_index) = recorder.norm(&self.norm, &sum, index)?;
        Ok((normed, norm_index))
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
        self.run(ids, types, mask, &mut Recorder(None))
    }

    /// [`Encoder::forward`] that also appends every operator of `precision_ops` to `traces`.
    pub fn forward_traced(
        &self,
        ids: &Tensor,
        types: &Tensor,
        mask: &Tensor,
        traces: &mut Vec<OpTrace>,
    ) -> Result<Tensor> {
        self.run(ids, types, mask, &mut Recorder(Some(traces)))
    }

    fn run(&self, ids: &Tensor, types: &Tensor, mask: &Tensor, recorder: &mut Recorder) -> Result<Tensor> {
        let (mut hidden, mut from) = self.embeddings.forward(ids, types, recorder)?;
        // HF's extended mask: 0 where attended, the most negative f32 where padded.
        let mask = mask.to_dtype(DType::F32)?.unsqueeze(1)?.unsqueeze(1)?;
        let mask = ((mask.ones_like()? - &mask)? * f32::MIN as f64)?;
        for layer in &self.layers {
            (hidden, from) = self.layer(layer, &hidden, from, &mask, recorder)?;
        }
        Ok(hidden)
    }

    /// One layer on `hidden` (the output of traced operator `from`, when tracing); its
    /// output and the traced operator that wrote it.
    fn layer(
        &self,
        layer: &Layer,
        hidden: &Tensor,
        from: Option<usize>,
        mask: &Tensor,
        recorder: &mut Recorder,
    ) -> Result<(Tensor, Option<usize>)> {
        let (q, _) = recorder.dense(&layer.query, hidden, from)?;
        let (k, _) = recorder.dense(&layer.key, hidden, from)?;
        let (v, _) = recorder.dense(&layer.value, hidden, from)?;
        let context = fused::self_attention(&q, &k, &v, mask, self.heads)?;
        let (projected, _) = recorder.dense(&layer.attention_output, &context, None)?;
        let (attended, attended_from) = recorder.norm(&layer.attention_norm, &(projected + hidden)?, None)?;
        let (inner, _) = recorder.dense(&layer.intermediate, &attended, attended_from)?;
        let inner = match self.activation {
            HiddenAct::Gelu => fused::gelu_erf(&inner)?,
            HiddenAct::GeluApproximate => inner.gelu()?,
            HiddenAct::Relu => inner.relu()?,
        };
        let (output, _) = recorder.dense(&layer.output, &inner, None)?;
        recorder.norm(&layer.output_norm, &(output + attended)?, None)
    }
}
