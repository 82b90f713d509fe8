//! The fleet page (issue 16): a timeline per slice of the last hour (serving, loaned,
//! training, reclaiming), loaned capacity over the scheduling rounds, the reclaim events
//! with the jobs they hit, and the training queue with each job's predicted start and JCT
//! (the round's forecast). It reads what `GET /api/v1/fleet/loaning` returns.

use std::collections::HashMap;

use askama::Template;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use chrono::Utc;
use serde::Deserialize;
use tessera_api::loaning::PredictedFrom;

use super::chart::{chart, Chart};
use super::{format, render, Layout, WebUser};
use crate::error::Result;
use crate::loaning::routes::{overview, WINDOW_MS};
use crate::state::AppState;
use crate::store::db::now_ms;
use crate::store::loaning as store;
use crate::workers;

/// SVG units of the timeline's width (the hour).
const WIDTH: f64 = 1000.0;

struct Segment {
    x: String,
    width: String,
    state: String,
    title: String,
}

struct SliceLine {
    label: String,
    now: &'static str,
    segments: Vec<Segment>,
}

struct ReclaimRow {
    at: String,
    ago: String,
    deployment: String,
    job: String,
    job_href: Option<String>,
    ranks: u32,
    action: &'static str,
    reason: String,
}

struct QueueRow {
    position: u32,
    name: String,
    href: String,
    state: String,
    ranks: String,
    preemptible: bool,
    /// "running", "now", "in 3 min" or "never".
    start: String,
    start_title: String,
    /// "in 12 min", or "—" when it never starts.
    finish: String,
    jct: String,
    /// `measured` or `prior` (the step-time prior); empty without a forecast.
    basis: &'static str,
    note: String,
}

struct FleetView {
    slices: Vec<SliceLine>,
    charts: Vec<Chart>,
    reclaims: Vec<ReclaimRow>,
    queue: Vec<QueueRow>,
    rounds: usize,
}

#[derive(Template)]
#[template(path = "fleet.html")]
struct FleetPage {
    layout: Layout,
    v: FleetView,
}

#[derive(Template)]
#[template(path = "fleet.html", block = "live")]
struct FleetFragment {
    v: FleetView,
}

#[derive(Debug, Default, Deserialize)]
pub struct PageQuery {
    fragment: Option<String>,
}

fn duration(secs: f64) -> String {
    let secs = secs.max(0.0).round() as u64;
    match secs {
        0..=99 => format!("{secs} s"),
        100..=5999 => format!("{} min", (secs + 30) / 60),
        _ => format!("{:.1} h", secs as f64 / 3600.0),
    }
}

