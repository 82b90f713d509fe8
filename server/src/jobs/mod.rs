//! Jobs as users see them: submit, list, inspect, cancel, preempt, read logs. A submitted
//! body is read once into `tessera_api::jobs::CreateJob`; each kind is then resolved into
//! the `JobSpec` a worker receives (training through `training::spec`).
//!
//! Preemption (issue 16) is asked of the worker, not done to it: [`preempt_job`] flags the
//! job, the worker learns it at its next heartbeat, checkpoints at the step it is on and
//! reports `preempted`; the job then waits, claimable, and resumes from that checkpoint.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use serde::Deserialize;
use sqlx::AnyConnection;
use tessera_api::elastic::PreemptRequest;
use tessera_api::jobs::{CreateJob, GenericSpec, Job, JobSpec, JobState, LogLine};
use uuid::Uuid;

use crate::auth::Principal;
use crate::error::{optional_json, ApiJson, ApiPath, ApiQuery, Error, Result};
use crate::paging::{self, Page};
use crate::state::AppState;
use crate::store::jobs::{self as store, ListFilter, NewJob};
use crate::store::{db::Db, Scope};
use crate::{datasets, gangs, quotas, registry, training};

/// Attempts a job gets when the body does not say.
const DEFAULT_MAX_ATTEMPTS: u32 = 3;

/// A job `scope` may see; 404 otherwise.
pub async fn find(db: &Db, scope: &Scope, id: Uuid) -> Result<Job> {
    store::get(db, scope, id).await?.ok_or_else(|| Error::not_found("Job"))
}

/// A body mistake as a 422 naming the field (its JSON path).
fn body_error(error: serde_path_to_error::Error<serde_json::Error>) -> Error {
    let path = error.path().to_string();
    let message = if path.starts_with("model") {
        "model: give a registered model's id or name, or {\"kind\":\"mlp\",\"hidden\":[…]}".to_string()
    } else if path == "." {
        // A missing field: serde's sentence names it.
        error.inner().to_string()
    } else {
        format!("{path}: {}", error.inner())
    };
    Error::invalid("invalid_spec", message)
}

/// Checks a job and queues it for `principal`; returns its id.
pub async fn submit(state: &AppState, principal: &Principal, request: CreateJob) -> Result<Uuid> {
    let name = request.name().trim().to_string();
    if !(1..=200).contains(&name.len()) || name.chars().any(char::is_control) {
        return Err(Error::invalid(
            "invalid_spec",
            "name: give the job a name of 1 to 200 characters, none of them a control character",
        ));
    }
    let max_attempts = request.max_attempts().unwrap_or(DEFAULT_MAX_ATTEMPTS);
    if !(1..=100).contains(&max_attempts) {
        return Err(Error::invalid("invalid_spec", "max_attempts must be between 1 and 100."));
    }
    let (spec, dataset) = match request {
        CreateJob::Train(train) => {
            let (job, dataset) = training::spec::resolve(state, principal, &train).await?;
            if let Some(parallel) = &job.parallel {
                let spec = JobSpec::Train(job.clone());
                let row = NewJob { dataset: Some(dataset), ..NewJob::new(principal.id, &name, &spec, max_attempts) };
                let mut tx = state.db.begin().await?;
                check_quotas(state, &mut tx, principal, &spec).await?;
                hold_inputs(&state.db, &mut tx, &row).await?;
                let id = gangs::queue(&mut tx, &row, &job, parallel).await?;
                tx.commit().await?;
                tracing::info!(job = %id, ranks = parallel.ranks.len(), user = %principal.username, "data-parallel job queued");
                return Ok(id);
            }
            (JobSpec::Train(job), Some(dataset))
        }
        CreateJob::Generic(job) => match job.spec {
            GenericSpec::Prefetch { model } => {
                let model = registry::resolve(state, principal, &model).await?;
                (JobSpec::Prefetch { model: model.id }, None)
            }
        },
    };
    let job = NewJob { dataset, ..NewJob::new(principal.id, &name, &spec, max_attempts) };
    // The quota check and the insert are one step for this user (see `quotas`).
    let mut tx = state.db.begin().await?;
    check_quotas(state, &mut tx, principal, &spec).await?;
    hold_inputs(&state.db, &mut tx, &job).await?;
    let id = store::insert_in(&mut tx, &job).await?;
    tx.commit().await?;
    tracing::info!(job = %id, kind = spec.kind(), user = %principal.username, "job queued");
    Ok(id)
}

