//! Throughput tables of models per MIG profile: a user queues a `profile` job, a worker
//! measures the model on its slices and reports the points here, and the planner reads
//! the table with unmeasured profiles estimated (`scheduler::throughput`).

use axum::extract::State;
use axum::http::StatusCode;
use sqlx::Row;
use tessera_api::jobs::{Job, JobSpec};
use tessera_api::mig::{CreateProfile, ModelProfiles, ProfileReport, ThroughputEntry};
use uuid::Uuid;

use crate::app::AppState;
use crate::auth::{AgentAuth, Principal};
use crate::store::db::{self, now_ms, Db};
use crate::error::{ApiJson, ApiPath, Error, Result};
use crate::scheduler::mig::GpuModel;
use crate::scheduler::throughput::{complete, Row as TableRow, SCALING_EXPONENT};

/// Batch sizes the profiler measures unless told otherwise.
pub const DEFAULT_BATCH_SIZES: [u32; 7] = [1, 2, 4, 8, 16, 32, 64];
/// Expired leases a profile job survives.
const PROFILE_MAX_ATTEMPTS: u32 = 3;

/// The measured rows of a model's table.
pub async fn measured(db: &Db, model: Uuid) -> Result<Vec<TableRow>> {
    let rows = sqlx::query(
        "SELECT gpu_model, profile, batch_size, throughput, p99_ms, simulated, measured_at FROM model_profiles \
         WHERE model_id = $1",
    )
    .bind(model.to_string())
    .fetch_all(db.pool())
    .await?;
    rows.iter()
        .map(|row| {
            Ok(TableRow {
                gpu_model: row.try_get("gpu_model")?,
                profile: row.try_get("profile")?,
                batch_size: row.try_get::<i64, _>("batch_size")? as u32,
                throughput: row.try_get("throughput")?,
                p99_ms: row.try_get("p99_ms")?,
                estimated: false,
                simulated: row.try_get::<i64, _>("simulated")? != 0,
                measured_at: Some(row.try_get("measured_at")?),
            })
        })
        .collect()
}

/// Queue a profiler job for a model: the worker that claims it measures throughput and
/// p99 latency per batch size on each kind of slice it offers.
#[utoipa::path(post, path = "/api/v1/models/{id}/profiles", tag = "models", security(("bearer" = [])),
    params(("id" = String, Path, description = "id or name")), request_body = CreateProfile,
    responses((status = 201, body = Job), (status = 404, body = tessera_api::error::ErrorBody),
              (status = 422, body = tessera_api::error::ErrorBody)))]
pub async fn create(
    State(state): State<AppState>,
    principal: Principal,
    ApiPath(id): ApiPath<String>,
    ApiJson(request): ApiJson<CreateProfile>,
) -> Result<(StatusCode, ApiJson<Job>)> {
    let model = crate::registry::resolve(&state, &principal, &id).await?;
    let batch_sizes = request
        .batch_sizes
        .unwrap_or_else(|| DEFAULT_BATCH_SIZES.to_vec());
    if batch_sizes.is_empty()
        || batch_sizes.len() > 16
        || batch_sizes.iter().any(|b| !(1..=256).contains(b))
    {
        return Err(Error::invalid(
            "invalid_batch_sizes",
            "batch_sizes lists 1 to 16 batch sizes, each between 1 and 256.",
        ));
    }
    let spec = JobSpec::Profile {
        model: model.id,
        batch_sizes,
    };
    let job = crate::jobs::insert(
        &state.db,
        principal.id,
        &format!("profile {}", model.name),
        &spec,
        PROFILE_MAX_ATTEMPTS,
        crate::jobs::JobLinks::default(),
    )
    .await?;
    Ok((
        StatusCode::CREATED,
        ApiJson(crate::jobs::get_visible(&state.db, &principal, job).await?),
    ))
}

