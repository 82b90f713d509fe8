//! The built-in multilayer perceptron for tabular data: `Linear → ReLU` per hidden width,
//! then a linear output layer. Weights start like PyTorch's `nn.Linear` default
//! (uniform in ±1/√fan_in for weight and bias), drawn from the job's seeded generator so
//! the same seed builds the same network.

use candle_core::{DType, Device, Result, Tensor, Var};

use super::{Network, OpTrace};
use crate::train::data::{Examples, Inputs};
use crate::train::precision::{self, OpKind, PlanError, Precision, PrecisionPlan};
use crate::train::rng::Rng;

pub struct Mlp {
    /// `(weight [out, in], bias [out])` per layer, by index in `parameters`.
    layers: usize,
    parameters: Vec<(String, Var)>,
    /// Per layer; the output layer is the head and stays f32.
    precisions: Vec<Precision>,
    device: Device,
}

impl Mlp {
    pub fn new(input: usize, hidden: &[usize], output: usize, seed: u64, device: &Device) -> Result<Mlp> {
        let mut rng = Rng::derive(seed, "init");
        let widths: Vec<usize> = std::iter::once(input).chain(hidden.iter().copied()).chain([output]).collect();
        let mut parameters = Vec::new();
        for (index, pair) in widths.windows(2).enumerate() {
            let (fan_in, fan_out) = (pair[0], pair[1]);
            let bound = 1.0 / (fan_in as f64).sqrt();
            let mut uniform =
                |n: usize| -> Vec<f32> { (0..n).map(|_| ((rng.next_f64() * 2.0 - 1.0) * bound) as f32).collect() };
            let weight = Tensor::from_vec(uniform(fan_in * fan_out), (fan_out, fan_in), device)?;
            let bias = Tensor::from_vec(uniform(fan_out), fan_out, device)?;
            parameters.push((format!("layers.{index}.weight"), Var::from_tensor(&weight)?));
            parameters.push((format!("layers.{index}.bias"), Var::from_tensor(&bias)?));
        }
        let layers = widths.len() - 1;
        Ok(Mlp { layers, parameters, precisions: vec![Precision::F32; layers], device: device.clone() })
    }

    /// One dense layer at its planned precision.
    fn linear(&self, layer: usize, input: &Tensor) -> Result<Tensor> {
        let weight = self.parameters[2 * layer].1.as_tensor();
        let bias = self.parameters[2 * layer + 1].1.as_tensor();
        precision::linear(input, weight, bias, self.precisions[layer])
    }

    fn run(&self, examples: &Examples, rows: &[usize], mut traces: Option<&mut Vec<OpTrace>>) -> Result<Tensor> {
        let Inputs::Dense { dim, values } = &examples.inputs else {
            candle_core::bail!("the MLP reads numeric feature columns, not text");
        };
        let batch: Vec<f32> = rows.iter().flat_map(|&r| values[r * dim..(r + 1) * dim].iter().copied()).collect();
        let mut x = Tensor::from_vec(batch, (rows.len(), *dim), &self.device)?.to_dtype(DType::F32)?;
        for layer in 0..self.layers {
            let y = self.linear(layer, &x)?;
            if let Some(traces) = traces.as_deref_mut() {
                let (weight, bias) = (
                    self.parameters[2 * layer].1.as_tensor().clone(),
                    self.parameters[2 * layer + 1].1.as_tensor().clone(),
                );
                let input = x.detach();
                let rerun_input = input.clone();
                let rerun_weight = weight.clone();
                traces.push(OpTrace {
                    name: format!("layers.{layer}"),
                    kind: if layer + 1 == self.layers { OpKind::Head } else { OpKind::Linear },
                    input,
                    output: y.detach(),
                    weight: Some(weight),
                    // Each layer reads the ReLU of the one before, the first the batch.
                    reads: None,
                    rerun: Box::new(move |p| precision::linear(&rerun_input, &rerun_weight, &bias, p)),
                });
            }
            x = if layer + 1 < self.layers { y.relu()? } else { y };
        }
        Ok(x)
    }
}

