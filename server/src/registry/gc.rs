//! Garbage collection of blobs, safe with several servers on one database and one object
//! store: a blob goes only once the ledger says no row references it and nobody touched
//! it for the grace period, and its ledger row stays locked while its bytes are deleted,
//! so no server can start using it meanwhile. Blobs the ledger never heard of (a crash
//! between a blob's write and its row) are adopted first and follow the same rule.

use std::time::Duration;

use futures_util::StreamExt;

use super::blobs::{BlobError, BlobStore};
use crate::state::AppState;
use crate::store::blobs as ledger;
use crate::store::db::{now_ms, Db};

/// What one collection did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Collected {
    /// Blobs found in the store without a ledger row, older than the grace period.
    pub adopted: usize,
    /// Blobs deleted.
    pub deleted: usize,
    /// Staging directories of servers that are gone.
    pub staging_dirs: usize,
}

/// Ledger rows handled per query.
const BATCH: i64 = 100;

/// Collects what was unreferenced and untouched for `grace` before `now` (ms).
pub async fn collect(blobs: &BlobStore, db: &Db, now: i64, grace: Duration) -> Result<Collected, BlobError> {
    let cutoff = now.saturating_sub(grace.as_millis() as i64);
    let mut collected = Collected { staging_dirs: blobs.sweep_staging()?, ..Collected::default() };

    let mut listing = blobs.list();
    while let Some(found) = listing.next().await {
        let (digest, modified_at) = found?;
        // A younger one may be an upload whose row is being written right now.
        if modified_at < cutoff && !ledger::known(db, &digest).await? && ledger::adopt(db, &digest, modified_at).await?
        {
            collected.adopted += 1;
        }
    }

    loop {
        let batch = ledger::collectable(db, cutoff, BATCH).await?;
        for digest in &batch {
            // Another server may have touched, referenced or collected it since.
            if let Some(deletion) = ledger::begin_deletion(db, digest, cutoff).await? {
                blobs.remove(digest).await?;
                deletion.finish().await?;
                collected.deleted += 1;
            }
        }
        if (batch.len() as i64) < BATCH {
            break;
        }
    }
    Ok(collected)
}

/// Collects garbage every few minutes until the server stops (every server runs one;
/// the ledger keeps them from stepping on each other).
pub fn spawn(state: AppState) {
    let grace = Duration::from_secs(state.config.blob_grace_secs);
    let period = (grace / 4).clamp(Duration::from_secs(10), Duration::from_secs(600));
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(period);
        loop {
            ticker.tick().await;
            match collect(&state.blobs, &state.db, now_ms(), grace).await {
                Ok(Collected { adopted: 0, deleted: 0, staging_dirs: 0 }) => {}
                Ok(done) => tracing::info!(?done, "blob garbage collected"),
                Err(e) => tracing::warn!(error = %e, "blob garbage collection failed"),
            }
        }
    });
}
