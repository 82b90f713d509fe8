//! The `/api/v1/jobs/{id}/…` routes of training jobs, for users (ownership checked
//! through the job) and for the worker holding the job's lease.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use tessera_api::precision::PrecisionPlanReport;
use tessera_api::train::{Checkpoint, LrStage, LrStageRecord, TrainingMetrics};
use uuid::Uuid;

use super::{checkpoints, lr_stages, metrics, precision};
use crate::auth::{AgentAuth, Principal};
use crate::error::{ApiJson, ApiMultipart, ApiPath, ApiQuery, Error, Result};
use crate::state::AppState;
use crate::{gangs, jobs};

#[derive(Debug, Deserialize, utoipa::IntoParams)]
pub struct MetricsQuery {
    /// Downsample each metric to at most this many points (min/max per bucket; the
    /// first and last points are always kept). Left out: every point.
    max_points: Option<usize>,
}

/// A job's metrics: `steps` (one row per training step: `loss`, `lr`, `throughput`, …)
/// and `evals` (one row per evaluation: `val_loss`, `accuracy`, …).
#[utoipa::path(get, path = "/api/v1/jobs/{id}/metrics", tag = "jobs", security(("bearer" = [])),
    params(("id" = Uuid, Path), MetricsQuery),
    responses((status = 200, body = TrainingMetrics), (status = 404, body = tessera_api::error::ErrorBody)))]
pub async fn job_metrics(
    State(state): State<AppState>,
    principal: Principal,
    ApiPath(id): ApiPath<Uuid>,
    ApiQuery(query): ApiQuery<MetricsQuery>,
) -> Result<ApiJson<TrainingMetrics>> {
    jobs::find(&state.db, &principal.scope(), id).await?;
    if query.max_points.is_some_and(|n| n < 4) {
        return Err(Error::BadRequest("max_points must be at least 4 (the ends and one bucket's min and max).".into()));
    }
    Ok(ApiJson(metrics::read(&state.db, id, query.max_points).await?))
}

/// The AutoLRS stages of a job, in order: each stage's candidate LRs with forecast and
/// observed losses, and the LR it chose.
#[utoipa::path(get, path = "/api/v1/jobs/{id}/lr-stages", tag = "jobs", security(("bearer" = [])),
    params(("id" = Uuid, Path)), responses((status = 200, body = Vec<LrStage>), (status = 404, body = tessera_api::error::ErrorBody)))]
pub async fn job_lr_stages(
    State(state): State<AppState>,
    principal: Principal,
    ApiPath(id): ApiPath<Uuid>,
) -> Result<ApiJson<Vec<LrStage>>> {
    jobs::find(&state.db, &principal.scope(), id).await?;
    Ok(ApiJson(lr_stages::read(&state.db, id).await?))
}

/// A job's checkpoints, oldest step first.
#[utoipa::path(get, path = "/api/v1/jobs/{id}/checkpoints", tag = "jobs", security(("bearer" = [])),
    params(("id" = Uuid, Path)), responses((status = 200, body = Vec<Checkpoint>), (status = 404, body = tessera_api::error::ErrorBody)))]
pub async fn job_checkpoints(
    State(state): State<AppState>,
    principal: Principal,
    ApiPath(id): ApiPath<Uuid>,
) -> Result<ApiJson<Vec<Checkpoint>>> {
    jobs::find(&state.db, &principal.scope(), id).await?;
    Ok(ApiJson(checkpoints::list(&state, id).await?))
}

/// Delete an ended job's checkpoints, freeing the storage they count against its owner's
/// quota. A job that may still resume from them (queued, preempted, running) keeps them.
#[utoipa::path(delete, path = "/api/v1/jobs/{id}/checkpoints", tag = "jobs", security(("bearer" = [])),
    params(("id" = Uuid, Path)), responses((status = 204), (status = 404, body = tessera_api::error::ErrorBody),
              (status = 409, body = tessera_api::error::ErrorBody)))]
