//! A dense tableau simplex for the small linear programmes of the lower bound: maximise
//! c·x subject to A x ≤ b and x ≥ 0, with b ≥ 0 so that x = 0 is a feasible start and no
//! first phase is needed. Dantzig's rule, switching to Bland's rule after a run of
//! degenerate pivots so it cannot cycle.

/// An optimal point and its objective value.
#[derive(Debug, Clone)]
pub(crate) struct LpSolution {
    pub x: Vec<f64>,
    pub value: f64,
}

const EPS: f64 = 1e-10;

/// `None` if the programme is unbounded or the pivot limit is reached.
pub(crate) fn maximise(a: &[Vec<f64>], b: &[f64], c: &[f64], max_pivots: usize) -> Option<LpSolution> {
    let m = a.len();
    let n = c.len();
    debug_assert!(b.iter().all(|&v| v >= 0.0), "x = 0 must be feasible");
    let width = n + m + 1;
    let rhs = n + m;
    let mut t = vec![0.0f64; m * width];
    for i in 0..m {
        t[i * width..i * width + n].copy_from_slice(&a[i]);
        t[i * width + n + i] = 1.0;
        t[i * width + rhs] = b[i];
    }
    // Reduced costs of the maximisation: positive means entering improves the objective.
    let mut cost = vec![0.0f64; width];
    cost[..n].copy_from_slice(c);
    let mut basis: Vec<usize> = (n..n + m).collect();
    let mut degenerate_run = 0usize;
    for _ in 0..max_pivots {
        let bland = degenerate_run > 50;
        let entering = if bland {
            (0..n + m).find(|&j| cost[j] > EPS)
        } else {
            (0..n + m).filter(|&j| cost[j] > EPS).max_by(|&x, &y| cost[x].total_cmp(&cost[y]).then(y.cmp(&x)))
        };
        let Some(e) = entering else {
            let mut x = vec![0.0; n];
            for (i, &v) in basis.iter().enumerate() {
                if v < n {
                    x[v] = t[i * width + rhs];
                }
            }
            let value = c.iter().zip(&x).map(|(ci, xi)| ci * xi).sum();
            return Some(LpSolution { x, value });
        };
        let mut leave: Option<(usize, f64)> = None;
        for i in 0..m {
            let coef = t[i * width + e];
            if coef > EPS {
                let ratio = t[i * width + rhs] / coef;
                let better = match leave {
                    None => true,
                    Some((l, r)) => ratio < r - 1e-12 || (ratio <= r + 1e-12 && basis[i] < basis[l]),
                };
                if better {
                    leave = Some((i, ratio));
                }
            }
        }
        let (l, ratio) = leave?;
        degenerate_run = if ratio.abs() <= 1e-12 { degenerate_run + 1 } else { 0 };
        let pivot = t[l * width + e];
        for j in 0..width {
            t[l * width + j] /= pivot;
        }
        let (before, from_pivot) = t.split_at_mut(l * width);
        let (pivot_row, after) = from_pivot.split_at_mut(width);
        for row in before.chunks_exact_mut(width).chain(after.chunks_exact_mut(width)) {
            let f = row[e];
            if f != 0.0 {
                for (r, p) in row.iter_mut().zip(pivot_row.iter()) {
                    *r -= f * p;
                }
            }
        }
        let f = cost[e];
        for (r, p) in cost.iter_mut().zip(pivot_row.iter()) {
            *r -= f * p;
        }
        basis[l] = e;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn solves_a_textbook_programme() {
        // max 3x + 5y  s.t. x ≤ 4, 2y ≤ 12, 3x + 2y ≤ 18  →  x = 2, y = 6, value 36.
        let a = vec![vec![1.0, 0.0], vec![0.0, 2.0], vec![3.0, 2.0]];
        let s = maximise(&a, &[4.0, 12.0, 18.0], &[3.0, 5.0], 100).unwrap();
        assert!((s.value - 36.0).abs() < 1e-9);
        assert!((s.x[0] - 2.0).abs() < 1e-9 && (s.x[1] - 6.0).abs() < 1e-9);
    }

    #[test]
    fn reports_an_unbounded_programme() {
        let a = vec![vec![1.0, -1.0]];
        assert!(maximise(&a, &[1.0], &[1.0, 1.0], 100).is_none());
    }

    #[test]
    fn terminates_on_a_degenerate_programme() {
        // Many constraints through the origin (the lower bound's rows look like this).
        let a = vec![vec![1.0, -1.0, 0.0], vec![1.0, 0.0, -1.0], vec![0.0, 1.0, 1.0], vec![1.0, -1.0, -1.0]];
        let s = maximise(&a, &[0.0, 0.0, 1.0, 0.0], &[1.0, 0.0, 0.0], 1000).unwrap();
        assert!((s.value - 0.5).abs() < 1e-9, "{}", s.value);
    }
}
