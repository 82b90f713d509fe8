//! Keeping every server's auth cache honest: a revocation is forgotten here at once and
//! announced to the other servers of a shared PostgreSQL database, and each server
//! listens for theirs (`store::revocations`). A server that loses the connection forgets
//! its whole cache, since it may have missed some; `TESSERA_AUTH_CACHE_SECS` is then
//! still the bound.

use std::time::Duration;

use crate::state::AppState;
use crate::store::db::Backend;
use crate::store::revocations::{self, Heard, Revoked};

fn forget(state: &AppState, revoked: &Revoked) {
    let cache = &state.auth_cache;
    match revoked {
        Revoked::Session(id) => cache.forget_session(*id),
        Revoked::Token(digest) => cache.forget_token(digest),
        Revoked::User(id) => cache.forget_user(*id),
    }
}

/// Forgets `revoked` here and tells the other servers. The database already says it is
/// revoked, so a failed announcement is logged, not returned: the others then trust
/// their cached copy for at most `TESSERA_AUTH_CACHE_SECS`.
pub async fn revoked(state: &AppState, revoked: Revoked) {
    forget(state, &revoked);
    if let Err(error) = revocations::publish(&state.db, &revoked).await {
        tracing::warn!(%error, "could not announce a revocation to the other servers");
    }
}

/// On PostgreSQL with the auth cache on, listens for other servers' revocations until
/// the process ends.
pub fn spawn_listener(state: &AppState) {
    if state.db.backend() != Backend::Postgres || state.config.auth_cache_secs == 0 {
        return;
    }
    let state = state.clone();
    tokio::spawn(async move {
        let url = state.config.database_url();
        loop {
            match revocations::subscribe(&url).await {
                Ok(mut subscription) => {
                    // Whatever was announced before this point was not heard.
                    state.auth_cache.forget_all();
                    loop {
                        match subscription.next().await {
                            Ok(Heard::Revoked(revoked)) => forget(&state, &revoked),
                            Ok(Heard::Unknown) => {}
                            Ok(Heard::Lost) => state.auth_cache.forget_all(),
                            Err(error) => {
                                tracing::warn!(%error, "lost the revocation channel; listening again shortly");
                                state.auth_cache.forget_all();
                                break;
                            }
                        }
                    }
                }
                Err(error) => tracing::warn!(%error, "cannot listen for revocations; retrying shortly"),
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
}
