//! Users and logins. The first start creates `admin`; admins create everyone else and
//! may disable them. A sign-in is a session row the server can end (log out, a password
//! change, a disabled user), not only a JWT that lives until it expires.

pub mod tokens;

use std::net::IpAddr;
use std::time::Instant;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use tessera_api::accounts::{ChangePassword, CreateUser, LoginRequest, LoginResponse, Role, UpdateUser, User};
use uuid::Uuid;

use crate::auth::client::ClientAddr;
use crate::auth::{self, password, revocations, Principal};
use crate::error::{ApiJson, ApiPath, Error, Result};
use crate::state::AppState;
use crate::store::db::{now_ms, Db};
use crate::store::revocations::Revoked;
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

/// A new user's row for `request`, after checking the name and password rules.
async fn new_user(request: CreateUser) -> Result<StoredUser> {
    check_username(&request.username)?;
    password::check_strength(&request.password)?;
    let hash = password::hash(request.password).await?;
    Ok(StoredUser {
        id: Uuid::new_v4(),
        username: request.username,
        role: request.role,
        password_hash: hash,
        created_at: now_ms(),
        disabled_at: None,
    })
}

/// Creates a user after checking the name and password rules.
pub async fn create_user(db: &Db, request: CreateUser) -> Result<User> {
    let user = new_user(request).await?;
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
/// the caller prints once; a configured password is never echoed. Servers starting at once
/// on one empty database may all get here: the first insert wins, and the others return
/// `None`, so only the winner's password (the one that works) is ever printed.
pub async fn bootstrap_admin(db: &Db, configured: Option<&str>) -> Result<Option<String>> {
    if users::count(db).await? > 0 {
        return Ok(None);
    }
    let (password, generated) = match configured {
        Some(password) => (password.to_string(), false),
        None => (crate::auth::secrets::generate("")[..24].to_string(), true),
    };
    let user = new_user(CreateUser { username: "admin".into(), password: password.clone(), role: Role::Admin }).await?;
    match users::insert(db, &user).await {
        Ok(()) => Ok(generated.then_some(password)),
        Err(e) if e.is_unique_violation() && users::find_by_name(db, &user.username).await?.is_some() => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// The longest username a login may carry: more than any real one (64 characters), so a
/// login with a longer one is refused before it costs a throttling bucket or a hash.
pub const MAX_LOGIN_USERNAME_BYTES: usize = 256;
/// The longest password a login may carry; Argon2 would hash a megabyte just as slowly.
pub const MAX_LOGIN_PASSWORD_BYTES: usize = 1024;

/// Checks a username and password, with throttling, and returns the user.
pub async fn check_login(state: &AppState, client: IpAddr, request: &LoginRequest) -> Result<StoredUser> {
    if request.username.len() > MAX_LOGIN_USERNAME_BYTES || request.password.len() > MAX_LOGIN_PASSWORD_BYTES {
        return Err(Error::BadRequest(format!(
            "A login's username has at most {MAX_LOGIN_USERNAME_BYTES} bytes and its password at most \
             {MAX_LOGIN_PASSWORD_BYTES} bytes."
        )));
    }
    state
        .login_limiter
        .attempt(client, &request.username, Instant::now())
        .map_err(|retry_after_secs| Error::TooManyRequests { retry_after_secs })?;
    let wrong = || Error::Unauthorized("Wrong username or password.".into());
    let user = users::find_by_name(&state.db, &request.username).await?;
    let Some(user) = user else {
        // Spend the same time as a real check so timing does not reveal which names exist,
        // and answer a busy server's 503 as a real check would.
        password::hash(request.password.clone()).await?;
        return Err(wrong());
    };
    if !password::verify(request.password.clone(), user.password_hash.clone()).await? {
        return Err(wrong());
    }
    // Said only after the right password, so it tells a guesser nothing.
    if user.disabled_at.is_some() {
        return Err(auth::account_disabled());
    }
    Ok(user)
}

/// Changes the caller's password after checking the current one (throttled like a
/// login), and ends every other session of theirs; `session` (the one making the change,
/// if it is one) stays signed in. API tokens are separate credentials and stay valid.
/// Returns how many sessions were ended.
pub async fn change_password(
    state: &AppState,
    principal: &Principal,
    session: Option<Uuid>,
    client: IpAddr,
    request: ChangePassword,
) -> Result<usize> {
    if request.current_password.len() > MAX_LOGIN_PASSWORD_BYTES {
        return Err(Error::BadRequest(format!("A password has at most {MAX_LOGIN_PASSWORD_BYTES} bytes.")));
    }
    password::check_strength(&request.new_password)?;
    state
        .login_limiter
        .attempt(client, &principal.username, Instant::now())
        .map_err(|retry_after_secs| Error::TooManyRequests { retry_after_secs })?;
    let user = users::find(&state.db, principal.id).await?.ok_or_else(|| Error::not_found("User"))?;
    if !password::verify(request.current_password, user.password_hash).await? {
        return Err(Error::Forbidden("The current password is wrong; the password was not changed.".into()));
    }
    let hash = password::hash(request.new_password).await?;
    users::set_password_hash(&state.db, principal.id, &hash).await?;
    let ended = auth::end_sessions_of(state, principal.id, session).await?;
    tracing::info!(user = %principal.username, sessions_ended = ended, "password changed");
    Ok(ended)
}

/// Disables a user (ending every session and API token it holds, and refusing its
/// logins) or enables it again. Admins only, and never themselves: the last admin
/// could otherwise lock everyone out.
pub async fn set_disabled(state: &AppState, principal: &Principal, id: Uuid, disabled: bool) -> Result<User> {
    principal.require_admin()?;
    if disabled && id == principal.id {
        return Err(Error::Conflict("You cannot disable yourself; ask another admin.".into()));
    }
    let disabled_at = disabled.then(now_ms);
    if !users::set_disabled(&state.db, id, disabled_at).await? {
        return Err(Error::not_found("User"));
    }
    // The flag first, so nothing new can be issued; then what the user already holds.
    revocations::revoked(state, Revoked::User(id)).await;
    if disabled {
        let sessions = auth::end_sessions_of(state, id, None).await?;
        let tokens = users::delete_tokens_of(&state.db, id).await?;
        for digest in tokens.iter().cloned() {
            revocations::revoked(state, Revoked::Token(digest)).await;
        }
        tracing::info!(user = %id, by = %principal.username, sessions, tokens = tokens.len(), "user disabled");
    } else {
        tracing::info!(user = %id, by = %principal.username, "user enabled");
    }
    let user = users::find(&state.db, id).await?.ok_or_else(|| Error::not_found("User"))?;
    Ok(user.to_api())
}

/// Exchange a username and password for a session token.
#[utoipa::path(post, path = "/api/v1/auth/login", tag = "accounts", request_body = LoginRequest,
    responses((status = 200, body = LoginResponse), (status = 401, body = tessera_api::error::ErrorBody),
              (status = 403, body = tessera_api::error::ErrorBody), (status = 429, description = "Too many attempts"),
              (status = 503, description = "Too many password checks at once; send it again shortly")))]
pub async fn login(
    State(state): State<AppState>,
    ClientAddr(client): ClientAddr,
    ApiJson(request): ApiJson<LoginRequest>,
) -> Result<ApiJson<LoginResponse>> {
    let user = check_login(&state, client, &request).await?;
    let (token, expires_at) = auth::start_session(&state, user.id).await?;
    Ok(ApiJson(LoginResponse { token, expires_at }))
}

/// The session a request's bearer JWT names (`None` for an API token).
fn bearer_session(state: &AppState, headers: &HeaderMap) -> Option<Uuid> {
    auth::bearer_of(headers).and_then(|token| auth::session_of(state, token))
}

/// End the session this request is signed in with: its token stops working at once on
/// this server (on other servers of a shared database within `TESSERA_AUTH_CACHE_SECS`).
#[utoipa::path(post, path = "/api/v1/auth/logout", tag = "accounts", security(("bearer" = [])),
    responses((status = 204), (status = 400, body = tessera_api::error::ErrorBody),
              (status = 401, body = tessera_api::error::ErrorBody)))]
