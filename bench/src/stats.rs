//! Statistics over paired seeds: a contender and a baseline run with the same seed (same
//! split, initialisation and batch order), summarised by their per-seed differences with a
//! Student t interval.

/// Two-sided 95 % Student t quantiles for 1..=30 degrees of freedom.
const T95: [f64; 30] = [
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131, 2.120,
    2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
];

/// The two-sided 95 % t quantile for `df` degrees of freedom (≥ 1; 30 and beyond use 30's,
/// which errs on the wide side).
pub fn t95(df: usize) -> f64 {
    T95[df.clamp(1, 30) - 1]
}

pub fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => sorted[n / 2],
        _ => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// Per-seed differences `contender − baseline` and their summary.
#[derive(Debug, Clone, PartialEq)]
pub struct PairedDifference {
    pub differences: Vec<f64>,
    pub mean: f64,
    pub median: f64,
    /// The 95 % t interval of the mean difference; NaN with fewer than two seeds.
    pub ci95: (f64, f64),
}

impl PairedDifference {
    /// `contender[i]` and `baseline[i]` come from the same seed.
    pub fn of(contender: &[f64], baseline: &[f64]) -> PairedDifference {
        assert_eq!(contender.len(), baseline.len(), "paired runs come in pairs");
        let differences: Vec<f64> = contender.iter().zip(baseline).map(|(c, b)| c - b).collect();
        let n = differences.len();
        let mean = differences.iter().sum::<f64>() / n.max(1) as f64;
        let half = if n >= 2 {
            let variance = differences.iter().map(|d| (d - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
            t95(n - 1) * variance.sqrt() / (n as f64).sqrt()
        } else {
            f64::NAN
        };
        PairedDifference { median: median(&differences), differences, mean, ci95: (mean - half, mean + half) }
    }

    /// Whether the mean difference is at least `margin` (a negative margin: "no worse than
    /// |margin| below the baseline").
    pub fn mean_at_least(&self, margin: f64) -> bool {
        self.mean >= margin
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paired_difference_matches_a_hand_computed_t_interval() {
        // Differences 1, 2, 3, 4, 5: mean 3, sample sd √2.5, t(4) = 2.776.
        let d = PairedDifference::of(&[2.0, 4.0, 6.0, 8.0, 10.0], &[1.0, 2.0, 3.0, 4.0, 5.0]);
        assert_eq!(d.differences, [1.0, 2.0, 3.0, 4.0, 5.0]);
        assert_eq!((d.mean, d.median), (3.0, 3.0));
        let half = 2.776 * 2.5f64.sqrt() / 5f64.sqrt();
        assert!((d.ci95.0 - (3.0 - half)).abs() < 1e-12 && (d.ci95.1 - (3.0 + half)).abs() < 1e-12, "{:?}", d.ci95);
        assert!(d.mean_at_least(3.0) && !d.mean_at_least(3.01));
    }

    #[test]
    fn identical_runs_differ_by_nothing_and_one_seed_has_no_interval() {
        let same = PairedDifference::of(&[0.9, 0.8], &[0.9, 0.8]);
        assert_eq!((same.mean, same.ci95), (0.0, (0.0, 0.0)));
        let one = PairedDifference::of(&[0.5], &[0.7]);
        assert!((one.mean + 0.2).abs() < 1e-12 && one.ci95.0.is_nan());
        assert!(!one.mean_at_least(-0.1) && one.mean_at_least(-0.25));
    }

    #[test]
    fn t_quantiles_and_medians() {
        assert_eq!((t95(1), t95(4), t95(30), t95(200)), (12.706, 2.776, 2.042, 2.042));
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
    }
}
