//! The model registry: validated uploads stored content-addressed, listed per owner.

pub mod blobs;
pub mod model_config;
pub mod model_files;
pub mod safetensors;
pub mod staging;

use axum::body::Body;
use axum::extract::{Multipart, State};
use axum::http::{header, StatusCode};
use axum::response::Response;
use sha2::{Digest, Sha256};
use sqlx::any::AnyRow;
use sqlx::Row;
use tessera_api::models::{Model, ModelFile};
use uuid::Uuid;

use crate::app::AppState;
use crate::auth::{AgentAuth, Principal};
use crate::store::db::{self, now_ms};
use crate::error::{ApiJson, ApiPath, Error, Result};
use staging::{Staged, Validated};

/// The model digest: SHA-256 over the sorted `(path, file digest)` list, so the same
/// files under the same paths always give the same digest.
fn model_digest(staged: &Staged) -> String {
    let mut hasher = Sha256::new();
    for (path, file) in &staged.files {
        hasher.update(path.as_bytes());
        hasher.update([0]);
        hasher.update(file.digest.as_bytes());
        hasher.update([b'\n']);
    }
    format!("sha256:{}", hex::encode(hasher.finalize()))
}

/// Names of models and datasets: safe in URLs and file names.
pub(crate) fn check_name(name: Option<&str>, what: &str) -> Result<String> {
    let name = name.unwrap_or_default();
    let ok = (1..=128).contains(&name.len())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
        && !name.starts_with('.');
    if ok {
        Ok(name.to_string())
    } else {
        Err(Error::invalid(
            "invalid_name",
            format!("Give the {what} a 'name' of 1 to 128 letters, digits, '_', '-' or '.', not starting with '.'."),
        ))
    }
}

