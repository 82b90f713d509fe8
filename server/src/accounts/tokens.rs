//! Personal API tokens: long-lived bearer secrets for scripts and inference clients.
//! The secret is shown once at creation; only its digest is stored.

use axum::extract::State;
use axum::http::StatusCode;
use tessera_api::accounts::{ApiToken, CreateToken, CreatedToken};
use uuid::Uuid;

use crate::auth::{secrets, Principal};
use crate::error::{ApiJson, ApiPath, Error, Result};
use crate::state::AppState;
use crate::store::db::{self, now_ms};
use crate::store::users;

/// Create a personal API token; the response holds the secret, shown only this once.
#[utoipa::path(post, path = "/api/v1/tokens", tag = "tokens", security(("bearer" = [])), request_body = CreateToken,
    responses((status = 201, body = CreatedToken), (status = 403, body = tessera_api::error::ErrorBody),
              (status = 422, body = tessera_api::error::ErrorBody)))]
pub async fn create(
    State(state): State<AppState>,
    principal: Principal,
    ApiJson(request): ApiJson<CreateToken>,
) -> Result<(StatusCode, ApiJson<CreatedToken>)> {
    let name = request.name.trim();
    if name.is_empty() || name.len() > 100 || name.chars().any(char::is_control) {
        return Err(Error::invalid("invalid_name", "A token name has 1 to 100 characters, none of them a control character."));
    }
    let secret = secrets::generate(secrets::API_TOKEN_PREFIX);
    let info = ApiToken {
        id: Uuid::new_v4(),
        name: name.to_string(),
        prefix: secret[..secrets::API_TOKEN_PREFIX.len() + 6].to_string(),
        owner: principal.username.clone(),
        created_at: db::time(now_ms()),
        last_used_at: None,
    };
    // A user disabled while this request ran gets no token (see `users::insert_token`).
    if !users::insert_token(&state.db, principal.id, &info, &secrets::digest(&secret)).await? {
        return Err(crate::auth::account_disabled());
    }
    Ok((StatusCode::CREATED, ApiJson(CreatedToken { info, token: secret })))
}

/// List your API tokens (an admin sees everyone's).
#[utoipa::path(get, path = "/api/v1/tokens", tag = "tokens", security(("bearer" = [])),
    responses((status = 200, body = Vec<ApiToken>)))]
pub async fn list(State(state): State<AppState>, principal: Principal) -> Result<ApiJson<Vec<ApiToken>>> {
    Ok(ApiJson(users::list_tokens(&state.db, &principal.scope()).await?))
}

/// Revoke an API token: it stops working at once on this server, and on the other
/// servers of a shared database as soon as they hear of it.
#[utoipa::path(delete, path = "/api/v1/tokens/{id}", tag = "tokens", security(("bearer" = [])),
    params(("id" = Uuid, Path)), responses((status = 204), (status = 404, body = tessera_api::error::ErrorBody)))]
pub async fn revoke(
    State(state): State<AppState>,
    principal: Principal,
    ApiPath(id): ApiPath<Uuid>,
) -> Result<StatusCode> {
    let deleted = users::delete_token(&state.db, &principal.scope(), id).await?;
    if deleted.is_empty() {
        return Err(Error::not_found("Token"));
    }
    for digest in deleted {
        crate::auth::revocations::revoked(&state, crate::store::revocations::Revoked::Token(digest)).await;
    }
    Ok(StatusCode::NO_CONTENT)
}
