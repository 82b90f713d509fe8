//! What a rank measures before planning (QSync profiles each device once per precision):
//! every operator of the job's model at every precision it can run, timed through
//! [`ProfiledOp`] so the real precision ops plug in, and the casts between precisions,
//! fitted to QSync's linear cast model `t = a·numel + b` by least squares
//! (`Predictor/casting_cost.py` fits the same line with `curve_fit`).

use std::collections::BTreeMap;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use tessera_api::precision::{CastFit, CastModel, CostTable, OpCost, OpKind, OpTiming, Precision};

use super::QsyncError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    Forward,
    Backward,
}

/// One operator of the job's model, on the job's real shapes, runnable at each precision it
/// supports. The harness runs each forward before the matching backward (other operators'
/// passes may come in between, as in an iteration), so the backward may use what the
/// forward saved.
pub trait ProfiledOp {
    fn name(&self) -> &str;
    fn kind(&self) -> OpKind;
    /// The precisions this rank can run the operator at; must include f32.
    fn precisions(&self) -> Vec<Precision>;
    /// Runs one pass and returns only once its result is computed (synchronise the device),
    /// so wall time is the operator's time.
    fn run(&mut self, precision: Precision, pass: Pass) -> candle_core::Result<()>;
}

/// How many times the harness runs each operator, and which figure of the timed runs it keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProfileConfig {
    /// Untimed runs first (caches, allocator, lazy initialisation).
    pub warmup: usize,
    /// Timed runs.
    pub iterations: usize,
    pub statistic: Statistic,
}

/// The figure kept of the timed runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Statistic {
    Median,
    /// The least disturbed run: for a device other processes share, where the median
    /// measures the neighbours as much as the operator.
    Min,
    /// The least disturbed round ([`profile_ops`]): every operator's times at a precision
    /// come from the one round of that precision whose recorded runs took least in total;
    /// for a single measured thing (a cast), its fastest run. A round is undisturbed only
    /// when all its operators are, as an iteration is, so on a shared host this predicts
    /// iterations better than `Min`, the sum of each operator's luckiest run, which came out
    /// low (by 6% in the median run on a noisy 2-core host, `bench/results/qsync_predictor.md`).
    FastestRound,
}

impl Statistic {
    /// The figure of `values`; 0 for none (nothing measured took no time).
    pub fn of(self, values: &mut [f64]) -> f64 {
        if values.is_empty() {
            return 0.0;
        }
        match self {
            Statistic::Median => median(values),
            Statistic::Min | Statistic::FastestRound => {
                values.iter().copied().fold(f64::INFINITY, f64::min)
            }
        }
    }
}

impl Default for ProfileConfig {
    fn default() -> Self {
        ProfileConfig {
            warmup: 2,
            iterations: 5,
            statistic: Statistic::Median,
        }
    }
}

/// Times every operator at every precision it supports: the rank's [`CostTable`], in the
/// order of `ops` (give them in the model's forward order). Overhead and optimizer time are
/// left at 0 for the caller, who measures them on the real loop.
///
/// Each operator is timed inside a pass over all of them, as a training iteration runs it,
/// not rerun alone. Rerun back to back, an operator finds its input and weights hot in
/// cache, while in an iteration they were last touched a whole forward earlier: the bf16
/// and int8 linears, whose GEMMs cast and repack their f32 operands, ran their backward a
/// quarter slower in an iteration than alone (f32 within 2%), and flushing the caches
/// before each run overshoots f32 instead (`bench/results/qsync_predictor.md`). So for
/// each precision `p`, one round runs every operator's forward in model order, each at the
/// lowest precision at or above `p` it supports (a uniform-`p` plan), then every backward
/// in reverse order, keeping what each forward produced until its backward; an operator's
/// times at `p` come from the rounds of `p`. The statistic is per operator over the rounds,
/// or picks one round per precision ([`Statistic::FastestRound`]).
///
/// The precisions take turns round by round (a round of each, then the next round of each),
/// so each precision's rounds spread over the whole profile: on a shared host a slow spell
/// of a second or two then slows a round of every precision, which the statistic drops,
/// rather than every round of one precision, which it cannot (one such spell once made
/// every bf16 operator a third slower than the runs beside it, and the plans' predictions
/// up to 24% off).
pub fn profile_ops(
    device: &str,
    ops: &mut [&mut dyn ProfiledOp],
    config: &ProfileConfig,
) -> Result<CostTable, QsyncError> {
    profile_ops_on(device, ops, config, &wall_clock())
}

