//! Datasets: CSV or JSONL files uploaded for training, checked once on the way in
//! (see `inspect`), stored in the registry's content-addressed blob store and listed
//! per owner. Workers download them for the training jobs they hold.

pub mod inspect;

use axum::body::Body;
use axum::extract::{Multipart, State};
use axum::http::{header, StatusCode};
use axum::response::Response;
use sqlx::AnyConnection;
use tessera_api::datasets::{Dataset, DatasetFormat};
use uuid::Uuid;

use crate::auth::{AgentAuth, Principal};
use crate::error::{ApiJson, ApiMultipart, ApiPath, Error, Result};
use crate::paging::{self, Page, PageQuery};
use crate::registry::{self, blobs::TempBlob, staging};
use crate::state::AppState;
use crate::store::datasets as store;
use crate::store::db::{self, Db};
use crate::store::{jobs, RowLock, Scope};
use inspect::InspectError;

const TOO_LARGE: &str = "The dataset is larger than this server's upload limit (TESSERA_MAX_UPLOAD_BYTES).";

/// A dataset `scope` may see; 404 otherwise.
pub async fn find(state: &AppState, scope: &Scope, id: Uuid) -> Result<Dataset> {
    store::get(&state.db, scope, id).await?.ok_or_else(|| Error::not_found("Dataset"))
}

/// The datasets `scope` may see, newest first, at most `limit`, after `before`, the last
/// dataset of the previous page; 400 when `before` names no dataset `scope` may see.
pub async fn page(state: &AppState, scope: &Scope, before: Option<Uuid>, limit: u32) -> Result<Page<Dataset>> {
    paging::read("dataset", limit, |rows| store::list(&state.db, scope, before, rows)).await
}

/// A dataset the principal may use, by id, or by name among the principal's own.
pub async fn resolve(state: &AppState, principal: &Principal, id_or_name: &str) -> Result<Dataset> {
    if let Ok(id) = id_or_name.parse::<Uuid>() {
        return find(state, &principal.scope(), id).await;
    }
    store::find_by_name(&state.db, principal.id, id_or_name)
        .await?
        .ok_or_else(|| Error::not_found(&format!("Dataset '{id_or_name}'")))
}

/// The format from the file name, else from the first byte (`{` starts a JSONL line).
fn detect_format(file_name: &str, first_byte: Option<u8>) -> DatasetFormat {
    let lower = file_name.to_ascii_lowercase();
    if lower.ends_with(".csv") {
        DatasetFormat::Csv
    } else if lower.ends_with(".jsonl") || lower.ends_with(".ndjson") {
        DatasetFormat::Jsonl
    } else if first_byte == Some(b'{') {
        DatasetFormat::Jsonl
    } else {
        DatasetFormat::Csv
    }
}

/// An upload received but not yet checked or stored.
pub struct Received {
    pub name: Option<String>,
    pub file: Option<(String, TempBlob, String)>,
}

/// Reads `multipart/form-data`: a text field `name` and one file part `file`, which
/// streams to a temp blob (deleted unless the dataset is stored).
pub async fn receive(multipart: &mut Multipart, state: &AppState) -> Result<Received> {
    let mut received = Received { name: None, file: None };
    let mut budget = state.config.max_upload_bytes;
    while let Some(mut field) = multipart.next_field().await? {
        match field.name() {
            Some("name") => received.name = Some(staging::read_text(&mut field).await?.trim().to_string()),
            Some("file") => {
                if received.file.is_some() {
                    return Err(Error::BadRequest("Send one part named 'file'; this upload has two.".into()));
                }
                let file_name = field.file_name().unwrap_or_default().to_string();
                let (blob, digest) = staging::stream_to_blob(&mut field, &state.blobs, &mut budget, TOO_LARGE).await?;
                received.file = Some((file_name, blob, digest));
            }
            other => {
                return Err(Error::BadRequest(format!(
                    "Unexpected form field {:?}; send a text field 'name' and one file part named 'file'.",
                    other.unwrap_or("")
                )))
            }
        }
    }
    Ok(received)
}

fn invalid(message: impl Into<String>) -> Error {
    Error::invalid("invalid_dataset", message)
}

