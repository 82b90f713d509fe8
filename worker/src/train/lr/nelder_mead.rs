//! Derivative-free minimisation (Nelder and Mead, 1965), the method AutoLRS's
//! forecaster uses for the decay rate (`scipy.optimize.fmin`). The GP uses it too, for
//! its three kernel hyper-parameters, where scikit-learn uses L-BFGS-B: with three
//! parameters and ten points the simplex converges to the same optimum without
//! gradients of the marginal likelihood.

/// When to stop: like `fmin`, the simplex must be small in both `x` and `f`.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// Edge of the initial simplex along each axis.
    pub step: f64,
    pub xtol: f64,
    pub ftol: f64,
    pub max_evals: usize,
}

/// The best point found and its value.
pub fn minimize(mut f: impl FnMut(&[f64]) -> f64, x0: &[f64], options: Options) -> (Vec<f64>, f64) {
    let dim = x0.len();
    // A NaN value ranks worst, so the simplex moves away from it.
    let mut eval = |x: &[f64]| {
        let value = f(x);
        if value.is_nan() {
            f64::INFINITY
        } else {
            value
        }
    };
    let mut simplex: Vec<(Vec<f64>, f64)> = Vec::with_capacity(dim + 1);
    simplex.push((x0.to_vec(), eval(x0)));
    for axis in 0..dim {
        let mut x = x0.to_vec();
        x[axis] += options.step;
        let value = eval(&x);
        simplex.push((x, value));
    }
    let mut evals = dim + 1;

    loop {
        simplex.sort_by(|a, b| a.1.total_cmp(&b.1));
        let best = &simplex[0];
        let x_spread = simplex[1..]
            .iter()
            .flat_map(|(x, _)| x.iter().zip(&best.0).map(|(a, b)| (a - b).abs()))
            .fold(0.0, f64::max);
        let f_spread = simplex[1..]
            .iter()
            .map(|(_, v)| (v - best.1).abs())
            .fold(0.0, f64::max);
        if (x_spread <= options.xtol && f_spread <= options.ftol) || evals >= options.max_evals {
            break;
        }

        let worst = simplex[dim].clone();
        let centroid: Vec<f64> = (0..dim)
            .map(|i| simplex[..dim].iter().map(|(x, _)| x[i]).sum::<f64>() / dim as f64)
            .collect();
        let towards = |t: f64| -> Vec<f64> {
            centroid
                .iter()
                .zip(&worst.0)
                .map(|(c, w)| c + t * (c - w))
                .collect()
        };

        let reflected = towards(1.0);
        let f_reflected = eval(&reflected);
        evals += 1;
        if f_reflected < simplex[0].1 {
            let expanded = towards(2.0);
            let f_expanded = eval(&expanded);
            evals += 1;
            simplex[dim] = if f_expanded < f_reflected {
                (expanded, f_expanded)
            } else {
                (reflected, f_reflected)
            };
            continue;
        }
        if f_reflected < simplex[dim - 1].1 {
            simplex[dim] = (reflected, f_reflected);
            continue;
        }
        // Contract outside when the reflection beat the worst point, inside otherwise.
        let (contracted, bound) = if f_reflected < worst.1 {
            (towards(0.5), f_reflected)
        } else {
            (towards(-0.5), worst.1)
        };
        let f_contracted = eval(&contracted);
        evals += 1;
        if f_contracted <= bound {
            simplex[dim] = (contracted, f_contracted);
            continue;
        }
        let best = simplex[0].0.clone();
        for vertex in simplex.iter_mut().skip(1) {
            let shrunk: Vec<f64> = best
                .iter()
                .zip(&vertex.0)
                .map(|(b, v)| b + 0.5 * (v - b))
                .collect();
            let value = eval(&shrunk);
            *vertex = (shrunk, value);
        }
        evals += dim;
    }
    simplex.swap_remove(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TIGHT: Options = Options {
        step: 0.5,
        xtol: 1e-8,
        ftol: 1e-12,
        max_evals: 5000,
    };

    #[test]
    fn finds_the_minimum_of_the_rosenbrock_valley() {
        let rosenbrock = |x: &[f64]| (1.0 - x[0]).powi(2) + 100.0 * (x[1] - x[0] * x[0]).powi(2);
        let (x, value) = minimize(rosenbrock, &[-1.2, 1.0], TIGHT);
        assert!(
            (x[0] - 1.0).abs() < 1e-4 && (x[1] - 1.0).abs() < 1e-4,
            "{x:?}"
        );
        assert!(value < 1e-8);
    }

    #[test]
    fn walks_far_from_a_poor_start_in_one_dimension() {
        let (x, _) = minimize(
            |x| (x[0] + 4.2).powi(2),
            &[0.0],
            Options {
                step: 0.00025,
                ..TIGHT
            },
        );
        assert!((x[0] + 4.2).abs() < 1e-6, "{x:?}");
    }
}
