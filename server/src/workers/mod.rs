//! Workers as people see them: hosts with their devices, online or offline.

pub mod agent;

use axum::extract::State;
use axum::http::StatusCode;
use tessera_api::workers::Worker;
use uuid::Uuid;

use crate::auth::Principal;
use crate::error::{ApiJson, ApiPath, Error, Result};
use crate::state::AppState;
use crate::store::db::now_ms;
use crate::store::workers::Retired;
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

/// Remove a worker that is gone for good (admins): it leaves the list and its secret stops
/// working; the jobs it ran keep naming it. Only an offline worker: a running one would
/// register again at once with the worker token (to keep a host out, change
/// TESSERA_WORKER_TOKEN, which cuts off every worker admitted with the old one). A worker
/// that joins under the same name later comes back.
#[utoipa::path(delete, path = "/api/v1/workers/{id}", tag = "workers", security(("bearer" = [])),
    params(("id" = Uuid, Path)),
    responses((status = 204), (status = 403, body = tessera_api::error::ErrorBody),
              (status = 404, body = tessera_api::error::ErrorBody), (status = 409, body = tessera_api::error::ErrorBody)))]
pub async fn remove(
    State(state): State<AppState>,
    principal: Principal,
    ApiPath(id): ApiPath<Uuid>,
) -> Result<StatusCode> {
    principal.require_admin()?;
    retire(&state, id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Retires worker `id` (see [`remove`]).
pub async fn retire(state: &AppState, id: Uuid) -> Result<()> {
    match store::retire(&state.db, id, online_since(state)).await? {
        Retired::Yes => {
            // Whatever it still held (a lease not yet expired) goes back to the queue.
            crate::store::jobs::release_held_by(&state.db, id).await?;
            tracing::info!(worker = %id, "worker removed");
            Ok(())
        }
        Retired::Online => Err(Error::Conflict(
            "The worker is online; stop it first (a running worker registers again at once), then remove it.".into(),
        )),
        Retired::Unknown => Err(Error::not_found("Worker")),
    }
}
