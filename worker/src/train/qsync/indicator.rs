//! QSync's gradient-variance indicator ("GVAR", `Predictor/indicator.py` of the authors'
//! code): how much variance running an operator at a lower precision adds to the
//! gradient, estimated from the operator's real input, weight and weight gradient, and
//! weighted by depth: ω = γ·(L − d)·fwd + d·bwd (forward noise passes through the L − d
//! operators after it, backward noise through the d before it; γ = 4 as the authors run it).
//!
//! For an operator with a weight (Linear, Embedding), with D the element counts, S = amax/127
//! the per-tensor int8 scales, ‖·‖ plain L2 norms and e the capped exponents below:
//! - int8: fwd = (‖W‖·S_v²·D_v + ‖V‖·S_w²·D_w)/6, bwd = (‖g_W‖·S_v²·D_v + ‖V‖·2^(2e_v)·2^(−2k)·D_o)/6
//! - 16-bit: fwd = 2^(−2k)·(‖W‖·D_v·e_v + ‖V‖·D_w·e_w)/6, bwd = 2^(−2k)·(‖g_W‖·D_v·e_v + ‖V‖·D_o·e_g)/6
//! - f32: 0.
//!
//! Single-input operators (LayerNorm, activations) have no backward term: int8 S_v·D_v/6,
//! 16-bit 2^(4e_v)·2^(−4k)·D_v.
//!
//! Departures from the released code: k is the format's mantissa bits − 1 (9 for f16 as
//! the authors hard-code, 6 for bf16, which their GPUs did not use); the int8 backward term
//! uses the k of the 16-bit format our int8 backward runs in ([`IndicatorConfig`]); the
//! single-input branch computes e_v as the weighted branch does (the released code reads it
//! before setting it); the weight gradient is required (the code falls back to 1).
//!
//! The 16-bit terms grow with the exponent e linearly while the int8 terms grow with the
//! squared scale, so the formulas do not order int8 against 16 bits: with bf16's k a bf16
//! operator can score above int8. The allocator therefore may raise an operator past a
//! level (int8 straight to f32).

use candle_core::{DType, Tensor};
use tessera_api::precision::Precision;

use super::QsyncError;
use crate::train::rng::Rng;

/// The indicator's constants.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IndicatorConfig {
    /// Weight of forward noise against backward noise (the authors' `gamma=4`).
    pub gamma: f64,
    /// The format an int8 operator's backward runs in (bf16 or f16 as QSync's ops do).
    pub int8_backward: Precision,
}

impl Default for IndicatorConfig {
    fn default() -> Self {
        IndicatorConfig {
            gamma: 4.0,
            int8_backward: Precision::Bf16,
        }
    }
}

/// The statistics of one operator that the indicator reads, taken from one profiled step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OpStats {
    Weighted {
        /// Element counts of input, weight, output.
        d_v: f64,
        d_w: f64,
        d_o: f64,
        /// int8 scales amax/127.
        s_v: f64,
        s_w: f64,
        norm_v: f64,
        norm_w: f64,
        norm_g: f64,
        /// |frexp exponent| of f16(√(‖V‖/D_v)), f16(√(‖W‖/D_w)) and f16(max|g_W|), capped at 5.
        e_v: f64,
        e_w: f64,
        e_g: f64,
    },
    SingleInput {
        d_v: f64,
        s_v: f64,
        e_v: f64,
    },
}

/// The released code caps every exponent at f16's exponent width.
const EXPONENT_CAP: i32 = 5;

impl OpStats {
    /// An operator with a weight. For an embedding pass the gathered rows as `input`.
    pub fn weighted(
        input: &[f32],
        weight: &[f32],
        weight_grad: &[f32],
        output_numel: usize,
    ) -> OpStats {
        let (norm_v, amax_v) = norm_and_amax(input);
        let (norm_w, amax_w) = norm_and_amax(weight);
        let (norm_g, amax_g) = norm_and_amax(weight_grad);
        let d_v = input.len() as f64;
        let d_w = weight.len() as f64;
        OpStats::Weighted {
            d_v,
            d_w,
            d_o: output_numel as f64,
            s_v: amax_v / 127.0,
            s_w: amax_w / 127.0,
            norm_v,
            norm_w,
            norm_g,
            e_v: capped_exponent(mean_magnitude(norm_v, d_v)),
            e_w: capped_exponent(mean_magnitude(norm_w, d_w)),
            e_g: capped_exponent(amax_g),
        }
    }

