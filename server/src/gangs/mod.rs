//! Data-parallel training jobs as gangs (issue 12): queueing a job's ranks, handing them
//! to workers that can host them, the rendezvous at which the ranks learn each other's
//! ring addresses, and keeping a gang's job in step with its ranks. How a gang is
//! claimed all or none is `store::gangs`' doc comment.
//!
//! Elastic gangs (issue 16): a gang is queued at its `max_ranks` (every device its spec
//! lists). While it waits (queued, or preempted) [`resize`] sets the rank count its next
//! formation runs at, `min_ranks..=max_ranks`: the first n devices of `parallel.ranks`.
//! The loaning round picks that count (a pull-based claim cannot see what the whole fleet
//! has free). A running gang changes its count in place ([`regroup_in_place`], the
//! `…/regroup` endpoint; how in `store::regroup`), or by a stop and restart when it cannot
//! (`loaning` module doc).

use axum::extract::State;
use sqlx::AnyConnection;
use tessera_api::jobs::JobSpec;
use tessera_api::parallel::{
    ParallelSpec, RankJob, RegroupRequest, RegroupResponse, RendezvousRequest, RendezvousResponse,
};
use tessera_api::train::TrainJob;
use uuid::Uuid;

use crate::auth::AgentAuth;
use crate::error::{ApiJson, ApiPath, Error, Result};
use crate::state::AppState;
use crate::store::db::{now_ms, Db};
use crate::store::gangs::{self as store, RankOf, Rendezvous};
use crate::store::regroup::{self, Joiner, Regroup};
use crate::store::jobs::{self as jobs_store, Claimed, NewJob};

/// The rank rows of `gang` at `world` ranks: the first `world` devices of `parallel`.
fn rank_rows(gang: Uuid, train: &TrainJob, parallel: &ParallelSpec, world: u32) -> Vec<(String, RankJob)> {
    parallel.ranks[..world as usize]
        .iter()
        .enumerate()
        .map(|(rank, device)| {
            let spec =
                RankJob { gang, rank: rank as u32, world, device: device.clone(), train: train.clone(), joining: false };
            (device.placement(), spec)
        })
        .collect()
}

/// Queues a data-parallel job inside the caller's transaction: its job row and one rank
/// row per entry of `parallel` (an elastic job starts at its most ranks; see [`resize`]).
pub async fn queue(conn: &mut AnyConnection, job: &NewJob<'_>, train: &TrainJob, parallel: &ParallelSpec) -> Result<Uuid> {
    let ranks = rank_rows(Uuid::nil(), train, parallel, parallel.ranks.len() as u32);
    Ok(store::insert_in(conn, job, &ranks).await?)
}

/// Sets the rank count of a waiting elastic gang's next formation to `world` (within its
/// `resources`, `min_ranks..=max_ranks`); it resumes from its last checkpoint at that
/// count. 409 while the gang runs or forms (preempt it first: `jobs::preempt_job`), 422
/// for a count outside its range, 404 for a job that is not a data-parallel one.
pub async fn resize(db: &Db, gang: Uuid, world: u32) -> Result<()> {
    let Some(JobSpec::Train(train)) = jobs_store::spec(db, gang).await? else {
        return Err(Error::not_found("Data-parallel job"));
    };
    let Some(parallel) = &train.parallel else {
        return Err(Error::not_found("Data-parallel job"));
    };
    let resources = train.resources();
    if !(resources.min_ranks..=resources.max_ranks).contains(&world) {
        return Err(Error::invalid(
            "invalid_ranks",
            format!("This job runs at {} to {} ranks, not {world}.", resources.min_ranks, resources.max_ranks),
        ));
    }
    if !store::reshape(db, gang, &rank_rows(gang, &train, parallel, world)).await? {
        return Err(Error::Conflict(
            "The gang is running or forming; resize it while it waits (queued or preempted).".into(),
        ));
    }
    Ok(())
}

