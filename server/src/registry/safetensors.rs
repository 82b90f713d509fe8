//! Checks an uploaded `.safetensors` weights file before it enters the registry.
//! Only the length prefix and the JSON header are read, so a bad upload is refused with a
//! precise 422 instead of failing later when a worker maps it into memory.

use std::io::{Read, Seek, SeekFrom};

use std::collections::{HashMap, HashSet};

use serde::de::{DeserializeSeed, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

/// Largest header we accept. This is the limit of the `safetensors` crate that the workers
/// load with (100 MB, a little under 100 MiB), so nothing we accept is refused there.
pub const MAX_HEADER_LEN: u64 = 100_000_000;

/// A header may take this many bytes besides its tensors' shares: `__metadata__` and
/// the padding writers add.
pub const HEADER_BASE_BYTES: u64 = 64 << 10;

/// Each tensor's share of the header: its name, dtype, shape and offsets (real files
/// spend about 100 bytes on one). A header longer than the base plus one share per
/// tensor is refused, so what parsing holds grows with the tensors, not the bytes sent.
pub const HEADER_BYTES_PER_TENSOR: u64 = 1 << 10;

/// One tensor as declared in the header. Offsets are relative to the start of the data
/// section, which begins right after the header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<u64>,
    pub data_offsets: (u64, u64),
}

#[derive(Debug, thiserror::Error)]
pub enum SafetensorsError {
    #[error("The safetensors file is only {len} bytes long, shorter than its 8-byte length prefix; upload the complete file.")]
    TooShort { len: u64 },
    #[error("The safetensors header claims to be {len} bytes long, more than the {max} bytes allowed; the file is corrupt or not a safetensors file.", max = MAX_HEADER_LEN)]
    HeaderTooLong { len: u64 },
    #[error("The safetensors header claims to be {header_len} bytes long but the file has only {file_len} bytes; the upload is truncated or the file is not a safetensors file.")]
    HeaderPastEof { header_len: u64, file_len: u64 },
    #[error("The safetensors header is not valid JSON ({detail}); the file is corrupt or not a safetensors file.")]
    HeaderNotJson { detail: String },
    #[error("The safetensors header is JSON but not an object of tensor names; the file is not a safetensors file.")]
    HeaderNotObject,
    #[error("The safetensors header is {len} bytes long for {tensors} tensors; at most {allowed} bytes are allowed ({HEADER_BASE_BYTES} plus {HEADER_BYTES_PER_TENSOR} per tensor). Re-save the file without padding or large metadata.")]
    HeaderOverBudget { len: u64, tensors: usize, allowed: u64 },
    #[error("The safetensors header entry of tensor `{tensor}` is {len} bytes long, more than the {HEADER_BYTES_PER_TENSOR} one tensor may take; the header is corrupt or the name is too long.")]
    EntryOverBudget { tensor: String, len: u64 },
    #[error("Tensor `{tensor}` appears twice in the safetensors header; each tensor needs one entry.")]
    DuplicateTensor { tensor: String },
    #[error("The `__metadata__` entry of the safetensors header must map strings to strings; re-save the file with string metadata.")]
    BadMetadata,
    #[error("Tensor `{tensor}` in the safetensors header is malformed ({detail}); each tensor needs `dtype` (a string), `shape` (non-negative integers) and `data_offsets` ([begin, end]).")]
    BadTensorEntry { tensor: String, detail: String },
    #[error("Tensor `{tensor}` has dtype `{dtype}`, which is not a safetensors dtype; use one of {allowed}.", allowed = dtype_names())]
    UnknownDtype { tensor: String, dtype: String },
    #[error("Tensor `{tensor}` has data_offsets [{begin}, {end}] that end before they begin; the header is corrupt.")]
    ReversedOffsets {
        tensor: String,
        begin: u64,
        end: u64,
    },
    #[error("Tensor `{tensor}` has shape {shape:?} that is too large to address; the header is corrupt.")]
    SizeOverflow { tensor: String, shape: Vec<u64> },
    #[error("Tensor `{tensor}` ({dtype}, shape {shape:?}) needs {expected} bytes but its data_offsets span {actual}; the header does not match the data.")]
    SizeMismatch {
        tensor: String,
        dtype: String,
        shape: Vec<u64>,
        expected: u64,
        actual: u64,
    },
    #[error("Tensor `{tensor}` ends at byte {end} of the data section, which is only {data_len} bytes long; the upload is truncated or the header is corrupt.")]
    OutOfBounds {
        tensor: String,
        end: u64,
        data_len: u64,
    },
    #[error(
        "Tensors `{a}` and `{b}` overlap in the data section; each tensor needs its own bytes."
    )]
    Overlap { a: String, b: String },
    #[error("Tensor `{tensor}` starts at byte {begin} of the data section but the bytes before it end at {expected}; safetensors files must pack tensors with no gaps.")]
    Gap {
        tensor: String,
        begin: u64,
        expected: u64,
    },
    #[error("The safetensors data section is {data_len} bytes long but its tensors cover only {used}; remove the trailing bytes or re-save the file.")]
    TrailingBytes { data_len: u64, used: u64 },
    #[error(
        "The safetensors file declares no tensors; upload a file that contains the model weights."
    )]
    NoTensors,
    #[error("The safetensors file could not be read: {0}.")]
    Io(#[from] std::io::Error),
}

