//! Packing tokenised inputs into one padding-free batch: all tokens laid end to end, with
//! `cu_seqlens` prefix offsets saying where each sequence starts. Built on the host while
//! batching, so the forward pass never has to read lengths back from a device.

use super::error::EngineError;

/// A packed batch. Sequence `i` owns rows `cu_seqlens[i]..cu_seqlens[i + 1]` of every
/// `[total_tokens, …]` tensor of the forward pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    input_ids: Vec<u32>,
    position_ids: Vec<u32>,
    token_type_ids: Vec<u32>,
    cu_seqlens: Vec<u32>,
    max_len: usize,
}

impl Batch {
    /// Packs token-id sequences. A sequence longer than `max_len` is cut to its first
    /// `max_len` ids when `truncate` is set, and is an [`EngineError::InputTooLong`]
    /// otherwise. Cutting raw ids drops a trailing `[SEP]`; texts should be truncated by the
    /// tokenizer instead (see `EmbeddingModel::tokenize`), which keeps it.
    pub fn pack<S: AsRef<[u32]>>(
        sequences: &[S],
        max_len: usize,
        truncate: bool,
    ) -> Result<Self, EngineError> {
        let mut total = 0usize;
        for (index, seq) in sequences.iter().enumerate() {
            let len = seq.as_ref().len();
            if len == 0 {
                return Err(EngineError::EmptyInput { index });
            }
            if len > max_len && !truncate {
                return Err(EngineError::InputTooLong {
                    index,
                    tokens: len,
                    max: max_len,
                });
            }
            total += len.min(max_len);
        }
        if total > u32::MAX as usize {
            return Err(EngineError::Unsupported(format!(
                "a batch of {total} tokens; split it"
            )));
        }

        let mut batch = Self {
            input_ids: Vec::with_capacity(total),
            position_ids: Vec::with_capacity(total),
            token_type_ids: vec![0; total],
            cu_seqlens: Vec::with_capacity(sequences.len() + 1),
            max_len: 0,
        };
        batch.cu_seqlens.push(0);
        for seq in sequences {
            let ids = &seq.as_ref()[..seq.as_ref().len().min(max_len)];
            batch.input_ids.extend_from_slice(ids);
            batch.position_ids.extend(0..ids.len() as u32);
            batch.cu_seqlens.push(batch.input_ids.len() as u32);
            batch.max_len = batch.max_len.max(ids.len());
        }
        Ok(batch)
    }

    /// Number of sequences.
    pub fn len(&self) -> usize {
        self.cu_seqlens.len() - 1
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tokens across all sequences: the rows the forward pass computes.
    pub fn total_tokens(&self) -> usize {
        self.input_ids.len()
    }

    /// The longest sequence's length.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Length of sequence `i` after truncation.
    pub fn seq_len(&self, i: usize) -> usize {
        (self.cu_seqlens[i + 1] - self.cu_seqlens[i]) as usize
    }

    pub fn input_ids(&self) -> &[u32] {
        &self.input_ids
    }

    /// Positions restart at 0 for every sequence.
    pub fn position_ids(&self) -> &[u32] {
        &self.position_ids
    }

    /// Segment ids; single-text inputs are all segment 0.
    pub fn token_type_ids(&self) -> &[u32] {
        &self.token_type_ids
    }

    /// `len() + 1` prefix offsets, from 0 to `total_tokens()`.
    pub fn cu_seqlens(&self) -> &[u32] {
        &self.cu_seqlens
    }

    /// The ids of sequence `i`.
    pub fn sequence(&self, i: usize) -> &[u32] {
        &self.input_ids[self.cu_seqlens[i] as usize..self.cu_seqlens[i + 1] as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packs_ragged_sequences_end_to_end() {
        let batch = Batch::pack(&[vec![101, 7, 102], vec![101, 102], vec![5]], 512, true).unwrap();
        assert_eq!(batch.len(), 3);
        assert_eq!(batch.total_tokens(), 6);
        assert_eq!(batch.input_ids(), &[101, 7, 102, 101, 102, 5]);
        assert_eq!(batch.position_ids(), &[0, 1, 2, 0, 1, 0]);
        assert_eq!(batch.token_type_ids(), &[0; 6]);
        assert_eq!(batch.cu_seqlens(), &[0, 3, 5, 6]);
        assert_eq!(batch.max_len(), 3);
        assert_eq!(batch.sequence(1), &[101, 102]);
        assert_eq!(batch.seq_len(2), 1);
    }

    #[test]
    fn truncates_long_sequences_to_max_len() {
        let long: Vec<u32> = (0..10).collect();
        let batch = Batch::pack(&[long, vec![1, 2]], 4, true).unwrap();
        assert_eq!(batch.cu_seqlens(), &[0, 4, 6]);
        assert_eq!(batch.sequence(0), &[0, 1, 2, 3]);
        assert_eq!(batch.position_ids(), &[0, 1, 2, 3, 0, 1]);
        assert_eq!(batch.max_len(), 4);
    }

    #[test]
    fn rejects_a_too_long_sequence_when_truncation_is_off() {
        let err = Batch::pack(&[vec![1, 2], vec![1, 2, 3, 4, 5]], 4, false).unwrap_err();
        assert!(
            matches!(
                err,
                EngineError::InputTooLong {
                    index: 1,
                    tokens: 5,
                    max: 4
                }
            ),
            "{err:?}"
        );
        assert!(err.is_input_error());
        // Exactly at the limit is fine.
        assert!(Batch::pack(&[vec![1, 2, 3, 4]], 4, false).is_ok());
    }

    #[test]
    fn rejects_an_empty_sequence() {
        let err = Batch::pack(&[vec![1], vec![]], 4, true).unwrap_err();
        assert!(
            matches!(err, EngineError::EmptyInput { index: 1 }),
            "{err:?}"
        );
    }

    #[test]
    fn an_empty_batch_has_one_offset() {
        let batch = Batch::pack::<Vec<u32>>(&[], 4, true).unwrap();
        assert!(batch.is_empty());
        assert_eq!(batch.cu_seqlens(), &[0]);
        assert_eq!(batch.total_tokens(), 0);
    }
}
