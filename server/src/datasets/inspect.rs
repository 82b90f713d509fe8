//! Reads an uploaded dataset once, start to end, to check it and learn its shape: the
//! columns (in file order) with their types, missing values and distinct values, and the
//! number of rows. Pure: it sees a reader, not the request or the database.
//!
//! What it accepts the worker's parser (`worker/src/train/data.rs`) reads the same way: the
//! same `csv` reader settings, the same number rule ([`parse_number`]), the same missing
//! values. A job that reads a column with missing values is refused at submission.

use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::io::{BufRead, BufReader, Read};
use std::rc::Rc;

use serde::de::{Deserializer, MapAccess, Visitor};
use tessera_api::datasets::{self, parse_number, ColumnType, DatasetColumn, DatasetFormat};
use tessera_api::train::MAX_CLASSES;

#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    pub columns: Vec<DatasetColumn>,
    pub rows: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum InspectError {
    /// A mistake in the file, with the 1-based line where it was found.
    #[error("line {line}: {message}")]
    Invalid { line: u64, message: String },
    #[error("{0}")]
    Empty(String),
    /// A JSONL line or CSV record longer than [`MAX_ROW_BYTES`] (a 413: it is a size).
    #[error("line {line}: a row is longer than {MAX_ROW_BYTES} bytes, the most one JSONL line or CSV record may take; split long texts or upload them shorter")]
    RowTooLong { line: u64 },
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

fn invalid(line: u64, message: impl Into<String>) -> InspectError {
    InspectError::Invalid { line, message: message.into() }
}

const MAX_COLUMNS: usize = 10_000;

/// Most bytes of one JSONL line or one CSV record. The reader holds a row whole while it
/// checks it, so this bounds what one row can make the server hold.
pub const MAX_ROW_BYTES: usize = 1 << 20;
const MAX_NAME_LEN: usize = 200;
/// Most bytes of all column names together (10000 names of 26 bytes): a job's spec
/// carries those it reads, once per rank of a data-parallel job.
const MAX_NAMES_BYTES: usize = 256 << 10;

/// Most value hashes the distinct counts of all columns hold at once (2^21, some 40 MB with
/// the sets' overhead). A column's set is dropped when it passes [`MAX_CLASSES`], so this
/// binds only on wide files of many columns still under the cap: the column whose set would
/// pass it is left uncounted, and a job on it finds its class count on the worker.
const DISTINCT_BUDGET: usize = 1 << 21;

/// A column's distinct values so far, as 64-bit hashes of the values the worker compares.
#[derive(Debug, Clone)]
enum Distinct {
    Counting(HashSet<u64>),
    /// More than [`MAX_CLASSES`].
    Over,
    /// Dropped to stay within [`DISTINCT_BUDGET`].
    Uncounted,
}

/// What the values of one column have been so far.
#[derive(Debug, Clone)]
struct Seen {
    number: bool,
    text: bool,
    missing: u64,
    distinct: Distinct,
}

impl Default for Seen {
    fn default() -> Seen {
        Seen { number: false, text: false, missing: 0, distinct: Distinct::Counting(HashSet::new()) }
    }
}

impl Seen {
    fn kind(&self) -> ColumnType {
        if self.number && !self.text {
            ColumnType::Number
        } else {
            ColumnType::String
        }
    }

    /// Counts a value that is not missing; `held` is the hashes all columns' sets hold.
    fn count(&mut self, value: impl Hash, held: &mut usize) {
        let Distinct::Counting(set) = &mut self.distinct else { return };
        let mut hasher = DefaultHasher::new();
        value.hash(&mut hasher);
        if !set.insert(hasher.finish()) {
            return;
        }
        *held += 1;
        let size = set.len();
        if size > MAX_CLASSES || *held > DISTINCT_BUDGET {
            *held -= size;
            self.distinct = if size > MAX_CLASSES { Distinct::Over } else { Distinct::Uncounted };
        }
    }

    fn column(&self, name: String) -> DatasetColumn {
        let distinct = match &self.distinct {
            Distinct::Counting(set) => Some(set.len() as u64),
            Distinct::Over => Some(MAX_CLASSES as u64 + 1),
            Distinct::Uncounted => None,
        };
        DatasetColumn { name, kind: self.kind(), missing: self.missing, distinct }
    }
}

fn check_names(names: &[String], line: u64) -> Result<(), InspectError> {
    if names.is_empty() {
        return Err(invalid(line, "there are no columns"));
    }
    if names.len() > MAX_COLUMNS {
        return Err(invalid(line, format!("there are {} columns; at most {MAX_COLUMNS} are allowed", names.len())));
    }
    let total: usize = names.iter().map(String::len).sum();
    if total > MAX_NAMES_BYTES {
        let message = format!("the column names take {total} bytes; at most {MAX_NAMES_BYTES} are allowed");
        return Err(invalid(line, message));
    }
    let mut unique = HashSet::new();
    for name in names {
        if name.trim().is_empty() || name.len() > MAX_NAME_LEN {
            return Err(invalid(line, format!("column names have 1 to {MAX_NAME_LEN} characters; found {name:?}")));
        }
        if name.chars().any(char::is_control) {
            return Err(invalid(line, format!("column names hold no control characters; found {name:?}")));
        }
        if !unique.insert(name.as_str()) {
            return Err(invalid(line, format!("the column {name:?} appears twice")));
        }
    }
    Ok(())
}

fn summary(names: Vec<String>, seen: Vec<Seen>, rows: u64) -> Result<Summary, InspectError> {
    if rows == 0 {
        return Err(InspectError::Empty("The dataset has no data rows.".into()));
    }
    let columns = names.into_iter().zip(seen).map(|(name, seen)| seen.column(name)).collect();
    Ok(Summary { columns, rows })
}

pub fn inspect(format: DatasetFormat, reader: impl Read) -> Result<Summary, InspectError> {
    match format {
        DatasetFormat::Csv => inspect_csv(reader),
        DatasetFormat::Jsonl => inspect_jsonl(reader),
    }
}

/// CSV with a header row: every record has as many fields as the header, the bytes are
/// UTF-8. A column is a number column when every field that is not blank is a number
/// ([`parse_number`]); blank fields are missing values. A quote inside an unquoted field is
/// kept as written (`5" screen`), as the `csv` reader does.
fn inspect_csv(reader: impl Read) -> Result<Summary, InspectError> {
    let record_start = Rc::new(Cell::new(0u64));
    let metered = Metered { inner: reader, pulled: 0, record_start: record_start.clone() };
    let mut csv = csv::ReaderBuilder::new().has_headers(true).flexible(false).from_reader(metered);
    let names: Vec<String> = csv.headers().map_err(|e| csv_error(e, 1))?.iter().map(str::to_string).collect();
    record_start.set(csv.position().byte());
    if names.iter().all(String::is_empty) && names.len() <= 1 {
        return Err(InspectError::Empty("The file is empty; a CSV dataset starts with a header row.".into()));
    }
    check_names(&names, 1)?;
    let mut seen = vec![Seen::default(); names.len()];
    let (mut rows, mut held) = (0u64, 0usize);
    let mut record = csv::StringRecord::new();
    while csv.read_record(&mut record).map_err(|e| csv_error(e, csv.position().line()))? {
        record_start.set(csv.position().byte());
        for (field, seen) in record.iter().zip(seen.iter_mut()) {
            let field = field.trim();
            if field.is_empty() {
                seen.missing += 1;
                continue;
            }
            match parse_number(field) {
                Some(_) => seen.number = true,
                None => seen.text = true,
            }
            seen.count(field, &mut held);
        }
        rows += 1;
    }
    summary(names, seen, rows)
}

/// The CSV reader's source, counting what it pulls: once the record being read passes
/// [`MAX_ROW_BYTES`] (with room for the reader's own buffer), reading stops with
/// [`RowOverLimit`] instead of letting the record grow without end.
struct Metered<R> {
    inner: R,
    pulled: u64,
    /// Where the record being read starts, set by the loop after each record.
    record_start: Rc<Cell<u64>>,
}

/// How far the CSV reader reads ahead of the record it parses (its buffer).
const CSV_READ_AHEAD: u64 = 64 << 10;

#[derive(Debug, thiserror::Error)]
#[error("the CSV record is longer than {MAX_ROW_BYTES} bytes")]
struct RowOverLimit;

impl<R: Read> Read for Metered<R> {
    fn read(&mut self, buffer: &mut [u8]) -> std::io::Result<usize> {
        let record = self.pulled.saturating_sub(self.record_start.get());
        if record > MAX_ROW_BYTES as u64 + CSV_READ_AHEAD {
            return Err(std::io::Error::other(RowOverLimit));
        }
        let n = self.inner.read(buffer)?;
        self.pulled += n as u64;
        Ok(n)
    }
}

/// The error as the client reads it; `at` is the line the failing record starts on,
/// for errors that carry no position of their own.
fn csv_error(error: csv::Error, at: u64) -> InspectError {
    let line = error.position().map(|p| p.line()).unwrap_or(at);
    match error.into_kind() {
        csv::ErrorKind::Io(io) if io.get_ref().is_some_and(|e| e.is::<RowOverLimit>()) => {
            InspectError::RowTooLong { line }
        }
        csv::ErrorKind::Io(io) => InspectError::Io(io),
        csv::ErrorKind::Utf8 { err, .. } => {
            invalid(line, format!("field {} is not valid UTF-8; save the file as UTF-8", err.field() + 1))
        }
        csv::ErrorKind::UnequalLengths { expected_len, len, .. } => {
            invalid(line, format!("this row has {len} fields but the header has {expected_len}"))
        }
        other => invalid(line, format!("{other:?}")),
    }
}

/// One JSONL line: a flat object, keys in the order written.
struct FlatObject(Vec<(String, serde_json::Value)>);

impl<'de> serde::Deserialize<'de> for FlatObject {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<FlatObject, D::Error> {
        struct ObjectVisitor;
        impl<'de> Visitor<'de> for ObjectVisitor {
            type Value = FlatObject;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<FlatObject, A::Error> {
                let mut entries = Vec::new();
                while let Some(entry) = map.next_entry::<String, serde_json::Value>()? {
                    entries.push(entry);
                }
                Ok(FlatObject(entries))
            }
        }
        deserializer.deserialize_map(ObjectVisitor)
    }
}

/// JSONL: one flat JSON object per line, every line with the same keys. Values are
/// numbers within f32's range ([`datasets::to_f32`]), strings, booleans (read as strings)
/// or null; null and blank strings are missing values. A key holding numbers on some lines
/// and strings on others is refused, so a column has one type.
fn inspect_jsonl(reader: impl Read) -> Result<Summary, InspectError> {
    let mut reader = BufReader::new(reader);
    let mut names: Option<Vec<String>> = None;
    let mut seen: Vec<Seen> = Vec::new();
    // Each key's column, so a row of k keys is k lookups, not k²/2 comparisons.
    let mut positions: HashMap<String, usize> = HashMap::new();
    let (mut rows, mut held) = (0u64, 0usize);
    let mut bytes = Vec::new();
    let mut number = 0u64;
    loop {
        bytes.clear();
        number += 1;
        // One byte past the limit and the line ending tell a long line from a full one.
        let read = (&mut reader).take(MAX_ROW_BYTES as u64 + 3).read_until(b'\n', &mut bytes)?;
        if read == 0 {
            break;
        }
        let content = bytes.strip_suffix(b"\n").map(|b| b.strip_suffix(b"\r").unwrap_or(b)).unwrap_or(&bytes);
        if content.len() > MAX_ROW_BYTES {
            return Err(InspectError::RowTooLong { line: number });
        }
        let line = std::str::from_utf8(content)
            .map_err(|_| invalid(number, "the line is not valid UTF-8; save the file as UTF-8"))?;
        if line.trim().is_empty() {
            continue;
        }
        let FlatObject(entries) =
            serde_json::from_str(line).map_err(|e| invalid(number, format!("not a JSON object ({e})")))?;
        let keys: Vec<String> = entries.iter().map(|(k, _)| k.clone()).collect();
        let names = match &names {
            Some(names) => names,
            None => {
                check_names(&keys, number)?;
                seen = vec![Seen::default(); keys.len()];
                positions = keys.iter().enumerate().map(|(i, k)| (k.clone(), i)).collect();
                names.insert(keys.clone())
            }
        };
        let present: HashSet<&str> = keys.iter().map(String::as_str).collect();
        if keys.len() != names.len() || present.len() != keys.len() || !keys.iter().all(|k| positions.contains_key(k)) {
            // By hash, and a few of each named: a line may hold a hundred thousand keys.
            let missing: Vec<&String> = names.iter().filter(|n| !present.contains(n.as_str())).take(5).collect();
            let extra: Vec<&String> = keys.iter().filter(|k| !positions.contains_key(*k)).take(5).collect();
            return Err(invalid(
                number,
                format!(
                    "the keys differ from the first line's (missing {missing:?}, extra {extra:?}, the first 5 of each); \
                     every line needs the same keys"
                ),
            ));
        }
        for (key, value) in &entries {
            let slot = &mut seen[positions[key.as_str()]];
            match value {
                serde_json::Value::Null => slot.missing += 1,
                serde_json::Value::String(text) if text.trim().is_empty() => slot.missing += 1,
                serde_json::Value::Number(n) if n.as_f64().and_then(datasets::to_f32).is_none() => {
                    return Err(invalid(
                        number,
                        format!(
                            "{key:?} holds {n}, outside ±3.4e38, the range of the f32 numbers training reads; \
                             scale the column or write its values as strings"
                        ),
                    ))
                }
                serde_json::Value::Number(n) => {
                    slot.number = true;
                    slot.count(n, &mut held);
                }
                // As the worker reads them: a string without its surrounding spaces, a boolean
                // as `true` or `false`.
                serde_json::Value::String(text) => {
                    slot.text = true;
                    slot.count(text.trim(), &mut held);
                }
                serde_json::Value::Bool(flag) => {
                    slot.text = true;
                    slot.count(if *flag { "true" } else { "false" }, &mut held);
                }
                _ => {
                    return Err(invalid(
                        number,
                        format!("the value of {key:?} is nested; each line must be a flat object"),
                    ))
                }
            }
            if slot.number && slot.text {
                return Err(invalid(number, format!("{key:?} holds both numbers and strings; give a column one type")));
            }
        }
        rows += 1;
    }
    let Some(names) = names else {
        return Err(InspectError::Empty("The file has no JSON lines.".into()));
    };
    summary(names, seen, rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn columns(summary: &Summary) -> Vec<(&str, ColumnType)> {
        summary.columns.iter().map(|c| (c.name.as_str(), c.kind)).collect()
    }

    #[test]
    fn csv_columns_are_typed_and_rows_counted() {
        let text = "x,y,label\n1,2.5,cat\n3,,dog\n-1e3,4,\"a, b\"\n";
        let summary = inspect(DatasetFormat::Csv, text.as_bytes()).unwrap();
        assert_eq!(summary.rows, 3);
        assert_eq!(
            columns(&summary),
            [("x", ColumnType::Number), ("y", ColumnType::Number), ("label", ColumnType::String)]
        );
    }

    fn counts(summary: &Summary) -> Vec<(u64, Option<u64>)> {
        summary.columns.iter().map(|c| (c.missing, c.distinct)).collect()
    }

    #[test]
    fn blank_fields_and_nulls_are_counted_as_missing_values() {
        let csv = "x,label,note\n1,cat,\n , dog,a\n2,cat, \n2,,b\n";
        let summary = inspect(DatasetFormat::Csv, csv.as_bytes()).unwrap();
        assert_eq!(columns(&summary)[0], ("x", ColumnType::Number), "a blank cell leaves a number column one");
        // Distinct as the worker compares them: ` dog` is `dog`, `2` twice is one value.
        assert_eq!(counts(&summary), [(1, Some(2)), (1, Some(2)), (2, Some(2))]);
        let jsonl = "{\"x\":1,\"t\":\"a\"}\n{\"x\":null,\"t\":\" \"}\n{\"x\":1.0,\"t\":true}\n";
        let summary = inspect(DatasetFormat::Jsonl, jsonl.as_bytes()).unwrap();
        assert_eq!(columns(&summary), [("x", ColumnType::Number), ("t", ColumnType::String)]);
        // 1 and 1.0 are two values to the worker, which reads their spelling.
        assert_eq!(counts(&summary), [(1, Some(2)), (1, Some(2))]);
    }

    #[test]
    fn numbers_past_f32_are_strings_in_csv_and_refused_in_jsonl() {
        let summary = inspect(DatasetFormat::Csv, "x,y\n1e39,1\n2,3.4e38\n".as_bytes()).unwrap();
        assert_eq!(columns(&summary), [("x", ColumnType::String), ("y", ColumnType::Number)]);
        let error = inspect(DatasetFormat::Jsonl, "{\"x\":1}\n{\"x\":1e39}\n".as_bytes()).unwrap_err();
        assert!(matches!(error, InspectError::Invalid { line: 2, .. }), "{error}");
        assert!(error.to_string().contains("f32"), "{error}");
    }

    /// A line of many keys other than the first line's is named by a few of them, found by
    /// hash: comparing every key with every name took seconds and wrote megabytes.
    #[test]
    fn a_line_with_other_keys_names_a_few_of_them() {
        let first: Vec<String> = (0..1000).map(|i| format!("\"c{i}\":1")).collect();
        let other: Vec<String> = (0..60_000).map(|i| format!("\"k{i}\":1")).collect();
        let file = format!("{{{}}}\n{{{}}}\n", first.join(","), other.join(","));
        let started = std::time::Instant::now();
        let error = inspect(DatasetFormat::Jsonl, file.as_bytes()).unwrap_err().to_string();
        assert!(started.elapsed() < std::time::Duration::from_secs(5), "{:?}", started.elapsed());
        assert!(error.len() < 400 && error.contains("\"c0\"") && error.contains("\"k4\""), "{error}");
        assert!(!error.contains("\"k5\""), "{error}");
    }

    #[test]
    fn a_quote_inside_an_unquoted_csv_field_is_kept() {
        let summary = inspect(DatasetFormat::Csv, "size,y\n5\" screen,1\n7\" screen,2\n".as_bytes()).unwrap();
        assert_eq!((summary.rows, columns(&summary)[0]), (2, ("size", ColumnType::String)));
    }

    #[test]
    fn distinct_values_are_counted_to_one_past_the_class_cap() {
        let rows: String = (0..MAX_CLASSES + 5).map(|i| format!("{i},{}\n", i % 3)).collect();
        let summary = inspect(DatasetFormat::Csv, format!("id,label\n{rows}").as_bytes()).unwrap();
        assert_eq!(counts(&summary), [(0, Some(MAX_CLASSES as u64 + 1)), (0, Some(3))]);
    }

    #[test]
    fn csv_row_with_a_missing_field_names_its_line() {
        let error = inspect(DatasetFormat::Csv, "a,b\n1,2\n3\n".as_bytes()).unwrap_err();
        assert!(matches!(error, InspectError::Invalid { line: 3, .. }), "{error}");
        assert!(error.to_string().contains("1 fields but the header has 2"), "{error}");
    }

    #[test]
    fn csv_that_is_not_utf8_is_refused() {
        let error = inspect(DatasetFormat::Csv, &b"a,b\n1,\xff\xfe\n"[..]).unwrap_err();
        assert!(error.to_string().contains("UTF-8"), "{error}");
    }

    #[test]
    fn csv_with_a_duplicate_or_empty_header_is_refused() {
        assert!(inspect(DatasetFormat::Csv, "a,a\n1,2\n".as_bytes()).unwrap_err().to_string().contains("twice"));
        assert!(inspect(DatasetFormat::Csv, "a,\n1,2\n".as_bytes()).is_err());
        assert!(matches!(inspect(DatasetFormat::Csv, "a,b\n".as_bytes()), Err(InspectError::Empty(_))));
        assert!(matches!(inspect(DatasetFormat::Csv, "".as_bytes()), Err(InspectError::Empty(_))));
    }

    #[test]
    fn rows_longer_than_the_cap_are_refused_with_their_line() {
        let at_cap = format!("{{\"t\":\"{}\"}}\r\n", "a".repeat(MAX_ROW_BYTES - 8));
        assert_eq!(inspect(DatasetFormat::Jsonl, at_cap.as_bytes()).unwrap().rows, 1);
        let over = format!("{{\"t\":\"x\"}}\n{{\"t\":\"{}\"}}\n", "a".repeat(MAX_ROW_BYTES));
        assert!(matches!(inspect(DatasetFormat::Jsonl, over.as_bytes()), Err(InspectError::RowTooLong { line: 2 })));
        let record = format!("t,n\nx,1\n\"{}\",2\n", "a\n".repeat(MAX_ROW_BYTES));
        assert!(matches!(inspect(DatasetFormat::Csv, record.as_bytes()), Err(InspectError::RowTooLong { .. })));
        let fine = format!("t,n\n\"{}\",2\n", "a\n".repeat(MAX_ROW_BYTES / 4));
        assert_eq!(inspect(DatasetFormat::Csv, fine.as_bytes()).unwrap().rows, 1);
    }

    #[test]
    fn jsonl_keeps_key_order_and_types() {
        let text = "{\"text\":\"hi\",\"score\":1,\"ok\":true}\n\n{\"score\":null,\"ok\":false,\"text\":\"yo\"}\n";
        let summary = inspect(DatasetFormat::Jsonl, text.as_bytes()).unwrap();
        assert_eq!(summary.rows, 2);
        assert_eq!(
            columns(&summary),
            [("text", ColumnType::String), ("score", ColumnType::Number), ("ok", ColumnType::String)]
        );
    }

    #[test]
    fn jsonl_lines_must_be_flat_objects_with_the_same_keys() {
        let differ = inspect(DatasetFormat::Jsonl, "{\"a\":1}\n{\"b\":1}\n".as_bytes()).unwrap_err();
        assert!(matches!(differ, InspectError::Invalid { line: 2, .. }), "{differ}");
        let nested = inspect(DatasetFormat::Jsonl, "{\"a\":[1]}\n".as_bytes()).unwrap_err();
        assert!(nested.to_string().contains("flat"), "{nested}");
        let array = inspect(DatasetFormat::Jsonl, "[1,2]\n".as_bytes()).unwrap_err();
        assert!(array.to_string().contains("not a JSON object"), "{array}");
        let mixed = inspect(DatasetFormat::Jsonl, "{\"a\":1}\n{\"a\":\"x\"}\n".as_bytes()).unwrap_err();
        assert!(mixed.to_string().contains("one type"), "{mixed}");
        assert!(matches!(inspect(DatasetFormat::Jsonl, "\n\n".as_bytes()), Err(InspectError::Empty(_))));
    }
}
