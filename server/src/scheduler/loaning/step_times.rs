//! A training job's step time per rank count, measured where its ranks ran and predicted
//! elsewhere, and the remaining time it gives: the quantity Aryl values extra workers by
//! (the knapsack's "JCT reduction", §3 of the research note) and orders its queue by.
//!
//! Departure: the paper profiles each job's throughput curve before scheduling it; here
//! the curve starts as a prior and the measurements replace it where they exist, the way
//! schedulers that model throughput online work (Pollux, OSDI '21, fits its model's
//! parameters from the job's own measurements as it runs). The prior is Amdahl's law: at
//! `r` ranks a step takes `t(r0) · (s + (1 − s) / r) / (s + (1 − s) / r0)`, anchored on a
//! measured count `r0`, where `s` is the share of a one-rank step that more ranks do not
//! shorten (the all-reduce, the optimiser, the input pipeline); read at `r0` instead
//! (`s0 = s / (s + (1 − s) / r0)`) it is `t(r0) · (s0 + (1 − s0) · r0 / r)`. Precisely:
//! - measured counts give their measurement;
//! - between two measured counts, the Amdahl curve through both (`a + b / r`), so the
//!   curve meets every measurement and falls wherever the measurements fall;
//! - below the smallest or above the largest, Amdahl anchored on that nearest count,
//!   with `s` fitted by least squares over every measured count (two or more; clamped to
//!   `[0, 1]`) or [`DEFAULT_SERIAL_SHARE`] with one;
//! - with nothing measured, what a measured job of the same kind takes a step at one rank
//!   ([`share_priors`]; the caller says what "same kind" is), else [`DEFAULT_STEP_SECS`],
//!   with the default share, so a new job's predicted time is finite and the queue is
//!   shortest-first by its declared steps, not its arrival.

/// Share of a one-rank step assumed not to shrink with more ranks while fewer than two
/// rank counts were measured. A guess, not a measurement (no job's curve is known before
/// it runs): with 0.1 a second rank saves 45% of a one-rank step and the eighth about
/// 1.6%, so a new job is offered spare ranks while they plausibly pay, a job measured to
/// scale well still wins them over it, and its own measurements replace the guess once it
/// ran at two rank counts.
pub const DEFAULT_SERIAL_SHARE: f64 = 0.1;

/// Seconds per step at one rank assumed for a job nothing was measured of: its spec
/// declares its steps but not their cost. Only the order of unmeasured jobs against
/// measured ones depends on it.
pub const DEFAULT_STEP_SECS: f64 = 1.0;

/// Steps a rank count needs timed before its median stands for it (fewer within the
/// window asked for, when the window is smaller).
pub const MIN_MEASURED_STEPS: usize = 5;

/// Seconds per optimiser step per rank count: the measured points and the prior around them.
#[derive(Debug, Clone, PartialEq)]
pub struct StepTimes {
    /// (ranks, seconds per step), sorted by ranks, ranks distinct and at least 1.
    points: Vec<(u32, f64)>,
    /// Serial share `s` of the prior: fitted, or the default.
    serial: f64,
    /// Seconds per step at one rank while nothing is measured.
    unmeasured_secs: f64,
}

impl Default for StepTimes {
    fn default() -> Self {
        StepTimes::new([])
    }
}

impl StepTimes {
    /// Keeps the points with a positive rank count and a positive, finite step time; a rank
    /// count measured twice keeps its last measurement.
    pub fn new(points: impl IntoIterator<Item = (u32, f64)>) -> Self {
        let mut points: Vec<(u32, f64)> = points.into_iter().filter(|&(r, t)| r > 0 && t.is_finite() && t > 0.0).collect();
        points.sort_by_key(|&(r, _)| r);
        // A stable sort keeps input order among equal ranks: keep the last of each run.
        points.reverse();
        points.dedup_by_key(|&mut (r, _)| r);
        points.reverse();
        let serial = fit_serial_share(&points);
        StepTimes { points, serial, unmeasured_secs: DEFAULT_STEP_SECS }
    }