    /// An operator with one input and no weight the indicator looks at.
    pub fn single_input(input: &[f32]) -> OpStats {
        let (norm_v, amax_v) = norm_and_amax(input);
        let d_v = input.len() as f64;
        OpStats::SingleInput {
            d_v,
            s_v: amax_v / 127.0,
            e_v: capped_exponent(mean_magnitude(norm_v, d_v)),
        }
    }

    /// [`OpStats::weighted`] from candle tensors of any float dtype and device.
    pub fn weighted_tensors(
        input: &Tensor,
        weight: &Tensor,
        weight_grad: &Tensor,
        output: &Tensor,
    ) -> Result<OpStats, QsyncError> {
        Ok(OpStats::weighted(
            &host_f32(input)?,
            &host_f32(weight)?,
            &host_f32(weight_grad)?,
            output.elem_count(),
        ))
    }

    /// [`OpStats::single_input`] from a candle tensor.
    pub fn single_input_tensor(input: &Tensor) -> Result<OpStats, QsyncError> {
        Ok(OpStats::single_input(&host_f32(input)?))
    }

    /// The forward and backward variance terms at `precision`, before depth weighting.
    pub fn variance(&self, precision: Precision, config: &IndicatorConfig) -> (f64, f64) {
        match precision {
            // The reference: no added variance.
            Precision::F32 => (0.0, 0.0),
            Precision::Int8 => self.int8_variance(config),
            Precision::Bf16 | Precision::F16 => self.half_variance(mantissa_k(precision)),
        }
    }

    fn half_variance(&self, k: i32) -> (f64, f64) {
        let eps2 = 2f64.powi(-2 * k);
        match *self {
            OpStats::Weighted {
                d_v,
                d_w,
                d_o,
                norm_v,
                norm_w,
                norm_g,
                e_v,
                e_w,
                e_g,
                ..
            } => (
                eps2 * (norm_w * d_v * e_v + norm_v * d_w * e_w) / 6.0,
                eps2 * (norm_g * d_v * e_v + norm_v * d_o * e_g) / 6.0,
            ),
            OpStats::SingleInput { d_v, e_v, .. } => {
                (2f64.powf(4.0 * e_v) * eps2 * eps2 * d_v, 0.0)
            }
        }
    }

    fn int8_variance(&self, config: &IndicatorConfig) -> (f64, f64) {
        match *self {
            OpStats::Weighted {
                d_v,
                d_w,
                d_o,
                s_v,
                s_w,
                norm_v,
                norm_w,
                norm_g,
                e_v,
                ..
            } => {
                let k = mantissa_k(config.int8_backward);
                (
                    (norm_w * s_v * s_v * d_v + norm_v * s_w * s_w * d_w) / 6.0,
                    (norm_g * s_v * s_v * d_v
                        + norm_v * 2f64.powf(2.0 * e_v) * 2f64.powi(-2 * k) * d_o)
                        / 6.0,
                )
            }
            OpStats::SingleInput { d_v, s_v, .. } => (s_v * d_v / 6.0, 0.0),
        }
    }

    /// ω at `precision` for the operator at `depth` (1-based) in a model of `model_depth`.
    pub fn omega(
        &self,
        precision: Precision,
        depth: usize,
        model_depth: usize,
        config: &IndicatorConfig,
    ) -> f64 {
        let (fwd, bwd) = self.variance(precision, config);
        let after = model_depth.saturating_sub(depth) as f64;
        config.gamma * after * fwd + depth as f64 * bwd
    }
}

