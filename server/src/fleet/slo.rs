//! Deployments given a throughput SLO: read the fleet's GPU slices and the throughput
//! tables, plan with `scheduler::fleet` (the MIG planner and the transition planner),
//! apply a repartition of idle simulated GPUs when their workers allow it, and queue one
//! replica pinned to each chosen slice. The plan is stored with the deployment.
//!
//! Two SLO deployments created at the same time on one server are planned one after the
//! other (a lock), so they never pick the same free slice; servers sharing a database
//! may still race, in which case the second replica waits until the slice frees.

use std::collections::BTreeMap;

use sqlx::Row;
use tessera_api::deployments::Deployment;
use tessera_api::jobs::JobSpec;
use tessera_api::mig::{PlannedSlice, SloStatus, TransitionStep};
use uuid::Uuid;

use super::profiles;
use super::slices::{slice_from_row, HOLDING};
use crate::app::AppState;
use crate::store::db::{now_ms, Db};
use crate::error::{Error, Result};
use crate::scheduler::fleet::{plan_slo, Demand, FleetGpu, FleetSlice};
use crate::scheduler::mig::{GpuModel, Placed};
use crate::scheduler::throughput::{complete, rates};

static PLANNING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Checks the SLO's numbers.
pub fn check(throughput: f64, latency_ms: Option<f64>) -> Result<()> {
    if !(throughput.is_finite() && throughput > 0.0 && throughput <= 1e7) {
        return Err(Error::invalid(
            "invalid_slo",
            "throughput must be a positive number of requests per second (at most 10000000).",
        ));
    }
    if latency_ms.is_some_and(|l| !(l.is_finite() && l > 0.0)) {
        return Err(Error::invalid(
            "invalid_slo",
            "latency_ms must be a positive number of milliseconds.",
        ));
    }
    Ok(())
}

pub fn from_column(text: Option<String>) -> Result<Option<SloStatus>> {
    text.map(|t| {
        serde_json::from_str(&t)
            .map_err(|e| anyhow::anyhow!("stored SLO plan unreadable: {e}").into())
    })
    .transpose()
}

/// A model's demand: its rates on every GPU model its table covers.
async fn demand(
    db: &Db,
    name: &str,
    model: Uuid,
    throughput: f64,
    latency_ms: Option<f64>,
) -> Result<Demand> {
    let table = complete(&profiles::measured(db, model).await?);
    let rates = GpuModel::ALL
        .into_iter()
        .map(|gpu| (gpu, rates(&table, gpu, latency_ms)))
        .filter(|(_, r)| r.iter().any(Option::is_some))
        .collect();
    Ok(Demand {
        name: name.to_string(),
        throughput,
        rates,
    })
}

/// The GPUs of online workers, with their slices and what holds each.
async fn fleet(state: &AppState) -> Result<Vec<FleetGpu>> {
    let rows = sqlx::query(&format!(
        "SELECT s.worker_id, w.allow_repartition, s.uuid, s.gpu_uuid, s.gpu_index, s.gpu_model, s.profile, s.start, \
           s.memory_bytes, s.simulated, \
           (SELECT d.name FROM jobs j JOIN deployments d ON d.id = j.deployment_id WHERE j.slice_uuid = s.uuid AND {HOLDING} \
            LIMIT 1) AS holder \
         FROM slices s JOIN workers w ON w.id = s.worker_id WHERE w.last_seen_at >= $1 \
         ORDER BY w.name, s.gpu_index, s.start"
    ))
    .bind(crate::workers::online_since(state))
    .fetch_all(state.db.pool())
    .await?;
    let mut gpus: BTreeMap<String, FleetGpu> = BTreeMap::new();
    for row in &rows {
        let slice = slice_from_row(row)?;
        let Some(model) = slice.gpu_model.as_deref().and_then(GpuModel::parse) else {
            continue;
        };
        let (profile, start) = match (&slice.profile, slice.start) {
            (None, _) => (model.whole_gpu_profile(), 0),
            (Some(name), Some(start)) => match model.profile_id(name) {
                Some(p) => (p, start),
                None => continue,
            },
            (Some(_), None) => continue,
        };
        let worker: String = row.try_get("worker_id")?;
        let gpu = gpus
            .entry(slice.gpu_uuid.clone())
            .or_insert_with(|| FleetGpu {
                uuid: slice.gpu_uuid.clone(),
                worker: worker.parse().unwrap_or_default(),
                model,
                whole: slice.profile.is_none(),
                repartition: slice.simulated
                    && row.try_get::<i64, _>("allow_repartition").unwrap_or(0) != 0,
                slices: Vec::new(),
            });
        gpu.slices.push(FleetSlice {
            uuid: slice.uuid,
            placed: Placed { profile, start },
            holder: row.try_get("holder")?,
        });
    }
    Ok(gpus.into_values().collect())
}

/// SLO deployments other than `except`, as demands.
async fn others(db: &Db, except: Uuid) -> Result<Vec<Demand>> {
    let rows = sqlx::query(
        "SELECT id, name, model_id, slo FROM deployments WHERE slo IS NOT NULL AND id <> $1",
    )
    .bind(except.to_string())
    .fetch_all(db.pool())
    .await?;
    let mut out = Vec::with_capacity(rows.len());
    for row in &rows {
        let Some(slo) = from_column(row.try_get("slo")?)? else {
            continue;
        };
        let model: String = row.try_get("model_id")?;
        let model = model
            .parse()
            .map_err(|e| anyhow::anyhow!("bad model id: {e}"))?;
        out.push(
            demand(
                db,
                &row.try_get::<String, _>("name")?,
                model,
                slo.throughput,
                slo.latency_ms,
            )
            .await?,
        );
    }
    Ok(out)
}