/// Element sizes in bytes, as the safetensors format defines them.
const DTYPES: &[(&str, u64)] = &[
    ("BOOL", 1),
    ("U8", 1),
    ("I8", 1),
    ("F8_E5M2", 1),
    ("F8_E4M3", 1),
    ("I16", 2),
    ("U16", 2),
    ("F16", 2),
    ("BF16", 2),
    ("I32", 4),
    ("U32", 4),
    ("F32", 4),
    ("F64", 8),
    ("I64", 8),
    ("U64", 8),
];

fn dtype_size(dtype: &str) -> Option<u64> {
    DTYPES
        .iter()
        .find(|(name, _)| *name == dtype)
        .map(|(_, size)| *size)
}

fn dtype_names() -> String {
    DTYPES
        .iter()
        .map(|(name, _)| *name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// A header entry before its fields are checked against each other.
#[derive(Deserialize)]
struct RawTensor {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: (u64, u64),
}

/// Validates the header of a safetensors file and returns its tensors ordered by offset.
///
/// The rules are those of the `safetensors` crate: besides fitting the file, tensors must
/// tile the data section exactly (no overlap, no gap, no trailing bytes), because the
/// loader on the workers rejects anything else.
pub fn validate(file: &mut std::fs::File) -> Result<Vec<TensorInfo>, SafetensorsError> {
    let file_len = file.metadata()?.len();
    if file_len < 8 {
        return Err(SafetensorsError::TooShort { len: file_len });
    }
    file.seek(SeekFrom::Start(0))?;
    let mut prefix = [0u8; 8];
    file.read_exact(&mut prefix)?;
    let header_len = u64::from_le_bytes(prefix);
    // Both bounds are checked before allocating, so a lying prefix cannot make us
    // reserve more memory than the file itself holds.
    if header_len > MAX_HEADER_LEN {
        return Err(SafetensorsError::HeaderTooLong { len: header_len });
    }
    let data_start = 8 + header_len;
    if data_start > file_len {
        return Err(SafetensorsError::HeaderPastEof {
            header_len,
            file_len,
        });
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header)?;

    parse_header(&header, file_len - data_start)
}

fn parse_header(header: &[u8], data_len: u64) -> Result<Vec<TensorInfo>, SafetensorsError> {
    let text = std::str::from_utf8(header).map_err(|e| SafetensorsError::HeaderNotJson {
        detail: e.to_string(),
    })?;
    let mut failure = None;
    let seed = EntriesSeed {
        failure: &mut failure,
    };
    let mut deserializer = serde_json::Deserializer::from_str(text);
    let parsed = seed.deserialize(&mut deserializer).and_then(|tensors| deserializer.end().map(|()| tensors));
    let mut tensors = match (parsed, failure) {
        (_, Some(failure)) => return Err(failure),
        (Ok(tensors), None) => tensors,
        // Entries' own mistakes are in `failure`; a type mismatch left is the top level's.
        (Err(e), None) if e.classify() == serde_json::error::Category::Data => {
            return Err(SafetensorsError::HeaderNotObject)
        }
        (Err(e), None) => {
            return Err(SafetensorsError::HeaderNotJson {
                detail: e.to_string(),
            })
        }
    };
    if tensors.is_empty() {
        return Err(SafetensorsError::NoTensors);
    }
    let allowed = HEADER_BASE_BYTES + HEADER_BYTES_PER_TENSOR * tensors.len() as u64;
    if header.len() as u64 > allowed {
        return Err(SafetensorsError::HeaderOverBudget {
            len: header.len() as u64,
            tensors: tensors.len(),
            allowed,
        });
    }

    // Sorting by (begin, end) puts empty tensors before a tensor that starts at the
    // same byte, so they never count as overlapping it.
    tensors.sort_by_key(|t| t.data_offsets);
    let mut covered_to = 0u64;
    let mut previous: Option<&TensorInfo> = None;
    for tensor in &tensors {
        let (begin, end) = tensor.data_offsets;
        if end > data_len {
            return Err(SafetensorsError::OutOfBounds {
                tensor: tensor.name.clone(),
                end,
                data_len,
            });
        }
        if begin < covered_to {
            return Err(SafetensorsError::Overlap {
                a: previous.map(|p| p.name.clone()).unwrap_or_default(),
                b: tensor.name.clone(),
            });
        }
        if begin > covered_to {
            return Err(SafetensorsError::Gap {
                tensor: tensor.name.clone(),
                begin,
                expected: covered_to,
            });
        }
        covered_to = end;
        previous = Some(tensor);
    }
    if covered_to != data_len {
        return Err(SafetensorsError::TrailingBytes {
            data_len,
            used: covered_to,
        });
    }
    Ok(tensors)
}

/// Reads the header's entries one at a time, so parsing holds the decoded tensors and not
/// a JSON tree of whatever the header contains: each entry is checked against its share
/// of the header ([`HEADER_BYTES_PER_TENSOR`], or [`HEADER_BASE_BYTES`] for the
/// metadata) before it is decoded. A mistake is left in `failure` (serde's error type
/// cannot carry it) and parsing stops there.
struct EntriesSeed<'f> {
    failure: &'f mut Option<SafetensorsError>,
}

impl<'de> DeserializeSeed<'de> for EntriesSeed<'_> {
    type Value = Vec<TensorInfo>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for EntriesSeed<'_> {
    type Value = Vec<TensorInfo>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an object of tensor names")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut tensors = Vec::new();
        let mut names = HashSet::new();
        while let Some(name) = map.next_key::<String>()? {
            let entry: &RawValue = map.next_value()?;
            let checked = if name == "__metadata__" {
                check_metadata(entry).map(|()| None)
            } else if !names.insert(name.clone()) {
                Err(SafetensorsError::DuplicateTensor { tensor: name })
            } else {
                check_tensor(name, entry).map(Some)
            };
            match checked {
                Ok(tensor) => tensors.extend(tensor),
                Err(failure) => {
                    *self.failure = Some(failure);
                    return Err(serde::de::Error::custom("the header has a bad entry"));
                }
            }
        }
        Ok(tensors)
    }
}

