//! What one rank measures before the plan: each traced operator of the job's model, on
//! the batch it really ran on, at every precision it may take (QSync's per-device
//! profiles), through the `qsync::profile` harness; the casts between f32 and bf16 fitted
//! on the model's own tensor sizes; and the replayer's graph of the traced operators.

use std::time::Instant;

use candle_core::{Device, Tensor};
use tessera_api::precision::{CastModel, CostTable, KeepRule, Precision};

use crate::train::model::OpTrace;
use crate::train::precision::IMPLEMENTED;
use crate::train::qsync::{
    profile_casts, profile_ops, CandleCasts, GradBucket, GraphOp, Pass, ProfileConfig, ProfiledCast, ProfiledOp,
    QsyncError, Statistic, TrainingGraph,
};
use crate::train::trainer::Slowdown;

/// The precisions operator `trace` may be planned at: the ones the training operators
/// implement, down to `low`, never below its keep-list floor.
pub fn candidates(trace: &OpTrace, low: Precision) -> Vec<Precision> {
    let floor = KeepRule::floor(&KeepRule::qsync_defaults(), &trace.name, trace.kind).max(low);
    IMPLEMENTED.into_iter().filter(|&p| p >= floor).collect()
}

/// A traced operator as the harness runs it: a forward reruns it on its traced input, a
/// backward differentiates that forward's output (summed, so the upstream gradient is ones)
/// down to its input and weights.
struct TracedOp<'a> {
    trace: &'a mut OpTrace,
    precisions: Vec<Precision>,
    output: Option<Tensor>,
    slowdown: Slowdown,
}

impl TracedOp<'_> {
    fn forward(&mut self, precision: Precision) -> candle_core::Result<Tensor> {
        let output = (self.trace.rerun)(precision)?;
        output.device().synchronize()?;
        Ok(output)
    }
}

impl ProfiledOp for TracedOp<'_> {
    fn name(&self) -> &str {
        &self.trace.name
    }

    fn kind(&self) -> tessera_api::precision::OpKind {
        self.trace.kind
    }

    fn precisions(&self) -> Vec<Precision> {
        self.precisions.clone()
    }

    fn run(&mut self, precision: Precision, pass: Pass) -> candle_core::Result<()> {
        let started = Instant::now();
        match pass {
            Pass::Forward => self.output = Some(self.forward(precision)?),
            Pass::Backward => {
                let output =
                    self.output.take().ok_or_else(|| candle_core::Error::Msg("backward before forward".into()))?;
                let grads = output.sum_all()?.backward()?;
                output.device().synchronize()?;
                drop(grads);
            }
        }
        self.slowdown.pause(started.elapsed());
        Ok(())
    }
}

/// Times every traced operator at each of its candidate precisions down to `low`, inside
/// rounds of all of them in iteration order (see `profile_ops`: an operator's operands are
/// as far out of cache as in a training step; `iterations` timed rounds per precision after
/// one warm-up, the precisions taking turns, each precision's fastest round kept: the host
/// is shared). A precision the device refuses (int8 off the CPU) is left out of that
/// operator's row; f32 must run. The table's overhead and optimizer times are the caller's to fill.
pub fn profile(
    device: &str,
    traces: &mut [OpTrace],
    low: Precision,
    iterations: usize,
    slowdown: Slowdown,
) -> Result<CostTable, QsyncError> {
    let mut ops = Vec::with_capacity(traces.len());
    for trace in traces.iter_mut() {
        let candidates = candidates(trace, low);
        let mut op = TracedOp { trace, precisions: Vec::new(), output: None, slowdown: slowdown.clone() };
        for precision in candidates {
            match op.forward(precision) {
                Ok(_) => op.precisions.push(precision),
                Err(source) if precision == Precision::F32 => {
                    return Err(QsyncError::Op { op: op.trace.name.clone(), precision, source })
                }
                Err(_) => {}
            }
        }
        ops.push(op);
    }
    let mut runnable: Vec<&mut dyn ProfiledOp> = ops.iter_mut().map(|op| op as &mut dyn ProfiledOp).collect();
    let config = ProfileConfig { warmup: 1, iterations: iterations.max(1), statistic: Statistic::FastestRound };
    let mut table = profile_ops(device, &mut runnable, &config)?;
    // The operators take f32 and cast (or quantise) inside, so their times include it.
    table.casts_in_op_time = true;
    Ok(table)
}

/// Casts between the precisions whose conversions candle runs (f32 ↔ bf16; int8 operators
/// quantise inside), slowed like the rest of the rank's compute.
struct RankCasts {
    casts: CandleCasts,
    slowdown: Slowdown,
}

impl ProfiledCast for RankCasts {
    fn pairs(&self) -> Vec<(Precision, Precision)> {
        self.casts
            .pairs()
            .into_iter()
            .filter(|(from, to)| IMPLEMENTED.contains(from) && IMPLEMENTED.contains(to))
            .collect()
    }

    fn prepare(&mut self, from: Precision, to: Precision, numel: usize) -> candle_core::Result<()> {
        self.casts.prepare(from, to, numel)
    }

    fn cast(&mut self) -> candle_core::Result<()> {
        let started = Instant::now();
        self.casts.cast()?;
        self.slowdown.pause(started.elapsed());
        Ok(())
    }
}

/// The tensor sizes the model casts (its operators' inputs and weights): up to four of
/// them spread from the smallest to the largest, at least two distinct.
fn cast_sizes(traces: &[OpTrace]) -> Vec<usize> {
    let mut sizes: Vec<usize> = traces
        .iter()
        .flat_map(|t| std::iter::once(t.input.elem_count()).chain(t.weight.as_ref().map(Tensor::elem_count)))
        .filter(|&n| n > 0)
        .collect();
    sizes.sort_unstable();
    sizes.dedup();
    if sizes.len() == 1 {
        sizes.insert(0, (sizes[0] / 2).max(1));
    }
    if sizes.len() <= 4 {
        return sizes;
    }
    let last = sizes.len() - 1;
    let mut spread: Vec<usize> = (0..4).map(|i| sizes[i * last / 3]).collect();
    spread.dedup();
    spread
}

/// The rank's cast model `t = a·numel + b`, fitted on the model's own tensor sizes.
pub fn profile_cast_model(
    device: &Device,
    traces: &[OpTrace],
    iterations: usize,
    slowdown: Slowdown,
) -> Result<CastModel, QsyncError> {
    let mut casts = RankCasts { casts: CandleCasts::new(device.clone()), slowdown };
    let config = ProfileConfig { warmup: 1, iterations: iterations.max(1), statistic: Statistic::Min };
    profile_casts(&mut casts, &cast_sizes(traces), &config)
}

/// The replayer's graph of the traced operators: one gradient bucket holding every
/// weight gradient, as `collective::RingSync` all-reduces them in one buffer after the
/// backward, taking `allreduce_ms`.
pub fn graph(traces: &[OpTrace], allreduce_ms: f64) -> TrainingGraph {
    TrainingGraph {
        ops: traces
            .iter()
            .map(|t| GraphOp {
                name: t.name.clone(),
                kind: t.kind,
                input: t.reads,
                input_numel: t.input.elem_count(),
                weight_numel: t.weight.as_ref().map_or(0, Tensor::elem_count),
                output_numel: t.output.elem_count(),
            })
            .collect(),
        buckets: vec![GradBucket { ops: (0..traces.len()).collect(), allreduce_ms }],
    }
}
