//! Deployments: a model served under a name. Each replica is a job of kind `serve` in
//! the leased queue, so placement, re-placement after a worker dies, and cancellation
//! are the queue's: a queued replica is pending, a leased one loading, a running one
//! ready (its engine endpoint recorded), a failed one carries the reason.
//!
//! The functions here are what both the API (`routes`) and the dashboard call; a
//! deployment sized by a throughput SLO is planned by `slo`.

pub mod routes;
pub mod slo;

use std::collections::HashSet;

use sqlx::AnyConnection;
use tessera_api::deployments::{CreateDeployment, Deployment, Replica, ServingState, UpdateDeployment};
use tessera_api::jobs::JobSpec;
use uuid::Uuid;

use crate::auth::Principal;
use crate::error::{Error, Result};
use crate::state::AppState;
use crate::store::Scope;
use crate::store::db::Db;
use crate::store::deployments::{self as store, NewDeployment, StoredDeployment};
use crate::store::jobs::{self, NewJob};
use crate::store::loaning as loaning_store;

/// Times a replica may be placed again after its worker vanished before it is failed.
pub const REPLICA_MAX_ATTEMPTS: u32 = 20;
const MAX_REPLICAS: u32 = 64;

/// The deployment's state from its replicas': ready when every replica asked for is
/// ready, failed when none can become ready, else loading or pending.
fn deployment_state(wanted: u32, replicas: &[Replica]) -> (ServingState, Option<String>) {
    let count = |s: ServingState| replicas.iter().filter(|r| r.state == s).count() as u32;
    let (ready, loading, pending, failed) =
        (count(ServingState::Ready), count(ServingState::Loading), count(ServingState::Pending), count(ServingState::Failed));
    let failure = replicas.iter().filter(|r| r.state == ServingState::Failed).find_map(|r| r.message.clone());
    if wanted == 0 {
        return (ServingState::Pending, Some("Scaled to zero replicas.".into()));
    }
    if ready >= wanted {
        return (ServingState::Ready, None);
    }
    if ready + loading + pending == 0 && failed > 0 {
        return (ServingState::Failed, failure.or_else(|| Some("Every replica failed.".into())));
    }
    let reason = match failure {
        Some(failure) => format!("{ready} of {wanted} replicas ready; a replica failed: {failure}"),
        None if pending > 0 && loading == 0 => {
            format!("{ready} of {wanted} replicas ready; waiting for a worker that can serve it to claim a replica.")
        }
        None => format!("{ready} of {wanted} replicas ready; {loading} loading."),
    };
    let state = if loading > 0 || ready > 0 { ServingState::Loading } else { ServingState::Pending };
    (state, Some(reason))
}

/// A stored deployment with its replicas and the state they add up to.
async fn with_status(db: &Db, stored: StoredDeployment) -> Result<Deployment> {
    let replica_status = store::replicas(db, stored.id).await?;
    // Slices lent to training are not expected to serve until they come back.
    let serving = stored.replicas.saturating_sub(stored.loaned_slices);
    let (state, mut reason) = deployment_state(serving, &replica_status);
    if stored.loaned_slices > 0 && stored.replicas > 0 {
        let lent = format!("{} of its {} slices are lent to training.", stored.loaned_slices, stored.replicas);
        reason = Some(match reason {
            Some(r) => format!("{r} {lent}"),
            None => lent,
        });
    }
    // An SLO deployment the fleet could give no slice says why, not "scaled to zero".
    if let Some(slo) = stored.slo.as_ref().filter(|_| stored.replicas == 0) {
        reason = Some(slo.note.clone());
    }
    Ok(Deployment {
        id: stored.id,
        name: stored.name,
        model_id: stored.model_id,
        model_name: stored.model_name,
        owner: stored.owner,
        replicas: stored.replicas,
        ready_replicas: replica_status.iter().filter(|r| r.state == ServingState::Ready).count() as u32,
        state,
        reason,
        limits: stored.limits,
        replica_status,
        slo: stored.slo,
        loanable: stored.loanable,
        reclaim_headroom: stored.reclaim_headroom,
        loaned_slices: stored.loaned_slices,
        created_at: stored.created_at,
        updated_at: stored.updated_at,
    })
}