/// Checks that the model has a throughput table, before the deployment is created.
pub async fn check_table(db: &Db, model: Uuid, model_name: &str) -> Result<()> {
    if profiles::measured(db, model).await?.is_empty() {
        return Err(Error::invalid(
            "no_throughput_table",
            format!(
                "Model '{model_name}' has no throughput table yet, so a throughput SLO cannot be planned: queue a profiler \
                 job with POST /api/v1/models/{model_name}/profiles (a worker with MIG slices runs it), or give replicas."
            ),
        ));
    }
    Ok(())
}

/// Plans the deployment's SLO, applies what may be applied, queues its replicas.
pub async fn place(
    state: &AppState,
    owner: Uuid,
    deployment: &Deployment,
    throughput: f64,
    latency_ms: Option<f64>,
) -> Result<()> {
    let _one_at_a_time = PLANNING.lock().await;
    let db = &state.db;
    let want = demand(
        db,
        &deployment.name,
        deployment.model_id,
        throughput,
        latency_ms,
    )
    .await?;
    if want.rates.is_empty() {
        return Err(Error::invalid(
            "no_throughput_table",
            format!("No profile of model '{}' meets a p99 of {} ms; relax latency_ms or profile the model again.", deployment.model_name, latency_ms.unwrap_or_default()),
        ));
    }
    let fleet = fleet(state).await?;
    let plan = plan_slo(&fleet, &want, &others(db, deployment.id).await?);

    let mut tx = db.begin().await?;
    // A repartition first: the chosen slices it creates get their uuids here.
    let mut created: BTreeMap<(usize, u8), String> = BTreeMap::new();
    if plan.applied {
        for (g, partition) in &plan.partitions {
            let gpu = &fleet[*g];
            let gpu_index: i64 =
                sqlx::query_scalar("SELECT gpu_index FROM slices WHERE gpu_uuid = $1 LIMIT 1")
                    .bind(&gpu.uuid)
                    .fetch_one(&mut *tx)
                    .await?;
            sqlx::query("DELETE FROM slices WHERE gpu_uuid = $1")
                .bind(&gpu.uuid)
                .execute(&mut *tx)
                .await?;
            for placed in partition {
                let profile = gpu.model.profile(placed.profile);
                let slice = tessera_api::mig::Slice {
                    uuid: format!("MIG-sim-{}", Uuid::new_v4()),
                    gpu_uuid: gpu.uuid.clone(),
                    gpu_index: gpu_index as u32,
                    gpu_model: Some(gpu.model.name().to_string()),
                    profile: Some(profile.name.to_string()),
                    start: Some(placed.start),
                    memory_bytes: u64::from(profile.memory_gb) << 30,
                    simulated: true,
                };
                super::slices::insert(&mut tx, gpu.worker, &slice).await?;
                created.insert((*g, placed.start), slice.uuid);
            }
        }
    }
    let spec = JobSpec::Serve {
        deployment: deployment.id,
        model: deployment.model_id,
        max_batch_tokens: deployment.max_batch_tokens,
        max_batch_requests: deployment.max_batch_requests,
    };
    let spec_json = serde_json::to_string(&spec).map_err(|e| anyhow::anyhow!(e))?;
    let now = now_ms();
    let mut planned = Vec::with_capacity(plan.chosen.len());
    for c in &plan.chosen {
        let gpu = &fleet[c.gpu];
        let slice = match &c.uuid {
            Some(uuid) => uuid.clone(),
            None => created
                .get(&(c.gpu, c.placed.start))
                .cloned()
                .ok_or_else(|| anyhow::anyhow!("planned slice not created"))?,
        };
        sqlx::query(
            "INSERT INTO jobs (id, owner_id, name, kind, spec, state, attempts, max_attempts, created_at, updated_at, \
             deployment_id, slice_uuid, slice_pinned) VALUES ($1, $2, $3, 'serve', $4, 'queued', 0, $5, $6, $6, $7, $8, 1)",
        )
        .bind(Uuid::new_v4().to_string())
        .bind(owner.to_string())
        .bind(format!("replica of {}", deployment.name))
        .bind(&spec_json)
        .bind(crate::deployments::REPLICA_MAX_ATTEMPTS as i64)
        .bind(now)
        .bind(deployment.id.to_string())
        .bind(&slice)
        .execute(&mut *tx)
        .await?;
        planned.push(PlannedSlice {
            slice,
            worker_id: gpu.worker,
            gpu_uuid: gpu.uuid.clone(),
            gpu_model: gpu.model.name().to_string(),
            profile: gpu.model.profile(c.placed.profile).name.to_string(),
            start: c.placed.start,
            throughput: c.rate.throughput,
            estimated: c.rate.estimated,
        });
    }
    let steps = plan
        .steps
        .iter()
        .map(|s| TransitionStep {
            action: s.action.to_string(),
            gpu_uuid: s.gpu.map(|g| fleet[g].uuid.clone()),
            worker_id: s.gpu.map(|g| fleet[g].worker),
            profile: s.profile.to_string(),
            start: s.start,
            service: s.service.clone(),
        })
        .collect();
    let status = SloStatus {
        throughput,
        latency_ms,
        capacity: plan.capacity,
        slices: planned,
        applied: plan.applied,
        steps,
        extra_gpus: plan.extra_gpus,
        note: plan.note,
    };
    sqlx::query("UPDATE deployments SET replicas = $1, slo = $2, updated_at = $3 WHERE id = $4")
        .bind(plan.chosen.len() as i64)
        .bind(serde_json::to_string(&status).map_err(|e| anyhow::anyhow!(e))?)
        .bind(now)
        .bind(deployment.id.to_string())
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    tracing::info!(deployment = %deployment.id, replicas = status.slices.len(), applied = status.applied, "{}", status.note);
    Ok(())
}
