//! Training views: progress with ETA and best metric (job list and job page), the job
//! page's checkpoints and AutoLRS panel, the JSON the charts read (cookie-authenticated,
//! downsampled server-side), and the compare page. Charts are drawn by web/train.js.

use askama::Template;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use chrono::Utc;
use serde::Deserialize;
use tessera_api::jobs::{Job, JobSpec};
use tessera_api::train::{CandidateScore, LrCandidate, LrSchedule, LrStage, LrStageRecord, TrainingMetrics};
use uuid::Uuid;

use super::{format, render, Layout, WebUser};
use crate::error::{ApiJson, Error, Result};
use crate::jobs;
use crate::state::AppState;
use crate::store::training::best_eval as best_of;
use crate::training::{checkpoints, lr_stages, metrics};

/// Progress of a training job as the list and the job page show it.
pub struct ProgressView {
    pub percent: u32,
    pub label: String,
    /// Time left at the rate so far, or empty when it cannot be told.
    pub eta: String,
    /// The best evaluation so far, e.g. `accuracy 0.9412 @ 2400`.
    pub best: String,
}

/// `None` for jobs that are not training jobs.
pub async fn progress(state: &AppState, job: &Job) -> Result<Option<ProgressView>> {
    let Some(progress) = &job.progress else {
        return Ok(None);
    };
    let fraction = (progress.step as f64 / progress.max_steps.max(1) as f64).min(1.0);
    let eta = match (job.started_at, job.state.is_terminal()) {
        (Some(started), false) if progress.step > 0 => {
            let elapsed = (Utc::now() - started).num_seconds().max(0) as f64;
            let left = elapsed / progress.step as f64 * progress.max_steps.saturating_sub(progress.step) as f64;
            format!("{} left", format::span(left as i64))
        }
        _ => String::new(),
    };
    Ok(Some(ProgressView {
        percent: (fraction * 100.0).round() as u32,
        label: format!("{} / {}", progress.step, progress.max_steps),
        eta,
        best: best_eval(state, job.id).await?,
    }))
}

/// Highest accuracy if the job reports one, else lowest validation loss.
async fn best_eval(state: &AppState, job: Uuid) -> Result<String> {
    for (name, highest) in [("accuracy", true), ("val_loss", false)] {
        if let Some((step, value)) = best_of(&state.db, job, name, highest).await? {
            return Ok(format!("{name} {} @ {step}", format::number(value)));
        }
    }
    Ok(String::new())
}

pub struct CheckpointRow {
    pub step: u64,
    pub size: String,
    pub created_ago: String,
    pub files: Vec<(String, String)>,
}

pub struct CandidateRow {
    pub lr: String,
    pub forecast: String,
    pub observed: String,
    pub chosen: bool,
    /// `forecast`, `observed` (the forecast was not credible) or `failed`.
    pub scored_by: &'static str,
    /// Why the forecast was not used or the candidate failed (empty when credible).
    pub note: String,
    /// An exploitation at this LR diverged and was abandoned.
    pub abandoned: bool,
}

/// An exploitation abandoned for divergence, as the stage panel lists it.
pub struct FallbackRow {
    pub lr: String,
    pub at_step: u64,
    pub steps: u64,
    pub reason: String,
}

pub struct StageRow {
    pub stage: u32,
    pub start_step: u64,
    pub tau_prime: u64,
    pub tau: u64,
    pub metric: String,
    pub chosen_lr: String,
    pub after: String,
    /// Loss after τ minus the chosen candidate's score.
    pub forecast_error: String,
    pub candidates: Vec<CandidateRow>,
    pub fallbacks: Vec<FallbackRow>,
    /// Why the run ended on this stage's snapshot (empty if it did not).
    pub run_end: String,
    /// An inline SVG plot: forecast (circles) vs observed (squares) loss over log-LR.
    pub plot: String,
}

/// What the job page adds for a training job.
pub struct TrainingView {
    pub progress: ProgressView,
    pub schedule: String,
    pub autolrs: bool,
    pub checkpoints: Vec<CheckpointRow>,
    pub stages: Vec<StageRow>,
}

