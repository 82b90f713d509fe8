//! Capacity loaning and elastic training in the server (issue 16, Aryl): the periodic
//! scheduling round that reads the fleet from the store, decides what each loanable
//! deployment lends (`scheduler::loaning::capacity`), plans training on the slices per MIG
//! profile (`scheduler::loaning::round::plan_round`) and applies the plan: slices lent or
//! reclaimed, waiting gangs sized and pinned to slices, reclaimed jobs preempted.
//!
//! One server runs the round at a time: it holds the `loaning` row of
//! `scheduler_leases` (a conditional upsert, the same on SQLite and PostgreSQL) for three
//! round periods and renews it every period while its round runs (`lease`), so a round
//! that runs longer keeps it; one whose renewals fail until the lease nearly lapses is
//! stopped there, before another server may take over. Every server records its own
//! gateway's request rates, which the round sums.
//!
//! A running elastic gang is resized in place (`store::regroup`): its ranks keep their
//! processes and state, joining ranks are pinned to the new slices (`InPlace::Grow`; free
//! ones first, then ones ranks leaving in place give up, whose joiners are claimable once
//! the leaving ranks are gone; a grow onto slices still held otherwise, by a gang that
//! stops, waits a round, `InPlace::Later`), leaving ones are those on the slices the plan
//! gives up (`InPlace::Shrink`), and the ring re-forms at the new world at one step. Starts
//! take slices ranks leave the same way. A gang mid-regroup counts at its new world and is
//! not resized by choice until it forms; a reclaim that needs its slices cuts the regroup
//! back instead of preempting it (`store::regroup::cut`: joiners there are dropped,
//! running ranks there leave). A move
//! between pools (a reclaim takes a rank's slice, the plan gives it another) shrinks out
//! of the pools it leaves now and grows into the others at a later round, as soon as the
//! shrink formed (`store::set_regrow`: the hysteresis does not hold that grow back). The round plans
//! a resize as a pause of `--gang-regroup-secs`. Training state is independent of the
//! world size (a fixed global batch split in shares, one loader position), so the gang
//! continues the same run. A move whose shrink would leave the gang below its minimum, or
//! a resize of a job with a precision plan (its plan is per world), is a stop and a
//! restart instead: the round records the size it wants (`resize_ranks`), preempts the
//! gang (it checkpoints at the step it is on and stops, `jobs::preempt_job`), and when
//! the gang waits again places it first at up to that size (`gangs::resize`, then rank
//! pins). Against churn: a grow or shrink by choice must predict a JCT gain above twice
//! the pause (`RESIZE_MARGIN`), and a gang keeps its size for `RESIZE_COOLDOWN_ROUNDS`
//! rounds after it formed or re-formed; a reclaim shrinks it (to at least `min_ranks`)
//! before preempting anyone, whenever it comes. Each resize goes in the job's log; a
//! shrink for a reclaim is also a reclaim event (not preempted).
//!
//! Departures from the pure planner's model, forced by the platform: a running elastic
//! job that is not `preemptible` is treated as inelastic (a resize is a preemption); a
//! job's ranks all ask for one MIG profile, so each profile is its own round.

pub mod lease;
pub mod preempt;
pub mod routes;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::Duration;

use tessera_api::loaning::{LoanRound, LoanState as SliceLoan, PredictedFrom};
use uuid::Uuid;

use crate::error::Result;
use crate::scheduler::loaning::step_times::share_priors;
use crate::scheduler::loaning::{
    capacity, forecast, plan_round, Job, LoanPolicy, LoanState, Pool, Round, StepTimes,
};
use crate::state::AppState;
use crate::store::db::now_ms;
use crate::store::deployments::{self as deployments_store, StoredDeployment};
use crate::store::jobs::{self as jobs_store, NewJob};
use crate::store::loaning::{
    self as store, FleetSlice, GangRank, Holder, NewReclaim, SliceGang, TrainingPlan, ANOTHER_USERS_DEPLOYMENT,
};
use crate::store::{models, Scope};

/// The `scheduler_leases` row of the round.
const LEASE: &str = "loaning";
/// Rounds a running gang keeps its size after it formed before the round may resize it
/// by choice (a reclaim may shrink it sooner): at the default 5 s rounds, 50 s plus the
/// restart, time for its step time at the new size to be measured.
pub const RESIZE_COOLDOWN_ROUNDS: u32 = 10;
/// A resize by choice must predict a JCT gain above the pause by this fraction of it:
/// twice the pause, so a step-time estimate off by a pause's worth does not flap it.
pub const RESIZE_MARGIN: f64 = 1.0;
/// Steps of a gang's timing whose median is its step time at a rank count: each count's
/// newest, however old (a count forgotten would re-anchor the prior on one noisy point and
/// invite resizing back to it, issue 16's simulator).
const STEP_WINDOW: usize = 50;
/// Gateway buckets (5 s each) a measured request rate spans: short, so a demand spike
/// reaches the round within seconds.
const RATE_BUCKETS: u64 = 2;
/// History the dashboard shows, and how long it is kept.
const HISTORY_MS: i64 = 24 * 3600 * 1000;

/// What one round did, for logs and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RoundReport {
    /// This server held the lease throughout and ran the round.
    pub led: bool,
    pub lent: u32,
    pub reclaiming: u32,
    pub returned: u32,
    pub started: u32,
    pub preempted: u32,
    /// Running gangs resized: in place, or stopped to restart at another size.
    pub resized: u32,
}

