//! Job pages: the list filtered by state, one job with its log and metrics (both
//! followed live until the job ends), cancel, and a form to submit a prefetch job.
//! Every action goes through the same functions as the `/api/v1/jobs` routes.

use std::collections::{BTreeMap, HashMap};

use askama::Template;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::Form;
use chrono::{DateTime, Utc};
use serde::Deserialize;
use tessera_api::jobs::{CreateJob, GenericJob, GenericSpec, Job, JobSpec, JobState, MetricPoint};
use tessera_api::train::{TrainModel, TrainingMetrics};
use uuid::Uuid;

use super::pager::{self, PageUrl, Pager, PAGE_SIZE};
use super::{flash, format, precision, render, training, with_status, Layout, WebUser};
use crate::error::{Error, Result};
use crate::state::AppState;
use crate::store::jobs as store;
use crate::training::checkpoints;
use crate::{jobs, registry, workers};

/// The log lines a job page shows: the latest ones, which is what a person follows (the
/// log API pages through longer logs).
const LOG_TAIL: i64 = 1000;

struct JobRow {
    id: String,
    name: String,
    kind: &'static str,
    state: &'static str,
    attempts: u32,
    max_attempts: u32,
    worker: String,
    created_ago: String,
    created_at: String,
    updated_ago: String,
    updated_at: String,
    /// Training jobs: step of max_steps, ETA and best evaluation.
    progress: Option<training::ProgressView>,
}

struct StateTab {
    label: &'static str,
    href: String,
    count: usize,
    active: bool,
}

#[derive(Template)]
#[template(path = "jobs.html")]
struct JobsPage {
    layout: Layout,
    live_url: String,
    tabs: Vec<StateTab>,
    rows: Vec<JobRow>,
    filter: &'static str,
    total: usize,
    pager: Pager,
}

#[derive(Template)]
#[template(path = "jobs.html", block = "table")]
struct JobsTable {
    tabs: Vec<StateTab>,
    rows: Vec<JobRow>,
    filter: &'static str,
    total: usize,
    pager: Pager,
}

#[derive(Debug, Default, Deserialize)]
pub struct ListQuery {
    state: Option<String>,
    /// The last job of the previous page.
    before: Option<String>,
    fragment: Option<String>,
}

pub(super) async fn worker_names(state: &AppState) -> Result<HashMap<Uuid, String>> {
    Ok(workers::list_all(state, &crate::store::Scope::all()).await?.into_iter().map(|w| (w.id, w.name)).collect())
}

pub async fn list(State(state): State<AppState>, user: WebUser, Query(query): Query<ListQuery>) -> Response {
    let result = async {
        // The page's tabs link "all" too.
        let wanted = jobs::list_filter(query.state.as_deref().filter(|s| *s != "all"), None)?;
        let before = pager::before(query.before.as_deref(), "job")?;
        let scope = user.0.scope();
        let counts = store::count_by_state(&state.db, &scope).await?;
        let count = |s: JobState| counts.iter().find(|(c, _)| *c == s).map_or(0, |(_, n)| *n as usize);
        let total = counts.iter().map(|(_, n)| *n as usize).sum();
        let page = jobs::page(&state.db, &scope, wanted, before, PAGE_SIZE).await?;
        let names = worker_names(&state).await?;
        let now = Utc::now();
        let filter = wanted.state;
        let mut tabs = vec![StateTab { label: "all", href: "/jobs".into(), count: total, active: filter.is_none() }];
        tabs.extend(JobState::ALL.into_iter().map(|s| StateTab {
            label: s.as_str(),
            href: format!("/jobs?state={}", s.as_str()),
            count: count(s),
            active: filter == Some(s),
        }));
        let mut rows = Vec::with_capacity(page.rows.len());
        for job in &page.rows {
            rows.push(JobRow {
                id: job.id.to_string(),
                name: job.name.clone(),
                kind: job.spec.kind(),
                state: job.state.as_str(),
                attempts: job.attempts,
                max_attempts: job.max_attempts,
                worker: job.worker_id.map(|id| worker_label(&names, id)).unwrap_or_default(),
                created_ago: format::ago(job.created_at, now),
                created_at: format::instant(job.created_at),
                updated_ago: format::ago(job.updated_at, now),
                updated_at: format::instant(job.updated_at),
                progress: training::progress(&state, job).await?,
            });
        }
        let in_state = filter.map(|s| format!("state={}", s.as_str())).unwrap_or_default();
        let url = PageUrl { path: "/jobs", filter: &in_state };
        let pager = Pager::new(&url, before, &page, |job| job.id, "job");
        let filter_name = filter.map(JobState::as_str).unwrap_or("");
        if query.fragment.is_some() {
            let table = JobsTable { tabs, rows, filter: filter_name, total, pager };
            return Ok(render(&table)?.into_response());
        }
        let page = JobsPage {
            layout: user.layout("Jobs", "jobs"),
            // The live refresh re-reads the page the person is on.
            live_url: url.at(before, "fragment=table"),
            tabs,
            rows,
            filter: filter_name,
            total,
            pager,
        };
        Ok(render(&page)?.into_response())
    }
    .await;
    user.page(result)
}