async fn view(state: &AppState, user: &WebUser) -> Result<FleetView> {
    let scope = user.0.scope();
    let data = overview(state, &scope).await?;
    let now = now_ms();
    let start = now - WINDOW_MS;
    let x = |at: i64| (at - start).clamp(0, WINDOW_MS) as f64 / WINDOW_MS as f64 * WIDTH;

    // Each slice's states over the hour, from its state before the window and its events.
    let before = store::slice_states_before(&state.db, start).await?;
    let fleet = workers::list_all(state, &scope).await?;
    let mut events: HashMap<&str, Vec<(i64, &str, &str)>> = HashMap::new();
    for e in data.slice_events.iter().rev() {
        events.entry(e.slice.as_str()).or_default().push((
            e.at.timestamp_millis(),
            e.state.as_str(),
            e.detail.as_str(),
        ));
    }
    let mut slices = Vec::new();
    for worker in &fleet {
        for s in &worker.slices {
            let uuid = s.slice.uuid.as_str();
            let mut changes: Vec<(i64, String, String)> = vec![(
                start,
                before
                    .get(uuid)
                    .cloned()
                    .unwrap_or_else(|| "serving".into()),
                String::new(),
            )];
            for &(at, st, detail) in events.get(uuid).map(Vec::as_slice).unwrap_or(&[]) {
                changes.push((at, st.to_string(), detail.to_string()));
            }
            let mut segments = Vec::new();
            // The loan state under a training rank: where a slice returns when the rank leaves.
            let mut loan = "serving".to_string();
            for (i, (at, st, detail)) in changes.iter().enumerate() {
                let end = changes.get(i + 1).map_or(now, |c| c.0);
                let (x0, x1) = (x(*at), x(end));
                let shown = match st.as_str() {
                    "idle" => loan.clone(),
                    "training" => "training".to_string(),
                    other => {
                        loan = other.to_string();
                        loan.clone()
                    }
                };
                if x1 - x0 < 0.01 {
                    continue;
                }
                segments.push(Segment {
                    x: format!("{x0:.1}"),
                    width: format!("{:.1}", x1 - x0),
                    title: if detail.is_empty() {
                        shown.clone()
                    } else {
                        format!("{shown}: {detail}")
                    },
                    state: shown,
                });
            }
            let now_state = if s.training_job.is_some() {
                "training"
            } else {
                s.loan_state.as_str()
            };
            slices.push(SliceLine {
                label: format!(
                    "{} · GPU {} · {}{}",
                    worker.name,
                    s.slice.gpu_index,
                    s.slice.profile.as_deref().unwrap_or("whole GPU"),
                    s.lender
                        .as_deref()
                        .map(|l| format!(" · lent by {l}"))
                        .unwrap_or_default()
                ),
                now: now_state,
                segments,
            });
        }
    }

    let series = |pick: fn(&tessera_api::loaning::LoanRound) -> u32| -> Vec<Option<f64>> {
        data.rounds.iter().map(|r| Some(pick(r) as f64)).collect()
    };
    let charts = vec![
        chart(
            "Loaned capacity",
            "slices",
            &[
                ("loaned", series(|r| r.loaned)),
                ("reclaiming", series(|r| r.reclaiming)),
            ],
            |v| format!("{v:.0}"),
        ),
        chart(
            "Training",
            "slices / jobs",
            &[
                ("ranks on slices", series(|r| r.training)),
                ("jobs waiting", series(|r| r.waiting)),
            ],
            |v| format!("{v:.0}"),
        ),
    ];
    let now_time = Utc::now();
    let reclaims = data
        .reclaims
        .iter()
        .map(|r| ReclaimRow {
            at: format::instant(r.at),
            ago: format::ago(r.at, now_time),
            deployment: r.deployment.clone(),
            job: r.job_name.clone(),
            job_href: r.job_id.map(|id| format!("/jobs/{id}")),
            ranks: r.ranks,
            action: if r.preempted { "preempted" } else { "shrunk" },
            reason: r.reason.clone(),
        })
        .collect();
    let from_now = |at: chrono::DateTime<Utc>| {
        let secs = (at - now_time).num_milliseconds() as f64 / 1000.0;
        if secs < 1.0 {
            "now".to_string()
        } else {
            format!("in {}", duration(secs))
        }
    };
    let queue = data
        .queue
        .iter()
        .map(|q| QueueRow {
            position: q.position + 1,
            name: q.name.clone(),
            href: format!("/jobs/{}", q.job_id),
            state: q.state.clone(),
            ranks: if q.min_ranks == q.max_ranks {
                format!("{}", q.ranks)
            } else {
                format!("{} ({}–{})", q.ranks, q.min_ranks, q.max_ranks)
            },
            preemptible: q.preemptible,
            start: match (q.predicted_start_at, q.predicted_finish_at) {
                (Some(at), _) => from_now(at),
                (None, Some(_)) => "running".into(),
                (None, None) if q.predicted_from.is_none() => "—".into(),
                (None, None) => "never".into(),
            },
            start_title: match (q.predicted_start_at, q.predicted_finish_at) {
                (Some(at), _) => format::instant(at),
                (None, None) if q.predicted_from.is_some() => {
                    "It asks for more slices than its pools hold".into()
                }
                _ => String::new(),
            },
            finish: q.predicted_finish_at.map_or_else(|| "—".into(), from_now),
            jct: q.predicted_jct_secs.map_or_else(|| "—".into(), duration),
            basis: q.predicted_from.map_or("", PredictedFrom::as_str),
            note: q.note.clone(),
        })
        .collect();
    Ok(FleetView {
        slices,
        charts,
        reclaims,
        queue,
        rounds: data.rounds.len(),
    })
}

pub async fn page(
    State(state): State<AppState>,
    user: WebUser,
    Query(query): Query<PageQuery>,
) -> Response {
    let result: Result<Response> = async {
        let v = view(&state, &user).await?;
        if query.fragment.is_some() {
            return Ok(render(&FleetFragment { v })?.into_response());
        }
        Ok(render(&FleetPage {
            layout: user.layout("Fleet", "fleet"),
            v,
        })?
        .into_response())
    }
    .await;
    user.page(result)
}
