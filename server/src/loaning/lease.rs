//! The round's lease: a server runs the loaning round only while it holds the round's
//! `scheduler_leases` row, and it renews the row while the round runs, so a round longer
//! than the lease (a big fleet, a slow database) keeps it and no other server starts one.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;
use uuid::Uuid;

use crate::store::db::{now_ms, Db};
use crate::store::loaning::lead;
use crate::store::Result;

/// Takes (or renews) the lease `name` for `holder` for `ttl` and, when it is `holder`'s,
/// runs `work` while renewing it every third of `ttl`. `None` when another server holds
/// the lease, or when it was lost while `work` ran: then `work` is dropped at the await it
/// is in, before the lease lapses, and what it applied stays as after a round that failed.
pub async fn lead_while<T>(
    db: &Db,
    name: &str,
    holder: Uuid,
    ttl: Duration,
    work: impl Future<Output = T>,
) -> Result<Option<T>> {
    let taken = Instant::now();
    let now = now_ms();
    if !lead(db, name, holder, now, now + ttl.as_millis() as i64).await? {
        return Ok(None);
    }
    tokio::select! {
        done = work => Ok(Some(done)),
        () = keep(db, name, holder, ttl, taken) => Ok(None),
    }
}

/// Renews the lease taken at `renewed` every third of `ttl` and returns once it may be
/// lost: another server holds it, or no renewal succeeded by half a period before it would
/// lapse (the margin covers the statement in flight when `work` is dropped).
async fn keep(db: &Db, name: &str, holder: Uuid, ttl: Duration, mut renewed: Instant) {
    let period = ttl / 3;
    loop {
        let deadline = renewed + ttl - period / 2;
        tokio::time::sleep(period).await;
        let attempt = Instant::now();
        if attempt >= deadline {
            tracing::warn!(lease = name, "no lease renewal succeeded in time; stopping the round");
            return;
        }
        let now = now_ms();
        let renewal = lead(db, name, holder, now, now + ttl.as_millis() as i64);
        match tokio::time::timeout_at(deadline, renewal).await {
            Ok(Ok(true)) => renewed = attempt,
            Ok(Ok(false)) => {
                tracing::warn!(lease = name, "another server took the lease; stopping the round");
                return;
            }
            Ok(Err(e)) => tracing::warn!(lease = name, error = %e, "renewing the lease failed; trying again"),
            Err(_) => {
                tracing::warn!(lease = name, "the lease renewal did not finish in time; stopping the round");
                return;
            }
        }
    }
}
