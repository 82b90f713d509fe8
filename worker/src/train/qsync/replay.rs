//! The replayer: a rank's iteration time for any precision plan, and the synchronous step
//! across ranks. QSync replays profiled traces as a dPRO graph (`Predictor/core.py`,
//! `cross_node_predict.py`); we replay the operator list the rank profiled:
//!
//! - Forward in graph order, each operator after its input: a cast of the input when its
//!   producer's output precision differs (an int8 operator outputs f32, a 16-bit one its own
//!   format), a cast of the f32 master weight to the operator's precision, then the
//!   operator's measured forward time.
//! - Backward in reverse order: the incoming gradient cast to the operator's backward
//!   precision when its consumers produced another (int8 operators run their backward at
//!   16 bits), the measured backward time, and the weight gradient cast back to f32 for the
//!   master weights and the all-reduce.
//! - Across ranks, QSync's `cross_communication`: gradient bucket k is all-reduced once every
//!   rank has produced it and bucket k − 1 is done, overlapping the rest of the backward.
//!   The step ends when the last bucket is reduced (or the slowest rank finishes) and each
//!   rank has run its optimizer step.
//!
//! Departures: one compute stream per rank, no CPU launch gaps (QSync adds measured
//! per-device gaps; our CPU ranks and candle's synchronous launches have none worth
//! modelling), and the all-reduce does not slow the backward it overlaps.

use tessera_api::precision::{CastModel, CostTable, OpKind, Precision};

use super::QsyncError;

/// One operator of the model as the replayer sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct GraphOp {
    /// The name in each rank's cost table.
    pub name: String,
    pub kind: OpKind,
    /// The operator whose output this one reads (an index before it); `None` when the input
    /// is f32 from outside the planned operators (the batch, a residual sum).
    pub input: Option<usize>,
    pub input_numel: usize,
    /// 0 for operators without a weight.
    pub weight_numel: usize,
    pub output_numel: usize,
}

/// A set of weight gradients all-reduced together.
#[derive(Debug, Clone, PartialEq)]
pub struct GradBucket {
    /// Indices of the operators whose weight gradients the bucket holds.
    pub ops: Vec<usize>,
    /// The bucket's all-reduce time across the ranks, measured, milliseconds.
    pub allreduce_ms: f64,
}

/// The operators of the job's model in forward order and its gradient buckets in the order
/// they are all-reduced.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainingGraph {
    pub ops: Vec<GraphOp>,
    pub buckets: Vec<GradBucket>,
}

impl TrainingGraph {
    /// Checks that inputs point backwards and buckets name real operators.
    pub fn validate(&self) -> Result<(), QsyncError> {
        for (i, op) in self.ops.iter().enumerate() {
            if let Some(input) = op.input {
                if input >= i {
                    return Err(QsyncError::InputOrder {
                        op: op.name.clone(),
                        input,
                    });
                }
            }
        }
        for (bucket, b) in self.buckets.iter().enumerate() {
            if let Some(&op) = b.ops.iter().find(|&&op| op >= self.ops.len()) {
                return Err(QsyncError::BucketOp {
                    bucket,
                    op,
                    ops: self.ops.len(),
                });
            }
        }
        Ok(())
    }
}

/// One rank's cost table and cast model resolved against the graph, ready to replay plans.
#[derive(Debug, Clone, PartialEq)]
pub struct RankProfile {
    pub device: String,
    /// `(forward_ms, backward_ms)` per operator, per precision in [`Precision::ALL`] order.
    times: Vec<[Option<(f64, f64)>; 4]>,
    /// `(ms_per_element, fixed_ms)` per (from, to).
    casts: [[Option<(f64, f64)>; 4]; 4],
    overhead_ms: f64,
    optimizer_ms: f64,
    casts_in_op_time: bool,
    int8_backward: Precision,
}

/// A rank's predicted iteration, milliseconds from its start.
#[derive(Debug, Clone, PartialEq)]
pub struct RankTimeline {
    pub forward_ms: f64,
    pub backward_ms: f64,
    /// Of forward and backward, the time spent casting.
    pub cast_ms: f64,
    /// When the backward ends: overhead + forward + backward.
    pub compute_ms: f64,
    pub optimizer_ms: f64,
    /// When each gradient bucket is ready on this rank.
    pub bucket_ready_ms: Vec<f64>,
}

