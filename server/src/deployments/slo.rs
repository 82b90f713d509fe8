//! Deployments given a throughput SLO: read the fleet's GPU slices and the throughput
//! tables, plan with `scheduler::placement` (the MIG planner and the transition planner),
//! apply a repartition of idle simulated GPUs when their workers allow it, and queue one
//! replica pinned to each chosen slice. The plan is stored with the deployment.
//!
//! SLO deployments are planned and applied one at a time, on every server sharing the
//! database, so two never pick the same free slice or repartition the same GPU: each waits
//! until the one before has committed and plans on what it committed ([`plan`] says how).
//! A replica without an SLO still takes a free slice when claimed, outside that lock; one
//! pinned to a slice so taken between its plan and its commit waits for the slice to free.

use std::collections::BTreeMap;

use sqlx::{Any, AnyConnection, Transaction};
use tessera_api::mig::{PlannedSlice, Slice, SloStatus, TransitionStep};
use tessera_api::models::Model;
use tokio::sync::MutexGuard;
use uuid::Uuid;

use super::{replica_spec, REPLICA_MAX_ATTEMPTS};
use crate::auth::Principal;
use crate::error::{Error, Result};
use crate::scheduler::mig::input::MAX_GPUS;
use crate::scheduler::mig::{GpuModel, Placed};
use crate::scheduler::placement::{plan_slo, Demand, FleetGpu, FleetSlice, SloPlan};
use crate::scheduler::throughput::{complete, rates};
use crate::state::AppState;
use crate::store::db::{Backend, Db};
use crate::store::deployments::{self as store, StoredDeployment};
use crate::store::{jobs, models, slices};

/// This server's turn to plan; PostgreSQL's advisory lock (`store::lock_slo_planning`) is
/// every server's.
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

/// A model's demand: its rates on every GPU model its table covers.
async fn demand(
    db: &Db,
    name: &str,
    model: Uuid,
    throughput: f64,
    latency_ms: Option<f64>,
) -> Result<Demand> {
    let table = complete(&models::measured_profiles(db, model).await?);
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
    let mut gpus: BTreeMap<String, FleetGpu> = BTreeMap::new();
    for row in slices::online(&state.db, crate::workers::online_since(state)).await? {
        let slice = row.slice;
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
        let gpu = gpus.entry(slice.gpu_uuid.clone()).or_insert_with(|| FleetGpu {
            uuid: slice.gpu_uuid.clone(),
            worker: row.worker,
            model,
            whole: slice.profile.is_none(),
            repartition: slice.simulated && row.allow_repartition,
            slices: Vec::new(),
        });
        gpu.slices.push(FleetSlice { uuid: slice.uuid, placed: Placed { profile, start }, holder: row.holder });
    }
    Ok(gpus.into_values().collect())
}

/// SLO deployments other than `except`, as demands.
async fn others(db: &Db, except: Uuid) -> Result<Vec<Demand>> {
    let mut out = Vec::new();
    for other in store::with_slo_except(db, except).await? {
        out.push(demand(db, &other.name, other.model_id, other.slo.throughput, other.slo.latency_ms).await?);
    }
    Ok(out)
}

