//! The genetic stage of MIG-serving (Tan et al., arXiv 2109.11067; research note §1,
//! where the operators are marked as a guess): a chromosome is a set of GPU
//! configurations, the population is seeded with the greedy's answer, and fitness is the
//! GPU count with every demand met.
//!
//! Operators, in the style of Falkenauer's grouping GA for bin packing (the paper's are
//! not public): crossover pools both parents' GPUs and keeps the fullest ones that are not
//! redundant with each other; mutation drops one to three GPUs, the emptier ones more
//! likely. Every child is repaired by filling idle slots and running a noisy greedy for
//! what is still missing, then trimmed and compacted ([`super::compact`]). Ties in GPU
//! count are broken by Σ fill², which prefers plans with one nearly empty GPU, the next to
//! go. Randomness comes from a seeded generator, so a seed reproduces a run.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use super::compact::compact;
use super::greedy::{complete, prices, Noise, Utility};
use super::space::{LatticeCache, Solution, Space};

/// Size of the search.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GeneticOptions {
    pub population: usize,
    pub generations: usize,
    /// Generations without improvement after which the search stops early.
    pub patience: usize,
}

impl Default for GeneticOptions {
    fn default() -> Self {
        GeneticOptions { population: 16, generations: 30, patience: 6 }
    }
}

/// Smaller is better: GPU count, then −Σ fill².
fn fitness(space: &Space, s: &Solution) -> (usize, f64) {
    (s.len(), -s.iter().map(|c| space.fill(c).powi(2)).sum::<f64>())
}

fn better(a: (usize, f64), b: (usize, f64)) -> bool {
    a.0 < b.0 || (a.0 == b.0 && a.1 < b.1 - 1e-12)
}

struct Ga<'a> {
    space: &'a Space<'a>,
    rng: StdRng,
    share: Vec<f64>,
    work: Vec<f64>,
    cache: LatticeCache,
}

impl Ga<'_> {
    fn repair(&mut self, partial: Solution) -> Solution {
        let price = if self.rng.gen_bool(0.5) { self.share.clone() } else { self.work.clone() };
        let mut noise = Noise { rng: &mut self.rng, probability: 0.2, top: 3 };
        let mut s = complete(self.space, partial, &price, Some(&mut noise), &mut self.cache);
        compact(self.space, &mut s, &mut self.cache);
        s
    }

    fn crossover(&mut self, a: &Solution, b: &Solution) -> Solution {
        let space = self.space;
        let mut pool: Vec<(f64, &super::space::Config)> =
            a.iter().chain(b.iter()).map(|c| (space.fill(c) + self.rng.gen_range(0.0..0.15), c)).collect();
        pool.shuffle(&mut self.rng);
        pool.sort_by(|x, y| y.0.total_cmp(&x.0));
        let mut child = Vec::new();
        let mut cap = vec![0.0; space.services()];
        for (_, config) in pool {
            let mut gives = vec![0.0; space.services()];
            space.add_capacity(config, &mut gives);
            let (mut useful, mut total) = (0.0, 0.0);
            for w in 0..space.services() {
                let lacking = (space.demand[w] - cap[w]).max(0.0);
                useful += gives[w].min(lacking) * self.work[w];
                total += gives[w] * self.work[w];
            }
            if total > 0.0 && useful >= 0.9 * total {
                for w in 0..space.services() {
                    cap[w] += gives[w];
                }
                child.push(config.clone());
            }
        }
        self.repair(child)
    }

    fn mutate(&mut self, mut s: Solution) -> Solution {
        let drops = self.rng.gen_range(1..=3usize).min(s.len());
        for _ in 0..drops {
            let weights: Vec<f64> = s.iter().map(|c| 1.05 - self.space.fill(c)).collect();
            let total: f64 = weights.iter().sum();
            let mut x = self.rng.gen_range(0.0..total);
            let mut pick = s.len() - 1;
            for (i, wt) in weights.iter().enumerate() {
                if x < *wt {
                    pick = i;
                    break;
                }
                x -= wt;
            }
            s.swap_remove(pick);
        }
        self.repair(s)
    }
}

