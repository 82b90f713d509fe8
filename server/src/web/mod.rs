//! The dashboard: server-rendered pages for people, signed in with a session cookie.
//! Each page is an askama template over a small view struct; list pages re-fetch a
//! fragment of themselves every few seconds (`data-live`, see web/app.js).

mod account;
mod api_docs;
mod assets;
mod chart;
mod datasets;
mod deployments;
mod flash;
mod fleet;
mod format;
mod jobs;
mod mig;
mod models;
mod pager;
mod precision;
mod session;
mod training;
mod workers;

use askama::Template;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::Router;

use crate::error::{Error, PlainRejection};
use crate::state::AppState;
pub use session::WebUser;

pub fn routes(state: &AppState) -> Router<AppState> {
    Router::new()
        .route("/", get(|| async { Redirect::to("/models") }))
        .route("/login", get(session::login_form).post(session::login))
        .route("/logout", flash::back_to("/").post(session::logout))
        .route("/account", get(account::account))
        .route("/account/password", flash::back_to("/account").post(account::change_password))
        .route("/users", get(account::list))
        .route("/users/{id}/disable", flash::back_to("/users").post(account::disable))
        .route("/users/{id}/enable", flash::back_to("/users").post(account::enable))
        .route("/models", get(models::list))
        // Uploads are capped by the registry while streaming, as on the API route.
        .route("/models/upload", flash::back_to("/models").post(models::upload).layer(DefaultBodyLimit::disable()))
        .route("/models/{id}", get(models::detail))
        .route("/models/{id}/delete", flash::back_to_item("models").post(models::delete))
        .route("/jobs", get(jobs::list))
        .route("/jobs/new", get(jobs::new_form).post(jobs::create))
        .route("/jobs/compare", get(training::compare))
        .route("/jobs/{id}", get(jobs::detail))
        .route("/jobs/{id}/series", get(training::series))
        .route("/jobs/{id}/checkpoints/{step}/files/{name}", get(training::checkpoint_file))
        .route("/datasets", get(datasets::list))
        // Uploads are capped while streaming, as on the API route.
        .route("/datasets/upload", flash::back_to("/datasets").post(datasets::upload).layer(DefaultBodyLimit::disable()))
        .route("/datasets/{id}/delete", flash::back_to("/datasets").post(datasets::delete))
        .route("/jobs/{id}/cancel", flash::back_to_item("jobs").post(jobs::cancel))
        .route("/jobs/{id}/checkpoints/delete", flash::back_to_item("jobs").post(jobs::delete_checkpoints))
        .route("/deployments", get(deployments::list).post(deployments::create))
        .route("/deployments/{id}", get(deployments::detail))
        .route("/deployments/{id}/scale", flash::back_to_item("deployments").post(deployments::scale))
        .route("/deployments/{id}/loaning", flash::back_to_item("deployments").post(deployments::loaning))
        .route("/deployments/{id}/delete", flash::back_to_item("deployments").post(deployments::delete))
        .route("/workers", get(workers::list))
        .route("/workers/{id}/remove", flash::back_to("/workers").post(workers::remove))
        .route("/mig", get(mig::page))
        .route("/fleet", get(fleet::page))
        .route("/api/docs", get(api_docs::page))
        .route("/static/{name}", get(assets::serve))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(state.clone(), guard))
}

/// What the shared layout (templates/base.html) needs from every page.
pub struct Layout {
    pub title: String,
    /// The nav entry to highlight: `models`, `deployments`, `jobs`, `workers`, `api` or empty.
    pub section: &'static str,
    pub user: Option<String>,
    /// Shows the admins' entries (Users) in the nav.
    pub admin: bool,
    /// Hides the nav, for the login form.
    pub bare: bool,
    /// Changes whenever the CSS or JS does, so browsers never run stale assets.
    pub assets: &'static str,
}

impl Layout {
    pub fn new(title: impl Into<String>, section: &'static str, user: Option<String>) -> Layout {
        Layout { title: title.into(), section, user, admin: false, bare: false, assets: assets::version() }
    }

    pub fn bare(title: impl Into<String>) -> Layout {
        Layout { bare: true, ..Layout::new(title, "", None) }
    }

    /// The letter in the user's avatar.
    pub fn initial(&self) -> String {
        self.user.as_deref().and_then(|u| u.chars().next()).map(|c| c.to_uppercase().collect()).unwrap_or_default()
    }
}

impl WebUser {
    pub fn layout(&self, title: impl Into<String>, section: &'static str) -> Layout {
        Layout { admin: self.0.is_admin(), ..Layout::new(title, section, Some(self.0.username.clone())) }
    }

    /// A page handler's outcome as a response: a failure becomes the error page, with
    /// the status the error maps to and the navigation still in place.
    pub fn page<T: IntoResponse>(&self, result: Result<T, Error>) -> Response {
        match result {
            Ok(page) => page.into_response(),
            Err(error) => error_page(&error, Some(self.0.username.clone())),
        }
    }
}

/// Renders a template, or a logged 500 when it cannot.
pub fn render(template: &impl Template) -> Result<Html<String>, Error> {
    Ok(Html(template.render()?))
}

