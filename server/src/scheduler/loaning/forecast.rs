//! When each training job of a round's plan starts and finishes: the dashboard's predicted
//! JCT. An event walk over the plan: running jobs finish after their remaining steps at the
//! ranks the plan leaves them; as their slices free, waiting jobs start by the round's own
//! rule (`shortest_first`: resumed resizes, then shortest predicted first, backfilling
//! what fits), each at the ranks it starts with. Times are seconds from the round.
//!
//! What it leaves out, so the figure is the plan's if nothing else happens: jobs that
//! arrive later, loans that grow or are taken back after this round (the loaned slices
//! the round leaves training stay training's for the whole walk), and the knapsack growing
//! a job after it started (an elastic job that starts later runs at its minimum, so its
//! own figure is pessimistic).

use super::round::{Plan, Pool, Round};
use super::shortest_first::{queue_order, shortest_first, Free, Waiting};

/// What the plan means for one job's start.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Outlook {
    /// It ran before the round and runs on at the same slices, finishing in `finish_secs`.
    Running { finish_secs: f64 },
    /// It starts in `start_secs` (0: the plan places it now; a running job the plan resizes
    /// or moves goes on after the round's resize pause, one it preempts after its restart)
    /// and finishes in `finish_secs`.
    Starts { start_secs: f64, finish_secs: f64 },
    /// It asks for more slices than the pools it may use hold once every other job ended:
    /// it starts only if the fleet grows.
    Never,
}

/// One job's forecast.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Forecast {
    pub outlook: Outlook,
    /// Ranks it runs at in the forecast.
    pub ranks: u32,
    /// Its own step times were measured (at some rank count), and so were those of every
    /// job whose end its start waited for: false when any of them is the prior's.
    pub measured: bool,
}

impl Forecast {
    /// Seconds from the round until it starts; `None` while it runs on, or never starts.
    pub fn start_secs(&self) -> Option<f64> {
        match self.outlook {
            Outlook::Starts { start_secs, .. } => Some(start_secs),
            _ => None,
        }
    }

    /// Seconds from the round until it finishes; `None` when it never starts.
    pub fn finish_secs(&self) -> Option<f64> {
        match self.outlook {
            Outlook::Running { finish_secs } | Outlook::Starts { finish_secs, .. } => {
                Some(finish_secs)
            }
            Outlook::Never => None,
        }
    }
}

