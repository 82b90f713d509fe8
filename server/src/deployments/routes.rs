//! The `/api/v1/deployments` routes: each unpacks the request and calls the function of
//! the same name in `deployments`, which the dashboard calls too.

use axum::extract::State;
use axum::http::StatusCode;
use tessera_api::deployments::{CreateDeployment, Deployment, DeploymentStats, UpdateDeployment};

use crate::auth::Principal;
use crate::error::{ApiJson, ApiPath, Result};
use crate::state::AppState;

/// Serve a model under a name.
#[utoipa::path(post, path = "/api/v1/deployments", tag = "deployments", security(("bearer" = [])),
    request_body = CreateDeployment,
    responses((status = 201, body = Deployment), (status = 409, body = tessera_api::error::ErrorBody),
              (status = 422, body = tessera_api::error::ErrorBody)))]
pub async fn create(
    State(state): State<AppState>,
    principal: Principal,
    ApiJson(request): ApiJson<CreateDeployment>,
) -> Result<(StatusCode, ApiJson<Deployment>)> {
    Ok((StatusCode::CREATED, ApiJson(super::create(&state, &principal, request).await?)))
}

/// List deployments (yours; an admin sees all).
#[utoipa::path(get, path = "/api/v1/deployments", tag = "deployments", security(("bearer" = [])),
    responses((status = 200, body = Vec<Deployment>)))]
pub async fn list(State(state): State<AppState>, principal: Principal) -> Result<ApiJson<Vec<Deployment>>> {
    Ok(ApiJson(super::list_visible(&state.db, &principal.scope()).await?))
}

/// A deployment with its replicas, by id or name.
#[utoipa::path(get, path = "/api/v1/deployments/{id}", tag = "deployments", security(("bearer" = [])),
    params(("id" = String, Path, description = "id or name")),
    responses((status = 200, body = Deployment), (status = 404, body = tessera_api::error::ErrorBody)))]
pub async fn get(State(state): State<AppState>, principal: Principal, ApiPath(id): ApiPath<String>) -> Result<ApiJson<Deployment>> {
    Ok(ApiJson(super::resolve(&state.db, &principal.scope(), &id).await?))
}

/// Change the number of replicas, whether it lends idle slices to training (`loanable`),
/// or its `reclaim_headroom`.
#[utoipa::path(patch, path = "/api/v1/deployments/{id}", tag = "deployments", security(("bearer" = [])),
    params(("id" = String, Path, description = "id or name")), request_body = UpdateDeployment,
    responses((status = 200, body = Deployment), (status = 404, body = tessera_api::error::ErrorBody),
              (status = 422, body = tessera_api::error::ErrorBody)))]
pub async fn update(
    State(state): State<AppState>,
    principal: Principal,
    ApiPath(id): ApiPath<String>,
    ApiJson(request): ApiJson<UpdateDeployment>,
) -> Result<ApiJson<Deployment>> {
    Ok(ApiJson(super::update(&state, &principal, &id, request).await?))
}

/// Stop serving: every replica is stopped at its worker's next heartbeat.
#[utoipa::path(delete, path = "/api/v1/deployments/{id}", tag = "deployments", security(("bearer" = [])),
    params(("id" = String, Path, description = "id or name")),
    responses((status = 204), (status = 404, body = tessera_api::error::ErrorBody)))]
pub async fn delete(State(state): State<AppState>, principal: Principal, ApiPath(id): ApiPath<String>) -> Result<StatusCode> {
    super::delete(&state, &principal, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Traffic this server forwarded to the deployment: totals since the server started and
/// the last ten minutes in five-second buckets (request rate, latency percentiles, batch
/// size, tokens per batch). Kept in memory; each server counts the requests it served.
#[utoipa::path(get, path = "/api/v1/deployments/{id}/stats", tag = "deployments", security(("bearer" = [])),
    params(("id" = String, Path, description = "id or name")),
    responses((status = 200, body = DeploymentStats), (status = 404, body = tessera_api::error::ErrorBody)))]
pub async fn stats(State(state): State<AppState>, principal: Principal, ApiPath(id): ApiPath<String>) -> Result<ApiJson<DeploymentStats>> {
    let deployment = super::resolve(&state.db, &principal.scope(), &id).await?;
    Ok(ApiJson(state.gateway.stats.snapshot(deployment.id)))
}
