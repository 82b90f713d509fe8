//! Deployment pages: the list with a form to serve a model under a name, and one
//! deployment with its replicas and live traffic (request rate, latency percentiles,
//! batch size and tokens per batch, from the gateway's rolling window), scaling and
//! deleting. Every action goes through the same functions as `/api/v1/deployments`.

use askama::Template;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect, Response};
use axum::Form;
use chrono::Utc;
use serde::Deserialize;
use tessera_api::deployments::{
    check_reclaim_headroom, BatchLimits, CreateDeployment, Deployment, DeploymentStats, Percentiles, UpdateDeployment,
    MAX_RECLAIM_HEADROOM,
};

use super::chart::{chart, Chart};
use super::jobs::{worker_label, worker_names};
use super::{format, render, with_status, Layout, WebUser};
use crate::error::{Error, Result};
use crate::state::AppState;
use crate::{deployments, registry};

fn per_second(value: f64) -> String {
    if value >= 100.0 {
        format!("{value:.0}")
    } else {
        format!("{value:.2}").trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

fn millis(value: f64) -> String {
    if value >= 100.0 {
        format!("{value:.0}")
    } else {
        format!("{value:.1}")
    }
}

fn count(value: f64) -> String {
    if value >= 10.0 {
        format!("{value:.0}")
    } else {
        format!("{value:.1}")
    }
}

struct DeploymentRow {
    id: String,
    name: String,
    model: String,
    model_href: String,
    ready: u32,
    wanted: u32,
    state: &'static str,
    reason: Option<String>,
    request_rate: String,
}

struct ModelChoice {
    id: String,
    name: String,
    selected: bool,
}

#[derive(Debug, Default, Deserialize)]
pub struct CreateForm {
    #[serde(default)]
    name: String,
    #[serde(default)]
    model: String,
    #[serde(default)]
    replicas: String,
    #[serde(default)]
    max_batch_tokens: String,
    #[serde(default)]
    max_batch_requests: String,
    /// The checkbox: present ("on") when ticked.
    #[serde(default)]
    loanable: Option<String>,
    /// Headroom in percent above the measured rate.
    #[serde(default)]
    headroom_percent: String,
}

/// A headroom given in percent on a form, as the API's fraction (`None` when left empty).
/// Its range is checked here too, so a refusal speaks of percent as the form does.
fn headroom(text: &str) -> Result<Option<f64>> {
    let refused = || {
        let most = MAX_RECLAIM_HEADROOM * 100.0;
        let sentence = format!("The headroom is a percentage from 0 to {most} (20 keeps 20% above the measured rate).");
        Error::invalid("invalid_reclaim_headroom", sentence)
    };
    match text.trim() {
        "" => Ok(None),
        text => {
            let fraction = text.parse::<f64>().map_err(|_| refused())? / 100.0;
            check_reclaim_headroom(fraction).map_err(|_| refused())?;
            Ok(Some(fraction))
        }
    }
}

#[derive(Template)]
#[template(path = "deployments.html")]
struct DeploymentsPage {
    layout: Layout,
    rows: Vec<DeploymentRow>,
    models: Vec<ModelChoice>,
    form: CreateForm,
    error: Option<String>,
}

#[derive(Template)]
#[template(path = "deployments.html", block = "table")]
struct DeploymentsTable {
    rows: Vec<DeploymentRow>,
}

async fn rows(state: &AppState, user: &WebUser) -> Result<Vec<DeploymentRow>> {
    let list = deployments::list_visible(&state.db, &user.0.scope()).await?;
    Ok(list
        .iter()
        .map(|d| DeploymentRow {
            id: d.id.to_string(),
            name: d.name.clone(),
            model: d.model_name.clone(),
            model_href: format!("/models/{}", d.model_id),
            ready: d.ready_replicas,
            wanted: d.replicas,
            state: d.state.as_str(),
            reason: d.reason.clone(),
            request_rate: per_second(state.gateway.stats.request_rate(d.id)),
        })
        .collect())
}

async fn list_page(state: &AppState, user: &WebUser, form: CreateForm, error: Option<String>) -> Result<DeploymentsPage> {
    let models = registry::newest(state, &user.0.scope())
        .await?
        .into_iter()
        .map(|m| ModelChoice { selected: form.model == m.id.to_string(), id: m.id.to_string(), name: m.name })
        .collect();
    let form = CreateForm { replicas: if form.replicas.is_empty() { "1".into() } else { form.replicas }, ..form };
    Ok(DeploymentsPage { layout: user.layout("Deployments", "deployments"), rows: rows(state, user).await?, models, form, error })
}

#[derive(Debug, Default, Deserialize)]
pub struct FragmentQuery {
    fragment: Option<String>,
}

pub async fn list(State(state): State<AppState>, user: WebUser, Query(query): Query<FragmentQuery>) -> Response {
    let result = async {
        if query.fragment.is_some() {
            return Ok(render(&DeploymentsTable { rows: rows(&state, &user).await? })?.into_response());
        }
        Ok(render(&list_page(&state, &user, CreateForm::default(), None).await?)?.into_response())
    }
    .await;
    user.page(result)
}

/// A whole number from a form field, or a 422 naming the field.
fn number(text: &str, field: &str, code: &'static str, range: &str) -> Result<Option<u32>> {
    match text.trim() {
        "" => Ok(None),
        text => text.parse().map(Some).map_err(|_| Error::invalid(code, format!("{field} must be a whole number {range}."))),
    }
}

pub async fn create(State(state): State<AppState>, user: WebUser, Form(form): Form<CreateForm>) -> Response {
    let result = async {
        let submitted = async {
            if form.model.is_empty() {
                return Err(Error::invalid("invalid_model", "Pick the model to serve; upload one on the Models page first."));
            }
            let replicas = number(&form.replicas, "replicas", "invalid_replicas", "between 0 and 64")?.unwrap_or(1);
            // A field left empty takes the API body's default.
            let defaults = BatchLimits::default();
            let limits = BatchLimits {
                max_batch_tokens: number(&form.max_batch_tokens, "max_batch_tokens", "invalid_batching", "between 512 and 1048576")?
                    .unwrap_or(defaults.max_batch_tokens),
                max_batch_requests: number(&form.max_batch_requests, "max_batch_requests", "invalid_batching", "between 1 and 4096")?
                    .unwrap_or(defaults.max_batch_requests),
            };
            let request = CreateDeployment {
                name: form.name.clone(),
                model: form.model.clone(),
                replicas,
                limits,
                throughput: None,
                latency_ms: None,
                loanable: form.loanable.is_some(),
                reclaim_headroom: if form.loanable.is_some() { headroom(&form.headroom_percent)? } else { None },
            };
            deployments::create(&state, &user.0, request).await
        };
        match submitted.await {
            Ok(deployment) => {
                tracing::info!(deployment = %deployment.id, user = %user.0.username, "deployment created from the dashboard");
                Ok(Redirect::to(&format!("/deployments/{}", deployment.id)).into_response())
            }
            Err(error) if error.status().is_client_error() => {
                let status = error.status();
                with_status(status, render(&list_page(&state, &user, form, Some(error.public_message())).await?))
            }
            Err(error) => Err(error),
        }
    }
    .await;
    user.page(result)
}

struct ReplicaRow {
    id: String,
    short_id: String,
    worker: Option<String>,
    state: &'static str,
    endpoint: Option<String>,
    message: Option<String>,
    attempts: u32,
    updated_ago: String,
    updated_at: String,
}

/// A headline figure above the charts.
struct Figure {
    label: &'static str,
    value: String,
    detail: String,
}

struct DeploymentView {
    id: String,
    name: String,
    model: String,
    model_href: String,
    owner: String,
    state: &'static str,
    reason: Option<String>,
    wanted: u32,
    ready: u32,
    limits: BatchLimits,
    replicas: Vec<ReplicaRow>,
    figures: Vec<Figure>,
    charts: Vec<Chart>,
    window_minutes: u32,
    since: String,
    loaned: u32,
}

#[derive(Template)]
#[template(path = "deployment.html")]
struct DeploymentPage {
    layout: Layout,
    d: DeploymentView,
    alert: Option<String>,
    /// What the scale and loaning forms show: the deployment's own values, or those of
    /// the form just refused, so the user corrects what they typed instead of retyping it.
    scale: ScaleForm,
    loan: LoaningForm,
}

/// A form posted on a deployment's page, kept to show again if it is refused.
enum Posted {
    Scale(ScaleForm),
    Loaning(LoaningForm),
}

#[derive(Template)]
#[template(path = "deployment.html", block = "detail")]
struct DeploymentFragment {
    d: DeploymentView,
}

fn figures(stats: &DeploymentStats) -> Vec<Figure> {
    let window = format!("last {} min", stats.window_seconds / 60);
    let latency = |pick: fn(&Percentiles) -> f64| {
        stats.window.latency_ms.as_ref().map(|l| format!("{} ms", millis(pick(l)))).unwrap_or_else(|| "—".into())
    };
    vec![
        Figure { label: "Requests/s", value: per_second(stats.request_rate), detail: "last minute".into() },
        Figure { label: "p50 latency", value: latency(|l| l.p50), detail: window.clone() },
        Figure { label: "p95 latency", value: latency(|l| l.p95), detail: window.clone() },
        Figure { label: "p99 latency", value: latency(|l| l.p99), detail: window },
        Figure {
            label: "Requests",
            value: stats.total.requests.to_string(),
            detail: format!("{} errors since the server started", stats.total.errors),
        },
        Figure { label: "Tokens", value: stats.total.tokens.to_string(), detail: "since the server started".into() },
    ]
}

fn charts(stats: &DeploymentStats) -> Vec<Chart> {
    let buckets = &stats.buckets;
    let latency = |pick: fn(&Percentiles) -> f64| -> Vec<Option<f64>> {
        buckets.iter().map(|b| b.traffic.latency_ms.as_ref().map(pick)).collect()
    };
    vec![
        chart("Request rate", "requests/s", &[("now", buckets.iter().map(|b| Some(b.request_rate)).collect())], per_second),
        chart("Latency", "ms", &[("p50", latency(|l| l.p50)), ("p95", latency(|l| l.p95)), ("p99", latency(|l| l.p99))], millis),
        chart("Batch size", "requests per batch", &[("mean", buckets.iter().map(|b| b.traffic.mean_batch_size).collect())], count),
        chart(
            "Tokens per batch",
            "tokens",
            &[("mean", buckets.iter().map(|b| b.traffic.mean_batch_tokens).collect())],
            count,
        ),
    ]
}

async fn deployment_view(state: &AppState, deployment: Deployment) -> Result<DeploymentView> {
    let now = Utc::now();
    let names = worker_names(state).await?;
    let stats = state.gateway.stats.snapshot(deployment.id);
    let replicas = deployment
        .replica_status
        .iter()
        .map(|r| ReplicaRow {
            id: r.id.to_string(),
            short_id: r.id.to_string()[..8].to_string(),
            worker: r.worker_id.map(|id| worker_label(&names, id)),
            state: r.state.as_str(),
            endpoint: r.endpoint.clone(),
            message: r.message.clone(),
            attempts: r.attempts,
            updated_ago: format::ago(r.updated_at, now),
            updated_at: format::instant(r.updated_at),
        })
        .collect();
    Ok(DeploymentView {
        id: deployment.id.to_string(),
        state: deployment.state.as_str(),
        model_href: format!("/models/{}", deployment.model_id),
        name: deployment.name,
        model: deployment.model_name,
        owner: deployment.owner,
        reason: deployment.reason,
        wanted: deployment.replicas,
        ready: deployment.ready_replicas,
        limits: deployment.limits,
        replicas,
        figures: figures(&stats),
        charts: charts(&stats),
        window_minutes: stats.window_seconds / 60,
        since: format::instant(stats.since),
        loaned: deployment.loaned_slices,
    })
}

/// A deployment's page; `refused` is the reason a form was refused and that form as sent.
async fn detail_page(
    state: &AppState,
    user: &WebUser,
    id: &str,
    refused: Option<(String, Posted)>,
) -> Result<DeploymentPage> {
    let deployment = deployments::resolve(&state.db, &user.0.scope(), id).await?;
    let mut page = DeploymentPage {
        layout: user.layout(deployment.name.clone(), "deployments"),
        alert: None,
        scale: ScaleForm { replicas: deployment.replicas.to_string() },
        loan: LoaningForm {
            loanable: deployment.loanable.then(|| "on".into()),
            // Exact, so saving the form unchanged keeps the headroom (12.5, not 13).
            headroom_percent: format::number(deployment.reclaim_headroom * 100.0),
        },
        d: deployment_view(state, deployment).await?,
    };
    if let Some((alert, posted)) = refused {
        page.alert = Some(alert);
        match posted {
            Posted::Scale(form) => page.scale = form,
            Posted::Loaning(form) => page.loan = form,
        }
    }
    Ok(page)
}

pub async fn detail(
    State(state): State<AppState>,
    user: WebUser,
    Path(id): Path<String>,
    Query(query): Query<FragmentQuery>,
) -> Response {
    let result = async {
        if query.fragment.is_some() {
            let deployment = deployments::resolve(&state.db, &user.0.scope(), &id).await?;
            return Ok(render(&DeploymentFragment { d: deployment_view(&state, deployment).await? })?.into_response());
        }
        Ok(render(&detail_page(&state, &user, &id, None).await?)?.into_response())
    }
    .await;
    user.page(result)
}

#[derive(Debug, Default, Deserialize)]
pub struct ScaleForm {
    #[serde(default)]
    replicas: String,
}

pub async fn scale(State(state): State<AppState>, user: WebUser, Path(id): Path<String>, Form(form): Form<ScaleForm>) -> Response {
    let result = async {
        let scaled = async {
            let replicas = number(&form.replicas, "replicas", "invalid_replicas", "between 0 and 64")?
                .ok_or_else(|| Error::invalid("invalid_replicas", "Say how many replicas to run (0 stops serving)."))?;
            deployments::scale(&state, &user.0, &id, replicas).await
        };
        let outcome = scaled.await;
        after_form(&state, &user, &id, outcome, Posted::Scale(form)).await
    }
    .await;
    user.page(result)
}

/// What a form on a deployment's page answers: back to that page, or the page again with
/// the user's mistake shown where they can fix it and the form as they sent it.
async fn after_form(
    state: &AppState,
    user: &WebUser,
    id: &str,
    outcome: Result<Deployment>,
    posted: Posted,
) -> Result<Response> {
    match outcome {
        Ok(deployment) => Ok(Redirect::to(&format!("/deployments/{}", deployment.id)).into_response()),
        Err(error) if error.status().is_client_error() && error.status() != StatusCode::NOT_FOUND => {
            let refused = Some((error.public_message(), posted));
            with_status(error.status(), render(&detail_page(state, user, id, refused).await?))
        }
        Err(error) => Err(error),
    }
}

#[derive(Debug, Default, Deserialize)]
pub struct LoaningForm {
    #[serde(default)]
    loanable: Option<String>,
    #[serde(default)]
    headroom_percent: String,
}

/// Lend idle slices to training or stop lending, and the headroom kept above demand.
pub async fn loaning(State(state): State<AppState>, user: WebUser, Path(id): Path<String>, Form(form): Form<LoaningForm>) -> Response {
    let result = async {
        let changed = async {
            let loanable = form.loanable.is_some();
            let update = UpdateDeployment {
                replicas: None,
                loanable: Some(loanable),
                reclaim_headroom: if loanable { headroom(&form.headroom_percent)? } else { None },
            };
            deployments::update(&state, &user.0, &id, update).await
        };
        let outcome = changed.await;
        after_form(&state, &user, &id, outcome, Posted::Loaning(form)).await
    }
    .await;
    user.page(result)
}

pub async fn delete(State(state): State<AppState>, user: WebUser, Path(id): Path<String>) -> Response {
    let result = async {
        deployments::delete(&state, &user.0, &id).await?;
        Ok(Redirect::to("/deployments").into_response())
    }
    .await;
    user.page(result)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_headroom_in_percent_is_the_api_s_fraction_and_out_of_range_is_refused_in_percent() {
        assert_eq!(headroom("").unwrap(), None);
        assert_eq!(headroom(" 12.5 ").unwrap(), Some(0.125));
        assert_eq!(headroom("400").unwrap(), Some(4.0));
        for text in ["400.5", "-1", "NaN", "inf", "twenty"] {
            let message = headroom(text).unwrap_err().public_message();
            assert!(message.contains("percentage from 0 to 400"), "{text}: {message}");
        }
    }
}
