//! Jobs as users see them: submit, list, inspect, cancel, read logs and metrics.

pub mod queue;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use serde::Deserialize;
use sqlx::any::AnyRow;
use sqlx::Row;
use tessera_api::jobs::{CreateJob, Job, JobSpec, JobState, LogLine};
use tessera_api::train::TrainProgress;
use uuid::Uuid;

use crate::app::AppState;
use crate::auth::Principal;
use crate::store::db::{self, now_ms, Db};
use crate::error::{ApiJson, ApiPath, Error, Result};

const JOB_COLUMNS: &str = "j.id, j.name, j.spec, j.state, j.message, j.attempts, j.max_attempts, j.worker_id, \
     j.lease_expires_at, j.created_at, j.updated_at, j.started_at, j.finished_at, j.progress_step, u.username AS owner";

fn parse_uuid(text: &str) -> Result<Uuid> {
    text.parse().map_err(|e| anyhow::anyhow!("bad uuid {text}: {e}").into())
}

fn job_from_row(row: &AnyRow) -> Result<Job> {
    let state: String = row.try_get("state")?;
    let spec: String = row.try_get("spec")?;
    let worker: Option<String> = row.try_get("worker_id")?;
    let spec: JobSpec =
        serde_json::from_str(&spec).map_err(|e| anyhow::anyhow!("stored job spec unreadable: {e}"))?;
    let progress = match &spec {
        JobSpec::Train(train) => Some(TrainProgress {
            step: row.try_get::<Option<i64>, _>("progress_step")?.unwrap_or(0).max(0) as u64,
            max_steps: train.max_steps,
        }),
        _ => None,
    };
    Ok(Job {
        id: parse_uuid(&row.try_get::<String, _>("id")?)?,
        name: row.try_get("name")?,
        owner: row.try_get("owner")?,
        spec,
        state: JobState::parse(&state).ok_or_else(|| anyhow::anyhow!("bad job state {state}"))?,
        message: row.try_get("message")?,
        attempts: row.try_get::<i64, _>("attempts")? as u32,
        max_attempts: row.try_get::<i64, _>("max_attempts")? as u32,
        worker_id: worker.as_deref().map(parse_uuid).transpose()?,
        lease_expires_at: db::opt_time(row.try_get("lease_expires_at")?),
        created_at: db::time(row.try_get("created_at")?),
        updated_at: db::time(row.try_get("updated_at")?),
        started_at: db::opt_time(row.try_get("started_at")?),
        finished_at: db::opt_time(row.try_get("finished_at")?),
        progress,
    })
}

/// Turns the client's spec (model by id or name) into the stored one (model by id).
async fn resolve_spec(state: &AppState, principal: &Principal, spec: serde_json::Value) -> Result<JobSpec> {
    let kind = spec.get("kind").and_then(|k| k.as_str()).unwrap_or_default().to_string();
    match kind.as_str() {
        "prefetch" => {
            let model = spec.get("model").and_then(|m| m.as_str()).ok_or_else(|| {
                Error::invalid("invalid_spec", "A prefetch job needs \"model\": the id or name of a model.")
            })?;
            let model = crate::registry::resolve(state, principal, model).await?;
            Ok(JobSpec::Prefetch { model: model.id })
        }
        _ => Err(Error::invalid(
            "invalid_spec",
            format!(
                "Unknown job kind {kind:?}; the spec's \"kind\" must be prefetch (a training job puts its fields at the top level, without \"spec\")."
            ),
        )),
    }
}

/// What a job belongs to besides its owner, written with the job in one statement.
#[derive(Debug, Default, Clone, Copy)]
pub struct JobLinks {
    /// The deployment a serving replica belongs to.
    pub deployment: Option<Uuid>,
    /// The dataset a training job reads (a dataset in use cannot be deleted).
    pub dataset: Option<Uuid>,
}

