//! The dashboard: server-rendered pages for people, signed in with a session cookie.

use axum::Router;

use crate::app::AppState;

pub fn routes() -> Router<AppState> {
    Router::new()
}