/// [`profile_ops`] on the clock `now` (milliseconds since a fixed start): the tests' clock
/// is one their operators advance, so what the harness records is exact, not a sleep's
/// overshoot on a loaded host.
fn profile_ops_on(
    device: &str,
    ops: &mut [&mut dyn ProfiledOp],
    config: &ProfileConfig,
    now: &dyn Fn() -> f64,
) -> Result<CostTable, QsyncError> {
    let mut supported = Vec::with_capacity(ops.len());
    for op in ops.iter() {
        let mut precisions = op.precisions();
        precisions.sort();
        precisions.dedup();
        if !precisions.contains(&Precision::F32) {
            return Err(QsyncError::NoF32(op.name().to_string()));
        }
        supported.push(precisions);
    }
    let mut sweeps: Vec<Precision> = supported.iter().flatten().copied().collect();
    sweeps.sort();
    sweeps.dedup();
    // Per operator, per precision it supports: the timed forwards and backwards.
    let mut samples: Vec<Vec<(Vec<f64>, Vec<f64>)>> = supported
        .iter()
        .map(|p| vec![Default::default(); p.len()])
        .collect();
    // Per sweep, each operator at the lowest precision it supports at or above the sweep's;
    // f32 is always there. Only the operators running at the sweep's own precision are
    // recorded, so every (operator, precision) gets exactly `iterations` samples.
    let sweeps: Vec<(Precision, Vec<usize>)> = sweeps
        .into_iter()
        .map(|sweep| {
            let ran_at = supported
                .iter()
                .map(|p| {
                    p.iter()
                        .position(|&q| q >= sweep)
                        .expect("f32 is supported")
                })
                .collect();
            (sweep, ran_at)
        })
        .collect();
    let iterations = config.iterations.max(1);
    for round in 0..config.warmup + iterations {
        let timed_round = round >= config.warmup;
        for &(sweep, ref ran_at) in &sweeps {
            for (i, op) in ops.iter_mut().enumerate() {
                let precision = supported[i][ran_at[i]];
                let ms = timed(now, || op.run(precision, Pass::Forward))
                    .map_err(|source| op_error(&**op, precision, source))?;
                if timed_round && precision == sweep {
                    samples[i][ran_at[i]].0.push(ms);
                }
            }
            for (i, op) in ops.iter_mut().enumerate().rev() {
                let precision = supported[i][ran_at[i]];
                let ms = timed(now, || op.run(precision, Pass::Backward))
                    .map_err(|source| op_error(&**op, precision, source))?;
                if timed_round && precision == sweep {
                    samples[i][ran_at[i]].1.push(ms);
                }
            }
        }
    }
    let fastest = match config.statistic {
        Statistic::FastestRound => fastest_rounds(&supported, &samples, iterations),
        Statistic::Median | Statistic::Min => BTreeMap::new(),
    };
    let ops = ops
        .iter()
        .zip(supported)
        .zip(samples)
        .map(|((op, precisions), samples)| OpCost {
            op: op.name().to_string(),
            kind: op.kind(),
            timings: precisions
                .into_iter()
                .zip(samples)
                .map(
                    |(precision, (mut forward, mut backward))| match fastest.get(&precision) {
                        Some(&round) => OpTiming {
                            precision,
                            forward_ms: forward[round],
                            backward_ms: backward[round],
                        },
                        None => OpTiming {
                            precision,
                            forward_ms: config.statistic.of(&mut forward),
                            backward_ms: config.statistic.of(&mut backward),
                        },
                    },
                )
                .collect(),
        })
        .collect();
    Ok(CostTable {
        device: device.to_string(),
        ops,
        overhead_ms: 0.0,
        optimizer_ms: 0.0,
        casts_in_op_time: false,
    })
}

