//! Personal API tokens: long-lived bearer secrets for scripts and inference clients.
//! The secret is shown once at creation; only its digest is stored.

use axum::extract::State;
use axum::http::StatusCode;
use sqlx::any::AnyRow;
use sqlx::Row;
use tessera_api::accounts::{ApiToken, CreateToken, CreatedToken};
use uuid::Uuid;

use crate::app::AppState;
use crate::auth::{secrets, Principal};
use crate::store::db::{self, now_ms};
use crate::error::{ApiJson, ApiPath, Error, Result};

fn from_row(row: &AnyRow) -> Result<ApiToken> {
    let id: String = row.try_get("id")?;
    Ok(ApiToken {
        id: id.parse().map_err(|e| anyhow::anyhow!("bad token id {id}: {e}"))?,
        name: row.try_get("name")?,
        prefix: row.try_get("prefix")?,
        owner: row.try_get("username")?,
        created_at: db::time(row.try_get("created_at")?),
        last_used_at: db::opt_time(row.try_get("last_used_at")?),
    })
}

/// Create a personal API token; the response holds the secret, shown only this once.
#[utoipa::path(post, path = "/api/v1/tokens", tag = "tokens", security(("bearer" = [])), request_body = CreateToken,
    responses((status = 201, body = CreatedToken), (status = 422, body = tessera_api::error::ErrorBody)))]
pub async fn create(
    State(state): State<AppState>,
    principal: Principal,
    ApiJson(request): ApiJson<CreateToken>,
) -> Result<(StatusCode, ApiJson<CreatedToken>)> {
    let name = request.name.trim();
    if name.is_empty() || name.len() > 100 {
        return Err(Error::invalid("invalid_name", "A token name has 1 to 100 characters."));
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
    sqlx::query(
        "INSERT INTO api_tokens (id, user_id, name, prefix, token_hash, created_at) VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(info.id.to_string())
    .bind(principal.id.to_string())
    .bind(&info.name)
    .bind(&info.prefix)
    .bind(secrets::digest(&secret))
    .bind(info.created_at.timestamp_millis())
    .execute(state.db.pool())
    .await?;
    Ok((StatusCode::CREATED, ApiJson(CreatedToken { info, token: secret })))
}

/// List your API tokens (an admin sees everyone's).
#[utoipa::path(get, path = "/api/v1/tokens", tag = "tokens", security(("bearer" = [])),
    responses((status = 200, body = Vec<ApiToken>)))]
pub async fn list(State(state): State<AppState>, principal: Principal) -> Result<ApiJson<Vec<ApiToken>>> {
    let rows = sqlx::query(
        "SELECT t.id, t.name, t.prefix, t.created_at, t.last_used_at, u.username FROM api_tokens t \
         JOIN users u ON u.id = t.user_id WHERE ($1 IS NULL OR t.user_id = $1) ORDER BY t.created_at",
    )
    .bind(principal.owner_filter())
    .fetch_all(state.db.pool())
    .await?;
    Ok(ApiJson(rows.iter().map(from_row).collect::<Result<_>>()?))
}

/// Revoke an API token: it stops working at once on this server (on other servers of a
/// shared database within `TESSERA_AUTH_CACHE_SECS`).
#[utoipa::path(delete, path = "/api/v1/tokens/{id}", tag = "tokens", security(("bearer" = [])),
    params(("id" = Uuid, Path)), responses((status = 204), (status = 404, body = tessera_api::error::ErrorBody)))]
pub async fn revoke(
    State(state): State<AppState>,
    principal: Principal,
    ApiPath(id): ApiPath<Uuid>,
) -> Result<StatusCode> {
    let deleted: Vec<String> =
        sqlx::query_scalar("DELETE FROM api_tokens WHERE id = $1 AND ($2 IS NULL OR user_id = $2) RETURNING token_hash")
            .bind(id.to_string())
            .bind(principal.owner_filter())
            .fetch_all(state.db.pool())
            .await?;
    if deleted.is_empty() {
        return Err(Error::not_found("Token"));
    }
    for digest in &deleted {
        state.auth_cache.forget_token(digest);
    }
    Ok(StatusCode::NO_CONTENT)
}