/// Queues a job.
pub async fn insert(
    db: &Db,
    owner: Uuid,
    name: &str,
    spec: &JobSpec,
    max_attempts: u32,
    links: JobLinks,
) -> Result<Uuid> {
    let id = Uuid::new_v4();
    let now = now_ms();
    sqlx::query(
        "INSERT INTO jobs (id, owner_id, name, kind, spec, state, attempts, max_attempts, created_at, updated_at, \
         deployment_id, dataset_id) VALUES ($1, $2, $3, $4, $5, 'queued', 0, $6, $7, $7, $8, $9)",
    )
    .bind(id.to_string())
    .bind(owner.to_string())
    .bind(name)
    .bind(spec.kind())
    .bind(serde_json::to_string(spec).map_err(|e| anyhow::anyhow!(e))?)
    .bind(max_attempts as i64)
    .bind(now)
    .bind(links.deployment.map(|d| d.to_string()))
    .bind(links.dataset.map(|d| d.to_string()))
    .execute(db.pool())
    .await?;
    Ok(id)
}

pub async fn get_visible(db: &Db, principal: &Principal, id: Uuid) -> Result<Job> {
    let row = sqlx::query(&format!(
        "SELECT {JOB_COLUMNS} FROM jobs j JOIN users u ON u.id = j.owner_id WHERE j.id = $1 AND ($2 IS NULL OR j.owner_id = $2)"
    ))
    .bind(id.to_string())
    .bind(principal.owner_filter())
    .fetch_optional(db.pool())
    .await?
    .ok_or_else(|| Error::not_found("Job"))?;
    job_from_row(&row)
}

/// Jobs newest first, without serving replicas (those are listed with their deployment).
pub async fn list_visible(db: &Db, principal: &Principal, state: Option<JobState>) -> Result<Vec<Job>> {
    let rows = sqlx::query(&format!(
        "SELECT {JOB_COLUMNS} FROM jobs j JOIN users u ON u.id = j.owner_id \
         WHERE ($1 IS NULL OR j.owner_id = $1) AND ($2 IS NULL OR j.state = $2) AND j.deployment_id IS NULL \
         ORDER BY j.created_at DESC LIMIT 500"
    ))
    .bind(principal.owner_filter())
    .bind(state.map(JobState::as_str))
    .fetch_all(db.pool())
    .await?;
    rows.iter().map(job_from_row).collect()
}

/// A job body: the generic `{"name", "spec": {"kind", …}}` form, or a training job's
/// fields at the top level (see `tessera_api::train::CreateTrainJob`). Only for the
/// OpenAPI document: the handler tells the two apart by the `spec` field, so each gets
/// error messages of its own.
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
pub enum SubmitJob {
    Generic(CreateJob),
    Train(tessera_api::train::CreateTrainJob),
}

/// Submit a job to the queue: a training job (its spec's fields at the top level), or
/// another kind as `{"name", "spec": {"kind": …}}`.
#[utoipa::path(post, path = "/api/v1/jobs", tag = "jobs", security(("bearer" = [])), request_body = SubmitJob,
    responses((status = 201, body = Job), (status = 422, body = tessera_api::error::ErrorBody)))]
pub async fn create(
    State(state): State<AppState>,
    principal: Principal,
    ApiJson(body): ApiJson<serde_json::Value>,
) -> Result<(StatusCode, ApiJson<Job>)> {
    let id = if body.get("spec").is_some() {
        let request: CreateJob = serde_json::from_value(body)
            .map_err(|e| Error::BadRequest(format!("The request body does not fit a job: {e}")))?;
        submit(&state, &principal, request).await?
    } else {
        crate::training::spec::submit(&state, &principal, body).await?
    };
    Ok((StatusCode::CREATED, ApiJson(get_visible(&state.db, &principal, id).await?)))
}

/// Queues a job of a generic kind (`{"name", "spec": {"kind": …}}`); returns its id.
pub async fn submit(state: &AppState, principal: &Principal, request: CreateJob) -> Result<Uuid> {
    let name = request.name.trim();
    if name.is_empty() || name.len() > 200 {
        return Err(Error::invalid("invalid_name", "A job name has 1 to 200 characters."));
    }
    let max_attempts = request.max_attempts.unwrap_or(3);
    if !(1..=100).contains(&max_attempts) {
        return Err(Error::invalid("invalid_spec", "max_attempts must be between 1 and 100."));
    }
    let spec = resolve_spec(state, principal, request.spec).await?;
    insert(&state.db, principal.id, name, &spec, max_attempts, JobLinks::default()).await
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
pub struct ListQuery {
    /// Only jobs in this state.
    state: Option<String>,
}

/// List jobs, newest first (yours; an admin sees all).
#[utoipa::path(get, path = "/api/v1/jobs", tag = "jobs", security(("bearer" = [])), params(ListQuery),
    responses((status = 200, body = Vec<Job>)))]
