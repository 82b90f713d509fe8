//! Taking loaned slices back for serving: Aryl's reclaiming greedy (Li et al., arXiv
//! 2202.07896, capacity reclaiming; research note §3), which repeatedly frees the capacity
//! with the least preemption cost until the deployment has what it asked for.
//!
//! Departures (the paper's exact cost is not public; the research note marks it GUESS):
//! - The unit is a slice of one lender, not a server, and the cost is in GPU-seconds:
//!   preempting a job loses the work since its last checkpoint and pays a restart on every
//!   rank, `ranks × (checkpoint age + restart)`; shrinking an elastic job stops all its ranks
//!   for one resize, `ranks × resize pause`, whatever number of ranks it gives back.
//! - Shrinking comes first, as the issue asks: every elastic job above its floor gives ranks
//!   (cheapest resize first) before anyone is preempted.
//! - The preemption greedy compares jobs by cost per slice freed towards what is still
//!   needed, so an 8-rank job is not preempted for one slice when a 1-rank job will do.
//! - A job that is not preemptible is preempted only when nothing else can free the need.

/// Cost added to preempting a job that is not preemptible: a last resort.
const NOT_PREEMPTIBLE: f64 = 1e15;

/// A training job holding slices of the lender being reclaimed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tenant {
    /// Slices it holds on this lender.
    pub here: u32,
    /// Ranks it runs at in all.
    pub ranks: u32,
    /// Fewest ranks it may shrink to (its `min_ranks`; its ranks now if it is not elastic).
    pub floor: u32,
    pub preemptible: bool,
    /// Seconds of work since its last checkpoint.
    pub checkpoint_age_secs: f64,
    /// Seconds a restart takes (load checkpoint, re-form ranks).
    pub restart_secs: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Give back this many ranks from this lender and keep running.
    Shrink { tenant: usize, ranks: u32 },
    /// Checkpoint now if it can, stop, and go back to the queue.
    Preempt { tenant: usize },
}

#[derive(Debug, Clone, PartialEq)]
pub struct Reclaimed {
    pub actions: Vec<Action>,
    /// Slices freed on this lender (at least the need when the tenants hold that much).
    pub freed: u32,
    /// Total cost in GPU-seconds.
    pub cost: f64,
}

pub fn preempt_cost(t: &Tenant) -> f64 {
    let base = t.ranks as f64 * (t.checkpoint_age_secs.max(0.0) + t.restart_secs.max(0.0));
    if t.preemptible {
        base
    } else {
        base + NOT_PREEMPTIBLE
    }
}

pub fn shrink_cost(t: &Tenant, resize_pause_secs: f64) -> f64 {
    t.ranks as f64 * resize_pause_secs.max(0.0)
}