/// Runs the round every `loan_round_secs` and records this server's request rates, until
/// the server stops.
pub fn spawn(state: AppState) {
    let server = Uuid::new_v4();
    let period = Duration::from_secs(state.config.loan_round_secs.max(1));
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(period);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            if let Err(e) = record_rates(&state, server).await {
                tracing::warn!(error = %e, "recording request rates failed");
            }
            match lead_and_run(&state, server).await {
                Ok(report)
                    if report.lent
                        + report.reclaiming
                        + report.returned
                        + report.started
                        + report.preempted
                        + report.resized
                        > 0 =>
                {
                    tracing::info!(?report, "loaning round")
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "loaning round failed"),
            }
        }
    });
}

/// This server's gateway rate of every deployment, into the store.
pub async fn record_rates(state: &AppState, server: Uuid) -> Result<()> {
    let deployments = deployments_store::list(&state.db, &Scope::all()).await?;
    let rates: Vec<(Uuid, f64)> = deployments
        .iter()
        .map(|d| (d.id, state.gateway.stats.recent_rate(d.id, RATE_BUCKETS)))
        .collect();
    store::record_rates(&state.db, server, &rates).await?;
    Ok(())
}

/// Takes (or renews) the round's lease and runs the round when this server holds it,
/// keeping the lease while it runs.
pub async fn lead_and_run(state: &AppState, server: Uuid) -> Result<RoundReport> {
    let ttl = 3 * Duration::from_secs(state.config.loan_round_secs.max(1));
    match lease::lead_while(&state.db, LEASE, server, ttl, run_round(state)).await? {
        Some(report) => Ok(RoundReport { led: true, ..report? }),
        None => Ok(RoundReport::default()),
    }
}

/// A deployment as this round sees it: its slices by what they do.
struct Lender<'a> {
    deployment: &'a StoredDeployment,
    /// Slices its live replicas hold (serving state), by worker, GPU and start; the loan
    /// takes them from the end.
    bound: Vec<&'a FleetSlice>,
    loaned: Vec<&'a FleetSlice>,
    /// Slices on their way back: still the deployment's, neither serving nor lent.
    reclaiming: usize,
}

/// Requests per second one of `slices` serves for `model`: the throughput table's best
/// within the SLO's latency (any latency without one), the weakest slice's figure when
/// they differ; 0 (nothing is known to be idle) without a table row.
async fn slice_rate(state: &AppState, d: &StoredDeployment, slices: &[&FleetSlice]) -> Result<f64> {
    let table = models::measured_profiles(&state.db, d.model_id).await?;
    let latency = d.slo.as_ref().and_then(|s| s.latency_ms);
    let mut rate = f64::INFINITY;
    for s in slices {
        let best = table
            .iter()
            .filter(|r| {
                Some(&r.gpu_model) == s.gpu_model.as_ref() && Some(&r.profile) == s.profile.as_ref()
            })
            .filter(|r| latency.is_none_or(|l| r.p99_ms <= l))
            .map(|r| r.throughput)
            .fold(0.0, f64::max);
        rate = rate.min(best);
    }
    Ok(if rate.is_finite() { rate } else { 0.0 })
}

/// For an SLO deployment, its plan's requests per second on each of `slices` it still has
/// (its serving floor's figures); `None` when a replica count sized it.
fn planned_rates(d: &StoredDeployment, slices: &[&FleetSlice]) -> Option<Vec<f64>> {
    let slo = d.slo.as_ref()?;
    Some(
        slo.slices
            .iter()
            .filter(|p| slices.iter().any(|s| s.uuid == p.slice))
            .map(|p| p.throughput)
            .collect(),
    )
}

/// The name of `lender` in what the owner `reader` of a job it takes slices from reads
/// (the job's log and preemption reason): another user's deployment is not named, as on
/// the fleet page.
fn lender_as_seen_by(lender: &StoredDeployment, reader: Uuid) -> &str {
    if lender.owner_id == reader {
        &lender.name
    } else {
        ANOTHER_USERS_DEPLOYMENT
    }
}

