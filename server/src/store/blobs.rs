//! The blob ledger (`blobs`): one row per blob in the object store with the number of
//! rows that reference it (model files, datasets, checkpoint files) and when it was last
//! touched. Triggers of migration 0008 keep `refs` exact on every insert and delete of a
//! referencing row, cascades included, and refuse a reference to a blob the ledger does
//! not hold; garbage collection reads the ledger, so several servers collect safely.

use sqlx::Row;

use super::db::{Backend, Db};
use super::Result;

/// Marks `digests` as being written now (before the bytes go to the object store), so
/// garbage collection leaves them alone for the grace period even while no row refers
/// to them yet. On PostgreSQL this waits for a collection that holds one of them.
pub async fn touch(db: &Db, digests: &[&str], now: i64) -> Result<()> {
    let mut tx = db.begin().await?;
    for digest in digests {
        sqlx::query(
            "INSERT INTO blobs (digest, refs, touched_at) VALUES ($1, 0, $2) \
             ON CONFLICT (digest) DO UPDATE SET touched_at = excluded.touched_at",
        )
        .bind(*digest)
        .bind(now)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(())
}

/// Records a blob found in the object store with no ledger row (a crash between the
/// write and the touch of an older version, or a hand copy), dated by its modification
/// time so the grace period counts from then. A row already there is left alone.
pub async fn adopt(db: &Db, digest: &str, modified_at: i64) -> Result<bool> {
    let done =
        sqlx::query("INSERT INTO blobs (digest, refs, touched_at) VALUES ($1, 0, $2) ON CONFLICT (digest) DO NOTHING")
            .bind(digest)
            .bind(modified_at)
            .execute(db.pool())
            .await?;
    Ok(done.rows_affected() == 1)
}

/// Whether the ledger holds `digest` (the object store may still hold bytes it does not).
pub async fn known(db: &Db, digest: &str) -> Result<bool> {
    let found: Option<String> =
        sqlx::query_scalar("SELECT digest FROM blobs WHERE digest = $1").bind(digest).fetch_optional(db.pool()).await?;
    Ok(found.is_some())
}

/// How many rows reference `digest` (None: not in the ledger).
pub async fn refs(db: &Db, digest: &str) -> Result<Option<i64>> {
    Ok(sqlx::query_scalar("SELECT refs FROM blobs WHERE digest = $1").bind(digest).fetch_optional(db.pool()).await?)
}

/// Blobs no row references and nobody touched since `cutoff`: what a collection may
/// delete, at most `limit` of them.
pub async fn collectable(db: &Db, cutoff: i64, limit: i64) -> Result<Vec<String>> {
    Ok(sqlx::query_scalar("SELECT digest FROM blobs WHERE refs <= 0 AND touched_at < $1 ORDER BY touched_at LIMIT $2")
        .bind(cutoff)
        .bind(limit)
        .fetch_all(db.pool())
        .await?)
}

/// A blob being deleted: its ledger row stays locked (a PostgreSQL row lock, or SQLite's
/// write lock) from the check until [`Deletion::finish`], so no server can touch or
/// reference it while its bytes go. Dropped unfinished, nothing changes.
pub struct Deletion {
    tx: sqlx::Transaction<'static, sqlx::Any>,
    digest: String,
}

/// Locks `digest` for deletion if it is still collectable at `cutoff` (another server
/// may have touched, referenced or collected it since it was listed).
pub async fn begin_deletion(db: &Db, digest: &str, cutoff: i64) -> Result<Option<Deletion>> {
    let mut tx = db.begin().await?;
    let lock = match db.backend() {
        Backend::Postgres => " FOR UPDATE",
        Backend::Sqlite => "",
    };
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT digest FROM blobs WHERE digest = $1 AND refs <= 0 AND touched_at < $2{lock}"
    )))
    .bind(digest)
    .bind(cutoff)
    .fetch_optional(&mut *tx)
    .await?;
    match row {
        Some(row) => Ok(Some(Deletion { tx, digest: row.try_get("digest")? })),
        None => Ok(None),
    }
}

impl Deletion {
    /// Forgets the blob, once its bytes are gone from the object store.
    pub async fn finish(mut self) -> Result<()> {
        sqlx::query("DELETE FROM blobs WHERE digest = $1").bind(&self.digest).execute(&mut *self.tx).await?;
        self.tx.commit().await?;
        Ok(())
    }
}