async fn find(db: &Db, scope: &Scope, id_or_name: &str) -> Result<StoredDeployment> {
    store::get(db, scope, id_or_name).await?.ok_or_else(|| Error::not_found(&format!("Deployment '{id_or_name}'")))
}

/// An SLO plan's transition steps may drain or move other deployments' replicas; a
/// caller who cannot see those deployments reads the step without their name.
fn hide_foreign_services(deployment: &mut Deployment, visible: &HashSet<String>) {
    if let Some(slo) = deployment.slo.as_mut() {
        for step in &mut slo.steps {
            if step.service.as_ref().is_some_and(|name| !visible.contains(name)) {
                step.service = None;
            }
        }
    }
}

/// A deployment in `scope`, by id or by name.
pub async fn resolve(db: &Db, scope: &Scope, id_or_name: &str) -> Result<Deployment> {
    let mut deployment = with_status(db, find(db, scope, id_or_name).await?).await?;
    if *scope != Scope::all() && deployment.slo.is_some() {
        let visible = store::list(db, scope).await?.into_iter().map(|d| d.name).collect();
        hide_foreign_services(&mut deployment, &visible);
    }
    Ok(deployment)
}

/// The deployments in `scope`, by name.
pub async fn list_visible(db: &Db, scope: &Scope) -> Result<Vec<Deployment>> {
    let mut deployments = Vec::new();
    for stored in store::list(db, scope).await? {
        deployments.push(with_status(db, stored).await?);
    }
    if *scope != Scope::all() {
        let visible: HashSet<String> = deployments.iter().map(|d| d.name.clone()).collect();
        for deployment in &mut deployments {
            hide_foreign_services(deployment, &visible);
        }
    }
    Ok(deployments)
}

fn check_replicas(replicas: u32) -> Result<()> {
    if replicas > MAX_REPLICAS {
        return Err(Error::invalid("invalid_replicas", format!("replicas must be between 0 and {MAX_REPLICAS}.")));
    }
    Ok(())
}

/// A loaning headroom in range, as a 422 that says what to give.
fn check_headroom(headroom: f64) -> Result<()> {
    tessera_api::deployments::check_reclaim_headroom(headroom).map_err(|m| Error::invalid("invalid_reclaim_headroom", m))
}

/// The job spec of each of the deployment's replicas.
pub fn replica_spec(deployment: &StoredDeployment) -> JobSpec {
    JobSpec::Serve { deployment: deployment.id, model: deployment.model_id, limits: deployment.limits }
}

/// Queues `count` new replicas of the deployment, on any worker that can serve them.
async fn queue_replicas(conn: &mut AnyConnection, deployment: &StoredDeployment, count: u32) -> Result<()> {
    let spec = replica_spec(deployment);
    let name = format!("replica of {}", deployment.name);
    let job = NewJob { deployment: Some(deployment.id), ..NewJob::new(deployment.owner_id, &name, &spec, REPLICA_MAX_ATTEMPTS) };
    for _ in 0..count {
        jobs::insert_in(conn, &job).await?;
    }
    Ok(())
}

/// Brings the number of live replicas to `wanted` less the slices it lent to training:
/// queues new ones, or cancels the least advanced ones (pending before loading before
/// ready, newest first). Runs in the caller's transaction, with the replica count it
/// stores, so two changes to one deployment cannot both count the same live replicas.
async fn reconcile(conn: &mut AnyConnection, deployment: &StoredDeployment, wanted: u32) -> Result<()> {
    let wanted = wanted.saturating_sub(deployment.loaned_slices);
    let replicas = store::replicas_in(conn, deployment.id).await?;
    let live: Vec<&Replica> = replicas.iter().filter(|r| r.state != ServingState::Failed).collect();
    let live_count = live.len() as u32;
    if live_count < wanted {
        queue_replicas(conn, deployment, wanted - live_count).await?;
    } else if live_count > wanted {
        let mut victims = live;
        victims.sort_by_key(|r| (r.state == ServingState::Ready, r.state == ServingState::Loading, std::cmp::Reverse(r.updated_at)));
        for replica in victims.into_iter().take((live_count - wanted) as usize) {
            store::scale_down(conn, replica.id).await?;
        }
    }
    Ok(())
}