fn describe(schedule: &LrSchedule) -> String {
    match schedule {
        LrSchedule::Constant { lr } => format!("constant lr {lr}"),
        LrSchedule::Step { lr, step_size, gamma } => format!("step: lr {lr} × {gamma} every {step_size} steps"),
        LrSchedule::Linear { lr, warmup_steps } => format!("linear: lr {lr} → 0, {warmup_steps} warm-up steps"),
        LrSchedule::Cosine { lr, warmup_steps, min_lr } => {
            format!("cosine: lr {lr} → {min_lr}, {warmup_steps} warm-up steps")
        }
        LrSchedule::Onecycle { max_lr, pct_start, .. } => format!("one-cycle: max lr {max_lr}, peak at {pct_start}"),
        LrSchedule::Autolrs { min_lr, max_lr, tau_prime, tau, k, tau_max } => {
            format!("AutoLRS over [{min_lr}, {max_lr}]: k = {k}, τ' = {tau_prime}, τ = {tau}, τ_max = {tau_max}")
        }
    }
}

fn candidate_row(c: &LrCandidate, record: &LrStageRecord) -> CandidateRow {
    CandidateRow {
        lr: format::number(c.lr),
        forecast: optional(c.forecast_loss),
        observed: optional(c.observed_loss),
        chosen: c.lr == record.chosen_lr,
        scored_by: match c.scored_by {
            CandidateScore::Forecast => "forecast",
            CandidateScore::Observed => "observed",
            CandidateScore::Failed => "failed",
        },
        note: c.note.clone().unwrap_or_default(),
        abandoned: record.fallbacks.iter().any(|f| f.lr == c.lr),
    }
}

fn optional(value: Option<f64>) -> String {
    value.map(format::number).unwrap_or_else(|| "—".into())
}

/// Forecast vs observed loss of one stage's candidates, x = log10(lr).
fn stage_plot(stage: &LrStage) -> String {
    let (w, h, pad) = (220.0, 90.0, 8.0);
    let points: Vec<(f64, Option<f64>, Option<f64>)> =
        stage.record.candidates.iter().map(|c| (c.lr.log10(), c.forecast_loss, c.observed_loss)).collect();
    let ys: Vec<f64> = points.iter().flat_map(|p| [p.1, p.2]).flatten().filter(|v| v.is_finite()).collect();
    if ys.is_empty() {
        return String::new();
    }
    let (x0, x1) = points.iter().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let (y0, y1) = ys.iter().fold((f64::MAX, f64::MIN), |(a, b), v| (a.min(*v), b.max(*v)));
    let sx = |x: f64| pad + if x1 > x0 { (x - x0) / (x1 - x0) * (w - 2.0 * pad) } else { (w - 2.0 * pad) / 2.0 };
    let sy = |y: f64| h - pad - if y1 > y0 { (y - y0) / (y1 - y0) * (h - 2.0 * pad) } else { (h - 2.0 * pad) / 2.0 };
    let chosen = stage.record.chosen_lr.log10();
    let mut svg = format!(
        "<svg class=\"stage-plot\" viewBox=\"0 0 {w} {h}\" role=\"img\" aria-label=\"Stage {} candidates\">\
         <line class=\"chosen\" x1=\"{x:.1}\" x2=\"{x:.1}\" y1=\"0\" y2=\"{h}\"/>",
        stage.record.stage,
        x = sx(chosen)
    );
    for (x, forecast, observed) in &points {
        if let (Some(f), Some(o)) = (forecast, observed) {
            svg.push_str(&format!(
                "<line class=\"gap\" x1=\"{x:.1}\" x2=\"{x:.1}\" y1=\"{:.1}\" y2=\"{:.1}\"/>",
                sy(*f),
                sy(*o),
                x = sx(*x)
            ));
        }
        if let Some(f) = forecast {
            svg.push_str(&format!("<circle class=\"forecast\" cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\"/>", sx(*x), sy(*f)));
        }
        if let Some(o) = observed {
            svg.push_str(&format!(
                "<rect class=\"observed\" x=\"{:.1}\" y=\"{:.1}\" width=\"5\" height=\"5\"/>",
                sx(*x) - 2.5,
                sy(*o) - 2.5
            ));
        }
    }
    svg.push_str("</svg>");
    svg
}

