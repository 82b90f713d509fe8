//! Users, their sign-in sessions and their personal API tokens. A token is stored as its
//! digest only; looking one up also records when it was last used. A session row is what
//! a session JWT's `sid` claim names: deleting it ends the session. A session or token is
//! stored only for a user not disabled, checked in the transaction that stores it.

use sqlx::any::AnyRow;
use sqlx::{AnyConnection, Row};
use tessera_api::accounts::{ApiToken, Role, User};
use uuid::Uuid;

use super::db::{self, now_ms, Db};
use super::{parse_uuid, Result, Scope, StoreError};

/// A user row, password hash included: only `accounts` and `auth` look at it.
#[derive(Debug, Clone)]
pub struct StoredUser {
    pub id: Uuid,
    pub username: String,
    pub role: Role,
    pub password_hash: String,
    pub created_at: i64,
    /// When an admin disabled the user; `None` for an active user.
    pub disabled_at: Option<i64>,
}

impl StoredUser {
    pub fn to_api(&self) -> User {
        User {
            id: self.id,
            username: self.username.clone(),
            role: self.role,
            created_at: db::time(self.created_at),
            disabled: self.disabled_at.is_some(),
        }
    }
}

const USER_COLUMNS: &str = "id, username, role, password_hash, created_at, disabled_at";

fn user_from_row(row: &AnyRow) -> Result<StoredUser> {
    let role: String = row.try_get("role")?;
    Ok(StoredUser {
        id: parse_uuid("users", "id", &row.try_get::<String, _>("id")?)?,
        username: row.try_get("username")?,
        role: Role::parse(&role).ok_or_else(|| StoreError::Corrupt {
            table: "users",
            column: "role",
            value: role.clone(),
            reason: "neither admin nor user".into(),
        })?,
        password_hash: row.try_get("password_hash")?,
        created_at: row.try_get("created_at")?,
        disabled_at: row.try_get("disabled_at")?,
    })
}

pub async fn find(db: &Db, id: Uuid) -> Result<Option<StoredUser>> {
    let row = sqlx::query(sqlx::AssertSqlSafe(format!("SELECT {USER_COLUMNS} FROM users WHERE id = $1")))
        .bind(id.to_string())
        .fetch_optional(db.pool())
        .await?;
    row.as_ref().map(user_from_row).transpose()
}

pub async fn find_by_name(db: &Db, username: &str) -> Result<Option<StoredUser>> {
    if !db::storable(username) {
        return Ok(None);
    }
    let row = sqlx::query(sqlx::AssertSqlSafe(format!("SELECT {USER_COLUMNS} FROM users WHERE username = $1")))
        .bind(username)
        .fetch_optional(db.pool())
        .await?;
    row.as_ref().map(user_from_row).transpose()
}

/// Every user, oldest first.
pub async fn list(db: &Db) -> Result<Vec<StoredUser>> {
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!("SELECT {USER_COLUMNS} FROM users ORDER BY created_at"))).fetch_all(db.pool()).await?;
    rows.iter().map(user_from_row).collect()
}

pub async fn count(db: &Db) -> Result<i64> {
    Ok(sqlx::query_scalar("SELECT COUNT(*) FROM users").fetch_one(db.pool()).await?)
}

/// Adds a user; a taken name is a unique violation (`StoreError::is_unique_violation`).
pub async fn insert(db: &Db, user: &StoredUser) -> Result<()> {
    sqlx::query("INSERT INTO users (id, username, role, password_hash, created_at) VALUES ($1, $2, $3, $4, $5)")
        .bind(user.id.to_string())
        .bind(&user.username)
        .bind(user.role.as_str())
        .bind(&user.password_hash)
        .bind(user.created_at)
        .execute(db.pool())
        .await?;
    Ok(())
}

/// The user an API token (by digest) belongs to, marking the token used now. Read first
/// and written only on a match: anyone may send a bogus token, and on SQLite every write
/// waits for the one write lock.
pub async fn use_token(db: &Db, digest: &str) -> Result<Option<Uuid>> {
    let user: Option<String> = sqlx::query_scalar("SELECT user_id FROM api_tokens WHERE token_hash = $1")
        .bind(digest)
        .fetch_optional(db.pool())
        .await?;
    let Some(user) = user else { return Ok(None) };
    let marked = sqlx::query("UPDATE api_tokens SET last_used_at = $1 WHERE token_hash = $2")
        .bind(now_ms())
        .bind(digest)
        .execute(db.pool())
        .await?;
    // Revoked between the two statements: it no longer signs anyone in.
    if marked.rows_affected() == 0 {
        return Ok(None);
    }
    parse_uuid("api_tokens", "user_id", &user).map(Some)
}

/// Holds `user`'s row until the caller's transaction ends, and says whether the user
/// exists and is not disabled. A disable waits for the holder to commit, or the holder
/// waits for the disable and then sees it (PostgreSQL re-reads the row it waited for;
/// SQLite's write transactions are serial), so what the caller stores next is either
/// there before the disable removes what the user holds, or not stored at all.
async fn lock_enabled(conn: &mut AnyConnection, user: Uuid) -> Result<bool> {
    let locked = sqlx::query("UPDATE users SET role = role WHERE id = $1 AND disabled_at IS NULL")
        .bind(user.to_string())
        .execute(conn)
        .await?;
    Ok(locked.rows_affected() > 0)
}