pub(super) fn worker_label(names: &HashMap<Uuid, String>, id: Uuid) -> String {
    names.get(&id).cloned().unwrap_or_else(|| id.to_string()[..8].to_string())
}

struct Timing {
    label: &'static str,
    value: String,
    detail: String,
}

struct LogView {
    seq: i64,
    at: String,
    line: String,
}

struct MetricView {
    name: String,
    step: i64,
    value: String,
}

/// One metric at a glance: its latest value, range and shape over the steps.
struct MetricSeries {
    name: String,
    count: usize,
    last: String,
    min: String,
    max: String,
    sparkline: String,
}

/// Points per metric the summary reads (downsampled: a long training run has 100k).
const SUMMARY_POINTS: usize = 400;

/// The rows of a metrics report as points ordered by name, then step.
fn metric_points(recorded: &TrainingMetrics) -> Vec<MetricPoint> {
    let mut points: Vec<MetricPoint> = recorded
        .steps
        .iter()
        .chain(&recorded.evals)
        .flat_map(|row| {
            row.values.iter().map(|(name, value)| MetricPoint {
                name: name.clone(),
                step: row.step as i64,
                value: *value,
                at: None,
            })
        })
        .collect();
    points.sort_by(|a, b| a.name.cmp(&b.name).then(a.step.cmp(&b.step)));
    points
}

/// Groups points (ordered by name, then step) into one series per metric, each counting
/// the points it has in all (`counts`; those shown may be a downsampled few).
fn series(points: &[MetricPoint], counts: &BTreeMap<String, usize>) -> Vec<MetricSeries> {
    points
        .chunk_by(|a, b| a.name == b.name)
        .map(|run| {
            let values: Vec<f64> = run.iter().map(|p| p.value).collect();
            let min = values.iter().copied().fold(f64::INFINITY, f64::min);
            let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            MetricSeries {
                name: run[0].name.clone(),
                count: counts.get(&run[0].name).copied().unwrap_or(run.len()),
                last: format::number(values[values.len() - 1]),
                min: format::number(min),
                max: format::number(max),
                sparkline: format::sparkline(&values),
            }
        })
        .collect()
}

