//! `GET /api/v1/fleet/loaning`: what the loaning rounds did, for API clients and the
//! dashboard alike (the dashboard's fleet page reads the same function).

use axum::extract::State;
use tessera_api::loaning::LoanOverview;

use crate::auth::Principal;
use crate::error::{ApiJson, Result};
use crate::state::AppState;
use crate::store::db::now_ms;
use crate::store::loaning as store;
use crate::store::Scope;

/// History the overview covers: the last hour.
pub const WINDOW_MS: i64 = 3600 * 1000;
/// Slice events the overview holds at most: the newest of the hour.
pub const SLICE_EVENTS: i64 = 2000;

/// The rounds, reclaims and slice events of the last hour and the training queue, as
/// `scope` may see them (other users' jobs and deployments are not named).
pub async fn overview(state: &AppState, scope: &Scope) -> Result<LoanOverview> {
    let since = now_ms() - WINDOW_MS;
    Ok(LoanOverview {
        rounds: store::rounds(&state.db, since).await?,
        reclaims: store::reclaims(&state.db, scope, since, 200).await?,
        slice_events: store::slice_events(&state.db, scope, since, SLICE_EVENTS).await?,
        queue: store::queue(&state.db, scope).await?,
    })
}

/// Loaned capacity over the last hour (slices per loan state at each scheduling round),
/// reclaim events with the jobs they hit, slice loan history, and the training queue the
/// last round planned with each job's predicted time to finish.
#[utoipa::path(get, path = "/api/v1/fleet/loaning", tag = "workers", security(("bearer" = [])),
    responses((status = 200, body = LoanOverview)))]
pub async fn get(
    State(state): State<AppState>,
    principal: Principal,
) -> Result<ApiJson<LoanOverview>> {
    Ok(ApiJson(overview(&state, &principal.scope()).await?))
}
