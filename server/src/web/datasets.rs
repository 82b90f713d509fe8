//! Dataset pages: the list with a plain upload form (no script needed: the browser
//! posts `multipart/form-data`, which streams through the same code as
//! `POST /api/v1/datasets`), and delete.

use askama::Template;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use chrono::Utc;
use serde::Deserialize;
use uuid::Uuid;

use super::pager::{self, PageUrl, Pager, PAGE_SIZE};
use super::{flash, format, render, with_status, Layout, WebUser};
use crate::datasets;
use crate::error::{ApiMultipart, Error, Result};
use crate::state::AppState;

struct DatasetRow {
    id: String,
    name: String,
    format: &'static str,
    columns: String,
    rows: u64,
    size: String,
    owner: String,
    created_ago: String,
    created_at: String,
}

#[derive(Template)]
#[template(path = "datasets.html")]
struct DatasetsPage {
    layout: Layout,
    rows: Vec<DatasetRow>,
    pager: Pager,
    max_upload: String,
    /// The outcome of the last upload or delete, shown above the form.
    notice: Option<String>,
    error: Option<String>,
    /// The name a refused upload gave, kept in the form (a browser cannot keep the file).
    name: String,
}

#[derive(Debug, Default, Deserialize)]
pub struct ListQuery {
    /// The last dataset of the previous page.
    before: Option<String>,
}

/// The list's page after `before` (the newest for `None`), with the outcome of the last
/// upload or delete.
async fn list_page(
    state: &AppState,
    user: &WebUser,
    before: Option<Uuid>,
    notice: Option<String>,
    error: Option<String>,
) -> Result<DatasetsPage> {
    let now = Utc::now();
    let page = datasets::page(state, &user.0.scope(), before, PAGE_SIZE).await?;
    let pager = Pager::new(&PageUrl { path: "/datasets", filter: "" }, before, &page, |d| d.id, "dataset");
    let rows = page
        .rows
        .into_iter()
        .map(|d| DatasetRow {
            id: d.id.to_string(),
            name: d.name,
            format: d.format.as_str(),
            columns: d
                .columns
                .iter()
                .map(|c| {
                    format!(
                        "{} ({})",
                        c.name,
                        if c.kind == tessera_api::datasets::ColumnType::Number { "number" } else { "string" }
                    )
                })
                .collect::<Vec<_>>()
                .join(", "),
            rows: d.rows,
            size: format::bytes(d.size_bytes),
            owner: d.owner,
            created_ago: format::ago(d.created_at, now),
            created_at: format::instant(d.created_at),
        })
        .collect();
    Ok(DatasetsPage {
        layout: user.layout("Datasets", "datasets"),
        rows,
        pager,
        max_upload: format::bytes(state.config.max_upload_bytes),
        notice,
        error,
        name: String::new(),
    })
}

pub async fn list(
    State(state): State<AppState>,
    user: WebUser,
    Query(query): Query<ListQuery>,
    headers: HeaderMap,
) -> Response {
    let notice = flash::notice(&headers);
    let result = async {
        let before = pager::before(query.before.as_deref(), "dataset")?;
        Ok(render(&list_page(&state, &user, before, notice, None).await?)?.into_response())
    }
    .await;
    flash::shown(user.page(result), &headers)
}

pub async fn upload(
    State(state): State<AppState>,
    user: WebUser,
    ApiMultipart(mut multipart): ApiMultipart,
) -> Response {
    let result = async {
        let mut name = String::new();
        let outcome = match datasets::receive(&mut multipart, &state).await {
            Ok(received) => {
                name = received.name.clone().unwrap_or_default();
                datasets::register(&state, &user.0, received).await
            }
            Err(error) => Err(error),
        };
        match outcome {
            Ok(dataset) => {
                let notice =
                    format!("Uploaded '{}': {} rows, {} columns.", dataset.name, dataset.rows, dataset.columns.len());
                Ok(flash::redirect("/datasets", &notice))
            }
            Err(error) if error.status().is_client_error() => {
                let status = error.status();
                let page = list_page(&state, &user, None, None, Some(error.public_message())).await?;
                let refused = DatasetsPage { name, ..page };
                with_status(status, render(&refused))
            }
            Err(error) => Err(error),
        }
    }
    .await;
    user.page(result)
}

pub async fn delete(State(state): State<AppState>, user: WebUser, Path(id): Path<String>) -> Response {
    let result = async {
        let id = id.parse().map_err(|_| Error::not_found("Dataset"))?;
        match datasets::delete_visible(&state, &user.0.scope(), id).await {
            Ok(()) => Ok(Redirect::to("/datasets").into_response()),
            Err(error @ Error::Conflict(_)) => with_status(
                StatusCode::CONFLICT,
                render(&list_page(&state, &user, None, None, Some(error.public_message())).await?),
            ),
            Err(error) => Err(error),
        }
    }
    .await;
    user.page(result)
}
