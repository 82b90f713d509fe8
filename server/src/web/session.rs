//! Signing in and out of the dashboard. The session is the same JWT the API hands out,
//! kept in an HttpOnly, SameSite=Strict cookie; `WebUser` reads it for every page.
//! Logging out ends the session on the server, so a copied cookie stops working too.

use askama::Template;
use axum::extract::{FromRequestParts, Query, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::Form;
use serde::Deserialize;
use tessera_api::accounts::LoginRequest;

use super::{render, wants_fragment, Layout};
use crate::auth::client::ClientAddr;
use crate::config::PublicUrl;
use crate::auth::{self, Principal};
use crate::error::Error;
use crate::state::AppState;

pub const COOKIE: &str = "tessera_session";

/// A person signed in to the dashboard.
#[derive(Debug, Clone)]
pub struct WebUser(pub Principal);

/// Why a page could not be shown to the caller.
pub enum SignIn {
    /// A page: go to the login form, then come back to `next`.
    Page { next: String },
    /// A fragment or XHR: the script redirects; a 401 tells it to.
    Fragment,
    Failed(Error),
}

impl IntoResponse for SignIn {
    fn into_response(self) -> Response {
        match self {
            SignIn::Page { next } if next == "/" => Redirect::to("/login").into_response(),
            SignIn::Page { next } => Redirect::to(&format!("/login?next={}", encode_query_value(&next))).into_response(),
            SignIn::Fragment => Error::Unauthorized("Your session has ended; sign in again.".into()).into_response(),
            SignIn::Failed(error) => error.into_response(),
        }
    }
}

impl FromRequestParts<AppState> for WebUser {
    type Rejection = SignIn;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, SignIn> {
        match current_user(state, &parts.headers).await {
            Ok(Some(principal)) => Ok(WebUser(principal)),
            Ok(None) if wants_fragment(&parts.headers, &parts.uri) => Err(SignIn::Fragment),
            Ok(None) => {
                // A form post cannot be replayed after login; land on its page group instead.
                let next = if parts.method == Method::GET {
                    parts.uri.path_and_query().map(|p| p.as_str().to_string()).unwrap_or_else(|| "/".into())
                } else {
                    "/".into()
                };
                Err(SignIn::Page { next })
            }
            Err(error) => Err(SignIn::Failed(error)),
        }
    }
}

/// The user the session cookie belongs to; `None` without a cookie or with a stale one.
pub async fn current_user(state: &AppState, headers: &HeaderMap) -> Result<Option<Principal>, Error> {
    let Some(token) = cookie(headers, COOKIE) else {
        return Ok(None);
    };
    match auth::authenticate(state, token).await {
        Ok(principal) => Ok(Some(principal)),
        Err(Error::Unauthorized(_)) => Ok(None),
        Err(error) => Err(error),
    }
}

/// The session the request's cookie names, if it carries a valid one.
pub fn cookie_session(state: &AppState, headers: &HeaderMap) -> Option<uuid::Uuid> {
    cookie(headers, COOKIE).and_then(|token| auth::session_of(state, token))
}

pub(super) fn cookie<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(key, _)| *key == name)
        .map(|(_, value)| value.trim())
        .filter(|value| !value.is_empty())
}

/// Whether the browser reached the dashboard over HTTPS: `--public-url` says so, or the
/// TLS-terminating proxy in front does (`X-Forwarded-Proto: https`).
pub fn is_https(headers: &HeaderMap, public: Option<&PublicUrl>) -> bool {
    let forwarded = headers
        .get("x-forwarded-proto")
        .and_then(|v| v.to_str().ok())
        .and_then(|protos| protos.split(',').next())
        .is_some_and(|proto| proto.trim().eq_ignore_ascii_case("https"));
    forwarded || public.is_some_and(PublicUrl::is_https)
}

/// Marks every cookie `response` sets Secure, so none travels over plain HTTP (a response
/// to a browser on HTTPS, [`is_https`]).
pub fn secure_cookies(response: &mut Response) {
    let headers = response.headers_mut();
    let cookies: Vec<HeaderValue> = headers.get_all(header::SET_COOKIE).iter().cloned().collect();
    headers.remove(header::SET_COOKIE);
    for cookie in cookies {
        let secure = match cookie.to_str() {
            Ok(text) if !text.to_ascii_lowercase().contains("; secure") => HeaderValue::from_str(&format!("{text}; Secure")).ok(),
            _ => None,
        };
        headers.append(header::SET_COOKIE, secure.unwrap_or(cookie));
    }
}

fn session_cookie(token: &str, max_age_secs: u64) -> HeaderValue {
    let value = format!("{COOKIE}={token}; HttpOnly; SameSite=Strict; Path=/; Max-Age={max_age_secs}");
    HeaderValue::from_str(&value).expect("a JWT is a valid header value")
}