/// Per precision, the timed round whose recorded runs (every operator's forward and
/// backward at that precision) took least in total.
fn fastest_rounds(
    supported: &[Vec<Precision>],
    samples: &[Vec<(Vec<f64>, Vec<f64>)>],
    rounds: usize,
) -> BTreeMap<Precision, usize> {
    let mut totals: BTreeMap<Precision, Vec<f64>> = BTreeMap::new();
    for (precisions, samples) in supported.iter().zip(samples) {
        for (&precision, (forward, backward)) in precisions.iter().zip(samples) {
            let total = totals.entry(precision).or_insert_with(|| vec![0.0; rounds]);
            for (total, ms) in total.iter_mut().zip(forward.iter().zip(backward)) {
                *total += ms.0 + ms.1;
            }
        }
    }
    totals
        .into_iter()
        .map(|(precision, total)| {
            let fastest = (0..rounds).min_by(|&a, &b| total[a].total_cmp(&total[b]));
            (precision, fastest.unwrap_or(0))
        })
        .collect()
}

fn op_error(op: &dyn ProfiledOp, precision: Precision, source: candle_core::Error) -> QsyncError {
    QsyncError::Op {
        op: op.name().to_string(),
        precision,
        source,
    }
}

/// Casting a tensor between precisions on one device, for [`profile_casts`].
pub trait ProfiledCast {
    /// The pairs this device can cast.
    fn pairs(&self) -> Vec<(Precision, Precision)>;
    /// Makes a tensor of `numel` elements in `from` to cast next (not timed).
    fn prepare(&mut self, from: Precision, to: Precision, numel: usize) -> candle_core::Result<()>;
    /// Casts the prepared tensor and returns once the result is computed (timed).
    fn cast(&mut self) -> candle_core::Result<()>;
}

/// Times every pair of `caster` at each size and fits `t = a·numel + b` per pair.
pub fn profile_casts(
    caster: &mut dyn ProfiledCast,
    sizes: &[usize],
    config: &ProfileConfig,
) -> Result<CastModel, QsyncError> {
    fit_cast_model(&measure_casts(caster, sizes, config)?)
}

/// The samples [`profile_casts`] fits: `(from, to, numel, ms)` for every pair and size.
pub fn measure_casts(
    caster: &mut dyn ProfiledCast,
    sizes: &[usize],
    config: &ProfileConfig,
) -> Result<Vec<(Precision, Precision, usize, f64)>, QsyncError> {
    let (mut samples, now) = (Vec::new(), wall_clock());
    for (from, to) in caster.pairs() {
        let fail = |source| QsyncError::Op {
            op: format!("cast {from}->{to}"),
            precision: to,
            source,
        };
        for &numel in sizes {
            caster.prepare(from, to, numel).map_err(fail)?;
            for _ in 0..config.warmup {
                caster.cast().map_err(fail)?;
            }
            let mut times = Vec::with_capacity(config.iterations);
            for _ in 0..config.iterations.max(1) {
                times.push(timed(&now, || caster.cast()).map_err(fail)?);
            }
            samples.push((from, to, numel, config.statistic.of(&mut times)));
        }
    }
    Ok(samples)
}

/// Fits one cast per (from, to) pair from measured `(from, to, numel, ms)` samples.
pub fn fit_cast_model(
    samples: &[(Precision, Precision, usize, f64)],
) -> Result<CastModel, QsyncError> {
    let mut pairs: Vec<(Precision, Precision)> = samples.iter().map(|s| (s.0, s.1)).collect();
    pairs.sort();
    pairs.dedup();
    let fits = pairs
        .into_iter()
        .map(|(from, to)| {
            let points: Vec<(f64, f64)> = samples
                .iter()
                .filter(|s| (s.0, s.1) == (from, to))
                .map(|s| (s.2 as f64, s.3))
                .collect();
            cast_fit(from, to, &points)
        })
        .collect::<Result<_, _>>()?;
    Ok(CastModel { fits })
}

fn cast_fit(from: Precision, to: Precision, points: &[(f64, f64)]) -> Result<CastFit, QsyncError> {
    let fit = LinearFit::fit(points)?;
    Ok(CastFit {
        from,
        to,
        ms_per_element: fit.slope,
        fixed_ms: fit.intercept,
        r2: fit.r2,
        samples: points.len() as u32,
    })
}

/// An ordinary least-squares line `y = slope·x + intercept` with its R².
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinearFit {
    pub slope: f64,
    pub intercept: f64,
    /// 1 − SS_res/SS_tot; 1 for a perfect fit (also when every y is equal and matched).
    pub r2: f64,
}

