//! The workers page: every host with its devices, online or offline by its heartbeats.

use askama::Template;
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use chrono::Utc;
use serde::Deserialize;
use tessera_api::workers::{Gpu, Worker, WorkerStatus};

use super::{format, render, Layout, WebUser};
use crate::error::Result;
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
    name: String,
    hostname: String,
    online: bool,
    cpu_cores: u32,
    memory: String,
    gpus: Vec<GpuView>,
    version: String,
    last_seen_ago: String,
    last_seen_at: String,
}

impl WorkerRow {
    fn new(worker: &Worker, now: chrono::DateTime<Utc>) -> WorkerRow {
        WorkerRow {
            name: worker.name.clone(),
            hostname: worker.inventory.hostname.clone(),
            online: worker.status == WorkerStatus::Online,
            cpu_cores: worker.inventory.cpu_cores,
            memory: format::bytes(worker.inventory.memory_bytes),
            gpus: worker.inventory.gpus.iter().map(GpuView::new).collect(),
            version: worker.version.clone(),
            last_seen_ago: format::ago(worker.last_seen_at, now),
            last_seen_at: format::instant(worker.last_seen_at),
        }
    }
}

#[derive(Template)]
#[template(path = "workers.html")]
struct WorkersPage {
    layout: Layout,
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

/// The address this browser reached the server at, for the "start a worker" hint.
fn server_url(headers: &HeaderMap) -> String {
    let host = headers
        .get("x-forwarded-host")
        .or_else(|| headers.get(header::HOST))
        .and_then(|v| v.to_str().ok())
        .unwrap_or("127.0.0.1:8080");
    let scheme = headers.get("x-forwarded-proto").and_then(|v| v.to_str().ok()).unwrap_or("http");
    format!("{scheme}://{host}")
}

pub async fn list(
    State(state): State<AppState>,
    user: WebUser,
    headers: HeaderMap,
    Query(query): Query<ListQuery>,
) -> Response {
    let result: Result<Response> = async {
        let now = Utc::now();
        let rows: Vec<WorkerRow> = workers::list_all(&state, &user.0.scope()).await?.iter().map(|w| WorkerRow::new(w, now)).collect();
        let online = rows.iter().filter(|r| r.online).count();
        let server_url = server_url(&headers);
        if query.fragment.is_some() {
            return Ok(render(&WorkersTable { rows, online, server_url })?.into_response());
        }
        let page = WorkersPage { layout: user.layout("Workers", "workers"), rows, online, server_url };
        Ok(render(&page)?.into_response())
    }
    .await;
    user.page(result)
}
