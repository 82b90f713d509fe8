//! Registered models (`models`, `model_files`) and their measured throughput tables
//! (`model_profiles`). The blobs the files name are counted in the ledger (`blobs`).

use sqlx::any::AnyRow;
use sqlx::{AnyConnection, Row};
use tessera_api::mig::ProfileReport;
use tessera_api::models::{Model, ModelFile};
use uuid::Uuid;

use super::db::{self, Backend, Db};
use super::{parse_json, parse_uuid, Listing, Result, RowLock, Scope};
use crate::scheduler::throughput::Row as TableRow;

const MODEL_COLUMNS: &str =
    "m.id, m.name, m.digest, m.architecture, m.size_bytes, m.created_at, u.username AS owner";
const LISTING: Listing = Listing { table: "models", alias: "m", columns: MODEL_COLUMNS };

async fn files(db: &Db, model: &str) -> Result<Vec<ModelFile>> {
    let rows = sqlx::query("SELECT path, digest, size_bytes FROM model_files WHERE model_id = $1 ORDER BY path")
        .bind(model)
        .fetch_all(db.pool())
        .await?;
    rows.iter()
        .map(|f| {
            Ok(ModelFile {
                path: f.try_get("path")?,
                digest: f.try_get("digest")?,
                size_bytes: f.try_get::<i64, _>("size_bytes")? as u64,
            })
        })
        .collect()
}

async fn model_from_row(db: &Db, row: &AnyRow) -> Result<Model> {
    let id: String = row.try_get("id")?;
    Ok(Model {
        id: parse_uuid("models", "id", &id)?,
        name: row.try_get("name")?,
        digest: row.try_get("digest")?,
        architecture: row.try_get("architecture")?,
        size_bytes: row.try_get::<i64, _>("size_bytes")? as u64,
        files: files(db, &id).await?,
        owner: row.try_get("owner")?,
        created_at: db::time(row.try_get("created_at")?),
    })
}

/// `owner`'s model called `name` (names are unique per owner).
pub async fn find_by_name(db: &Db, owner: Uuid, name: &str) -> Result<Option<Model>> {
    if !db::storable(name) {
        return Ok(None);
    }
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {MODEL_COLUMNS} FROM models m JOIN users u ON u.id = m.owner_id WHERE m.owner_id = $1 AND m.name = $2"
    )))
    .bind(owner.to_string())
    .bind(name)
    .fetch_optional(db.pool())
    .await?;
    match row {
        Some(row) => Ok(Some(model_from_row(db, &row).await?)),
        None => Ok(None),
    }
}

/// A model in `scope`, by id.
pub async fn get(db: &Db, scope: &Scope, id: Uuid) -> Result<Option<Model>> {
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {MODEL_COLUMNS} FROM models m JOIN users u ON u.id = m.owner_id \
         WHERE m.id = $1 AND ($2 IS NULL OR m.owner_id = $2)"
    )))
    .bind(id.to_string())
    .bind(scope.owner_filter())
    .fetch_optional(db.pool())
    .await?;
    match row {
        Some(row) => Ok(Some(model_from_row(db, &row).await?)),
        None => Ok(None),
    }
}

/// The models in `scope`, newest first (ties of one millisecond by id): at most `limit`,
/// after `before`, the last one of the previous page. `Ok(None)` when `before` names none `scope` may see.
pub async fn list(db: &Db, scope: &Scope, before: Option<Uuid>, limit: u32) -> Result<Option<Vec<Model>>> {
    let Some(rows) = LISTING.page(db, scope, before, limit).await? else {
        return Ok(None);
    };
    let mut models = Vec::with_capacity(rows.len());
    for row in &rows {
        models.push(model_from_row(db, row).await?);
    }
    Ok(Some(models))
}

/// A model about to be registered: its row and the `config` summary kept with it.
pub struct NewModel<'a> {
    pub id: Uuid,
    pub owner: Uuid,
    pub name: &'a str,
    pub digest: &'a str,
    pub architecture: &'a str,
    pub config: &'a serde_json::Value,
    pub size_bytes: u64,
    pub created_at: i64,
}