fn check_metadata(entry: &RawValue) -> Result<(), SafetensorsError> {
    if entry.get().len() as u64 > HEADER_BASE_BYTES {
        return Err(SafetensorsError::HeaderOverBudget {
            len: entry.get().len() as u64,
            tensors: 0,
            allowed: HEADER_BASE_BYTES,
        });
    }
    serde_json::from_str::<HashMap<String, String>>(entry.get())
        .map(drop)
        .map_err(|_| SafetensorsError::BadMetadata)
}

fn check_tensor(name: String, entry: &RawValue) -> Result<TensorInfo, SafetensorsError> {
    let len = (name.len() + entry.get().len()) as u64;
    if len > HEADER_BYTES_PER_TENSOR {
        return Err(SafetensorsError::EntryOverBudget {
            tensor: name.chars().take(64).collect(),
            len,
        });
    }
    let raw: RawTensor = match serde_json::from_str(entry.get()) {
        Ok(raw) => raw,
        Err(e) => {
            return Err(SafetensorsError::BadTensorEntry {
                tensor: name,
                detail: e.to_string(),
            })
        }
    };
    let Some(element_size) = dtype_size(&raw.dtype) else {
        return Err(SafetensorsError::UnknownDtype {
            tensor: name,
            dtype: raw.dtype,
        });
    };
    let (begin, end) = raw.data_offsets;
    if begin > end {
        return Err(SafetensorsError::ReversedOffsets {
            tensor: name,
            begin,
            end,
        });
    }
    let expected = raw
        .shape
        .iter()
        .try_fold(element_size, |bytes, &dim| bytes.checked_mul(dim));
    let Some(expected) = expected else {
        return Err(SafetensorsError::SizeOverflow {
            tensor: name,
            shape: raw.shape,
        });
    };
    if end - begin != expected {
        return Err(SafetensorsError::SizeMismatch {
            tensor: name,
            dtype: raw.dtype,
            shape: raw.shape,
            expected,
            actual: end - begin,
        });
    }
    Ok(TensorInfo {
        name,
        dtype: raw.dtype,
        shape: raw.shape,
        data_offsets: raw.data_offsets,
    })
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use serde_json::{json, Value};

    use super::*;

    /// Writes `prefix ++ header ++ data` to a temporary file, with the prefix given
    /// explicitly so tests can lie about the header length.
    fn file_with(prefix: u64, header: &[u8], data: &[u8]) -> std::fs::File {
        let mut file = tempfile::tempfile().expect("temp file");
        file.write_all(&prefix.to_le_bytes()).expect("write");
        file.write_all(header).expect("write");
        file.write_all(data).expect("write");
        file
    }

    /// A well-formed file: the honest header length followed by `data_len` zero bytes.
    fn safetensors(header: Value, data_len: usize) -> std::fs::File {
        let header = header.to_string().into_bytes();
        file_with(header.len() as u64, &header, &vec![0u8; data_len])
    }

    fn two_tensors() -> Value {
        json!({
            "__metadata__": {"format": "pt"},
            "b": {"dtype": "F16", "shape": [3], "data_offsets": [24, 30]},
            "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        })
    }

    #[test]
    fn accepts_valid_file_and_lists_tensors_by_offset() {
        let tensors = validate(&mut safetensors(two_tensors(), 30)).expect("valid file");
        assert_eq!(
            tensors,
            vec![
                TensorInfo {
                    name: "a".into(),
                    dtype: "F32".into(),
                    shape: vec![2, 3],
                    data_offsets: (0, 24),
                },
                TensorInfo {
                    name: "b".into(),
                    dtype: "F16".into(),
                    shape: vec![3],
                    data_offsets: (24, 30),
                },
            ]
        );
    }

    #[test]
    fn accepts_scalars_empty_tensors_and_space_padded_header() {
        let header = json!({
            "empty": {"dtype": "I64", "shape": [0, 4], "data_offsets": [0, 0]},
            "scalar": {"dtype": "BF16", "shape": [], "data_offsets": [0, 2]},
        });
        // The reference writer pads the header with spaces to an 8-byte boundary.
        let mut bytes = header.to_string().into_bytes();
        bytes.extend_from_slice(b"      ");
        let tensors =
            validate(&mut file_with(bytes.len() as u64, &bytes, &[0, 0])).expect("valid file");
        assert_eq!(tensors.len(), 2);
    }

    #[test]
    fn header_is_bounded_by_its_tensor_count() {
        let mut padded = two_tensors().to_string().into_bytes();
        padded.resize((HEADER_BASE_BYTES + 2 * HEADER_BYTES_PER_TENSOR) as usize, b' ');
        assert!(validate(&mut file_with(padded.len() as u64, &padded, &[0; 30])).is_ok());
        padded.push(b' ');
        let err = validate(&mut file_with(padded.len() as u64, &padded, &[0; 30])).unwrap_err();
        assert!(matches!(err, SafetensorsError::HeaderOverBudget { tensors: 2, .. }), "{err:?}");
        let twice = br#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#;
        let err = validate(&mut file_with(twice.len() as u64, twice, &[0; 2])).unwrap_err();
        assert!(matches!(err, SafetensorsError::DuplicateTensor { .. }), "{err:?}");
    }

    #[test]
    fn rejects_truncated_file() {
        let mut file = tempfile::tempfile().expect("temp file");
        file.write_all(&[1, 2, 3]).expect("write");
        assert!(matches!(
            validate(&mut file),
            Err(SafetensorsError::TooShort { len: 3 })
        ));
    }

    #[test]
    fn rejects_header_length_past_eof() {
        let mut file = file_with(1_000, b"{}", &[]);
        assert!(matches!(
            validate(&mut file),
            Err(SafetensorsError::HeaderPastEof {
                header_len: 1_000,
                file_len: 10
            })
        ));
    }

    #[test]
    fn rejects_header_length_lie() {
        let header = two_tensors().to_string().into_bytes();
        let real = header.len() as u64;
        // Shorter cuts the JSON off; longer swallows data bytes into it.
        for claimed in [real - 5, real + 5] {
            let mut file = file_with(claimed, &header, &[7u8; 30]);
            let err = validate(&mut file).expect_err("header length lies");
            assert!(
                matches!(err, SafetensorsError::HeaderNotJson { .. }),
                "{err:?}"
            );
        }
    }

    #[test]
    fn rejects_oversized_header_length() {
        let mut file = file_with(MAX_HEADER_LEN + 1, b"{}", &[]);
        assert!(matches!(
            validate(&mut file),
            Err(SafetensorsError::HeaderTooLong { .. })
        ));
        let mut file = file_with(u64::MAX, b"{}", &[]);
        assert!(matches!(
            validate(&mut file),
            Err(SafetensorsError::HeaderTooLong { .. })
        ));
    }

    #[test]
    fn rejects_non_json_header() {
        let mut file = file_with(4, b"\xff\xfe{}", &[]);
        assert!(matches!(
            validate(&mut file),
            Err(SafetensorsError::HeaderNotJson { .. })
        ));
        let mut file = file_with(8, b"not json", &[]);
        assert!(matches!(
            validate(&mut file),
            Err(SafetensorsError::HeaderNotJson { .. })
        ));
        let mut file = safetensors(json!([1, 2]), 0);
        assert!(matches!(
            validate(&mut file),
            Err(SafetensorsError::HeaderNotObject)
        ));
    }

    #[test]
    fn rejects_overlapping_tensors() {
        let header = json!({
            "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
            "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]},
        });
        let err = validate(&mut safetensors(header, 6)).expect_err("overlap");
        assert!(matches!(&err, SafetensorsError::Overlap { a, b } if a == "a" && b == "b"));
        assert!(err.to_string().contains("`a`") && err.to_string().contains("`b`"));
    }

    #[test]
    fn rejects_gaps_and_trailing_bytes() {
        let gap = json!({"a": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}});
        let err = validate(&mut safetensors(gap, 6)).expect_err("gap");
        assert!(matches!(
            err,
            SafetensorsError::Gap {
                begin: 2,
                expected: 0,
                ..
            }
        ));

        let short = json!({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}});
        let err = validate(&mut safetensors(short, 6)).expect_err("trailing bytes");
        assert!(matches!(
            err,
            SafetensorsError::TrailingBytes {
                data_len: 6,
                used: 4
            }
        ));
    }

    #[test]
    fn rejects_wrong_dtype() {
        let header = json!({"w": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}});
        let err = validate(&mut safetensors(header, 16)).expect_err("unknown dtype");
        assert!(
            matches!(&err, SafetensorsError::UnknownDtype { tensor, dtype }
            if tensor == "w" && dtype == "F128")
        );
        assert!(
            err.to_string().contains("BF16"),
            "message lists the allowed dtypes"
        );
    }

    #[test]
    fn rejects_size_not_matching_shape() {
        let header = json!({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 8]}});
        let err = validate(&mut safetensors(header, 8)).expect_err("size mismatch");
        assert!(matches!(
            err,
            SafetensorsError::SizeMismatch {
                expected: 16,
                actual: 8,
                ..
            }
        ));
        assert!(err.to_string().contains("`w`"));
    }

    #[test]
    fn rejects_shape_whose_size_overflows() {
        let huge = u64::MAX / 2;
        let header = json!({"w": {"dtype": "F32", "shape": [huge, 4], "data_offsets": [0, 8]}});
        let err = validate(&mut safetensors(header, 8)).expect_err("overflow");
        assert!(matches!(err, SafetensorsError::SizeOverflow { .. }));
    }

    #[test]
    fn rejects_offsets_past_data_section() {
        let header = json!({"w": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}});
        let err = validate(&mut safetensors(header, 4)).expect_err("past data section");
        assert!(matches!(
            err,
            SafetensorsError::OutOfBounds {
                end: 8,
                data_len: 4,
                ..
            }
        ));
    }

    #[test]
    fn rejects_reversed_offsets_and_malformed_entries() {
        let reversed = json!({"w": {"dtype": "U8", "shape": [0], "data_offsets": [4, 0]}});
        let err = validate(&mut safetensors(reversed, 4)).expect_err("reversed");
        assert!(matches!(err, SafetensorsError::ReversedOffsets { .. }));

        let negative = json!({"w": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}});
        let err = validate(&mut safetensors(negative, 0)).expect_err("negative dim");
        assert!(matches!(&err, SafetensorsError::BadTensorEntry { tensor, .. } if tensor == "w"));

        let missing = json!({"w": {"dtype": "U8", "shape": [1]}});
        let err = validate(&mut safetensors(missing, 1)).expect_err("no offsets");
        assert!(matches!(err, SafetensorsError::BadTensorEntry { .. }));
    }

    #[test]
    fn rejects_non_string_metadata_and_empty_header() {
        let header = json!({
            "__metadata__": {"epoch": 3},
            "w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
        });
        let err = validate(&mut safetensors(header, 1)).expect_err("metadata");
        assert!(matches!(err, SafetensorsError::BadMetadata));

        let only_metadata = json!({"__metadata__": {"format": "pt"}});
        let err = validate(&mut safetensors(only_metadata, 0)).expect_err("no tensors");
        assert!(matches!(err, SafetensorsError::NoTensors));
    }

    #[test]
    fn accepts_real_minilm_weights() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../.assets/all-MiniLM-L6-v2/model.safetensors");
        let Ok(mut file) = std::fs::File::open(&path) else {
            eprintln!("skipping: {} not present", path.display());
            return;
        };
        let tensors = validate(&mut file).expect("MiniLM weights are valid");
        let embeddings = tensors
            .iter()
            .find(|t| t.name == "embeddings.word_embeddings.weight")
            .expect("word embeddings present");
        assert_eq!(embeddings.shape, vec![30522, 384]);
    }
}
