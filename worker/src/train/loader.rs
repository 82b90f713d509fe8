//! The data loader: each epoch visits the training rows in a fresh seeded order, in
//! batches of a fixed size (a short tail is dropped, so every step sees the same batch
//! size). Its position is three numbers and an RNG state; a checkpoint stores it, and a
//! restored loader yields exactly the batches the original would have.

use serde::{Deserialize, Serialize};

use super::rng::Rng;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderPosition {
    pub epoch: u64,
    /// Rows of this epoch's order already handed out.
    pub index: usize,
    /// The generator as it was before this epoch's shuffle; replaying it rebuilds the order.
    pub epoch_rng: Rng,
}

#[derive(Debug, Clone)]
pub struct Loader {
    rows: usize,
    batch: usize,
    order: Vec<usize>,
    position: LoaderPosition,
}

impl Loader {
    /// `batch` larger than the data is clamped to the data.
    pub fn new(rows: usize, batch: usize, seed: u64) -> Loader {
        Loader::resume(rows, batch, LoaderPosition { epoch: 0, index: 0, epoch_rng: Rng::derive(seed, "loader") })
    }

    pub fn resume(rows: usize, batch: usize, position: LoaderPosition) -> Loader {
        assert!(rows > 0, "a loader needs at least one row");
        let mut order: Vec<usize> = (0..rows).collect();
        position.epoch_rng.clone().shuffle(&mut order);
        Loader { rows, batch: batch.clamp(1, rows), order, position }
    }

    pub fn position(&self) -> &LoaderPosition {
        &self.position
    }

    pub fn batch_size(&self) -> usize {
        self.batch
    }

    /// The row indices of the next batch.
    pub fn next_batch(&mut self) -> Vec<usize> {
        if self.position.index + self.batch > self.rows {
            let mut rng = self.position.epoch_rng.clone();
            // Advance past this epoch's shuffle, then shuffle the next one.
            rng.shuffle(&mut vec![(); self.rows]);
            self.position = LoaderPosition { epoch: self.position.epoch + 1, index: 0, epoch_rng: rng.clone() };
            self.order = (0..self.rows).collect();
            rng.shuffle(&mut self.order);
        }
        let start = self.position.index;
        self.position.index += self.batch;
        self.order[start..start + self.batch].to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epochs_are_permutations_in_full_batches() {
        let mut loader = Loader::new(10, 3, 1);
        let first: Vec<usize> = (0..3).flat_map(|_| loader.next_batch()).collect();
        let mut sorted = first.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 9, "nine distinct rows, the tenth dropped");
        let second: Vec<usize> = (0..3).flat_map(|_| loader.next_batch()).collect();
        assert_eq!(loader.position().epoch, 1);
        assert_ne!(first, second, "each epoch has its own order");
    }

    #[test]
    fn resumed_loader_continues_identically() {
        let mut original = Loader::new(17, 4, 9);
        for _ in 0..6 {
            original.next_batch();
        }
        let saved = serde_json::to_string(original.position()).unwrap();
        let mut resumed = Loader::resume(17, 4, serde_json::from_str(&saved).unwrap());
        for _ in 0..20 {
            assert_eq!(original.next_batch(), resumed.next_batch());
        }
        assert_ne!(Loader::new(17, 4, 9).next_batch(), Loader::new(17, 4, 10).next_batch());
    }
}