struct JobView {
    id: String,
    name: String,
    owner: String,
    kind: &'static str,
    state: &'static str,
    terminal: bool,
    message: Option<String>,
    /// What the job works on, e.g. the model a prefetch fetches.
    target_label: String,
    target_href: Option<String>,
    /// A serving replica's deployment, which scales it (it is not cancelled on its own).
    deployment_href: Option<String>,
    attempts: u32,
    max_attempts: u32,
    worker: Option<String>,
    timings: Vec<Timing>,
    logs: Vec<LogView>,
    logs_skipped: u64,
    series: Vec<MetricSeries>,
    /// The points shown (each metric downsampled to at most [`SUMMARY_POINTS`]) and all.
    metrics: Vec<MetricView>,
    metrics_total: usize,
    /// A refused action (cancelling an ended job) shown above the details.
    alert: Option<String>,
    /// Training jobs: progress, checkpoints and the AutoLRS panel.
    training: Option<training::TrainingView>,
    /// Data-parallel jobs with a precision plan: the QSync panel.
    precision: Option<precision::PlanView>,
}

#[derive(Template)]
#[template(path = "job.html")]
struct JobPage {
    layout: Layout,
    notice: Option<String>,
    job: JobView,
}

/// A job's page with the notice a form left for it, or the reason `alert` a form on it
/// was refused.
async fn job_page(
    state: &AppState,
    user: &WebUser,
    job: Job,
    notice: Option<String>,
    alert: Option<String>,
) -> Result<JobPage> {
    let layout = user.layout(job.name.clone(), "jobs");
    let mut view = job_view(state, user, job).await?;
    view.alert = alert;
    Ok(JobPage { layout, notice, job: view })
}

#[derive(Template)]
#[template(path = "job.html", block = "detail")]
struct JobFragment {
    job: JobView,
}

fn timing(label: &'static str, at: Option<DateTime<Utc>>, now: DateTime<Utc>) -> Option<Timing> {
    at.map(|at| Timing { label, value: format::ago(at, now), detail: format::instant(at) })
}

async fn job_view(state: &AppState, user: &WebUser, job: Job) -> Result<JobView> {
    let now = Utc::now();
    let (model, purpose) = match &job.spec {
        JobSpec::Prefetch { model } => (Some(*model), String::new()),
        JobSpec::Profile { model, .. } => (Some(*model), " (profiled)".to_string()),
        JobSpec::Serve { model, deployment, .. } => {
            (Some(*model), format!(" for deployment {}", &deployment.to_string()[..8]))
        }
        JobSpec::Train(train) => match &train.model {
            TrainModel::Registered { id, .. } => (Some(*id), " (fine-tuned)".to_string()),
            TrainModel::Mlp { hidden } => (None, format!("MLP {hidden:?}")),
        },
        JobSpec::TrainRank(rank) => {
            let purpose = format!(" (rank {} of {} of job {})", rank.rank, rank.world, &rank.gang.to_string()[..8]);
            match &rank.train.model {
                TrainModel::Registered { id, .. } => (Some(*id), purpose),
                TrainModel::Mlp { hidden } => (None, format!("MLP {hidden:?}{purpose}")),
            }
        }
    };
    let (target_label, target_href) = match model {
        None => (purpose, None),
        Some(model) => match registry::resolve(state, &user.0, &model.to_string()).await {
            Ok(found) => (format!("model {}{purpose}", found.name), Some(format!("/models/{}", found.id))),
            Err(Error::NotFound(_)) => (format!("model {model} (deleted){purpose}"), None),
            Err(error) => return Err(error),
        },
    };
    let worker = match job.worker_id {
        Some(id) => Some(worker_label(&worker_names(state).await?, id)),
        // A data-parallel job runs on its ranks' workers; the job itself is never leased.
        None => {
            let held: Vec<(u32, Uuid)> = crate::gangs::rank_workers(&state.db, job.id)
                .await?
                .into_iter()
                .filter_map(|(rank, worker)| worker.map(|w| (rank, w)))
                .collect();
            if held.is_empty() {
                None
            } else {
                let names = worker_names(state).await?;
                let ranks: Vec<String> =
                    held.iter().map(|(rank, id)| format!("rank {rank}: {}", worker_label(&names, *id))).collect();
                Some(ranks.join(" · "))
            }
        }
    };
    let mut timings: Vec<Timing> = [
        timing("Created", Some(job.created_at), now),
        timing("Started", job.started_at, now),
        timing("Finished", job.finished_at, now),
        timing("Updated", Some(job.updated_at), now),
    ]
    .into_iter()
    .flatten()
    .collect();
    if let Some(started) = job.started_at {
        let end = job.finished_at.unwrap_or(now);
        let detail = if job.finished_at.is_some() { "start to finish" } else { "so far" };
        timings.push(Timing { label: "Run time", value: format::elapsed(started, end), detail: detail.into() });
    }
    if !job.state.is_terminal() {
        if let Some(expiry) = job.lease_expires_at {
            timings.push(Timing {
                label: "Lease expires",
                value: format::ago(expiry, now),
                detail: format::instant(expiry),
            });
        }
    }
    let (lines, logs_skipped) = store::log_tail(&state.db, job.id, LOG_TAIL).await?;
    let logs = lines
        .into_iter()
        .map(|l| LogView { seq: l.seq, at: l.at.format("%H:%M:%S").to_string(), line: l.line })
        .collect();
    let (recorded, counts) = crate::training::metrics::read_counted(&state.db, job.id, Some(SUMMARY_POINTS)).await?;
    let points = metric_points(&recorded);
    let series = series(&points, &counts);
    let metrics_total = counts.values().sum();
    let metrics = points
        .into_iter()
        .map(|p| MetricView { name: p.name, step: p.step, value: format::number(p.value) })
        .collect();
    let training = training::view(state, &job).await?;
    let precision = precision::view(state, &job).await?;
    Ok(JobView {
        training,
        precision,
        id: job.id.to_string(),
        name: job.name,
        owner: job.owner,
        kind: job.spec.kind(),
        state: job.state.as_str(),
        terminal: job.state.is_terminal(),
        message: job.message,
        target_label,
        target_href,
        deployment_href: match &job.spec {
            JobSpec::Serve { deployment, .. } => Some(format!("/deployments/{deployment}")),
            _ => None,
        },
        attempts: job.attempts,
        max_attempts: job.max_attempts,
        worker,
        timings,
        logs,
        logs_skipped,
        series,
        metrics,
        metrics_total,
        alert: None,
    })
}

