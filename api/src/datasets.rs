//! Datasets: uploaded training data (CSV with a header row, or JSONL), immutable and
//! addressed by the digest of their bytes.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum DatasetFormat {
    Csv,
    Jsonl,
}

impl DatasetFormat {
    pub fn as_str(self) -> &'static str {
        match self {
            DatasetFormat::Csv => "csv",
            DatasetFormat::Jsonl => "jsonl",
        }
    }

    pub fn parse(s: &str) -> Option<DatasetFormat> {
        [DatasetFormat::Csv, DatasetFormat::Jsonl].into_iter().find(|f| f.as_str() == s)
    }
}

/// `number` when every value of the column that is not missing is a number training can
/// read ([`parse_number`]), else `string`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ColumnType {
    Number,
    String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct DatasetColumn {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: ColumnType,
    /// Rows without a value here: an empty or blank CSV field, a JSONL null or blank string.
    /// Left out when every row has one, and by datasets uploaded before it was counted (a
    /// job on those finds a missing value as it reads the data).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub missing: u64,
    /// Distinct values, missing ones aside, counted up to one past
    /// [`crate::train::MAX_CLASSES`]: a column showing that has at least as many. Left out
    /// where not counted: by datasets uploaded before it was, and for columns past what one
    /// upload may hold in memory to count them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub distinct: Option<u64>,
}

fn is_zero(count: &u64) -> bool {
    *count == 0
}

/// A number as training reads it, an f32; `None` outside f32's range (±3.4e38) and for an
/// infinity or NaN. Upload typing and the worker's parser both go through it, so every value
/// of a `number` column is one the worker can train on.
pub fn to_f32(value: f64) -> Option<f32> {
    let narrowed = value as f32;
    narrowed.is_finite().then_some(narrowed)
}

/// A text value (a CSV field, surrounding spaces aside) as a number: see [`to_f32`].
pub fn parse_number(text: &str) -> Option<f32> {
    text.trim().parse::<f64>().ok().and_then(to_f32)
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Dataset {
    pub id: Uuid,
    pub name: String,
    /// `sha256:<hex>` of the uploaded bytes.
    pub digest: String,
    pub format: DatasetFormat,
    pub columns: Vec<DatasetColumn>,
    /// Data rows (the CSV header is not counted).
    pub rows: u64,
    pub size_bytes: u64,
    pub owner: String,
    pub created_at: DateTime<Utc>,
}
