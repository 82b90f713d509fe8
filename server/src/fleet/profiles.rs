//! Throughput tables of models per MIG profile: a user queues a `profile` job, a worker
//! measures the model on its slices and reports the points here, and the planner reads
//! the table with unmeasured profiles estimated (`scheduler::throughput`). The rows live
//! in `store::models`.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use tessera_api::jobs::{Job, JobSpec};
use tessera_api::mig::{CreateProfile, ModelProfiles, ProfileReport, ThroughputEntry};
use uuid::Uuid;

use crate::auth::{AgentAuth, Principal};
use crate::error::{optional_json, ApiJson, ApiPath, Error, Result};
use crate::scheduler::mig::GpuModel;
use crate::scheduler::throughput::{complete, SCALING_EXPONENT};
use crate::state::AppState;
use crate::store::db::{self, now_ms};
use crate::store::jobs::{self, NewJob};
use crate::store::models;

/// Batch sizes the profiler measures unless told otherwise.
pub const DEFAULT_BATCH_SIZES: [u32; 7] = [1, 2, 4, 8, 16, 32, 64];
/// Expired leases a profile job survives.
const PROFILE_MAX_ATTEMPTS: u32 = 3;

/// Queue a profiler job for a model: the worker that claims it measures throughput and
/// p99 latency per batch size on each kind of slice it offers. The body may be left out.
#[utoipa::path(post, path = "/api/v1/models/{id}/profiles", tag = "models", security(("bearer" = [])),
    params(("id" = String, Path, description = "id or name")), request_body(content = Option<CreateProfile>),
    responses((status = 201, body = Job), (status = 403, body = tessera_api::error::ErrorBody),
              (status = 404, body = tessera_api::error::ErrorBody), (status = 422, body = tessera_api::error::ErrorBody)))]
pub async fn create(
    State(state): State<AppState>,
    principal: Principal,
    ApiPath(id): ApiPath<String>,
    body: Bytes,
) -> Result<(StatusCode, ApiJson<Job>)> {
    let request: CreateProfile = optional_json(&body, r#"{"batch_sizes": [1, 2, 4, …]}"#)?;
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
    let name = format!("profile {}", model.name);
    // A job like the others: the jobs quota holds for it (see `quotas`).
    let mut tx = state.db.begin().await?;
    crate::quotas::check_jobs(&state, &mut tx, &principal).await?;
    crate::registry::hold(&state.db, &mut tx, model.id).await?;
    let job = jobs::insert_in(&mut tx, &NewJob::new(principal.id, &name, &spec, PROFILE_MAX_ATTEMPTS)).await?;
    tx.commit().await?;
    Ok((StatusCode::CREATED, ApiJson(crate::jobs::find(&state.db, &principal.scope(), job).await?)))
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
    let entries = complete(&models::measured_profiles(&state.db, model.id).await?)
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

/// The least throughput a profile point may report, requests per second.
const MIN_THROUGHPUT: f64 = 1e-3;

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
        // A rate below one request in 1000 s is no measurement; it would size a plan in
        // billions of GPUs.
        if p.batch_size == 0 || !positive(p.p99_ms) || !(p.throughput.is_finite() && p.throughput >= MIN_THROUGHPUT) {
            return invalid(format!(
                "{} {} batch {}: batch size and p99_ms must be positive, throughput at least {MIN_THROUGHPUT} req/s",
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
    let Some(JobSpec::Profile { model, .. }) = jobs::spec(&state.db, job).await? else {
        return Err(Error::Conflict(
            "Only a profile job reports throughput profiles.".into(),
        ));
    };
    reports.iter().try_for_each(check_report)?;
    // Stored under the catalogue's spelling of the GPU model.
    let reports: Vec<ProfileReport> = reports
        .into_iter()
        .map(|r| ProfileReport { gpu_model: GpuModel::parse(&r.gpu_model).expect("checked above").name().to_string(), ..r })
        .collect();
    models::record_profiles(&state.db, model, &reports, now_ms()).await?;
    Ok(StatusCode::NO_CONTENT)
}
