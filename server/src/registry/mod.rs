//! The model registry: validated uploads stored content-addressed, listed per owner.
//! The functions here are what both the API (`routes`) and the dashboard call.

pub mod blobs;
pub mod gc;
pub mod model_config;
pub mod model_files;
pub mod routes;
pub mod safetensors;
pub mod staging;

use axum::extract::Multipart;
use sha2::{Digest, Sha256};
use sqlx::AnyConnection;
use tessera_api::models::{Model, ModelFile};
use uuid::Uuid;

use crate::auth::Principal;
use crate::error::{Error, Result};
use crate::paging::{self, Page};
use crate::state::AppState;
use crate::store::db::{self, now_ms, Db};
use crate::store::models::{self as store, NewModel};
use crate::store::{deployments, jobs, users, RowLock, Scope};
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
    if !ok {
        return Err(Error::invalid(
            "invalid_name",
            format!("Give the {what} a 'name' of 1 to 128 letters, digits, '_', '-' or '.', not starting with '.'."),
        ));
    }
    // Paths and specs name a model, dataset or deployment by id or by name.
    if name.parse::<Uuid>().is_ok() {
        return Err(Error::invalid(
            "invalid_name",
            format!("The {what}'s 'name' {name:?} reads as an id and would be taken for one; pick another name."),
        ));
    }
    Ok(name.to_string())
}