/// The quotas a new job must fit, checked in the transaction that queues it: one more
/// job, and for a training job room in storage for the checkpoints it will upload.
async fn check_quotas(state: &AppState, conn: &mut AnyConnection, principal: &Principal, spec: &JobSpec) -> Result<()> {
    quotas::check_jobs(state, conn, principal).await?;
    if matches!(spec, JobSpec::Train(_)) {
        quotas::check_checkpoint_room(state, conn, principal).await?;
    }
    Ok(())
}

/// Keeps the registered model and the dataset `job` reads from being deleted until the
/// caller's transaction, which queues it, ends (see `registry::hold`).
async fn hold_inputs(db: &Db, conn: &mut AnyConnection, job: &NewJob<'_>) -> Result<()> {
    if let Some(model) = job.spec.model() {
        registry::hold(db, conn, model).await?;
    }
    if let Some(dataset) = job.dataset {
        datasets::hold(db, conn, dataset).await?;
    }
    Ok(())
}

/// Cancels a job `principal` may see; 409 when it already ended, and for a serving
/// replica, which its deployment answers for (a cancelled one would leave it short for good).
pub async fn cancel_job(db: &Db, principal: &Principal, id: Uuid) -> Result<Job> {
    let scope = principal.scope();
    let job = find(db, &scope, id).await?;
    if let JobSpec::Serve { deployment, .. } = &job.spec {
        return Err(Error::Conflict(format!(
            "This job is a serving replica of deployment {deployment}; change its replicas with PATCH \
             /api/v1/deployments/{deployment}, or delete the deployment."
        )));
    }
    if !store::cancel(db, &scope, id, &format!("Cancelled by {}.", principal.username)).await? {
        return Err(Error::Conflict(format!(
            "The job already ended ({}); there is nothing to cancel.",
            job.state.as_str()
        )));
    }
    // A data-parallel job's ranks stop with it.
    gangs::settle(db, id).await?;
    find(db, &scope, id).await
}

/// What [`preempt_job`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preemption {
    /// The worker (every rank, for a gang) was asked to checkpoint now and stop; the job
    /// shows `preempted` once it has, and its slices are then free.
    Requested,
    /// A gang still forming (some ranks claimed, none training): its ranks went back to
    /// the queue at once, there being nothing to checkpoint.
    Released,
}

/// Preempts a running training job for the server's scheduler (`reason` goes in the job's
/// log once the request is recorded): a one-process job or a whole data-parallel gang
/// checkpoints at the step it is on and stops, then waits as `preempted` (claimed like
/// `queued`, not counted as an attempt) and resumes from that checkpoint. Asking again while a request is pending
/// keeps the first reason. Refuses with 409 a job whose spec is not `preemptible`, one
/// that is not a training job, and one with nothing running (queued, preempted, ended).
/// Ownership is not checked: that is [`preempt`]'s, for people.
pub async fn preempt_job(db: &Db, job: Uuid, reason: &str) -> Result<Preemption> {
    request_preemption(db, job, reason, false).await
}

