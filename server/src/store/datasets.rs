//! Datasets (`datasets`): uploaded training data, its file a blob by digest, named
//! uniquely per owner.

use sqlx::any::AnyRow;
use sqlx::{AnyConnection, Row};
use tessera_api::datasets::{Dataset, DatasetFormat};
use uuid::Uuid;

use super::db::{self, Backend, Db};
use super::{parse_json, parse_uuid, Listing, Result, RowLock, Scope, StoreError};

const COLUMNS: &str =
    "d.id, d.name, d.digest, d.format, d.columns, d.num_rows, d.size_bytes, d.created_at, u.username AS owner";
const LISTING: Listing = Listing { table: "datasets", alias: "d", columns: COLUMNS };

fn from_row(row: &AnyRow) -> Result<Dataset> {
    let format: String = row.try_get("format")?;
    Ok(Dataset {
        id: parse_uuid("datasets", "id", &row.try_get::<String, _>("id")?)?,
        name: row.try_get("name")?,
        digest: row.try_get("digest")?,
        format: DatasetFormat::parse(&format).ok_or_else(|| StoreError::Corrupt {
            table: "datasets",
            column: "format",
            value: format.clone(),
            reason: "not csv or jsonl".into(),
        })?,
        columns: parse_json("datasets", "columns", &row.try_get::<String, _>("columns")?)?,
        rows: row.try_get::<i64, _>("num_rows")? as u64,
        size_bytes: row.try_get::<i64, _>("size_bytes")? as u64,
        owner: row.try_get("owner")?,
        created_at: db::time(row.try_get("created_at")?),
    })
}

/// A dataset `scope` may see.
pub async fn get(db: &Db, scope: &Scope, id: Uuid) -> Result<Option<Dataset>> {
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM datasets d JOIN users u ON u.id = d.owner_id WHERE d.id = $1 AND ($2 IS NULL OR d.owner_id = $2)"
    )))
    .bind(id.to_string())
    .bind(scope.owner_filter())
    .fetch_optional(db.pool())
    .await?;
    row.as_ref().map(from_row).transpose()
}

/// `owner`'s dataset called `name` (names are unique per owner).
pub async fn find_by_name(db: &Db, owner: Uuid, name: &str) -> Result<Option<Dataset>> {
    if !db::storable(name) {
        return Ok(None);
    }
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM datasets d JOIN users u ON u.id = d.owner_id WHERE d.owner_id = $1 AND d.name = $2"
    )))
    .bind(owner.to_string())
    .bind(name)
    .fetch_optional(db.pool())
    .await?;
    row.as_ref().map(from_row).transpose()
}

/// Datasets `scope` may see, newest first (ties of one millisecond by id): at most `limit`,
/// after `before`, the last one of the previous page. `Ok(None)` when `before` names none `scope` may see.
pub async fn list(db: &Db, scope: &Scope, before: Option<Uuid>, limit: u32) -> Result<Option<Vec<Dataset>>> {
    let Some(rows) = LISTING.page(db, scope, before, limit).await? else {
        return Ok(None);
    };
    rows.iter().map(from_row).collect::<Result<_>>().map(Some)
}

/// Records a dataset owned by `owner` (its `owner` name is not stored), inside the
/// caller's transaction. A second dataset of the same name for the same owner breaks a
/// unique constraint ([`StoreError::is_unique_violation`]).
pub async fn insert(conn: &mut AnyConnection, owner: Uuid, dataset: &Dataset) -> Result<()> {
    sqlx::query(
        "INSERT INTO datasets (id, owner_id, name, digest, format, columns, num_rows, size_bytes, created_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
    )
    .bind(dataset.id.to_string())
    .bind(owner.to_string())
    .bind(&dataset.name)
    .bind(&dataset.digest)
    .bind(dataset.format.as_str())
    .bind(serde_json::to_string(&dataset.columns)?)
    .bind(dataset.rows as i64)
    .bind(dataset.size_bytes as i64)
    .bind(dataset.created_at.timestamp_millis())
    .execute(conn)
    .await?;
    Ok(())
}

/// Whether dataset `id` exists, locked for the caller's transaction (see [`RowLock`]).
pub async fn lock(conn: &mut AnyConnection, backend: Backend, id: Uuid, lock: RowLock) -> Result<bool> {
    super::lock_row(conn, backend, "datasets", id, lock).await
}

/// Deletes a dataset inside the caller's transaction.
pub async fn delete_in(conn: &mut AnyConnection, id: Uuid) -> Result<()> {
    sqlx::query("DELETE FROM datasets WHERE id = $1").bind(id.to_string()).execute(conn).await?;
    Ok(())
}