pub async fn delete_job_checkpoints(
    State(state): State<AppState>,
    principal: Principal,
    ApiPath(id): ApiPath<Uuid>,
) -> Result<StatusCode> {
    let job = jobs::find(&state.db, &principal.scope(), id).await?;
    checkpoints::delete_ended(&state, &job).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Download one file of a job's checkpoint.
#[utoipa::path(get, path = "/api/v1/jobs/{id}/checkpoints/{step}/files/{name}", tag = "jobs", security(("bearer" = [])),
    params(("id" = Uuid, Path), ("step" = u64, Path), ("name" = String, Path)),
    responses((status = 200, content_type = "application/octet-stream"), (status = 404, body = tessera_api::error::ErrorBody)))]
pub async fn checkpoint_file(
    State(state): State<AppState>,
    principal: Principal,
    ApiPath((id, step, name)): ApiPath<(Uuid, u64, String)>,
) -> Result<Response> {
    jobs::find(&state.db, &principal.scope(), id).await?;
    checkpoints::file_response(&state, id, step, &name).await
}

/// The QSync precision plan of a data-parallel job: what each rank measured (cost table,
/// cast model), the precision chosen per operator and rank with its indicator value, the
/// predicted and measured step time, and the allocator's trace. 404 until rank 0 posted it.
#[utoipa::path(get, path = "/api/v1/jobs/{id}/precision-plan", tag = "jobs", security(("bearer" = [])),
    params(("id" = Uuid, Path)),
    responses((status = 200, body = PrecisionPlanReport), (status = 404, body = tessera_api::error::ErrorBody)))]
pub async fn job_precision_plan(
    State(state): State<AppState>,
    principal: Principal,
    ApiPath(id): ApiPath<Uuid>,
) -> Result<ApiJson<PrecisionPlanReport>> {
    let job = jobs::find(&state.db, &principal.scope(), id).await?;
    Ok(ApiJson(precision::read(&state.db, &job).await?.0))
}

/// Record training metrics of a leased job: rows per step and per evaluation. A step
/// reported again replaces the earlier values.
#[utoipa::path(post, path = "/api/v1/agent/jobs/{id}/training-metrics", tag = "agent", security(("worker" = [])),
    params(("id" = Uuid, Path)), request_body = TrainingMetrics,
    responses((status = 204), (status = 409, body = tessera_api::error::ErrorBody), (status = 422, body = tessera_api::error::ErrorBody)))]
pub async fn agent_metrics(
    State(state): State<AppState>,
    agent: AgentAuth,
    ApiPath(job): ApiPath<Uuid>,
    ApiJson(report): ApiJson<TrainingMetrics>,
) -> Result<StatusCode> {
    let (job, rank) = gangs::leased_job(&state, agent.worker_id, job).await?;
    metrics::store_report(&state.db, job, &report, rank.map(|r| r.rank)).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Record (or replace) one AutoLRS stage of a leased job.
#[utoipa::path(post, path = "/api/v1/agent/jobs/{id}/lr-stages", tag = "agent", security(("worker" = [])),
    params(("id" = Uuid, Path)), request_body = LrStageRecord,
    responses((status = 204), (status = 409, body = tessera_api::error::ErrorBody), (status = 422, body = tessera_api::error::ErrorBody)))]
pub async fn agent_lr_stage(
    State(state): State<AppState>,
    agent: AgentAuth,
    ApiPath(job): ApiPath<Uuid>,
    ApiJson(record): ApiJson<LrStageRecord>,
) -> Result<StatusCode> {
    let (job, _) = gangs::leased_job(&state, agent.worker_id, job).await?;
    lr_stages::store(&state.db, job, &record).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Upload a checkpoint of a leased job as `multipart/form-data`: a text field `step`,
/// then one part `files` per file (its filename names it). Same step again replaces it.
#[utoipa::path(post, path = "/api/v1/agent/jobs/{id}/checkpoints", tag = "agent", security(("worker" = [])),
    params(("id" = Uuid, Path)),
    request_body(content_type = "multipart/form-data", description = "field `step`, parts `files`"),
    responses((status = 201, body = Checkpoint), (status = 409, body = tessera_api::error::ErrorBody),
              (status = 413, body = tessera_api::error::ErrorBody), (status = 422, body = tessera_api::error::ErrorBody)))]