/// A run that lasted this long ends a crash loop: the next restart is immediate again.
const HEALTHY_RUN_MS: i64 = 10 * 60 * 1000;
/// The back-off before the second restart in a row; it doubles with each, up to the cap.
const FIRST_BACKOFF_MS: i64 = 10_000;
const MAX_BACKOFF_MS: i64 = 5 * 60 * 1000;

/// How long after it ended a replica with `restarts` restarts in a row before this end is
/// restarted: at once the first time, then 10 s, 20 s, … up to 5 minutes (a crash loop
/// backs off as Kubernetes' does).
fn backoff_ms(restarts: u32) -> i64 {
    match restarts {
        0 => 0,
        n => FIRST_BACKOFF_MS.saturating_mul(1 << (n - 1).min(10)).min(MAX_BACKOFF_MS),
    }
}

/// The repair tick, for each deployment whose live replicas and lent slices do not add
/// up to its replica count:
/// - a replica-count deployment scaled below what it lent gives the surplus loans up (the
///   training on them goes on, and no replica is queued for them when it ends);
/// - replicas that ended (the engine crashed, failed to load, ran out of attempts as
///   workers came and went) while it is short are queued again in place, the latest to end
///   first, each after its back-off. An SLO deployment's replica keeps the slice its plan
///   pinned it to while that slice's worker was seen since `online_since` (ms);
/// - a replica-count deployment short by more than its ended replicas (a slice it lent
///   went with its worker) queues new ones.
///
/// Returns how many replicas were restarted or queued.
pub async fn repair(db: &Db, now: i64, online_since: i64) -> Result<u32> {
    let mut repaired = 0;
    for id in store::out_of_step(db).await? {
        let mut tx = db.begin().await?;
        // Under the row's lock, as a scale or the loaning round changes it.
        if !store::lock(&mut tx, db.backend(), id, crate::store::RowLock::Update).await? {
            continue;
        }
        let Some(deployment) = store::get_in(&mut tx, &Scope::all(), &id.to_string()).await? else {
            continue;
        };
        let counted = deployment.slo.is_none();
        let live = store::replicas_in(&mut tx, id).await?.iter().filter(|r| r.state != ServingState::Failed).count() as u32;
        let mut loaned = deployment.loaned_slices;
        if counted && loaned > 0 && live + loaned > deployment.replicas {
            let surplus = (live + loaned - deployment.replicas).min(loaned);
            loaned -= loaning_store::give_up_loans(&mut tx, id, surplus).await? as u32;
        }
        let short = deployment.replicas.saturating_sub(loaned).saturating_sub(live) as usize;
        let ended = store::ended_replicas_in(&mut tx, id).await?;
        let ended_count = ended.len();
        let due = ended.into_iter().filter_map(|ended| {
            let healthy = ended.started_at.is_some_and(|started| ended.finished_at - started >= HEALTHY_RUN_MS);
            let restarts = if healthy { 0 } else { ended.restarts };
            (now - ended.finished_at >= backoff_ms(restarts)).then_some((ended.id, restarts))
        });
        for (replica, restarts) in due.take(short).collect::<Vec<_>>() {
            if store::restart(&mut tx, replica, restarts + 1, online_since).await? {
                repaired += 1;
            }
        }
        // Those backing off will restart; only the rest are new.
        if counted {
            let missing = short.saturating_sub(ended_count) as u32;
            queue_replicas(&mut tx, &deployment, missing).await?;
            repaired += missing;
        }
        tx.commit().await?;
    }
    Ok(repaired)
}