/// One rank within a synchronous step.
#[derive(Debug, Clone, PartialEq)]
pub struct RankStep {
    pub compute_ms: f64,
    /// Idle time: waiting for slower ranks' gradients and the all-reduce.
    pub wait_ms: f64,
}

/// The predicted synchronous step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepPrediction {
    pub step_ms: f64,
    /// Sum of the buckets' all-reduce times.
    pub allreduce_ms: f64,
    /// How long the last all-reduce runs past the slowest rank's backward.
    pub tail_ms: f64,
    pub ranks: Vec<RankStep>,
}

fn index(p: Precision) -> usize {
    p as usize
}

impl RankProfile {
    /// `int8_backward` is the 16-bit format this rank's int8 operators run their backward in.
    pub fn new(
        graph: &TrainingGraph,
        table: &CostTable,
        casts: &CastModel,
        int8_backward: Precision,
    ) -> Result<RankProfile, QsyncError> {
        graph.validate()?;
        let times = graph
            .ops
            .iter()
            .map(|op| {
                let cost = table
                    .ops
                    .iter()
                    .find(|c| c.op == op.name)
                    .ok_or_else(|| QsyncError::MissingOp(op.name.clone()))?;
                let mut row = [None; 4];
                for t in &cost.timings {
                    row[index(t.precision)] = Some((t.forward_ms, t.backward_ms));
                }
                if row[index(Precision::F32)].is_none() {
                    return Err(QsyncError::NoF32(op.name.clone()));
                }
                Ok(row)
            })
            .collect::<Result<_, _>>()?;
        let mut cast_table = [[None; 4]; 4];
        for fit in &casts.fits {
            cast_table[index(fit.from)][index(fit.to)] = Some((fit.ms_per_element, fit.fixed_ms));
        }
        Ok(RankProfile {
            device: table.device.clone(),
            times,
            casts: cast_table,
            overhead_ms: table.overhead_ms,
            optimizer_ms: table.optimizer_ms,
            casts_in_op_time: table.casts_in_op_time,
            int8_backward,
        })
    }

    /// The precisions operator `op` was measured at, ascending.
    pub fn precisions(&self, op: usize) -> Vec<Precision> {
        Precision::ALL
            .into_iter()
            .filter(|&p| self.times[op][index(p)].is_some())
            .collect()
    }

    /// Measured forward + backward time of `op` at `precision`, without casts.
    pub fn op_ms(&self, op: usize, precision: Precision) -> Option<f64> {
        self.times[op][index(precision)].map(|(f, b)| f + b)
    }

