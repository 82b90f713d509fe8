//! Gaussian-process regression in one dimension, as AutoLRS gets it from scikit-optimize
//! (`cook_estimator("GP")`, read in the note `shared/research/qsync_autolrs.md` §2):
//!
//! - kernel `σ_f² · Matérn_{ν=5/2}(ℓ)` plus white observation noise `σ_n²`, with the
//!   bounds skopt and scikit-learn give them: `σ_f² ∈ [0.01, 1000]`, `ℓ ∈ [0.01, 100]`,
//!   `σ_n² ∈ [1e-5, 1e5]`, and a `1e-10` jitter on the diagonal;
//! - targets normalised to zero mean and unit variance (`normalize_y`);
//! - hyper-parameters by maximum marginal likelihood from the initial `(1, 1, 1)` plus
//!   two random restarts (`n_restarts_optimizer=2`), in log space;
//! - the posterior variance is that of the latent function: skopt zeroes the white
//!   kernel after fitting, so the noise enters `K(X, X)` but not `k(x*, x*)`.
//!
//! Departure: the simplex method instead of L-BFGS-B for the hyper-parameters (see
//! [`super::nelder_mead`]).

use super::linalg::Cholesky;
use super::nelder_mead::{self, Options};
use crate::train::rng::Rng;

pub const AMPLITUDE_BOUNDS: (f64, f64) = (0.01, 1000.0);
pub const LENGTH_SCALE_BOUNDS: (f64, f64) = (0.01, 100.0);
pub const NOISE_BOUNDS: (f64, f64) = (1e-5, 1e5);
/// scikit-learn's `alpha`: keeps `K` invertible when two inputs coincide.
const JITTER: f64 = 1e-10;
/// skopt's `n_restarts_optimizer`.
pub const RESTARTS: usize = 2;

/// Kernel hyper-parameters, in the units of the normalised targets.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hyper {
    /// `σ_f²`, the constant kernel's value.
    pub amplitude: f64,
    pub length_scale: f64,
    /// `σ_n²`, the white kernel's level.
    pub noise: f64,
}

impl Hyper {
    /// The kernels' initial values in skopt, where the optimiser starts.
    pub const INITIAL: Hyper = Hyper {
        amplitude: 1.0,
        length_scale: 1.0,
        noise: 1.0,
    };

    fn to_log(self) -> [f64; 3] {
        [self.amplitude.ln(), self.length_scale.ln(), self.noise.ln()]
    }

    /// Clamped into the bounds, so the optimiser may wander outside them harmlessly.
    fn from_log(theta: &[f64]) -> Hyper {
        let clamp = |v: f64, (lo, hi): (f64, f64)| v.exp().clamp(lo, hi);
        Hyper {
            amplitude: clamp(theta[0], AMPLITUDE_BOUNDS),
            length_scale: clamp(theta[1], LENGTH_SCALE_BOUNDS),
            noise: clamp(theta[2], NOISE_BOUNDS),
        }
    }
}

