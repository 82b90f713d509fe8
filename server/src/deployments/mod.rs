//! Deployments: a model served under a name. Each replica is a job of kind `serve` in
//! the leased queue, so placement, re-placement after a worker dies, and cancellation
//! are the queue's: a queued replica is pending, a leased one loading, a running one
//! ready (its engine endpoint recorded), a failed one carries the reason.

use axum::extract::State;
use axum::http::StatusCode;
use sqlx::any::AnyRow;
use sqlx::Row;
use tessera_api::deployments::{CreateDeployment, Deployment, DeploymentStats, Replica, ServingState, UpdateDeployment};
use tessera_api::jobs::{JobSpec, JobState};
use uuid::Uuid;

use crate::app::AppState;
use crate::auth::Principal;
use crate::store::db::{self, now_ms, Db};
use crate::error::{ApiJson, ApiPath, Error, Result};

/// Times a replica may be placed again after its worker vanished before it is failed.
pub(crate) const REPLICA_MAX_ATTEMPTS: u32 = 20;
const MAX_REPLICAS: u32 = 64;
pub const DEFAULT_MAX_BATCH_TOKENS: u32 = 16_384;
pub const DEFAULT_MAX_BATCH_REQUESTS: u32 = 64;

fn parse_uuid(text: &str) -> Result<Uuid> {
    text.parse().map_err(|e| anyhow::anyhow!("bad uuid {text}: {e}").into())
}

fn replica_state(state: JobState) -> ServingState {
    match state {
        JobState::Queued => ServingState::Pending,
        JobState::Leased => ServingState::Loading,
        JobState::Running => ServingState::Ready,
        JobState::Succeeded | JobState::Failed | JobState::Cancelled => ServingState::Failed,
    }
}

/// The deployment's state from its replicas': ready when every replica asked for is
/// ready, failed when none can become ready, else loading or pending.
fn deployment_state(wanted: u32, replicas: &[Replica]) -> (ServingState, Option<String>) {
    let count = |s: ServingState| replicas.iter().filter(|r| r.state == s).count() as u32;
    let (ready, loading, pending, failed) =
        (count(ServingState::Ready), count(ServingState::Loading), count(ServingState::Pending), count(ServingState::Failed));
    let failure = replicas.iter().filter(|r| r.state == ServingState::Failed).find_map(|r| r.message.clone());
    if wanted == 0 {
        return (ServingState::Pending, Some("Scaled to zero replicas.".into()));
    }
    if ready >= wanted {
        return (ServingState::Ready, None);
    }
    if ready + loading + pending == 0 && failed > 0 {
        return (ServingState::Failed, failure.or_else(|| Some("Every replica failed.".into())));
    }
    let reason = match failure {
        Some(failure) => format!("{ready} of {wanted} replicas ready; a replica failed: {failure}"),
        None if pending > 0 && loading == 0 => {
            format!("{ready} of {wanted} replicas ready; waiting for a worker that can serve it to claim a replica.")
        }
        None => format!("{ready} of {wanted} replicas ready; {loading} loading."),
    };
    let state = if loading > 0 || ready > 0 { ServingState::Loading } else { ServingState::Pending };
    (state, Some(reason))
}

const DEPLOYMENT_COLUMNS: &str = "d.id, d.name, d.model_id, m.name AS model_name, u.username AS owner, d.replicas, \
     d.max_batch_tokens, d.max_batch_requests, d.slo, d.created_at, d.updated_at";

async fn replicas_of(db: &Db, deployment: &str) -> Result<Vec<Replica>> {
    // Cancelled replicas were scaled away; they are history, not status.
    let rows = sqlx::query(
        "SELECT id, state, worker_id, message, attempts, endpoint, slice_uuid, slice_pinned, updated_at FROM jobs \
         WHERE deployment_id = $1 AND state <> 'cancelled' ORDER BY created_at",
    )
    .bind(deployment)
    .fetch_all(db.pool())
    .await?;
    rows.iter()
        .map(|row| {
            let state: String = row.try_get("state")?;
            let worker: Option<String> = row.try_get("worker_id")?;
            // A slice the planner chose is the replica's while it waits; one picked at
            // claim time only while the replica holds its lease.
            let bound = row.try_get::<i64, _>("slice_pinned")? != 0 || matches!(state.as_str(), "leased" | "running");
            Ok(Replica {
                id: parse_uuid(&row.try_get::<String, _>("id")?)?,
                state: replica_state(JobState::parse(&state).ok_or_else(|| anyhow::anyhow!("bad state {state}"))?),
                worker_id: worker.as_deref().map(parse_uuid).transpose()?,
                message: row.try_get("message")?,
                attempts: row.try_get::<i64, _>("attempts")? as u32,
                endpoint: row.try_get("endpoint")?,
                slice: if bound { row.try_get("slice_uuid")? } else { None },
                updated_at: db::time(row.try_get("updated_at")?),
            })
        })
        .collect()
}