    /// The rank's timeline under `plan` (one precision per graph operator).
    pub fn replay(
        &self,
        graph: &TrainingGraph,
        plan: &[Precision],
    ) -> Result<RankTimeline, QsyncError> {
        if plan.len() != graph.ops.len() || self.times.len() != graph.ops.len() {
            return Err(QsyncError::PlanLength {
                expected: graph.ops.len(),
                got: plan.len(),
            });
        }
        let timing = |i: usize| {
            self.times[i][index(plan[i])].ok_or_else(|| QsyncError::MissingTiming {
                op: graph.ops[i].name.clone(),
                precision: plan[i],
            })
        };
        let mut cast_ms = 0.0;
        let mut forward_ms = 0.0;
        for (i, op) in graph.ops.iter().enumerate() {
            let p = plan[i];
            if !self.casts_in_op_time {
                let produced = op
                    .input
                    .map_or(Precision::F32, |j| output_precision(plan[j]));
                cast_ms += self.cast(produced, p, op.input_numel)?;
                if op.weight_numel > 0 {
                    cast_ms += self.cast(Precision::F32, p, op.weight_numel)?;
                }
            }
            forward_ms += timing(i)?.0;
        }
        let forward_casts = cast_ms;

        // Each consumer hands back a gradient in its own backward precision; the loss hands
        // f32 to an operator no planned operator reads.
        let mut gradients: Vec<Vec<Precision>> = vec![Vec::new(); graph.ops.len()];
        for (j, op) in graph.ops.iter().enumerate() {
            if let Some(i) = op.input {
                gradients[i].push(self.backward_precision(plan[j]));
            }
        }
        let mut done = vec![0.0; graph.ops.len()];
        let mut clock = self.overhead_ms + forward_ms + forward_casts;
        let mut backward_ms = 0.0;
        for i in (0..graph.ops.len()).rev() {
            let op = &graph.ops[i];
            let bwd = self.backward_precision(plan[i]);
            if !self.casts_in_op_time {
                let sources: &[Precision] = if gradients[i].is_empty() {
                    &[Precision::F32]
                } else {
                    &gradients[i]
                };
                for &source in sources {
                    let t = self.cast(source, bwd, op.output_numel)?;
                    cast_ms += t;
                    clock += t;
                }
                if op.weight_numel > 0 {
                    let t = self.cast(bwd, Precision::F32, op.weight_numel)?;
                    cast_ms += t;
                    clock += t;
                }
            }
            let b = timing(i)?.1;
            backward_ms += b;
            clock += b;
            done[i] = clock;
        }
        let bucket_ready_ms = graph
            .buckets
            .iter()
            .map(|b| b.ops.iter().map(|&op| done[op]).fold(0.0, f64::max))
            .collect();
        Ok(RankTimeline {
            forward_ms,
            backward_ms,
            cast_ms,
            compute_ms: clock,
            optimizer_ms: self.optimizer_ms,
            bucket_ready_ms,
        })
    }

    fn backward_precision(&self, p: Precision) -> Precision {
        if p == Precision::Int8 {
            self.int8_backward
        } else {
            p
        }
    }

    fn cast(&self, from: Precision, to: Precision, numel: usize) -> Result<f64, QsyncError> {
        if from == to || numel == 0 {
            return Ok(0.0);
        }
        let (a, b) =
            self.casts[index(from)][index(to)].ok_or(QsyncError::MissingCast { from, to })?;
        Ok(a * numel as f64 + b)
    }
}

/// What an operator hands to its consumers: int8 operators dequantise to f32.
fn output_precision(p: Precision) -> Precision {
    if p == Precision::Int8 {
        Precision::F32
    } else {
        p
    }
}