/// Checks a received upload and registers it as a dataset owned by `owner`.
pub async fn register(state: &AppState, owner: &Principal, received: Received) -> Result<Dataset> {
    let name = registry::check_name(received.name.as_deref(), "dataset")?;
    let (file_name, blob, digest) = received
        .file
        .ok_or_else(|| invalid("Attach the data as a file part named 'file' (CSV with a header row, or JSONL)."))?;
    if store::find_by_name(&state.db, owner.id, &name).await?.is_some() {
        return Err(Error::Conflict(format!(
            "You already have a dataset named '{name}'; delete it or pick another name."
        )));
    }
    let (blob, checked) = tokio::task::spawn_blocking(move || {
        let checked = (|| {
            let mut file = std::fs::File::open(blob.path())?;
            let mut first = [0u8; 1];
            let first = std::io::Read::read(&mut file, &mut first).map(|n| (n == 1).then_some(first[0]))?;
            let format = detect_format(&file_name, first);
            let file = std::fs::File::open(blob.path())?;
            Ok::<_, InspectError>((format, inspect::inspect(format, std::io::BufReader::with_capacity(1 << 20, file))?))
        })();
        (blob, checked)
    })
    .await?;
    let (format, summary) = checked.map_err(|e| match e {
        InspectError::Io(io) => Error::Io(io),
        long @ InspectError::RowTooLong { .. } => Error::PayloadTooLarge(format!("The dataset is too large to take: {long}.")),
        other => invalid(format!("The {} file is not valid: {other}", "dataset")),
    })?;

    let dataset = Dataset {
        id: Uuid::new_v4(),
        name,
        digest,
        format,
        columns: summary.columns,
        rows: summary.rows,
        size_bytes: blob.size(),
        owner: owner.username.clone(),
        created_at: db::time(db::now_ms()),
    };
    // A user already past the storage quota is refused before their bytes go into the store.
    crate::quotas::precheck_storage(state, owner, blob.size()).await?;
    // The blob goes in place before the row that references it; the ledger keeps garbage
    // collection away from it until then (and after a refused insert, for the grace period).
    state.blobs.commit(&state.db, vec![blob]).await?;
    // The binding quota check and the row are one transaction (see `quotas`).
    let mut tx = state.db.begin().await?;
    crate::quotas::check_storage(state, &mut tx, owner, dataset.size_bytes).await?;
    if let Err(e) = store::insert(&mut tx, owner.id, &dataset).await {
        return Err(if e.is_unique_violation() {
            Error::Conflict(format!(
                "You already have a dataset named '{}'; delete it or pick another name.",
                dataset.name
            ))
        } else {
            e.into()
        });
    }
    tx.commit().await?;
    Ok(dataset)
}

/// Deletes a dataset no unfinished job reads; garbage collection deletes its file after
/// the grace period unless something else shares it. The check and the delete hold the
/// dataset's row, so a job queued meanwhile on any server is either seen here or finds
/// the dataset gone ([`hold`]).
pub async fn delete_visible(state: &AppState, scope: &Scope, id: Uuid) -> Result<()> {
    find(state, scope, id).await?;
    let mut tx = state.db.begin().await?;
    if !store::lock(&mut tx, state.db.backend(), id, RowLock::Update).await? {
        return Err(Error::not_found("Dataset"));
    }
    let in_use = jobs::unfinished_reading(&mut tx, id).await?;
    if in_use > 0 {
        return Err(Error::Conflict(format!(
            "{in_use} unfinished training job(s) read this dataset; cancel them or wait until they end."
        )));
    }
    store::delete_in(&mut tx, id).await?;
    tx.commit().await?;
    Ok(())
}

/// Keeps dataset `id` from being deleted until the caller's transaction, which queues a
/// job reading it, ends; 404 when it was deleted since the job was checked.
pub async fn hold(db: &Db, conn: &mut AnyConnection, id: Uuid) -> Result<()> {
    if store::lock(conn, db.backend(), id, RowLock::Share).await? {
        Ok(())
    } else {
        Err(Error::NotFound("The dataset was deleted while the job was being queued; upload it again.".into()))
    }
}

/// Upload a dataset as `multipart/form-data`: a text field `name` and one file part
/// `file`, CSV with a header row or JSONL (one flat object per line). The format comes
/// from the file name (`.csv`, `.jsonl`), else from the first byte.
#[utoipa::path(post, path = "/api/v1/datasets", tag = "datasets", security(("bearer" = [])),
    request_body(content_type = "multipart/form-data", description = "field `name`, part `file`"),
    responses((status = 201, body = Dataset), (status = 409, body = tessera_api::error::ErrorBody),
              (status = 413, body = tessera_api::error::ErrorBody), (status = 422, body = tessera_api::error::ErrorBody)))]
pub async fn upload(
    State(state): State<AppState>,
    principal: Principal,
    ApiMultipart(mut multipart): ApiMultipart,
) -> Result<(StatusCode, ApiJson<Dataset>)> {
    let received = receive(&mut multipart, &state).await?;
    let dataset = register(&state, &principal, received).await?;
    tracing::info!(dataset = %dataset.id, name = %dataset.name, rows = dataset.rows, "dataset registered");
    Ok((StatusCode::CREATED, ApiJson(dataset)))
}

/// List datasets, newest first (yours; an admin sees all), paged as `GET /api/v1/jobs`
/// is: while more follow, the `Link` header (`rel="next"`) is the next page's URL.
#[utoipa::path(get, path = "/api/v1/datasets", tag = "datasets", security(("bearer" = [])), params(PageQuery),
    responses((status = 200, body = Vec<Dataset>, headers(("link" = String, description = "The next page, if any"))),
              (status = 400, body = tessera_api::error::ErrorBody)))]