/// A model's throughput table: measured rows, and estimated rows for the profiles of
/// each measured GPU model that nobody measured (`estimated: true`).
#[utoipa::path(get, path = "/api/v1/models/{id}/profiles", tag = "models", security(("bearer" = [])),
    params(("id" = String, Path, description = "id or name")),
    responses((status = 200, body = ModelProfiles), (status = 404, body = tessera_api::error::ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    principal: Principal,
    ApiPath(id): ApiPath<String>,
) -> Result<ApiJson<ModelProfiles>> {
    let model = crate::registry::resolve(&state, &principal, &id).await?;
    let entries = complete(&measured(&state.db, model.id).await?)
        .into_iter()
        .map(|r| ThroughputEntry {
            gpu_model: r.gpu_model,
            profile: r.profile,
            batch_size: r.batch_size,
            throughput: r.throughput,
            p99_ms: r.p99_ms,
            estimated: r.estimated,
            simulated: r.simulated,
            measured_at: r.measured_at.map(db::time),
        })
        .collect();
    Ok(ApiJson(ModelProfiles {
        model_id: model.id,
        scaling_exponent: SCALING_EXPONENT,
        entries,
    }))
}

fn check_report(report: &ProfileReport) -> Result<()> {
    let invalid = |m: String| Err(Error::invalid("invalid_profile", m));
    let Some(gpu) = GpuModel::parse(&report.gpu_model) else {
        return invalid(format!(
            "unknown GPU model \"{}\"; use one of A100-40GB, A100-80GB, H100-80GB, H200-141GB",
            report.gpu_model
        ));
    };
    if gpu.profile_id(&report.profile).is_none() {
        return invalid(format!(
            "{gpu} has no MIG profile \"{}\"; its profiles are {}",
            report.profile,
            gpu.profile_names()
        ));
    }
    for p in &report.points {
        let positive = |x: f64| x.is_finite() && x > 0.0;
        if p.batch_size == 0 || !positive(p.throughput) || !positive(p.p99_ms) {
            return invalid(format!(
                "{} {} batch {}: batch size, throughput and p99_ms must be positive",
                report.gpu_model, report.profile, p.batch_size
            ));
        }
    }
    Ok(())
}

/// Store a profile job's measurements (a point measured again replaces the earlier one).
#[utoipa::path(post, path = "/api/v1/agent/jobs/{id}/profiles", tag = "agent", security(("worker" = [])),
    params(("id" = Uuid, Path)), request_body = Vec<ProfileReport>,
    responses((status = 204), (status = 409, body = tessera_api::error::ErrorBody), (status = 422, body = tessera_api::error::ErrorBody)))]
pub async fn agent_report(
    State(state): State<AppState>,
    agent: AgentAuth,
    ApiPath(job): ApiPath<Uuid>,
    ApiJson(reports): ApiJson<Vec<ProfileReport>>,
) -> Result<StatusCode> {
    crate::workers::agent::check_lease(&state, agent.worker_id, job).await?;
    let spec: String = sqlx::query_scalar("SELECT spec FROM jobs WHERE id = $1")
        .bind(job.to_string())
        .fetch_one(state.db.pool())
        .await?;
    let Ok(JobSpec::Profile { model, .. }) = serde_json::from_str::<JobSpec>(&spec) else {
        return Err(Error::Conflict(
            "Only a profile job reports throughput profiles.".into(),
        ));
    };
    reports.iter().try_for_each(check_report)?;
    let now = now_ms();
    let mut tx = state.db.begin().await?;
    for report in &reports {
        let gpu = GpuModel::parse(&report.gpu_model)
            .expect("checked above")
            .name();
        for p in &report.points {
            sqlx::query(
                "INSERT INTO model_profiles (model_id, gpu_model, profile, batch_size, throughput, p99_ms, simulated, measured_at) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8) \
                 ON CONFLICT (model_id, gpu_model, profile, batch_size) DO UPDATE SET throughput = excluded.throughput, \
                   p99_ms = excluded.p99_ms, simulated = excluded.simulated, measured_at = excluded.measured_at",
            )
            .bind(model.to_string())
            .bind(gpu)
            .bind(&report.profile)
            .bind(p.batch_size as i64)
            .bind(p.throughput)
            .bind(p.p99_ms)
            .bind(report.simulated as i64)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        }
    }
    tx.commit().await?;
    Ok(StatusCode::NO_CONTENT)
}