/// A fragment request (`?fragment=…`, or a script's fetch) gets 401 rather than a
/// redirect, and its errors as JSON.
pub fn wants_fragment(headers: &HeaderMap, uri: &Uri) -> bool {
    headers.contains_key("x-requested-with")
        || uri.query().is_some_and(|q| q.split('&').any(|pair| pair.starts_with("fragment=")))
}

#[derive(Template)]
#[template(path = "error.html")]
struct ErrorPage {
    layout: Layout,
    status: u16,
    reason: &'static str,
    message: String,
}

fn error_page(error: &Error, user: Option<String>) -> Response {
    let status = error.status();
    if status.is_server_error() {
        tracing::error!(error = ?error, "page failed");
    }
    status_page(status, error.public_message(), user)
}

fn status_page(status: StatusCode, message: String, user: Option<String>) -> Response {
    let reason = status.canonical_reason().unwrap_or("Error");
    let page = ErrorPage { layout: Layout::new(reason, "", user), status: status.as_u16(), reason, message };
    match page.render() {
        Ok(html) => (status, Html(html)).into_response(),
        Err(_) => (status, page.message).into_response(),
    }
}

/// A rejection axum answered in plain text (a path segment or query field the handler
/// cannot parse, a form of the wrong type) as the error page, with a sentence on what to
/// change; a script's request gets it as JSON, like the page's other errors.
async fn rejection_page(state: &AppState, cookies: &HeaderMap, fragment: bool, rejection: PlainRejection) -> Response {
    if fragment {
        return rejection.shaped(IntoResponse::into_response);
    }
    let fix = match rejection.status {
        StatusCode::NOT_FOUND => "Check the address, or pick a section from the menu.",
        StatusCode::PAYLOAD_TOO_LARGE => "Send less: a smaller file, or fewer fields.",
        StatusCode::UNSUPPORTED_MEDIA_TYPE => "Send the form from its page on the dashboard.",
        _ => "Correct that part of the address or form, or follow the link from the dashboard again.",
    };
    let text = rejection.text.trim_end_matches('.');
    let message = if rejection.status == StatusCode::NOT_FOUND {
        format!("{text}. {fix}")
    } else {
        format!("The request could not be read ({text}). {fix}")
    };
    status_page(rejection.status, message, signed_in(state, cookies).await)
}

/// `error` on a dashboard path, found before any page ran (a post from another site, and
/// in the server's own layers a NUL byte in the URL or a method the route does not take):
/// the error page, or JSON for a script, with every page's headers.
pub async fn refusal(state: &AppState, headers: &HeaderMap, uri: &Uri, error: Error) -> Response {
    let mut response = if wants_fragment(headers, uri) {
        error.into_response()
    } else {
        error_page(&error, signed_in(state, headers).await)
    };
    page_headers(&mut response);
    response
}

/// Who the error page's navigation names: the session's user, or no one.
async fn signed_in(state: &AppState, headers: &HeaderMap) -> Option<String> {
    session::current_user(state, headers).await.ok().flatten().map(|p| p.username)
}

async fn not_found(State(state): State<AppState>, headers: HeaderMap) -> Response {
    let error = Error::NotFound("There is no page at this address; pick a section from the menu.".into());
    error_page(&error, signed_in(&state, &headers).await)
}

/// Every dashboard response: state-changing requests must come from this site, pages may
/// not be framed or run scripts from elsewhere, and what a signed-in user was shown stays
/// out of caches. Rejections axum answered in plain text become the error page here, so
/// they carry these headers too.
async fn guard(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let public = state.config.public_url.as_ref();
    if !request.method().is_safe() && !session::same_origin(request.headers(), public) {
        return refusal(&state, request.headers(), request.uri(), session::forbidden_origin()).await;
    }
    let https = session::is_https(request.headers(), public);
    let fragment = wants_fragment(request.headers(), request.uri());
    // Only the session cookie is kept, for the error page's navigation.
    let mut cookies = HeaderMap::new();
    for value in request.headers().get_all(header::COOKIE) {
        cookies.append(header::COOKIE, value.clone());
    }
    let mut response = match PlainRejection::of(next.run(request).await).await {
        Ok(rejection) => rejection_page(&state, &cookies, fragment, rejection).await,
        Err(response) => response,
    };
    page_headers(&mut response);
    if https {
        session::secure_cookies(&mut response);
    }
    response
}

/// The headers of every dashboard response, where the handler set none of its own (the
/// static assets say how long a browser keeps them).
fn page_headers(response: &mut Response) {
    let headers = response.headers_mut();
    let defaults = [
        (
            header::CONTENT_SECURITY_POLICY,
            "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; object-src 'none'; \
             base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
        ),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::REFERRER_POLICY, "same-origin"),
        (header::CACHE_CONTROL, "no-store"),
    ];
    for (name, value) in defaults {
        headers.entry(name).or_insert(HeaderValue::from_static(value));
    }
}

/// Shorthand for handlers that answer with a status and a rendered page.
pub fn with_status(status: StatusCode, page: Result<Html<String>, Error>) -> Result<Response, Error> {
    Ok((status, page?).into_response())
}