pub async fn list(
    State(state): State<AppState>,
    principal: Principal,
    Query(query): Query<ListQuery>,
) -> Result<ApiJson<Vec<Job>>> {
    let filter = match query.state.as_deref() {
        None | Some("") => None,
        Some(s) => Some(JobState::parse(s).ok_or_else(|| {
            Error::BadRequest(format!("Unknown state {s:?}; use queued, leased, running, succeeded, failed or cancelled."))
        })?),
    };
    Ok(ApiJson(list_visible(&state.db, &principal, filter).await?))
}

#[utoipa::path(get, path = "/api/v1/jobs/{id}", tag = "jobs", security(("bearer" = [])),
    params(("id" = Uuid, Path)), responses((status = 200, body = Job), (status = 404, body = tessera_api::error::ErrorBody)))]
pub async fn get(State(state): State<AppState>, principal: Principal, ApiPath(id): ApiPath<Uuid>) -> Result<ApiJson<Job>> {
    Ok(ApiJson(get_visible(&state.db, &principal, id).await?))
}

/// Cancel a job. A queued job never runs; a running one is stopped at the worker's next
/// heartbeat.
#[utoipa::path(post, path = "/api/v1/jobs/{id}/cancel", tag = "jobs", security(("bearer" = [])),
    params(("id" = Uuid, Path)), responses((status = 200, body = Job), (status = 409, body = tessera_api::error::ErrorBody)))]
pub async fn cancel(State(state): State<AppState>, principal: Principal, ApiPath(id): ApiPath<Uuid>) -> Result<ApiJson<Job>> {
    let job = get_visible(&state.db, &principal, id).await?;
    let now = now_ms();
    let changed = sqlx::query(
        "UPDATE jobs SET state = 'cancelled', message = $1, finished_at = $2, updated_at = $2, lease_expires_at = NULL \
         WHERE id = $3 AND state IN ('queued', 'leased', 'running')",
    )
    .bind(format!("Cancelled by {}.", principal.username))
    .bind(now)
    .bind(id.to_string())
    .execute(state.db.pool())
    .await?
    .rows_affected();
    if changed == 0 {
        return Err(Error::Conflict(format!("The job already ended ({}); there is nothing to cancel.", job.state.as_str())));
    }
    Ok(ApiJson(get_visible(&state.db, &principal, id).await?))
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
pub struct LogQuery {
    /// Only lines after this sequence number (for following a log).
    after: Option<i64>,
    /// At most this many lines (default 1000).
    limit: Option<i64>,
}

/// A job's log lines, oldest first.
#[utoipa::path(get, path = "/api/v1/jobs/{id}/logs", tag = "jobs", security(("bearer" = [])),
    params(("id" = Uuid, Path), LogQuery), responses((status = 200, body = Vec<LogLine>)))]
pub async fn logs(
    State(state): State<AppState>,
    principal: Principal,
    ApiPath(id): ApiPath<Uuid>,
    Query(query): Query<LogQuery>,
) -> Result<ApiJson<Vec<LogLine>>> {
    get_visible(&state.db, &principal, id).await?;
    Ok(ApiJson(read_logs(&state.db, id, query.after.unwrap_or(0), query.limit.unwrap_or(1000).clamp(1, 10_000)).await?))
}

pub async fn read_logs(db: &Db, job: Uuid, after: i64, limit: i64) -> Result<Vec<LogLine>> {
    let rows = sqlx::query("SELECT seq, at, line FROM job_logs WHERE job_id = $1 AND seq > $2 ORDER BY seq LIMIT $3")
        .bind(job.to_string())
        .bind(after)
        .bind(limit)
        .fetch_all(db.pool())
        .await?;
    rows.iter()
        .map(|r| Ok(LogLine { seq: r.try_get("seq")?, at: db::time(r.try_get("at")?), line: r.try_get("line")? }))
        .collect()
}