    /// From step timings newest first, `(ranks, seconds)`: each rank count's median over its
    /// `per_count` newest steps (the median, so the slow first step after a start or a
    /// resize, spent loading and warming up, does not move it). A count with fewer than
    /// [`MIN_MEASURED_STEPS`] steps is left to the prior: a gang stopped within its first
    /// steps (a reclaim right after it formed) timed only its warm-up, and a count measured
    /// slower than it is would be read as scaling badly and never offered again.
    pub fn from_recent(samples: impl IntoIterator<Item = (u32, f64)>, per_count: usize) -> Self {
        let mut by_count: std::collections::BTreeMap<u32, Vec<f64>> = std::collections::BTreeMap::new();
        for (ranks, secs) in samples {
            let seen = by_count.entry(ranks).or_default();
            if seen.len() < per_count && secs.is_finite() && secs > 0.0 {
                seen.push(secs);
            }
        }
        let enough = MIN_MEASURED_STEPS.min(per_count.max(1));
        StepTimes::new(by_count.into_iter().filter(|(_, v)| v.len() >= enough).map(|(r, mut v)| (r, median(&mut v))))
    }

    /// The same curve with `secs` per step at one rank assumed while nothing is measured
    /// (a positive, finite figure; anything else keeps the default).
    pub fn assuming(mut self, secs: f64) -> Self {
        if secs.is_finite() && secs > 0.0 {
            self.unmeasured_secs = secs;
        }
        self
    }

    /// Nothing measured: every figure is the prior's.
    pub fn is_empty(&self) -> bool {
        self.points.is_empty()
    }

    /// The measured points, by rank count.
    pub fn points(&self) -> &[(u32, f64)] {
        &self.points
    }

    /// The prior's serial share: fitted from two or more measured counts, else the default.
    pub fn serial_share(&self) -> f64 {
        self.serial
    }

    /// Predicted seconds per step at `ranks` (at least 1): positive and finite.
    pub fn at(&self, ranks: u32) -> f64 {
        let ranks = ranks.max(1);
        let s = self.serial;
        let amdahl = |(r0, t0): (u32, f64)| t0 * (s + (1.0 - s) / ranks as f64) / (s + (1.0 - s) / r0 as f64);
        let (Some(&first), Some(&last)) = (self.points.first(), self.points.last()) else {
            return amdahl((1, self.unmeasured_secs));
        };
        if ranks <= first.0 {
            return amdahl(first);
        }
        if ranks >= last.0 {
            return amdahl(last);
        }
        let i = self.points.partition_point(|&(r, _)| r < ranks);
        let (hi_r, hi_t) = self.points[i];
        if hi_r == ranks {
            return hi_t;
        }
        // t = a + b / r through both neighbours; between them it stays between their times.
        let (lo_r, lo_t) = self.points[i - 1];
        let (x_lo, x_hi, x) = (1.0 / lo_r as f64, 1.0 / hi_r as f64, 1.0 / ranks as f64);
        lo_t + (hi_t - lo_t) * (x_lo - x) / (x_lo - x_hi)
    }

    /// Predicted seconds to run `steps` more steps at `ranks`: finite.
    pub fn remaining_secs(&self, steps: f64, ranks: u32) -> f64 {
        steps.max(0.0) * self.at(ranks)
    }
}

/// Jobs nothing was measured of assume, at one rank, the median one-rank step time
/// predicted for the measured jobs of the same kind (`kinds[i]` is job `i`'s, e.g. its
/// model and batch size on one slice profile); jobs of a kind nobody measured keep theirs.
pub fn share_priors<'a, K: PartialEq>(kinds: &[K], times: impl IntoIterator<Item = &'a mut StepTimes>) {
    let mut times: Vec<&mut StepTimes> = times.into_iter().collect();
    let n = times.len().min(kinds.len());
    // Each kind's measured jobs' one-rank step times.
    let mut measured: Vec<(&K, Vec<f64>)> = Vec::new();
    for i in (0..n).filter(|&i| !times[i].is_empty()) {
        let secs = times[i].at(1);
        match measured.iter_mut().find(|(k, _)| *k == &kinds[i]) {
            Some((_, seen)) => seen.push(secs),
            None => measured.push((&kinds[i], vec![secs])),
        }
    }
    for (kind, t) in kinds.iter().zip(times.iter_mut()) {
        if !t.is_empty() {
            continue;
        }
        if let Some((_, seen)) = measured.iter_mut().find(|(k, _)| *k == kind) {
            let secs = median(seen);
            **t = std::mem::take(&mut **t).assuming(secs);
        }
    }
}

/// The median of a non-empty list (reordered).
fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len() % 2 == 1 {
        values[mid]
    } else {
        (values[mid - 1] + values[mid]) / 2.0
    }
}

