//! Model pages: the list with the upload form, one model's files, delete. Uploads go
//! through the same registry code as `POST /api/v1/models`, authenticated by the cookie.

use askama::Template;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect, Response};
use chrono::Utc;
use serde::Deserialize;
use tessera_api::models::Model;

use super::pager::{self, PageUrl, Pager, PAGE_SIZE};
use super::{format, render, with_status, Layout, WebUser};
use crate::error::{ApiJson, ApiMultipart, Error, Result};
use crate::registry::{self, model_files};
use crate::state::AppState;

/// The folder a sentence-transformers pooling config sits in, as a JavaScript regex;
/// `model_files::check_path` is the rule the server enforces.
const POOLING_PATH_PATTERN: &str = r"^[0-9]+_Pooling/config\.json$";

struct ModelRow {
    id: String,
    name: String,
    architecture: String,
    size: String,
    files: usize,
    owner: String,
    created_ago: String,
    created_at: String,
}

impl ModelRow {
    fn new(model: &Model, now: chrono::DateTime<Utc>) -> ModelRow {
        ModelRow {
            id: model.id.to_string(),
            name: model.name.clone(),
            architecture: model.architecture.clone(),
            size: format::bytes(model.size_bytes),
            files: model.files.len(),
            owner: model.owner.clone(),
            created_ago: format::ago(model.created_at, now),
            created_at: format::instant(model.created_at),
        }
    }
}

#[derive(Template)]
#[template(path = "models.html")]
struct ModelsPage {
    layout: Layout,
    live_url: String,
    rows: Vec<ModelRow>,
    pager: Pager,
    /// JSON array of the exact file names a model folder may hold.
    allowed_names: String,
    pooling_pattern: &'static str,
    /// JSON array of the files every model must have.
    required_names: String,
    required: String,
    max_upload: String,
    max_upload_bytes: u64,
}

#[derive(Template)]
#[template(path = "models.html", block = "table")]
struct ModelsTable {
    rows: Vec<ModelRow>,
    pager: Pager,
}

#[derive(Debug, Default, Deserialize)]
pub struct ListQuery {
    /// The last model of the previous page.
    before: Option<String>,
    fragment: Option<String>,
}

pub async fn list(State(state): State<AppState>, user: WebUser, Query(query): Query<ListQuery>) -> Response {
    let result = async {
        let before = pager::before(query.before.as_deref(), "model")?;
        let page = registry::page(&state, &user.0.scope(), before, PAGE_SIZE).await?;
        let url = PageUrl { path: "/models", filter: "" };
        let pager = Pager::new(&url, before, &page, |model| model.id, "model");
        let now = Utc::now();
        let rows = page.rows.iter().map(|m| ModelRow::new(m, now)).collect();
        if query.fragment.is_some() {
            return Ok(render(&ModelsTable { rows, pager })?.into_response());
        }
        let names: Vec<&str> = model_files::ALLOWED.iter().map(|(name, _)| *name).collect();
        let page = ModelsPage {
            layout: user.layout("Models", "models"),
            // The live refresh re-reads the page the person is on.
            live_url: url.at(before, "fragment=table"),
            rows,
            pager,
            allowed_names: serde_json::to_string(&names).map_err(Error::Encode)?,
            pooling_pattern: POOLING_PATH_PATTERN,
            required_names: serde_json::to_string(model_files::REQUIRED).map_err(Error::Encode)?,
            required: model_files::REQUIRED.join(", "),
            max_upload: format::bytes(state.config.max_upload_bytes),
            max_upload_bytes: state.config.max_upload_bytes,
        };
        Ok(render(&page)?.into_response())
    }
    .await;
    user.page(result)
}

/// `POST /models/upload`: the API's upload, answered the API's way (JSON, 201 or the
/// error body), since the page's script reads it.
pub async fn upload(
    State(state): State<AppState>,
    user: WebUser,
    ApiMultipart(mut multipart): ApiMultipart,
) -> Result<(StatusCode, ApiJson<Model>)> {
    Ok((StatusCode::CREATED, ApiJson(registry::upload_model(&state, &user.0, &mut multipart).await?)))
}

struct FileRow {
    path: String,
    size: String,
    digest: String,
    digest_short: String,
}

#[derive(Template)]
#[template(path = "model.html")]
struct ModelPage {
    layout: Layout,
    model: ModelRow,
    digest: String,
    files: Vec<FileRow>,
    /// Why the last action on the model was refused.
    error: Option<String>,
}

fn model_page(user: &WebUser, model: &Model, error: Option<String>) -> ModelPage {
    let files = model
        .files
        .iter()
        .map(|f| FileRow {
            path: f.path.clone(),
            size: format::bytes(f.size_bytes),
            digest: f.digest.clone(),
            digest_short: format::short_digest(&f.digest),
        })
        .collect();
    ModelPage {
        layout: user.layout(model.name.clone(), "models"),
        model: ModelRow::new(model, Utc::now()),
        digest: model.digest.clone(),
        files,
        error,
    }
}

pub async fn detail(State(state): State<AppState>, user: WebUser, Path(id): Path<String>) -> Response {
    let result = async {
        let model = registry::resolve(&state, &user.0, &id).await?;
        Ok(render(&model_page(&user, &model, None))?.into_response())
    }
    .await;
    user.page(result)
}

/// Deletes the model; one still served or used by a job stays, its page saying by what.
pub async fn delete(State(state): State<AppState>, user: WebUser, Path(id): Path<String>) -> Response {
    let result = async {
        let model = registry::resolve(&state, &user.0, &id).await?;
        match registry::delete_visible(&state, &user.0.scope(), model.id).await {
            Ok(()) => {
                tracing::info!(model = %model.id, name = %model.name, user = %user.0.username, "model deleted from the dashboard");
                Ok(Redirect::to("/models").into_response())
            }
            Err(error @ Error::Conflict(_)) => {
                with_status(StatusCode::CONFLICT, render(&model_page(&user, &model, Some(error.public_message()))))
            }
            Err(error) => Err(error),
        }
    }
    .await;
    user.page(result)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The page's script skips files by the allowlist; whatever it lets through must be
    /// what the server accepts.
    #[test]
    fn every_name_offered_to_the_page_is_accepted_by_the_registry() {
        for (name, _) in model_files::ALLOWED {
            assert!(model_files::check_path(name).is_ok(), "{name}");
        }
        for path in ["1_Pooling/config.json", "12_Pooling/config.json"] {
            assert!(model_files::check_path(path).is_ok(), "{path}");
        }
    }
}
