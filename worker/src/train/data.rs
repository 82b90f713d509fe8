//! Training data: a dataset file (CSV with a header row, or JSONL objects) read into a
//! table, then turned into model inputs and targets for one task. Numeric features are
//! standardised with the training split's mean and deviation only, so no validation
//! statistic leaks into training; the split itself is a seeded permutation, the same on
//! every worker that resumes the job.
//!
//! The file is read as the server's upload check read it (`server/src/datasets/inspect.rs`):
//! the same `csv` reader and settings, the same numbers ([`parse_number`]), the same missing
//! values. A missing value is harmless in a column the task does not read; in one it reads,
//! the server refuses the job at submission, and for a dataset uploaded before it counted
//! them the job fails here, naming the column and the row.

use std::collections::{BTreeSet, HashMap};

use tessera_api::datasets::{parse_number, DatasetFormat};
use tessera_api::train::MAX_CLASSES;

use super::rng::Rng;

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("the dataset is not valid UTF-8")]
    NotUtf8,
    #[error("the dataset has no rows")]
    Empty,
    #[error("line {line}: {message}")]
    Malformed { line: usize, message: String },
    #[error("the dataset has no column '{0}'")]
    MissingColumn(String),
    #[error("column '{column}', row {row}: '{value}' is not a number")]
    NotNumeric { column: String, row: usize, value: String },
    #[error(
        "column '{column}', row {row}: no value; the task reads this column, so every row needs one: fill it in, or \
         train without the column"
    )]
    MissingValue { column: String, row: usize },
    #[error("label column '{column}' holds {classes} distinct values; a classification takes at most {MAX_CLASSES}")]
    TooManyClasses { column: String, classes: usize },
    #[error("the task uses no feature columns: name numeric `feature_columns`, or a `text_column`")]
    NoFeatures,
    #[error("{0}")]
    Split(String),
}

/// A dataset as read: column names and every cell as text. JSON numbers keep their JSON
/// spelling, which parses back to the same value. A missing value (a blank CSV field, a
/// JSONL null, blank string or absent key) is a blank cell.
#[derive(Debug, Clone, PartialEq)]
pub struct Table {
    pub columns: Vec<String>,
    pub rows: Vec<Vec<String>>,
}

impl Table {
    /// Reads a dataset file in the format the server recorded for it.
    pub fn read(bytes: &[u8], format: DatasetFormat) -> Result<Table, DataError> {
        let text = std::str::from_utf8(bytes).map_err(|_| DataError::NotUtf8)?;
        let table = match format {
            DatasetFormat::Csv => parse_csv(text)?,
            DatasetFormat::Jsonl => parse_jsonl(text)?,
        };
        if table.rows.is_empty() {
            return Err(DataError::Empty);
        }
        Ok(table)
    }

    /// Reads a table written by hand (tests, benchmarks): JSONL when the first non-blank
    /// character is `{`, CSV otherwise. A job's dataset is read with [`Table::read`].
    pub fn parse(bytes: &[u8]) -> Result<Table, DataError> {
        let text = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes);
        let jsonl = text.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
        Table::read(text, if jsonl { DatasetFormat::Jsonl } else { DatasetFormat::Csv })
    }

    pub fn column(&self, name: &str) -> Result<usize, DataError> {
        self.columns.iter().position(|c| c == name).ok_or_else(|| DataError::MissingColumn(name.into()))
    }

    /// A column the task reads, every cell of it: a missing one is an error naming its row.
    fn present(&self, column: usize) -> Result<Vec<&str>, DataError> {
        self.rows
            .iter()
            .enumerate()
            .map(|(row, cells)| match cells[column].as_str() {
                blank if blank.trim().is_empty() => {
                    Err(DataError::MissingValue { column: self.columns[column].clone(), row: row + 1 })
                }
                value => Ok(value),
            })
            .collect()
    }

    fn numeric(&self, column: usize) -> Result<Vec<f32>, DataError> {
        let values = self.present(column)?;
        values
            .iter()
            .enumerate()
            .map(|(row, value)| {
                parse_number(value).ok_or_else(|| DataError::NotNumeric {
                    column: self.columns[column].clone(),
                    row: row + 1,
                    value: value.to_string(),
                })
            })
            .collect()
    }

    fn is_numeric(&self, column: usize) -> bool {
        self.rows.iter().all(|cells| parse_number(&cells[column]).is_some())
    }
}

