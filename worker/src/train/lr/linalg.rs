//! The one piece of dense linear algebra the tuner needs: a Cholesky factorisation of a
//! small symmetric positive-definite matrix (the GP's kernel matrix, the smoothing
//! spline's normal equations). Matrices are row-major `n × n` slices.

/// `A = L·Lᵀ` with `L` lower triangular.
#[derive(Debug, Clone)]
pub struct Cholesky {
    n: usize,
    l: Vec<f64>,
}

impl Cholesky {
    /// `None` when `a` is not (numerically) positive definite.
    pub fn new(a: &[f64], n: usize) -> Option<Cholesky> {
        assert_eq!(a.len(), n * n, "matrix is not {n}×{n}");
        let mut l = vec![0.0; n * n];
        for i in 0..n {
            for j in 0..=i {
                let dot: f64 = (0..j).map(|p| l[i * n + p] * l[j * n + p]).sum();
                let value = a[i * n + j] - dot;
                if i == j {
                    if !(value > 0.0 && value.is_finite()) {
                        return None;
                    }
                    l[i * n + i] = value.sqrt();
                } else {
                    l[i * n + j] = value / l[j * n + j];
                }
            }
        }
        Some(Cholesky { n, l })
    }

    /// `z` with `L·z = b`.
    pub fn solve_lower(&self, b: &[f64]) -> Vec<f64> {
        let n = self.n;
        let mut z = b.to_vec();
        for i in 0..n {
            let dot: f64 = (0..i).map(|p| self.l[i * n + p] * z[p]).sum();
            z[i] = (z[i] - dot) / self.l[i * n + i];
        }
        z
    }

    /// `x` with `A·x = b`.
    pub fn solve(&self, b: &[f64]) -> Vec<f64> {
        let n = self.n;
        let mut x = self.solve_lower(b);
        for i in (0..n).rev() {
            let dot: f64 = (i + 1..n).map(|p| self.l[p * n + i] * x[p]).sum();
            x[i] = (x[i] - dot) / self.l[i * n + i];
        }
        x
    }

    /// `ln det A`.
    pub fn log_det(&self) -> f64 {
        2.0 * (0..self.n)
            .map(|i| self.l[i * self.n + i].ln())
            .sum::<f64>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn solves_a_small_system_and_knows_its_determinant() {
        // A = [[4, 2], [2, 3]], det 8.
        let chol = Cholesky::new(&[4.0, 2.0, 2.0, 3.0], 2).unwrap();
        let x = chol.solve(&[2.0, 1.0]);
        // Cramer: x = (2·3 − 2·1)/8, (4·1 − 2·2)/8.
        assert!((x[0] - 0.5).abs() < 1e-12 && x[1].abs() < 1e-12, "{x:?}");
        assert!((chol.log_det() - 8f64.ln()).abs() < 1e-12);
    }

    #[test]
    fn rejects_a_matrix_that_is_not_positive_definite() {
        assert!(Cholesky::new(&[1.0, 2.0, 2.0, 1.0], 2).is_none());
    }
}