/// [`preempt_job`], with `force` lifting the `preemptible` check (an admin's choice).
async fn request_preemption(db: &Db, id: Uuid, reason: &str, force: bool) -> Result<Preemption> {
    let job = find(db, &Scope::all(), id).await?;
    let train = match &job.spec {
        JobSpec::Train(train) => train,
        JobSpec::TrainRank(rank) => {
            return Err(Error::Conflict(format!(
                "This is one rank of data-parallel job {}; preempt that job, and every rank stops together.",
                rank.gang
            )))
        }
        _ => return Err(Error::Conflict("Only training jobs can be preempted.".into())),
    };
    if !force && !train.resources().preemptible {
        return Err(Error::Conflict(
            "This job is not preemptible (its spec's resources.preemptible is false); an admin may force it \
             with {\"force\": true}."
                .into(),
        ));
    }
    let done = if store::request_preemption(db, id, reason).await? {
        tracing::info!(job = %id, reason, "preemption requested");
        Some(Preemption::Requested)
    } else if train.parallel.is_some() && gangs::release_forming(db, id, reason).await? {
        tracing::info!(job = %id, reason, "forming gang released for a preemption");
        Some(Preemption::Released)
    } else {
        None
    };
    if let Some(done) = done {
        // The job's log says why, for its owner.
        store::append_logs(db, id, &[reason.to_string()], crate::store::db::now_ms()).await?;
        return Ok(done);
    }
    let job = find(db, &Scope::all(), id).await?;
    Err(Error::Conflict(format!("The job is {}, not running; there is nothing to preempt.", job.state.as_str())))
}

/// Preempt a training job: it checkpoints at the step it is on, stops, and waits as
/// `preempted` until a worker claims it again and resumes from that checkpoint (no
/// attempt spent). The owner may preempt their own job when its spec says
/// `resources.preemptible`; an admin any training job, one that is not preemptible only
/// with `"force": true`. The body may be left out. 202 once the request is recorded: the
/// job shows `preempted` after the worker's next heartbeat and checkpoint upload.
#[utoipa::path(post, path = "/api/v1/jobs/{id}/preempt", tag = "jobs", security(("bearer" = [])),
    params(("id" = Uuid, Path)), request_body(content = Option<PreemptRequest>),
    responses((status = 202, body = Job), (status = 403, body = tessera_api::error::ErrorBody),
              (status = 404, body = tessera_api::error::ErrorBody), (status = 409, body = tessera_api::error::ErrorBody)))]
pub async fn preempt(
    State(state): State<AppState>,
    principal: Principal,
    ApiPath(id): ApiPath<Uuid>,
    body: Bytes,
) -> Result<(StatusCode, ApiJson<Job>)> {
    let request: PreemptRequest = optional_json(&body, r#"{"reason": "…", "force": false}"#)?;
    // 404 for a job the caller may not see, before anything else is said about it.
    find(&state.db, &principal.scope(), id).await?;
    if request.force && !principal.is_admin() {
        return Err(Error::Forbidden(
            "Only an admin may force the preemption of a job that is not preemptible.".into(),
        ));
    }
    if request.reason.as_deref().is_some_and(|r| r.contains('\0')) {
        return Err(Error::invalid("invalid_request", "reason: write it without NUL characters."));
    }
    let reason = match request.reason.as_deref().map(str::trim) {
        Some(reason) if !reason.is_empty() => {
            format!("Preempted by {}: {}", principal.username, reason.chars().take(500).collect::<String>())
        }
        _ => format!("Preempted by {}.", principal.username),
    };
    request_preemption(&state.db, id, &reason, request.force).await?;
    Ok((StatusCode::ACCEPTED, ApiJson(find(&state.db, &principal.scope(), id).await?)))
}

/// Submit a job to the queue: a training job (its spec's fields at the top level), or
/// another kind as `{"name", "spec": {"kind": …}}`.
#[utoipa::path(post, path = "/api/v1/jobs", tag = "jobs", security(("bearer" = [])), request_body = CreateJob,
    responses((status = 201, body = Job), (status = 422, body = tessera_api::error::ErrorBody)))]
pub async fn create(
    State(state): State<AppState>,
    principal: Principal,
    ApiJson(body): ApiJson<serde_json::Value>,
) -> Result<(StatusCode, ApiJson<Job>)> {
    let request = CreateJob::from_json(body).map_err(body_error)?;
    let id = submit(&state, &principal, request).await?;
    Ok((StatusCode::CREATED, ApiJson(find(&state.db, &principal.scope(), id).await?)))
}

