//! The workers page: every host with its devices, online or offline by its heartbeats.

use askama::Template;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use chrono::Utc;
use serde::Deserialize;
use tessera_api::workers::{Gpu, Worker, WorkerStatus};

use uuid::Uuid;

use super::{flash, format, render, with_status, Layout, WebUser};
use crate::error::{Error, Result};
use crate::state::AppState;
use crate::workers;

struct GpuView {
    index: u32,
    name: String,
    memory: String,
    compute_capability: String,
    mig_enabled: bool,
    /// `1g.10gb (9.8 GiB)` per MIG instance.
    mig_instances: Vec<String>,
}

impl GpuView {
    fn new(gpu: &Gpu) -> GpuView {
        GpuView {
            index: gpu.index,
            name: gpu.name.clone(),
            memory: format::bytes(gpu.memory_bytes),
            compute_capability: format!("{}.{}", gpu.compute_capability.0, gpu.compute_capability.1),
            mig_enabled: gpu.mig_enabled,
            mig_instances: gpu
                .mig_instances
                .iter()
                .map(|m| format!("{} ({})", m.name, format::bytes(m.memory_bytes)))
                .collect(),
        }
    }
}

struct WorkerRow {
    id: String,
    name: String,
    hostname: String,
    online: bool,
    cpu_cores: u32,
    memory: String,
    gpus: Vec<GpuView>,
    version: String,
    last_seen_ago: String,
    last_seen_at: String,
    /// An admin may remove an offline worker.
    removable: bool,
}

impl WorkerRow {
    fn new(worker: &Worker, now: chrono::DateTime<Utc>, admin: bool) -> WorkerRow {
        let online = worker.status == WorkerStatus::Online;
        WorkerRow {
            id: worker.id.to_string(),
            name: worker.name.clone(),
            hostname: worker.inventory.hostname.clone(),
            online,
            cpu_cores: worker.inventory.cpu_cores,
            memory: format::bytes(worker.inventory.memory_bytes),
            gpus: worker.inventory.gpus.iter().map(GpuView::new).collect(),
            version: worker.version.clone(),
            last_seen_ago: format::ago(worker.last_seen_at, now),
            last_seen_at: format::instant(worker.last_seen_at),
            removable: admin && !online,
        }
    }
}

#[derive(Template)]
#[template(path = "workers.html")]
struct WorkersPage {
    layout: Layout,
    notice: Option<String>,
    alert: Option<String>,
    rows: Vec<WorkerRow>,
    online: usize,
    server_url: String,
}

#[derive(Template)]
#[template(path = "workers.html", block = "table")]
struct WorkersTable {
    rows: Vec<WorkerRow>,
    online: usize,
    server_url: String,
}

#[derive(Debug, Default, Deserialize)]
pub struct ListQuery {
    fragment: Option<String>,
}

/// The address workers should use, for the "start a worker" hint: `--public-url`, else
/// the one this browser reached the server at.
fn server_url(state: &AppState, headers: &HeaderMap) -> String {
    if let Some(public) = &state.config.public_url {
        return public.as_str().to_string();
    }
    let host = headers
        .get("x-forwarded-host")
        .or_else(|| headers.get(header::HOST))
        .and_then(|v| v.to_str().ok())
        .and_then(|hosts| hosts.split(',').next())
        .unwrap_or("127.0.0.1:8080");
    let scheme = if super::session::is_https(headers, None) { "https" } else { "http" };
    format!("{scheme}://{}", host.trim())
}

async fn rows(state: &AppState, user: &WebUser) -> Result<Vec<WorkerRow>> {
    let now = Utc::now();
    let workers = workers::list_all(state, &user.0.scope()).await?;
    Ok(workers.iter().map(|w| WorkerRow::new(w, now, user.0.is_admin())).collect())
}

async fn page(
    state: &AppState,
    user: &WebUser,
    headers: &HeaderMap,
    notice: Option<String>,
    alert: Option<String>,
) -> Result<WorkersPage> {
    let rows = rows(state, user).await?;
    let online = rows.iter().filter(|r| r.online).count();
    let layout = user.layout("Workers", "workers");
    Ok(WorkersPage { layout, notice, alert, rows, online, server_url: server_url(state, headers) })
}

pub async fn list(
    State(state): State<AppState>,
    user: WebUser,
    headers: HeaderMap,
    Query(query): Query<ListQuery>,
) -> Response {
    let result: Result<Response> = async {
        if query.fragment.is_some() {
            let rows = rows(&state, &user).await?;
            let online = rows.iter().filter(|r| r.online).count();
            return Ok(render(&WorkersTable { rows, online, server_url: server_url(&state, &headers) })?.into_response());
        }
        Ok(render(&page(&state, &user, &headers, flash::notice(&headers), None).await?)?.into_response())
    }
    .await;
    flash::shown(user.page(result), &headers)
}

/// Removes an offline worker (admins; the button in its row).
pub async fn remove(
    State(state): State<AppState>,
    user: WebUser,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let result = async {
        user.0.require_admin()?;
        let id: Uuid = id.parse().map_err(|_| Error::not_found("Worker"))?;
        match workers::retire(&state, id).await {
            Ok(()) => Ok(flash::redirect("/workers", "Removed the worker.")),
            Err(error @ Error::Conflict(_)) => {
                let refused = page(&state, &user, &headers, None, Some(error.public_message())).await?;
                with_status(StatusCode::CONFLICT, render(&refused))
            }
            Err(error) => Err(error),
        }
    }
    .await;
    user.page(result)
}
