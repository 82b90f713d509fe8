//! exp and erf for the softmax and GELU kernels: an 8-lane AVX2 version for the hot loops and a
//! scalar one for tails and CPUs without AVX2. Both use the same approximations, so a row gives
//! the same result whichever path handled it.
//!
//! exp follows Cephes `expf` (range reduction by ln 2, degree-5 polynomial; about 1 ulp).
//! erf is the rational approximation Eigen and XLA use for f32 (odd degree-13 over even
//! degree-8 polynomial on [-4, 4], saturating to ±1 outside; a few ulp), which keeps GELU
//! exact in the sense sentence-transformers means: erf, not the tanh approximation.

const EXP_HI: f32 = 88.376_26;
const EXP_LO: f32 = -88.376_26;
const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const EXP_P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

const ERF_ALPHA: [f32; 7] = [
    -2.726_142_3e-10,
    2.770_681_4e-8,
    -2.101_024e-6,
    -5.692_506_4e-5,
    -7.349_906_3e-4,
    -2.954_6e-3,
    -1.609_603_3e-2,
];
const ERF_BETA: [f32; 5] = [
    -1.456_607_2e-5,
    -2.133_740_6e-4,
    -1.682_827e-3,
    -7.373_329e-3,
    -1.426_474e-2,
];