/// Validates staged files and registers them as a model owned by `owner`.
pub async fn register(state: &AppState, owner: &Principal, staged: Staged) -> Result<Model> {
    let name = check_name(staged.name.as_deref(), "model")?;
    if store::find_by_name(&state.db, owner.id, &name).await?.is_some() {
        return Err(Error::Conflict(format!("You already have a model named '{name}'; delete it or pick another name.")));
    }
    let (staged, validated) = tokio::task::spawn_blocking(move || {
        let validated = staged.validate();
        (staged, validated)
    })
    .await?;
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
        "intermediate_size": config.intermediate_size,
        "num_labels": config.num_labels,
        "pooling": pooling.map(|p| format!("{p:?}").to_lowercase()),
    });

    // A user already past the storage quota is refused before their bytes go into the store.
    crate::quotas::precheck_storage(state, owner, size_bytes).await?;
    // Blobs go in place before the rows that reference them; the ledger keeps garbage
    // collection (on any server) away from them until those rows exist.
    let mut files = Vec::new();
    let mut blobs = Vec::new();
    for (path, file) in staged.files {
        files.push(ModelFile { path, digest: file.digest, size_bytes: file.blob.size() });
        blobs.push(file.blob);
    }
    state.blobs.commit(&state.db, blobs).await?;
    let created_at = now_ms();
    let new = NewModel {
        id: model_id,
        owner: owner.id,
        name: &name,
        digest: &digest,
        architecture: &config.architecture,
        config: &config_json,
        size_bytes,
        created_at,
    };
    // The binding quota check and the rows are one transaction (see `quotas`). A refused
    // insert leaves the blobs unreferenced: garbage collection takes them after the grace
    // period unless another row comes to reference them.
    let mut tx = state.db.begin().await?;
    crate::quotas::check_storage(state, &mut tx, owner, size_bytes).await?;
    if let Err(e) = store::insert(&mut tx, &new, &files).await {
        return Err(if e.is_unique_violation() {
            Error::Conflict(format!("You already have a model named '{name}'; delete it or pick another name."))
        } else {
            e.into()
        });
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

/// A model the principal may see, by id, or by name among the principal's own models.
pub async fn resolve(state: &AppState, principal: &Principal, id_or_name: &str) -> Result<Model> {
    if let Ok(id) = id_or_name.parse::<Uuid>() {
        return find(state, &principal.scope(), id).await;
    }
    store::find_by_name(&state.db, principal.id, id_or_name)
        .await?
        .ok_or_else(|| Error::not_found(&format!("Model '{id_or_name}'")))
}

/// A model in `scope`, by id.
pub async fn find(state: &AppState, scope: &Scope, id: Uuid) -> Result<Model> {
    store::get(&state.db, scope, id).await?.ok_or_else(|| Error::not_found("Model"))
}

/// The models in `scope`, newest first, at most `limit`, after `before`, the last model of
/// the previous page; 400 when `before` names no model `scope` may see.
pub async fn page(state: &AppState, scope: &Scope, before: Option<Uuid>, limit: u32) -> Result<Page<Model>> {
    paging::read("model", limit, |rows| store::list(&state.db, scope, before, rows)).await
}

/// The newest [`paging::MAX_LIMIT`] models in `scope`, which the dashboard's forms offer.
pub async fn newest(state: &AppState, scope: &Scope) -> Result<Vec<Model>> {
    Ok(page(state, scope, None, paging::MAX_LIMIT).await?.rows)
}

/// Deletes a model in `scope` that no deployment serves and no unfinished job reads;
/// garbage collection deletes its blobs after the grace period unless another model,
/// dataset or checkpoint shares them. The checks and the delete hold the model's row, so
/// a deployment or job created meanwhile on any server is either seen here or finds the
/// model gone ([`hold`]).
pub async fn delete_visible(state: &AppState, scope: &Scope, id: Uuid) -> Result<()> {
    let model = find(state, scope, id).await?;
    let mut tx = state.db.begin().await?;
    if !store::lock(&mut tx, state.db.backend(), id, RowLock::Update).await? {
        return Err(Error::not_found("Model"));
    }
    let serving = deployments::names_serving(&mut tx, id).await?;
    if !serving.is_empty() {
        return Err(in_use(&model.name, &serving));
    }
    let reading = jobs::unfinished_using_model(&mut tx, id).await?;
    if !reading.is_empty() {
        return Err(read_by_jobs(&model.name, &reading));
    }
    store::delete_in(&mut tx, id).await?;
    tx.commit().await?;
    Ok(())
}

/// Keeps model `id` from being deleted until the caller's transaction, which creates a
/// job or deployment that uses it, ends; 404 when it was deleted since it was resolved.
pub async fn hold(db: &Db, conn: &mut AnyConnection, id: Uuid) -> Result<()> {
    if store::lock(conn, db.backend(), id, RowLock::Share).await? {
        Ok(())
    } else {
        Err(Error::NotFound("The model was deleted meanwhile; register it again or name another.".into()))
    }
}

fn in_use(model: &str, deployments: &[String]) -> Error {
    Error::Conflict(format!(
        "Model '{model}' is served by deployment {}; delete the deployment first.",
        deployments.iter().map(|name| format!("'{name}'")).collect::<Vec<_>>().join(", ")
    ))
}

fn read_by_jobs(model: &str, jobs: &[(Uuid, &str)]) -> Error {
    const NAMED: usize = 5;
    let mut named: Vec<String> = jobs.iter().take(NAMED).map(|(id, kind)| format!("{kind} job {id}")).collect();
    if jobs.len() > NAMED {
        named.push(format!("{} more", jobs.len() - NAMED));
    }
    Error::Conflict(format!(
        "Model '{model}' is used by {} unfinished job(s): {}; cancel them or wait until they end.",
        jobs.len(),
        named.join(", ")
    ))
}

/// Receives a multipart upload and registers it as a model of `principal`'s.
pub async fn upload_model(state: &AppState, principal: &Principal, multipart: &mut Multipart) -> Result<Model> {
    let staged = Staged::receive(multipart, &state.blobs, state.config.max_upload_bytes).await?;
    let model = register(state, principal, staged).await?;
    tracing::info!(model = %model.id, name = %model.name, owner = %principal.username, "model registered");
    Ok(model)
}

/// Registers a model folder from the server's disk (the `import-model` command). An
/// existing model of the same owner and name is left alone, so the command can be
/// repeated. Returns a sentence saying what happened.
pub async fn import_dir(state: &AppState, owner: &str, name: &str, dir: &std::path::Path, max_bytes: u64) -> Result<String> {
    let user = users::find_by_name(&state.db, owner)
        .await?
        .filter(|u| u.role == tessera_api::accounts::Role::Admin)
        .ok_or_else(|| Error::NotFound(format!("there is no admin named '{owner}'")))?;
    let principal = Principal { id: user.id, username: user.username, role: user.role };
    if let Some(existing) = store::find_by_name(&state.db, principal.id, name).await? {
        return Ok(format!("Model '{name}' already exists ({}); nothing imported.", existing.id));
    }
    let (mut staged, skipped) = Staged::from_dir(dir, &state.blobs, max_bytes)
        .await
        .map_err(|e| Error::BadRequest(format!("{}: {}", dir.display(), e.public_message())))?;
    staged.name = Some(name.to_string());
    let model = register(state, &principal, staged).await?;
    let mut outcome = format!("Imported model '{}' ({}, {} files, {} bytes).", model.name, model.id, model.files.len(), model.size_bytes);
    if !skipped.is_empty() {
        outcome.push_str(&format!(" Skipped files a model folder may not hold: {}.", skipped.join(", ")));
    }
    Ok(outcome)
}
