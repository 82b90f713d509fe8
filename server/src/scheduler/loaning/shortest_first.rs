//! Starting waiting training jobs shortest-first, as Aryl does for inelastic jobs and for
//! the base demand of elastic ones before the knapsack hands out the rest (Li et al., arXiv
//! 2202.07896; third-party notes in the research note §3).
//!
//! A job's predicted time is finite even before it ran: `StepTimes`' prior gives one from
//! its declared steps, so new jobs are ordered by length too, not by arrival.
//!
//! Departures: a job that does not fit is skipped and later, shorter-or-not, jobs may still
//! start (backfilling; the paper's notes do not say). Slices are interchangeable within a
//! pool and a job may span pools (no server topology). A job that is not preemptible only
//! takes slices of the training pool; a preemptible one takes loaned slices first (largest
//! pool first, so it spans few lenders) and keeps the training pool for jobs that need it.
//! A job restarting from a resize goes before the order: it was running a round ago, and
//! a resize that left it waiting behind shorter jobs would be a preemption in disguise.

/// A job waiting to start.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Waiting {
    /// Ranks it starts with (its requested ranks, or its minimum when elastic).
    pub ranks: u32,
    /// Predicted running time at those ranks; the queue's order.
    pub predicted_secs: f64,
    pub preemptible: bool,
    /// Restarting from a resize the round made: starts before every other waiting job.
    pub resuming: bool,
}

/// A pool's free slices and whether they are loaned from serving.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Free {
    pub slices: u32,
    pub loaned: bool,
}

/// The order jobs start in: resumed resizes first, then by predicted time, NaN or unknown
/// predictions last.
pub fn queue_order(a: &Waiting, b: &Waiting) -> std::cmp::Ordering {
    let key = |w: &Waiting| if w.predicted_secs.is_nan() { f64::INFINITY } else { w.predicted_secs };
    b.resuming.cmp(&a.resuming).then(key(a).total_cmp(&key(b)))
}

/// The jobs that start (index into `waiting`) with the slices they take from each pool
/// (index into `free`, count), in start order. `free` is updated.
pub fn shortest_first(waiting: &[Waiting], free: &mut [Free]) -> Vec<(usize, Vec<(usize, u32)>)> {
    let mut order: Vec<usize> = (0..waiting.len()).collect();
    // Stable: equals keep the order given (a caller that passes them sorted pays a pass).
    order.sort_by(|&a, &b| queue_order(&waiting[a], &waiting[b]));
    let mut started = Vec::new();
    let mut pools: Vec<usize> = Vec::with_capacity(free.len());
    for i in order {
        let w = waiting[i];
        if w.ranks == 0 {
            continue;
        }
        pools.clear();
        pools.extend((0..free.len()).filter(|&p| free[p].loaned && w.preemptible && free[p].slices > 0));
        pools.sort_by(|&a, &b| free[b].slices.cmp(&free[a].slices).then(a.cmp(&b)));
        pools.extend((0..free.len()).filter(|&p| !free[p].loaned && free[p].slices > 0));
        let available: u32 = pools.iter().map(|&p| free[p].slices).sum();
        if available < w.ranks {
            continue;
        }
        let mut left = w.ranks;
        let mut took = Vec::new();
        for &p in &pools {
            let n = left.min(free[p].slices);
            if n > 0 {
                free[p].slices -= n;
                took.push((p, n));
                left -= n;
            }
            if left == 0 {
                break;
            }
        }
        started.push((i, took));
    }
    started
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(ranks: u32, secs: f64, preemptible: bool) -> Waiting {
        Waiting { ranks, predicted_secs: secs, preemptible, resuming: false }
    }

    #[test]
    fn a_job_resuming_from_a_resize_starts_before_shorter_ones() {
        let mut free = [Free { slices: 4, loaned: false }];
        let resumed = Waiting { resuming: true, ..job(3, 7200.0, true) };
        let started = shortest_first(&[job(2, 60.0, true), resumed, job(1, 30.0, true)], &mut free);
        assert_eq!(started, vec![(1, vec![(0, 3)]), (2, vec![(0, 1)])]);
    }

    #[test]
    fn shortest_starts_first_and_a_long_one_waits() {
        let mut free = [Free { slices: 4, loaned: false }];
        let started = shortest_first(&[job(4, 3600.0, true), job(4, 60.0, true)], &mut free);
        assert_eq!(started, vec![(1, vec![(0, 4)])]);
        assert_eq!(free[0].slices, 0);
    }

    #[test]
    fn a_job_that_does_not_fit_is_skipped_for_one_that_does() {
        let mut free = [Free { slices: 3, loaned: false }];
        let started = shortest_first(&[job(4, 10.0, true), job(2, 20.0, true)], &mut free);
        assert_eq!(started, vec![(1, vec![(0, 2)])]);
    }

    #[test]
    fn non_preemptible_jobs_stay_off_loaned_slices() {
        let mut free = [Free { slices: 2, loaned: false }, Free { slices: 8, loaned: true }];
        let started = shortest_first(&[job(4, 10.0, false), job(4, 20.0, true), job(2, 30.0, false)], &mut free);
        assert_eq!(started, vec![(1, vec![(1, 4)]), (2, vec![(0, 2)])]);
    }

    /// Through the whole round: jobs nothing was measured of start shortest-first by their
    /// declared steps, and the knapsack grows the elastic one onto what is left.
    #[test]
    fn unmeasured_jobs_start_shortest_first_and_the_elastic_one_grows() {
        use super::super::round::{plan_round, Job, Pool, Round};
        use super::super::step_times::StepTimes;
        let job = |min: u32, max: u32, steps: f64| Job {
            min_ranks: min,
            max_ranks: max,
            requested_ranks: max,
            preemptible: true,
            remaining_steps: steps,
            step_secs: StepTimes::new([]),
            checkpoint_age_secs: 0.0,
            restart_secs: 60.0,
            holdings: Vec::new(),
            resizable: false,
            resuming: false,
        };
        // Arrival order: a long job first, then two short ones; 5 slices.
        let jobs = [job(4, 4, 100_000.0), job(2, 4, 50.0), job(1, 1, 10.0)];
        let capacity = [(Pool::Training, 5)];
        let plan = plan_round(&Round { capacity: &capacity, jobs: &jobs, elastic: true, resize_pause_secs: 30.0, resize_margin: 0.0 });
        let ranks: Vec<u32> = plan.placements.iter().map(|p| p.holdings.iter().map(|&(_, n)| n).sum()).collect();
        // The long job waits; the short elastic one starts at 2 and takes the other 2 spare.
        assert_eq!(ranks, vec![0, 4, 1]);
    }

    #[test]
    fn preemptible_jobs_take_the_largest_loaned_pool_first_then_training() {
        let mut free = [Free { slices: 5, loaned: false }, Free { slices: 2, loaned: true }, Free { slices: 3, loaned: true }];
        let started = shortest_first(&[job(7, 1.0, true)], &mut free);
        assert_eq!(started, vec![(0, vec![(2, 3), (1, 2), (0, 2)])]);
    }
}
