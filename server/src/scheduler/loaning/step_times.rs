//! A training job's measured step time per rank count, and the remaining time it predicts:
//! the quantity Aryl values extra workers by (the knapsack's "JCT reduction", §3 of the
//! research note).
//!
//! Departure: the paper profiles each job's throughput curve; here the curve is whatever
//! the workers measured so far. Between two measured rank counts the step time is
//! interpolated linearly; below the smallest it is scaled as if ranks shared the work
//! perfectly (which predicts a slower job, never a faster one). Above the largest it
//! follows Amdahl's law fitted through the two largest measured counts (never faster than
//! that fit, never slower than the largest's time); with one count measured, as if half of
//! a step did not shrink with more ranks (GUESS: a cautious prior, so a running elastic
//! job may try a larger size once, and its measurement there replaces the guess).

/// Seconds per optimiser step at each measured rank count.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StepTimes {
    /// (ranks, seconds per step), sorted by ranks, ranks distinct and at least 1.
    points: Vec<(u32, f64)>,
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
        StepTimes { points }
    }

    pub fn is_empty(&self) -> bool {
        self.points.is_empty()
    }

    /// Predicted seconds per step at `ranks` (at least 1); `None` when nothing was measured.
    pub fn at(&self, ranks: u32) -> Option<f64> {
        let ranks = ranks.max(1);
        let (first, last) = (*self.points.first()?, *self.points.last()?);
        if ranks <= first.0 {
            return Some(first.1 * first.0 as f64 / ranks as f64);
        }
        if ranks == last.0 {
            return Some(last.1);
        }
        if ranks > last.0 {
            return Some(self.beyond(ranks));
        }
        let i = self.points.partition_point(|&(r, _)| r < ranks);
        let (hi_r, hi_t) = self.points[i];
        if hi_r == ranks {
            return Some(hi_t);
        }
        let (lo_r, lo_t) = self.points[i - 1];
        let f = (ranks - lo_r) as f64 / (hi_r - lo_r) as f64;
        Some(lo_t + f * (hi_t - lo_t))
    }

    /// Step time above the largest measured count: `serial + parallel / ranks` through the
    /// two largest points (one point: half serial), clamped to non-negative parts.
    fn beyond(&self, ranks: u32) -> f64 {
        let (r2, t2) = self.points[self.points.len() - 1];
        let parallel = match self.points.len() {
            1 => t2 * 0.5 * r2 as f64,
            n => {
                let (r1, t1) = self.points[n - 2];
                ((t1 - t2) / (1.0 / r1 as f64 - 1.0 / r2 as f64)).clamp(0.0, t2 * r2 as f64)
            }
        };
        let serial = t2 - parallel / r2 as f64;
        serial + parallel / ranks as f64
    }

    /// Predicted seconds to run `steps` more steps at `ranks`; infinite when unmeasured.
    pub fn remaining_secs(&self, steps: f64, ranks: u32) -> f64 {
        self.at(ranks).map_or(f64::INFINITY, |t| steps.max(0.0) * t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measured_points_are_returned_exactly() {
        let s = StepTimes::new([(4, 0.3), (1, 1.0), (2, 0.55)]);
        assert_eq!(s.at(1), Some(1.0));
        assert_eq!(s.at(2), Some(0.55));
        assert_eq!(s.at(4), Some(0.3));
    }

    #[test]
    fn between_points_interpolates_and_beyond_the_last_follows_amdahl() {
        let s = StepTimes::new([(2, 0.6), (6, 0.2)]);
        assert!((s.at(4).unwrap() - 0.4).abs() < 1e-12);
        // 0.6 at 2 and 0.2 at 6 fit 0 + 1.2 / r: perfect scaling continues.
        assert!((s.at(12).unwrap() - 0.1).abs() < 1e-12);
        // A job that got slower with more ranks is not predicted faster beyond them.
        let worse = StepTimes::new([(1, 1.0), (2, 1.1)]);
        assert_eq!(worse.at(8), Some(1.1));
        // Amdahl through (1, 1.0) and (2, 0.6): 0.2 + 0.8 / r.
        let amdahl = StepTimes::new([(1, 1.0), (2, 0.6)]);
        assert!((amdahl.at(4).unwrap() - 0.4).abs() < 1e-12);
        // Below the smallest: perfect scaling backwards, so one rank is twice as slow as two.
        assert!((s.at(1).unwrap() - 1.2).abs() < 1e-12);
    }

    #[test]
    fn repeated_rank_keeps_the_last_measurement_and_bad_points_are_dropped() {
        let s = StepTimes::new([(2, 0.9), (2, 0.5), (0, 1.0), (3, f64::NAN), (4, -1.0)]);
        assert_eq!(s.at(2), Some(0.5));
        // One count measured: half of the step shrinks with ranks, 0.25 + 0.25 × 2 / 8.
        assert!((s.at(8).unwrap() - 0.3125).abs() < 1e-12);
        assert!(StepTimes::new([]).at(1).is_none());
        assert_eq!(StepTimes::new([]).remaining_secs(10.0, 1), f64::INFINITY);
    }
}