/// The forecast of every job of `round` under `plan` (`plan_round(round)`), same order.
pub fn forecast(round: &Round, plan: &Plan) -> Vec<Forecast> {
    let jobs = round.jobs;
    assert_eq!(plan.placements.len(), jobs.len(), "the plan is the round's");
    let mut pools: Vec<Pool> = round.capacity.iter().map(|&(p, _)| p).collect();
    pools.extend(
        plan.placements
            .iter()
            .flat_map(|pl| pl.holdings.iter().map(|&(p, _)| p)),
    );
    pools.sort_unstable();
    pools.dedup();
    let index = |p: Pool| pools.binary_search(&p).expect("every pool is listed");
    let mut free: Vec<Free> = pools
        .iter()
        .map(|&p| Free {
            slices: 0,
            loaned: p != Pool::Training,
        })
        .collect();
    for &(p, n) in round.capacity {
        free[index(p)].slices += n;
    }
    let own_measured: Vec<bool> = jobs.iter().map(|j| !j.step_secs.is_empty()).collect();

    let mut out: Vec<Forecast> = vec![
        Forecast {
            outlook: Outlook::Never,
            ranks: 0,
            measured: false
        };
        jobs.len()
    ];
    // Slices each job holds while it runs (pool index, count), given back when it ends.
    let mut holds: Vec<Vec<(usize, u32)>> = vec![Vec::new(); jobs.len()];
    // (finish seconds, job) of the jobs running in the walk.
    let mut ends: Vec<(f64, usize)> = Vec::new();
    let mut waiting: Vec<usize> = Vec::new();
    for (j, (job, placement)) in jobs.iter().zip(&plan.placements).enumerate() {
        let ranks: u32 = placement.holdings.iter().map(|&(_, n)| n).sum();
        if ranks == 0 {
            waiting.push(j);
            continue;
        }
        for &(p, n) in &placement.holdings {
            let f = &mut free[index(p)];
            f.slices = f.slices.saturating_sub(n);
            holds[j].push((index(p), n));
        }
        let run = job.step_secs.remaining_secs(job.remaining_steps, ranks);
        let outlook = if job.holdings.is_empty() {
            Outlook::Starts {
                start_secs: 0.0,
                finish_secs: run,
            }
        } else if placement.preempted || !same_slices(&job.holdings, &placement.holdings) {
            // Preempted, it restarts after its restart; resized (or moved by a reclaim), it
            // goes on after the round's resize pause.
            let pause = if placement.preempted { job.restart_secs } else { round.resize_pause_secs };
            Outlook::Starts {
                start_secs: pause,
                finish_secs: pause + run,
            }
        } else {
            Outlook::Running { finish_secs: run }
        };
        ends.push((outlook_finish(outlook), j));
        out[j] = Forecast {
            outlook,
            ranks,
            measured: own_measured[j],
        };
    }

    // The event walk: at each end, its slices free and waiting jobs start by the round's rule.
    let start_ranks = |j: usize| {
        let job = &jobs[j];
        if round.elastic && job.max_ranks > job.min_ranks {
            job.min_ranks
        } else {
            job.requested_ranks
        }
    };
    // What each job asks of the queue, fixed through the walk: computed once, not at
    // every end (a walk at 1,000 jobs has as many ends).
    let asks: Vec<Waiting> = jobs
        .iter()
        .enumerate()
        .map(|(j, job)| Waiting {
            ranks: start_ranks(j),
            predicted_secs: job.step_secs.remaining_secs(job.remaining_steps, start_ranks(j)),
            preemptible: job.preemptible,
            resuming: job.resuming,
        })
        .collect();
    // Kept in start order, so each end's `shortest_first` sorts a sorted queue (one pass).
    waiting.sort_by(|&a, &b| queue_order(&asks[a], &asks[b]).then(a.cmp(&b)));
    while !ends.is_empty() {
        // The earliest end (ties: every job ending then).
        let now = ends.iter().map(|&(t, _)| t).fold(f64::INFINITY, f64::min);
        let mut waited_on_prior = false;
        ends.retain(|&(t, j)| {
            if t > now {
                return true;
            }
            for &(p, n) in &holds[j] {
                free[p].slices += n;
            }
            waited_on_prior |= !out[j].measured;
            false
        });
        let spare: u32 = free.iter().map(|f| f.slices).sum();
        if waiting.is_empty() || waiting.iter().all(|&j| asks[j].ranks > spare) {
            continue;
        }
        let queue: Vec<Waiting> = waiting.iter().map(|&j| asks[j]).collect();
        let started = shortest_first(&queue, &mut free);
        let mut gone = vec![false; waiting.len()];
        for (w, took) in started {
            let j = waiting[w];
            gone[w] = true;
            let finish = now + asks[j].predicted_secs;
            holds[j] = took;
            ends.push((finish, j));
            out[j] = Forecast {
                outlook: Outlook::Starts {
                    start_secs: now,
                    finish_secs: finish,
                },
                ranks: asks[j].ranks,
                measured: own_measured[j] && !waited_on_prior,
            };
        }
        let mut i = 0;
        waiting.retain(|_| {
            i += 1;
            !gone[i - 1]
        });
    }
    // Whoever still waits asks for more than its pools hold: `Never`, at its start ranks.
    for &j in &waiting {
        out[j].ranks = start_ranks(j);
        out[j].measured = own_measured[j];
    }
    out
}

fn outlook_finish(outlook: Outlook) -> f64 {
    match outlook {
        Outlook::Running { finish_secs } | Outlook::Starts { finish_secs, .. } => finish_secs,
        Outlook::Never => f64::INFINITY,
    }
}

/// The same slices per pool (orders and zero counts aside).
fn same_slices(a: &[(Pool, u32)], b: &[(Pool, u32)]) -> bool {
    let norm = |h: &[(Pool, u32)]| {
        let mut h: Vec<(Pool, u32)> = h.iter().copied().filter(|&(_, n)| n > 0).collect();
        h.sort_unstable();
        h
    };
    norm(a) == norm(b)
}