async fn from_row(db: &Db, row: &AnyRow) -> Result<Deployment> {
    let id: String = row.try_get("id")?;
    let replicas = row.try_get::<i64, _>("replicas")? as u32;
    let replica_status = replicas_of(db, &id).await?;
    let slo = crate::fleet::slo::from_column(row.try_get("slo")?)?;
    let (state, mut reason) = deployment_state(replicas, &replica_status);
    // An SLO deployment the fleet could give no slice says why, not "scaled to zero".
    if let Some(slo) = slo.as_ref().filter(|_| replicas == 0) {
        reason = Some(slo.note.clone());
    }
    Ok(Deployment {
        id: parse_uuid(&id)?,
        name: row.try_get("name")?,
        model_id: parse_uuid(&row.try_get::<String, _>("model_id")?)?,
        model_name: row.try_get("model_name")?,
        owner: row.try_get("owner")?,
        replicas,
        ready_replicas: replica_status.iter().filter(|r| r.state == ServingState::Ready).count() as u32,
        state,
        reason,
        max_batch_tokens: row.try_get::<i64, _>("max_batch_tokens")? as u32,
        max_batch_requests: row.try_get::<i64, _>("max_batch_requests")? as u32,
        replica_status,
        slo,
        created_at: db::time(row.try_get("created_at")?),
        updated_at: db::time(row.try_get("updated_at")?),
    })
}

/// A deployment the principal may see, by id or by name.
pub async fn resolve(db: &Db, principal: &Principal, id_or_name: &str) -> Result<Deployment> {
    let row = sqlx::query(&format!(
        "SELECT {DEPLOYMENT_COLUMNS} FROM deployments d JOIN models m ON m.id = d.model_id \
         JOIN users u ON u.id = d.owner_id WHERE (d.id = $1 OR d.name = $1) AND ($2 IS NULL OR d.owner_id = $2)"
    ))
    .bind(id_or_name)
    .bind(principal.owner_filter())
    .fetch_optional(db.pool())
    .await?
    .ok_or_else(|| Error::not_found(&format!("Deployment '{id_or_name}'")))?;
    from_row(db, &row).await
}

pub async fn list_visible(db: &Db, principal: &Principal) -> Result<Vec<Deployment>> {
    let rows = sqlx::query(&format!(
        "SELECT {DEPLOYMENT_COLUMNS} FROM deployments d JOIN models m ON m.id = d.model_id \
         JOIN users u ON u.id = d.owner_id WHERE ($1 IS NULL OR d.owner_id = $1) ORDER BY d.name"
    ))
    .bind(principal.owner_filter())
    .fetch_all(db.pool())
    .await?;
    let mut deployments = Vec::with_capacity(rows.len());
    for row in &rows {
        deployments.push(from_row(db, row).await?);
    }
    Ok(deployments)
}

fn check_replicas(replicas: u32) -> Result<()> {
    if replicas > MAX_REPLICAS {
        return Err(Error::invalid("invalid_replicas", format!("replicas must be between 0 and {MAX_REPLICAS}.")));
    }
    Ok(())
}

/// Brings the number of live replicas to `wanted`: queues new ones, or cancels the
/// least advanced ones (pending before loading before ready, newest first).
async fn reconcile(db: &Db, owner: Uuid, deployment: &Deployment, wanted: u32) -> Result<()> {
    let live: Vec<&Replica> = deployment.replica_status.iter().filter(|r| r.state != ServingState::Failed).collect();
    let live_count = live.len() as u32;
    if live_count < wanted {
        let spec = JobSpec::Serve {
            deployment: deployment.id,
            model: deployment.model_id,
            max_batch_tokens: deployment.max_batch_tokens,
            max_batch_requests: deployment.max_batch_requests,
        };
        for _ in live_count..wanted {
            let name = format!("replica of {}", deployment.name);
            let links = crate::jobs::JobLinks { deployment: Some(deployment.id), ..Default::default() };
            crate::jobs::insert(db, owner, &name, &spec, REPLICA_MAX_ATTEMPTS, links).await?;
        }
    } else if live_count > wanted {
        let mut victims = live;
        victims.sort_by_key(|r| (r.state == ServingState::Ready, r.state == ServingState::Loading, std::cmp::Reverse(r.updated_at)));
        let now = now_ms();
        for replica in victims.into_iter().take((live_count - wanted) as usize) {
            sqlx::query(
                "UPDATE jobs SET state = 'cancelled', message = 'Scaled down.', finished_at = $1, updated_at = $1, \
                 lease_expires_at = NULL, endpoint = NULL WHERE id = $2 AND state IN ('queued', 'leased', 'running')",
            )
            .bind(now)
            .bind(replica.id.to_string())
            .execute(db.pool())
            .await?;
        }
    }
    Ok(())
}

