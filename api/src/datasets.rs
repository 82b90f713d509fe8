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

/// `number` when every non-empty value of the column is a finite number, else `string`.
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
