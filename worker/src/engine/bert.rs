//! BERT (and MiniLM, which is BERT with smaller sizes): embeddings, the encoder stack over
//! packed tokens, and the `BertForSequenceClassification` head. Checkpoints saved from
//! `BertModel` name tensors `embeddings.…`; those saved from a task model put them under
//! `bert.…` and the head (`classifier.…`) at the top level. Both load.

use super::batch::Batch;
use super::config::EncoderConfig;
use super::error::EngineError;
use super::layer::{EncoderLayer, LayerTensors, Packing};
use super::ops::{BiasResidualLayerNorm, GemmInputs, Pooling, SegmentedPool};
use super::weights::Weights;
use candle_core::{Device, Tensor};

type Result<T, E = candle_core::Error> = std::result::Result<T, E>;

pub(crate) struct Bert {
    word_embeddings: Tensor,
    position_embeddings: Tensor,
    token_type_embeddings: Tensor,
    /// `[3, H]`: zero bias, LayerNorm gamma, beta.
    embedding_norm: Tensor,
    norm: BiasResidualLayerNorm,
    layers: Vec<EncoderLayer>,
    head: Option<ClassificationHead>,
    device: Device,
}

/// `tanh(W_p · h_[CLS] + b_p)` then a linear classifier, as `BertForSequenceClassification`.
struct ClassificationHead {
    pooler: (Tensor, Tensor),
    classifier: (Tensor, Tensor),
    labels: Vec<String>,
}

impl Bert {
    pub fn load(
        w: &Weights,
        c: &EncoderConfig,
        device: &Device,
        gemm: GemmInputs,
    ) -> Result<Self, EngineError> {
        let prefix = ["", "bert."]
            .into_iter()
            .find(|p| w.contains(&format!("{p}embeddings.word_embeddings.weight")))
            .unwrap_or("");
        let h = c.hidden_size;
        let get = |name: &str, shape: &[usize]| w.get(&format!("{prefix}{name}"), shape);
        let linear =
            |name: &str, out: usize, inp: usize| -> Result<(Tensor, Tensor), EngineError> {
                Ok((
                    get(&format!("{name}.weight"), &[out, inp])?,
                    get(&format!("{name}.bias"), &[out])?,
                ))
            };
        let norm = |name: &str| -> Result<(Tensor, Tensor), EngineError> {
            Ok((
                get(&format!("{name}.weight"), &[h])?,
                get(&format!("{name}.bias"), &[h])?,
            ))
        };

        let (gamma, beta) = norm("embeddings.LayerNorm")?;
        let embedding_norm = Tensor::stack(&[&gamma.zeros_like()?, &gamma, &beta], 0)?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let l = format!("encoder.layer.{i}");
            let tensors = LayerTensors {
                query: linear(&format!("{l}.attention.self.query"), h, h)?,
                key: linear(&format!("{l}.attention.self.key"), h, h)?,
                value: linear(&format!("{l}.attention.self.value"), h, h)?,
                attention_out: linear(&format!("{l}.attention.output.dense"), h, h)?,
                attention_norm: norm(&format!("{l}.attention.output.LayerNorm"))?,
                ffn_in: linear(&format!("{l}.intermediate.dense"), c.intermediate_size, h)?,
                ffn_out: linear(&format!("{l}.output.dense"), h, c.intermediate_size)?,
                ffn_norm: norm(&format!("{l}.output.LayerNorm"))?,
            };
            layers.push(EncoderLayer::new(
                tensors,
                (c.num_attention_heads, c.head_dim()),
                c.layer_norm_eps,
                gemm,
            )?);
        }

        let head = if w.contains("classifier.weight") {
            let classes = w_rows(w, "classifier.weight")?;
            let classifier = (
                w.get("classifier.weight", &[classes, h])?,
                w.get("classifier.bias", &[classes])?,
            );
            let pooler = linear("pooler.dense", h, h)?;
            Some(ClassificationHead {
                pooler: (pooler.0.t()?.contiguous()?, pooler.1),
                classifier: (classifier.0.t()?.contiguous()?, classifier.1),
                labels: c.labels(classes),
            })
        } else {
            None
        };

        Ok(Self {
            word_embeddings: get("embeddings.word_embeddings.weight", &[c.vocab_size, h])?,
            position_embeddings: get(
                "embeddings.position_embeddings.weight",
                &[c.max_position_embeddings, h],
            )?,
            token_type_embeddings: get(
                "embeddings.token_type_embeddings.weight",
                &[c.type_vocab_size, h],
            )?,
            embedding_norm,
            norm: BiasResidualLayerNorm {
                eps: c.layer_norm_eps as f32,
            },
            layers,
            head,
            device: device.clone(),
        })
    }

    pub fn labels(&self) -> Option<&[String]> {
        self.head.as_ref().map(|h| h.labels.as_slice())
    }

    /// The last layer's hidden states, `[T, H]`, and the batch's offsets on the device.
    pub fn forward(&self, batch: &Batch) -> Result<(Tensor, Packing)> {
        let t = batch.total_tokens();
        // The batch's four host arrays go over in one copy, each then a view of it: on a GPU
        // a copy from pageable host memory waits for the stream, so this is the forward
        // pass's only wait, before its first kernel.
        let host = [
            batch.input_ids(),
            batch.position_ids(),
            batch.token_type_ids(),
            batch.cu_seqlens(),
        ]
        .concat();
        let len = host.len();
        let all = Tensor::from_vec(host, len, &self.device)?;
        let input_ids = all.narrow(0, 0, t)?;
        let position_ids = all.narrow(0, t, t)?;
        let token_type_ids = all.narrow(0, 2 * t, t)?;
        let packing = Packing {
            cu_seqlens: all.narrow(0, 3 * t, batch.len() + 1)?,
            max_len: batch.max_len(),
        };

        let words = self.word_embeddings.index_select(&input_ids, 0)?;
        let others = (self.position_embeddings.index_select(&position_ids, 0)?
            + self
                .token_type_embeddings
                .index_select(&token_type_ids, 0)?)?;
        let mut hidden = words.apply_op3_no_bwd(&others, &self.embedding_norm, &self.norm)?;
        for layer in &self.layers {
            hidden = layer.forward(&hidden, &packing)?;
        }
        Ok((hidden, packing))
    }

    /// Class logits `[n, classes]`, or `None` without a classification head.
    pub fn classify(&self, hidden: &Tensor, packing: &Packing) -> Option<Result<Tensor>> {
        let head = self.head.as_ref()?;
        let run = || {
            let cls = hidden.apply_op2_no_bwd(
                &packing.cu_seqlens,
                &SegmentedPool {
                    pooling: Pooling::Cls,
                    normalize: false,
                },
            )?;
            let pooled = cls
                .matmul(&head.pooler.0)?
                .broadcast_add(&head.pooler.1)?
                .tanh()?;
            pooled
                .matmul(&head.classifier.0)?
                .broadcast_add(&head.classifier.1)
        };
        Some(run())
    }
}

fn w_rows(w: &Weights, name: &str) -> Result<usize, EngineError> {
    // The class count is whatever the checkpoint was trained with; read it off the tensor.
    w.shape(name).map(|s| s[0])
}