/// Validates staged files and registers them as a model owned by `owner`.
pub async fn register(state: &AppState, owner: &Principal, staged: Staged) -> Result<Model> {
    let name = check_name(staged.name.as_deref(), "model")?;
    if find_by_name(state, &owner.id.to_string(), &name).await?.is_some() {
        return Err(Error::Conflict(format!("You already have a model named '{name}'; delete it or pick another name.")));
    }
    let (staged, validated) = tokio::task::spawn_blocking(move || {
        let validated = staged.validate();
        (staged, validated)
    })
    .await
    .map_err(|e| Error::Internal(e.into()))?;
    let Validated { config, pooling } = validated?;

    let model_id = Uuid::new_v4();
    let digest = model_digest(&staged);
    let size_bytes = staged.size_bytes();
    let config_json = serde_json::json!({
        "model_type": config.model_type,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "num_labels": config.num_labels,
        "pooling": pooling.map(|p| format!("{p:?}").to_lowercase()),
    });

    // Blobs go in place before the rows that reference them, and the registry lock
    // keeps a concurrent delete from collecting a blob this model is about to use.
    let _guard = state.registry_lock.lock().await;
    let mut files = Vec::new();
    for (path, file) in staged.files {
        files.push(ModelFile { path, digest: file.digest, size_bytes: file.blob.size() });
        state.blobs.commit(file.blob).await?;
    }
    let created_at = now_ms();
    let mut tx = state.db.begin().await?;
    let inserted = sqlx::query(
        "INSERT INTO models (id, owner_id, name, digest, architecture, config, size_bytes, created_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
    )
    .bind(model_id.to_string())
    .bind(owner.id.to_string())
    .bind(&name)
    .bind(&digest)
    .bind(&config.architecture)
    .bind(config_json.to_string())
    .bind(size_bytes as i64)
    .bind(created_at)
    .execute(&mut *tx)
    .await;
    if let Err(e) = inserted {
        drop(tx);
        collect_garbage(state, files.iter().map(|f| f.digest.clone()).collect()).await?;
        return Err(if db::is_unique_violation(&e) {
            Error::Conflict(format!("You already have a model named '{name}'; delete it or pick another name."))
        } else {
            e.into()
        });
    }
    for file in &files {
        sqlx::query("INSERT INTO model_files (model_id, path, digest, size_bytes) VALUES ($1, $2, $3, $4)")
            .bind(model_id.to_string())
            .bind(&file.path)
            .bind(&file.digest)
            .bind(file.size_bytes as i64)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    Ok(Model {
        id: model_id,
        name,
        digest,
        architecture: config.architecture,
        size_bytes,
        files,
        owner: owner.username.clone(),
        created_at: db::time(created_at),
    })
}

/// Removes blobs nothing references any more: no model file, dataset or checkpoint
/// file (they share the store, so the same bytes are kept once). Call with the
/// registry lock held.
pub(crate) async fn collect_garbage(state: &AppState, digests: Vec<String>) -> Result<()> {
    for digest in digests {
        let used: i64 = sqlx::query_scalar(
            "SELECT (SELECT COUNT(*) FROM model_files WHERE digest = $1) \
             + (SELECT COUNT(*) FROM datasets WHERE digest = $1) \
             + (SELECT COUNT(*) FROM checkpoint_files WHERE digest = $1)",
        )
        .bind(&digest)
        .fetch_one(state.db.pool())
        .await?;
        if used == 0 {
            state.blobs.remove(&digest).await?;
        }
    }
    Ok(())
}

const MODEL_COLUMNS: &str =
    "m.id, m.name, m.digest, m.architecture, m.size_bytes, m.created_at, u.username AS owner";

async fn model_from_row(state: &AppState, row: &AnyRow) -> Result<Model> {
    let id: String = row.try_get("id")?;
    let files = sqlx::query("SELECT path, digest, size_bytes FROM model_files WHERE model_id = $1 ORDER BY path")
        .bind(&id)
        .fetch_all(state.db.pool())
        .await?
        .iter()
        .map(|f| {
            Ok(ModelFile {
                path: f.try_get("path")?,
                digest: f.try_get("digest")?,
                size_bytes: f.try_get::<i64, _>("size_bytes")? as u64,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Model {
        id: id.parse().map_err(|e| anyhow::anyhow!("bad model id {id}: {e}"))?,
        name: row.try_get("name")?,
        digest: row.try_get("digest")?,
        architecture: row.try_get("architecture")?,
        size_bytes: row.try_get::<i64, _>("size_bytes")? as u64,
        files,
        owner: row.try_get("owner")?,
        created_at: db::time(row.try_get("created_at")?),
    })
}

async fn find_by_name(state: &AppState, owner_id: &str, name: &str) -> Result<Option<Model>> {
    let row = sqlx::query(&format!(
        "SELECT {MODEL_COLUMNS} FROM models m JOIN users u ON u.id = m.owner_id WHERE m.owner_id = $1 AND m.name = $2"
    ))
    .bind(owner_id)
    .bind(name)
    .fetch_optional(state.db.pool())
    .await?;
    match row {
        Some(row) => Ok(Some(model_from_row(state, &row).await?)),
        None => Ok(None),
    }
}

/// A model the principal may see, by id, or by name among the principal's own models.
pub async fn resolve(state: &AppState, principal: &Principal, id_or_name: &str) -> Result<Model> {
    if let Ok(id) = id_or_name.parse::<Uuid>() {
        return get_visible(state, Some(principal), id).await;
    }
    find_by_name(state, &principal.id.to_string(), id_or_name)
        .await?
        .ok_or_else(|| Error::not_found(&format!("Model '{id_or_name}'")))
}

/// A model by id; `None` for the principal means no ownership check (workers, admins).
async fn get_visible(state: &AppState, principal: Option<&Principal>, id: Uuid) -> Result<Model> {
    let owner = principal.and_then(Principal::owner_filter);
    let row = sqlx::query(&format!(
        "SELECT {MODEL_COLUMNS} FROM models m JOIN users u ON u.id = m.owner_id \
         WHERE m.id = $1 AND ($2 IS NULL OR m.owner_id = $2)"
    ))
    .bind(id.to_string())
    .bind(owner)
    .fetch_optional(state.db.pool())
    .await?
    .ok_or_else(|| Error::not_found("Model"))?;
    model_from_row(state, &row).await
}

pub async fn list_visible(state: &AppState, principal: &Principal) -> Result<Vec<Model>> {
    let rows = sqlx::query(&format!(
        "SELECT {MODEL_COLUMNS} FROM models m JOIN users u ON u.id = m.owner_id \
         WHERE ($1 IS NULL OR m.owner_id = $1) ORDER BY m.created_at DESC"
    ))
    .bind(principal.owner_filter())
    .fetch_all(state.db.pool())
    .await?;
    let mut models = Vec::with_capacity(rows.len());
    for row in &rows {
        models.push(model_from_row(state, row).await?);
    }
    Ok(models)
}

pub async fn delete_visible(state: &AppState, principal: &Principal, id: Uuid) -> Result<()> {
    let model = get_visible(state, Some(principal), id).await?;
    let _guard = state.registry_lock.lock().await;
    sqlx::query("DELETE FROM models WHERE id = $1").bind(id.to_string()).execute(state.db.pool()).await?;
    collect_garbage(state, model.files.into_iter().map(|f| f.digest).collect()).await
}

/// Upload a model as `multipart/form-data`: a text field `name` and one part named
/// `files` per file, whose filename is its path in the model folder.
#[utoipa::path(post, path = "/api/v1/models", tag = "models", security(("bearer" = [])),
    request_body(content_type = "multipart/form-data", description = "field `name`, parts `files`"),
    responses((status = 201, body = Model), (status = 409, body = tessera_api::error::ErrorBody),
              (status = 413, body = tessera_api::error::ErrorBody), (status = 422, body = tessera_api::error::ErrorBody)))]
pub async fn upload(
    State(state): State<AppState>,
    principal: Principal,
    mut multipart: Multipart,
) -> Result<(StatusCode, ApiJson<Model>)> {
    let staged = Staged::receive(&mut multipart, &state.blobs, state.config.max_upload_bytes).await?;
    let model = register(&state, &principal, staged).await?;
    tracing::info!(model = %model.id, name = %model.name, owner = %principal.username, "model registered");
    Ok((StatusCode::CREATED, ApiJson(model)))
}

/// List models (yours; an admin sees all).
#[utoipa::path(get, path = "/api/v1/models", tag = "models", security(("bearer" = [])),
    responses((status = 200, body = Vec<Model>)))]