/// Asks running gang `gang` (of `train`) to change from `from` to `to` ranks in place:
/// `leaving` (rank rows) leave when it shrinks; when it grows, ranks `from..to` of its
/// spec's devices join, pinned to `slices` (one each, in order) when they run on MIG
/// slices. False when the gang cannot now (it is not running, or a regroup or preemption
/// is under way).
pub async fn regroup_in_place(
    state: &AppState,
    gang: Uuid,
    train: &TrainJob,
    (from, to): (u32, u32),
    leaving: &[Uuid],
    slices: &[String],
) -> Result<bool> {
    let Some(parallel) = &train.parallel else {
        return Ok(false);
    };
    let joining: Vec<Joiner> = rank_rows(gang, train, parallel, to.max(from))
        .into_iter()
        .skip(from as usize)
        .enumerate()
        .map(|(i, (placement, spec))| Joiner {
            placement,
            spec: RankJob { joining: true, ..spec },
            slice: slices.get(i).cloned(),
        })
        .collect();
    let deadline = now_ms() + state.config.gang_rendezvous_secs as i64 * 1000;
    Ok(regroup::request(&state.db, gang, to, leaving, &joining, deadline).await?)
}

/// Leases `worker` a rank of the oldest gang it can host, if any; with `slices_only`, only
/// a rank pinned to one of its slices.
pub async fn claim_rank(state: &AppState, worker: Uuid, lease_ttl_ms: i64, slices_only: bool) -> Result<Option<Claimed>> {
    let mut placements = store::placements(&state.db, worker).await?;
    if slices_only {
        placements.retain(|p| p.starts_with("slice:"));
    }
    let deadline = now_ms() + state.config.gang_rendezvous_secs as i64 * 1000;
    Ok(store::claim_rank(&state.db, worker, &placements, lease_ttl_ms, deadline).await?)
}

/// The job `worker` reports on through `job`: the job itself, or for a rank its gang's
/// job (metrics, checkpoints and logs of a gang live there). 409 unless it holds `job`.
pub async fn leased_job(state: &AppState, worker: Uuid, job: Uuid) -> Result<(Uuid, Option<RankOf>)> {
    if !jobs_store::holds_lease(&state.db, worker, job).await? {
        return Err(Error::Conflict(
            "This worker does not hold the job's lease (it expired or the job was cancelled); stop it.".into(),
        ));
    }
    Ok(match store::rank_of(&state.db, job).await? {
        Some(rank) => (rank.gang, Some(rank)),
        None => (job, None),
    })
}

/// The worker holding each rank of data-parallel job `gang`, by rank (see
/// `store::gangs::rank_workers`).
pub async fn rank_workers(db: &Db, gang: Uuid) -> Result<Vec<(u32, Option<Uuid>)>> {
    Ok(store::rank_workers(db, gang).await?)
}

/// After a rank's status changed, or a gang's job was cancelled: bring the gang's job and
/// its ranks in line (nothing for other jobs).
pub async fn settle(db: &Db, job: Uuid) -> Result<()> {
    let gang = store::rank_of(db, job).await?.map_or(job, |rank| rank.gang);
    store::sweep(db, now_ms(), Some(gang)).await?;
    Ok(())
}

/// Releases the claimed ranks of a gang still forming (for a preemption: nothing trains
/// yet, so nothing is checkpointed); false when `gang` is not forming.
pub async fn release_forming(db: &Db, gang: Uuid, reason: &str) -> Result<bool> {
    Ok(store::release_forming(db, gang, now_ms(), reason).await?)
}

