//! The worker protocol. A worker joins with the shared worker token and gets its own
//! secret; then it heartbeats (renewing its leases), claims jobs, and reports their
//! status, log lines and metrics. Everything it says is checked against the lease it
//! holds, so a worker whose lease expired cannot overwrite the job's new attempt. A
//! worker gets least privilege: it fetches only the models and datasets of jobs it
//! holds, reports engine endpoints only on its own host, and cannot take a live
//! worker's name.

use std::net::{IpAddr, SocketAddr};

use axum::extract::{ConnectInfo, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use tessera_api::jobs::{JobSpec, JobState};
use tessera_api::mig::Slice;
use tessera_api::parallel::RankJob;
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
    let given = crate::auth::bearer_of(headers).unwrap_or_default();
    if secrets::equal(given, expected) {
        Ok(())
    } else {
        Err(Error::Unauthorized("Send `Authorization: Bearer <TESSERA_WORKER_TOKEN>` to register a worker.".into()))
    }
}

/// Join (or rejoin under the same name) with the shared worker token. While a worker of
/// that name is online, only one presenting its `previous_secret` may rejoin (409 else).
#[utoipa::path(post, path = "/api/v1/agent/register", tag = "agent", security(("worker_token" = [])),
    request_body = RegisterRequest, responses((status = 200, body = RegisterResponse), (status = 401, body = tessera_api::error::ErrorBody),
              (status = 409, body = tessera_api::error::ErrorBody)))]
pub async fn register(
    State(state): State<AppState>,
    headers: HeaderMap,
    ApiJson(request): ApiJson<RegisterRequest>,
) -> Result<ApiJson<RegisterResponse>> {
    check_join_token(&state, &headers)?;
    check_identifiers(&request)?;
    // A partition that cannot be is refused before anything changes: a refused rejoin
    // keeps its secret, its name and its jobs.
    let slices = crate::fleet::slices::with_starts(&request.inventory.slices)?;
    let name = request.name.trim();
    let secret = secrets::generate(secrets::WORKER_SECRET_PREFIX);
    let engine_token = secrets::generate(secrets::ENGINE_TOKEN_PREFIX);
    let previous_digest = request.previous_secret.as_deref().map(secrets::digest);
    let online_since = super::online_since(&state);
    if let Some((slice, other)) = crate::fleet::slices::offered_by_another(&state.db, name, &slices, online_since).await? {
        return Err(Error::Conflict(format!(
            "The slice {slice} is offered by worker '{other}', which is online; one device slice has one worker (run \
             one worker per GPU host, or stop '{other}' first)."
        )));
    }
    let registration = Registration {
        name,
        version: &request.version,
        inventory: &request.inventory,
        secret_digest: &secrets::digest(&secret),
        engine_token: &engine_token,
        join_digest: &secrets::digest(state.config.worker_token.as_deref().unwrap_or_default()),
        previous_digest: previous_digest.as_deref(),
        online_since,
    };
    let Some(worker_id) = workers::register(&state.db, &registration).await? else {
        let seen = workers::last_seen(&state.db, name).await?.unwrap_or(online_since);
        let wait = (seen - online_since).max(0) / 1000 + 1;
        return Err(Error::Conflict(format!(
            "A worker named '{name}' is online (heard from {}s ago); pick another name, or retry in {wait}s once \
             it has gone quiet. The same worker rejoins at once by sending its previous_secret.",
            (now_ms() - seen).max(0) / 1000
        )));
    };
    // Whatever the previous incarnation held is gone with it.
    jobs::release_held_by(&state.db, worker_id).await?;
    crate::fleet::slices::record(&state.db, worker_id, request.allow_repartition, &slices).await?;
    tracing::info!(worker = %worker_id, name, slices = request.inventory.slices.len(), "worker registered");
    Ok(ApiJson(RegisterResponse {
        worker_id,
        secret,
        heartbeat_interval_secs: state.config.heartbeat_secs,
        lease_ttl_secs: state.config.lease_ttl_secs,
        engine_token,
    }))
}