impl LinearFit {
    pub fn fit(points: &[(f64, f64)]) -> Result<LinearFit, QsyncError> {
        let n = points.len() as f64;
        let mean_x = points.iter().map(|p| p.0).sum::<f64>() / n;
        let mean_y = points.iter().map(|p| p.1).sum::<f64>() / n;
        let sxx: f64 = points.iter().map(|p| (p.0 - mean_x).powi(2)).sum();
        if points.len() < 2 || sxx <= 0.0 {
            return Err(QsyncError::TooFewSamples(points.len()));
        }
        let sxy: f64 = points.iter().map(|p| (p.0 - mean_x) * (p.1 - mean_y)).sum();
        let slope = sxy / sxx;
        let intercept = mean_y - slope * mean_x;
        let ss_res: f64 = points
            .iter()
            .map(|p| (p.1 - slope * p.0 - intercept).powi(2))
            .sum();
        let ss_tot: f64 = points.iter().map(|p| (p.1 - mean_y).powi(2)).sum();
        let r2 = if ss_tot > 0.0 {
            1.0 - ss_res / ss_tot
        } else if ss_res <= f64::EPSILON {
            1.0
        } else {
            0.0
        };
        Ok(LinearFit {
            slope,
            intercept,
            r2,
        })
    }

    pub fn at(&self, x: f64) -> f64 {
        self.slope * x + self.intercept
    }
}

/// Casts between f32, bf16 and f16 with candle's `to_dtype` on one device. candle has no
/// int8 dtype: the int8 quantise/dequantise casts come from the int8 op's own code.
pub struct CandleCasts {
    device: Device,
    prepared: Option<(Tensor, DType)>,
}

impl CandleCasts {
    pub fn new(device: Device) -> CandleCasts {
        CandleCasts {
            device,
            prepared: None,
        }
    }
}

fn float_dtype(p: Precision) -> candle_core::Result<DType> {
    match p {
        Precision::F32 => Ok(DType::F32),
        Precision::Bf16 => Ok(DType::BF16),
        Precision::F16 => Ok(DType::F16),
        Precision::Int8 => Err(candle_core::Error::Msg("candle has no int8 dtype".into())),
    }
}

impl ProfiledCast for CandleCasts {
    fn pairs(&self) -> Vec<(Precision, Precision)> {
        use Precision::*;
        vec![(F32, Bf16), (Bf16, F32), (F32, F16), (F16, F32)]
    }

    fn prepare(&mut self, from: Precision, to: Precision, numel: usize) -> candle_core::Result<()> {
        let source =
            Tensor::rand(-1f32, 1f32, numel, &self.device)?.to_dtype(float_dtype(from)?)?;
        self.prepared = Some((source, float_dtype(to)?));
        Ok(())
    }

    fn cast(&mut self) -> candle_core::Result<()> {
        let (source, to) = self
            .prepared
            .as_ref()
            .ok_or_else(|| candle_core::Error::Msg("cast before prepare".into()))?;
        let cast = source.to_dtype(*to)?;
        self.device.synchronize()?;
        drop(cast);
        Ok(())
    }
}

/// Milliseconds since the call.
fn wall_clock() -> impl Fn() -> f64 {
    let start = Instant::now();
    move || start.elapsed().as_secs_f64() * 1e3
}