/// A ring address is handed to the other ranks to connect to: a host with a control
/// character or a space (a NUL would also fail PostgreSQL's insert) is none they can reach.
fn check_address(address: &str) -> Result<()> {
    let valid = address.len() <= 300
        && address.rsplit_once(':').is_some_and(|(host, port)| {
            !host.is_empty()
                && !host.chars().any(|c| c.is_control() || c.is_whitespace())
                && port.parse::<u16>().is_ok_and(|p| p > 0)
        });
    if valid {
        Ok(())
    } else {
        Err(Error::invalid(
            "invalid_address",
            "Post the ring address as host:port, a host without spaces or control characters and a port above 0.",
        ))
    }
}

/// Post where this rank accepts its ring neighbour, and learn whether the gang formed
/// (every rank's address, by rank) or is still waiting. 409 once the rank is no longer
/// this worker's (the gang was released after its rendezvous time-out, or requeued).
#[utoipa::path(post, path = "/api/v1/agent/jobs/{id}/rendezvous", tag = "agent", security(("worker" = [])),
    params(("id" = Uuid, Path)), request_body = RendezvousRequest,
    responses((status = 200, body = RendezvousResponse), (status = 409, body = tessera_api::error::ErrorBody),
              (status = 422, body = tessera_api::error::ErrorBody)))]
pub async fn rendezvous(
    State(state): State<AppState>,
    agent: AgentAuth,
    ApiPath(job): ApiPath<Uuid>,
    ApiJson(request): ApiJson<RendezvousRequest>,
) -> Result<ApiJson<RendezvousResponse>> {
    check_address(&request.address)?;
    if let Some(rank) = store::rank_of(&state.db, job).await? {
        // A gang past its deadline is released before anyone waits on it longer.
        store::sweep(&state.db, now_ms(), Some(rank.gang)).await?;
    }
    match store::rendezvous(&state.db, agent.worker_id, job, &request.address).await? {
        Rendezvous::NotHeld => Err(Error::Conflict(
            "This worker does not hold this rank (the gang did not form in time and was released, or was requeued); drop it."
                .into(),
        )),
        Rendezvous::Waiting => Ok(ApiJson(RendezvousResponse::Waiting)),
        Rendezvous::Formed { generation, peers } => Ok(ApiJson(RendezvousResponse::Formed { generation, peers })),
    }
}

/// Post where this rank accepts its ring neighbour in its gang's new world (the gang grows
/// or shrinks in place, `store::regroup`): a rank of the gang once it stopped at the step
/// the ranks agreed on, a joining rank once it is ready. The answer: wait, the new world
/// formed (this rank's new number, the world, every rank's address), leave the gang, or
/// stop (the gang was preempted instead: report `preempted`). 409 once the rank is no
/// longer this worker's (a joining rank whose regroup was called off).
#[utoipa::path(post, path = "/api/v1/agent/jobs/{id}/regroup", tag = "agent", security(("worker" = [])),
    params(("id" = Uuid, Path)), request_body = RegroupRequest,
    responses((status = 200, body = RegroupResponse), (status = 409, body = tessera_api::error::ErrorBody),
              (status = 422, body = tessera_api::error::ErrorBody)))]
pub async fn regroup(
    State(state): State<AppState>,
    agent: AgentAuth,
    ApiPath(job): ApiPath<Uuid>,
    ApiJson(request): ApiJson<RegroupRequest>,
) -> Result<ApiJson<RegroupResponse>> {
    check_address(&request.address)?;
    let deadline = now_ms() + state.config.gang_rendezvous_secs as i64 * 1000;
    let answer = regroup::post(&state.db, agent.worker_id, job, &request.address, request.generation, deadline).await?;
    Ok(ApiJson(match answer {
        Regroup::NotHeld => {
            return Err(Error::Conflict(
                "This worker does not hold this rank (its gang's resize was called off, or it was requeued); drop it."
                    .into(),
            ))
        }
        Regroup::Waiting => RegroupResponse::Waiting,
        Regroup::Formed { generation, rank, world, peers } => RegroupResponse::Formed { generation, rank, world, peers },
        Regroup::Leave => RegroupResponse::Leave,
        Regroup::Stop => RegroupResponse::Stop,
    }))
}