/// What names the worker and its slices is kept as given and matched on later, so a
/// control character (a NUL, which PostgreSQL cannot store, or an escape) is refused,
/// not replaced as in the text a worker reports.
fn check_identifiers(request: &RegisterRequest) -> Result<()> {
    let plain = |text: &str| !text.chars().any(char::is_control);
    let name = request.name.trim();
    if name.is_empty() || name.len() > 200 || !plain(name) {
        return Err(Error::invalid("invalid_name", "A worker name has 1 to 200 characters, none of them a control character."));
    }
    if !plain(&request.version) {
        return Err(Error::invalid("invalid_version", "version: report the worker's version without control characters."));
    }
    let plain_slice = |s: &Slice| {
        [Some(s.uuid.as_str()), Some(s.gpu_uuid.as_str()), s.gpu_model.as_deref(), s.profile.as_deref()]
            .into_iter()
            .flatten()
            .all(plain)
    };
    if !request.inventory.slices.iter().all(plain_slice) {
        return Err(Error::invalid(
            "invalid_slices",
            "A slice's uuid, gpu_uuid, gpu_model and profile hold no control characters; report them as NVML gives them.",
        ));
    }
    Ok(())
}

fn lease_ttl_ms(state: &AppState) -> i64 {
    state.config.lease_ttl_secs as i64 * 1000
}

/// The most entries a heartbeat's `jobs` or a claim's `kinds` may list (each costs the
/// database a statement or a parameter); far more than a worker runs or knows.
const MAX_LISTED: usize = 1024;

/// Say the worker is alive and renew the leases of the jobs it is running; the answer
/// names the jobs to stop and those to preempt (checkpoint now, report `preempted`). A job
/// leased to the worker that it neither started nor listed (a claim whose answer it never
/// got) is requeued at once, not a lease later.
#[utoipa::path(post, path = "/api/v1/agent/heartbeat", tag = "agent", security(("worker" = [])),
    request_body = Heartbeat, responses((status = 200, body = HeartbeatResponse)))]
pub async fn heartbeat(
    State(state): State<AppState>,
    agent: AgentAuth,
    ApiJson(beat): ApiJson<Heartbeat>,
) -> Result<ApiJson<HeartbeatResponse>> {
    if beat.jobs.len() > MAX_LISTED {
        return Err(Error::invalid(
            "too_many_jobs",
            format!("jobs: a heartbeat lists at most {MAX_LISTED} jobs, those the worker runs."),
        ));
    }
    let stop = jobs::renew(&state.db, agent.worker_id, &beat.jobs, lease_ttl_ms(&state)).await?;
    for job in jobs::release_unlisted(&state.db, agent.worker_id, &beat.jobs).await? {
        tracing::info!(%job, worker = %agent.worker_id, "a job leased to the worker that it does not run was released");
    }
    let preempt = jobs::preempt_requested(&state.db, agent.worker_id).await?;
    Ok(ApiJson(HeartbeatResponse { stop, preempt }))
}

/// The job kinds a worker may ask for: `slice_rank` is a rank pinned to one of its slices.
const CLAIMABLE: [&str; 6] = ["prefetch", "train", "train_rank", "slice_rank", "profile", "serve"];

/// Lease the oldest queued job of a kind the worker can run; `204` when there is none.
#[utoipa::path(post, path = "/api/v1/agent/claim", tag = "agent", security(("worker" = [])),
    request_body = ClaimRequest, responses((status = 200, body = Assignment), (status = 204, description = "Nothing to do")))]