/// Evolves from `seeds` (at least one feasible solution) and returns the best solution
/// seen, never worse than the best seed.
pub(crate) fn solve(space: &Space, seeds: Vec<Solution>, options: GeneticOptions, seed: u64) -> Solution {
    let mut ga = Ga {
        space,
        rng: StdRng::seed_from_u64(seed),
        share: prices(space, Utility::DemandShare),
        work: prices(space, Utility::Work),
        cache: LatticeCache::default(),
    };
    let mut population: Vec<Solution> = seeds
        .into_iter()
        .filter(|s| space.is_feasible(s))
        .map(|mut s| {
            compact(space, &mut s, &mut ga.cache);
            s
        })
        .collect();
    assert!(!population.is_empty(), "the genetic algorithm needs a feasible seed");
    let size = options.population.max(2);
    while population.len() < size {
        let fresh = ga.repair(Vec::new());
        population.push(fresh);
    }
    let mut best =
        population.iter().min_by(|a, b| fitness(space, a).partial_cmp(&fitness(space, b)).unwrap()).unwrap().clone();
    let mut stale = 0;
    for _ in 0..options.generations {
        population.sort_by(|a, b| fitness(space, a).partial_cmp(&fitness(space, b)).unwrap());
        let mut next: Vec<Solution> = population.iter().take(2).cloned().collect();
        while next.len() < size {
            let a = tournament(&mut ga.rng, space, &population).clone();
            let b = tournament(&mut ga.rng, space, &population).clone();
            let mut child = if ga.rng.gen_bool(0.9) { ga.crossover(&a, &b) } else { a };
            if ga.rng.gen_bool(0.4) {
                child = ga.mutate(child);
            }
            next.push(child);
        }
        population = next;
        let round_best =
            population.iter().min_by(|a, b| fitness(space, a).partial_cmp(&fitness(space, b)).unwrap()).unwrap();
        if better(fitness(space, round_best), fitness(space, &best)) {
            if round_best.len() < best.len() {
                stale = 0;
            }
            best = round_best.clone();
        } else {
            stale += 1;
        }
        if stale >= options.patience {
            break;
        }
    }
    best
}

fn tournament<'p>(rng: &mut StdRng, space: &Space, population: &'p [Solution]) -> &'p Solution {
    let a = &population[rng.gen_range(0..population.len())];
    let b = &population[rng.gen_range(0..population.len())];
    if better(fitness(space, b), fitness(space, a)) {
        b
    } else {
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::mig::catalog::GpuModel;
    use crate::scheduler::mig::greedy::solve as greedy;
    use crate::scheduler::mig::plan::Problem;
    use crate::scheduler::mig::space::tests::bert_like;

    fn problem() -> Problem {
        let services = (0..16)
            .map(|i| bert_like(&format!("s{i}"), 120.0 * (1.0 + (i * 7 % 11) as f64).powf(1.4), 1.0 + 0.05 * i as f64))
            .collect();
        Problem { gpu: GpuModel::A100_80GB, services }
    }

    #[test]
    fn genetic_is_never_worse_than_its_greedy_seed() {
        let problem = problem();
        let space = Space::new(&problem);
        let seed = greedy(&space, Utility::DemandShare);
        let evolved = solve(&space, vec![seed.clone()], GeneticOptions::default(), 7);
        assert!(evolved.len() <= seed.len());
        space.to_plan(&evolved).check(&problem).unwrap();
    }

    #[test]
    fn the_same_seed_reproduces_the_same_plan() {
        let problem = problem();
        let space = Space::new(&problem);
        let seed = greedy(&space, Utility::DemandShare);
        let a = solve(&space, vec![seed.clone()], GeneticOptions::default(), 42);
        let b = solve(&space, vec![seed], GeneticOptions::default(), 42);
        assert_eq!(space.to_plan(&a), space.to_plan(&b));
    }
}