#[inline]
pub(super) fn exp_scalar(x: f32) -> f32 {
    let x = x.clamp(EXP_LO, EXP_HI);
    let n = (x * LOG2E + 0.5).floor();
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut y = EXP_P[0];
    for p in &EXP_P[1..] {
        y = y.mul_add(r, *p);
    }
    let y = y.mul_add(r * r, r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

#[inline]
pub(super) fn erf_scalar(x: f32) -> f32 {
    let x = x.clamp(-4.0, 4.0);
    let x2 = x * x;
    let mut p = ERF_ALPHA[0];
    for a in &ERF_ALPHA[1..] {
        p = p.mul_add(x2, *a);
    }
    let mut q = ERF_BETA[0];
    for b in &ERF_BETA[1..] {
        q = q.mul_add(x2, *b);
    }
    x * p / q
}

/// GELU with the exact (erf) form: `x/2 · (1 + erf(x/√2))`.
#[inline]
pub(super) fn gelu_scalar(x: f32) -> f32 {
    0.5 * x * (1.0 + erf_scalar(x * std::f32::consts::FRAC_1_SQRT_2))
}

/// `exp` of every value, in place: 8 AVX2 lanes at a time where the CPU has AVX2 and FMA,
/// `exp_scalar` on the tail and elsewhere (training's softmax and GELU derivative).
pub(crate) fn exp_in_place(values: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if super::has_avx2_fma() {
        // SAFETY: AVX2 and FMA detected just above.
        return unsafe { avx2::in_place(values, |v| avx2::exp(v), exp_scalar) };
    }
    values.iter_mut().for_each(|v| *v = exp_scalar(*v));
}

/// [`gelu_scalar`] of every value, in place, as [`exp_in_place`] (training's GELU).
pub(crate) fn gelu_in_place(values: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if super::has_avx2_fma() {
        // SAFETY: AVX2 and FMA detected just above.
        return unsafe { avx2::in_place(values, |v| avx2::gelu(v), gelu_scalar) };
    }
    values.iter_mut().for_each(|v| *v = gelu_scalar(*v));
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp(x: __m256) -> __m256 {
        let x = _mm256_min_ps(
            _mm256_max_ps(x, _mm256_set1_ps(EXP_LO)),
            _mm256_set1_ps(EXP_HI),
        );
        let n = _mm256_floor_ps(_mm256_fmadd_ps(
            x,
            _mm256_set1_ps(LOG2E),
            _mm256_set1_ps(0.5),
        ));
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
        let mut y = _mm256_set1_ps(EXP_P[0]);
        for p in &EXP_P[1..] {
            y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(*p));
        }
        let y = _mm256_add_ps(
            _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r),
            _mm256_set1_ps(1.0),
        );
        let pow2n = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        ));
        _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn erf(x: __m256) -> __m256 {
        let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-4.0)), _mm256_set1_ps(4.0));
        let x2 = _mm256_mul_ps(x, x);
        let mut p = _mm256_set1_ps(ERF_ALPHA[0]);
        for a in &ERF_ALPHA[1..] {
            p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(*a));
        }
        let mut q = _mm256_set1_ps(ERF_BETA[0]);
        for b in &ERF_BETA[1..] {
            q = _mm256_fmadd_ps(q, x2, _mm256_set1_ps(*b));
        }
        _mm256_div_ps(_mm256_mul_ps(x, p), q)
    }

    /// `lanes` over `values` 8 at a time, `scalar` over the tail.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn in_place(values: &mut [f32], lanes: impl Fn(__m256) -> __m256, scalar: fn(f32) -> f32) {
        let whole = values.len() / 8 * 8;
        let (body, tail) = values.split_at_mut(whole);
        for chunk in body.chunks_exact_mut(8) {
            _mm256_storeu_ps(chunk.as_mut_ptr(), lanes(_mm256_loadu_ps(chunk.as_ptr())));
        }
        tail.iter_mut().for_each(|v| *v = scalar(*v));
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn gelu(x: __m256) -> __m256 {
        let half_x = _mm256_mul_ps(x, _mm256_set1_ps(0.5));
        let e = erf(_mm256_mul_ps(
            x,
            _mm256_set1_ps(std::f32::consts::FRAC_1_SQRT_2),
        ));
        _mm256_fmadd_ps(half_x, e, half_x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// erf by its Taylor series in f64: slow, but exact to ~1e-12 on [-5, 5].
    fn erf_reference(x: f64) -> f64 {
        let mut term = x;
        let mut sum = x;
        for n in 1..200 {
            term *= -x * x / n as f64;
            sum += term / (2 * n + 1) as f64;
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    }

    #[test]
    fn scalar_exp_is_within_two_ulp_on_the_softmax_range() {
        for i in 0..=20_000 {
            let x = -87.0 + i as f32 * 0.00435;
            let want = (x as f64).exp();
            let got = exp_scalar(x) as f64;
            assert!(
                ((got - want) / want).abs() < 2.5e-7,
                "exp({x}) = {got}, want {want}"
            );
        }
    }

    #[test]
    fn scalar_erf_matches_the_series() {
        for i in 0..=8_000 {
            let x = -5.0 + i as f32 * 0.00125;
            let want = erf_reference(x as f64);
            let got = erf_scalar(x) as f64;
            assert!((got - want).abs() < 1e-6, "erf({x}) = {got}, want {want}");
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_lanes_agree_with_scalar() {
        use std::arch::x86_64::*;
        if !super::super::has_avx2_fma() {
            return;
        }
        let xs: Vec<f32> = (0..4096).map(|i| -20.0 + i as f32 * 0.01).collect();
        for chunk in xs.chunks_exact(8) {
            let (mut e, mut g) = ([0f32; 8], [0f32; 8]);
            // SAFETY: AVX2 and FMA were detected above; buffers hold 8 lanes.
            unsafe {
                let v = _mm256_loadu_ps(chunk.as_ptr());
                _mm256_storeu_ps(e.as_mut_ptr(), avx2::exp(v));
                _mm256_storeu_ps(g.as_mut_ptr(), avx2::gelu(v));
            }
            for k in 0..8 {
                let (es, gs) = (exp_scalar(chunk[k]), gelu_scalar(chunk[k]));
                assert!((e[k] - es).abs() <= es.abs() * 1e-6, "exp lane {k}");
                assert!(
                    (g[k] - gs).abs() <= 1e-6 * (1.0 + gs.abs()),
                    "gelu lane {k}"
                );
            }
        }
    }
}