pub async fn list(State(state): State<AppState>, principal: Principal) -> Result<ApiJson<Vec<Model>>> {
    Ok(ApiJson(list_visible(&state, &principal).await?))
}

#[utoipa::path(get, path = "/api/v1/models/{id}", tag = "models", security(("bearer" = [])),
    params(("id" = Uuid, Path)), responses((status = 200, body = Model), (status = 404, body = tessera_api::error::ErrorBody)))]
pub async fn get(State(state): State<AppState>, principal: Principal, ApiPath(id): ApiPath<Uuid>) -> Result<ApiJson<Model>> {
    Ok(ApiJson(get_visible(&state, Some(&principal), id).await?))
}

/// Delete a model; its files are removed unless another model shares them.
#[utoipa::path(delete, path = "/api/v1/models/{id}", tag = "models", security(("bearer" = [])),
    params(("id" = Uuid, Path)), responses((status = 204), (status = 404, body = tessera_api::error::ErrorBody)))]
pub async fn delete(State(state): State<AppState>, principal: Principal, ApiPath(id): ApiPath<Uuid>) -> Result<StatusCode> {
    delete_visible(&state, &principal, id).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn file_response(state: &AppState, model: &Model, path: &str) -> Result<Response> {
    let file = model.files.iter().find(|f| f.path == path).ok_or_else(|| Error::not_found(&format!("File '{path}'")))?;
    let blob = state.blobs.path(&file.digest).ok_or_else(|| anyhow::anyhow!("malformed digest {}", file.digest))?;
    let stream = tokio_util::io::ReaderStream::new(tokio::fs::File::open(blob).await?);
    Response::builder()
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(header::CONTENT_LENGTH, file.size_bytes)
        .header(header::ETAG, format!("\"{}\"", file.digest))
        .body(Body::from_stream(stream))
        .map_err(|e| Error::Internal(e.into()))
}

/// Download one file of a model, byte for byte as uploaded.
#[utoipa::path(get, path = "/api/v1/models/{id}/files/{*path}", tag = "models", security(("bearer" = [])),
    params(("id" = Uuid, Path), ("path" = String, Path, description = "path inside the model folder")),
    responses((status = 200, content_type = "application/octet-stream"), (status = 404, body = tessera_api::error::ErrorBody)))]