/// Least-squares fit of `t = a + b / r` over the points, read as Amdahl's serial share
/// `a / (a + b)` and clamped to `[0, 1]`: a curve that falls faster than linear scaling
/// gives 0, one that does not fall gives 1 (extra ranks are worth nothing).
fn fit_serial_share(points: &[(u32, f64)]) -> f64 {
    if points.len() < 2 {
        return DEFAULT_SERIAL_SHARE;
    }
    let n = points.len() as f64;
    let x_mean = points.iter().map(|&(r, _)| 1.0 / r as f64).sum::<f64>() / n;
    let y_mean = points.iter().map(|&(_, t)| t).sum::<f64>() / n;
    let (mut sxy, mut sxx) = (0.0, 0.0);
    for &(r, t) in points {
        let dx = 1.0 / r as f64 - x_mean;
        sxy += dx * (t - y_mean);
        sxx += dx * dx;
    }
    // Distinct rank counts: sxx > 0.
    let b = sxy / sxx;
    let a = y_mean - b * x_mean;
    if b <= 0.0 {
        1.0
    } else if a <= 0.0 {
        0.0
    } else {
        (a / (a + b)).clamp(0.0, 1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9 * b.abs().max(1.0)
    }

    #[test]
    fn measured_points_are_returned_exactly() {
        let s = StepTimes::new([(4, 0.3), (1, 1.0), (2, 0.55)]);
        assert_eq!(s.at(1), 1.0);
        assert_eq!(s.at(2), 0.55);
        assert_eq!(s.at(4), 0.3);
    }

    #[test]
    fn two_measured_counts_fit_the_serial_share_of_an_amdahl_job() {
        // t(r) = 2 · (0.25 + 0.75 / r): measured at 2 and 4, predicted at 8 and at 1.
        let amdahl = |r: u32| 2.0 * (0.25 + 0.75 / r as f64);
        let s = StepTimes::new([(2, amdahl(2)), (4, amdahl(4))]);
        assert!(close(s.serial_share(), 0.25), "{}", s.serial_share());
        assert!(close(s.at(8), amdahl(8)));
        assert!(close(s.at(1), amdahl(1)));
        assert!(close(s.at(3), amdahl(3)), "between the points the curve is Amdahl's too");
    }

    #[test]
    fn one_measured_count_anchors_the_default_share() {
        let s = StepTimes::new([(2, 0.6)]);
        assert_eq!(s.serial_share(), DEFAULT_SERIAL_SHARE);
        // At one rank 0.6 / (0.1 + 0.9 / 2); at four 0.6 · (0.1 + 0.9 / 4) / (0.1 + 0.9 / 2).
        assert!(close(s.at(1), 0.6 / 0.55));
        assert!(close(s.at(4), 0.6 * 0.325 / 0.55));
        assert!(s.at(64) < s.at(8), "above the measurement extra ranks still help");
    }

    #[test]
    fn the_anchor_is_the_nearest_measured_count() {
        // Two points that no single Amdahl curve through (1, 1.0) would give at 16.
        let s = StepTimes::new([(1, 1.0), (2, 0.9), (8, 0.2)]);
        let fit = s.serial_share();
        assert!(close(s.at(16), 0.2 * (fit + (1.0 - fit) / 16.0) / (fit + (1.0 - fit) / 8.0)));
        assert!(close(s.at(8), 0.2));
    }

    #[test]
    fn the_fitted_share_is_clamped() {
        // Slower with more ranks: share 1, flat beyond the largest count.
        let worse = StepTimes::new([(1, 1.0), (2, 1.2), (4, 1.5)]);
        assert_eq!(worse.serial_share(), 1.0);
        assert_eq!(worse.at(16), 1.5);
        // Faster than linear: share 0, linear beyond.
        let super_linear = StepTimes::new([(1, 1.0), (2, 0.4)]);
        assert_eq!(super_linear.serial_share(), 0.0);
        assert!(close(super_linear.at(4), 0.2));
    }

    #[test]
    fn nothing_measured_is_finite_and_scales_with_the_default_share() {
        let s = StepTimes::new([]);
        assert!(s.is_empty());
        assert_eq!(s.at(1), DEFAULT_STEP_SECS);
        assert!(close(s.at(2), DEFAULT_STEP_SECS * 0.55));
        assert!(close(s.remaining_secs(100.0, 2), 55.0 * DEFAULT_STEP_SECS));
        assert_eq!(s.remaining_secs(-3.0, 2), 0.0);
        let assumed = StepTimes::new([]).assuming(0.2);
        assert!(close(assumed.remaining_secs(10.0, 1), 2.0));
        assert_eq!(StepTimes::new([]).assuming(f64::NAN), StepTimes::new([]));
        // A measurement replaces the assumption.
        assert_eq!(StepTimes::new([(1, 0.7)]).assuming(0.2).at(1), 0.7);
    }

    #[test]
    fn monotone_non_increasing_wherever_the_measurements_are() {
        let mut rng = StdRng::seed_from_u64(16);
        for case in 0..500 {
            // Falling measurements at random rank counts (or none).
            let mut t = rng.gen_range(0.01..10.0);
            let mut points = Vec::new();
            let mut r = 0;
            for _ in 0..rng.gen_range(0..5) {
                r += rng.gen_range(1..6);
                points.push((r, t));
                t *= rng.gen_range(0.3..1.0);
            }
            let s = StepTimes::new(points);
            let mut before = f64::INFINITY;
            for r in 1..=40 {
                let now = s.at(r);
                assert!(now.is_finite() && now > 0.0, "case {case}: t({r}) = {now}");
                assert!(now <= before * (1.0 + 1e-12), "case {case}: t({r}) = {now} after {before}: {s:?}");
                before = now;
            }
        }
    }

    #[test]
    fn recent_samples_give_each_count_its_median() {
        // Newest first: at 4 ranks, a slow first step after the resize (9.0) is outvoted.
        let samples = [(4, 0.30), (4, 0.32), (4, 9.0), (2, 0.5), (2, 0.7), (2, 0.6), (2, 50.0), (1, f64::NAN)];
        let s = StepTimes::from_recent(samples, 3);
        assert_eq!(s.points(), &[(2, 0.6), (4, 0.32)]);
        assert!(StepTimes::from_recent([], 3).is_empty());
        let even = StepTimes::from_recent([(1, 1.0); 3].into_iter().chain([(1, 2.0); 3]), 10);
        assert_eq!(even.points(), &[(1, 1.5)]);
    }

    #[test]
    fn a_count_stopped_within_its_first_steps_is_left_to_the_prior() {
        // Two ranks timed three warm-up steps before a reclaim shrank the gang: read as a
        // measurement they would say two ranks are slower than one, so the job never grew.
        let one: Vec<(u32, f64)> = vec![(1, 1.0); 40];
        let warm_up = [(2, 3.0), (2, 2.0), (2, 1.5)];
        let s = StepTimes::from_recent(one.iter().copied().chain(warm_up), 50);
        assert_eq!(s.points(), &[(1, 1.0)]);
        assert!(s.at(2) < s.at(1));
        let settled = one.iter().copied().chain([(2, 0.6); MIN_MEASURED_STEPS]);
        assert_eq!(StepTimes::from_recent(settled, 50).points(), &[(1, 1.0), (2, 0.6)]);
    }

    #[test]
    fn a_new_job_borrows_the_step_time_of_measured_jobs_of_its_kind() {
        let mut times = vec![
            StepTimes::new([(1, 0.4)]),
            StepTimes::new([]),
            StepTimes::new([(2, 0.3)]),
            StepTimes::new([]),
            StepTimes::new([(1, 0.2)]),
        ];
        let kinds = ["bert", "bert", "bert", "mlp", "bert"];
        share_priors(&kinds, times.iter_mut());
        // The median of 0.4, 0.2 and 0.3 / 0.55 (the 2-rank job's prediction at one rank).
        assert!(close(times[1].at(1), 0.4));
        assert!(close(times[1].at(2), times[1].at(1) * 0.55));
        // No measured job of its kind: the default; measured jobs keep their own.
        assert_eq!(times[3].at(1), DEFAULT_STEP_SECS);
        assert_eq!(times[0].at(1), 0.4);
        assert_eq!(times[4].at(1), 0.2);
    }

    #[test]
    fn repeated_rank_keeps_the_last_measurement_and_bad_points_are_dropped() {
        let s = StepTimes::new([(2, 0.9), (2, 0.5), (0, 1.0), (3, f64::NAN), (4, -1.0)]);
        assert_eq!(s.points(), &[(2, 0.5)]);
        assert_eq!(s.at(2), 0.5);
    }
}