pub async fn agent_upload_checkpoint(
    State(state): State<AppState>,
    agent: AgentAuth,
    ApiPath(job): ApiPath<Uuid>,
    ApiMultipart(mut multipart): ApiMultipart,
) -> Result<(StatusCode, ApiJson<Checkpoint>)> {
    let (reported, _) = gangs::leased_job(&state, agent.worker_id, job).await?;
    let checkpoint = checkpoints::upload(&state, reported, agent.worker_id, job, &mut multipart).await?;
    Ok((StatusCode::CREATED, ApiJson(checkpoint)))
}

/// The latest checkpoint of a leased job, to resume from; `204` when it has none.
#[utoipa::path(get, path = "/api/v1/agent/jobs/{id}/checkpoints/latest", tag = "agent", security(("worker" = [])),
    params(("id" = Uuid, Path)),
    responses((status = 200, body = Checkpoint), (status = 204, description = "No checkpoint yet"),
              (status = 409, body = tessera_api::error::ErrorBody)))]
pub async fn agent_latest_checkpoint(
    State(state): State<AppState>,
    agent: AgentAuth,
    ApiPath(job): ApiPath<Uuid>,
) -> Result<Response> {
    let (job, _) = gangs::leased_job(&state, agent.worker_id, job).await?;
    Ok(match checkpoints::latest(&state, job).await? {
        Some(checkpoint) => ApiJson(checkpoint).into_response(),
        None => StatusCode::NO_CONTENT.into_response(),
    })
}

/// Download one file of a leased job's checkpoint.
#[utoipa::path(get, path = "/api/v1/agent/jobs/{id}/checkpoints/{step}/files/{name}", tag = "agent", security(("worker" = [])),
    params(("id" = Uuid, Path), ("step" = u64, Path), ("name" = String, Path)),
    responses((status = 200, content_type = "application/octet-stream"), (status = 404, body = tessera_api::error::ErrorBody),
              (status = 409, body = tessera_api::error::ErrorBody)))]
pub async fn agent_checkpoint_file(
    State(state): State<AppState>,
    agent: AgentAuth,
    ApiPath((job, step, name)): ApiPath<(Uuid, u64, String)>,
) -> Result<Response> {
    let (job, _) = gangs::leased_job(&state, agent.worker_id, job).await?;
    checkpoints::file_response(&state, job, step, &name).await
}

/// Post (or replace) the precision plan of the data-parallel job whose rank 0 this worker
/// holds, after planning and again at the end with the measured step time. 403 from
/// another rank or worker, 409 once the lease is gone, 422 for a report that does not fit
/// the gang (counts, operators, figures).
#[utoipa::path(put, path = "/api/v1/agent/jobs/{id}/precision-plan", tag = "agent", security(("worker" = [])),
    params(("id" = Uuid, Path)), request_body = PrecisionPlanReport,
    responses((status = 204), (status = 403, body = tessera_api::error::ErrorBody),
              (status = 409, body = tessera_api::error::ErrorBody), (status = 422, body = tessera_api::error::ErrorBody)))]
pub async fn agent_precision_plan(
    State(state): State<AppState>,
    agent: AgentAuth,
    ApiPath(job): ApiPath<Uuid>,
    ApiJson(report): ApiJson<PrecisionPlanReport>,
) -> Result<StatusCode> {
    precision::accept(&state.db, agent.worker_id, job, &report).await?;
    Ok(StatusCode::NO_CONTENT)
}