fn parse_id(id: &str) -> Result<Uuid> {
    id.parse().map_err(|_| Error::not_found("Job"))
}

#[derive(Debug, Default, Deserialize)]
pub struct DetailQuery {
    fragment: Option<String>,
}

pub async fn detail(
    State(state): State<AppState>,
    user: WebUser,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(query): Query<DetailQuery>,
) -> Response {
    let result = async {
        let job = jobs::find(&state.db, &user.0.scope(), parse_id(&id)?).await?;
        if query.fragment.is_some() {
            return Ok(render(&JobFragment { job: job_view(&state, &user, job).await? })?.into_response());
        }
        Ok(render(&job_page(&state, &user, job, flash::notice(&headers), None).await?)?.into_response())
    }
    .await;
    flash::shown(user.page(result), &headers)
}

pub async fn cancel(State(state): State<AppState>, user: WebUser, Path(id): Path<String>) -> Response {
    let result = async {
        let id = parse_id(&id)?;
        match jobs::cancel_job(&state.db, &user.0, id).await {
            Ok(_) => Ok(Redirect::to(&format!("/jobs/{id}")).into_response()),
            // Already ended: show the job as it is now, with the reason.
            Err(error @ Error::Conflict(_)) => {
                let job = jobs::find(&state.db, &user.0.scope(), id).await?;
                let page = job_page(&state, &user, job, None, Some(error.public_message())).await?;
                with_status(StatusCode::CONFLICT, render(&page))
            }
            Err(error) => Err(error),
        }
    }
    .await;
    user.page(result)
}

