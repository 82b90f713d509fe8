//! Fine-tuning a registered BERT-family encoder for sequence classification or
//! regression: our trainable encoder (`super::encoder`, every weight a `Var`, each
//! operator at its planned precision), the token states mean-pooled over the attention
//! mask (what sentence-transformers models such as all-MiniLM-L6-v2 are trained for; BERT's
//! CLS pooler is not in their files), then a linear head initialised from the job's seed and
//! kept at f32. The serving engine in `crate::engine` is inference-only (packed, no
//! autograd), so training uses this padded graph. No dropout, which keeps runs deterministic.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{DType, Device, Result, Tensor, Var};
use candle_transformers::models::bert::Config;
use tessera_api::train::{encoder_activations_per_row, MAX_TEXT_TOKENS};
use tokenizers::{PaddingParams, Tokenizer, TruncationParams};

use super::encoder::Encoder;
use super::{Network, OpTrace};
use crate::train::data::{Examples, Inputs, Prepared, TaskKind};
use crate::train::precision::{self, OpKind, PlanError, Precision, PrecisionPlan};
use crate::train::rng::Rng;

pub struct BertClassifier {
    encoder: Encoder,
    tokenizer: Tokenizer,
    /// Encoder weights (sorted by name), then `head.weight`, `head.bias`.
    parameters: Vec<(String, Var)>,
    /// What a forward holds per row at the longest input (see [`encoder_activations_per_row`]).
    activations_per_row: u64,
    device: Device,
}

fn invalid(what: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(what.to_string())
}

impl BertClassifier {
    pub fn load(folder: &Path, data: &Prepared, kind: TaskKind, seed: u64, device: &Device) -> Result<BertClassifier> {
        let config: Config = serde_json::from_slice(&std::fs::read(folder.join("config.json"))?)
            .map_err(|e| invalid(format!("config.json is not a BERT config: {e}")))?;
        let mut tokenizer =
            Tokenizer::from_file(folder.join("tokenizer.json")).map_err(|e| invalid(format!("tokenizer.json: {e}")))?;
        let tokens = MAX_TEXT_TOKENS.min(config.max_position_embeddings);
        tokenizer
            .with_truncation(Some(TruncationParams { max_length: tokens, ..Default::default() }))
            .map_err(|e| invalid(format!("tokenizer: {e}")))?;
        let activations_per_row = encoder_activations_per_row(
            tokens as u64,
            config.hidden_size as u64,
            config.intermediate_size as u64,
            config.num_attention_heads as u64,
            config.num_hidden_layers as u64,
        );
        tokenizer.with_padding(Some(PaddingParams { pad_id: config.pad_token_id as u32, ..Default::default() }));

        // The file's tensors become the Vars the model is built from, so nothing is left
        // at a random initial value; a `bert.` prefix (HF task checkpoints) is dropped.
        let weights = candle_core::safetensors::load(folder.join("model.safetensors"), device)?;
        let mut vars = BTreeMap::new();
        for (name, tensor) in weights {
            if tensor.dtype().is_float() {
                let name = name.strip_prefix("bert.").unwrap_or(&name).to_string();
                vars.insert(name, Var::from_tensor(&tensor.to_dtype(DType::F32)?)?);
            }
        }
        let encoder = Encoder::new(&config, &vars)?;
        // Only what the encoder reads is trained and checkpointed (not a pooler or an MLM
        // head the file may also hold).
        let used = encoder.parameter_names();
        let mut parameters: Vec<(String, Var)> =
            vars.into_iter().filter(|(name, _)| used.binary_search(name).is_ok()).collect();
        parameters.sort_by(|a, b| a.0.cmp(&b.0));

        let outputs = if kind == TaskKind::Classification { data.classes.len() } else { 1 };
        let hidden = config.hidden_size;
        let mut rng = Rng::derive(seed, "init");
        let bound = 1.0 / (hidden as f64).sqrt();
        let mut uniform =
            |n: usize| -> Vec<f32> { (0..n).map(|_| ((rng.next_f64() * 2.0 - 1.0) * bound) as f32).collect() };
        parameters.push((
            "head.weight".into(),
            Var::from_tensor(&Tensor::from_vec(uniform(outputs * hidden), (outputs, hidden), device)?)?,
        ));
        parameters.push(("head.bias".into(), Var::from_tensor(&Tensor::from_vec(uniform(outputs), outputs, device)?)?));
        Ok(BertClassifier { encoder, tokenizer, parameters, activations_per_row, device: device.clone() })
    }