/// How long `run` took by the clock `now`, in milliseconds.
fn timed(now: &dyn Fn() -> f64, run: impl FnOnce() -> candle_core::Result<()>) -> candle_core::Result<f64> {
    let start = now();
    run()?;
    Ok(now() - start)
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 96×96 matmul: candle's GEMM at f32, a naive triple loop standing in for a second
    /// precision (`Int8`), and a backward that really runs too (the transposed products).
    struct MatmulOp {
        a: Tensor,
        b: Tensor,
        a_host: Vec<f32>,
        b_host: Vec<f32>,
        n: usize,
        runs: usize,
    }

    impl MatmulOp {
        fn new(n: usize) -> MatmulOp {
            let a = Tensor::rand(-1f32, 1f32, (n, n), &Device::Cpu).unwrap();
            let b = Tensor::rand(-1f32, 1f32, (n, n), &Device::Cpu).unwrap();
            let a_host = a.flatten_all().unwrap().to_vec1().unwrap();
            let b_host = b.flatten_all().unwrap().to_vec1().unwrap();
            MatmulOp {
                a,
                b,
                a_host,
                b_host,
                n,
                runs: 0,
            }
        }

        fn naive(&self) -> Vec<f32> {
            let n = self.n;
            let mut c = vec![0f32; n * n];
            for i in 0..n {
                for j in 0..n {
                    let mut acc = 0f32;
                    for k in 0..n {
                        acc += self.a_host[i * n + k] * self.b_host[k * n + j];
                    }
                    c[i * n + j] = acc;
                }
            }
            c
        }
    }

    impl ProfiledOp for MatmulOp {
        fn name(&self) -> &str {
            "matmul"
        }
        fn kind(&self) -> OpKind {
            OpKind::Linear
        }
        fn precisions(&self) -> Vec<Precision> {
            vec![Precision::F32, Precision::Int8]
        }
        fn run(&mut self, precision: Precision, pass: Pass) -> candle_core::Result<()> {
            self.runs += 1;
            match (precision, pass) {
                (Precision::F32, Pass::Forward) => {
                    std::hint::black_box(self.a.matmul(&self.b)?);
                }
                (Precision::F32, Pass::Backward) => {
                    std::hint::black_box(self.a.t()?.matmul(&self.b)?);
                    std::hint::black_box(self.a.matmul(&self.b.t()?)?);
                }
                (_, Pass::Forward) => {
                    std::hint::black_box(self.naive());
                }
                (_, Pass::Backward) => {
                    std::hint::black_box(self.naive());
                    std::hint::black_box(self.naive());
                }
            }
            Ok(())
        }
    }

    #[test]
    fn harness_times_a_real_op_at_each_precision() {
        let mut op = MatmulOp::new(96);
        // The least disturbed of 9 runs: the test suite shares the cores with other tests.
        let config = ProfileConfig {
            warmup: 1,
            iterations: 9,
            statistic: Statistic::Min,
        };
        let table = profile_ops("cpu", &mut [&mut op], &config).unwrap();
        assert_eq!(op.runs, 2 * (1 + 9) * 2);
        assert_eq!(table.ops.len(), 1);
        let timings = &table.ops[0].timings;
        assert_eq!(
            timings.iter().map(|t| t.precision).collect::<Vec<_>>(),
            [Precision::Int8, Precision::F32]
        );
        let (naive, gemm) = (timings[0], timings[1]);
        assert!(gemm.forward_ms > 0.0 && gemm.backward_ms > 0.0);
        // 96³ scalar FMAs in a dependent chain against a blocked SIMD GEMM: the loop is the
        // slower by far, which the harness must see.
        assert!(
            naive.forward_ms > 2.0 * gemm.forward_ms,
            "{naive:?} vs {gemm:?}"
        );
        assert!(
            naive.backward_ms > naive.forward_ms,
            "two products take longer than one: {naive:?}"
        );
    }

    /// A clock the test operators advance by the time they say they took, so the harness
    /// records those times exactly (sleeps overshoot on a loaded host).
    type FakeClock = std::rc::Rc<std::cell::Cell<f64>>;

    fn advance(clock: &FakeClock, ms: u64) {
        clock.set(clock.get() + ms as f64);
    }

    /// An operator that records every run in a log the model's operators share, and
    /// takes a time set per precision and pass, so the table shows which runs were kept.
    struct LoggedOp {
        name: &'static str,
        precisions: Vec<Precision>,
        log: std::rc::Rc<std::cell::RefCell<Vec<(&'static str, Precision, Pass)>>>,
        clock: FakeClock,
    }

    impl ProfiledOp for LoggedOp {
        fn name(&self) -> &str {
            self.name
        }
        fn kind(&self) -> OpKind {
            OpKind::Linear
        }
        fn precisions(&self) -> Vec<Precision> {
            self.precisions.clone()
        }
        fn run(&mut self, precision: Precision, pass: Pass) -> candle_core::Result<()> {
            self.log.borrow_mut().push((self.name, precision, pass));
            // 2 ms at int8, 4 at bf16, 8 at f32; a backward twice its forward.
            let ms = match precision {
                Precision::Int8 => 2,
                Precision::Bf16 | Precision::F16 => 4,
                Precision::F32 => 8,
            } * if pass == Pass::Backward { 2 } else { 1 };
            advance(&self.clock, ms);
            Ok(())
        }
    }

    /// Operators are timed inside iteration-like rounds, not rerun alone: per precision,
    /// every forward in model order at the precision nearest it, then every backward in
    /// reverse; the precisions take turns round by round; each (operator, precision) keeps
    /// the runs of its own precision's rounds.
    #[test]
    fn harness_times_operators_inside_iteration_ordered_rounds() {
        use Precision::*;
        let (log, clock) = (std::rc::Rc::new(std::cell::RefCell::new(Vec::new())), FakeClock::default());
        let op = |name, precisions: &[Precision]| LoggedOp {
            name,
            precisions: precisions.to_vec(),
            log: log.clone(),
            clock: clock.clone(),
        };
        let (mut a, mut b, mut c) = (
            op("a", &[F32, Int8, Bf16]),
            op("b", &[F32]),
            op("c", &[Bf16, F32]),
        );
        let config = ProfileConfig {
            warmup: 1,
            iterations: 3,
            statistic: Statistic::Min,
        };
        let table = profile_ops_on("cpu", &mut [&mut a, &mut b, &mut c], &config, &|| clock.get()).unwrap();

        // Four rounds, each a sweep of int8, then bf16, then f32; a sweep is six runs.
        let log = log.borrow();
        assert_eq!(log.len(), 4 * 3 * 6);
        for (sweep, (pa, pc)) in [(Int8, Bf16), (Bf16, Bf16), (F32, F32)]
            .into_iter()
            .enumerate()
        {
            let round = [
                ("a", pa, Pass::Forward),
                ("b", F32, Pass::Forward),
                ("c", pc, Pass::Forward),
                ("c", pc, Pass::Backward),
                ("b", F32, Pass::Backward),
                ("a", pa, Pass::Backward),
            ];
            for r in 0..4 {
                let start = (r * 3 + sweep) * 6;
                assert_eq!(
                    &log[start..start + 6],
                    &round[..],
                    "sweep {sweep}, round {r}"
                );
            }
        }

        let timing = |op: usize, p: Precision| {
            *table.ops[op]
                .timings
                .iter()
                .find(|t| t.precision == p)
                .unwrap()
        };
        assert_eq!(
            table.ops.iter().map(|o| o.op.as_str()).collect::<Vec<_>>(),
            ["a", "b", "c"]
        );
        assert_eq!(table.ops[0].timings.len(), 3);
        assert_eq!(table.ops[2].timings.len(), 2);
        // Each figure comes from its own precision's runs: a run at another precision kept by
        // mistake would give another time.
        for (op, p, forward) in [
            (0, Int8, 2.0),
            (0, Bf16, 4.0),
            (0, F32, 8.0),
            (1, F32, 8.0),
            (2, Bf16, 4.0),
            (2, F32, 8.0),
        ] {
            let t = timing(op, p);
            assert_eq!((t.forward_ms, t.backward_ms), (forward, 2.0 * forward), "{op} {p}");
        }
    }

    /// An f32 operator whose forwards take the given milliseconds in turn (backwards: 0).
    struct ScriptedOp {
        name: &'static str,
        forward_ms: std::vec::IntoIter<u64>,
        clock: FakeClock,
    }

    impl ProfiledOp for ScriptedOp {
        fn name(&self) -> &str {
            self.name
        }
        fn kind(&self) -> OpKind {
            OpKind::Linear
        }
        fn precisions(&self) -> Vec<Precision> {
            vec![Precision::F32]
        }
        fn run(&mut self, _: Precision, pass: Pass) -> candle_core::Result<()> {
            if pass == Pass::Forward {
                let ms = self.forward_ms.next().expect("a time per round");
                advance(&self.clock, ms);
            }
            Ok(())
        }
    }

    /// `Min` adds each operator's luckiest run, though no round had both; `FastestRound`
    /// keeps the round that was fastest as a whole, as an iteration's time is.
    #[test]
    fn fastest_round_keeps_one_whole_round() {
        let profile = |statistic| {
            let clock = FakeClock::default();
            let mut a = ScriptedOp {
                name: "a",
                forward_ms: vec![1, 20, 6].into_iter(),
                clock: clock.clone(),
            };
            let mut b = ScriptedOp {
                name: "b",
                forward_ms: vec![20, 1, 6].into_iter(),
                clock: clock.clone(),
            };
            let config = ProfileConfig {
                warmup: 0,
                iterations: 3,
                statistic,
            };
            let table = profile_ops_on("cpu", &mut [&mut a, &mut b], &config, &|| clock.get()).unwrap();
            table
                .ops
                .iter()
                .map(|op| op.timings[0].forward_ms)
                .collect::<Vec<_>>()
        };
        // The rounds' totals are 21, 21 and 12 ms.
        assert_eq!(profile(Statistic::Min), [1.0, 1.0]);
        assert_eq!(profile(Statistic::FastestRound), [6.0, 6.0]);
    }

    #[test]
    fn harness_refuses_an_op_without_f32() {
        struct OnlyInt8;
        impl ProfiledOp for OnlyInt8 {
            fn name(&self) -> &str {
                "q"
            }
            fn kind(&self) -> OpKind {
                OpKind::Linear
            }
            fn precisions(&self) -> Vec<Precision> {
                vec![Precision::Int8]
            }
            fn run(&mut self, _: Precision, _: Pass) -> candle_core::Result<()> {
                Ok(())
            }
        }
        let err = profile_ops("cpu", &mut [&mut OnlyInt8], &ProfileConfig::default()).unwrap_err();
        assert!(
            matches!(err, QsyncError::NoF32(ref op) if op == "q"),
            "{err}"
        );
    }

    #[test]
    fn least_squares_recovers_a_line_and_reports_fit_quality() {
        let exact: Vec<(f64, f64)> = [1e3, 1e4, 1e5, 1e6]
            .iter()
            .map(|&x| (x, 2.5e-7 * x + 0.01))
            .collect();
        let fit = LinearFit::fit(&exact).unwrap();
        assert!((fit.slope - 2.5e-7).abs() < 1e-15 && (fit.intercept - 0.01).abs() < 1e-9);
        assert!((fit.r2 - 1.0).abs() < 1e-12);
        assert!((fit.at(2e6) - 0.51).abs() < 1e-9);

        // Four points off any line, solved by hand: x̄ = ȳ = 1.5, Sxx = 5, Sxy = 3.
        let noisy = [(0.0, 1.0), (1.0, 0.0), (2.0, 3.0), (3.0, 2.0)];
        let fit = LinearFit::fit(&noisy).unwrap();
        assert!((fit.slope - 0.6).abs() < 1e-12 && (fit.intercept - 0.6).abs() < 1e-12);
        // Residuals 0.4, −1.2, 1.2, −0.4 → SS_res 3.2; SS_tot 5 → R² 0.36.
        assert!((fit.r2 - 0.36).abs() < 1e-12);

        assert!(matches!(
            LinearFit::fit(&[(1.0, 2.0)]),
            Err(QsyncError::TooFewSamples(1))
        ));
        assert!(matches!(
            LinearFit::fit(&[(1.0, 2.0), (1.0, 3.0)]),
            Err(QsyncError::TooFewSamples(2))
        ));
    }

    #[test]
    fn cast_model_fits_each_pair_from_samples() {
        use Precision::*;
        let mut samples = Vec::new();
        for numel in [1_000usize, 10_000, 100_000] {
            samples.push((F32, Bf16, numel, 1e-6 * numel as f64 + 0.002));
            samples.push((F32, Int8, numel, 3e-6 * numel as f64 + 0.010));
        }
        let model = fit_cast_model(&samples).unwrap();
        assert_eq!(model.fits.len(), 2);
        let int8 = model.fits.iter().find(|f| f.to == Int8).unwrap();
        assert!((int8.ms_per_element - 3e-6).abs() < 1e-15 && (int8.fixed_ms - 0.010).abs() < 1e-9);
        assert_eq!(int8.samples, 3);
        assert!(int8.r2 > 0.999_999);
    }

    #[test]
    fn candle_casts_profile_and_fit_every_float_pair() {
        let mut casts = CandleCasts::new(Device::Cpu);
        let config = ProfileConfig {
            warmup: 1,
            iterations: 3,
            statistic: Statistic::Min,
        };
        let model = profile_casts(&mut casts, &[4_096, 65_536, 262_144], &config).unwrap();
        assert_eq!(model.fits.len(), 4);
        for fit in &model.fits {
            assert_eq!(fit.samples, 3);
            assert!(
                fit.ms_per_element.is_finite() && fit.r2.is_finite(),
                "{fit:?}"
            );
        }
    }
}
