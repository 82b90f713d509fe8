//! The worker protocol. A worker joins with the shared worker token and gets its own
//! secret; then it heartbeats (renewing its leases), claims jobs, and reports their
//! status, log lines and metrics. Everything it says is checked against the lease it
//! holds, so a worker whose lease expired cannot overwrite the job's new attempt.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use sqlx::Row;
use tessera_api::jobs::JobState;
use tessera_api::workers::{
    Assignment, ClaimRequest, Heartbeat, HeartbeatResponse, LogBatch, MetricBatch, RegisterRequest, RegisterResponse,
    StatusReport,
};
use uuid::Uuid;

use crate::app::AppState;
use crate::auth::{secrets, AgentAuth};
use crate::store::db::{self, now_ms};
use crate::error::{ApiJson, ApiPath, Error, Result};
use crate::jobs::queue;
use crate::training::metrics;

fn check_join_token(state: &AppState, headers: &HeaderMap) -> Result<()> {
    let expected = state.config.worker_token.as_deref().ok_or_else(|| {
        Error::Forbidden("This server accepts no workers: start it with TESSERA_WORKER_TOKEN set.".into())
    })?;
    let given = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or_default();
    if secrets::equal(given, expected) {
        Ok(())
    } else {
        Err(Error::Unauthorized("Send `Authorization: Bearer <TESSERA_WORKER_TOKEN>` to register a worker.".into()))
    }
}

/// Join (or rejoin under the same name) with the shared worker token.
#[utoipa::path(post, path = "/api/v1/agent/register", tag = "agent", security(("worker_token" = [])),
    request_body = RegisterRequest, responses((status = 200, body = RegisterResponse), (status = 401, body = tessera_api::error::ErrorBody)))]
pub async fn register(
    State(state): State<AppState>,
    headers: HeaderMap,
    ApiJson(request): ApiJson<RegisterRequest>,
) -> Result<ApiJson<RegisterResponse>> {
    check_join_token(&state, &headers)?;
    let name = request.name.trim();
    if name.is_empty() || name.len() > 200 {
        return Err(Error::invalid("invalid_name", "A worker name has 1 to 200 characters."));
    }
    let secret = secrets::generate(secrets::WORKER_SECRET_PREFIX);
    let engine_token = secrets::generate(secrets::ENGINE_TOKEN_PREFIX);
    let inventory = serde_json::to_string(&request.inventory).map_err(|e| anyhow::anyhow!(e))?;
    let now = now_ms();
    // A worker that restarts under its name keeps its id; its old secret stops working.
    let row = sqlx::query(
        "INSERT INTO workers (id, name, version, inventory, secret_hash, engine_token, registered_at, last_seen_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $7) \
         ON CONFLICT (name) DO UPDATE SET version = excluded.version, inventory = excluded.inventory, \
           secret_hash = excluded.secret_hash, engine_token = excluded.engine_token, \
           last_seen_at = excluded.last_seen_at \
         RETURNING id",
    )
    .bind(Uuid::new_v4().to_string())
    .bind(name)
    .bind(&request.version)
    .bind(inventory)
    .bind(secrets::digest(&secret))
    .bind(&engine_token)
    .bind(now)
    .fetch_one(state.db.pool())
    .await?;
    let id: String = row.try_get("id")?;
    let worker_id: Uuid = id.parse().map_err(|e| anyhow::anyhow!("bad worker id {id}: {e}"))?;
    // Whatever the previous incarnation held is gone with it.
    sqlx::query(
        "UPDATE jobs SET state = 'queued', worker_id = NULL, lease_expires_at = NULL, updated_at = $1, \
         message = 'The worker restarted; the job was requeued.' WHERE worker_id = $2 AND state IN ('leased', 'running')",
    )
    .bind(now)
    .bind(&id)
    .execute(state.db.pool())
    .await?;
    crate::fleet::slices::record(&state.db, worker_id, request.allow_repartition, &request.inventory.slices).await?;
    tracing::info!(worker = %worker_id, name, slices = request.inventory.slices.len(), "worker registered");
    Ok(ApiJson(RegisterResponse {
        worker_id,
        secret,
        heartbeat_interval_secs: state.config.heartbeat_secs,
        lease_ttl_secs: state.config.lease_ttl_secs,
        engine_token,
    }))
}

fn lease_ttl_ms(state: &AppState) -> i64 {
    state.config.lease_ttl_secs as i64 * 1000
}

/// Say the worker is alive and renew the leases of the jobs it is running.
#[utoipa::path(post, path = "/api/v1/agent/heartbeat", tag = "agent", security(("worker" = [])),
    request_body = Heartbeat, responses((status = 200, body = HeartbeatResponse)))]
pub async fn heartbeat(
    State(state): State<AppState>,
    agent: AgentAuth,
    ApiJson(beat): ApiJson<Heartbeat>,
) -> Result<ApiJson<HeartbeatResponse>> {
    let stop = queue::renew(&state.db, agent.worker_id, &beat.jobs, lease_ttl_ms(&state)).await?;
    Ok(ApiJson(HeartbeatResponse { stop }))
}

/// Lease the oldest queued job of a kind the worker can run; `204` when there is none.
#[utoipa::path(post, path = "/api/v1/agent/claim", tag = "agent", security(("worker" = [])),
    request_body = ClaimRequest, responses((status = 200, body = Assignment), (status = 204, description = "Nothing to do")))]
