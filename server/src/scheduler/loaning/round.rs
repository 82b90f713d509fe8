//! One scheduling round of the shared fleet, Aryl's order (Li et al., arXiv 2202.07896;
//! research note §3): take back what serving reclaims (least preemption cost), start
//! waiting jobs shortest-first on their base demand, then hand what is left to elastic jobs
//! by the multiple-choice knapsack. Plain data in, placements out: the simulator in
//! `bench/src/bin/aryl.rs` calls this function, and so does the server's round (`loaning`).
//!
//! Departures: each round re-decides the extra ranks of running elastic jobs (their base
//! stays put), so waiting jobs may take extra ranks back before the knapsack runs. Two
//! brakes keep that from churning: the knapsack charges a running job that changes size
//! the resize pause times `1 + resize_margin` (a hurdle, not a cost: the gain must beat the
//! pause by that margin), and a running job the caller marks not `resizable` (the
//! platform's hysteresis after each start or resize) keeps its ranks unless a reclaim
//! shrinks it. With `elastic` off every job runs at its requested ranks and is never
//! resized, only preempted.

use super::elastic::{grant, Candidate};
use super::reclaim::{reclaim, Action, Tenant};
use super::shortest_first::{shortest_first, Free, Waiting};
use super::step_times::StepTimes;

/// Where a slice comes from: the training pool, or a serving deployment that lent it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Pool {
    Training,
    Loaned(usize),
}

/// A training job, waiting (no holdings) or running.
#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    pub min_ranks: u32,
    pub max_ranks: u32,
    /// Ranks it runs at when elasticity is off (between min and max).
    pub requested_ranks: u32,
    pub preemptible: bool,
    pub remaining_steps: f64,
    pub step_secs: StepTimes,
    pub checkpoint_age_secs: f64,
    pub restart_secs: f64,
    /// Slices it holds per pool now; empty when waiting.
    pub holdings: Vec<(Pool, u32)>,
    /// Running: the knapsack may grow or shrink it this round. A reclaim may shrink an
    /// elastic job either way. Ignored while it waits.
    pub resizable: bool,
    /// Waiting to restart from a resize a round made: it starts before other waiting jobs.
    pub resuming: bool,
}

impl Job {
    pub fn ranks(&self) -> u32 {
        self.holdings.iter().map(|&(_, n)| n).sum()
    }
}

/// The round's input.
#[derive(Debug, Clone, Copy)]
pub struct Round<'a> {
    /// Slices training may hold in each pool after this round (the training pool's size,
    /// and each lender's current loan). A pool not listed has none.
    pub capacity: &'a [(Pool, u32)],
    pub jobs: &'a [Job],
    pub elastic: bool,
    pub resize_pause_secs: f64,
    /// A running job changes size by choice only when the predicted JCT gain exceeds the
    /// pause by this fraction of it (0: any gain above the pause).
    pub resize_margin: f64,
}

/// Where a job runs after the round.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Placement {
    /// Slices per pool (non-zero counts); empty when it waits.
    pub holdings: Vec<(Pool, u32)>,
    /// It was preempted by a reclaim this round (it may have restarted elsewhere).
    pub preempted: bool,
}

/// A reclaim decision, for the dashboard's reclaim events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReclaimEvent {
    pub pool: Pool,
    pub job: usize,
    /// Ranks given back on that pool; the whole job when `preempted`.
    pub ranks: u32,
    pub preempted: bool,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct Plan {
    /// One per input job, same order.
    pub placements: Vec<Placement>,
    pub reclaims: Vec<ReclaimEvent>,
}

