//! Users and logins. The first start creates `admin`; admins create everyone else.

pub mod tokens;

use std::net::SocketAddr;
use std::time::Instant;

use axum::extract::{ConnectInfo, State};
use axum::http::StatusCode;
use tessera_api::accounts::{CreateUser, LoginRequest, LoginResponse, Role, User};
use uuid::Uuid;

use crate::auth::{password, Principal};
use crate::error::{ApiJson, Error, Result};
use crate::state::AppState;
use crate::store::db::{now_ms, Db};
use crate::store::users::{self, StoredUser};

fn check_username(username: &str) -> Result<()> {
    let ok = (1..=64).contains(&username.len())
        && username.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    if ok {
        Ok(())
    } else {
        Err(Error::invalid(
            "invalid_username",
            "A username has 1 to 64 characters: letters, digits, '_', '-' or '.'.",
        ))
    }
}

/// Creates a user after checking the name and password rules.
pub async fn create_user(db: &Db, request: CreateUser) -> Result<User> {
    check_username(&request.username)?;
    password::check_strength(&request.password)?;
    let hash = password::hash(request.password).await?;
    let user = StoredUser {
        id: Uuid::new_v4(),
        username: request.username,
        role: request.role,
        password_hash: hash,
        created_at: now_ms(),
    };
    users::insert(db, &user).await.map_err(|e| {
        if e.is_unique_violation() {
            Error::Conflict(format!("A user named '{}' already exists; pick another name.", user.username))
        } else {
            e.into()
        }
    })?;
    Ok(user.to_api())
}

/// Creates `admin` when there is no user at all. Returns the generated password, which
/// the caller prints once; a configured password is never echoed.
pub async fn bootstrap_admin(db: &Db, configured: Option<&str>) -> Result<Option<String>> {
    if users::count(db).await? > 0 {
        return Ok(None);
    }
    let (password, generated) = match configured {
        Some(password) => (password.to_string(), false),
        None => (crate::auth::secrets::generate("")[..24].to_string(), true),
    };
    let request = CreateUser { username: "admin".into(), password: password.clone(), role: Role::Admin };
    create_user(db, request).await?;
    Ok(generated.then_some(password))
}

/// The longest username a login may carry: more than any real one (64 characters), so a
/// login with a longer one is refused before it costs a throttling bucket or a hash.
pub const MAX_LOGIN_USERNAME_BYTES: usize = 256;
/// The longest password a login may carry; Argon2 would hash a megabyte just as slowly.
pub const MAX_LOGIN_PASSWORD_BYTES: usize = 1024;

/// Checks a username and password, with throttling, and returns the user.
pub async fn check_login(state: &AppState, client: SocketAddr, request: &LoginRequest) -> Result<StoredUser> {
    if request.username.len() > MAX_LOGIN_USERNAME_BYTES || request.password.len() > MAX_LOGIN_PASSWORD_BYTES {
        return Err(Error::BadRequest(format!(
            "A login's username has at most {MAX_LOGIN_USERNAME_BYTES} bytes and its password at most \
             {MAX_LOGIN_PASSWORD_BYTES} bytes."
        )));
    }
    state
        .login_limiter
        .attempt(client.ip(), &request.username, Instant::now())
        .map_err(|retry_after_secs| Error::TooManyRequests { retry_after_secs })?;
    let wrong = || Error::Unauthorized("Wrong username or password.".into());
    let user = users::find_by_name(&state.db, &request.username).await?;
    let Some(user) = user else {
        // Spend the same time as a real check so timing does not reveal which names exist.
        let _ = password::hash(request.password.clone()).await;
        return Err(wrong());
    };
    if password::verify(request.password.clone(), user.password_hash.clone()).await? {
        Ok(user)
    } else {
        Err(wrong())
    }
}

/// Exchange a username and password for a session token.
#[utoipa::path(post, path = "/api/v1/auth/login", tag = "accounts", request_body = LoginRequest,
    responses((status = 200, body = LoginResponse), (status = 401, body = tessera_api::error::ErrorBody),
              (status = 429, description = "Too many attempts")))]
pub async fn login(
    State(state): State<AppState>,
    ConnectInfo(client): ConnectInfo<SocketAddr>,
    ApiJson(request): ApiJson<LoginRequest>,
) -> Result<ApiJson<LoginResponse>> {
    let user = check_login(&state, client, &request).await?;
    let (token, expires_at) = state.sessions.issue(&user.id.to_string());
    Ok(ApiJson(LoginResponse { token, expires_at }))
}

/// The user the request is authenticated as.
#[utoipa::path(get, path = "/api/v1/auth/me", tag = "accounts", security(("bearer" = [])),
    responses((status = 200, body = User)))]
pub async fn me(State(state): State<AppState>, principal: Principal) -> Result<ApiJson<User>> {
    let user = users::find(&state.db, principal.id).await?.ok_or_else(|| Error::not_found("User"))?;
    Ok(ApiJson(user.to_api()))
}

/// Create a user (admins only).
#[utoipa::path(post, path = "/api/v1/users", tag = "accounts", security(("bearer" = [])), request_body = CreateUser,
    responses((status = 201, body = User), (status = 403, body = tessera_api::error::ErrorBody),
              (status = 409, body = tessera_api::error::ErrorBody)))]
pub async fn create(
    State(state): State<AppState>,
    principal: Principal,
    ApiJson(request): ApiJson<CreateUser>,
) -> Result<(StatusCode, ApiJson<User>)> {
    principal.require_admin()?;
    Ok((StatusCode::CREATED, ApiJson(create_user(&state.db, request).await?)))
}

/// List users (admins only).
#[utoipa::path(get, path = "/api/v1/users", tag = "accounts", security(("bearer" = [])),
    responses((status = 200, body = Vec<User>)))]
pub async fn list(State(state): State<AppState>, principal: Principal) -> Result<ApiJson<Vec<User>>> {
    principal.require_admin()?;
    Ok(ApiJson(users::list(&state.db).await?.iter().map(StoredUser::to_api).collect()))
}