/// Serve a model under a name.
#[utoipa::path(post, path = "/api/v1/deployments", tag = "deployments", security(("bearer" = [])),
    request_body = CreateDeployment,
    responses((status = 201, body = Deployment), (status = 409, body = tessera_api::error::ErrorBody),
              (status = 422, body = tessera_api::error::ErrorBody)))]
pub async fn create(
    State(state): State<AppState>,
    principal: Principal,
    ApiJson(request): ApiJson<CreateDeployment>,
) -> Result<(StatusCode, ApiJson<Deployment>)> {
    let name = request.name.trim();
    let valid_name = (1..=128).contains(&name.len())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
        && !name.starts_with('.');
    if !valid_name {
        return Err(Error::invalid(
            "invalid_name",
            "A deployment name has 1 to 128 letters, digits, '_', '-' or '.', not starting with '.'.",
        ));
    }
    check_replicas(request.replicas)?;
    if let Some(throughput) = request.throughput {
        crate::fleet::slo::check(throughput, request.latency_ms)?;
    }
    let max_batch_tokens = request.max_batch_tokens.unwrap_or(DEFAULT_MAX_BATCH_TOKENS);
    let max_batch_requests = request.max_batch_requests.unwrap_or(DEFAULT_MAX_BATCH_REQUESTS);
    if !(512..=1 << 20).contains(&max_batch_tokens) || !(1..=4096).contains(&max_batch_requests) {
        return Err(Error::invalid(
            "invalid_batching",
            "max_batch_tokens must be between 512 and 1048576 (a whole max-length input must fit) and max_batch_requests between 1 and 4096.",
        ));
    }
    let model = crate::registry::resolve(&state, &principal, &request.model).await?;
    if request.throughput.is_some() {
        crate::fleet::slo::check_table(&state.db, model.id, &model.name).await?;
    }
    let id = Uuid::new_v4();
    let now = now_ms();
    sqlx::query(
        "INSERT INTO deployments (id, owner_id, name, model_id, replicas, max_batch_tokens, max_batch_requests, \
         created_at, updated_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $8)",
    )
    .bind(id.to_string())
    .bind(principal.id.to_string())
    .bind(name)
    .bind(model.id.to_string())
    .bind(request.replicas as i64)
    .bind(max_batch_tokens as i64)
    .bind(max_batch_requests as i64)
    .bind(now)
    .execute(state.db.pool())
    .await
    .map_err(|e| {
        if db::is_unique_violation(&e) {
            Error::Conflict(format!("A deployment named '{name}' already exists; pick another name."))
        } else {
            e.into()
        }
    })?;
    let deployment = resolve(&state.db, &principal, &id.to_string()).await?;
    match request.throughput {
        Some(throughput) => crate::fleet::slo::place(&state, principal.id, &deployment, throughput, request.latency_ms).await?,
        None => reconcile(&state.db, principal.id, &deployment, request.replicas).await?,
    }
    Ok((StatusCode::CREATED, ApiJson(resolve(&state.db, &principal, &id.to_string()).await?)))
}

/// List deployments (yours; an admin sees all).
#[utoipa::path(get, path = "/api/v1/deployments", tag = "deployments", security(("bearer" = [])),
    responses((status = 200, body = Vec<Deployment>)))]
pub async fn list(State(state): State<AppState>, principal: Principal) -> Result<ApiJson<Vec<Deployment>>> {
    Ok(ApiJson(list_visible(&state.db, &principal).await?))
}

/// A deployment with its replicas, by id or name.
#[utoipa::path(get, path = "/api/v1/deployments/{id}", tag = "deployments", security(("bearer" = [])),
    params(("id" = String, Path, description = "id or name")),
    responses((status = 200, body = Deployment), (status = 404, body = tessera_api::error::ErrorBody)))]
pub async fn get(State(state): State<AppState>, principal: Principal, ApiPath(id): ApiPath<String>) -> Result<ApiJson<Deployment>> {
    Ok(ApiJson(resolve(&state.db, &principal, &id).await?))
}

