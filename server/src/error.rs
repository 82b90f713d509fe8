//! One error type for every handler, mapped once to an HTTP status and the uniform
//! `{"error":{"code","message"}}` body. Internal failures are logged, never returned.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use tessera_api::error::{ErrorBody, ErrorDetail};

use crate::registry::blobs::BlobError;
use crate::store::StoreError;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    BadRequest(String),
    /// The request was understood but its content is wrong (an invalid model file, …).
    #[error("{message}")]
    Invalid { code: &'static str, message: String },
    #[error("{0}")]
    Unauthorized(String),
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    MethodNotAllowed(String),
    #[error("{0}")]
    PayloadTooLarge(String),
    /// A per-user quota would be exceeded; the sentence names the quota and the use.
    #[error("{0}")]
    QuotaExceeded(String),
    #[error("too many attempts; try again in {retry_after_secs} s")]
    TooManyRequests { retry_after_secs: u64 },
    /// The server has no room for the request now (every password check slot is taken):
    /// a 503 with `Retry-After` whose sentence says what is busy, not an internal error.
    #[error("{0}")]
    Overloaded(String),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Blob(#[from] BlobError),
    /// A page's template failed to render.
    #[error("template failed to render: {0}")]
    Template(#[from] askama::Error),
    /// A blocking task (hashing, validation) panicked or was cancelled.
    #[error("a blocking task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
    /// Argon2 refused to hash, or a stored hash does not parse.
    #[error("password hashing failed: {0}")]
    PasswordHash(argon2::password_hash::Error),
    /// A value the server built did not serialise to JSON (never the client's input).
    #[error("could not encode JSON: {0}")]
    Encode(serde_json::Error),
    /// Something the code relies on did not hold: a bug, logged and answered with a 500.
    #[error("internal invariant broken: {0}")]
    Invariant(&'static str),
}

impl Error {
    pub fn invalid(code: &'static str, message: impl Into<String>) -> Error {
        Error::Invalid { code, message: message.into() }
    }

    pub fn not_found(what: &str) -> Error {
        Error::NotFound(format!("{what} not found; check the id or name."))
    }

    /// The database turned the request away for now (see [`crate::store::db::is_busy`]):
    /// a 503 with `Retry-After`, so that clients (workers included) send it again.
    fn busy(&self) -> bool {
        match self {
            Error::Database(error) | Error::Store(StoreError::Database(error)) => crate::store::db::is_busy(error),
            _ => false,
        }
    }

    pub fn status(&self) -> StatusCode {
        if self.busy() {
            return StatusCode::SERVICE_UNAVAILABLE;
        }
        match self {
            Error::BadRequest(_) => StatusCode::BAD_REQUEST,
            Error::Invalid { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            Error::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            Error::Forbidden(_) => StatusCode::FORBIDDEN,
            Error::NotFound(_) => StatusCode::NOT_FOUND,
            Error::Conflict(_) => StatusCode::CONFLICT,
            Error::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            Error::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Error::QuotaExceeded(_) => StatusCode::FORBIDDEN,
            Error::TooManyRequests { .. } => StatusCode::TOO_MANY_REQUESTS,
            Error::Overloaded(_) => StatusCode::SERVICE_UNAVAILABLE,
            Error::Database(_)
            | Error::Store(_)
            | Error::Io(_)
            | Error::Blob(_)
            | Error::Template(_)
            | Error::Task(_)
            | Error::PasswordHash(_)
            | Error::Encode(_)
            | Error::Invariant(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn code(&self) -> &'static str {
        if self.busy() {
            return "unavailable";
        }
        match self {
            Error::BadRequest(_) => "bad_request",
            Error::Invalid { code, .. } => code,
            Error::Unauthorized(_) => "unauthorized",
            Error::Forbidden(_) => "forbidden",
            Error::NotFound(_) => "not_found",
            Error::Conflict(_) => "conflict",
            Error::MethodNotAllowed(_) => "method_not_allowed",
            Error::PayloadTooLarge(_) => "payload_too_large",
            Error::QuotaExceeded(_) => "quota_exceeded",
            Error::TooManyRequests { .. } => "rate_limited",
            Error::Overloaded(_) => "unavailable",
            Error::Database(_)
            | Error::Store(_)
            | Error::Io(_)
            | Error::Blob(_)
            | Error::Template(_)
            | Error::Task(_)
            | Error::PasswordHash(_)
            | Error::Encode(_)
            | Error::Invariant(_) => "internal",
        }
    }

    /// A failure of the server's own, logged and kept from the client; an `Overloaded`
    /// 503 is a refusal for now that says what to do.
    fn internal(&self) -> bool {
        self.status().is_server_error() && !matches!(self, Error::Overloaded(_))
    }

    /// The sentence shown to the client: internals stay in the log.
    pub fn public_message(&self) -> String {
        if self.busy() {
            "The server is busy (its database did not take the request in time); send it again shortly.".into()
        } else if self.internal() {
            "The server hit an internal error; it has been logged.".into()
        } else {
            self.to_string()
        }
    }
}

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        let status = self.status();
        if self.internal() {
            tracing::error!(error = ?self, "request failed");
        }
        let body = ErrorBody {
            error: ErrorDetail { code: self.code().into(), message: self.public_message() },
        };
        let mut response = (status, Json(body)).into_response();
        if let Error::TooManyRequests { retry_after_secs } = self {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(retry_after_secs));
        } else if status == StatusCode::SERVICE_UNAVAILABLE {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(1));
        }
        response
    }
}

impl From<axum::extract::rejection::JsonRejection> for Error {
    fn from(rejection: axum::extract::rejection::JsonRejection) -> Error {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            return Error::PayloadTooLarge(format!(
                "The request body is larger than this route accepts ({} bytes at most).",
                JSON_BODY_LIMIT_BYTES
            ));
        }
        Error::BadRequest(format!("The request body is not valid JSON for this route: {}", rejection.body_text()))
    }
}

impl From<axum::extract::rejection::QueryRejection> for Error {
    fn from(rejection: axum::extract::rejection::QueryRejection) -> Error {
        Error::BadRequest(format!("The query string is malformed: {}", rejection.body_text()))
    }
}

impl From<axum::extract::multipart::MultipartRejection> for Error {
    fn from(rejection: axum::extract::multipart::MultipartRejection) -> Error {
        Error::BadRequest(format!(
            "Send this route a multipart/form-data body with a boundary: {}",
            rejection.body_text()
        ))
    }
}

impl From<axum::extract::rejection::PathRejection> for Error {
    fn from(rejection: axum::extract::rejection::PathRejection) -> Error {
        Error::BadRequest(format!("The URL path is malformed: {}", rejection.body_text()))
    }
}

impl From<axum::extract::multipart::MultipartError> for Error {
    fn from(error: axum::extract::multipart::MultipartError) -> Error {
        if let Some(limit) = crate::multipart::limit_behind(&error) {
            return Error::PayloadTooLarge(limit.to_string());
        }
        Error::BadRequest(format!("The multipart body could not be read: {}", error.body_text()))
    }
}

/// A 4xx that axum answered in plain text itself: an extractor's rejection (a path segment
/// that is not UTF-8 or not a number, a query or form field of the wrong type, a form without
/// its content type) or a handler's bare text. The API and the dashboard each reshape it.
pub struct PlainRejection {
    /// axum's status, which the reshaped answer keeps (a form field of the wrong type is a 422).
    pub status: StatusCode,
    pub text: String,
}

impl PlainRejection {
    /// The rejection `response` is, or `response` untouched when it is none.
    pub async fn of(response: Response) -> Result<PlainRejection, Response> {
        let plain = response
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/plain"));
        if !response.status().is_client_error() || !plain {
            return Err(response);
        }
        let status = response.status();
        // axum's rejection texts are one line; anything longer is cut, not buffered.
        let text = axum::body::to_bytes(response.into_body(), 4 << 10)
            .await
            .map(|bytes| String::from_utf8_lossy(&bytes).trim().to_string())
            .unwrap_or_default();
        Ok(PlainRejection { status, text })
    }

    /// The rejection as our error in the shape `shape` gives it (a route family's), with
    /// axum's status.
    pub fn shaped(self, shape: impl FnOnce(Error) -> Response) -> Response {
        let status = self.status;
        let error = match status {
            StatusCode::NOT_FOUND => Error::NotFound(self.text),
            StatusCode::PAYLOAD_TOO_LARGE => Error::PayloadTooLarge(self.text),
            StatusCode::UNSUPPORTED_MEDIA_TYPE => Error::invalid("unsupported_media_type", self.text),
            _ => Error::BadRequest(format!("The request could not be read: {}", self.text)),
        };
        let mut response = shape(error);
        *response.status_mut() = status;
        response
    }
}

/// `Json` whose rejection is our error body, so malformed JSON gets the uniform shape.
#[derive(Debug, Clone, Copy, Default, axum::extract::FromRequest)]
#[from_request(via(axum::Json), rejection(Error))]
pub struct ApiJson<T>(pub T);

impl<T: serde::Serialize> IntoResponse for ApiJson<T> {
    fn into_response(self) -> Response {
        Json(self.0).into_response()
    }
}

/// A JSON body the client may leave out: an empty or blank body reads as `T::default()`;
/// one that does not parse is a 422 saying what to send (`expected`) and what is wrong
/// (serde's sentence names an unknown or mistyped field).
pub fn optional_json<T: serde::de::DeserializeOwned + Default>(body: &[u8], expected: &str) -> Result<T> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body).map_err(|e| Error::invalid("invalid_request", format!("Send {expected} or no body: {e}")))
}