/// Writes the model and its files inside the caller's transaction. A name the owner
/// already uses is a unique violation (`StoreError::is_unique_violation`).
pub async fn insert(conn: &mut AnyConnection, model: &NewModel<'_>, files: &[ModelFile]) -> Result<()> {
    sqlx::query(
        "INSERT INTO models (id, owner_id, name, digest, architecture, config, size_bytes, created_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
    )
    .bind(model.id.to_string())
    .bind(model.owner.to_string())
    .bind(model.name)
    .bind(model.digest)
    .bind(model.architecture)
    .bind(model.config.to_string())
    .bind(model.size_bytes as i64)
    .bind(model.created_at)
    .execute(&mut *conn)
    .await?;
    for file in files {
        sqlx::query("INSERT INTO model_files (model_id, path, digest, size_bytes) VALUES ($1, $2, $3, $4)")
            .bind(model.id.to_string())
            .bind(&file.path)
            .bind(&file.digest)
            .bind(file.size_bytes as i64)
            .execute(&mut *conn)
            .await?;
    }
    Ok(())
}

/// Whether model `id` exists, locked for the caller's transaction (see [`RowLock`]).
pub async fn lock(conn: &mut AnyConnection, backend: Backend, id: Uuid, lock: RowLock) -> Result<bool> {
    super::lock_row(conn, backend, "models", id, lock).await
}

/// Deletes a model inside the caller's transaction (its files and profiles go with it,
/// by foreign key).
pub async fn delete_in(conn: &mut AnyConnection, id: Uuid) -> Result<()> {
    sqlx::query("DELETE FROM models WHERE id = $1").bind(id.to_string()).execute(conn).await?;
    Ok(())
}

/// The `config.json` summary stored at registration (`num_labels`, `hidden_size`, …).
pub async fn config(db: &Db, id: Uuid) -> Result<Option<serde_json::Value>> {
    let text: Option<String> = sqlx::query_scalar("SELECT config FROM models WHERE id = $1")
        .bind(id.to_string())
        .fetch_optional(db.pool())
        .await?;
    text.map(|t| parse_json("models", "config", &t)).transpose()
}

/// The measured rows of a model's throughput table.
pub async fn measured_profiles(db: &Db, model: Uuid) -> Result<Vec<TableRow>> {
    let rows = sqlx::query(
        "SELECT gpu_model, profile, batch_size, throughput, p99_ms, simulated, measured_at FROM model_profiles \
         WHERE model_id = $1",
    )
    .bind(model.to_string())
    .fetch_all(db.pool())
    .await?;
    rows.iter()
        .map(|row| {
            Ok(TableRow {
                gpu_model: row.try_get("gpu_model")?,
                profile: row.try_get("profile")?,
                batch_size: row.try_get::<i64, _>("batch_size")? as u32,
                throughput: row.try_get("throughput")?,
                p99_ms: row.try_get("p99_ms")?,
                estimated: false,
                simulated: row.try_get::<i64, _>("simulated")? != 0,
                measured_at: Some(row.try_get("measured_at")?),
            })
        })
        .collect()
}

/// Stores a profiler's points in one transaction; a point measured again replaces the
/// earlier one. `gpu_model` of each report is written as given (callers pass the
/// catalogue's spelling).
pub async fn record_profiles(db: &Db, model: Uuid, reports: &[ProfileReport], measured_at: i64) -> Result<()> {
    let mut tx = db.begin().await?;
    for report in reports {
        for p in &report.points {
            sqlx::query(
                "INSERT INTO model_profiles (model_id, gpu_model, profile, batch_size, throughput, p99_ms, simulated, measured_at) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8) \
                 ON CONFLICT (model_id, gpu_model, profile, batch_size) DO UPDATE SET throughput = excluded.throughput, \
                   p99_ms = excluded.p99_ms, simulated = excluded.simulated, measured_at = excluded.measured_at",
            )
            .bind(model.to_string())
            .bind(&report.gpu_model)
            .bind(&report.profile)
            .bind(p.batch_size as i64)
            .bind(p.throughput)
            .bind(p.p99_ms)
            .bind(report.simulated as i64)
            .bind(measured_at)
            .execute(&mut *tx)
            .await?;
        }
    }
    tx.commit().await?;
    Ok(())
}