/// CSV with a header row, read by the `csv` crate with the settings the server checked the
/// upload with: RFC 4180 quoting, a quote inside an unquoted field kept as written, blank
/// lines skipped, every record as wide as the header, names exactly as written.
fn parse_csv(text: &str) -> Result<Table, DataError> {
    let mut reader = csv::ReaderBuilder::new().has_headers(true).flexible(false).from_reader(text.as_bytes());
    let columns: Vec<String> = reader.headers().map_err(csv_error)?.iter().map(str::to_string).collect();
    let mut rows: Vec<Vec<String>> = Vec::new();
    for record in reader.records() {
        rows.push(record.map_err(csv_error)?.iter().map(str::to_string).collect());
    }
    Ok(Table { columns, rows })
}

fn csv_error(error: csv::Error) -> DataError {
    let line = error.position().map_or(0, |p| p.line() as usize);
    let message = match error.kind() {
        csv::ErrorKind::UnequalLengths { expected_len, len, .. } => {
            format!("{len} fields where the header has {expected_len}")
        }
        _ => error.to_string(),
    };
    DataError::Malformed { line, message }
}

/// JSONL: the first line's keys are the columns. A null, a blank string or a key a line
/// lacks is a missing value, harmless unless the task reads that column.
fn parse_jsonl(text: &str) -> Result<Table, DataError> {
    let mut columns: Option<Vec<String>> = None;
    let mut rows = Vec::new();
    for (index, raw) in text.lines().enumerate() {
        let line = index + 1;
        if raw.trim().is_empty() {
            continue;
        }
        let malformed = |message: String| DataError::Malformed { line, message };
        let value: serde_json::Value = serde_json::from_str(raw).map_err(|e| malformed(e.to_string()))?;
        let object = value.as_object().ok_or_else(|| malformed("each line must be a JSON object".into()))?;
        let header = columns.get_or_insert_with(|| object.keys().cloned().collect());
        let row = header
            .iter()
            .map(|key| match object.get(key) {
                None | Some(serde_json::Value::Null) => Ok(String::new()),
                Some(serde_json::Value::String(s)) => Ok(s.clone()),
                Some(v @ (serde_json::Value::Number(_) | serde_json::Value::Bool(_))) => Ok(v.to_string()),
                Some(_) => Err(malformed(format!("the value of '{key}' is nested; each line must be a flat object"))),
            })
            .collect::<Result<Vec<_>, _>>()?;
        rows.push(row);
    }
    Ok(Table { columns: columns.ok_or(DataError::Empty)?, rows })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaskKind {
    Classification,
    Regression,
}

/// Which columns a task reads. `features: None` means every numeric column other than
/// the label (ignored when `text` is set: a text model reads the text column only).
#[derive(Debug, Clone, PartialEq)]
pub struct TaskColumns {
    pub kind: TaskKind,
    pub label: String,
    pub features: Option<Vec<String>>,
    pub text: Option<String>,
    pub validation_split: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Inputs {
    /// Row-major `[rows, dim]`.
    Dense {
        dim: usize,
        values: Vec<f32>,
    },
    Text(Vec<String>),
}

#[derive(Debug, Clone, PartialEq)]
pub enum Targets {
    /// Class indices into `Prepared::classes`.
    Classes(Vec<u32>),
    Values(Vec<f32>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Examples {
    pub inputs: Inputs,
    pub targets: Targets,
}

impl Examples {
    pub fn len(&self) -> usize {
        match &self.targets {
            Targets::Classes(c) => c.len(),
            Targets::Values(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn select(&self, rows: &[usize]) -> Examples {
        let inputs = match &self.inputs {
            Inputs::Dense { dim, values } => Inputs::Dense {
                dim: *dim,
                values: rows.iter().flat_map(|&r| values[r * dim..(r + 1) * dim].iter().copied()).collect(),
            },
            Inputs::Text(texts) => Inputs::Text(rows.iter().map(|&r| texts[r].clone()).collect()),
        };
        let targets = match &self.targets {
            Targets::Classes(c) => Targets::Classes(rows.iter().map(|&r| c[r]).collect()),
            Targets::Values(v) => Targets::Values(rows.iter().map(|&r| v[r]).collect()),
        };
        Examples { inputs, targets }
    }
}

/// A task's data, split and ready for the model.
#[derive(Debug, Clone, PartialEq)]
pub struct Prepared {
    pub train: Examples,
    pub validation: Examples,
    /// Class names in index order (classification only).
    pub classes: Vec<String>,
    pub feature_columns: Vec<String>,
}

impl Prepared {
    pub fn input_dim(&self) -> usize {
        match &self.train.inputs {
            Inputs::Dense { dim, .. } => *dim,
            Inputs::Text(_) => 0,
        }
    }
}

/// Class names in a stable order: numerically when every label is a number (so digit
/// `3` is class 3), lexically otherwise.
fn class_names(labels: &[&str]) -> Vec<String> {
    let distinct: BTreeSet<&str> = labels.iter().map(|l| l.trim()).collect();
    let mut names: Vec<String> = distinct.into_iter().map(str::to_string).collect();
    if names.iter().all(|n| n.parse::<f64>().is_ok()) {
        names.sort_by(|a, b| a.parse::<f64>().unwrap().total_cmp(&b.parse::<f64>().unwrap()));
    }
    names
}

pub fn prepare(table: &Table, task: &TaskColumns, seed: u64) -> Result<Prepared, DataError> {
    let label = table.column(&task.label)?;
    let (inputs, feature_columns) = match &task.text {
        Some(text) => {
            let texts = table.present(table.column(text)?)?;
            (Inputs::Text(texts.into_iter().map(str::to_string).collect()), vec![text.clone()])
        }
        None => {
            let columns: Vec<usize> = match &task.features {
                Some(names) => names.iter().map(|n| table.column(n)).collect::<Result<_, _>>()?,
                None => (0..table.columns.len()).filter(|&c| c != label && table.is_numeric(c)).collect(),
            };
            if columns.is_empty() {
                return Err(DataError::NoFeatures);
            }
            let by_column = columns.iter().map(|&c| table.numeric(c)).collect::<Result<Vec<_>, _>>()?;
            let dim = columns.len();
            let values = (0..table.rows.len()).flat_map(|r| by_column.iter().map(move |col| col[r])).collect();
            (Inputs::Dense { dim, values }, columns.iter().map(|&c| table.columns[c].clone()).collect())
        }
    };
    let (targets, classes) = match task.kind {
        TaskKind::Classification => {
            let labels = table.present(label)?;
            let classes = class_names(&labels);
            if classes.len() < 2 {
                return Err(DataError::Split(format!("label column '{}' has fewer than two classes", task.label)));
            }
            if classes.len() > MAX_CLASSES {
                return Err(DataError::TooManyClasses { column: task.label.clone(), classes: classes.len() });
            }
            let targets: Vec<u32> = {
                let index: HashMap<&str, u32> =
                    classes.iter().enumerate().map(|(i, c)| (c.as_str(), i as u32)).collect();
                labels.iter().map(|l| index[l.trim()]).collect()
            };
            (Targets::Classes(targets), classes)
        }
        TaskKind::Regression => (Targets::Values(table.numeric(label)?), Vec::new()),
    };
    let all = Examples { inputs, targets };

    let rows = all.len();
    if !(0.0..1.0).contains(&task.validation_split) {
        return Err(DataError::Split("validation_split must be in [0, 1)".into()));
    }
    let validation_rows = (rows as f64 * task.validation_split).round() as usize;
    if validation_rows == 0 && task.validation_split > 0.0 || rows - validation_rows == 0 {
        return Err(DataError::Split(format!(
            "{rows} rows cannot be split {:.2} for validation",
            task.validation_split
        )));
    }
    let mut order: Vec<usize> = (0..rows).collect();
    Rng::derive(seed, "split").shuffle(&mut order);
    let (validation, train) = order.split_at(validation_rows);
    let (mut train, mut validation) = (all.select(train), all.select(validation));
    if let (Inputs::Dense { dim, values }, Inputs::Dense { values: val, .. }) =
        (&mut train.inputs, &mut validation.inputs)
    {
        let (mean, scale) = standardisation(values, *dim);
        for data in [values, val] {
            for row in data.chunks_mut(*dim) {
                for ((x, m), s) in row.iter_mut().zip(&mean).zip(&scale) {
                    *x = (*x - m) / s;
                }
            }
        }
    }
    Ok(Prepared { train, validation, classes, feature_columns })
}

/// Per-column mean and standard deviation; a constant column keeps scale 1 so it maps to 0.
fn standardisation(values: &[f32], dim: usize) -> (Vec<f32>, Vec<f32>) {
    let rows = (values.len() / dim) as f64;
    let mut mean = vec![0f64; dim];
    for row in values.chunks(dim) {
        for (m, &x) in mean.iter_mut().zip(row) {
            *m += f64::from(x) / rows;
        }
    }
    let mut var = vec![0f64; dim];
    for row in values.chunks(dim) {
        for ((v, &x), m) in var.iter_mut().zip(row).zip(&mean) {
            *v += (f64::from(x) - m).powi(2) / rows;
        }
    }
    let scale = var.iter().map(|v| if v.sqrt() > 1e-12 { v.sqrt() as f32 } else { 1.0 }).collect();
    (mean.into_iter().map(|m| m as f32).collect(), scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(kind: TaskKind, split: f64) -> TaskColumns {
        TaskColumns { kind, label: "y".into(), features: None, text: None, validation_split: split }
    }

    #[test]
    fn csv_with_quotes_and_crlf() {
        let table = Table::parse(b"\"a b\",y,note\r\n1,\"x,1\",\"say \"\"hi\"\"\"\r\n2,z,\r\n").unwrap();
        assert_eq!(table.columns, ["a b", "y", "note"]);
        assert_eq!(table.rows, [vec!["1", "x,1", "say \"hi\""], vec!["2", "z", ""]]);
    }

    #[test]
    fn csv_row_with_wrong_width_names_its_line() {
        let err = Table::parse(b"a,y\n1,2\n3\n").unwrap_err();
        assert_eq!(err.to_string(), "line 3: 1 fields where the header has 2");
    }

    #[test]
    fn jsonl_reads_objects_and_rejects_nested_values() {
        let table = Table::parse(b"{\"x\": 1.5, \"y\": \"cat\"}\n\n{\"x\": 2, \"y\": \"dog\"}\n").unwrap();
        assert_eq!(table.rows, [vec!["1.5", "cat"], vec!["2", "dog"]]);
        let err = Table::parse(b"{\"x\": 1, \"y\": 2}\n{\"x\": 1, \"y\": [2]}\n").unwrap_err();
        assert!(err.to_string().starts_with("line 2: the value of 'y' is nested"), "{err}");
    }

    #[test]
    fn a_jsonl_null_or_absent_key_is_harmless_in_a_column_the_task_does_not_read() {
        let jsonl = "{\"f\": 1, \"y\": 0, \"note\": null}\n{\"f\": 2, \"y\": 1}\n\
                     {\"f\": 3, \"y\": 1, \"note\": \"x\"}\n";
        let table = Table::read(jsonl.as_bytes(), DatasetFormat::Jsonl).unwrap();
        let mut t = task(TaskKind::Classification, 0.0);
        t.features = Some(vec!["f".into()]);
        assert_eq!(prepare(&table, &t, 1).unwrap().train.len(), 3);
        t.features = Some(vec!["f".into(), "note".into()]);
        let err = prepare(&table, &t, 1).unwrap_err();
        assert!(matches!(&err, DataError::MissingValue { column, row: 1 } if column == "note"), "{err}");
    }

    #[test]
    fn an_empty_number_cell_is_a_missing_value_named_by_column_and_row() {
        let table = Table::read(b"f,g,y\n1,,0\n2,5,1\n3, ,1\n", DatasetFormat::Csv).unwrap();
        let mut t = task(TaskKind::Classification, 0.0);
        t.features = Some(vec!["f".into()]);
        prepare(&table, &t, 1).unwrap();
        t.features = Some(vec!["g".into()]);
        let err = prepare(&table, &t, 1).unwrap_err();
        assert!(matches!(&err, DataError::MissingValue { column, row: 1 } if column == "g"), "{err}");
        // Left to choose, the task skips a column with a missing value.
        t.features = None;
        assert_eq!(prepare(&table, &t, 1).unwrap().feature_columns, ["f"]);
        // A missing label is named too.
        let table = Table::read(b"f,y\n1,0\n2,\n3,1\n", DatasetFormat::Csv).unwrap();
        let err = prepare(&table, &task(TaskKind::Regression, 0.0), 1).unwrap_err();
        assert!(matches!(&err, DataError::MissingValue { column, row: 2 } if column == "y"), "{err}");
    }

    #[test]
    fn a_quote_inside_an_unquoted_csv_field_is_kept_as_written() {
        let table = Table::read(b" size ,y\n5\" screen,1\n\"7\"\" screen\",2\n", DatasetFormat::Csv).unwrap();
        assert_eq!(table.columns, [" size ", "y"], "names as the server recorded them");
        assert_eq!(table.rows, [vec!["5\" screen", "1"], vec!["7\" screen", "2"]]);
    }

    #[test]
    fn numbers_past_f32_are_not_numbers() {
        let table = Table::read(b"f,y\n3.4e38,0\n1e39,1\n", DatasetFormat::Csv).unwrap();
        let mut t = task(TaskKind::Classification, 0.0);
        t.features = Some(vec!["f".into()]);
        assert_eq!(prepare(&table, &t, 1).unwrap_err().to_string(), "column 'f', row 2: '1e39' is not a number");
    }

    #[test]
    fn the_recorded_format_decides_how_a_file_is_read() {
        // A CSV whose first column name starts with a brace is not JSONL.
        let table = Table::read(b"{id},y\n1,2\n", DatasetFormat::Csv).unwrap();
        assert_eq!(table.columns, ["{id}", "y"]);
        assert!(matches!(Table::read(b"a,y\n1,2\n", DatasetFormat::Jsonl), Err(DataError::Malformed { line: 1, .. })));
    }

    #[test]
    fn labels_map_to_classes_by_index_up_to_the_class_cap() {
        let rows: String = (0..2 * MAX_CLASSES).map(|i| format!("{i},c{}\n", i % MAX_CLASSES)).collect();
        let csv = format!("f,y\n{rows}");
        let classification = task(TaskKind::Classification, 0.0);
        let prepared = prepare(&Table::parse(csv.as_bytes()).unwrap(), &classification, 1).unwrap();
        assert_eq!(prepared.classes.len(), MAX_CLASSES);
        let (Inputs::Dense { values, .. }, Targets::Classes(index)) = (&prepared.train.inputs, &prepared.train.targets)
        else {
            panic!("dense inputs and class targets")
        };
        // Standardising keeps the order of f: the k-th smallest is row k of the file, label c{k % cap}.
        let mut order: Vec<usize> = (0..values.len()).collect();
        order.sort_by(|&a, &b| values[a].total_cmp(&values[b]));
        for (k, &row) in order.iter().enumerate() {
            assert_eq!(prepared.classes[index[row] as usize], format!("c{}", k % MAX_CLASSES));
        }
        let more = csv + &format!("0,c{MAX_CLASSES}\n");
        let err = prepare(&Table::parse(more.as_bytes()).unwrap(), &classification, 1).unwrap_err();
        assert!(matches!(&err, DataError::TooManyClasses { classes, .. } if *classes == MAX_CLASSES + 1), "{err}");
    }

    #[test]
    fn classification_maps_numeric_labels_in_numeric_order() {
        let csv = "f,y\n1,10\n2,9\n3,10\n4,2\n";
        let prepared =
            prepare(&Table::parse(csv.as_bytes()).unwrap(), &task(TaskKind::Classification, 0.0), 1).unwrap();
        assert_eq!(prepared.classes, ["2", "9", "10"]);
        let Targets::Classes(mut index) = prepared.train.targets else { panic!() };
        index.sort();
        assert_eq!(index, [0, 1, 2, 2]);
    }

    #[test]
    fn split_is_seeded_and_standardised_with_train_statistics() {
        let csv: String =
            "f,const,y\n".to_string() + &(0..100).map(|i| format!("{i},5,{}\n", i * 2)).collect::<String>();
        let table = Table::parse(csv.as_bytes()).unwrap();
        let a = prepare(&table, &task(TaskKind::Regression, 0.2), 7).unwrap();
        assert_eq!(a, prepare(&table, &task(TaskKind::Regression, 0.2), 7).unwrap());
        assert_ne!(a.validation, prepare(&table, &task(TaskKind::Regression, 0.2), 8).unwrap().validation);
        assert_eq!((a.train.len(), a.validation.len()), (80, 20));
        assert_eq!(a.feature_columns, ["f", "const"]);
        let Inputs::Dense { dim: 2, values } = &a.train.inputs else { panic!() };
        let mean: f32 = values.iter().step_by(2).sum::<f32>() / 80.0;
        let var: f32 = values.iter().step_by(2).map(|x| x * x).sum::<f32>() / 80.0;
        assert!(mean.abs() < 1e-5 && (var - 1.0).abs() < 1e-4, "{mean} {var}");
        assert!(values.iter().skip(1).step_by(2).all(|&x| x == 0.0), "a constant column maps to 0");
        // Targets travel with their rows: y = 2·f, so ordering by feature orders the targets.
        let Inputs::Dense { values: val, .. } = &a.validation.inputs else { panic!() };
        let Targets::Values(y) = &a.validation.targets else { panic!() };
        let mut pairs: Vec<(f32, f32)> = val.iter().step_by(2).copied().zip(y.iter().copied()).collect();
        pairs.sort_by(|p, q| p.0.total_cmp(&q.0));
        assert!(pairs.windows(2).all(|w| w[0].1 < w[1].1));
    }

    #[test]
    fn non_numeric_feature_is_named() {
        let table = Table::parse(b"f,y\n1,0\nx,1\n").unwrap();
        let mut t = task(TaskKind::Classification, 0.0);
        t.features = Some(vec!["f".into()]);
        assert_eq!(prepare(&table, &t, 1).unwrap_err().to_string(), "column 'f', row 2: 'x' is not a number");
        t.features = Some(vec!["g".into()]);
        assert_eq!(prepare(&table, &t, 1).unwrap_err().to_string(), "the dataset has no column 'g'");
    }
}