/// Serves a model under a name for `principal`: with a replica count, or planned onto
/// MIG slices for a throughput SLO.
pub async fn create(state: &AppState, principal: &Principal, request: CreateDeployment) -> Result<Deployment> {
    let name = request.name.trim();
    crate::registry::check_name(Some(name), "deployment")?;
    check_replicas(request.replicas)?;
    if let Some(throughput) = request.throughput {
        slo::check(throughput, request.latency_ms)?;
    }
    request.limits.validate().map_err(|message| Error::invalid("invalid_batching", message))?;
    if let Some(headroom) = request.reclaim_headroom {
        check_headroom(headroom)?;
    }
    let model = crate::registry::resolve(state, principal, &request.model).await?;
    if request.throughput.is_some() {
        slo::check_table(&state.db, model.id, &model.name).await?;
    }
    let id = Uuid::new_v4();
    let new = NewDeployment {
        id,
        owner: principal.id,
        name,
        model: model.id,
        replicas: request.replicas,
        limits: request.limits,
        loanable: request.loanable,
        reclaim_headroom: request.reclaim_headroom.unwrap_or(tessera_api::deployments::DEFAULT_RECLAIM_HEADROOM),
    };
    // An SLO is planned before anything is written and applied in the transaction that
    // stores the row, so a refused plan (no profile meets the latency, the replica quota)
    // leaves no deployment behind to block a corrected retry under the same name. The
    // quota check, the row and its replicas are one transaction (see `quotas`); the plan
    // comes with its own, which holds the planning lock on PostgreSQL.
    let (planned, mut tx) = match request.throughput {
        Some(throughput) => {
            let (planned, tx) = slo::plan(state, id, name, &model, throughput, request.latency_ms).await?;
            (Some(planned), tx)
        }
        None => (None, state.db.begin().await?),
    };
    if planned.is_none() {
        crate::quotas::check_replicas(state, &mut tx, principal, request.replicas, None).await?;
    }
    crate::registry::hold(&state.db, &mut tx, model.id).await?;
    store::insert(&mut tx, &new).await.map_err(|e| {
        if e.is_unique_violation() {
            Error::Conflict(format!("A deployment named '{name}' already exists; pick another name."))
        } else {
            e.into()
        }
    })?;
    let scope = principal.scope();
    let deployment = store::get_in(&mut tx, &scope, &id.to_string())
        .await?
        .ok_or(Error::Invariant("a deployment just inserted cannot be read back"))?;
    match &planned {
        Some(planned) => slo::apply(state, &mut tx, principal, &deployment, planned).await?,
        None => reconcile(&mut tx, &deployment, request.replicas).await?,
    }
    tx.commit().await?;
    // Only now may the next SLO deployment be planned: it sees these replicas' slices.
    drop(planned);
    resolve(&state.db, &scope, &id.to_string()).await
}

/// Changes the number of replicas of a deployment `principal` may see.
pub async fn scale(state: &AppState, principal: &Principal, id_or_name: &str, replicas: u32) -> Result<Deployment> {
    update(state, principal, id_or_name, UpdateDeployment { replicas: Some(replicas), ..UpdateDeployment::default() }).await
}

