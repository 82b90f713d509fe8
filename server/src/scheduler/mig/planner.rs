//! The planners alone or together, each answer reported with the lower bound and its gap;
//! also the two baselines the benchmark compares against.
//!
//! `Best` departs from MIG-serving's order (greedy → genetic → tree search): after the
//! greedy it runs the exact search with a small node budget, because with the integer
//! slot-price bound that search usually proves the optimum in milliseconds even for 50
//! services; only when it gives up do the genetic algorithm (seeded with the best plan so
//! far) and the tree search run.

use super::bound::lower_bound;
use super::compact::compact;
use super::exact::{self, ExactOptions};
use super::genetic::{self, GeneticOptions};
use super::greedy::{self, Utility};
use super::mcts::{self, MctsOptions};
use super::plan::{gap, Plan, Problem};
use super::space::{LatticeCache, Solution, Space};

/// Which planner to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// MIG-serving's utility-first greedy.
    Greedy,
    /// The genetic algorithm seeded with the greedy.
    Genetic,
    /// Monte Carlo tree search with greedy roll-outs.
    Mcts,
    /// Branch and bound, proving optimality unless it runs out of nodes.
    Exact,
    /// The greedy, then the exact search on a small budget, then (if still unproven) the
    /// genetic algorithm and the tree search; keeps the best plan.
    Best,
}

impl Algorithm {
    pub const ALL: [Algorithm; 5] =
        [Algorithm::Greedy, Algorithm::Genetic, Algorithm::Mcts, Algorithm::Exact, Algorithm::Best];

    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Greedy => "greedy",
            Algorithm::Genetic => "genetic",
            Algorithm::Mcts => "mcts",
            Algorithm::Exact => "exact",
            Algorithm::Best => "best",
        }
    }

    pub fn parse(text: &str) -> Option<Algorithm> {
        Algorithm::ALL.into_iter().find(|a| a.name().eq_ignore_ascii_case(text))
    }
}

/// Default seed for the randomised planners (MIG-serving's arXiv number).
pub const DEFAULT_SEED: u64 = 2109_11067;

/// Knobs of every planner.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Options {
    pub seed: u64,
    pub genetic: GeneticOptions,
    pub mcts: MctsOptions,
    pub exact: ExactOptions,
    /// Node budget of the exact search inside `Best` (alone it gets `exact.node_limit`).
    pub best_exact_nodes: u64,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            seed: DEFAULT_SEED,
            genetic: GeneticOptions::default(),
            mcts: MctsOptions::default(),
            exact: ExactOptions::default(),
            best_exact_nodes: 300_000,
        }
    }
}

/// A plan with its quality.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub plan: Plan,
    pub algorithm: Algorithm,
    /// The stage whose answer this is (differs from `algorithm` for `Best`).
    pub found_by: Algorithm,
    /// No plan uses fewer GPUs (the optimum itself when `optimal`).
    pub lower_bound: usize,
    /// The slot-price bound before rounding.
    pub fractional_bound: f64,
    /// Proven optimal, by the exact solver or by meeting the bound.
    pub optimal: bool,
    /// (GPUs − lower bound) / lower bound.
    pub gap: f64,
}

/// Runs `algorithm` on `problem`. The problem must be valid (every service has a positive
/// demand and at least one profile), as [`super::input`] guarantees.
pub fn plan(problem: &Problem, algorithm: Algorithm, options: &Options) -> Outcome {
    let space = Space::new(problem);
    let bound = lower_bound(&space);
    let lb = bound.gpus;
    let greedy_plan = || greedy::solve(&space, Utility::DemandShare);
    let seeds = || vec![greedy::solve(&space, Utility::DemandShare), greedy::solve(&space, Utility::Work)];
    let mut proven = false;
    let (solution, found_by): (Solution, Algorithm) = match algorithm {
        Algorithm::Greedy => (greedy_plan(), Algorithm::Greedy),
        Algorithm::Genetic => (genetic::solve(&space, seeds(), options.genetic, options.seed), Algorithm::Genetic),
        Algorithm::Mcts => (mcts::solve(&space, None, lb, options.mcts, options.seed), Algorithm::Mcts),
        Algorithm::Exact => {
            let mut incumbent = best_of(seeds());
            compact(&space, &mut incumbent, &mut LatticeCache::default());
            let outcome = exact::solve(&space, incumbent, options.exact);
            proven = outcome.proven;
            (outcome.solution, Algorithm::Exact)
        }
        Algorithm::Best => {
            let mut best = (greedy_plan(), Algorithm::Greedy);
            let better = |candidate: Solution, by: Algorithm, best: &mut (Solution, Algorithm)| {
                if candidate.len() < best.0.len() {
                    *best = (candidate, by);
                }
            };
            // The exact search first: where the bound is tight it proves the optimum in
            // milliseconds, and when it gives up within its budget the paper's stages run.
            if best.0.len() > lb {
                let budget = ExactOptions {
                    node_limit: options.best_exact_nodes.min(options.exact.node_limit),
                    ..options.exact
                };
                let mut incumbent = best_of(vec![best.0.clone(), greedy::solve(&space, Utility::Work)]);
                compact(&space, &mut incumbent, &mut LatticeCache::default());
                let outcome = exact::solve(&space, incumbent, budget);
                proven = outcome.proven;
                better(outcome.solution, Algorithm::Exact, &mut best);
            }
            if best.0.len() > lb && !proven {
                let ga = genetic::solve(
                    &space,
                    vec![best.0.clone(), greedy::solve(&space, Utility::Work)],
                    options.genetic,
                    options.seed,
                );
                better(ga, Algorithm::Genetic, &mut best);
            }
            if best.0.len() > lb && !proven {
                let tree = mcts::solve(&space, Some(best.0.clone()), lb, options.mcts, options.seed);
                better(tree, Algorithm::Mcts, &mut best);
            }
            best
        }
    };
    debug_assert!(space.is_feasible(&solution));
    let gpus = solution.len();
    let optimal = proven || gpus <= lb;
    let lower = if proven { gpus } else { lb.min(gpus) };
    Outcome {
        plan: space.to_plan(&solution),
        algorithm,
        found_by,
        lower_bound: lower,
        fractional_bound: bound.fractional,
        optimal,
        gap: gap(gpus, lower),
    }
}

