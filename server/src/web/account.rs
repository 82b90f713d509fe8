//! The signed-in user's account page (change the password, which signs out their other
//! sessions) and the admins' users page (disable or enable a user). Both call the same
//! domain functions as `/api/v1/auth/password` and `PATCH /api/v1/users/{id}`.

use askama::Template;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Form;
use chrono::Utc;
use serde::Deserialize;
use tessera_api::accounts::ChangePassword;
use uuid::Uuid;

use super::session::cookie_session;
use super::{flash, format, render, with_status, Layout, WebUser};
use crate::accounts;
use crate::auth::client::ClientAddr;
use crate::error::{Error, Result};
use crate::state::AppState;
use crate::store::users;

#[derive(Template)]
#[template(path = "account.html")]
struct AccountPage {
    layout: Layout,
    username: String,
    notice: Option<String>,
    error: Option<String>,
}

fn account_page(user: &WebUser, notice: Option<String>, error: Option<String>) -> AccountPage {
    AccountPage {
        layout: user.layout("Account", "account"),
        username: user.0.username.clone(),
        notice,
        error,
    }
}

pub async fn account(user: WebUser, headers: HeaderMap) -> Response {
    let result = render(&account_page(&user, flash::notice(&headers), None)).map(IntoResponse::into_response);
    flash::shown(user.page(result), &headers)
}

#[derive(Debug, Deserialize)]
pub struct PasswordForm {
    #[serde(default)]
    current_password: String,
    #[serde(default)]
    new_password: String,
}

pub async fn change_password(
    State(state): State<AppState>,
    user: WebUser,
    ClientAddr(client): ClientAddr,
    headers: HeaderMap,
    Form(form): Form<PasswordForm>,
) -> Response {
    let result = async {
        let request = ChangePassword {
            current_password: form.current_password,
            new_password: form.new_password,
        };
        let session = cookie_session(&state, &headers);
        match accounts::change_password(&state, &user.0, session, client, request).await {
            Ok(ended) => {
                let notice = format!("Your password was changed; {ended} other session(s) were signed out.");
                Ok(flash::redirect("/account", &notice))
            }
            Err(error) if error.status().is_client_error() => with_status(
                error.status(),
                render(&account_page(&user, None, Some(error.public_message()))),
            ),
            Err(error) => Err(error),
        }
    }
    .await;
    user.page(result)
}

struct UserRow {
    id: String,
    username: String,
    role: &'static str,
    disabled: bool,
    is_self: bool,
    created_ago: String,
    created_at: String,
}

#[derive(Template)]
#[template(path = "users.html")]
struct UsersPage {
    layout: Layout,
    rows: Vec<UserRow>,
    notice: Option<String>,
    error: Option<String>,
}

async fn users_page(
    state: &AppState,
    user: &WebUser,
    notice: Option<String>,
    error: Option<String>,
) -> Result<UsersPage> {
    user.0.require_admin()?;
    let now = Utc::now();
    let rows = users::list(&state.db)
        .await?
        .iter()
        .map(|u| {
            let api = u.to_api();
            UserRow {
                id: u.id.to_string(),
                username: u.username.clone(),
                role: u.role.as_str(),
                disabled: api.disabled,
                is_self: u.id == user.0.id,
                created_ago: format::ago(api.created_at, now),
                created_at: format::instant(api.created_at),
            }
        })
        .collect();
    Ok(UsersPage {
        layout: user.layout("Users", "users"),
        rows,
        notice,
        error,
    })
}

pub async fn list(State(state): State<AppState>, user: WebUser, headers: HeaderMap) -> Response {
    let notice = flash::notice(&headers);
    let result = async { Ok(render(&users_page(&state, &user, notice, None).await?)?.into_response()) }.await;
    flash::shown(user.page(result), &headers)
}

async fn set_disabled(state: &AppState, user: &WebUser, id: &str, disabled: bool) -> Result<Response> {
    let id: Uuid = id.parse().map_err(|_| Error::not_found("User"))?;
    match accounts::set_disabled(state, &user.0, id, disabled).await {
        Ok(changed) => {
            let verb = if disabled {
                "disabled; its sessions and API tokens ended"
            } else {
                "enabled"
            };
            let notice = format!("{} was {verb}.", changed.username);
            Ok(flash::redirect("/users", &notice))
        }
        Err(error @ (Error::Conflict(_) | Error::NotFound(_))) => with_status(
            error.status(),
            render(&users_page(state, user, None, Some(error.public_message())).await?),
        ),
        Err(error) => Err(error),
    }
}

pub async fn disable(State(state): State<AppState>, user: WebUser, Path(id): Path<String>) -> Response {
    let result = set_disabled(&state, &user, &id, true).await;
    user.page(result)
}

pub async fn enable(State(state): State<AppState>, user: WebUser, Path(id): Path<String>) -> Response {
    let result = set_disabled(&state, &user, &id, false).await;
    user.page(result)
}