#[cfg(test)]
mod tests {
    use super::super::round::{plan_round, Job};
    use super::super::StepTimes;
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn job(ranks: u32, steps: f64, step_secs: StepTimes) -> Job {
        Job {
            min_ranks: ranks,
            max_ranks: ranks,
            requested_ranks: ranks,
            preemptible: true,
            remaining_steps: steps,
            step_secs,
            checkpoint_age_secs: 0.0,
            restart_secs: 60.0,
            holdings: Vec::new(),
            resizable: false,
            resuming: false,
        }
    }

    /// One second per step at one rank, half that at two, a quarter at four (measured).
    fn halving() -> StepTimes {
        StepTimes::new([(1, 1.0), (2, 0.5), (4, 0.25)])
    }

    fn round<'a>(capacity: &'a [(Pool, u32)], jobs: &'a [Job]) -> Round<'a> {
        Round {
            capacity,
            jobs,
            elastic: true,
            resize_pause_secs: 60.0,
            resize_margin: 1.0,
        }
    }

    fn predict(capacity: &[(Pool, u32)], jobs: &[Job]) -> Vec<Forecast> {
        let r = round(capacity, jobs);
        forecast(&r, &plan_round(&r))
    }

    fn close(a: Option<f64>, b: f64) -> bool {
        a.is_some_and(|a| (a - b).abs() < 1e-9)
    }

    #[test]
    fn a_running_job_finishes_after_its_remaining_steps_at_its_ranks() {
        let mut running = job(2, 100.0, halving());
        running.holdings = vec![(Pool::Training, 2)];
        let f = predict(&[(Pool::Training, 2)], &[running]);
        assert_eq!(f[0].outlook, Outlook::Running { finish_secs: 50.0 });
        assert_eq!(
            (f[0].ranks, f[0].measured, f[0].start_secs()),
            (2, true, None)
        );
    }

    #[test]
    fn waiting_jobs_start_shortest_first_as_slices_free() {
        // Four slices: a running job holds two for 50 s; the plan starts the 10 s job on the
        // other two now. The 40 s and 20 s jobs of two ranks wait: the 20 s one starts when
        // the 10 s job ends, the 40 s one when that ends at 30 s (before the running job).
        let mut running = job(2, 100.0, halving());
        running.holdings = vec![(Pool::Training, 2)];
        let jobs = [
            running,
            job(2, 80.0, halving()),
            job(2, 20.0, halving()),
            job(2, 40.0, halving()),
        ];
        let f = predict(&[(Pool::Training, 4)], &jobs);
        assert_eq!(
            f[2].outlook,
            Outlook::Starts {
                start_secs: 0.0,
                finish_secs: 10.0
            }
        );
        assert_eq!(
            f[3].outlook,
            Outlook::Starts {
                start_secs: 10.0,
                finish_secs: 30.0
            }
        );
        assert_eq!(
            f[1].outlook,
            Outlook::Starts {
                start_secs: 30.0,
                finish_secs: 70.0
            }
        );
        assert!(f.iter().all(|f| f.measured && f.ranks == 2));
    }

    #[test]
    fn a_job_that_does_not_fit_yet_is_passed_by_one_that_does() {
        // Four slices, one held for 100 s by a running job. A 4-rank job cannot start
        // before everything ends; a longer 1-rank job backfills at once (the plan's rule).
        let mut running = job(1, 100.0, halving());
        running.holdings = vec![(Pool::Training, 1)];
        let mut wide = job(4, 40.0, halving());
        wide.requested_ranks = 4;
        let jobs = [running, wide, job(1, 200.0, halving())];
        let f = predict(&[(Pool::Training, 4)], &jobs);
        assert_eq!(
            f[2].outlook,
            Outlook::Starts {
                start_secs: 0.0,
                finish_secs: 200.0
            }
        );
        assert_eq!(
            f[1].outlook,
            Outlook::Starts {
                start_secs: 200.0,
                finish_secs: 210.0
            }
        );
    }

    #[test]
    fn a_job_larger_than_its_pools_never_starts() {
        // Not preemptible: it may not use the loaned slices, and the training pool has 2.
        let mut fixed = job(3, 10.0, halving());
        fixed.preemptible = false;
        let f = predict(
            &[(Pool::Training, 2), (Pool::Loaned(0), 4)],
            &[fixed.clone()],
        );
        assert_eq!(
            (f[0].outlook, f[0].ranks, f[0].finish_secs()),
            (Outlook::Never, 3, None)
        );
        // Preemptible, the loaned slices count.
        fixed.preemptible = true;
        let f = predict(&[(Pool::Training, 2), (Pool::Loaned(0), 4)], &[fixed]);
        let at_three = halving().at(3);
        assert_eq!(
            f[0].outlook,
            Outlook::Starts {
                start_secs: 0.0,
                finish_secs: 10.0 * at_three
            }
        );
    }