/// ω of every operator at every precision, in the graph's operator order.
#[derive(Debug, Clone, PartialEq)]
pub struct Indicators {
    /// Indexed by operator, then by precision in [`Precision::ALL`] order.
    values: Vec<[f64; 4]>,
}

impl Indicators {
    /// The gradient-variance indicator of each operator; `depths[i]` is operator i's
    /// 1-based depth in the forward graph of `model_depth` operators.
    pub fn gradient_variance(
        stats: &[OpStats],
        depths: &[usize],
        model_depth: usize,
        config: &IndicatorConfig,
    ) -> Result<Indicators, QsyncError> {
        if depths.len() != stats.len() {
            return Err(QsyncError::IndicatorLength {
                expected: stats.len(),
                got: depths.len(),
            });
        }
        let values = stats
            .iter()
            .zip(depths)
            .map(|(s, &d)| Precision::ALL.map(|p| s.omega(p, d, model_depth, config)))
            .collect();
        Ok(Indicators { values })
    }

    /// Values given directly (a stored plan, tests), indexed like [`Indicators::value`].
    pub fn from_values(values: Vec<[f64; 4]>) -> Indicators {
        Indicators { values }
    }

    pub fn len(&self) -> usize {
        self.values.len()
    }

    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    pub fn value(&self, op: usize, precision: Precision) -> f64 {
        self.values[op][precision_index(precision)]
    }

    /// The random-indicator ablation (the authors' `--random`): the same per-operator rows
    /// shuffled across operators, so the search sees a real indicator's magnitudes and
    /// ordering over precisions but not which operator they belong to.
    pub fn shuffled(&self, seed: u64) -> Indicators {
        let mut values = self.values.clone();
        Rng::derive(seed, "qsync-random-indicator").shuffle(&mut values);
        Indicators { values }
    }
}

fn precision_index(precision: Precision) -> usize {
    Precision::ALL
        .iter()
        .position(|&p| p == precision)
        .expect("ALL lists every precision")
}

/// k of a format's rounding step 2^(−k): its mantissa bits − 1 (f16 9 as the authors use,
/// bf16 6, f32 22 for an f32 int8 backward). int8 has no mantissa (its step is the scale):
/// named as the int8 backward format it is read as bf16.
fn mantissa_k(precision: Precision) -> i32 {
    match precision {
        Precision::F16 => 9,
        Precision::Bf16 | Precision::Int8 => 6,
        Precision::F32 => 22,
    }
}

fn norm_and_amax(values: &[f32]) -> (f64, f64) {
    let mut sum = 0f64;
    let mut amax = 0f64;
    for &v in values {
        let v = f64::from(v);
        sum += v * v;
        amax = amax.max(v.abs());
    }
    (sum.sqrt(), amax)
}

/// √(‖x‖/D) as the released code computes it (the plain norm, not its square).
fn mean_magnitude(norm: f64, count: f64) -> f64 {
    if count == 0.0 {
        0.0
    } else {
        (norm / count).sqrt()
    }
}

/// |frexp exponent| of the value rounded to f16, capped: numpy gives exponent 0 for 0 and
/// for the infinity an f16 overflows to.
fn capped_exponent(x: f64) -> f64 {
    let h = round_to_f16(x.abs());
    let e = if h == 0.0 || !h.is_finite() {
        0
    } else {
        frexp_exponent(h)
    };
    f64::from(e.abs().min(EXPONENT_CAP))
}

/// x = m·2^e with m in [0.5, 1), for a positive normal f64.
fn frexp_exponent(x: f64) -> i32 {
    ((x.to_bits() >> 52) & 0x7ff) as i32 - 1022
}

/// Round a non-negative value to the nearest f16 (ties to even), as `np.float16(x)` does.
fn round_to_f16(x: f64) -> f64 {
    if x >= 65520.0 {
        return f64::INFINITY;
    }
    if x == 0.0 {
        return 0.0;
    }
    // Below 2^-14 f16 is subnormal with a fixed quantum of 2^-24; above, 11 significant bits.
    let quantum = if x < 2f64.powi(-14) {
        2f64.powi(-24)
    } else {
        2f64.powi(frexp_exponent(x) - 11)
    };
    (x / quantum).round_ties_even() * quantum
}