fn best_of(solutions: Vec<Solution>) -> Solution {
    solutions.into_iter().min_by_key(|s| s.len()).expect("at least one solution")
}

/// The best plan in which every GPU has the same partition: the "single homogeneous
/// partition" baseline. Each partition is tried with the greedy and compaction.
#[derive(Debug, Clone, PartialEq)]
pub struct Homogeneous {
    /// Profile names of the partition, by start.
    pub partition: Vec<&'static str>,
    pub gpus: usize,
}

pub fn best_homogeneous(problem: &Problem) -> Option<Homogeneous> {
    let shapes = Space::new(problem).shapes.len();
    let mut best: Option<Homogeneous> = None;
    for i in 0..shapes {
        let mut space = Space::new(problem);
        let shape = space.shapes.swap_remove(i);
        space.shapes = vec![shape];
        // A shape without any slot some service can use never meets the demand.
        let usable = (0..space.services())
            .all(|w| space.shapes[0].counts.iter().enumerate().any(|(t, &n)| n > 0 && space.rate[w][t] > 0.0));
        if !usable {
            continue;
        }
        let mut solution =
            best_of(vec![greedy::solve(&space, Utility::DemandShare), greedy::solve(&space, Utility::Work)]);
        compact(&space, &mut solution, &mut LatticeCache::default());
        if best.as_ref().is_none_or(|b| solution.len() < b.gpus) {
            let partition = space.shapes[0].placement.iter().map(|s| problem.gpu.profile(s.profile).name).collect();
            best = Some(Homogeneous { partition, gpus: solution.len() });
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::mig::catalog::GpuModel;
    use crate::scheduler::mig::space::tests::bert_like;

    fn mixed() -> Problem {
        let services = (0..10)
            .map(|i| {
                bert_like(
                    &format!("s{i}"),
                    [150.0, 2400.0, 380.0, 90.0, 1200.0, 640.0, 300.0, 3100.0, 200.0, 820.0][i],
                    1.0 + 0.1 * (i % 3) as f64,
                )
            })
            .collect();
        Problem { gpu: GpuModel::A100_80GB, services }
    }

    #[test]
    fn every_algorithm_returns_a_valid_plan_no_better_than_the_bound() {
        let problem = mixed();
        for algorithm in Algorithm::ALL {
            let outcome = plan(&problem, algorithm, &Options::default());
            outcome.plan.check(&problem).unwrap();
            assert!(outcome.plan.gpu_count() >= outcome.lower_bound, "{algorithm:?}");
            assert!(outcome.gap >= 0.0);
        }
    }

    #[test]
    fn best_is_at_least_as_good_as_each_stage_and_small_cases_are_proven() {
        let problem = mixed();
        let best = plan(&problem, Algorithm::Best, &Options::default());
        for algorithm in [Algorithm::Greedy, Algorithm::Genetic, Algorithm::Mcts] {
            assert!(best.plan.gpu_count() <= plan(&problem, algorithm, &Options::default()).plan.gpu_count());
        }
        assert!(best.optimal, "ten services is small enough to prove");
        assert_eq!(best.gap, 0.0);
    }

    #[test]
    fn mig_beats_whole_gpus_and_homogeneous_partitions_on_a_mixed_load() {
        let problem = mixed();
        let best = plan(&problem, Algorithm::Best, &Options::default()).plan.gpu_count();
        let whole = problem.whole_gpu_count().unwrap();
        let homogeneous = best_homogeneous(&problem).unwrap();
        assert!(best < whole, "{best} vs {whole}");
        assert!(best <= homogeneous.gpus);
        assert!(homogeneous.gpus <= whole);
    }

    #[test]
    fn algorithm_names_round_trip() {
        for a in Algorithm::ALL {
            assert_eq!(Algorithm::parse(a.name()), Some(a));
        }
        assert_eq!(Algorithm::parse("simulated-annealing"), None);
    }
}