pub async fn logout(State(state): State<AppState>, _principal: Principal, headers: HeaderMap) -> Result<StatusCode> {
    let session = bearer_session(&state, &headers).ok_or_else(|| {
        let message = "This request uses an API token, not a session; revoke it with DELETE /api/v1/tokens/{id}.";
        Error::BadRequest(message.into())
    })?;
    auth::end_session(&state, session).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Change your password. Every other session of yours ends; the one making the change
/// stays signed in, and API tokens stay valid (revoke them under /api/v1/tokens).
#[utoipa::path(post, path = "/api/v1/auth/password", tag = "accounts", security(("bearer" = [])),
    request_body = ChangePassword,
    responses((status = 204), (status = 403, body = tessera_api::error::ErrorBody),
              (status = 422, body = tessera_api::error::ErrorBody), (status = 429, description = "Too many attempts")))]
pub async fn password(
    State(state): State<AppState>,
    principal: Principal,
    ClientAddr(client): ClientAddr,
    headers: HeaderMap,
    ApiJson(request): ApiJson<ChangePassword>,
) -> Result<StatusCode> {
    let session = bearer_session(&state, &headers);
    change_password(&state, &principal, session, client, request).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Disable or enable a user (admins only). Disabling ends every session and API token
/// the user holds and refuses its logins; enabling lets it sign in again.
#[utoipa::path(patch, path = "/api/v1/users/{id}", tag = "accounts", security(("bearer" = [])),
    params(("id" = Uuid, Path)), request_body = UpdateUser,
    responses((status = 200, body = User), (status = 403, body = tessera_api::error::ErrorBody),
              (status = 404, body = tessera_api::error::ErrorBody),
              (status = 409, body = tessera_api::error::ErrorBody)))]
pub async fn update(
    State(state): State<AppState>,
    principal: Principal,
    ApiPath(id): ApiPath<Uuid>,
    ApiJson(request): ApiJson<UpdateUser>,
) -> Result<ApiJson<User>> {
    principal.require_admin()?;
    let user = match request.disabled {
        Some(disabled) => set_disabled(&state, &principal, id, disabled).await?,
        None => users::find(&state.db, id).await?.ok_or_else(|| Error::not_found("User"))?.to_api(),
    };
    Ok(ApiJson(user))
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
