//! The MIG page: every GPU drawn as its slices (width by memory slices, placed by start),
//! coloured by the deployment each slice serves; each throughput-SLO deployment's demand
//! against its planned capacity; and the transition steps applied or proposed.

use std::collections::BTreeSet;

use askama::Template;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use tessera_api::loaning::LoanState;
use tessera_api::mig::SliceStatus;

use super::{render, Layout, WebUser};
use crate::error::Result;
use crate::scheduler::mig::GpuModel;
use crate::scheduler::mig::catalog::MEMORY_SLICES;
use crate::state::AppState;
use crate::{deployments, workers};

/// Colours of services, in the order of their names; slices nobody uses are grey.
const PALETTE: [&str; 8] = [
    "#2563eb", "#16a34a", "#d97706", "#9333ea", "#dc2626", "#0891b2", "#65a30d", "#db2777",
];
/// SVG units per memory slice.
const UNIT: u32 = 100;

struct SliceBox {
    x: u32,
    width: u32,
    centre: u32,
    profile: String,
    service: String,
    colour: &'static str,
}

struct GpuCard {
    title: String,
    detail: String,
    boxes: Vec<SliceBox>,
}

struct StepRow {
    action: String,
    gpu: String,
    slice: String,
    service: String,
}

struct ServiceRow {
    name: String,
    colour: &'static str,
    demand: String,
    capacity: String,
    met: bool,
    /// Capacity as a share of demand, 0–100, for the bar.
    percent: u32,
    applied: bool,
    note: String,
    steps: Vec<StepRow>,
}

#[derive(Template)]
#[template(path = "mig.html")]
struct MigPage {
    layout: Layout,
    gpus: Vec<GpuCard>,
    services: Vec<ServiceRow>,
    width: u32,
}

#[derive(Template)]
#[template(path = "mig.html", block = "live")]
struct MigFragment {
    gpus: Vec<GpuCard>,
    services: Vec<ServiceRow>,
    width: u32,
}

#[derive(Debug, Default, Deserialize)]
pub struct PageQuery {
    fragment: Option<String>,
}

fn colour(names: &[String], name: Option<&str>) -> &'static str {
    match name.and_then(|n| names.iter().position(|x| x == n)) {
        Some(i) => PALETTE[i % PALETTE.len()],
        None => "#9ca3af",
    }
}

/// Memory slices a slice spans and where it starts: a whole GPU spans them all.
fn extent(slice: &SliceStatus) -> (u32, u32) {
    let s = &slice.slice;
    let memory = s
        .gpu_model
        .as_deref()
        .and_then(GpuModel::parse)
        .zip(s.profile.as_deref())
        .and_then(|(gpu, p)| gpu.profile_id(p).map(|id| gpu.profile(id).memory))
        .unwrap_or(MEMORY_SLICES);
    (u32::from(s.start.unwrap_or(0)), u32::from(memory))
}

