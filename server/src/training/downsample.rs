//! Server-side downsampling of metric series for charts: a browser drawing 100k points
//! per curve stalls, and a chart a few hundred pixels wide cannot show them anyway.
//!
//! Min/max per bucket: the first and last points are kept, the points between are cut
//! into equal runs (by position, i.e. by step for a series reported every step), and
//! each run contributes its lowest and its highest point, in step order. Unlike
//! averaging, spikes and the noise envelope survive, and every point returned is a
//! point that was really reported.

/// At most `max_points` of `points` (ordered by step); all of them when they fit.
/// `max_points` below 4 is treated as 4 (first, last, one run's min and max).
pub fn min_max(points: &[(i64, f64)], max_points: usize) -> Vec<(i64, f64)> {
    let max_points = max_points.max(4);
    if points.len() <= max_points {
        return points.to_vec();
    }
    let interior = &points[1..points.len() - 1];
    let buckets = (max_points - 2) / 2;
    let mut out = Vec::with_capacity(max_points);
    out.push(points[0]);
    for b in 0..buckets {
        let run = &interior[b * interior.len() / buckets..(b + 1) * interior.len() / buckets];
        if run.is_empty() {
            continue;
        }
        let (mut lo, mut hi) = (0, 0);
        for (i, point) in run.iter().enumerate() {
            if point.1 < run[lo].1 {
                lo = i;
            }
            if point.1 > run[hi].1 {
                hi = i;
            }
        }
        let (first, second) = if lo <= hi { (lo, hi) } else { (hi, lo) };
        out.push(run[first]);
        if second != first {
            out.push(run[second]);
        }
    }
    out.push(points[points.len() - 1]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(n: i64) -> Vec<(i64, f64)> {
        (0..n).map(|s| (s, ((s as f64) * 0.37).sin() + 1.0 / (1.0 + s as f64))).collect()
    }

    #[test]
    fn short_series_come_back_whole() {
        let points = series(10);
        assert_eq!(min_max(&points, 10), points);
        assert_eq!(min_max(&points, 1000), points);
    }

    #[test]
    fn long_series_fit_the_budget_keep_ends_extremes_and_order() {
        let mut points = series(100_000);
        points[54_321].1 = 42.0; // a spike must survive
        points[77_777].1 = -42.0;
        let out = min_max(&points, 1000);
        assert!(out.len() <= 1000 && out.len() >= 990, "{}", out.len());
        assert_eq!(out[0], points[0]);
        assert_eq!(*out.last().unwrap(), points[99_999]);
        assert!(out.windows(2).all(|w| w[0].0 < w[1].0), "steps increase");
        assert!(out.contains(&(54_321, 42.0)) && out.contains(&(77_777, -42.0)));
        assert!(out.iter().all(|p| points[p.0 as usize] == *p), "only real points");
    }

    #[test]
    fn a_tiny_budget_still_gives_the_ends() {
        let out = min_max(&series(50), 1);
        assert_eq!(out.len(), 4);
        assert_eq!(out[0].0, 0);
        assert_eq!(out[3].0, 49);
    }
}