/// Frees `need` slices of one lender from `tenants` at the least cost the greedy finds:
/// first by shrinking elastic jobs (cheapest resize first, as many ranks from one job as it
/// can give), then by preempting (least cost per useful slice first).
pub fn reclaim(tenants: &[Tenant], need: u32, resize_pause_secs: f64) -> Reclaimed {
    let mut shrunk = vec![0u32; tenants.len()];
    let mut paid = vec![0.0f64; tenants.len()];
    let mut preempted = vec![false; tenants.len()];
    let mut freed = 0u32;
    // (cost per useful slice, useful slices, tenant): the least cost, then the most freed.
    let better = |a: (f64, u32, usize), b: Option<(f64, u32, usize)>| b.is_none_or(|b| a.0 < b.0 || (a.0 == b.0 && a.1 > b.1));
    while freed < need {
        let left = need - freed;
        let mut best = None;
        for (i, t) in tenants.iter().enumerate() {
            let can = t.here.min(t.ranks - t.floor.min(t.ranks)).saturating_sub(shrunk[i]);
            if can > 0 && shrunk[i] == 0 {
                let useful = can.min(left);
                let option = (shrink_cost(t, resize_pause_secs) / useful as f64, useful, i);
                if better(option, best) {
                    best = Some(option);
                }
            }
        }
        let Some((_, useful, i)) = best else {
            break;
        };
        paid[i] = shrink_cost(&tenants[i], resize_pause_secs);
        shrunk[i] = useful;
        freed += useful;
    }
    while freed < need {
        let left = need - freed;
        let mut best = None;
        for (i, t) in tenants.iter().enumerate() {
            if preempted[i] || t.here <= shrunk[i] {
                continue;
            }
            let useful = (t.here - shrunk[i]).min(left);
            let option = ((preempt_cost(t) - paid[i]).max(0.0) / useful as f64, useful, i);
            if better(option, best) {
                best = Some(option);
            }
        }
        let Some((_, _, i)) = best else {
            break;
        };
        let frees = tenants[i].here - shrunk[i];
        paid[i] = preempt_cost(&tenants[i]);
        preempted[i] = true;
        freed += frees;
    }
    let mut actions = Vec::new();
    for i in 0..tenants.len() {
        if preempted[i] {
            actions.push(Action::Preempt { tenant: i });
        } else if shrunk[i] > 0 {
            actions.push(Action::Shrink { tenant: i, ranks: shrunk[i] });
        }
    }
    Reclaimed { actions, freed, cost: paid.iter().sum() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn tenant(here: u32, ranks: u32, floor: u32, age: f64) -> Tenant {
        Tenant { here, ranks, floor, preemptible: true, checkpoint_age_secs: age, restart_secs: 60.0 }
    }

    #[test]
    fn shrinks_an_elastic_job_before_preempting_anyone() {
        let tenants = [tenant(2, 2, 2, 0.0), tenant(4, 8, 4, 600.0)];
        let r = reclaim(&tenants, 3, 30.0);
        assert_eq!(r.actions, vec![Action::Shrink { tenant: 1, ranks: 3 }]);
        assert_eq!(r.freed, 3);
    }

    #[test]
    fn preempts_the_job_that_loses_least_work() {
        let tenants = [tenant(1, 1, 1, 1800.0), tenant(1, 1, 1, 60.0), tenant(1, 1, 1, 900.0)];
        let r = reclaim(&tenants, 1, 30.0);
        assert_eq!(r.actions, vec![Action::Preempt { tenant: 1 }]);
    }

    #[test]
    fn a_big_job_is_not_preempted_for_one_slice_a_small_one_can_give() {
        let tenants = [tenant(8, 8, 8, 100.0), tenant(1, 1, 1, 300.0)];
        // Big: 8 × 160 = 1280 for 1 useful slice; small: 1 × 360.
        let r = reclaim(&tenants, 1, 30.0);
        assert_eq!(r.actions, vec![Action::Preempt { tenant: 1 }]);
    }

    #[test]
    fn non_preemptible_job_is_the_last_resort() {
        let mut keep = tenant(2, 2, 2, 0.0);
        keep.preemptible = false;
        let tenants = [keep, tenant(1, 1, 1, 3000.0)];
        assert_eq!(reclaim(&tenants, 1, 30.0).actions, vec![Action::Preempt { tenant: 1 }]);
        let r = reclaim(&tenants, 3, 30.0);
        assert_eq!(r.freed, 3);
        assert_eq!(r.actions.len(), 2);
    }

    #[test]
    fn frees_at_least_the_need_and_never_shrinks_below_the_floor() {
        let mut rng = StdRng::seed_from_u64(23);
        for case in 0..3000 {
            let tenants: Vec<Tenant> = (0..rng.gen_range(0..8))
                .map(|_| {
                    let ranks = rng.gen_range(1..17);
                    let here = rng.gen_range(1..=ranks);
                    Tenant {
                        here,
                        ranks,
                        floor: rng.gen_range(1..=ranks),
                        preemptible: rng.gen_bool(0.8),
                        checkpoint_age_secs: rng.gen_range(0.0..3600.0),
                        restart_secs: rng.gen_range(0.0..120.0),
                    }
                })
                .collect();
            let held: u32 = tenants.iter().map(|t| t.here).sum();
            let need = rng.gen_range(0..=held + 2);
            let r = reclaim(&tenants, need, rng.gen_range(0.0..60.0));
            assert!(r.freed >= need.min(held), "case {case}: freed {} of {need}", r.freed);
            assert!(r.freed <= held);
            let mut freed = 0;
            for a in &r.actions {
                match *a {
                    Action::Shrink { tenant, ranks } => {
                        let t = &tenants[tenant];
                        assert!(ranks <= t.here && t.ranks - ranks >= t.floor, "case {case}: below floor");
                        freed += ranks;
                    }
                    Action::Preempt { tenant } => freed += tenants[tenant].here,
                }
            }
            assert_eq!(freed, r.freed, "case {case}");
            // Shrinking comes first: no one is preempted while shrinks could cover the need.
            let shrinkable: u32 = tenants.iter().map(|t| t.here.min(t.ranks - t.floor)).sum();
            if shrinkable >= need {
                assert!(r.actions.iter().all(|a| matches!(a, Action::Shrink { .. })), "case {case}: preempted");
            }
            if need == 0 {
                assert!(r.actions.is_empty());
            }
        }
    }
}