pub async fn page(
    State(state): State<AppState>,
    user: WebUser,
    Query(query): Query<PageQuery>,
) -> Response {
    let result: Result<Response> = async {
        let workers = workers::list_all(&state, &user.0.scope()).await?;
        let visible = deployments::list_visible(&state.db, &user.0.scope()).await?;
        let mut names: BTreeSet<String> = visible.iter().map(|d| d.name.clone()).collect();
        names.extend(
            workers
                .iter()
                .flat_map(|w| w.slices.iter().filter_map(|s| s.deployment.clone())),
        );
        let names: Vec<String> = names.into_iter().collect();

        let mut gpus = Vec::new();
        for worker in &workers {
            let mut by_gpu: Vec<(&str, Vec<&SliceStatus>)> = Vec::new();
            for s in &worker.slices {
                match by_gpu.iter_mut().find(|(g, _)| *g == s.slice.gpu_uuid) {
                    Some((_, list)) => list.push(s),
                    None => by_gpu.push((&s.slice.gpu_uuid, vec![s])),
                }
            }
            for (gpu_uuid, slices) in by_gpu {
                let first = &slices[0].slice;
                let model = first
                    .gpu_model
                    .clone()
                    .unwrap_or_else(|| "unknown GPU".into());
                let mig = slices.iter().any(|s| s.slice.profile.is_some());
                let boxes = slices
                    .iter()
                    .map(|s| {
                        let (start, memory) = extent(s);
                        SliceBox {
                            x: start * UNIT + 2,
                            width: memory * UNIT - 4,
                            centre: start * UNIT + memory * UNIT / 2,
                            profile: s
                                .slice
                                .profile
                                .clone()
                                .unwrap_or_else(|| "whole GPU".into()),
                            // Another tenant's replica: the slice is taken, by whom is theirs.
                            service: match (&s.deployment, s.in_use, s.loan_state) {
                                (Some(name), _, _) => name.clone(),
                                (None, _, _) if s.training_job.is_some() => "training".into(),
                                (None, true, LoanState::Serving) => "in use".into(),
                                (None, _, LoanState::Serving) => String::new(),
                                (None, _, state) => match &s.lender {
                                    Some(lender) => format!("{} by {lender}", state.as_str()),
                                    None => state.as_str().into(),
                                },
                            },
                            colour: colour(&names, s.deployment.as_deref()),
                        }
                    })
                    .collect();
                let mut detail = vec![
                    if mig {
                        "MIG on".to_string()
                    } else {
                        "MIG off".to_string()
                    },
                    gpu_uuid.to_string(),
                ];
                if first.simulated {
                    detail.push("simulated".into());
                }
                if worker.allow_repartition {
                    detail.push("repartitioning allowed".into());
                }
                gpus.push(GpuCard {
                    title: format!("{} · GPU {} · {model}", worker.name, first.gpu_index),
                    detail: detail.join(" · "),
                    boxes,
                });
            }
        }

        let gpu_label = |uuid: &Option<String>| match uuid {
            None => "a GPU the fleet lacks".to_string(),
            Some(u) => gpus_name(&workers, u),
        };
        let services = visible
            .iter()
            .filter_map(|d| d.slo.as_ref().map(|slo| (d, slo)))
            .map(|(d, slo)| ServiceRow {
                name: d.name.clone(),
                colour: colour(&names, Some(&d.name)),
                demand: format!("{:.1}", slo.throughput),
                capacity: format!("{:.1}", slo.capacity),
                met: slo.capacity >= slo.throughput * (1.0 - 1e-9),
                percent: ((slo.capacity / slo.throughput) * 100.0).clamp(0.0, 100.0) as u32,
                applied: slo.applied,
                note: slo.note.clone(),
                steps: slo
                    .steps
                    .iter()
                    .map(|s| StepRow {
                        action: s.action.replace('_', " "),
                        gpu: gpu_label(&s.gpu_uuid),
                        slice: format!("{} @ {}", s.profile, s.start),
                        service: s.service.clone().unwrap_or_default(),
                    })
                    .collect(),
            })
            .collect();
        let width = u32::from(MEMORY_SLICES) * UNIT;
        if query.fragment.is_some() {
            return Ok(render(&MigFragment {
                gpus,
                services,
                width,
            })?
            .into_response());
        }
        Ok(render(&MigPage {
            layout: user.layout("MIG", "mig"),
            gpus,
            services,
            width,
        })?
        .into_response())
    }
    .await;
    user.page(result)
}

/// "worker · GPU n" for a GPU uuid.
fn gpus_name(workers: &[tessera_api::workers::Worker], uuid: &str) -> String {
    workers
        .iter()
        .find_map(|w| {
            w.slices
                .iter()
                .find(|s| s.slice.gpu_uuid == uuid)
                .map(|s| format!("{} · GPU {}", w.name, s.slice.gpu_index))
        })
        .unwrap_or_else(|| uuid.to_string())
}