/// Stores a new token's metadata and digest for `user`; false, storing nothing, when the
/// user is disabled (or gone).
pub async fn insert_token(db: &Db, user: Uuid, token: &ApiToken, digest: &str) -> Result<bool> {
    let mut tx = db.begin().await?;
    if !lock_enabled(&mut tx, user).await? {
        return Ok(false);
    }
    sqlx::query(
        "INSERT INTO api_tokens (id, user_id, name, prefix, token_hash, created_at) VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(token.id.to_string())
    .bind(user.to_string())
    .bind(&token.name)
    .bind(&token.prefix)
    .bind(digest)
    .bind(token.created_at.timestamp_millis())
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(true)
}

fn token_from_row(row: &AnyRow) -> Result<ApiToken> {
    Ok(ApiToken {
        id: parse_uuid("api_tokens", "id", &row.try_get::<String, _>("id")?)?,
        name: row.try_get("name")?,
        prefix: row.try_get("prefix")?,
        owner: row.try_get("username")?,
        created_at: db::time(row.try_get("created_at")?),
        last_used_at: db::opt_time(row.try_get("last_used_at")?),
    })
}

/// The tokens in `scope`, oldest first.
pub async fn list_tokens(db: &Db, scope: &Scope) -> Result<Vec<ApiToken>> {
    let rows = sqlx::query(
        "SELECT t.id, t.name, t.prefix, t.created_at, t.last_used_at, u.username FROM api_tokens t \
         JOIN users u ON u.id = t.user_id WHERE ($1 IS NULL OR t.user_id = $1) ORDER BY t.created_at",
    )
    .bind(scope.owner_filter())
    .fetch_all(db.pool())
    .await?;
    rows.iter().map(token_from_row).collect()
}

/// Deletes a token in `scope`; returns the digests deleted (none when it is not there).
pub async fn delete_token(db: &Db, scope: &Scope, id: Uuid) -> Result<Vec<String>> {
    Ok(sqlx::query_scalar("DELETE FROM api_tokens WHERE id = $1 AND ($2 IS NULL OR user_id = $2) RETURNING token_hash")
        .bind(id.to_string())
        .bind(scope.owner_filter())
        .fetch_all(db.pool())
        .await?)
}

/// Marks a user disabled (`Some(time)`) or active again (`None`); false when there is no
/// such user.
pub async fn set_disabled(db: &Db, id: Uuid, disabled_at: Option<i64>) -> Result<bool> {
    let done = sqlx::query("UPDATE users SET disabled_at = $1 WHERE id = $2")
        .bind(disabled_at)
        .bind(id.to_string())
        .execute(db.pool())
        .await?;
    Ok(done.rows_affected() > 0)
}

pub async fn set_password_hash(db: &Db, id: Uuid, password_hash: &str) -> Result<()> {
    sqlx::query("UPDATE users SET password_hash = $1 WHERE id = $2")
        .bind(password_hash)
        .bind(id.to_string())
        .execute(db.pool())
        .await?;
    Ok(())
}

/// Deletes every API token of `user`; returns their digests, for the auth cache.
pub async fn delete_tokens_of(db: &Db, user: Uuid) -> Result<Vec<String>> {
    Ok(sqlx::query_scalar("DELETE FROM api_tokens WHERE user_id = $1 RETURNING token_hash")
        .bind(user.to_string())
        .fetch_all(db.pool())
        .await?)
}

/// Records a new session of `user` valid until `expires_at` (ms), dropping expired ones
/// on the way, so the table holds only the sessions of the last `TESSERA_SESSION_HOURS`;
/// false, storing nothing, when the user is disabled (or gone).
pub async fn insert_session(db: &Db, id: Uuid, user: Uuid, expires_at: i64) -> Result<bool> {
    let now = now_ms();
    let mut tx = db.begin().await?;
    if !lock_enabled(&mut tx, user).await? {
        return Ok(false);
    }
    sqlx::query("DELETE FROM sessions WHERE expires_at <= $1")
        .bind(now)
        .execute(&mut *tx)
        .await?;
    sqlx::query("INSERT INTO sessions (id, user_id, created_at, expires_at) VALUES ($1, $2, $3, $4)")
        .bind(id.to_string())
        .bind(user.to_string())
        .bind(now)
        .bind(expires_at)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(true)
}

/// The user a live (not ended, not expired) session belongs to.
pub async fn session_user(db: &Db, id: Uuid) -> Result<Option<Uuid>> {
    let user: Option<String> = sqlx::query_scalar("SELECT user_id FROM sessions WHERE id = $1 AND expires_at > $2")
        .bind(id.to_string())
        .bind(now_ms())
        .fetch_optional(db.pool())
        .await?;
    user.map(|id| parse_uuid("sessions", "user_id", &id)).transpose()
}

/// Ends one session; false when it had already ended.
pub async fn delete_session(db: &Db, id: Uuid) -> Result<bool> {
    let done = sqlx::query("DELETE FROM sessions WHERE id = $1").bind(id.to_string()).execute(db.pool()).await?;
    Ok(done.rows_affected() > 0)
}

/// Ends every session of `user` but `keep`; returns the ids ended, for the auth cache.
pub async fn delete_sessions_of(db: &Db, user: Uuid, keep: Option<Uuid>) -> Result<Vec<Uuid>> {
    let ids: Vec<String> =
        sqlx::query_scalar("DELETE FROM sessions WHERE user_id = $1 AND ($2 IS NULL OR id <> $2) RETURNING id")
            .bind(user.to_string())
            .bind(keep.map(|k| k.to_string()))
            .fetch_all(db.pool())
            .await?;
    ids.iter().map(|id| parse_uuid("sessions", "id", id)).collect()
}
