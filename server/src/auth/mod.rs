//! Who is calling: session JWTs and personal API tokens for people, per-worker secrets
//! for agents. Handlers take a `Principal` (or `AgentAuth`) and never parse headers.

pub mod cache;
pub mod client;
pub mod password;
pub mod rate_limit;
pub mod revocations;
pub mod secrets;
pub mod session;

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use tessera_api::accounts::Role;
use uuid::Uuid;

use crate::error::Error;
use crate::state::AppState;
use crate::store::revocations::Revoked;
use crate::store::{users, workers, Scope};

/// A signed-in person.
#[derive(Debug, Clone)]
pub struct Principal {
    pub id: Uuid,
    pub username: String,
    pub role: Role,
}

impl Principal {
    pub fn is_admin(&self) -> bool {
        self.role == Role::Admin
    }

    /// The rows this caller may see: everything for admins, their own otherwise.
    pub fn scope(&self) -> Scope {
        if self.is_admin() {
            Scope::all()
        } else {
            Scope::owned_by(self.id)
        }
    }

    pub fn require_admin(&self) -> Result<(), Error> {
        if self.is_admin() {
            Ok(())
        } else {
            Err(Error::Forbidden("Only an admin may do this.".into()))
        }
    }
}

const MISSING_CREDENTIALS: &str =
    "Send `Authorization: Bearer <token>`; get a token from POST /api/v1/auth/login.";

/// The bearer credential of a request, if it sends one.
pub fn bearer(parts: &Parts) -> Option<&str> {
    bearer_of(&parts.headers)
}

pub fn bearer_of(headers: &axum::http::HeaderMap) -> Option<&str> {
    let value = headers.get(axum::http::header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

impl FromRequestParts<AppState> for Principal {
    type Rejection = Error;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Error> {
        let token = bearer(parts).ok_or_else(|| Error::Unauthorized(MISSING_CREDENTIALS.into()))?;
        authenticate(state, token).await
    }
}

/// Resolves a session JWT (whose session must not have ended) or a personal API token to
/// the user it belongs to, who must not be disabled. What the database said is remembered
/// for a few seconds (see `cache`), so repeated calls with the same credential cost no
/// round trip; `last_used_at` is written when it is read.
pub async fn authenticate(state: &AppState, token: &str) -> Result<Principal, Error> {
    let invalid = || Error::Unauthorized("The token is invalid, expired or revoked; log in again.".into());
    let cache = &state.auth_cache;
    let user_id = if token.starts_with(secrets::API_TOKEN_PREFIX) {
        let digest = secrets::digest(token);
        match cache.token_user(&digest) {
            Some(user_id) => user_id,
            None => {
                let read_at = cache.generation();
                let user_id = users::use_token(&state.db, &digest).await?.ok_or_else(invalid)?;
                cache.remember_token(digest, user_id, read_at);
                user_id
            }
        }
    } else {
        let claims = state.sessions.verify(token).ok_or_else(invalid)?;
        let owner = match cache.session_user(claims.session) {
            Some(owner) => owner,
            None => {
                let read_at = cache.generation();
                let owner = users::session_user(&state.db, claims.session).await?.ok_or_else(invalid)?;
                cache.remember_session(claims.session, owner, read_at);
                owner
            }
        };
        if owner != claims.user {
            return Err(invalid());
        }
        owner
    };
    if let Some(principal) = cache.user(user_id) {
        return Ok(principal);
    }
    let read_at = cache.generation();
    let user = users::find(&state.db, user_id).await?.filter(|u| u.disabled_at.is_none()).ok_or_else(invalid)?;
    let principal = Principal { id: user.id, username: user.username, role: user.role };
    cache.remember_user(principal.clone(), read_at);
    Ok(principal)
}

/// The session a request's bearer JWT names, if it carries one (an API token has none).
pub fn session_of(state: &AppState, token: &str) -> Option<Uuid> {
    state.sessions.verify(token).map(|claims| claims.session)
}

/// What a disabled user is told when it signs in or asks for a credential: said only to
/// one that proved the password or holds a session, so it tells a guesser nothing.
pub fn account_disabled() -> Error {
    Error::Forbidden("This account is disabled; ask an admin to enable it.".into())
}

/// Starts a session for `user`: its row, then the JWT that names it. A user disabled
/// since its password was checked gets no row (the store checks in the same transaction),
/// so a login racing the disable cannot outlive it.
pub async fn start_session(state: &AppState, user: Uuid) -> Result<(String, chrono::DateTime<chrono::Utc>), Error> {
    let session = Uuid::new_v4();
    let (token, expires_at) = state.sessions.issue(user, session);
    if !users::insert_session(&state.db, session, user, expires_at.timestamp_millis()).await? {
        return Err(account_disabled());
    }
    Ok((token, expires_at))
}

/// Ends one session: at once here, and on the other servers of a shared PostgreSQL
/// database as soon as they hear of it (`revocations`).
pub async fn end_session(state: &AppState, session: Uuid) -> Result<(), Error> {
    users::delete_session(&state.db, session).await?;
    revocations::revoked(state, Revoked::Session(session)).await;
    Ok(())
}

/// Ends every session of `user` except `keep`.
pub async fn end_sessions_of(state: &AppState, user: Uuid, keep: Option<Uuid>) -> Result<usize, Error> {
    let ended = users::delete_sessions_of(&state.db, user, keep).await?;
    for session in &ended {
        revocations::revoked(state, Revoked::Session(*session)).await;
    }
    Ok(ended.len())
}

/// A registered worker calling the agent protocol with its own secret.
#[derive(Debug, Clone)]
pub struct AgentAuth {
    pub worker_id: Uuid,
}

impl FromRequestParts<AppState> for AgentAuth {
    type Rejection = Error;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Error> {
        let token = bearer(parts).ok_or_else(|| {
            Error::Unauthorized("Workers send `Authorization: Bearer <worker secret>` from registration.".into())
        })?;
        let unknown = || Error::Unauthorized("Unknown worker secret; register the worker again.".into());
        let digest = secrets::digest(token);
        let (worker_id, joined_with) = workers::by_secret(&state.db, &digest).await?.ok_or_else(unknown)?;
        // A changed (or unset) TESSERA_WORKER_TOKEN cuts off every worker admitted with the old one.
        let current = state.config.worker_token.as_deref().map(secrets::digest);
        if joined_with.is_some_and(|joined| current.as_deref() != Some(joined.as_str())) {
            return Err(Error::Unauthorized(
                "This worker joined with a worker token this server no longer accepts (TESSERA_WORKER_TOKEN \
                 changed or was unset); start it with the server's current token."
                    .into(),
            ));
        }
        if !workers::touch(&state.db, worker_id, &digest).await? {
            return Err(unknown());
        }
        Ok(AgentAuth { worker_id })
    }
}