/// Checks that the model has a throughput table, before the deployment is created.
pub async fn check_table(db: &Db, model: Uuid, model_name: &str) -> Result<()> {
    if models::measured_profiles(db, model).await?.is_empty() {
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

/// An SLO planned on the fleet as it is now, not yet applied. It holds this server's
/// planning lock: keep it until the transaction that applies it ([`apply`]) has committed.
pub struct Planned {
    fleet: Vec<FleetGpu>,
    plan: SloPlan,
    throughput: f64,
    latency_ms: Option<f64>,
    _one_at_a_time: MutexGuard<'static, ()>,
}

/// Plans deployment `name` (id `id`, not stored yet) of `model` for the SLO, and begins the
/// transaction to store and [`apply`] it in. Reads only, so a refusal (no measured profile
/// meets the latency) leaves nothing behind.
///
/// No other SLO deployment is planned until that transaction ends. On this server a lock
/// (taken first, so a server's waiting plans hold one pooled connection, not one each).
/// On PostgreSQL the transaction also begins before the fleet is read and first takes an
/// advisory lock every server shares; the reads, made after it is granted, each see what
/// the previous holder committed (READ COMMITTED: a statement sees the rows committed
/// before it began, and the lock is released only once its holder's commit is visible).
/// SQLite begins it after planning: its write lock would stop every other writer during
/// the planner's search, and a SQLite file has one server, whose lock is enough.
pub async fn plan(
    state: &AppState,
    id: Uuid,
    name: &str,
    model: &Model,
    throughput: f64,
    latency_ms: Option<f64>,
) -> Result<(Planned, Transaction<'static, Any>)> {
    let db = &state.db;
    let want = demand(db, name, model.id, throughput, latency_ms).await?;
    if want.rates.is_empty() {
        return Err(Error::invalid(
            "no_throughput_table",
            format!("No profile of model '{}' meets a p99 of {} ms; relax latency_ms or profile the model again.", model.name, latency_ms.unwrap_or_default()),
        ));
    }
    let least = want.least_gpus();
    if least > MAX_GPUS {
        return Err(Error::invalid(
            "invalid_slo",
            format!(
                "At its best measured rate model '{}' needs at least {least:.0} GPUs for {throughput} req/s, and the \
                 planner plans at most {MAX_GPUS}; check that the throughput is in requests per second.",
                model.name
            ),
        ));
    }
    let one_at_a_time = PLANNING.lock().await;
    let shared = match db.backend() {
        Backend::Postgres => {
            let mut tx = db.begin().await?;
            store::lock_slo_planning(&mut tx).await?;
            Some(tx)
        }
        Backend::Sqlite => None,
    };
    let fleet = fleet(state).await?;
    let others = others(db, id).await?;
    // The planner's searches take a while on big fleets: off the async threads.
    let (fleet, plan) = tokio::task::spawn_blocking(move || {
        let plan = plan_slo(&fleet, &want, &others);
        (fleet, plan)
    })
    .await?;
    let tx = match shared {
        Some(tx) => tx,
        None => db.begin().await?,
    };
    Ok((Planned { fleet, plan, throughput, latency_ms, _one_at_a_time: one_at_a_time }, tx))
}

/// Applies `planned` to `deployment` in the transaction that inserts it: the owner's
/// replica quota, the repartition of idle simulated GPUs, one replica pinned to each
/// chosen slice, and the plan stored with the deployment. On a refusal (the quota) the
/// caller's transaction rolls back, the deployment with it.
pub async fn apply(
    state: &AppState,
    conn: &mut AnyConnection,
    owner: &Principal,
    deployment: &StoredDeployment,
    planned: &Planned,
) -> Result<()> {
    let Planned { fleet, plan, throughput, latency_ms, .. } = planned;
    let (throughput, latency_ms) = (*throughput, *latency_ms);
    crate::quotas::check_replicas(state, conn, owner, plan.chosen.len() as u32, Some(deployment.id)).await?;
    // A repartition first: the chosen slices it creates get their uuids here.
    let mut created: BTreeMap<(usize, u8), String> = BTreeMap::new();
    if plan.applied {
        for (g, partition) in &plan.partitions {
            let gpu = &fleet[*g];
            let gpu_index = slices::gpu_index(conn, &gpu.uuid).await?;
            let mut new = Vec::with_capacity(partition.len());
            for placed in partition {
                let profile = gpu.model.profile(placed.profile);
                let slice = Slice {
                    uuid: format!("MIG-sim-{}", Uuid::new_v4()),
                    gpu_uuid: gpu.uuid.clone(),
                    gpu_index,
                    gpu_model: Some(gpu.model.name().to_string()),
                    profile: Some(profile.name.to_string()),
                    start: Some(placed.start),
                    memory_bytes: u64::from(profile.memory_gb) << 30,
                    simulated: true,
                };
                created.insert((*g, placed.start), slice.uuid.clone());
                new.push(slice);
            }
            slices::replace_gpu(conn, gpu.worker, &gpu.uuid, &new).await?;
        }
    }
    let spec = replica_spec(deployment);
    let name = format!("replica of {}", deployment.name);
    let mut placed_slices = Vec::with_capacity(plan.chosen.len());
    for c in &plan.chosen {
        let gpu = &fleet[c.gpu];
        let slice = match &c.uuid {
            Some(uuid) => uuid.clone(),
            None => created
                .get(&(c.gpu, c.placed.start))
                .cloned()
                .ok_or(Error::Invariant("the SLO plan chose a slice its repartition does not create"))?,
        };
        let job = jobs::NewJob {
            owner: deployment.owner_id,
            name: &name,
            spec: &spec,
            max_attempts: REPLICA_MAX_ATTEMPTS,
            deployment: Some(deployment.id),
            dataset: None,
            pinned_slice: Some(&slice),
        };
        jobs::insert_in(conn, &job).await?;
        placed_slices.push(PlannedSlice {
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
        slices: placed_slices,
        applied: plan.applied,
        steps,
        extra_gpus: plan.extra_gpus,
        note: plan.note.clone(),
    };
    store::set_slo(conn, deployment.id, plan.chosen.len() as u32, &status).await?;
    tracing::info!(deployment = %deployment.id, replicas = status.slices.len(), applied = status.applied, "{}", status.note);
    Ok(())
}