/// The list filter a request's `state` and `kind` ask for (empty or absent: any); 400 with
/// the values to use for anything else.
pub fn list_filter(state: Option<&str>, kind: Option<&str>) -> Result<ListFilter> {
    let state = match state {
        None | Some("") => None,
        Some(s) => Some(JobState::parse(s).ok_or_else(|| {
            Error::BadRequest(format!(
                "Unknown state {s:?}; use queued, preempted, leased, running, succeeded, failed or cancelled."
            ))
        })?),
    };
    let kind = match kind {
        None | Some("") => None,
        Some(k) => Some(store::LISTED_KINDS.into_iter().find(|listed| *listed == k).ok_or_else(|| {
            Error::BadRequest(format!(
                "Unknown kind {k:?}; use {} (serving replicas are listed with their deployment, ranks with their job).",
                store::LISTED_KINDS.join(", ")
            ))
        })?),
    };
    Ok(ListFilter { state, kind })
}

/// The jobs `scope` may see that pass `filter`, newest first, at most `limit`, after
/// `before`, the last job of the previous page; 400 when `before` names no job `scope`
/// may see.
pub async fn page(db: &Db, scope: &Scope, filter: ListFilter, before: Option<Uuid>, limit: u32) -> Result<Page<Job>> {
    paging::read("job", limit, |rows| store::list(db, scope, filter, before, rows)).await
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    /// Only jobs in this state.
    state: Option<String>,
    /// Only jobs of this kind: prefetch, profile or train.
    kind: Option<String>,
    /// At most this many jobs, 1 to 500 (default 500).
    limit: Option<u32>,
    /// Only the jobs listed after this one: the last job of the previous page.
    before: Option<Uuid>,
}

/// List jobs, newest first (yours; an admin sees all), a page at a time: when more jobs
/// follow, the `Link` header holds the next page's URL (`rel="next"`), as GitHub's API
/// pages; a list without it is complete.
#[utoipa::path(get, path = "/api/v1/jobs", tag = "jobs", security(("bearer" = [])), params(ListQuery),
    responses((status = 200, body = Vec<Job>, headers(("link" = String, description = "The next page, when there is one"))),
        (status = 400, body = tessera_api::error::ErrorBody)))]
pub async fn list(
    State(state): State<AppState>,
    principal: Principal,
    ApiQuery(query): ApiQuery<ListQuery>,
) -> Result<Response> {
    let filter = list_filter(query.state.as_deref(), query.kind.as_deref())?;
    let limit = paging::limit(query.limit)?;
    let page = page(&state.db, &principal.scope(), filter, query.before, limit).await?;
    let in_state = filter.state.map(|s| format!("&state={}", s.as_str())).unwrap_or_default();
    let of_kind = filter.kind.map(|k| format!("&kind={k}")).unwrap_or_default();
    paging::respond(page, |job| job.id, "jobs", limit, &format!("{in_state}{of_kind}"))
}

#[utoipa::path(get, path = "/api/v1/jobs/{id}", tag = "jobs", security(("bearer" = [])),
    params(("id" = Uuid, Path)), responses((status = 200, body = Job), (status = 404, body = tessera_api::error::ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    principal: Principal,
    ApiPath(id): ApiPath<Uuid>,
) -> Result<ApiJson<Job>> {
    Ok(ApiJson(find(&state.db, &principal.scope(), id).await?))
}

/// Cancel a job. A queued job never runs; a running one is stopped at the worker's next
/// heartbeat.
#[utoipa::path(post, path = "/api/v1/jobs/{id}/cancel", tag = "jobs", security(("bearer" = [])),
    params(("id" = Uuid, Path)), responses((status = 200, body = Job), (status = 409, body = tessera_api::error::ErrorBody)))]
pub async fn cancel(
    State(state): State<AppState>,
    principal: Principal,
    ApiPath(id): ApiPath<Uuid>,
) -> Result<ApiJson<Job>> {
    Ok(ApiJson(cancel_job(&state.db, &principal, id).await?))
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
    ApiQuery(query): ApiQuery<LogQuery>,
) -> Result<ApiJson<Vec<LogLine>>> {
    find(&state.db, &principal.scope(), id).await?;
    let limit = query.limit.unwrap_or(1000).clamp(1, 10_000);
    Ok(ApiJson(store::logs(&state.db, id, query.after.unwrap_or(0), limit).await?))
}
