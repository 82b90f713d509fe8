//! The store: every SQL statement of the server and every row decode, one file per table
//! family. Handlers, pages and background loops call these functions and hold no SQL.
//! Reads and writes of rows that belong to a user take a [`Scope`], so "visible to this
//! caller" is part of the call and cannot be forgotten (lldap's access-controlled
//! backend idea: the permission travels with the request, not in a remembered filter).

pub mod blobs;
pub mod datasets;
pub mod deployments;
pub mod db;
pub mod gangs;
pub mod jobs;
pub mod loaning;
pub mod models;
pub mod precision;
pub mod quotas;
pub mod regroup;
pub mod revocations;
pub mod slices;
pub mod training;
pub mod users;
pub mod workers;

use sqlx::any::AnyRow;
use sqlx::AnyConnection;
use uuid::Uuid;

use db::{Backend, Db};

/// What can go wrong below the handlers: the database failed, or a row it returned does
/// not decode (a bug or a hand edit, never a user mistake).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    #[error("{table} row has a bad {column} ({value:?}): {reason}")]
    Corrupt { table: &'static str, column: &'static str, value: String, reason: String },
    /// A value bound for a JSON column did not serialise (a bug, never user input).
    #[error("could not encode a JSON column: {0}")]
    Encode(#[from] serde_json::Error),
}

impl StoreError {
    /// True when the statement broke a unique constraint (both backends): the caller
    /// usually turns it into a 409 naming the duplicate.
    pub fn is_unique_violation(&self) -> bool {
        matches!(self, StoreError::Database(error) if db::is_unique_violation(error))
    }

    /// True when the statement broke a foreign key (a row still refers to the one deleted).
    pub fn is_foreign_key_violation(&self) -> bool {
        matches!(self, StoreError::Database(sqlx::Error::Database(error)) if error.is_foreign_key_violation())
    }
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// Decodes an id column; a value that is not a UUID is a corrupt row.
pub fn parse_uuid(table: &'static str, column: &'static str, value: &str) -> Result<Uuid> {
    value.parse().map_err(|e: uuid::Error| StoreError::Corrupt {
        table,
        column,
        value: value.into(),
        reason: e.to_string(),
    })
}

/// Decodes a JSON column; text that does not parse as `T` is a corrupt row.
pub fn parse_json<T: serde::de::DeserializeOwned>(table: &'static str, column: &'static str, text: &str) -> Result<T> {
    serde_json::from_str(text).map_err(|e| StoreError::Corrupt {
        table,
        column,
        value: text.into(),
        reason: e.to_string(),
    })
}

/// How a transaction locks a registry row (a model or a dataset) it is about to depend on
/// or delete. A job that names the row takes [`RowLock::Share`], the row's deletion
/// [`RowLock::Update`], so the two run one after the other: the deletion then sees the
/// queued job, or the job finds the row gone. PostgreSQL locks the row; SQLite needs
/// nothing, its writing transactions (`Db::begin`) running one at a time already.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowLock {
    Share,
    Update,
}

/// Whether row `id` of `table` exists, locked as `lock` says until the caller's
/// transaction ends.
async fn lock_row(conn: &mut AnyConnection, backend: Backend, table: &str, id: Uuid, lock: RowLock) -> Result<bool> {
    let clause = match (backend, lock) {
        (Backend::Sqlite, _) => "",
        (Backend::Postgres, RowLock::Share) => " FOR SHARE",
        (Backend::Postgres, RowLock::Update) => " FOR UPDATE",
    };
    let found = sqlx::query(sqlx::AssertSqlSafe(format!("SELECT id FROM {table} WHERE id = $1{clause}")))
        .bind(id.to_string())
        .fetch_optional(conn)
        .await?;
    Ok(found.is_some())
}

/// A table of owned rows listed newest first by `(created_at, id)`, a page at a time: the
/// models and the datasets. Its rows are read as `alias`, with the owner's name joined as
/// `u.username`.
struct Listing {
    table: &'static str,
    alias: &'static str,
    columns: &'static str,
}

impl Listing {
    /// The rows `scope` may see, newest first (ties of one millisecond by id): at most
    /// `limit`, and with `before` only those listed after that row, so a caller pages by
    /// passing the last row it got. `Ok(None)` when `before` names no row `scope` may see.
    async fn page(&self, db: &Db, scope: &Scope, before: Option<Uuid>, limit: u32) -> Result<Option<Vec<AnyRow>>> {
        let Listing { table, alias, columns } = self;
        // The row the page starts after, as the ORDER BY compares it.
        let after = match before {
            None => None,
            Some(id) => {
                let sql = format!("SELECT created_at FROM {table} WHERE id = $1 AND ($2 IS NULL OR owner_id = $2)");
                let query = sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).bind(id.to_string());
                let Some(created_at) = query.bind(scope.owner_filter()).fetch_optional(db.pool()).await? else {
                    return Ok(None);
                };
                Some((created_at, id.to_string()))
            }
        };
        let (created_at, id): (Option<i64>, Option<String>) = after.unzip();
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {columns} FROM {table} {alias} JOIN users u ON u.id = {alias}.owner_id \
             WHERE ($1 IS NULL OR {alias}.owner_id = $1) \
             AND ($2 IS NULL OR {alias}.created_at < $2 OR ({alias}.created_at = $2 AND {alias}.id < $3)) \
             ORDER BY {alias}.created_at DESC, {alias}.id DESC LIMIT $4"
        )))
        .bind(scope.owner_filter())
        .bind(created_at)
        .bind(id)
        .bind(limit as i64)
        .fetch_all(db.pool())
        .await?;
        Ok(Some(rows))
    }
}

/// Whose rows a call may see or change. Built from the caller (`Principal::scope`) for
/// requests, or `Scope::all()` for the server's own work (scheduling, lease expiry, the
/// gateway's routing table), which is never done on a user's behalf.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scope {
    owner: Option<Uuid>,
}

impl Scope {
    /// Every row: admins, and the server itself.
    pub fn all() -> Scope {
        Scope { owner: None }
    }

    /// Only the rows `owner` owns.
    pub fn owned_by(owner: Uuid) -> Scope {
        Scope { owner: Some(owner) }
    }

    /// The value a query binds for `($n IS NULL OR owner_id = $n)`.
    fn owner_filter(&self) -> Option<String> {
        self.owner.map(|id| id.to_string())
    }

    /// True when this scope may see a row owned by `owner`.
    pub fn sees(&self, owner: Uuid) -> bool {
        self.owner.is_none_or(|id| id == owner)
    }

    /// True for `Scope::all()`: rows whose owner is gone are seen only here.
    pub fn sees_everything(&self) -> bool {
        self.owner.is_none()
    }
}