/// Matérn covariance with ν = 5/2 at distance `r`, unit amplitude:
/// `(1 + √5 r/ℓ + 5r²/(3ℓ²)) · exp(−√5 r/ℓ)`.
pub fn matern52(r: f64, length_scale: f64) -> f64 {
    let z = 5f64.sqrt() * r.abs() / length_scale;
    (1.0 + z + z * z / 3.0) * (-z).exp()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum GpError {
    #[error("the GP needs at least one observation")]
    Empty,
    #[error("an observation is not a finite number")]
    NonFinite,
    #[error("the kernel matrix is not positive definite")]
    Singular,
}

/// A GP conditioned on observations `(x, y)`.
#[derive(Debug, Clone)]
pub struct Gp {
    xs: Vec<f64>,
    y_mean: f64,
    y_scale: f64,
    hyper: Hyper,
    chol: Cholesky,
    /// `(K + σ_n² I)⁻¹ y` for the normalised `y`.
    alpha: Vec<f64>,
    log_likelihood: f64,
}

impl Gp {
    /// Conditions on the data with fixed hyper-parameters.
    pub fn fit(xs: &[f64], ys: &[f64], hyper: Hyper) -> Result<Gp, GpError> {
        let (y_mean, y_scale) = normalisation(xs, ys)?;
        let normalised: Vec<f64> = ys.iter().map(|y| (y - y_mean) / y_scale).collect();
        condition(xs, &normalised, hyper).map(|(chol, alpha, log_likelihood)| Gp {
            xs: xs.to_vec(),
            y_mean,
            y_scale,
            hyper,
            chol,
            alpha,
            log_likelihood,
        })
    }

    /// Conditions on the data with the hyper-parameters that maximise the marginal
    /// likelihood; the restarts start from uniform draws in the log-bounds.
    pub fn fit_max_likelihood(xs: &[f64], ys: &[f64], rng: &mut Rng) -> Result<Gp, GpError> {
        let (y_mean, y_scale) = normalisation(xs, ys)?;
        let normalised: Vec<f64> = ys.iter().map(|y| (y - y_mean) / y_scale).collect();
        let negative_log_likelihood =
            |theta: &[f64]| match condition(xs, &normalised, Hyper::from_log(theta)) {
                Ok((_, _, log_likelihood)) => -log_likelihood,
                Err(_) => f64::INFINITY,
            };
        let options = Options {
            step: 1.0,
            xtol: 1e-4,
            ftol: 1e-8,
            max_evals: 600,
        };
        let mut starts = vec![Hyper::INITIAL.to_log()];
        for _ in 0..RESTARTS {
            let draw = |rng: &mut Rng, (lo, hi): (f64, f64)| {
                lo.ln() + rng.next_f64() * (hi.ln() - lo.ln())
            };
            starts.push([
                draw(rng, AMPLITUDE_BOUNDS),
                draw(rng, LENGTH_SCALE_BOUNDS),
                draw(rng, NOISE_BOUNDS),
            ]);
        }
        let best = starts
            .iter()
            .map(|start| nelder_mead::minimize(negative_log_likelihood, start, options))
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .expect("at least one start");
        Gp::fit(xs, ys, Hyper::from_log(&best.0))
    }

    pub fn hyper(&self) -> Hyper {
        self.hyper
    }

    /// `ln p(y | X, θ)` of the normalised targets.
    pub fn log_marginal_likelihood(&self) -> f64 {
        self.log_likelihood
    }

    /// Posterior mean and variance of the latent function at `x`, in the targets' units.
    pub fn predict(&self, x: f64) -> (f64, f64) {
        let k_star: Vec<f64> = self
            .xs
            .iter()
            .map(|&xi| self.hyper.amplitude * matern52(x - xi, self.hyper.length_scale))
            .collect();
        let mean: f64 = k_star.iter().zip(&self.alpha).map(|(k, a)| k * a).sum();
        let v = self.chol.solve_lower(&k_star);
        let variance = (self.hyper.amplitude - v.iter().map(|v| v * v).sum::<f64>()).max(0.0);
        (
            self.y_mean + self.y_scale * mean,
            variance * self.y_scale * self.y_scale,
        )
    }
}

/// Mean and (population) standard deviation of the targets; a constant series keeps
/// scale 1, as scikit-learn does.
fn normalisation(xs: &[f64], ys: &[f64]) -> Result<(f64, f64), GpError> {
    assert_eq!(xs.len(), ys.len(), "one target per input");
    if ys.is_empty() {
        return Err(GpError::Empty);
    }
    if xs.iter().chain(ys).any(|v| !v.is_finite()) {
        return Err(GpError::NonFinite);
    }
    let n = ys.len() as f64;
    let mean = ys.iter().sum::<f64>() / n;
    let sd = (ys.iter().map(|y| (y - mean).powi(2)).sum::<f64>() / n).sqrt();
    Ok((mean, if sd > 0.0 { sd } else { 1.0 }))
}

/// Factorises `K + (σ_n² + jitter) I` and returns it with `α` and the log marginal
/// likelihood `−½ yᵀα − ½ ln det − (n/2) ln 2π`.
fn condition(xs: &[f64], ys: &[f64], hyper: Hyper) -> Result<(Cholesky, Vec<f64>, f64), GpError> {
    let n = xs.len();
    let mut k = vec![0.0; n * n];
    for i in 0..n {
        for j in 0..n {
            k[i * n + j] = hyper.amplitude * matern52(xs[i] - xs[j], hyper.length_scale);
        }
        k[i * n + i] += hyper.noise + JITTER;
    }
    let chol = Cholesky::new(&k, n).ok_or(GpError::Singular)?;
    let alpha = chol.solve(ys);
    let fit: f64 = ys.iter().zip(&alpha).map(|(y, a)| y * a).sum();
    let log_likelihood =
        -0.5 * fit - 0.5 * chol.log_det() - 0.5 * n as f64 * (2.0 * std::f64::consts::PI).ln();
    Ok((chol, alpha, log_likelihood))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two points at x = 0 and 0.5 with targets 1 and 3: normalised to −1 and +1
    /// (mean 2, population sd 1). With σ_f² = 2, ℓ = 0.5, σ_n² = 0.1, worked by hand:
    /// k(0.5) = 2·(1 + √5 + 5/3)·e^{−√5} = 1.047988, k(0.25) = 2·(1 + √5/2 + 5/12)·e^{−√5/2}
    /// = 1.657298, (K + σ_n² I)⁻¹ = [[2.1, −k], [−k, 2.1]] / (2.1² − k²).
    /// At x* = 0.25 the mean is 2 by symmetry and the variance 2 − 2k*²/(2.1 + k) = 0.254989;
    /// at x* = 0 the mean is 2 + (2·α₀ + k·α₁) with α = (−1, 1)/(2.1 + k), i.e. 1.095056.
    #[test]
    fn posterior_matches_the_two_point_case_worked_by_hand() {
        let hyper = Hyper {
            amplitude: 2.0,
            length_scale: 0.5,
            noise: 0.1,
        };
        let gp = Gp::fit(&[0.0, 0.5], &[1.0, 3.0], hyper).unwrap();
        assert!((2.0 * matern52(0.5, 0.5) - 1.047988).abs() < 1e-6);
        assert!((2.0 * matern52(0.25, 0.5) - 1.657298).abs() < 1e-6);

        let (mean, variance) = gp.predict(0.25);
        assert!((mean - 2.0).abs() < 1e-9, "{mean}");
        assert!((variance - 0.254989).abs() < 1e-6, "{variance}");
        let (mean, _) = gp.predict(0.0);
        assert!((mean - 1.095056).abs() < 1e-6, "{mean}");

        // ln p(y) = −½ yᵀ(K + σ_n² I)⁻¹y − ½ ln det − ln 2π for n = 2, yᵀ(·)⁻¹y = 2/(2.1 − k).
        let k = 1.0479882176636406;
        let expected = -1.0 / (2.1 - k)
            - 0.5 * (2.1f64 * 2.1 - k * k).ln()
            - (2.0 * std::f64::consts::PI).ln();
        assert!((gp.log_marginal_likelihood() - expected).abs() < 1e-8);
    }

    #[test]
    fn maximum_likelihood_fits_a_smooth_function_with_little_noise() {
        let xs: Vec<f64> = (0..8).map(|i| i as f64 / 7.0).collect();
        let ys: Vec<f64> = xs.iter().map(|x| (6.0 * x).sin()).collect();
        let fitted = Gp::fit_max_likelihood(&xs, &ys, &mut Rng::new(1)).unwrap();
        let initial = Gp::fit(&xs, &ys, Hyper::INITIAL).unwrap();
        assert!(fitted.log_marginal_likelihood() > initial.log_marginal_likelihood());
        assert!(fitted.hyper().noise < 1e-2, "{:?}", fitted.hyper());
        // It interpolates between the samples.
        let (mean, variance) = fitted.predict(0.5);
        assert!((mean - 3f64.sin()).abs() < 0.05, "{mean}");
        assert!(variance < 0.01);
        // And is unsure far from them.
        assert!(fitted.predict(3.0).1 > fitted.predict(0.5).1 * 100.0);
    }

    #[test]
    fn rejects_non_finite_targets() {
        assert_eq!(
            Gp::fit(&[0.0], &[f64::NAN], Hyper::INITIAL).unwrap_err(),
            GpError::NonFinite
        );
        assert_eq!(
            Gp::fit(&[], &[], Hyper::INITIAL).unwrap_err(),
            GpError::Empty
        );
    }
}