pub async fn claim(
    State(state): State<AppState>,
    agent: AgentAuth,
    ApiJson(request): ApiJson<ClaimRequest>,
) -> Result<Response> {
    let free = crate::fleet::slices::free_for(&state.db, agent.worker_id).await?;
    let Some(claimed) = queue::claim(&state.db, agent.worker_id, &request.kinds, lease_ttl_ms(&state), &free).await? else {
        return Ok(StatusCode::NO_CONTENT.into_response());
    };
    let slice = crate::fleet::slices::bind_claimed(&state.db, claimed.job_id, &free).await?;
    let spec = serde_json::from_str(&claimed.spec).map_err(|e| anyhow::anyhow!("stored job spec unreadable: {e}"))?;
    Ok(ApiJson(Assignment {
        job_id: claimed.job_id,
        spec,
        attempt: claimed.attempt,
        lease_expires_at: db::time(claimed.lease_expires_at),
        slice,
    })
    .into_response())
}

/// Fails unless `worker_id` holds the lease on `job`.
pub(crate) async fn check_lease(state: &AppState, worker_id: Uuid, job: Uuid) -> Result<()> {
    let held: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM jobs WHERE id = $1 AND worker_id = $2 AND state IN ('leased', 'running')",
    )
    .bind(job.to_string())
    .bind(worker_id.to_string())
    .fetch_one(state.db.pool())
    .await?;
    if held == 0 {
        return Err(Error::Conflict("This worker does not hold the job's lease (it expired or the job was cancelled); stop it.".into()));
    }
    Ok(())
}

/// Report that a leased job started, succeeded or failed.
#[utoipa::path(post, path = "/api/v1/agent/jobs/{id}/status", tag = "agent", security(("worker" = [])),
    params(("id" = Uuid, Path)), request_body = StatusReport,
    responses((status = 204), (status = 409, body = tessera_api::error::ErrorBody)))]
pub async fn report_status(
    State(state): State<AppState>,
    agent: AgentAuth,
    ApiPath(job): ApiPath<Uuid>,
    ApiJson(report): ApiJson<StatusReport>,
) -> Result<StatusCode> {
    let now = now_ms();
    // The fifth parameter: the endpoint of a running job, the state of a finished one.
    let (sql, fifth) = match report.state {
        JobState::Running => (
            "UPDATE jobs SET state = 'running', message = $1, updated_at = $2, started_at = COALESCE(started_at, $2), \
             endpoint = $5 WHERE id = $3 AND worker_id = $4 AND state IN ('leased', 'running')",
            report.endpoint.clone(),
        ),
        JobState::Succeeded | JobState::Failed => (
            "UPDATE jobs SET state = $5, message = $1, updated_at = $2, finished_at = $2, lease_expires_at = NULL, \
             endpoint = NULL WHERE id = $3 AND worker_id = $4 AND state IN ('leased', 'running')",
            Some(report.state.as_str().to_string()),
        ),
        other => {
            return Err(Error::BadRequest(format!(
                "A worker reports running, succeeded or failed, not {}.",
                other.as_str()
            )))
        }
    };
    let query = sqlx::query(sql).bind(report.message).bind(now).bind(job.to_string()).bind(agent.worker_id.to_string());
    if query.bind(fifth).execute(state.db.pool()).await?.rows_affected() == 0 {
        check_lease(&state, agent.worker_id, job).await?;
    }
    Ok(StatusCode::NO_CONTENT)
}

/// Append log lines to a leased job.
#[utoipa::path(post, path = "/api/v1/agent/jobs/{id}/logs", tag = "agent", security(("worker" = [])),
    params(("id" = Uuid, Path)), request_body = LogBatch, responses((status = 204)))]
pub async fn append_logs(
    State(state): State<AppState>,
    agent: AgentAuth,
    ApiPath(job): ApiPath<Uuid>,
    ApiJson(batch): ApiJson<LogBatch>,
) -> Result<StatusCode> {
    check_lease(&state, agent.worker_id, job).await?;
    if batch.lines.len() > 10_000 {
        return Err(Error::PayloadTooLarge("Send at most 10000 log lines per request.".into()));
    }
    let mut tx = state.db.begin().await?;
    let last: Option<i64> = sqlx::query_scalar("SELECT MAX(seq) FROM job_logs WHERE job_id = $1")
        .bind(job.to_string())
        .fetch_one(&mut *tx)
        .await?;
    let now = now_ms();
    for (i, line) in batch.lines.iter().enumerate() {
        let line: String = line.chars().take(8192).collect();
        sqlx::query("INSERT INTO job_logs (job_id, seq, at, line) VALUES ($1, $2, $3, $4)")
            .bind(job.to_string())
            .bind(last.unwrap_or(0) + 1 + i as i64)
            .bind(now)
            .bind(line)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Record metric points of a leased job (one per name and step: a point reported again
/// replaces the earlier one). Training jobs report through `training-metrics`.
#[utoipa::path(post, path = "/api/v1/agent/jobs/{id}/metrics", tag = "agent", security(("worker" = [])),
    params(("id" = Uuid, Path)), request_body = MetricBatch, responses((status = 204)))]
pub async fn record_metrics(
    State(state): State<AppState>,
    agent: AgentAuth,
    ApiPath(job): ApiPath<Uuid>,
    ApiJson(batch): ApiJson<MetricBatch>,
) -> Result<StatusCode> {
    check_lease(&state, agent.worker_id, job).await?;
    let now = now_ms();
    let points = batch
        .points
        .into_iter()
        .map(|p| metrics::Point {
            series: metrics::Series::Step,
            name: p.name,
            step: p.step,
            value: p.value,
            at: p.at.map(|t| t.timestamp_millis()).unwrap_or(now),
        })
        .collect();
    metrics::store(&state.db, job, points).await?;
    Ok(StatusCode::NO_CONTENT)
}
