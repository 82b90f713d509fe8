//! Workers as people see them: hosts with their devices, online or offline.

pub mod agent;

use axum::extract::State;
use tessera_api::workers::Worker;

use crate::auth::Principal;
use crate::error::{ApiJson, Result};
use crate::state::AppState;
use crate::store::db::now_ms;
use crate::store::{slices, workers as store, Scope};

/// Misses this many heartbeats and a worker is shown offline.
const MISSED_BEATS_OFFLINE: i64 = 3;

/// The earliest last-seen time that still counts as online.
pub fn online_since(state: &AppState) -> i64 {
    now_ms() - MISSED_BEATS_OFFLINE * state.config.heartbeat_secs as i64 * 1000
}

/// Every worker with its slices and what holds each: the deployments holding slices are
/// named only where `scope` sees them (a user sees "in use" on other tenants' slices).
pub async fn list_all(state: &AppState, scope: &Scope) -> Result<Vec<Worker>> {
    let mut workers = store::list(&state.db, online_since(state)).await?;
    let mut slices = slices::by_worker(&state.db, scope).await?;
    for worker in &mut workers {
        worker.slices = slices.remove(&worker.id).unwrap_or_default();
    }
    Ok(workers)
}

pub async fn count_online(state: &AppState) -> Result<i64> {
    Ok(store::count_online(&state.db, online_since(state)).await?)
}

/// List workers with their devices and when each was last seen. Workers are shared
/// infrastructure, so every signed-in user sees all of them; a slice held by another
/// tenant's replica shows `in_use` without the deployment's name (admins see every name).
#[utoipa::path(get, path = "/api/v1/workers", tag = "workers", security(("bearer" = [])),
    responses((status = 200, body = Vec<Worker>)))]
pub async fn list(State(state): State<AppState>, principal: Principal) -> Result<ApiJson<Vec<Worker>>> {
    Ok(ApiJson(list_all(&state, &principal.scope()).await?))
}