    /// The f32 values a training forward holds per row at the longest input, which the job
    /// checks its batch against before the first step.
    pub fn activations_per_row(&self) -> u64 {
        self.activations_per_row
    }
}

impl BertClassifier {
    /// The rows' texts tokenized, truncated and padded to the longest of them.
    fn encode(&self, examples: &Examples, rows: &[usize]) -> Result<Vec<tokenizers::Encoding>> {
        let Inputs::Text(texts) = &examples.inputs else {
            candle_core::bail!("a transformer model reads a text column");
        };
        let batch: Vec<&str> = rows.iter().map(|&r| texts[r].as_str()).collect();
        self.tokenizer.encode_batch(batch, true).map_err(|e| invalid(format!("tokenizer: {e}")))
    }

    fn run(&self, examples: &Examples, rows: &[usize], traces: Option<&mut Vec<OpTrace>>) -> Result<Tensor> {
        let encodings = self.encode(examples, rows)?;
        let tensor = |f: &dyn Fn(&tokenizers::Encoding) -> &[u32]| -> Result<Tensor> {
            let rows = encodings.iter().map(|e| Tensor::new(f(e), &self.device)).collect::<Result<Vec<_>>>()?;
            Tensor::stack(&rows, 0)
        };
        let ids = tensor(&|e| e.get_ids())?;
        let types = tensor(&|e| e.get_type_ids())?;
        let mask = tensor(&|e| e.get_attention_mask())?;
        let mut traces = traces;
        let states = match traces.as_deref_mut() {
            Some(traces) => self.encoder.forward_traced(&ids, &types, &mask, traces)?,
            None => self.encoder.forward(&ids, &types, &mask)?,
        };
        let mask = mask.to_dtype(DType::F32)?.unsqueeze(2)?;
        let pooled = states.broadcast_mul(&mask)?.sum(1)?.broadcast_div(&mask.sum(1)?)?;
        let n = self.parameters.len();
        let (weight, bias) = (self.parameters[n - 2].1.as_tensor(), self.parameters[n - 1].1.as_tensor());
        let outputs = precision::linear(&pooled, weight, bias, Precision::F32)?;
        if let Some(traces) = traces {
            let (input, weight, bias) = (pooled.detach(), weight.clone(), bias.clone());
            let (rerun_input, rerun_weight) = (input.clone(), weight.clone());
            traces.push(OpTrace {
                name: "head".into(),
                kind: OpKind::Head,
                input,
                output: outputs.detach(),
                weight: Some(weight),
                reads: None,
                rerun: Box::new(move |p| precision::linear(&rerun_input, &rerun_weight, &bias, p)),
            });
        }
        Ok(outputs)
    }
}

impl Network for BertClassifier {
    fn forward(&self, examples: &Examples, rows: &[usize], _train: bool) -> Result<Tensor> {
        self.run(examples, rows, None)
    }

    fn forward_traced(&self, examples: &Examples, rows: &[usize]) -> Result<(Tensor, Vec<OpTrace>)> {
        let mut traces = Vec::new();
        let outputs = self.run(examples, rows, Some(&mut traces))?;
        Ok((outputs, traces))
    }

    fn parameters(&self) -> &[(String, Var)] {
        &self.parameters
    }

    /// Tokens after padding: the encoder's work grows with them (at up to 128 tokens the
    /// linears, linear in them, dominate the attention).
    fn batch_work(&self, examples: &Examples, rows: &[usize]) -> Result<usize> {
        Ok(self.encode(examples, rows)?.iter().map(|e| e.get_ids().len()).sum())
    }

    /// The encoder's operators, then `head` (always f32).
    fn precision_ops(&self) -> Vec<(String, OpKind)> {
        let mut ops = self.encoder.precision_ops();
        ops.push(("head".into(), OpKind::Head));
        ops
    }

    fn set_precision(&mut self, plan: &PrecisionPlan) -> std::result::Result<(), PlanError> {
        plan.check(&self.precision_ops())?;
        let mut encoder_plan = plan.clone();
        encoder_plan.0.remove("head");
        self.encoder.set_precision(&encoder_plan)
    }
}