pub async fn download(
    State(state): State<AppState>,
    principal: Principal,
    ApiPath((id, path)): ApiPath<(Uuid, String)>,
) -> Result<Response> {
    let model = get_visible(&state, Some(&principal), id).await?;
    file_response(&state, &model, &path).await
}

/// A worker fetching a model file for a job it holds.
#[utoipa::path(get, path = "/api/v1/agent/models/{id}/files/{*path}", tag = "agent", security(("worker" = [])),
    params(("id" = Uuid, Path), ("path" = String, Path)),
    responses((status = 200, content_type = "application/octet-stream"), (status = 404, body = tessera_api::error::ErrorBody)))]
pub async fn agent_download(
    State(state): State<AppState>,
    _agent: AgentAuth,
    ApiPath((id, path)): ApiPath<(Uuid, String)>,
) -> Result<Response> {
    let model = get_visible(&state, None, id).await?;
    file_response(&state, &model, &path).await
}

/// Registers a model folder from the server's disk (the `import-model` command). An
/// existing model of the same owner and name is left alone, so the command can be
/// repeated. Returns a sentence saying what happened.
pub async fn import_dir(
    state: &AppState,
    owner: &str,
    name: &str,
    dir: &std::path::Path,
    max_bytes: u64,
) -> anyhow::Result<String> {
    let row = sqlx::query("SELECT id FROM users WHERE username = $1 AND role = 'admin'")
        .bind(owner)
        .fetch_optional(state.db.pool())
        .await?
        .ok_or_else(|| anyhow::anyhow!("there is no admin named '{owner}'"))?;
    let id: String = row.try_get("id")?;
    let principal = crate::accounts::find_user(&state.db, &id)
        .await?
        .map(|u| Principal { id: u.id, username: u.username, role: u.role })
        .ok_or_else(|| anyhow::anyhow!("admin '{owner}' vanished"))?;
    if let Some(existing) = find_by_name(state, &id, name).await? {
        return Ok(format!("Model '{name}' already exists ({}); nothing imported.", existing.id));
    }
    let (mut staged, skipped) = Staged::from_dir(dir, &state.blobs, max_bytes)
        .await
        .map_err(|e| anyhow::anyhow!("{}: {}", dir.display(), e.public_message()))?;
    staged.name = Some(name.to_string());
    let model = register(state, &principal, staged).await.map_err(|e| anyhow::anyhow!(e.public_message()))?;
    let mut outcome = format!("Imported model '{}' ({}, {} files, {} bytes).", model.name, model.id, model.files.len(), model.size_bytes);
    if !skipped.is_empty() {
        outcome.push_str(&format!(" Skipped files a model folder may not hold: {}.", skipped.join(", ")));
    }
    Ok(outcome)
}

/// A model's metadata for a worker (any model: workers run every user's jobs).
#[utoipa::path(get, path = "/api/v1/agent/models/{id}", tag = "agent", security(("worker" = [])),
    params(("id" = Uuid, Path)), responses((status = 200, body = Model), (status = 404, body = tessera_api::error::ErrorBody)))]
pub async fn agent_get(State(state): State<AppState>, _agent: AgentAuth, ApiPath(id): ApiPath<Uuid>) -> Result<ApiJson<Model>> {
    Ok(ApiJson(get_visible(&state, None, id).await?))
}