/// One scheduling round; see the module comment. The caller holds the round's lease
/// (tests call it directly).
pub async fn run_round(state: &AppState) -> Result<RoundReport> {
    let db = &state.db;
    let now = now_ms();
    let restart_secs = state.config.gang_restart_secs as f64;
    let regroup_secs = state.config.gang_regroup_secs as f64;
    let mut report = RoundReport::default();
    store::release_orphans(db).await?;
    let online_since = crate::workers::online_since(state);
    let fleet = store::fleet(db, online_since).await?;
    let deployments = deployments_store::list(db, &Scope::all()).await?;
    let rates = store::rates(
        db,
        now - 3 * state.config.loan_round_secs.max(1) as i64 * 1000,
    )
    .await?;

    // 1. What each deployment lends: grow the loan now, or mark slices to take back.
    let mut lenders: Vec<Lender> = deployments
        .iter()
        .map(|d| Lender {
            deployment: d,
            bound: fleet
                .iter()
                .filter(|s| s.loan_state == SliceLoan::Serving)
                .filter(|s| matches!(s.holder, Holder::Replica { deployment, .. } if deployment == d.id))
                .collect(),
            loaned: fleet.iter().filter(|s| s.lender == Some(d.id) && s.loan_state == SliceLoan::Loaned).collect(),
            reclaiming: fleet
                .iter()
                .filter(|s| s.lender == Some(d.id) && s.loan_state == SliceLoan::Reclaiming)
                .count(),
        })
        .collect();
    // Slices to take back per lender, chosen after the plan picks whom it preempts.
    let mut take_back: HashMap<Uuid, u32> = HashMap::new();
    let mut newly_loaned: Vec<(Uuid, String)> = Vec::new();
    for lender in &mut lenders {
        let d = lender.deployment;
        if !d.loanable && lender.loaned.is_empty() {
            continue;
        }
        let all: Vec<&FleetSlice> = lender.bound.iter().chain(&lender.loaned).copied().collect();
        let measured_rate = rates.get(&d.id).copied().unwrap_or(0.0);
        let planned = planned_rates(d, &all);
        let sizing = planned
            .as_deref()
            .map_or(capacity::Sizing::Replicas, |planned| {
                capacity::Sizing::Slo { planned }
            });
        let view = capacity::Deployment {
            // A slice still being taken back counts, or the loan would shrink once more
            // while the deployment waits for it.
            slices: (all.len() + lender.reclaiming) as u32,
            min_serving: capacity::serving_floor(&sizing, measured_rate, d.reclaim_headroom),
            slice_rate: slice_rate(state, d, &all).await?,
            measured_rate,
            loanable: d.loanable,
        };
        let policy = LoanPolicy {
            headroom: d.reclaim_headroom,
            ..LoanPolicy::default()
        };
        let prev = LoanState {
            loaned: lender.loaned.len() as u32,
            calm: d.loan_calm,
        };
        let next = capacity::next_loan(&view, &policy, prev);
        store::set_calm(db, d.id, next.calm).await?;
        if next.loaned > prev.loaned {
            let detail = format!(
                "lent by {}: {:.1} req/s measured, {:.1} req/s per slice, {:.0}% headroom",
                d.name,
                view.measured_rate,
                view.slice_rate,
                d.reclaim_headroom * 100.0
            );
            for slice in lender
                .bound
                .iter()
                .rev()
                .take((next.loaned - prev.loaned) as usize)
            {
                let replica = match slice.holder {
                    Holder::Replica { job, .. } => Some(job),
                    _ => None,
                };
                if store::lend(db, &slice.uuid, d.id, replica, &detail).await? {
                    newly_loaned.push((d.id, slice.uuid.clone()));
                    report.lent += 1;
                }
            }
        } else if next.loaned < prev.loaned {
            take_back.insert(d.id, prev.loaned - next.loaned);
        }
    }
    // The fleet again, with this round's loans.
    let fleet = if newly_loaned.is_empty() {
        fleet
    } else {
        store::fleet(db, online_since).await?
    };

    // 2. Free loaned slices go back first; the rest of each take-back is the plan's.
    let mut reclaim_now: HashSet<String> = HashSet::new();
    for (&d, need) in take_back.iter_mut() {
        for s in fleet.iter().filter(|s| {
            s.lender == Some(d) && s.loan_state == SliceLoan::Loaned && s.holder == Holder::Free
        }) {
            if *need == 0 {
                break;
            }
            reclaim_now.insert(s.uuid.clone());
            *need -= 1;
        }
    }

    // 3. Plan training per MIG profile.
    let gangs = store::slice_gangs(db).await?;
    // The oldest of the newest `RESIZE_COOLDOWN_ROUNDS` rounds, once there are as many.
    let newest = store::newest_rounds(db, RESIZE_COOLDOWN_ROUNDS).await?;
    let cooldown_from = newest.get(RESIZE_COOLDOWN_ROUNDS as usize - 1).copied();
    let lender_ids: Vec<Uuid> = deployments.iter().map(|d| d.id).collect();
    let pool_of = |s: &FleetSlice| match (s.loan_state, s.lender) {
        (SliceLoan::Serving, _) => Some(Pool::Training),
        (_, Some(l)) => lender_ids.iter().position(|&x| x == l).map(Pool::Loaned),
        (_, None) => None,
    };
    let profiles: BTreeSet<&str> = fleet.iter().filter_map(|s| s.profile.as_deref()).collect();
    // Running first, then waiting jobs by predicted start (never last), then as read.
    let mut plans: Vec<((bool, i64, usize), TrainingPlan)> = Vec::new();
    let mut notes: Vec<String> = Vec::new();
    for profile in profiles {
        let slices: Vec<&FleetSlice> = fleet
            .iter()
            .filter(|s| s.profile.as_deref() == Some(profile))
            .collect();
        let mine: Vec<&SliceGang> = gangs
            .iter()
            .filter(|g| g.profile() == Some(profile))
            .collect();
        // Capacity: free or rank-held serving slices, and each lender's loaned slices
        // that stay lent (its take-back, less the free ones already chosen).
        let mut capacity: HashMap<Pool, u32> = HashMap::new();
        for s in &slices {
            let Some(pool) = pool_of(s) else { continue };
            let usable = match s.loan_state {
                SliceLoan::Serving => matches!(s.holder, Holder::Free | Holder::Rank { .. }),
                SliceLoan::Loaned => !reclaim_now.contains(&s.uuid),
                SliceLoan::Reclaiming => false,
            };
            *capacity.entry(pool).or_default() += u32::from(usable);
        }
        // A lender's remaining take-back comes off its held loaned slices of this profile.
        // Held slices each lender takes back in this profile, marked once the plan says
        // whom that preempts.
        let mut cuts: HashMap<Uuid, u32> = HashMap::new();
        let lenders_back: Vec<(Uuid, u32)> = take_back.iter().map(|(&d, &n)| (d, n)).collect();
        for (d, need) in lenders_back {
            if let Some(i) = lender_ids.iter().position(|&x| x == d) {
                let c = capacity.entry(Pool::Loaned(i)).or_default();
                let cut = need.min(*c);
                *c -= cut;
                take_back.insert(d, need - cut);
                cuts.insert(d, cut);
            }
        }
        let mut jobs = Vec::new();
        for g in &mine {
            let ranks = g.world();
            let wanted = g.train.resources();
            let waiting = g.waiting();
            // Running, it may change size, but not while a stop is under way; mid-regroup
            // only a reclaim may shrink it (see the resize loop below).
            let elastic = wanted.max_ranks > wanted.min_ranks && wanted.preemptible && !g.stopping;
            let mut holdings: HashMap<Pool, u32> = HashMap::new();
            if !waiting {
                for r in g.ranks.iter().filter(|r| !r.leaving) {
                    let pool = r
                        .slice
                        .as_ref()
                        .and_then(|u| slices.iter().find(|s| &s.uuid == u))
                        .and_then(|s| pool_of(s))
                        .unwrap_or(Pool::Training);
                    *holdings.entry(pool).or_default() += 1;
                }
            }
            let (min, max) = if waiting {
                // Restarting from a resize: at most the size the round stopped it for.
                let max = wanted.max_ranks.max(wanted.min_ranks);
                let max = g.resize_ranks.map_or(max, |n| n.clamp(wanted.min_ranks, max));
                (wanted.min_ranks, max)
            } else if elastic && g.regrouping {
                (wanted.min_ranks.min(ranks), ranks)
            } else if elastic {
                (wanted.min_ranks.min(ranks), wanted.max_ranks.max(ranks))
            } else {
                (ranks, ranks)
            };
            // Cooled down: at least `RESIZE_COOLDOWN_ROUNDS` rounds recorded since it formed,
            // or shrunk for a move a reclaim split, whose size the round chose already.
            let cooled = g.regrow
                || match (g.formed_at, cooldown_from) {
                    (Some(formed), Some(oldest)) => formed <= oldest,
                    _ => false,
                };
            let resizable = elastic && !g.regrouping && !waiting && cooled;
            let measured = match g.measured {
                true => store::step_secs_by_count(db, g.id, STEP_WINDOW).await?,
                false => Vec::new(),
            };
            let step_secs = StepTimes::from_recent(measured, STEP_WINDOW);
            jobs.push(Job {
                min_ranks: min,
                max_ranks: max,
                requested_ranks: ranks.clamp(min, max),
                preemptible: wanted.preemptible,
                remaining_steps: g.train.max_steps.saturating_sub(g.progress_step) as f64,
                step_secs,
                checkpoint_age_secs: (now - g.last_safe_at).max(0) as f64 / 1000.0,
                restart_secs,
                holdings: holdings.into_iter().collect(),
                resizable,
                resuming: waiting && g.resize_ranks.is_some(),
            });
        }
        // A job nothing was measured of takes a step as long as measured jobs of the same
        // model and global batch on this profile do.
        let kinds: Vec<_> = mine
            .iter()
            .map(|g| (&g.train.model, g.train.batch_size))
            .collect();
        share_priors(&kinds, jobs.iter_mut().map(|j| &mut j.step_secs));
        let capacity: Vec<(Pool, u32)> = capacity.into_iter().collect();
        let round = Round {
            capacity: &capacity,
            jobs: &jobs,
            elastic: true,
            resize_pause_secs: regroup_secs,
            resize_margin: RESIZE_MARGIN,
        };
        let plan = plan_round(&round);
        let forecasts = forecast(&round, &plan);

        // Reclaims: the jobs the greedy chose give their slices back.
        let mut preempted: HashSet<Uuid> = HashSet::new();
        for event in &plan.reclaims {
            let g = mine[event.job];
            // The record names the lender; the job's owner reads it only if it is theirs.
            let (deployment, name, told) = match event.pool {
                Pool::Loaned(i) => {
                    let d = &deployments[i];
                    (Some(d.id), d.name.as_str(), lender_as_seen_by(d, g.owner))
                }
                Pool::Training => (None, "training pool", "training pool"),
            };
            let mut reason = format!("{name} needs its {profile} slices back");
            if !event.preempted {
                let after: u32 = plan.placements[event.job].holdings.iter().map(|&(_, n)| n).sum();
                reason += &match after < g.world() {
                    true => format!("; shrunk from {} to {after} ranks", g.world()),
                    false => format!("; its {after} ranks move to other slices"),
                };
            }
            if event.preempted && !preempted.contains(&g.id) {
                let told = format!("Preempted by the loaning round: {told} needs its {profile} slices back.");
                if preempt::preempt_job(state, g.id, &told).await? {
                    report.preempted += 1;
                }
                preempted.insert(g.id);
            }
            let record = NewReclaim {
                deployment,
                deployment_name: name,
                job: g.id,
                job_name: &g.name,
                owner: g.owner,
                ranks: event.ranks,
                preempted: event.preempted,
                reason: &reason,
            };
            store::record_reclaim(db, now, &record).await?;
        }
        // Running gangs the plan gives another size: in place when they can (`InPlace`), else
        // a stop at a checkpoint and a restart at it. Slices joining ranks take are `taken`.
        let mut resized: HashSet<Uuid> = HashSet::new();
        let mut regrouped: HashSet<Uuid> = HashSet::new();
        // Regroups a reclaim called off: the gang runs on at its size.
        let mut called_off: HashSet<Uuid> = HashSet::new();
        // Grows that wait a round for slices a stopping gang still holds (`InPlace::Later`).
        let mut deferred: HashSet<Uuid> = HashSet::new();
        let mut leaving: HashSet<Uuid> = HashSet::new();
        let mut taken: HashSet<&str> = HashSet::new();
        // Slices ranks leave, in regroups under way (unless a joining rank is pinned to them
        // already) or this round's shrinks, which go first: a grow or a start may take them,
        // its ranks claimable once the leaving ones are gone (`store::gangs::claim_rank`).
        let rank_slices = |leaving: bool, state: Option<&'static str>| {
            mine.iter()
                .filter(|g| !g.waiting())
                .flat_map(|g| &g.ranks)
                .filter(move |r| r.leaving == leaving && state.is_none_or(|s| r.state == s))
                .filter_map(|r| r.slice.as_deref())
        };
        let joining: HashSet<&str> = rank_slices(false, Some("queued")).collect();
        let mut released: HashSet<&str> = rank_slices(true, None).filter(|s| !joining.contains(s)).collect();
        let planned = |j: usize| -> u32 { plan.placements[j].holdings.iter().map(|&(_, n)| n).sum() };
        let mut order: Vec<usize> = (0..mine.len()).collect();
        order.sort_by_key(|&j| planned(j) >= mine[j].world());
        for j in order {
            let g = mine[j];
            let reclaimed = plan.reclaims.iter().find(|e| e.job == j);
            // A gang mid-regroup keeps its new size until it forms, unless a reclaim cuts it.
            if g.waiting() || g.stopping || preempted.contains(&g.id) || (g.regrouping && reclaimed.is_none()) {
                continue;
            }
            let from = g.world();
            let to = planned(j);
            // A reclaimed gang stops even at the same size: its slices move.
            if to == 0 || (to == from && reclaimed.is_none()) {
                continue;
            }
            let why = match reclaimed {
                Some(e) => match e.pool {
                    Pool::Loaned(i) => {
                        format!("{} needs its {profile} slices back", lender_as_seen_by(&deployments[i], g.owner))
                    }
                    Pool::Training => format!("the training pool needs its {profile} slices back"),
                },
                None if to > from => {
                    let (left, steps) = (jobs[j].remaining_steps, &jobs[j].step_secs);
                    let gain = steps.remaining_secs(left, from) - steps.remaining_secs(left, to);
                    let extra = to - from;
                    format!("{extra} spare {profile} slices, predicted to finish {gain:.0} s sooner")
                }
                None => {
                    let (left, steps) = (jobs[j].remaining_steps, &jobs[j].step_secs);
                    let gain = steps.remaining_secs(left, from) - steps.remaining_secs(left, to);
                    if gain > 0.0 {
                        format!("predicted to finish {gain:.0} s sooner at fewer ranks")
                    } else {
                        "other jobs take its extra slices".to_string()
                    }
                }
            };
            let rank_pool = |r: &GangRank| {
                r.slice
                    .as_ref()
                    .and_then(|u| slices.iter().find(|s| &s.uuid == u))
                    .and_then(|s| pool_of(s))
                    .unwrap_or(Pool::Training)
            };
            // Free slices first, then those leaving ranks give up (`released`).
            let free_in = |pool: Pool| {
                let (pool_of, reclaim_now) = (&pool_of, &reclaim_now);
                let usable = move |s: &&&FleetSlice| {
                    pool_of(s) == Some(pool) && s.loan_state != SliceLoan::Reclaiming && !reclaim_now.contains(&s.uuid)
                };
                let free = slices.iter().filter(usable).filter(|s| s.holder == Holder::Free);
                let leaving = slices.iter().filter(usable).filter(|s| released.contains(s.uuid.as_str()));
                free.chain(leaving).map(|s| s.uuid.as_str())
            };
            let staying: Vec<GangRank> = g.ranks.iter().filter(|r| !r.leaving).cloned().collect();
            let change = match g.train.parallel.as_ref().is_some_and(|p| p.precision.is_none()) {
                true => InPlace::of(&staying, &plan.placements[j].holdings, rank_pool, free_in, &taken),
                false => None,
            };
            // A move between pools shrinks out of the pools it leaves first, if the gang
            // stays within its ranks; it grows into the others at a later round.
            let floor = g.train.resources().min_ranks.max(1);
            let below = |c: &InPlace| matches!(c, InPlace::Shrink(out) if from - (out.len() as u32) < floor);
            let too_small = change.as_ref().is_some_and(below);
            let change = change.filter(|c| !below(c));
            // Mid-regroup, a reclaim's shrink cuts the regroup back (`store::regroup::cut`);
            // anything else leaves it as it is, unless it must go below its minimum (a stop).
            if g.regrouping && !too_small {
                let Some(InPlace::Shrink(out)) = &change else {
                    continue;
                };
                let Some(cut) = crate::store::regroup::cut(db, g.id, out, floor).await? else {
                    continue;
                };
                let (world, gone) = (cut.world, &cut.gone);
                let reason = match cut.called_off {
                    true => format!(
                        "Its in-place resize to {from} ranks was called off by the loaning round: {why}. It runs on at \
                         {world} ranks."
                    ),
                    false => format!(
                        "Its in-place resize to {from} ranks was cut to {world} by the loaning round: {why}. Its ranks \
                         stop at a step and re-form at {world}."
                    ),
                };
                jobs_store::append_logs(db, g.id, &[reason], now).await?;
                if world < to && !cut.called_off {
                    store::set_regrow(db, g.id).await?;
                }
                leaving.extend(gone);
                released.extend(g.ranks.iter().filter(|r| gone.contains(&r.job)).filter_map(|r| r.slice.as_deref()));
                match cut.called_off {
                    true => called_off.insert(g.id),
                    false => regrouped.insert(g.id),
                };
                report.resized += 1;
                continue;
            }
            if let Some(change) = change {
                let (out, joins): (&[Uuid], &[&str]) = match &change {
                    InPlace::Shrink(out) => (out, &[]),
                    InPlace::Grow(joins) => (&[], joins),
                    InPlace::Later => {
                        deferred.insert(g.id);
                        continue;
                    }
                };
                let world = from - out.len() as u32 + joins.len() as u32;
                let mut reason = format!(
                    "Resized from {from} to {world} ranks in place by the loaning round: {why}. Its ranks stop at a \
                     step and re-form at {world}."
                );
                if world != to {
                    reason += &format!(" It grows to {to} on other slices once it re-formed.");
                }
                let joins: Vec<String> = joins.iter().map(|s| s.to_string()).collect();
                if crate::gangs::regroup_in_place(state, g.id, &g.train, (from, world), out, &joins).await? {
                    jobs_store::append_logs(db, g.id, &[reason], now).await?;
                    if world < to && reclaimed.is_some() {
                        store::set_regrow(db, g.id).await?;
                    }
                    leaving.extend(out);
                    released.extend(g.ranks.iter().filter(|r| out.contains(&r.job)).filter_map(|r| r.slice.as_deref()));
                    if let InPlace::Grow(joins) = change {
                        taken.extend(joins);
                    }
                    regrouped.insert(g.id);
                    report.resized += 1;
                }
                continue;
            }
            let reason = if to == from {
                format!(
                    "Moved to other slices by the loaning round: {why}. It checkpoints now and \
                     restarts at {to} ranks."
                )
            } else {
                format!(
                    "Resized from {from} to {to} ranks by the loaning round: {why}. It checkpoints \
                     now and restarts at {to}."
                )
            };
            if !store::set_resize(db, g.id, to).await? {
                continue;
            }
            if preempt::preempt_job(state, g.id, &reason).await? {
                jobs_store::append_logs(db, g.id, &[reason], now).await?;
                resized.insert(g.id);
                report.resized += 1;
            } else {
                store::clear_resize(db, g.id).await?;
            }
        }

        // Which loaned slices the take-back marks: those the stopping jobs held first.
        for (&d, need) in cuts.iter_mut() {
            let mut held: Vec<&&FleetSlice> = slices
                .iter()
                .filter(|s| s.lender == Some(d) && s.loan_state == SliceLoan::Loaned)
                .collect();
            // Slices of ranks that leave their gang first, then of gangs that stop.
            let stopping = |gang: &Uuid| preempted.contains(gang) || resized.contains(gang);
            held.sort_by_key(|s| match s.holder {
                Holder::Rank { job, .. } if leaving.contains(&job) => 0,
                Holder::Rank { gang, .. } if stopping(&gang) => 1,
                _ => 2,
            });
            // Not those joining ranks were just pinned to.
            for s in held.into_iter().filter(|s| !taken.contains(s.uuid.as_str())) {
                if *need == 0 {
                    break;
                }
                if reclaim_now.insert(s.uuid.clone()) {
                    *need -= 1;
                }
            }
        }

        // Waiting gangs start where the plan put them: sized, then pinned slice by slice.
        for (j, g) in mine.iter().enumerate() {
            if !g.waiting() {
                continue;
            }
            let placement = &plan.placements[j];
            let total: u32 = placement.holdings.iter().map(|&(_, n)| n).sum();
            if total == 0 {
                if g.ranks.iter().any(|r| r.slice.is_some()) {
                    store::unpin_ranks(db, g.id).await?;
                }
                continue;
            }
            let mut chosen: Vec<String> = Vec::new();
            for &(pool, n) in &placement.holdings {
                let mut candidates: Vec<&&FleetSlice> = slices
                    .iter()
                    .filter(|s| {
                        pool_of(s) == Some(pool)
                            && !reclaim_now.contains(&s.uuid)
                            && !taken.contains(s.uuid.as_str())
                    })
                    .filter(|s| s.loan_state != SliceLoan::Reclaiming)
                    .filter(|s| match s.holder {
                        Holder::Free => true,
                        // Slices pinned by waiting gangs are re-placed this round, and those
                        // leaving ranks give up are taken once free.
                        Holder::Rank { gang, .. } => {
                            gangs.iter().any(|w| w.id == gang && w.waiting()) || released.contains(s.uuid.as_str())
                        }
                        Holder::Replica { .. } => false,
                    })
                    .collect();
                // Its own pins first (a stable plan moves nothing), then free slices, then
                // those leaving ranks give up.
                candidates.sort_by_key(|s| {
                    let own = matches!(s.holder, Holder::Rank { gang, .. } if gang == g.id);
                    (!own, released.contains(s.uuid.as_str()))
                });
                for s in candidates.into_iter().take(n as usize) {
                    taken.insert(s.uuid.as_str());
                    chosen.push(s.uuid.clone());
                }
            }
            if (chosen.len() as u32) < total {
                notes.push(format!("{}: the plan's slices were not all free", g.name));
                continue;
            }
            // Within the spec's min..=max ranks (the plan's range); refused only if the gang
            // left the queue since the round read it.
            if total as usize != g.ranks.len() && crate::gangs::resize(db, g.id, total).await.is_err() {
                continue;
            }
            let ranks = store::gang_ranks(db, g.id).await?;
            let pins: Vec<(Uuid, String)> = ranks.iter().map(|r| r.job).zip(chosen).collect();
            if pins
                .iter()
                .zip(&ranks)
                .any(|((_, s), r)| r.slice.as_deref() != Some(s.as_str()))
            {
                store::pin_ranks(db, g.id, &pins).await?;
                report.started += 1;
            }
            if g.resize_ranks.is_some() {
                store::clear_resize(db, g.id).await?;
            }
        }

        // The queue as planned: running jobs first, then waiting ones by forecast start.
        for (j, g) in mine.iter().enumerate() {
            let placement = &plan.placements[j];
            let ranks: u32 = placement.holdings.iter().map(|&(_, n)| n).sum();
            let at = if ranks > 0 {
                ranks
            } else {
                forecasts[j].ranks
            };
            let secs = jobs[j]
                .step_secs
                .remaining_secs(jobs[j].remaining_steps, at);
            let note = if preempted.contains(&g.id) {
                "preempted this round".to_string()
            } else if resized.contains(&g.id) {
                format!("resizing from {} to {ranks} {profile} slices", g.world())
            } else if regrouped.contains(&g.id) || (g.regrouping && !called_off.contains(&g.id)) {
                format!("resizing in place to {ranks} {profile} slices")
            } else if deferred.contains(&g.id) {
                format!("running on {} {profile} slices; grows in place to {ranks} once others free them", g.world())
            } else if g.waiting() && ranks == 0 {
                format!("waiting for {} free {profile} slices", jobs[j].min_ranks)
            } else if g.waiting() {
                format!("placed on {ranks} {profile} slices")
            } else {
                format!("running on {ranks} {profile} slices")
            };
            let f = &forecasts[j];
            let in_ms = |secs: f64| now.saturating_add((secs * 1000.0).round() as i64);
            let start = f.start_secs().map(in_ms);
            let order = (
                g.waiting(),
                start.filter(|_| g.waiting()).unwrap_or(i64::MAX),
                plans.len(),
            );
            plans.push((
                order,
                TrainingPlan {
                    job: g.id,
                    position: 0,
                    ranks: at,
                    min_ranks: jobs[j].min_ranks,
                    max_ranks: jobs[j].max_ranks,
                    preemptible: jobs[j].preemptible,
                    // The API's figure is measured: none while only the prior knows.
                    predicted_secs: (!jobs[j].step_secs.is_empty()).then_some(secs),
                    predicted_start_at: start,
                    predicted_finish_at: f.finish_secs().map(in_ms),
                    predicted_from: Some(match f.measured {
                        true => PredictedFrom::Measured,
                        false => PredictedFrom::Prior,
                    }),
                    note,
                },
            ));
        }
    }
    for note in notes {
        tracing::debug!(note, "loaning round");
    }

    // 4. Mark what goes back, and finish the slices no rank holds any more.
    for uuid in &reclaim_now {
        if store::start_reclaim(db, uuid, "demand returned").await? {
            report.reclaiming += 1;
        }
    }
    let fleet = store::fleet(db, online_since).await?;
    // Those a rank still holds wait for it to stop (`finish_reclaim` checks again).
    for s in fleet
        .iter()
        .filter(|s| s.loan_state == SliceLoan::Reclaiming && s.holder == Holder::Free)
    {
        let Some(d) = s
            .lender
            .and_then(|l| deployments.iter().find(|d| d.id == l))
        else {
            continue;
        };
        let spec = crate::deployments::replica_spec(d);
        let name = format!("replica of {}", d.name);
        let job = NewJob {
            deployment: Some(d.id),
            pinned_slice: Some(&s.uuid),
            ..NewJob::new(
                d.owner_id,
                &name,
                &spec,
                crate::deployments::REPLICA_MAX_ATTEMPTS,
            )
        };
        if store::finish_reclaim(db, &s.uuid, d.id, &job).await? {
            report.returned += 1;
        }
    }

    // 5. What the dashboard shows.
    plans.sort_by_key(|(order, _)| *order);
    let plans: Vec<TrainingPlan> = plans
        .into_iter()
        .enumerate()
        .map(|(i, (_, p))| TrainingPlan {
            position: i as u32,
            ..p
        })
        .collect();
    store::replace_plans(db, &plans).await?;
    let count = |f: &dyn Fn(&FleetSlice) -> bool| fleet.iter().filter(|s| f(s)).count() as u32;
    let round = LoanRound {
        at: crate::store::db::time(now),
        serving: count(&|s| {
            s.loan_state == SliceLoan::Serving && !matches!(s.holder, Holder::Rank { .. })
        }),
        loaned: count(&|s| s.loan_state == SliceLoan::Loaned),
        reclaiming: count(&|s| s.loan_state == SliceLoan::Reclaiming),
        training: count(&|s| matches!(s.holder, Holder::Rank { .. })),
        waiting: gangs.iter().filter(|g| g.waiting()).count() as u32,
    };
    store::record_round(db, &round).await?;
    store::prune(db, now - HISTORY_MS).await?;
    Ok(report)
}