/// The synchronous step of `ranks` (one timeline per rank, replayed on the same graph).
pub fn replay_step(graph: &TrainingGraph, ranks: &[RankTimeline]) -> StepPrediction {
    let mut comm_end: f64 = 0.0;
    let mut allreduce_ms = 0.0;
    for (k, bucket) in graph.buckets.iter().enumerate() {
        let ready = ranks
            .iter()
            .map(|r| r.bucket_ready_ms[k])
            .fold(0.0, f64::max);
        comm_end = comm_end.max(ready) + bucket.allreduce_ms;
        allreduce_ms += bucket.allreduce_ms;
    }
    let slowest = ranks.iter().map(|r| r.compute_ms).fold(0.0, f64::max);
    let step_ms = ranks
        .iter()
        .map(|r| r.compute_ms.max(comm_end) + r.optimizer_ms)
        .fold(0.0, f64::max);
    StepPrediction {
        step_ms,
        allreduce_ms,
        tail_ms: (comm_end - slowest).max(0.0),
        ranks: ranks
            .iter()
            .map(|r| RankStep {
                compute_ms: r.compute_ms,
                wait_ms: step_ms - r.compute_ms - r.optimizer_ms,
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_api::precision::{CastFit, OpCost, OpTiming};
    use Precision::*;

    fn op(name: &str, input: Option<usize>, weight: usize) -> GraphOp {
        GraphOp {
            name: name.into(),
            kind: OpKind::Linear,
            input,
            input_numel: 100,
            weight_numel: weight,
            output_numel: 200,
        }
    }

    /// Three chained linears; each measured at f32 (fwd 1, bwd 2 ms), bf16 (0.5, 1) and
    /// int8 (0.25, 0.5). Casts cost 0.001 ms per element + 0.1 ms, any pair.
    fn setup(buckets: Vec<GradBucket>) -> (TrainingGraph, RankProfile) {
        let graph = TrainingGraph {
            ops: vec![op("a", None, 50), op("b", Some(0), 50), op("c", Some(1), 0)],
            buckets,
        };
        let timings = vec![
            OpTiming {
                precision: F32,
                forward_ms: 1.0,
                backward_ms: 2.0,
            },
            OpTiming {
                precision: Bf16,
                forward_ms: 0.5,
                backward_ms: 1.0,
            },
            OpTiming {
                precision: Int8,
                forward_ms: 0.25,
                backward_ms: 0.5,
            },
        ];
        let table = CostTable {
            device: "cpu".into(),
            ops: ["a", "b", "c"]
                .iter()
                .map(|n| OpCost {
                    op: n.to_string(),
                    kind: OpKind::Linear,
                    timings: timings.clone(),
                })
                .collect(),
            overhead_ms: 0.5,
            optimizer_ms: 0.25,
            casts_in_op_time: false,
        };
        let mut fits = Vec::new();
        for from in Precision::ALL {
            for to in Precision::ALL {
                if from != to {
                    fits.push(CastFit {
                        from,
                        to,
                        ms_per_element: 0.001,
                        fixed_ms: 0.1,
                        r2: 1.0,
                        samples: 2,
                    });
                }
            }
        }
        let profile = RankProfile::new(&graph, &table, &CastModel { fits }, Bf16).unwrap();
        (graph, profile)
    }

    #[test]
    fn all_f32_replays_as_the_sum_of_measured_times() {
        let (graph, rank) = setup(vec![]);
        let t = rank.replay(&graph, &[F32, F32, F32]).unwrap();
        assert_eq!((t.forward_ms, t.backward_ms, t.cast_ms), (3.0, 6.0, 0.0));
        assert_eq!(t.compute_ms, 0.5 + 3.0 + 6.0);
    }

    #[test]
    fn mixed_plan_adds_casts_at_precision_boundaries() {
        let (graph, rank) = setup(vec![]);
        // a: int8, b: bf16, c: f32. Cast cost c(n) = 0.001·n + 0.1.
        // Forward: a quantises its f32 input (100 → 0.2) and weight (50 → 0.15); b reads a's
        // dequantised f32 output, casts it to bf16 (0.2) and its weight (0.15); c reads b's bf16
        // output → f32 (0.2); c has no weight. Forward casts 0.9, ops 0.25 + 0.5 + 1 = 1.75.
        // Backward: c gets f32 from the loss (no cast), runs 2. b gets c's f32 gradient → bf16
        // over its 200 outputs (0.3), runs 1, weight gradient bf16 → f32 (0.15). a (int8,
        // backward in bf16) gets b's bf16 gradient (no cast), runs 0.5, weight gradient → f32 (0.15).
        let t = rank.replay(&graph, &[Int8, Bf16, F32]).unwrap();
        assert!((t.forward_ms - 1.75).abs() < 1e-12);
        assert!((t.backward_ms - 3.5).abs() < 1e-12);
        assert!(
            (t.cast_ms - (0.9 + 0.3 + 0.15 + 0.15)).abs() < 1e-12,
            "{t:?}"
        );
        assert!((t.compute_ms - (0.5 + 1.75 + 3.5 + 1.5)).abs() < 1e-12);
    }

    #[test]
    fn an_output_read_twice_gets_a_gradient_cast_from_each_reader() {
        let (mut graph, rank) = setup(vec![]);
        // b and c both read a's output (as Q and K read one LayerNorm).
        graph.ops[2].input = Some(0);
        let t = rank.replay(&graph, &[F32, Bf16, Int8]).unwrap();
        // Forward: b casts a's f32 output (0.2) and its weight (0.15); c quantises a's output
        // (0.2), no weight. Backward: c and b each get f32 from the loss → bf16 (0.3 each),
        // b's weight gradient → f32 (0.15); a gets a bf16 gradient from b and one from c,
        // each cast to f32 (0.3 + 0.3).
        assert!(
            (t.cast_ms - (0.55 + 0.6 + 0.15 + 0.6)).abs() < 1e-12,
            "{t:?}"
        );
        assert!((t.compute_ms - (0.5 + 1.75 + 3.5 + 1.9)).abs() < 1e-12);
    }

    #[test]
    fn buckets_become_ready_as_the_backward_reaches_them() {
        let buckets = vec![
            GradBucket {
                ops: vec![1],
                allreduce_ms: 1.0,
            },
            GradBucket {
                ops: vec![0],
                allreduce_ms: 1.0,
            },
        ];
        let (graph, rank) = setup(buckets);
        let t = rank.replay(&graph, &[F32, F32, F32]).unwrap();
        // Backward starts at 0.5 + 3 = 3.5: c ends 5.5, b 7.5, a 9.5.
        assert_eq!(t.bucket_ready_ms, vec![7.5, 9.5]);
    }

    #[test]
    fn step_waits_for_the_slowest_rank_and_the_allreduce_tail() {
        let buckets = vec![
            GradBucket {
                ops: vec![1],
                allreduce_ms: 1.0,
            },
            GradBucket {
                ops: vec![0],
                allreduce_ms: 1.5,
            },
        ];
        let (graph, rank) = setup(buckets);
        let fast = rank.replay(&graph, &[Int8, Int8, Int8]).unwrap();
        let slow = rank.replay(&graph, &[F32, F32, F32]).unwrap();
        // Slow (f32): buckets ready 7.5 and 9.5, backward ends 9.5. Bucket 0 reduces 7.5–8.5,
        // bucket 1 9.5–11; every rank then runs its 0.25 ms optimizer: step 11.25.
        let step = replay_step(&graph, &[fast.clone(), slow.clone()]);
        assert_eq!(step.step_ms, 11.25);
        assert_eq!(step.allreduce_ms, 2.5);
        assert_eq!(step.tail_ms, 1.5);
        assert_eq!(step.ranks[1].wait_ms, 11.25 - 9.5 - 0.25);
        assert!(step.ranks[0].wait_ms > step.ranks[1].wait_ms);

        // A long first all-reduce delays the second past the slowest backward.
        let mut graph = graph;
        graph.buckets[0].allreduce_ms = 3.0;
        let step = replay_step(&graph, &[fast, slow]);
        // Bucket 0: 7.5–10.5; bucket 1 starts at max(10.5, 9.5) → ends 12; step 12.25.
        assert_eq!(step.step_ms, 12.25);
        assert_eq!(step.tail_ms, 2.5);
    }

    #[test]
    fn missing_measurements_are_named() {
        let (graph, rank) = setup(vec![]);
        let err = rank.replay(&graph, &[F16, F32, F32]).unwrap_err();
        assert!(
            matches!(err, QsyncError::MissingTiming { ref op, precision: F16 } if op == "a"),
            "{err}"
        );
        let err = rank.replay(&graph, &[F32]).unwrap_err();
        assert!(matches!(
            err,
            QsyncError::PlanLength {
                expected: 3,
                got: 1
            }
        ));

        let no_casts = RankProfile::new(
            &graph,
            &CostTable {
                device: "cpu".into(),
                ops: ["a", "b", "c"]
                    .iter()
                    .map(|n| OpCost {
                        op: n.to_string(),
                        kind: OpKind::Linear,
                        timings: vec![
                            OpTiming {
                                precision: F32,
                                forward_ms: 1.0,
                                backward_ms: 1.0,
                            },
                            OpTiming {
                                precision: Int8,
                                forward_ms: 1.0,
                                backward_ms: 1.0,
                            },
                        ],
                    })
                    .collect(),
                overhead_ms: 0.0,
                optimizer_ms: 0.0,
                casts_in_op_time: false,
            },
            &CastModel::default(),
            Bf16,
        )
        .unwrap();
        assert!(no_casts.replay(&graph, &[F32, F32, F32]).is_ok());
        let err = no_casts.replay(&graph, &[Int8, F32, F32]).unwrap_err();
        assert!(
            matches!(
                err,
                QsyncError::MissingCast {
                    from: F32,
                    to: Int8
                }
            ),
            "{err}"
        );

        let mut bad = graph.clone();
        bad.ops[0].input = Some(2);
        assert!(matches!(bad.validate(), Err(QsyncError::InputOrder { .. })));
    }
}