pub async fn view(state: &AppState, job: &Job) -> Result<Option<TrainingView>> {
    let JobSpec::Train(train) = &job.spec else {
        return Ok(None);
    };
    let progress = progress(state, job).await?.expect("training jobs have progress");
    let now = Utc::now();
    let checkpoints = checkpoints::list(state, job.id)
        .await?
        .into_iter()
        .rev()
        .map(|c| CheckpointRow {
            step: c.step,
            size: format::bytes(c.size_bytes),
            created_ago: format::ago(c.created_at, now),
            files: c
                .files
                .iter()
                .map(|f| (f.name.clone(), format!("/jobs/{}/checkpoints/{}/files/{}", job.id, c.step, f.name)))
                .collect(),
        })
        .collect();
    let stages = lr_stages::read(&state.db, job.id)
        .await?
        .iter()
        .map(|s| StageRow {
            stage: s.record.stage,
            start_step: s.record.start_step,
            tau_prime: s.record.tau_prime,
            tau: s.record.tau,
            metric: s.record.metric.clone(),
            chosen_lr: format::number(s.record.chosen_lr),
            after: optional(s.record.observed_loss_after_tau),
            forecast_error: optional(s.record.forecast_error),
            candidates: s.record.candidates.iter().map(|c| candidate_row(c, &s.record)).collect(),
            fallbacks: s
                .record
                .fallbacks
                .iter()
                .map(|f| FallbackRow {
                    lr: format::number(f.lr),
                    at_step: f.at_step,
                    steps: f.steps,
                    reason: f.reason.clone(),
                })
                .collect(),
            run_end: s.record.run_end.clone().unwrap_or_default(),
            plot: stage_plot(s),
        })
        .collect();
    Ok(Some(TrainingView {
        progress,
        schedule: describe(&train.lr_schedule),
        autolrs: matches!(train.lr_schedule, LrSchedule::Autolrs { .. }),
        checkpoints,
        stages,
    }))
}

#[derive(Debug, Deserialize)]
pub struct SeriesQuery {
    max_points: Option<usize>,
}

/// `GET /jobs/{id}/series`: the API's metrics for the charts, with the session cookie.
pub async fn series(
    State(state): State<AppState>,
    user: WebUser,
    Path(id): Path<String>,
    Query(query): Query<SeriesQuery>,
) -> Result<ApiJson<TrainingMetrics>> {
    let id: Uuid = id.parse().map_err(|_| Error::not_found("Job"))?;
    jobs::find(&state.db, &user.0.scope(), id).await?;
    let max_points = query.max_points.unwrap_or(1000).clamp(4, 20_000);
    Ok(ApiJson(metrics::read(&state.db, id, Some(max_points)).await?))
}

/// `GET /jobs/{id}/checkpoints/{step}/files/{name}`: a checkpoint download from the page.
pub async fn checkpoint_file(
    State(state): State<AppState>,
    user: WebUser,
    Path((id, step, name)): Path<(String, u64, String)>,
) -> Response {
    let result = async {
        let id: Uuid = id.parse().map_err(|_| Error::not_found("Job"))?;
        jobs::find(&state.db, &user.0.scope(), id).await?;
        checkpoints::file_response(&state, id, step, &name).await
    }
    .await;
    user.page(result)
}

struct CompareRow {
    id: String,
    name: String,
    state: &'static str,
    schedule: String,
    checked: bool,
}

#[derive(Template)]
#[template(path = "compare.html")]
struct ComparePage {
    layout: Layout,
    rows: Vec<CompareRow>,
    /// Comma-separated ids of the jobs to draw, for the script.
    selected: String,
}

/// Jobs older than the newest 500 training jobs a compare link may bring in.
const MAX_LINKED: usize = 50;

#[derive(Debug, Default, Deserialize)]
pub struct CompareQuery {
    /// Comma-separated job ids.
    #[serde(default)]
    ids: String,
}

/// `GET /jobs/compare?ids=a,b`: several training jobs' curves on one chart.
pub async fn compare(State(state): State<AppState>, user: WebUser, Query(query): Query<CompareQuery>) -> Response {
    let result = async {
        let wanted: Vec<&str> = query.ids.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
        let scope = user.0.scope();
        let mut jobs = crate::store::jobs::newest_training(&state.db, &scope).await?;
        // A job the link asks for stays pickable however many jobs came after it.
        for id in wanted.iter().filter_map(|id| id.parse::<Uuid>().ok()).take(MAX_LINKED) {
            if !jobs.iter().any(|job| job.id == id) {
                jobs.extend(crate::store::jobs::get(&state.db, &scope, id).await?);
            }
        }
        let rows: Vec<CompareRow> = jobs
            .into_iter()
            .filter_map(|job| match &job.spec {
                JobSpec::Train(train) => Some(CompareRow {
                    checked: wanted.contains(&job.id.to_string().as_str()),
                    id: job.id.to_string(),
                    name: job.name.clone(),
                    state: job.state.as_str(),
                    schedule: train.lr_schedule.kind().to_string(),
                }),
                _ => None,
            })
            .collect();
        let selected = rows.iter().filter(|r| r.checked).map(|r| r.id.clone()).collect::<Vec<_>>().join(",");
        Ok(render(&ComparePage { layout: user.layout("Compare runs", "jobs"), rows, selected })?.into_response())
    }
    .await;
    user.page(result)
}