/// Change the number of replicas.
#[utoipa::path(patch, path = "/api/v1/deployments/{id}", tag = "deployments", security(("bearer" = [])),
    params(("id" = String, Path, description = "id or name")), request_body = UpdateDeployment,
    responses((status = 200, body = Deployment), (status = 404, body = tessera_api::error::ErrorBody)))]
pub async fn update(
    State(state): State<AppState>,
    principal: Principal,
    ApiPath(id): ApiPath<String>,
    ApiJson(request): ApiJson<UpdateDeployment>,
) -> Result<ApiJson<Deployment>> {
    check_replicas(request.replicas)?;
    let deployment = resolve(&state.db, &principal, &id).await?;
    if deployment.slo.is_some() {
        return Err(Error::invalid(
            "slo_deployment",
            "This deployment is sized by its throughput SLO; delete it and create it again with the new throughput or with replicas.",
        ));
    }
    sqlx::query("UPDATE deployments SET replicas = $1, updated_at = $2 WHERE id = $3")
        .bind(request.replicas as i64)
        .bind(now_ms())
        .bind(deployment.id.to_string())
        .execute(state.db.pool())
        .await?;
    let owner: String = sqlx::query_scalar("SELECT owner_id FROM deployments WHERE id = $1")
        .bind(deployment.id.to_string())
        .fetch_one(state.db.pool())
        .await?;
    reconcile(&state.db, parse_uuid(&owner)?, &deployment, request.replicas).await?;
    Ok(ApiJson(resolve(&state.db, &principal, &id).await?))
}

/// Stop serving: every replica is stopped at its worker's next heartbeat.
#[utoipa::path(delete, path = "/api/v1/deployments/{id}", tag = "deployments", security(("bearer" = [])),
    params(("id" = String, Path, description = "id or name")),
    responses((status = 204), (status = 404, body = tessera_api::error::ErrorBody)))]
pub async fn delete(State(state): State<AppState>, principal: Principal, ApiPath(id): ApiPath<String>) -> Result<StatusCode> {
    let deployment = resolve(&state.db, &principal, &id).await?;
    let mut tx = state.db.begin().await?;
    sqlx::query("DELETE FROM jobs WHERE deployment_id = $1").bind(deployment.id.to_string()).execute(&mut *tx).await?;
    sqlx::query("DELETE FROM deployments WHERE id = $1").bind(deployment.id.to_string()).execute(&mut *tx).await?;
    tx.commit().await?;
    state.gateway.stats.forget(deployment.id);
    Ok(StatusCode::NO_CONTENT)
}

/// Traffic this server forwarded to the deployment: totals since the server started and
/// the last ten minutes in five-second buckets (request rate, latency percentiles, batch
/// size, tokens per batch). Kept in memory; each server counts the requests it served.
#[utoipa::path(get, path = "/api/v1/deployments/{id}/stats", tag = "deployments", security(("bearer" = [])),
    params(("id" = String, Path, description = "id or name")),
    responses((status = 200, body = DeploymentStats), (status = 404, body = tessera_api::error::ErrorBody)))]
pub async fn stats(State(state): State<AppState>, principal: Principal, ApiPath(id): ApiPath<String>) -> Result<ApiJson<DeploymentStats>> {
    let deployment = resolve(&state.db, &principal, &id).await?;
    Ok(ApiJson(state.gateway.stats.snapshot(deployment.id)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replica(state: ServingState, message: Option<&str>) -> Replica {
        Replica {
            id: Uuid::new_v4(),
            state,
            worker_id: None,
            message: message.map(Into::into),
            attempts: 1,
            endpoint: None,
            slice: None,
            updated_at: db::time(0),
        }
    }

    #[test]
    fn deployment_is_ready_only_when_every_wanted_replica_is() {
        let two_ready = [replica(ServingState::Ready, None), replica(ServingState::Ready, None)];
        assert_eq!(deployment_state(2, &two_ready).0, ServingState::Ready);
        assert_eq!(deployment_state(3, &two_ready).0, ServingState::Loading);
    }

    #[test]
    fn deployment_fails_with_the_replicas_reason_when_none_can_serve() {
        let failed = [replica(ServingState::Failed, Some("config.json: unsupported"))];
        let (state, reason) = deployment_state(1, &failed);
        assert_eq!(state, ServingState::Failed);
        assert_eq!(reason.as_deref(), Some("config.json: unsupported"));
    }

    #[test]
    fn pending_deployment_says_it_waits_for_a_worker() {
        let (state, reason) = deployment_state(1, &[replica(ServingState::Pending, None)]);
        assert_eq!(state, ServingState::Pending);
        assert!(reason.unwrap().contains("waiting for a worker"));
    }
}