/// Deletes an ended job's checkpoints (the button under its checkpoint table); a job that
/// may still resume from them keeps them and its page says why.
pub async fn delete_checkpoints(
    State(state): State<AppState>,
    user: WebUser,
    Path(id): Path<String>,
) -> Response {
    let result = async {
        let job = jobs::find(&state.db, &user.0.scope(), parse_id(&id)?).await?;
        match checkpoints::delete_ended(&state, &job).await {
            Ok(deleted) => {
                let plural = if deleted == 1 { "" } else { "s" };
                let notice = format!("Deleted {deleted} checkpoint{plural} of '{}'.", job.name);
                Ok(flash::redirect(&format!("/jobs/{}", job.id), &notice))
            }
            Err(error @ Error::Conflict(_)) => {
                let page = job_page(&state, &user, job, None, Some(error.public_message())).await?;
                with_status(StatusCode::CONFLICT, render(&page))
            }
            Err(error) => Err(error),
        }
    }
    .await;
    user.page(result)
}

struct ModelOption {
    id: String,
    name: String,
    selected: bool,
}

#[derive(Template)]
#[template(path = "job_new.html")]
struct NewJobPage {
    layout: Layout,
    models: Vec<ModelOption>,
    name: String,
    max_attempts: String,
    error: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
pub struct NewJobForm {
    #[serde(default)]
    name: String,
    #[serde(default)]
    model: String,
    #[serde(default)]
    max_attempts: String,
}

async fn new_job_page(state: &AppState, user: &WebUser, form: NewJobForm, error: Option<String>) -> Result<NewJobPage> {
    let models = registry::newest(state, &user.0.scope())
        .await?
        .into_iter()
        .map(|m| ModelOption { selected: form.model == m.id.to_string(), id: m.id.to_string(), name: m.name })
        .collect();
    Ok(NewJobPage {
        layout: user.layout("New job", "jobs"),
        models,
        name: form.name,
        max_attempts: if form.max_attempts.is_empty() { "3".into() } else { form.max_attempts },
        error,
    })
}

pub async fn new_form(State(state): State<AppState>, user: WebUser, Query(form): Query<NewJobForm>) -> Response {
    let result = async { Ok(render(&new_job_page(&state, &user, form, None).await?)?.into_response()) }.await;
    user.page(result)
}

pub async fn create(State(state): State<AppState>, user: WebUser, Form(form): Form<NewJobForm>) -> Response {
    let result = async {
        match submit(&state, &user, &form).await {
            Ok(job) => Ok(Redirect::to(&format!("/jobs/{}", job.id)).into_response()),
            Err(error) if error.status().is_client_error() => {
                let status = error.status();
                let page = new_job_page(&state, &user, form, Some(error.public_message())).await?;
                with_status(status, render(&page))
            }
            Err(error) => Err(error),
        }
    }
    .await;
    user.page(result)
}

async fn submit(state: &AppState, user: &WebUser, form: &NewJobForm) -> Result<Job> {
    if form.model.is_empty() {
        return Err(Error::invalid("invalid_spec", "Pick the model to prefetch; upload one on the Models page first."));
    }
    let max_attempts =
        match form.max_attempts.trim() {
            "" => None,
            text => Some(text.parse::<u32>().map_err(|_| {
                Error::invalid("invalid_spec", "Max attempts must be a whole number between 1 and 100.")
            })?),
        };
    let name = match form.name.trim() {
        "" => {
            let model = registry::resolve(state, &user.0, &form.model).await?;
            format!("prefetch {}", model.name)
        }
        name => name.to_string(),
    };
    let request = CreateJob::Generic(GenericJob {
        name,
        spec: GenericSpec::Prefetch { model: form.model.clone() },
        max_attempts,
    });
    let id = jobs::submit(state, &user.0, request).await?;
    let job = jobs::find(&state.db, &user.0.scope(), id).await?;
    tracing::info!(job = %job.id, user = %user.0.username, "job submitted from the dashboard");
    Ok(job)
}
