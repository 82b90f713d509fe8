//! The database: one schema on SQLite (the embedded default) or PostgreSQL (shared by
//! several server replicas). Queries go through sqlx's `Any` driver so each is written
//! once; where the dialects differ (job claiming) the caller asks `backend()`.

use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use sqlx::any::{AnyConnectOptions, AnyPoolOptions};
use sqlx::migrate::Migrator;
use sqlx::AnyPool;

static SQLITE_MIGRATIONS: Migrator = sqlx::migrate!("../migrations/sqlite");
static POSTGRES_MIGRATIONS: Migrator = sqlx::migrate!("../migrations/postgres");

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

#[derive(Debug, Clone)]
pub struct Db {
    pool: AnyPool,
    backend: Backend,
}

impl Db {
    /// Connects and brings the schema up to date.
    pub async fn connect(url: &str) -> Result<Db, sqlx::Error> {
        sqlx::any::install_default_drivers();
        let backend = if url.starts_with("postgres:") || url.starts_with("postgresql:") {
            Backend::Postgres
        } else if url.starts_with("sqlite:") {
            Backend::Sqlite
        } else {
            return Err(sqlx::Error::Configuration(
                "the database URL must start with sqlite: or postgres:".into(),
            ));
        };
        let options = AnyConnectOptions::from_str(url)?;
        let pool = AnyPoolOptions::new()
            .max_connections(if backend == Backend::Sqlite { 8 } else { 16 })
            .acquire_timeout(Duration::from_secs(30))
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    if backend == Backend::Sqlite {
                        // WAL lets readers run beside the one writer; a busy writer waits
                        // instead of failing.
                        sqlx::query("PRAGMA journal_mode = WAL").execute(&mut *conn).await?;
                        sqlx::query("PRAGMA busy_timeout = 10000").execute(&mut *conn).await?;
                        sqlx::query("PRAGMA foreign_keys = ON").execute(&mut *conn).await?;
                    }
                    Ok(())
                })
            })
            .connect_with(options)
            .await?;
        let migrator = match backend {
            Backend::Sqlite => &SQLITE_MIGRATIONS,
            Backend::Postgres => &POSTGRES_MIGRATIONS,
        };
        migrator.run(&pool).await?;
        Ok(Db { pool, backend })
    }

    /// Answers when the database does (health checks).
    pub async fn ping(&self) -> Result<(), sqlx::Error> {
        sqlx::query("SELECT 1").execute(&self.pool).await.map(drop)
    }

    pub fn pool(&self) -> &AnyPool {
        &self.pool
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Begins a transaction that may write. On SQLite it takes the write lock at once
    /// (`BEGIN IMMEDIATE`): a deferred transaction that reads and then writes cannot wait
    /// for another writer and fails with "database is locked" instead.
    pub async fn begin(&self) -> Result<sqlx::Transaction<'static, sqlx::Any>, sqlx::Error> {
        match self.backend {
            Backend::Sqlite => self.pool.begin_with("BEGIN IMMEDIATE").await,
            Backend::Postgres => self.pool.begin().await,
        }
    }
}

/// Milliseconds since the Unix epoch, the unit every time column uses.
pub fn now_ms() -> i64 {
    Utc::now().timestamp_millis()
}

pub fn time(ms: i64) -> DateTime<Utc> {
    Utc.timestamp_millis_opt(ms).single().unwrap_or_default()
}

pub fn opt_time(ms: Option<i64>) -> Option<DateTime<Utc>> {
    ms.map(time)
}

/// Whether `text` could be stored in a column: PostgreSQL refuses text with a NUL byte
/// (an error, not a miss), so lookups by such a name answer "no row" without asking.
pub fn storable(text: &str) -> bool {
    !text.contains('\0')
}

/// True when the database turned the statement away for now, so that the same request
/// may succeed sent again: no pooled connection came free in time, SQLite's file stayed
/// locked past its busy timeout (codes 5 and 6, with their extended forms), or
/// PostgreSQL aborted the transaction as a serialisation failure or a deadlock.
pub fn is_busy(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::PoolTimedOut => true,
        sqlx::Error::Database(db) => {
            let code = db.code().unwrap_or_default();
            if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() {
                code.parse::<u32>().is_ok_and(|extended| matches!(extended & 0xff, 5 | 6))
            } else {
                matches!(code.as_ref(), "40001" | "40P01")
            }
        }
        _ => false,
    }
}

/// True when a database error is a unique-constraint violation (both backends).
pub fn is_unique_violation(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Database(db) => db.is_unique_violation(),
        _ => false,
    }
}
