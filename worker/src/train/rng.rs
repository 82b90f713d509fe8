//! The training engine's only source of randomness: SplitMix64 (Steele, Lea and Flood,
//! "Fast splittable pseudorandom number generators", 2014). Its whole state is one `u64`,
//! so a checkpoint stores it exactly and a resumed run draws the same numbers an
//! uninterrupted one would. Weight initialisation, the validation split and shuffling all
//! draw from generators derived from the job's seed, never from a thread-local RNG.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rng {
    state: u64,
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng { state: seed }
    }

    /// An independent stream for one purpose (`"init"`, `"split"`, …), so adding a draw in
    /// one place does not shift the numbers another place sees.
    pub fn derive(seed: u64, purpose: &str) -> Rng {
        let mut mixer = Rng::new(seed);
        let mut state = mixer.next_u64();
        for byte in purpose.bytes() {
            state = Rng::new(state ^ u64::from(byte)).next_u64();
        }
        Rng::new(state)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box–Muller), from two uniform draws.
    pub fn next_gaussian(&mut self) -> f64 {
        let u = self.next_f64().max(1e-300);
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * self.next_f64()).cos()
    }

    /// Uniform in `[0, n)`; `n` must be positive. Lemire's multiply-shift; the bias is
    /// below 2^-32 for the sizes a data set has, which shuffling does not notice.
    pub fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }

    /// Fisher–Yates.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i + 1);
            items.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream_and_purposes_differ() {
        let a: Vec<u64> = (0..4).scan(Rng::new(7), |r, _| Some(r.next_u64())).collect();
        let b: Vec<u64> = (0..4).scan(Rng::new(7), |r, _| Some(r.next_u64())).collect();
        assert_eq!(a, b);
        assert_ne!(Rng::derive(7, "init").next_u64(), Rng::derive(7, "split").next_u64());
    }

    #[test]
    fn shuffle_is_a_permutation_and_below_stays_in_range() {
        let mut rng = Rng::new(3);
        let mut items: Vec<usize> = (0..100).collect();
        rng.shuffle(&mut items);
        assert_ne!(items, (0..100).collect::<Vec<_>>());
        items.sort();
        assert_eq!(items, (0..100).collect::<Vec<_>>());
        assert!((0..1000).all(|_| rng.below(7) < 7));
        let mean = (0..10_000).map(|_| rng.next_f64()).sum::<f64>() / 10_000.0;
        assert!((mean - 0.5).abs() < 0.02, "{mean}");
    }
}