pub async fn list(State(state): State<AppState>, principal: Principal, query: PageQuery) -> Result<Response> {
    let limit = paging::limit(query.limit)?;
    let page = page(&state, &principal.scope(), query.before, limit).await?;
    paging::respond(page, |dataset| dataset.id, "datasets", limit, "")
}

/// A dataset by its id or by the name it was uploaded under (yours).
#[utoipa::path(get, path = "/api/v1/datasets/{id}", tag = "datasets", security(("bearer" = [])),
    params(("id" = String, Path, description = "id or name")),
    responses((status = 200, body = Dataset), (status = 404, body = tessera_api::error::ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    principal: Principal,
    ApiPath(id): ApiPath<String>,
) -> Result<ApiJson<Dataset>> {
    Ok(ApiJson(resolve(&state, &principal, &id).await?))
}

/// Delete a dataset, by id or name (refused while an unfinished job reads it).
#[utoipa::path(delete, path = "/api/v1/datasets/{id}", tag = "datasets", security(("bearer" = [])),
    params(("id" = String, Path, description = "id or name")),
    responses((status = 204), (status = 404, body = tessera_api::error::ErrorBody), (status = 409, body = tessera_api::error::ErrorBody)))]
pub async fn delete(
    State(state): State<AppState>,
    principal: Principal,
    ApiPath(id): ApiPath<String>,
) -> Result<StatusCode> {
    let dataset = resolve(&state, &principal, &id).await?;
    delete_visible(&state, &principal.scope(), dataset.id).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn file_response(state: &AppState, dataset: &Dataset) -> Result<Response> {
    let stream = state.blobs.read(&dataset.digest).await?;
    let content_type = match dataset.format {
        DatasetFormat::Csv => "text/csv; charset=utf-8",
        DatasetFormat::Jsonl => "application/jsonl",
    };
    Response::builder()
        .header(header::CONTENT_TYPE, content_type)
        .header(header::CONTENT_LENGTH, dataset.size_bytes)
        .header(header::ETAG, format!("\"{}\"", dataset.digest))
        .body(Body::from_stream(stream))
        .map_err(|_| Error::Invariant("a file response's headers are valid"))
}

/// Download a dataset's file, byte for byte as uploaded.
#[utoipa::path(get, path = "/api/v1/datasets/{id}/file", tag = "datasets", security(("bearer" = [])),
    params(("id" = String, Path, description = "id or name")),
    responses((status = 200, content_type = "application/octet-stream"), (status = 404, body = tessera_api::error::ErrorBody)))]
pub async fn download(
    State(state): State<AppState>,
    principal: Principal,
    ApiPath(id): ApiPath<String>,
) -> Result<Response> {
    let dataset = resolve(&state, &principal, &id).await?;
    file_response(&state, &dataset).await
}

/// A dataset's metadata for a worker holding a training job on it (any user's dataset).
#[utoipa::path(get, path = "/api/v1/agent/datasets/{id}", tag = "agent", security(("worker" = [])),
    params(("id" = Uuid, Path)), responses((status = 200, body = Dataset), (status = 403, body = tessera_api::error::ErrorBody),
              (status = 404, body = tessera_api::error::ErrorBody)))]
pub async fn agent_get(
    State(state): State<AppState>,
    agent: AgentAuth,
    ApiPath(id): ApiPath<Uuid>,
) -> Result<ApiJson<Dataset>> {
    crate::workers::agent::check_uses_dataset(&state, agent.worker_id, id).await?;
    Ok(ApiJson(find(&state, &Scope::all(), id).await?))
}

/// A worker downloading a dataset's file for a training job it holds; check it against
/// the `digest` in the job spec.
#[utoipa::path(get, path = "/api/v1/agent/datasets/{id}/file", tag = "agent", security(("worker" = [])),
    params(("id" = Uuid, Path)),
    responses((status = 200, content_type = "application/octet-stream"), (status = 403, body = tessera_api::error::ErrorBody),
              (status = 404, body = tessera_api::error::ErrorBody)))]
pub async fn agent_download(
    State(state): State<AppState>,
    agent: AgentAuth,
    ApiPath(id): ApiPath<Uuid>,
) -> Result<Response> {
    crate::workers::agent::check_uses_dataset(&state, agent.worker_id, id).await?;
    let dataset = find(&state, &Scope::all(), id).await?;
    file_response(&state, &dataset).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_comes_from_the_extension_then_the_first_byte() {
        assert_eq!(detect_format("wine.CSV", Some(b'{')), DatasetFormat::Csv);
        assert_eq!(detect_format("a.jsonl", None), DatasetFormat::Jsonl);
        assert_eq!(detect_format("data", Some(b'{')), DatasetFormat::Jsonl);
        assert_eq!(detect_format("data", Some(b'x')), DatasetFormat::Csv);
    }
}