pub async fn claim(
    State(state): State<AppState>,
    agent: AgentAuth,
    ApiJson(request): ApiJson<ClaimRequest>,
) -> Result<Response> {
    if request.kinds.len() > MAX_LISTED {
        return Err(Error::invalid("invalid_kind", format!("kinds: ask for at most {MAX_LISTED} job kinds.")));
    }
    // Only what a worker runs: a gang's own row (`train_gang`) is the server's to settle.
    if let Some(kind) = request.kinds.iter().find(|k| !CLAIMABLE.contains(&k.as_str())) {
        return Err(Error::invalid(
            "invalid_kind",
            format!("kinds: {kind:?} is not a kind a worker claims; ask for {}.", CLAIMABLE.join(", ")),
        ));
    }
    // A rank of a forming gang first: its gang waits on it. `slice_rank` asks only for a
    // rank pinned to one of the worker's slices (it holds the slice, not a batch slot).
    let asks = |kind: &str| request.kinds.iter().any(|k| k == kind);
    let (any_rank, slice_rank) = (asks("train_rank"), asks("slice_rank"));
    let gang_rank = if any_rank || slice_rank {
        gangs::claim_rank(&state, agent.worker_id, lease_ttl_ms(&state), !any_rank).await?
    } else {
        None
    };
    let kinds: Vec<String> =
        request.kinds.into_iter().filter(|k| k != "train_rank" && k != "slice_rank").collect();
    let free = slices::free_for(&state.db, agent.worker_id).await?;
    let claimed = match gang_rank {
        Some(claimed) => Some(claimed),
        None => jobs::claim(&state.db, agent.worker_id, &kinds, lease_ttl_ms(&state), &free).await?,
    };
    let Some(claimed) = claimed else {
        return Ok(StatusCode::NO_CONTENT.into_response());
    };
    let slice = match slices::bind_claimed(&state.db, agent.worker_id, claimed.job_id, &free).await? {
        slices::Bound::Job(slice) => slice,
        slices::Bound::Gone => return Ok(StatusCode::NO_CONTENT.into_response()),
    };
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

/// Fails unless `worker` holds a live job that `uses` (a model or dataset it asks for).
async fn check_uses(state: &AppState, worker: Uuid, what: &str, uses: impl Fn(&JobSpec) -> bool) -> Result<()> {
    if workers::held_specs(&state.db, worker).await?.iter().any(uses) {
        Ok(())
    } else {
        Err(Error::Forbidden(format!(
            "This worker holds no job that uses {what}; a worker fetches only what the jobs it leases need."
        )))
    }
}

/// Fails unless `worker` holds a job that runs, serves, profiles or trains `model`.
pub async fn check_uses_model(state: &AppState, worker: Uuid, model: Uuid) -> Result<()> {
    check_uses(state, worker, &format!("model {model}"), |spec| spec.model() == Some(model)).await
}

/// Fails unless `worker` holds a training job on `dataset`.
pub async fn check_uses_dataset(state: &AppState, worker: Uuid, dataset: Uuid) -> Result<()> {
    check_uses(state, worker, &format!("dataset {dataset}"), |spec| {
        matches!(spec, JobSpec::Train(train) | JobSpec::TrainRank(RankJob { train, .. }) if train.dataset.id == dataset)
    })
    .await
}

/// The same address, reading an IPv4-mapped IPv6 peer as IPv4, and any loopback as the
/// loopback (a worker on the server's host may say `localhost`, `127.0.0.1` or `::1`).
fn same_host(a: IpAddr, b: IpAddr) -> bool {
    let (a, b) = (a.to_canonical(), b.to_canonical());
    a == b || (a.is_loopback() && b.is_loopback())
}

/// An engine endpoint must be an http(s) URL on the host the worker connects from, so a
/// worker cannot send the gateway (with user traffic and its engine token) elsewhere.
/// `TESSERA_ALLOW_ADVERTISED_ENDPOINTS` lifts the host rule for NAT and proxies. Answers
/// the endpoint to store: an http URL naming a host gets the address that was checked in
/// place of the name, so a name that resolves elsewhere later cannot send the gateway
/// elsewhere. An https one keeps its name, which its certificate must match, and so does
/// one on the server's own loopback (`localhost` may be either of two addresses).
async fn check_endpoint(state: &AppState, peer: IpAddr, endpoint: &str) -> Result<String> {
    let invalid = |why: String| Error::invalid("invalid_endpoint", why);
    // The URL parser drops or escapes some control characters, but the report is stored as sent.
    if endpoint.len() > 2048 || endpoint.chars().any(char::is_control) {
        return Err(invalid("Report an endpoint URL of at most 2048 characters, none a control character.".into()));
    }
    let mut url = reqwest::Url::parse(endpoint)
        .map_err(|e| invalid(format!("The endpoint {endpoint:?} is not a URL ({e}); report http://HOST:PORT.")))?;
    let Some(host) = url.host_str().map(str::to_string) else {
        return Err(invalid(format!("The endpoint {endpoint:?} names no host; report http://HOST:PORT.")));
    };
    if !matches!(url.scheme(), "http" | "https") {
        return Err(invalid(format!("The endpoint {endpoint:?} is not http or https.")));
    }
    if state.config.allow_advertised_endpoints {
        return Ok(endpoint.to_string());
    }
    let port = url.port_or_known_default().unwrap_or(80);
    // An IPv6 host comes bracketed (`[::1]`); a name is resolved as the gateway would.
    let literal = host.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>().ok();
    let addresses: Vec<IpAddr> = match literal {
        Some(ip) => vec![ip],
        None => match tokio::net::lookup_host((host.as_str(), port)).await {
            Ok(found) => found.map(|a| a.ip()).collect(),
            Err(_) => Vec::new(),
        },
    };
    let Some(checked) = addresses.into_iter().find(|a| same_host(*a, peer)) else {
        return Err(invalid(format!(
            "The endpoint {endpoint} is not on this worker's host ({peer}, where it connects from); report a URL on \
             that address, or have the operator start the server with TESSERA_ALLOW_ADVERTISED_ENDPOINTS=true to \
             trust advertised URLs (NAT, proxies)."
        )));
    };
    if literal.is_none() && url.scheme() == "http" && !checked.to_canonical().is_loopback() {
        url.set_ip_host(checked.to_canonical()).expect("an http URL takes an IP host");
        return Ok(url.to_string());
    }
    Ok(endpoint.to_string())
}

/// Report that a leased job started, succeeded, failed or was preempted. A replica's endpoint
/// must be on the worker's own host (see `check_endpoint`). An end or a preemption reported
/// again by the worker that reported it is a 204 again, not a 409.
#[utoipa::path(post, path = "/api/v1/agent/jobs/{id}/status", tag = "agent", security(("worker" = [])),
    params(("id" = Uuid, Path)), request_body = StatusReport,
    responses((status = 204), (status = 409, body = tessera_api::error::ErrorBody),
              (status = 422, body = tessera_api::error::ErrorBody)))]