/// The largest body a JSON route reads: axum's default limit, which every route but the
/// streamed uploads keeps.
pub const JSON_BODY_LIMIT_BYTES: usize = 2 << 20;

/// `Query` whose rejection is our error body (an unknown sort key is a 400 in our shape).
#[derive(Debug, Clone, Copy, Default, axum::extract::FromRequestParts)]
#[from_request(via(axum::extract::Query), rejection(Error))]
pub struct ApiQuery<T>(pub T);

/// `Multipart` whose rejection (no boundary, not multipart at all) is our error body, and
/// whose body is held to the limits of [`crate::multipart`].
pub struct ApiMultipart(pub axum::extract::Multipart);

impl<S: Send + Sync> axum::extract::FromRequest<S> for ApiMultipart {
    type Rejection = Error;

    async fn from_request(request: axum::extract::Request, state: &S) -> Result<Self, Error> {
        let request = crate::multipart::bounded(request);
        Ok(ApiMultipart(axum::extract::Multipart::from_request(request, state).await?))
    }
}

/// `Path` whose rejection is our error body (a malformed UUID is a 400, not axum's text).
#[derive(Debug, Clone, Copy, Default, axum::extract::FromRequestParts)]
#[from_request(via(axum::extract::Path), rejection(Error))]
pub struct ApiPath<T>(pub T);