    #[test]
    fn a_running_job_the_round_resizes_pays_the_resize_pause_not_a_restart() {
        // Running at one rank with four free slices and a long way to go: the plan grows it
        // to four, so it goes on after the 10 s resize pause (in place, not its 60 s
        // restart) at a quarter of the step time.
        let mut elastic = job(1, 10_000.0, halving());
        elastic.max_ranks = 4;
        elastic.holdings = vec![(Pool::Training, 1)];
        elastic.resizable = true;
        let jobs = [elastic];
        let r = Round { resize_pause_secs: 10.0, ..round(&[(Pool::Training, 4)], &jobs) };
        let f = forecast(&r, &plan_round(&r));
        assert_eq!(f[0].ranks, 4);
        assert_eq!(
            f[0].outlook,
            Outlook::Starts {
                start_secs: 10.0,
                finish_secs: 10.0 + 2500.0
            }
        );
    }

    #[test]
    fn a_start_that_waits_on_a_prior_figure_rests_on_the_prior() {
        // The running job was never measured (the prior: 1 s a step at one rank); the
        // waiting one was, but it starts when the prior says the running one ends.
        let mut unmeasured = job(2, 10.0, StepTimes::new([]));
        unmeasured.holdings = vec![(Pool::Training, 2)];
        let jobs = [unmeasured, job(2, 10.0, halving())];
        let f = predict(&[(Pool::Training, 2)], &jobs);
        assert!(!f[0].measured && !f[1].measured, "{f:?}");
        assert!(close(f[1].start_secs(), 10.0 * 0.55));
        // Measured, both figures rest on measurements.
        let mut measured = jobs[0].clone();
        measured.step_secs = halving();
        let f = predict(&[(Pool::Training, 2)], &[measured, jobs[1].clone()]);
        assert!(f[0].measured && f[1].measured, "{f:?}");
        assert!(close(f[1].start_secs(), 5.0));
    }

    #[test]
    fn never_more_ranks_at_once_than_the_pool_holds_and_every_job_that_fits_ends() {
        let mut rng = StdRng::seed_from_u64(16);
        for case in 0..300 {
            let cap = rng.gen_range(1..12u32);
            let mut jobs = Vec::new();
            let mut used = 0;
            for _ in 0..rng.gen_range(1..15) {
                let ranks = rng.gen_range(1..6u32);
                let measured = rng.gen_bool(0.7);
                let times = if measured {
                    StepTimes::new([(1, rng.gen_range(0.1..2.0))])
                } else {
                    StepTimes::new([])
                };
                let mut j = job(ranks, rng.gen_range(0.0..500.0), times);
                if used + ranks <= cap && rng.gen_bool(0.4) {
                    j.holdings = vec![(Pool::Training, ranks)];
                    used += ranks;
                }
                jobs.push(j);
            }
            let f = predict(&[(Pool::Training, cap)], &jobs);
            // Ranks in use just after every start: within the pool.
            let span = |f: &Forecast| (f.start_secs().unwrap_or(0.0), f.finish_secs().unwrap());
            for probe in f.iter().filter(|f| f.finish_secs().is_some()) {
                let t = span(probe).0;
                let busy: u32 = f
                    .iter()
                    .filter(|g| g.finish_secs().is_some())
                    .filter(|g| span(g).0 <= t && t < span(g).1)
                    .map(|g| g.ranks)
                    .sum();
                assert!(
                    busy <= cap,
                    "case {case}: {busy} ranks of {cap} at {t}: {f:?}"
                );
            }
            for (j, g) in jobs.iter().zip(&f) {
                let fits = j.requested_ranks <= cap;
                assert_eq!(g.finish_secs().is_some(), fits, "case {case}: {g:?}");
                if let Some((start, finish)) = g.finish_secs().map(|_| span(g)) {
                    assert!(start >= 0.0 && finish >= start, "case {case}: {g:?}");
                }
            }
        }
    }
}
