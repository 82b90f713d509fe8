//! The worker protocol. A worker joins with the shared worker token and gets its own
//! secret; then it heartbeats (renewing its leases), claims jobs, and reports their
//! status, log lines and metrics. Everything it says is checked against the lease it
//! holds, so a worker whose lease expired cannot overwrite the job's new attempt.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use tessera_api::jobs::JobState;
use tessera_api::workers::{
    Assignment, ClaimRequest, Heartbeat, HeartbeatResponse, LogBatch, MetricBatch, RegisterRequest, RegisterResponse,
    StatusReport,
};
use uuid::Uuid;

use crate::auth::{secrets, AgentAuth};
use crate::error::{ApiJson, ApiPath, Error, Result};
use crate::gangs;
use crate::state::AppState;
use crate::store::db::{self, now_ms};
use crate::store::training::{Point, Series};
use crate::store::workers::Registration;
use crate::store::{jobs, slices, workers};
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
    let registration = Registration {
        name,
        version: &request.version,
        inventory: &request.inventory,
        secret_digest: &secrets::digest(&secret),
        engine_token: &engine_token,
    };
    let worker_id = workers::register(&state.db, &registration).await?;
    // Whatever the previous incarnation held is gone with it.
    jobs::requeue_held_by(&state.db, worker_id, "The worker restarted; the job was requeued.").await?;
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
    let stop = jobs::renew(&state.db, agent.worker_id, &beat.jobs, lease_ttl_ms(&state)).await?;
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
    // A rank of a forming gang first: its gang waits on it.
    let ranks = request.kinds.iter().any(|k| k == "train_rank");
    let gang_rank = if ranks { gangs::claim_rank(&state, agent.worker_id, lease_ttl_ms(&state)).await? } else { None };
    let kinds: Vec<String> = request.kinds.into_iter().filter(|k| k != "train_rank").collect();
    let free = slices::free_for(&state.db, agent.worker_id).await?;
    let claimed = match gang_rank {
        Some(claimed) => Some(claimed),
        None => jobs::claim(&state.db, agent.worker_id, &kinds, lease_ttl_ms(&state), &free).await?,
    };
    let Some(claimed) = claimed else {
        return Ok(StatusCode::NO_CONTENT.into_response());
    };
    let slice = slices::bind_claimed(&state.db, claimed.job_id, &free).await?;
    Ok(ApiJson(Assignment {
        job_id: claimed.job_id,
        spec: claimed.spec,
        attempt: claimed.attempt,
        lease_expires_at: db::time(claimed.lease_expires_at),
        slice,
    })
    .into_response())
}

/// Fails unless `worker_id` holds the lease on `job`.
pub async fn check_lease(state: &AppState, worker_id: Uuid, job: Uuid) -> Result<()> {
    if !jobs::holds_lease(&state.db, worker_id, job).await? {
        return Err(Error::Conflict(
            "This worker does not hold the job's lease (it expired or the job was cancelled); stop it.".into(),
        ));
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
    let held = match report.state {
        JobState::Running => {
            let endpoint = report.endpoint.as_deref();
            jobs::mark_running(&state.db, agent.worker_id, job, report.message.as_deref(), endpoint).await?
        }
        JobState::Succeeded | JobState::Failed => {
            jobs::mark_finished(&state.db, agent.worker_id, job, report.state, report.message.as_deref()).await?
        }
        other => {
            return Err(Error::BadRequest(format!(
                "A worker reports running, succeeded or failed, not {}.",
                other.as_str()
            )))
        }
    };
    if !held {
        check_lease(&state, agent.worker_id, job).await?;
    }
    gangs::settle(&state.db, job).await?;
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
    let (job, rank) = gangs::leased_job(&state, agent.worker_id, job).await?;
    if batch.lines.len() > 10_000 {
        return Err(Error::PayloadTooLarge("Send at most 10000 log lines per request.".into()));
    }
    // A gang's ranks write to its job's one log, each line saying whose it is.
    let prefix = rank.map(|r| format!("rank {}: ", r.rank)).unwrap_or_default();
    let lines: Vec<String> =
        batch.lines.iter().map(|line| format!("{prefix}{}", line.chars().take(8192).collect::<String>())).collect();
    jobs::append_logs(&state.db, job, &lines, now_ms()).await?;
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
        .map(|p| Point {
            series: Series::Step,
            name: p.name,
            step: p.step,
            value: p.value,
            at: p.at.map(|t| t.timestamp_millis()).unwrap_or(now),
            phase: None,
        })
        .collect();
    metrics::store(&state.db, job, points).await?;
    Ok(StatusCode::NO_CONTENT)
}