/// Handler for unknown `/api` routes.
pub async fn api_not_found() -> Error {
    Error::NotFound("No such API route; see /api/openapi.json for the routes that exist.".into())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use sqlx::sqlite::SqliteConnectOptions;
    use sqlx::{ConnectOptions, Connection};

    use super::*;

    /// What a client is answered for `error`: the status, `Retry-After` and the code.
    async fn answer(error: Error) -> (StatusCode, Option<String>, String) {
        let response = error.into_response();
        let status = response.status();
        let retry = response.headers().get(header::RETRY_AFTER).map(|v| v.to_str().unwrap().to_string());
        let body = axum::body::to_bytes(response.into_body(), 1 << 16).await.unwrap();
        let body: ErrorBody = serde_json::from_slice(&body).unwrap();
        (status, retry, body.error.code)
    }

    #[tokio::test]
    async fn a_database_that_turns_a_request_away_is_a_503_to_send_again() {
        // A real SQLite lock: one connection holds the write lock, another that waits for
        // no one asks for it.
        let dir = tempfile::tempdir().unwrap();
        let options = SqliteConnectOptions::new().filename(dir.path().join("db")).create_if_missing(true);
        let mut holder = options.clone().connect().await.unwrap();
        let mut other = options.busy_timeout(Duration::ZERO).connect().await.unwrap();
        sqlx::query("BEGIN IMMEDIATE").execute(&mut holder).await.unwrap();
        let locked = sqlx::query("BEGIN IMMEDIATE").execute(&mut other).await.unwrap_err();
        let unavailable = (StatusCode::SERVICE_UNAVAILABLE, Some("1".to_string()), "unavailable".to_string());
        assert_eq!(answer(Error::Database(locked)).await, unavailable);
        assert_eq!(answer(Error::Store(StoreError::Database(sqlx::Error::PoolTimedOut))).await, unavailable);
        // Anything else the database says is the server's fault, said once.
        let internal = (StatusCode::INTERNAL_SERVER_ERROR, None, "internal".to_string());
        assert_eq!(answer(Error::Database(sqlx::Error::RowNotFound)).await, internal);
        holder.close().await.unwrap();
        // PostgreSQL's codes are its own: 22021 (a NUL in text) is no SQLite 5 (busy).
        let Ok(url) = std::env::var("TESSERA_TEST_POSTGRES_URL") else { return };
        let mut postgres = sqlx::PgConnection::connect(&url).await.unwrap();
        let nul = sqlx::query("SELECT convert_from('\\x00'::bytea, 'UTF8')");
        let refused = nul.execute(&mut postgres).await.unwrap_err();
        assert_eq!(refused.as_database_error().and_then(|e| e.code()).as_deref(), Some("22021"));
        assert_eq!(answer(Error::Database(refused)).await, internal);
    }
}