/// Only local paths: `//evil.example` and `/\evil.example` are other sites to a browser,
/// which also drops tabs and line breaks (`/\t/evil.example` is `//evil.example`), so a
/// path of anything but visible ASCII is refused; it could not be a header value either.
fn safe_next(next: &str) -> &str {
    let visible = next.bytes().all(|b| b.is_ascii_graphic() && b != b'\\');
    let local = visible && next.starts_with('/') && !next.starts_with("//");
    if local && !next.starts_with("/login") {
        next
    } else {
        "/"
    }
}

fn encode_query_value(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for byte in value.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.' | b'~' | b'/') {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

#[derive(Template)]
#[template(path = "login.html")]
struct LoginPage {
    layout: Layout,
    username: String,
    next: String,
    error: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
pub struct NextQuery {
    #[serde(default)]
    next: String,
}

pub async fn login_form(State(state): State<AppState>, headers: HeaderMap, Query(query): Query<NextQuery>) -> Response {
    match current_user(&state, &headers).await {
        Ok(Some(_)) => return Redirect::to(safe_next(&query.next)).into_response(),
        Ok(None) => {}
        Err(error) => return error.into_response(),
    }
    let page = LoginPage {
        layout: Layout::bare("Sign in"),
        username: String::new(),
        next: safe_next(&query.next).to_string(),
        error: None,
    };
    render(&page).into_response()
}

#[derive(Debug, Deserialize)]
pub struct LoginForm {
    #[serde(default)]
    username: String,
    #[serde(default)]
    password: String,
    #[serde(default)]
    next: String,
}

pub async fn login(
    State(state): State<AppState>,
    ClientAddr(client): ClientAddr,
    Form(form): Form<LoginForm>,
) -> Response {
    let request = LoginRequest { username: form.username.trim().to_string(), password: form.password };
    let next = safe_next(&form.next).to_string();
    let signed_in = match crate::accounts::check_login(&state, client, &request).await {
        // Disabled while the password was checked: refused like a disabled user's login.
        Ok(user) => auth::start_session(&state, user.id).await.map(|(token, _)| (user, token)),
        Err(error) => Err(error),
    };
    match signed_in {
        Ok((user, token)) => {
            let max_age = state.config.session_hours * 3600;
            let mut response = Redirect::to(&next).into_response();
            response.headers_mut().insert(header::SET_COOKIE, session_cookie(&token, max_age));
            tracing::info!(user = %user.username, "signed in to the dashboard");
            response
        }
        Err(error) => {
            let status = error.status();
            if status.is_server_error() && !matches!(error, Error::Overloaded(_)) {
                tracing::error!(error = ?error, "login failed");
            }
            let retry_after = match &error {
                Error::TooManyRequests { retry_after_secs } => Some(*retry_after_secs),
                _ if status == StatusCode::SERVICE_UNAVAILABLE => Some(1),
                _ => None,
            };
            let page = LoginPage {
                layout: Layout::bare("Sign in"),
                username: request.username,
                next,
                error: Some(sentence(&error.public_message())),
            };
            let mut response = (status, render(&page)).into_response();
            if let Some(seconds) = retry_after {
                response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(seconds));
            }
            response
        }
    }
}

/// Error texts are written for API bodies; on a page they start with a capital.
fn sentence(message: &str) -> String {
    let mut chars = message.chars();
    match chars.next() {
        Some(first) => first.to_uppercase().chain(chars).collect(),
        None => String::new(),
    }
}

/// Ends the cookie's session on the server and drops the cookie.
pub async fn logout(State(state): State<AppState>, headers: HeaderMap) -> Response {
    if let Some(session) = cookie_session(&state, &headers) {
        if let Err(error) = auth::end_session(&state, session).await {
            return error.into_response();
        }
    }
    let mut response = Redirect::to("/login").into_response();
    response.headers_mut().insert(header::SET_COOKIE, session_cookie("", 0));
    response
}

/// `Origin`, when the browser sends one, must name this site: the `Host` it asked, a host
/// a proxy in front forwarded (`X-Forwarded-Host`, any of them), or `--public-url`'s.
/// Beside SameSite=Strict this stops a form on another site from posting with the user's
/// session.
pub fn same_origin(headers: &HeaderMap, public: Option<&PublicUrl>) -> bool {
    let Some(origin) = headers.get(header::ORIGIN) else {
        return true;
    };
    let Some(authority) = origin.to_str().ok().and_then(|o| o.split_once("://")).map(|(_, rest)| rest) else {
        return false; // `Origin: null` and anything unparsable
    };
    let authority = authority.trim_end_matches('/');
    // A reverse proxy may rewrite Host; a cross-site form cannot set X-Forwarded-Host.
    let forwarded = [header::HOST.as_str(), "x-forwarded-host"]
        .into_iter()
        .flat_map(|name| headers.get_all(name))
        .filter_map(|v| v.to_str().ok())
        .flat_map(|hosts| hosts.split(','));
    forwarded.chain(public.map(PublicUrl::authority)).any(|host| host.trim().eq_ignore_ascii_case(authority))
}

pub fn forbidden_origin() -> Error {
    Error::Forbidden("This form was sent from another site, so it was refused; reload the page and try again.".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(*name, HeaderValue::from_str(value).unwrap());
        }
        map
    }

    #[test]
    fn reads_the_session_cookie_among_others() {
        let h = headers(&[("cookie", "a=1; tessera_session=abc.def; b=2")]);
        assert_eq!(cookie(&h, COOKIE), Some("abc.def"));
        assert_eq!(cookie(&headers(&[("cookie", "tessera_session=")]), COOKIE), None);
        assert_eq!(cookie(&HeaderMap::new(), COOKIE), None);
    }

    #[test]
    fn origin_must_match_host_when_present() {
        let same = |pairs: &[(&'static str, &str)]| same_origin(&headers(pairs), None);
        assert!(same(&[("host", "127.0.0.1:8080")]));
        assert!(same(&[("host", "127.0.0.1:8080"), ("origin", "http://127.0.0.1:8080")]));
        assert!(!same(&[("host", "127.0.0.1:8080"), ("origin", "http://evil.example")]));
        assert!(!same(&[("host", "127.0.0.1:8080"), ("origin", "null")]));
        let proxied = [("host", "tessera:8080"), ("x-forwarded-host", "ml.example.com"), ("origin", "https://ml.example.com")];
        assert!(same(&proxied));
        // Two proxies in a row: the host the browser asked is the first of the list.
        let chained = [("host", "tessera:8080"), ("x-forwarded-host", "ml.example.com, edge.internal")];
        assert!(same(&[chained[0], chained[1], ("origin", "https://ml.example.com")]));
    }

    #[test]
    fn the_public_url_s_host_is_this_site() {
        let public: PublicUrl = "https://ML.example.com/".parse().unwrap();
        let posted = headers(&[("host", "tessera:8080"), ("origin", "https://ml.example.com")]);
        assert!(!same_origin(&posted, None), "a proxy that rewrites Host and forwards nothing");
        assert!(same_origin(&posted, Some(&public)));
        let evil = headers(&[("host", "tessera:8080"), ("origin", "https://evil.example")]);
        assert!(!same_origin(&evil, Some(&public)));
    }

    #[test]
    fn on_https_every_cookie_is_marked_secure_once() {
        let plain = HeaderMap::new();
        assert!(!is_https(&plain, None));
        assert!(is_https(&headers(&[("x-forwarded-proto", "https")]), None));
        assert!(is_https(&headers(&[("x-forwarded-proto", "HTTPS, http")]), None));
        assert!(is_https(&plain, Some(&"https://ml.example.com".parse().unwrap())));
        assert!(!is_https(&plain, Some(&"http://ml.example.com".parse().unwrap())));
        let mut response = Response::new(axum::body::Body::empty());
        response.headers_mut().append(header::SET_COOKIE, session_cookie("t", 60));
        response.headers_mut().append(header::SET_COOKIE, HeaderValue::from_static("n=1; Path=/; Secure"));
        secure_cookies(&mut response);
        let cookies: Vec<&str> =
            response.headers().get_all(header::SET_COOKIE).iter().map(|v| v.to_str().unwrap()).collect();
        assert_eq!(cookies, [&format!("{COOKIE}=t; HttpOnly; SameSite=Strict; Path=/; Max-Age=60; Secure"), "n=1; Path=/; Secure"]);
    }

    #[test]
    fn next_stays_on_this_site() {
        assert_eq!(safe_next("/jobs?state=failed"), "/jobs?state=failed");
        assert_eq!(safe_next("//evil.example"), "/");
        assert_eq!(safe_next("/\\evil.example"), "/");
        assert_eq!(safe_next("https://evil.example"), "/");
        assert_eq!(safe_next("/login"), "/");
        assert_eq!(safe_next("/\t/evil.example"), "/");
        assert_eq!(safe_next("/jobs\r\nSet-Cookie: x=y"), "/");
        assert_eq!(safe_next("/caf\u{e9}"), "/");
        assert_eq!(encode_query_value("/jobs?state=a b"), "/jobs%3Fstate%3Da%20b");
    }
}