pub fn plan_round(round: &Round) -> Plan {
    let jobs = round.jobs;
    let mut pools: Vec<Pool> = round.capacity.iter().map(|&(p, _)| p).collect();
    pools.extend(jobs.iter().flat_map(|j| j.holdings.iter().map(|&(p, _)| p)));
    pools.sort_unstable();
    pools.dedup();
    let index = |p: Pool| pools.binary_search(&p).expect("every pool is listed");
    let np = pools.len();
    let mut cap = vec![0u32; np];
    for &(p, n) in round.capacity {
        cap[index(p)] += n;
    }
    let mut held: Vec<Vec<u32>> = jobs
        .iter()
        .map(|j| {
            let mut h = vec![0u32; np];
            for &(p, n) in &j.holdings {
                h[index(p)] += n;
            }
            h
        })
        .collect();
    let elastic: Vec<bool> = jobs.iter().map(|j| round.elastic && j.max_ranks > j.min_ranks).collect();
    let mut preempted = vec![false; jobs.len()];
    let mut resized = vec![false; jobs.len()];
    let mut reclaims = Vec::new();

    // 1. Serving takes back what its loans no longer cover.
    for p in 0..np {
        let used: u32 = held.iter().map(|h| h[p]).sum();
        if used <= cap[p] {
            continue;
        }
        let on: Vec<usize> = (0..jobs.len()).filter(|&j| held[j][p] > 0).collect();
        let tenants: Vec<Tenant> = on
            .iter()
            .map(|&j| {
                let ranks: u32 = held[j].iter().sum();
                Tenant {
                    here: held[j][p],
                    ranks,
                    floor: if elastic[j] { jobs[j].min_ranks.min(ranks) } else { ranks },
                    preemptible: jobs[j].preemptible,
                    checkpoint_age_secs: jobs[j].checkpoint_age_secs,
                    restart_secs: jobs[j].restart_secs,
                }
            })
            .collect();
        for action in reclaim(&tenants, used - cap[p], round.resize_pause_secs).actions {
            match action {
                Action::Shrink { tenant, ranks } => {
                    let j = on[tenant];
                    held[j][p] -= ranks;
                    resized[j] = true;
                    reclaims.push(ReclaimEvent { pool: pools[p], job: j, ranks, preempted: false });
                }
                Action::Preempt { tenant } => {
                    let j = on[tenant];
                    reclaims.push(ReclaimEvent { pool: pools[p], job: j, ranks: held[j][p], preempted: true });
                    held[j].iter_mut().for_each(|n| *n = 0);
                    preempted[j] = true;
                }
            }
        }
    }

    // 2. Elastic jobs fall back to their base; the knapsack decides their extra ranks again.
    // Loaned slices go first, so a job's base stays on the training pool where it can.
    let mut stripped: Vec<Vec<u32>> = vec![Vec::new(); jobs.len()];
    for j in 0..jobs.len() {
        let ranks: u32 = held[j].iter().sum();
        // A job held at its size (hysteresis) keeps its extra ranks, unless a reclaim
        // already stops it for a resize.
        if !elastic[j] || ranks <= jobs[j].min_ranks || !(jobs[j].resizable || resized[j]) {
            continue;
        }
        let mut extra = ranks - jobs[j].min_ranks;
        stripped[j] = vec![0; np];
        for p in (0..np).rev() {
            let n = extra.min(held[j][p]);
            held[j][p] -= n;
            stripped[j][p] = n;
            extra -= n;
        }
    }

    // 3. Waiting jobs start shortest-first on what is free.
    let mut free: Vec<Free> = (0..np)
        .map(|p| Free { slices: cap[p].saturating_sub(held.iter().map(|h| h[p]).sum()), loaned: pools[p] != Pool::Training })
        .collect();
    let waiting: Vec<usize> = (0..jobs.len()).filter(|&j| held[j].iter().all(|&n| n == 0)).collect();
    let start_ranks = |j: usize| if elastic[j] { jobs[j].min_ranks } else { jobs[j].requested_ranks };
    let queue: Vec<Waiting> = waiting
        .iter()
        .map(|&j| Waiting {
            ranks: start_ranks(j),
            predicted_secs: jobs[j].step_secs.remaining_secs(jobs[j].remaining_steps, start_ranks(j)),
            preemptible: jobs[j].preemptible,
            resuming: jobs[j].resuming,
        })
        .collect();
    let mut starts = vec![false; jobs.len()];
    for (w, took) in shortest_first(&queue, &mut free) {
        let j = waiting[w];
        starts[j] = true;
        for (p, n) in took {
            held[j][p] += n;
        }
    }

    // 4. The knapsack hands what is left to elastic jobs.
    if round.elastic {
        let growing: Vec<usize> = (0..jobs.len())
            .filter(|&j| elastic[j] && held[j].iter().any(|&n| n > 0))
            .filter(|&j| starts[j] || resized[j] || jobs[j].resizable)
            .collect();
        let candidates: Vec<Candidate> = growing
            .iter()
            .map(|&j| Candidate {
                base: held[j].iter().sum(),
                max: jobs[j].max_ranks,
                current: (!starts[j] && !resized[j] && !preempted[j]).then(|| jobs[j].ranks()),
                remaining_steps: jobs[j].remaining_steps,
                step_secs: &jobs[j].step_secs,
            })
            .collect();
        let spare: u32 = free.iter().map(|f| f.slices).sum();
        // The hurdle only weighs on running jobs changing size (see `elastic::value`).
        let extras = grant(&candidates, spare, round.resize_pause_secs * (1.0 + round.resize_margin.max(0.0)));
        for (&j, mut extra) in growing.iter().zip(extras) {
            // Back where its extra ranks ran before, then the fullest pools.
            if let Some(before) = stripped.get(j).filter(|s| !s.is_empty()) {
                for p in 0..np {
                    let n = extra.min(before[p]).min(free[p].slices);
                    held[j][p] += n;
                    free[p].slices -= n;
                    extra -= n;
                }
            }
            while extra > 0 {
                let p = (0..np).max_by_key(|&p| (free[p].slices, std::cmp::Reverse(p))).expect("pools exist");
                let n = extra.min(free[p].slices);
                assert!(n > 0, "the knapsack stays within the spare slices");
                held[j][p] += n;
                free[p].slices -= n;
                extra -= n;
            }
        }
    }

    let placements = (0..jobs.len())
        .map(|j| Placement {
            holdings: (0..np).filter(|&p| held[j][p] > 0).map(|p| (pools[p], held[j][p])).collect(),
            preempted: preempted[j],
        })
        .collect();
    Plan { placements, reclaims }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn job(min: u32, max: u32, requested: u32, steps: f64) -> Job {
        Job {
            min_ranks: min,
            max_ranks: max,
            requested_ranks: requested,
            preemptible: true,
            remaining_steps: steps,
            step_secs: StepTimes::new((1..=64).map(|r| (r, 0.05 + 0.95 / r as f64))),
            checkpoint_age_secs: 0.0,
            restart_secs: 60.0,
            holdings: Vec::new(),
            resizable: true,
            resuming: false,
        }
    }

    fn round<'a>(capacity: &'a [(Pool, u32)], jobs: &'a [Job]) -> Round<'a> {
        Round { capacity, jobs, elastic: true, resize_pause_secs: 30.0, resize_margin: 0.0 }
    }

    #[test]
    fn a_running_elastic_job_grows_onto_spare_slices() {
        let mut j = job(1, 4, 1, 10_000.0);
        j.holdings = vec![(Pool::Training, 1)];
        let capacity = [(Pool::Training, 2), (Pool::Loaned(0), 2)];
        let plan = plan_round(&round(&capacity, &[j.clone()]));
        assert_eq!(plan.placements[0].holdings, vec![(Pool::Training, 2), (Pool::Loaned(0), 2)]);
        assert!(plan.reclaims.is_empty() && !plan.placements[0].preempted);

        // Held at its size by the hysteresis: it keeps its one rank.
        j.resizable = false;
        let plan = plan_round(&round(&capacity, &[j]));
        assert_eq!(plan.placements[0].holdings, vec![(Pool::Training, 1)]);
    }

    #[test]
    fn a_reclaim_shrinks_a_running_elastic_job_before_preempting_anyone() {
        // The elastic job holds 3 loaned slices and 1 of training; an inelastic job holds 2
        // loaned. The lender wants 3 back: the elastic job gives all 3, even held at its
        // size, and nobody is preempted.
        let mut elastic = job(1, 4, 4, 10_000.0);
        elastic.holdings = vec![(Pool::Training, 1), (Pool::Loaned(0), 3)];
        elastic.resizable = false;
        let mut fixed = job(2, 2, 2, 10_000.0);
        fixed.holdings = vec![(Pool::Loaned(0), 2)];
        let capacity = [(Pool::Training, 1), (Pool::Loaned(0), 2)];
        let plan = plan_round(&round(&capacity, &[elastic.clone(), fixed.clone()]));
        assert_eq!(plan.reclaims, vec![ReclaimEvent { pool: Pool::Loaned(0), job: 0, ranks: 3, preempted: false }]);
        assert_eq!(plan.placements[0].holdings, vec![(Pool::Training, 1)]);
        assert_eq!(plan.placements[1].holdings, vec![(Pool::Loaned(0), 2)]);
        assert!(plan.placements.iter().all(|p| !p.preempted));

        // Below its minimum it cannot go: a job at its floor is preempted instead.
        let mut at_floor = elastic;
        at_floor.holdings = vec![(Pool::Loaned(0), 1)];
        let capacity = [(Pool::Training, 0), (Pool::Loaned(0), 2)];
        let plan = plan_round(&round(&capacity, &[at_floor, fixed]));
        assert_eq!(plan.reclaims, vec![ReclaimEvent { pool: Pool::Loaned(0), job: 0, ranks: 1, preempted: true }]);
    }

    #[test]
    fn hysteresis_a_small_gain_or_a_recent_resize_keeps_the_size() {
        // At 1 rank a step takes 1 s, at 2 ranks 0.525 s: 95 steps left gain 45 s.
        let mut j = job(1, 2, 1, 95.0);
        j.holdings = vec![(Pool::Training, 1)];
        let capacity = [(Pool::Training, 2)];
        let ranks = |plan: &Plan| plan.placements[0].holdings.iter().map(|&(_, n)| n).sum::<u32>();
        assert_eq!(ranks(&plan_round(&round(&capacity, &[j.clone()]))), 2, "45 s beats a 30 s pause");
        let margin = Round { resize_margin: 1.0, ..round(&capacity, std::slice::from_ref(&j)) };
        assert_eq!(ranks(&plan_round(&margin)), 1, "45 s does not beat twice the pause");

        // A running job held at its size keeps its extra ranks from a waiting job.
        let mut running = job(1, 8, 2, 10_000.0);
        running.holdings = vec![(Pool::Training, 8)];
        running.resizable = false;
        let capacity = [(Pool::Training, 8)];
        let plan = plan_round(&round(&capacity, &[running.clone(), job(4, 4, 4, 100.0)]));
        assert_eq!(plan.placements[0].holdings, vec![(Pool::Training, 8)]);
        assert!(plan.placements[1].holdings.is_empty());
        // Once resizable it gives them up (the existing Aryl order: waiting jobs first).
        running.resizable = true;
        let plan = plan_round(&round(&capacity, &[running, job(4, 4, 4, 100.0)]));
        assert_eq!(plan.placements[1].holdings, vec![(Pool::Training, 4)]);
    }

    #[test]
    fn a_job_resuming_from_a_resize_restarts_before_shorter_waiting_jobs() {
        let mut resumed = job(2, 3, 3, 1e6);
        resumed.resuming = true;
        let capacity = [(Pool::Training, 3)];
        let plan = plan_round(&round(&capacity, &[job(2, 2, 2, 10.0), resumed]));
        assert!(plan.placements[0].holdings.is_empty());
        assert_eq!(plan.placements[1].holdings, vec![(Pool::Training, 3)]);
    }

    #[test]
    fn loaned_slices_return_to_serving_and_the_job_shrinks_first() {
        let mut j = job(2, 8, 4, 1000.0);
        j.holdings = vec![(Pool::Training, 2), (Pool::Loaned(0), 6)];
        let capacity = [(Pool::Training, 2), (Pool::Loaned(0), 1)];
        let plan = plan_round(&Round { capacity: &capacity, jobs: &[j], elastic: true, resize_pause_secs: 30.0, resize_margin: 0.0 });
        assert!(!plan.placements[0].preempted);
        assert_eq!(plan.placements[0].holdings, vec![(Pool::Training, 2), (Pool::Loaned(0), 1)]);
        assert_eq!(plan.reclaims, vec![ReclaimEvent { pool: Pool::Loaned(0), job: 0, ranks: 5, preempted: false }]);
    }

    #[test]
    fn without_elasticity_a_reclaim_preempts_and_the_job_restarts_where_it_fits() {
        let mut j = job(2, 8, 4, 1000.0);
        j.holdings = vec![(Pool::Loaned(0), 4)];
        let capacity = [(Pool::Training, 4), (Pool::Loaned(0), 0)];
        let plan = plan_round(&Round { capacity: &capacity, jobs: &[j], elastic: false, resize_pause_secs: 30.0, resize_margin: 0.0 });
        assert!(plan.placements[0].preempted);
        assert_eq!(plan.placements[0].holdings, vec![(Pool::Training, 4)]);
    }

    #[test]
    fn spare_slices_grow_the_elastic_job_and_a_new_job_takes_them_back() {
        let capacity = [(Pool::Training, 8)];
        let alone = [job(1, 8, 2, 10_000.0)];
        let plan = plan_round(&Round { capacity: &capacity, jobs: &alone, elastic: true, resize_pause_secs: 30.0, resize_margin: 0.0 });
        assert_eq!(plan.placements[0].holdings, vec![(Pool::Training, 8)]);

        let mut running = alone[0].clone();
        running.holdings = plan.placements[0].holdings.clone();
        let newcomer = job(4, 4, 4, 100.0);
        let plan = plan_round(&Round { capacity: &capacity, jobs: &[running, newcomer], elastic: true, resize_pause_secs: 30.0, resize_margin: 0.0 });
        assert_eq!(plan.placements[1].holdings, vec![(Pool::Training, 4)]);
        assert_eq!(plan.placements[0].holdings, vec![(Pool::Training, 4)]);
    }

    /// Random rounds: capacity per pool is respected, ranks stay within bounds, inelastic
    /// jobs run at exactly their request, non-preemptible bases stay on the training pool.
    #[test]
    fn random_rounds_respect_capacity_and_bounds() {
        let mut rng = StdRng::seed_from_u64(1602);
        for case in 0..400 {
            let lenders = rng.gen_range(0..4);
            let mut capacity = vec![(Pool::Training, rng.gen_range(0..24))];
            for d in 0..lenders {
                capacity.push((Pool::Loaned(d), rng.gen_range(0..12)));
            }
            let elastic_round = rng.gen_bool(0.5);
            let mut jobs = Vec::new();
            for _ in 0..rng.gen_range(0..20) {
                let min = rng.gen_range(1..5);
                let max = if rng.gen_bool(0.5) { min + rng.gen_range(0..8) } else { min };
                let mut j = job(min, max, rng.gen_range(min..=max), rng.gen_range(1.0..1e5));
                j.preemptible = rng.gen_bool(0.7);
                j.checkpoint_age_secs = rng.gen_range(0.0..1800.0);
                j.resizable = rng.gen_bool(0.6);
                // Some already run somewhere (possibly more than the pools now allow).
                if rng.gen_bool(0.5) {
                    let ranks = if elastic_round { rng.gen_range(min..=max) } else { j.requested_ranks };
                    let mut left = ranks;
                    while left > 0 {
                        let p = if j.preemptible || rng.gen_bool(0.3) { rng.gen_range(0..=lenders) } else { 0 };
                        let pool = if p == 0 { Pool::Training } else { Pool::Loaned(p - 1) };
                        let n = rng.gen_range(1..=left);
                        j.holdings.push((pool, n));
                        left -= n;
                    }
                }
                jobs.push(j);
            }
            let margin = if rng.gen_bool(0.5) { 0.0 } else { 1.0 };
            let plan = plan_round(&Round { capacity: &capacity, jobs: &jobs, elastic: elastic_round, resize_pause_secs: 20.0, resize_margin: margin });
            // A running job held at its size that no reclaim touched keeps exactly what it held.
            for (i, (j, pl)) in jobs.iter().zip(&plan.placements).enumerate() {
                if j.holdings.is_empty() || j.resizable || plan.reclaims.iter().any(|r| r.job == i) {
                    continue;
                }
                let mut before = std::collections::BTreeMap::new();
                for &(p, n) in &j.holdings {
                    *before.entry(p).or_insert(0u32) += n;
                }
                let after: std::collections::BTreeMap<Pool, u32> = pl.holdings.iter().copied().collect();
                assert_eq!(after, before, "case {case}: job {i} held at its size moved");
            }
            let mut used = std::collections::BTreeMap::new();
            for (j, pl) in jobs.iter().zip(&plan.placements) {
                let ranks: u32 = pl.holdings.iter().map(|&(_, n)| n).sum();
                for &(p, n) in &pl.holdings {
                    *used.entry(p).or_insert(0u32) += n;
                }
                if ranks == 0 {
                    continue;
                }
                if elastic_round && j.max_ranks > j.min_ranks {
                    assert!(ranks >= j.min_ranks && ranks <= j.max_ranks, "case {case}: elastic ranks {ranks}");
                } else {
                    assert_eq!(ranks, j.requested_ranks, "case {case}: inelastic ranks");
                }
                if !j.preemptible && j.holdings.is_empty() {
                    let training: u32 = pl.holdings.iter().filter(|(p, _)| *p == Pool::Training).map(|&(_, n)| n).sum();
                    let base = if elastic_round { j.min_ranks } else { j.requested_ranks };
                    assert!(training >= base.min(ranks), "case {case}: non-preemptible base on loaned slices");
                }
            }
            for (p, n) in used {
                let cap = capacity.iter().find(|(q, _)| *q == p).map_or(0, |&(_, c)| c);
                assert!(n <= cap, "case {case}: pool {p:?} holds {n} of {cap}");
            }
        }
    }
}