pub async fn report_status(
    State(state): State<AppState>,
    agent: AgentAuth,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    ApiPath(job): ApiPath<Uuid>,
    ApiJson(report): ApiJson<StatusReport>,
) -> Result<StatusCode> {
    let message = report.message.as_deref().map(storable_text);
    let held = match report.state {
        JobState::Running => {
            let endpoint = match report.endpoint.as_deref() {
                Some(endpoint) => Some(check_endpoint(&state, peer.ip(), endpoint).await?),
                None => None,
            };
            jobs::mark_running(&state.db, agent.worker_id, job, message.as_deref(), endpoint.as_deref()).await?
        }
        // The same end reported again (its answer was lost) is answered as the first was,
        // and settles the gang again in case the first did not get that far.
        JobState::Succeeded | JobState::Failed => {
            jobs::mark_finished(&state.db, agent.worker_id, job, report.state, message.as_deref()).await?
                || jobs::ended_by(&state.db, agent.worker_id, job, report.state).await?
        }
        // Preempting frees the lease, so a repeat is known by who preempted it instead.
        JobState::Preempted => {
            let message = message.as_deref().unwrap_or("Preempted: checkpointed and stopped.");
            let preempted = jobs::mark_preempted(&state.db, agent.worker_id, job, message).await?;
            if !preempted && jobs::holds_lease(&state.db, agent.worker_id, job).await? {
                return Err(Error::Conflict(
                    "Nobody asked this job to preempt; report running, succeeded or failed.".into(),
                ));
            }
            preempted || jobs::preempted_by(&state.db, agent.worker_id, job).await?
        }
        other => {
            return Err(Error::BadRequest(format!(
                "A worker reports running, succeeded, failed or preempted, not {}.",
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

/// Text a worker reports (a process's output, a failure message) as a column can hold it:
/// PostgreSQL refuses a NUL byte in text, so each becomes U+FFFD rather than failing the
/// whole report.
fn storable_text(text: &str) -> String {
    text.replace('\0', "\u{FFFD}")
}

/// Append log lines to a leased job. A batch sent again under the `batch` id it was
/// stored with is not appended again (204 all the same).
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
    let lines: Vec<String> = batch
        .lines
        .iter()
        .map(|line| format!("{prefix}{}", storable_text(&line.chars().take(8192).collect::<String>())))
        .collect();
    jobs::append_batch(&state.db, job, &lines, now_ms(), batch.batch).await?;
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
