//! A training job's measured step time per rank count, and the remaining time it predicts:
//! the quantity Aryl values extra workers by (the knapsack's "JCT reduction", §3 of the
//! research note).
//!
//! Departure: the paper profiles each job's throughput curve; here the curve is whatever
//! the workers measured so far. Between two measured rank counts the step time is
//! interpolated linearly; below the smallest it is scaled as if ranks shared the work
//! perfectly (which predicts a slower job, never a faster one); above the largest it is
//! taken as flat, so a job is never granted ranks nobody has seen it use well.

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
        if ranks >= last.0 {
            return Some(last.1);
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
    fn between_points_interpolates_and_beyond_the_last_is_flat() {
        let s = StepTimes::new([(2, 0.6), (6, 0.2)]);
        assert!((s.at(4).unwrap() - 0.4).abs() < 1e-12);
        assert_eq!(s.at(32), Some(0.2));
        // Below the smallest: perfect scaling backwards, so one rank is twice as slow as two.
        assert!((s.at(1).unwrap() - 1.2).abs() < 1e-12);
    }

    #[test]
    fn repeated_rank_keeps_the_last_measurement_and_bad_points_are_dropped() {
        let s = StepTimes::new([(2, 0.9), (2, 0.5), (0, 1.0), (3, f64::NAN), (4, -1.0)]);
        assert_eq!(s.at(2), Some(0.5));
        assert_eq!(s.at(8), Some(0.5));
        assert!(StepTimes::new([]).at(1).is_none());
        assert_eq!(StepTimes::new([]).remaining_secs(10.0, 1), f64::INFINITY);
    }
}