/// Changes any of the replica count, whether the deployment lends idle slices to
/// training, and its headroom. Checked whole before anything changes.
pub async fn update(
    state: &AppState,
    principal: &Principal,
    id_or_name: &str,
    request: UpdateDeployment,
) -> Result<Deployment> {
    if request.replicas.is_none() && request.loanable.is_none() && request.reclaim_headroom.is_none() {
        return Err(Error::invalid(
            "empty_update",
            "Give at least one of \"replicas\", \"loanable\" or \"reclaim_headroom\" to change.",
        ));
    }
    if let Some(replicas) = request.replicas {
        check_replicas(replicas)?;
    }
    if let Some(headroom) = request.reclaim_headroom {
        check_headroom(headroom)?;
    }
    let scope = principal.scope();
    let deployment = find(&state.db, &scope, id_or_name).await?;
    if request.reclaim_headroom.is_some() && !request.loanable.unwrap_or(deployment.loanable) {
        return Err(Error::invalid(
            "invalid_reclaim_headroom",
            "reclaim_headroom applies to a loanable deployment: send \"loanable\": true with it.",
        ));
    }
    if request.replicas.is_some() && deployment.slo.is_some() {
        return Err(Error::invalid(
            "slo_deployment",
            "This deployment is sized by its throughput SLO; delete it and create it again with the new throughput or with replicas.",
        ));
    }
    // The replica change first: its quota check is the last refusal, so a refused request
    // changes nothing.
    if let Some(replicas) = request.replicas {
        let mut tx = state.db.begin().await?;
        crate::quotas::check_replicas(state, &mut tx, principal, replicas, Some(deployment.id)).await?;
        // Read again under the row's lock: a loan made since the first read (the loaning
        // round shares the lock) changed what it lends.
        let current = match store::set_replicas(&mut tx, deployment.id, replicas).await? {
            true => store::get_in(&mut tx, &Scope::all(), &deployment.id.to_string()).await?,
            false => None,
        };
        let Some(current) = current else {
            return Err(Error::NotFound(format!("Deployment '{}' was deleted meanwhile.", deployment.name)));
        };
        reconcile(&mut tx, &current, replicas).await?;
        tx.commit().await?;
    }
    if request.loanable.is_some() || request.reclaim_headroom.is_some() {
        // What it lent comes back through the loaning round's reclaim, not at once.
        loaning_store::set_loanable(&state.db, deployment.id, request.loanable, request.reclaim_headroom).await?;
    }
    resolve(&state.db, &scope, id_or_name).await
}

/// Stops serving: every replica is stopped at its worker's next heartbeat.
pub async fn delete(state: &AppState, principal: &Principal, id_or_name: &str) -> Result<()> {
    let deployment = find(&state.db, &principal.scope(), id_or_name).await?;
    store::delete(&state.db, deployment.id).await?;
    state.gateway.stats.forget(deployment.id);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replica(state: ServingState, message: Option<&str>) -> Replica {
        Replica {
            id: Uuid::new_v4(),
            state,
            worker_id: None,
            message: message.map(Into::into),
            attempts: 1,
            endpoint: None,
            slice: None,
            updated_at: chrono::DateTime::default(),
        }
    }

    #[test]
    fn a_crash_loop_backs_off_doubling_up_to_five_minutes() {
        let waits: Vec<i64> = (0..12).map(backoff_ms).collect();
        assert_eq!(&waits[..6], &[0, 10_000, 20_000, 40_000, 80_000, 160_000]);
        assert!(waits[6..].iter().all(|&w| w == MAX_BACKOFF_MS), "{waits:?}");
        assert_eq!(backoff_ms(u32::MAX), MAX_BACKOFF_MS);
    }

    #[test]
    fn deployment_is_ready_only_when_every_wanted_replica_is() {
        let two_ready = [replica(ServingState::Ready, None), replica(ServingState::Ready, None)];
        assert_eq!(deployment_state(2, &two_ready).0, ServingState::Ready);
        assert_eq!(deployment_state(3, &two_ready).0, ServingState::Loading);
    }

    #[test]
    fn deployment_fails_with_the_replicas_reason_when_none_can_serve() {
        let failed = [replica(ServingState::Failed, Some("config.json: unsupported"))];
        let (state, reason) = deployment_state(1, &failed);
        assert_eq!(state, ServingState::Failed);
        assert_eq!(reason.as_deref(), Some("config.json: unsupported"));
    }

    #[test]
    fn pending_deployment_says_it_waits_for_a_worker() {
        let (state, reason) = deployment_state(1, &[replica(ServingState::Pending, None)]);
        assert_eq!(state, ServingState::Pending);
        assert!(reason.unwrap().contains("waiting for a worker"));
    }
}