fn host_f32(t: &Tensor) -> Result<Vec<f32>, QsyncError> {
    Ok(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * a.abs().max(b.abs()).max(1e-300)
    }

    // V = [1, 2, 2]: ‖V‖ = 3, D_v = 3, amax 2, √(3/3) = 1 = 0.5·2^1 → e_v = 1.
    // W = [3, 4]: ‖W‖ = 5, D_w = 2, amax 4, √(5/2) ≈ 1.58 → e_w = 1.
    // g = [0, 0.5]: ‖g‖ = 0.5, max 0.5 = 0.5·2^0 → e_g = 0. D_o = 4.
    fn small_linear() -> OpStats {
        OpStats::weighted(&[1.0, 2.0, 2.0], &[3.0, 4.0], &[0.0, 0.5], 4)
    }

    #[test]
    fn weighted_statistics_match_a_hand_computation() {
        let OpStats::Weighted {
            d_v,
            d_w,
            d_o,
            s_v,
            s_w,
            norm_v,
            norm_w,
            norm_g,
            e_v,
            e_w,
            e_g,
        } = small_linear()
        else {
            panic!("weighted")
        };
        assert_eq!((d_v, d_w, d_o), (3.0, 2.0, 4.0));
        assert!(close(s_v, 2.0 / 127.0) && close(s_w, 4.0 / 127.0));
        assert!(close(norm_v, 3.0) && close(norm_w, 5.0) && close(norm_g, 0.5));
        assert_eq!((e_v, e_w, e_g), (1.0, 1.0, 0.0));
    }

    #[test]
    fn int8_and_f16_terms_match_the_formulas_by_hand() {
        let stats = small_linear();
        let config = IndicatorConfig {
            gamma: 4.0,
            int8_backward: Precision::F16,
        };
        let (sv, sw) = (2.0 / 127.0f64, 4.0 / 127.0f64);
        let (fwd, bwd) = stats.variance(Precision::Int8, &config);
        assert!(close(
            fwd,
            (5.0 * sv * sv * 3.0 + 3.0 * sw * sw * 2.0) / 6.0
        ));
        // 2^(2·e_v) = 4, 2^(−2k) = 2^−18 (f16 backward).
        assert!(close(
            bwd,
            (0.5 * sv * sv * 3.0 + 3.0 * 4.0 * 2f64.powi(-18) * 4.0) / 6.0
        ));

        let (fwd, bwd) = stats.variance(Precision::F16, &config);
        assert!(close(
            fwd,
            2f64.powi(-18) * (5.0 * 3.0 * 1.0 + 3.0 * 2.0 * 1.0) / 6.0
        ));
        assert!(close(
            bwd,
            2f64.powi(-18) * (0.5 * 3.0 * 1.0 + 3.0 * 4.0 * 0.0) / 6.0
        ));
        assert_eq!(stats.variance(Precision::F32, &config), (0.0, 0.0));

        // ω = γ·(L − d)·fwd + d·bwd at depth 2 of 5.
        let omega = stats.omega(Precision::F16, 2, 5, &config);
        assert!(close(omega, 4.0 * 3.0 * fwd + 2.0 * bwd));
    }

    #[test]
    fn single_input_terms_match_the_formulas_by_hand() {
        // V = [0.25; 4]: ‖V‖ = 0.5, √(0.5/4) ≈ 0.354 = 0.707·2^−1 → e_v = 1; amax 0.25.
        let stats = OpStats::single_input(&[0.25; 4]);
        let config = IndicatorConfig::default();
        assert_eq!(
            stats.variance(Precision::Int8, &config),
            ((0.25 / 127.0) * 4.0 / 6.0, 0.0)
        );
        let (fwd, bwd) = stats.variance(Precision::F16, &config);
        assert!(close(fwd, 2f64.powi(4) * 2f64.powi(-36) * 4.0));
        assert_eq!(bwd, 0.0);
        // No backward term: the operator at the model's last depth adds nothing.
        assert_eq!(stats.omega(Precision::Int8, 7, 7, &config), 0.0);
    }

    #[test]
    fn int8_indicator_grows_with_the_quantisation_step() {
        let config = IndicatorConfig::default();
        let weight: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 17) as f32 - 8.0) / 16.0)
            .collect();
        let grad: Vec<f32> = (0..64)
            .map(|i| ((i * 11 % 13) as f32 - 6.0) / 100.0)
            .collect();
        let mut last = 0.0;
        // Scaling the input scales its int8 step S_v = amax/127.
        for scale in [0.5f32, 1.0, 2.0, 4.0, 8.0] {
            let input: Vec<f32> = (0..32).map(|i| scale * ((i % 7) as f32 - 3.0)).collect();
            let omega =
                OpStats::weighted(&input, &weight, &grad, 16).omega(Precision::Int8, 3, 6, &config);
            assert!(
                omega > last,
                "ω = {omega} at scale {scale} is not above {last}"
            );
            last = omega;
        }
        // A coarser mantissa adds more variance: bf16 (k = 6) > f16 (k = 9) > f32 = 0. (The
        // formulas do not order int8 against the 16-bit formats.)
        let input: Vec<f32> = (0..32).map(|i| (i % 7) as f32 - 3.0).collect();
        let stats = OpStats::weighted(&input, &weight, &grad, 16);
        let omega = |p| stats.omega(p, 3, 6, &config);
        assert!(omega(Precision::Bf16) > omega(Precision::F16));
        assert!(omega(Precision::F16) > omega(Precision::F32));
        assert_eq!(omega(Precision::F32), 0.0);
    }

    #[test]
    fn exponents_follow_numpy_float16_frexp() {
        assert_eq!(capped_exponent(1.0), 1.0); // 0.5·2^1
        assert_eq!(capped_exponent(0.5), 0.0);
        assert_eq!(capped_exponent(0.3), 1.0); // 0.6·2^−1
        assert_eq!(capped_exponent(1e-3), 5.0); // 2^−9 region, capped
        assert_eq!(capped_exponent(0.0), 0.0);
        assert_eq!(capped_exponent(1e6), 0.0); // f16 overflows to inf
                                               // 0.99999 rounds up to 1.0 in f16, whose exponent is 1, not 0.
        assert_eq!(capped_exponent(0.99999), 1.0);
        assert_eq!(round_to_f16(1.0 + 2f64.powi(-12)), 1.0);
    }

    #[test]
    fn tensor_statistics_equal_slice_statistics() {
        let device = Device::Cpu;
        let input = Tensor::new(&[[1f32, 2.0], [2.0, 0.0]], &device).unwrap();
        let weight = Tensor::new(&[3f32, 4.0], &device).unwrap();
        let grad = Tensor::new(&[0f32, 0.5], &device).unwrap();
        let output = Tensor::zeros((2, 2), DType::F32, &device).unwrap();
        let from_tensors = OpStats::weighted_tensors(&input, &weight, &grad, &output).unwrap();
        assert_eq!(
            from_tensors,
            OpStats::weighted(&[1.0, 2.0, 2.0, 0.0], &[3.0, 4.0], &[0.0, 0.5], 4)
        );
    }

    #[test]
    fn random_ablation_permutes_rows_reproducibly() {
        let rows: Vec<[f64; 4]> = (0..12)
            .map(|i| [10.0 + i as f64, 5.0 + i as f64, 1.0 + i as f64, 0.0])
            .collect();
        let real = Indicators::from_values(rows.clone());
        let a = real.shuffled(7);
        assert_eq!(a, real.shuffled(7));
        assert_ne!(a, real, "12 rows shuffled by seed 7 came back in order");
        assert_ne!(a, real.shuffled(8));
        let mut sorted = a.values.clone();
        sorted.sort_by(|x, y| x[0].total_cmp(&y[0]));
        assert_eq!(sorted, rows);
    }
}