impl Network for Mlp {
    fn forward(&self, examples: &Examples, rows: &[usize], _train: bool) -> Result<Tensor> {
        self.run(examples, rows, None)
    }

    fn forward_traced(&self, examples: &Examples, rows: &[usize]) -> Result<(Tensor, Vec<OpTrace>)> {
        let mut traces = Vec::with_capacity(self.layers);
        let outputs = self.run(examples, rows, Some(&mut traces))?;
        Ok((outputs, traces))
    }

    fn parameters(&self) -> &[(String, Var)] {
        &self.parameters
    }

    /// `layers.{i}` per layer; the last is the head.
    fn precision_ops(&self) -> Vec<(String, OpKind)> {
        (0..self.layers)
            .map(|i| (format!("layers.{i}"), if i + 1 == self.layers { OpKind::Head } else { OpKind::Linear }))
            .collect()
    }

    fn set_precision(&mut self, plan: &PrecisionPlan) -> std::result::Result<(), PlanError> {
        plan.check(&self.precision_ops())?;
        self.precisions = (0..self.layers).map(|i| plan.get(&format!("layers.{i}"))).collect();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_names_and_seeded_init() {
        let device = Device::Cpu;
        let mlp = Mlp::new(3, &[5, 4], 2, 1, &device).unwrap();
        let names: Vec<&str> = mlp.parameters().iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "layers.0.weight",
                "layers.0.bias",
                "layers.1.weight",
                "layers.1.bias",
                "layers.2.weight",
                "layers.2.bias"
            ]
        );
        let examples = Examples {
            inputs: Inputs::Dense { dim: 3, values: vec![0.5; 6] },
            targets: crate::train::data::Targets::Values(vec![0.0; 2]),
        };
        assert_eq!(mlp.forward(&examples, &[0, 1], true).unwrap().dims(), [2, 2]);
        let again = Mlp::new(3, &[5, 4], 2, 1, &device).unwrap();
        let other = Mlp::new(3, &[5, 4], 2, 2, &device).unwrap();
        let first = |m: &Mlp| m.parameters()[0].1.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(first(&mlp), first(&again));
        assert_ne!(first(&mlp), first(&other));
        assert!(first(&mlp).iter().all(|w| w.abs() <= 1.0 / 3f32.sqrt()));
    }

    #[test]
    fn a_traced_forward_records_each_layer_on_its_real_input() {
        let mlp = Mlp::new(3, &[5, 4], 2, 1, &Device::Cpu).unwrap();
        let examples = Examples {
            inputs: Inputs::Dense { dim: 3, values: vec![0.5, -1.0, 2.0, 0.25, 0.0, -0.75] },
            targets: crate::train::data::Targets::Values(vec![0.0; 2]),
        };
        let values = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let (outputs, mut traces) = mlp.forward_traced(&examples, &[1, 0]).unwrap();
        assert_eq!(values(&outputs), values(&mlp.forward(&examples, &[1, 0], true).unwrap()));
        let recorded: Vec<(String, OpKind)> = traces.iter().map(|t| (t.name.clone(), t.kind)).collect();
        assert_eq!(recorded, mlp.precision_ops());
        assert_eq!(values(&traces[0].input), [0.25, 0.0, -0.75, 0.5, -1.0, 2.0], "the batch's rows in order");
        for (layer, trace) in traces.iter_mut().enumerate() {
            // The weight is the parameter itself, so a traced loss's gradients name it.
            assert_eq!(trace.weight.as_ref().unwrap().id(), mlp.parameters()[2 * layer].1.as_tensor().id());
            assert_eq!(values(&(trace.rerun)(Precision::F32).unwrap()), values(&trace.output));
            assert_eq!((trace.rerun)(Precision::Bf16).unwrap().dims(), trace.output.dims());
        }
        assert_eq!(values(&traces[1].input), values(&traces[0].output.relu().unwrap()));
    }
}
