//! The `/api/v1/models` routes and the agent's model routes: each unpacks the request
//! and calls the registry function the dashboard calls too.

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::Response;
use tessera_api::models::Model;
use uuid::Uuid;

use crate::auth::{AgentAuth, Principal};
use crate::error::{ApiJson, ApiMultipart, ApiPath, Error, Result};
use crate::paging::{self, PageQuery};
use crate::state::AppState;
use crate::store::Scope;

/// Upload a model as `multipart/form-data`: a text field `name` and one part named
/// `files` per file, whose filename is its path in the model folder.
#[utoipa::path(post, path = "/api/v1/models", tag = "models", security(("bearer" = [])),
    request_body(content_type = "multipart/form-data", description = "field `name`, parts `files`"),
    responses((status = 201, body = Model), (status = 409, body = tessera_api::error::ErrorBody),
              (status = 413, body = tessera_api::error::ErrorBody), (status = 422, body = tessera_api::error::ErrorBody)))]
pub async fn upload(
    State(state): State<AppState>,
    principal: Principal,
    ApiMultipart(mut multipart): ApiMultipart,
) -> Result<(StatusCode, ApiJson<Model>)> {
    Ok((StatusCode::CREATED, ApiJson(super::upload_model(&state, &principal, &mut multipart).await?)))
}

/// List models, newest first (yours; an admin sees all), paged as `GET /api/v1/jobs` is:
/// while more follow, the `Link` header (`rel="next"`) is the next page's URL.
#[utoipa::path(get, path = "/api/v1/models", tag = "models", security(("bearer" = [])), params(PageQuery),
    responses((status = 200, body = Vec<Model>, headers(("link" = String, description = "The next page, if any"))),
              (status = 400, body = tessera_api::error::ErrorBody)))]
pub async fn list(State(state): State<AppState>, principal: Principal, query: PageQuery) -> Result<Response> {
    let limit = paging::limit(query.limit)?;
    let page = super::page(&state, &principal.scope(), query.before, limit).await?;
    paging::respond(page, |model| model.id, "models", limit, "")
}

/// A model by its id or by the name it was registered under (yours).
#[utoipa::path(get, path = "/api/v1/models/{id}", tag = "models", security(("bearer" = [])),
    params(("id" = String, Path, description = "id or name")),
    responses((status = 200, body = Model), (status = 404, body = tessera_api::error::ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    principal: Principal,
    ApiPath(id): ApiPath<String>,
) -> Result<ApiJson<Model>> {
    Ok(ApiJson(super::resolve(&state, &principal, &id).await?))
}

/// Delete a model (by id or name); its files are removed unless another model shares them.
#[utoipa::path(delete, path = "/api/v1/models/{id}", tag = "models", security(("bearer" = [])),
    params(("id" = String, Path, description = "id or name")),
    responses((status = 204), (status = 404, body = tessera_api::error::ErrorBody)))]
pub async fn delete(
    State(state): State<AppState>,
    principal: Principal,
    ApiPath(id): ApiPath<String>,
) -> Result<StatusCode> {
    let model = super::resolve(&state, &principal, &id).await?;
    super::delete_visible(&state, &principal.scope(), model.id).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn file_response(state: &AppState, model: &Model, path: &str) -> Result<Response> {
    let file = model.files.iter().find(|f| f.path == path).ok_or_else(|| Error::not_found(&format!("File '{path}'")))?;
    let stream = state.blobs.read(&file.digest).await?;
    Response::builder()
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(header::CONTENT_LENGTH, file.size_bytes)
        .header(header::ETAG, format!("\"{}\"", file.digest))
        .body(Body::from_stream(stream))
        .map_err(|_| Error::Invariant("a file response's headers are valid"))
}

/// Download one file of a model, byte for byte as uploaded.
#[utoipa::path(get, path = "/api/v1/models/{id}/files/{*path}", tag = "models", security(("bearer" = [])),
    params(("id" = String, Path, description = "id or name"),
           ("path" = String, Path, description = "path inside the model folder")),
    responses((status = 200, content_type = "application/octet-stream"), (status = 404, body = tessera_api::error::ErrorBody)))]
pub async fn download(
    State(state): State<AppState>,
    principal: Principal,
    ApiPath((id, path)): ApiPath<(String, String)>,
) -> Result<Response> {
    let model = super::resolve(&state, &principal, &id).await?;
    file_response(&state, &model, &path).await
}

/// A worker fetching a model file for a job it holds (403 for a model none of its jobs use).
#[utoipa::path(get, path = "/api/v1/agent/models/{id}/files/{*path}", tag = "agent", security(("worker" = [])),
    params(("id" = Uuid, Path), ("path" = String, Path)),
    responses((status = 200, content_type = "application/octet-stream"), (status = 403, body = tessera_api::error::ErrorBody),
              (status = 404, body = tessera_api::error::ErrorBody)))]
pub async fn agent_download(
    State(state): State<AppState>,
    agent: AgentAuth,
    ApiPath((id, path)): ApiPath<(Uuid, String)>,
) -> Result<Response> {
    crate::workers::agent::check_uses_model(&state, agent.worker_id, id).await?;
    let model = super::find(&state, &Scope::all(), id).await?;
    file_response(&state, &model, &path).await
}

/// A model's metadata for a worker holding a job that uses it (any user's model).
#[utoipa::path(get, path = "/api/v1/agent/models/{id}", tag = "agent", security(("worker" = [])),
    params(("id" = Uuid, Path)), responses((status = 200, body = Model), (status = 403, body = tessera_api::error::ErrorBody),
              (status = 404, body = tessera_api::error::ErrorBody)))]
pub async fn agent_get(State(state): State<AppState>, agent: AgentAuth, ApiPath(id): ApiPath<Uuid>) -> Result<ApiJson<Model>> {
    crate::workers::agent::check_uses_model(&state, agent.worker_id, id).await?;
    Ok(ApiJson(super::find(&state, &Scope::all(), id).await?))
}