/// How a running gang changes size in place: the rank rows that leave, or the slices
/// ranks join on.
enum InPlace<'a> {
    Shrink(Vec<Uuid>),
    Grow(Vec<&'a str>),
    /// A grow onto slices not all free nor given up by ranks leaving in place (a gang that
    /// stops still holds them): it waits a round rather than restarting, since a restart
    /// would wait for them as well.
    Later,
}

impl<'a> InPlace<'a> {
    /// The change from `ranks` (each in its pool, `pool_of`) to `target` slices per pool:
    /// a shrink gives up the highest ranks of each pool it leaves, a grow joins on slices
    /// (`free_in`: free, then given up by leaving ranks) not yet `taken`, or waits for them
    /// (`Later`). A move between pools
    /// is its shrink, now; the gang grows into the other pools at a later round. `None`
    /// when no pool changes.
    fn of<I: Iterator<Item = &'a str>>(
        ranks: &[GangRank],
        target: &[(Pool, u32)],
        pool_of: impl Fn(&GangRank) -> Pool,
        free_in: impl Fn(Pool) -> I,
        taken: &HashSet<&str>,
    ) -> Option<InPlace<'a>> {
        let mut now: HashMap<Pool, u32> = HashMap::new();
        for r in ranks {
            *now.entry(pool_of(r)).or_default() += 1;
        }
        let wanted = |p: &Pool| target.iter().find(|(q, _)| q == p).map_or(0, |&(_, n)| n);
        let pools: BTreeSet<Pool> = now.keys().chain(target.iter().map(|(p, _)| p)).copied().collect();
        let shrinks = pools.iter().any(|p| wanted(p) < now.get(p).copied().unwrap_or(0));
        let grows = pools.iter().any(|p| wanted(p) > now.get(p).copied().unwrap_or(0));
        match (shrinks, grows) {
            // A move between pools: its shrink now (the grow waits for a later round).
            (true, _) => {
                let mut out = Vec::new();
                for p in &pools {
                    let excess = now.get(p).copied().unwrap_or(0).saturating_sub(wanted(p)) as usize;
                    out.extend(ranks.iter().rev().filter(|r| pool_of(r) == *p).take(excess).map(|r| r.job));
                }
                Some(InPlace::Shrink(out))
            }
            (false, true) => {
                let mut joins = Vec::new();
                for p in &pools {
                    let need = (wanted(p) - now.get(p).copied().unwrap_or(0)) as usize;
                    let free: Vec<&str> = free_in(*p).filter(|s| !taken.contains(s)).take(need).collect();
                    if free.len() < need {
                        return Some(InPlace::Later);
                    }
                    joins.extend(free);
                }
                Some(InPlace::Grow(joins))
            }
            (false, false) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ranks 0.. of a gang on slices "s0".., each in its pool.
    fn gang(pools: &[Pool]) -> (Vec<GangRank>, HashMap<String, Pool>) {
        let ranks: Vec<GangRank> = (0..pools.len())
            .map(|i| GangRank {
                job: Uuid::from_u128(i as u128),
                rank: i as u32,
                state: "running".into(),
                placement: "any".into(),
                slice: Some(format!("s{i}")),
                leaving: false,
            })
            .collect();
        let pool_of = ranks.iter().map(|r| r.slice.clone().unwrap()).zip(pools.iter().copied()).collect();
        (ranks, pool_of)
    }

    fn change<'a>(
        ranks: &[GangRank],
        pools: &HashMap<String, Pool>,
        target: &[(Pool, u32)],
        free: &[(Pool, &'a str)],
        taken: &HashSet<&str>,
    ) -> Option<InPlace<'a>> {
        let pool_of = |r: &GangRank| pools[r.slice.as_ref().unwrap()];
        let free_in = |p: Pool| free.iter().filter(move |(q, _)| *q == p).map(|&(_, s)| s);
        InPlace::of(ranks, target, pool_of, free_in, taken)
    }

    #[test]
    fn a_shrink_gives_up_the_highest_ranks_of_each_pool_it_leaves() {
        let (ranks, pools) = gang(&[Pool::Training, Pool::Loaned(0), Pool::Loaned(0)]);
        let none = HashSet::new();
        match change(&ranks, &pools, &[(Pool::Training, 1), (Pool::Loaned(0), 1)], &[], &none) {
            Some(InPlace::Shrink(out)) => assert_eq!(out, vec![ranks[2].job]),
            _ => panic!("a shrink"),
        }
    }

    #[test]
    fn a_grow_joins_free_slices_not_taken_or_waits_a_round_for_them() {
        let (ranks, pools) = gang(&[Pool::Training]);
        let free = [(Pool::Loaned(0), "a"), (Pool::Loaned(0), "b"), (Pool::Training, "c")];
        let target = [(Pool::Training, 1), (Pool::Loaned(0), 2)];
        match change(&ranks, &pools, &target, &free, &HashSet::new()) {
            Some(InPlace::Grow(joins)) => assert_eq!(joins, vec!["a", "b"]),
            _ => panic!("a grow onto a and b"),
        }
        // Another gang took b this round: too few are free yet, so it waits, not restarts.
        let taken = HashSet::from(["b"]);
        assert!(matches!(change(&ranks, &pools, &target, &free, &taken), Some(InPlace::Later)));
    }

    #[test]
    fn a_move_between_pools_shrinks_out_of_the_pool_it_leaves_first() {
        let (ranks, pools) = gang(&[Pool::Training, Pool::Loaned(0)]);
        let free = [(Pool::Loaned(1), "a")];
        let target = [(Pool::Training, 1), (Pool::Loaned(1), 1)];
        match change(&ranks, &pools, &target, &free, &HashSet::new()) {
            Some(InPlace::Shrink(out)) => assert_eq!(out, vec![ranks[1].job]),
            _ => panic!("the rank on the pool it leaves goes first"),
        }
        let same = [(Pool::Training, 1), (Pool::Loaned(0), 1)];
        assert!(change(&ranks, &pools, &same, &free, &HashSet::new()).is_none(), "nothing to change");
    }
}
