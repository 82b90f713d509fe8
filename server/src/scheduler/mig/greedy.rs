//! MIG-serving's utility-first greedy (Tan et al., arXiv 2109.11067, its heuristic stage;
//! research note §1): open GPUs one at a time, each with the configuration of highest
//! utility Σ_w min(μ_conf[w], r_w) / d_w, where r_w is what service w still lacks.
//!
//! Departures from the paper's description:
//! - The utility caps each service at what it still lacks (the note's formula weights
//!   μ/d by the remaining share instead); uncapped, a tiny service would look worth far
//!   more than the slice it needs.
//! - The best configuration of each partition is found by an exact dynamic programme over
//!   slot counts ([`best_assignment`]), so the limit of three distinct services per GPU
//!   (and its relaxation when a weight drops below 0.1) is not needed.
//! - The "most similar to the current GPU among the top 10" rule for re-planning is left to
//!   the transition planner, which reuses matching slices instead.
//! - Utilities only fall as demand is met, so each step re-evaluates only the partitions
//!   whose last utility could still win (lazy greedy); the choice is the same.
//! - A second utility, [`Utility::Work`], seeds the later stages alongside the paper's.

use rand::rngs::StdRng;
use rand::Rng;

use super::plan::{Plan, Problem};
use super::space::{best_assignment, needed, picks_by_type, Config, LatticeCache, Solution, Space};

/// What a GPU's worth is measured in when the greedy compares configurations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Utility {
    /// The paper's: the share of each service's demand a configuration covers.
    DemandShare,
    /// Work in whole-GPU equivalents: throughput divided by what one GPU devoted to the
    /// service gives. Favours configurations that waste little of the GPU.
    Work,
}

pub(crate) fn prices(space: &Space, utility: Utility) -> Vec<f64> {
    (0..space.services())
        .map(|w| match utility {
            Utility::DemandShare => 1.0 / space.demand[w],
            Utility::Work => {
                let best = space
                    .shapes
                    .iter()
                    .map(|s| s.counts.iter().enumerate().map(|(t, &n)| n as f64 * space.rate[w][t]).sum::<f64>())
                    .fold(0.0, f64::max);
                1.0 / best
            }
        })
        .collect()
}

/// The best configuration of one shape and its utility.
pub(crate) struct Candidate {
    pub utility: f64,
    pub config: Config,
}

/// The best configuration of every shape for the demand still `remaining`, best first.
pub(crate) fn candidates(space: &Space, remaining: &[f64], price: &[f64]) -> Vec<Candidate> {
    let mut out: Vec<Candidate> = space
        .shapes
        .iter()
        .enumerate()
        .filter_map(|(i, shape)| {
            let (utility, picks) = best_assignment(space, &shape.lattice, remaining, price);
            (utility > 0.0 && !picks.is_empty()).then(|| Candidate {
                utility,
                config: space.config_from_types(i, &picks_by_type(space, &shape.lattice, &picks)),
            })
        })
        .collect();
    out.sort_by(|a, b| b.utility.total_cmp(&a.utility));
    out
}

/// Occasional departures from the greedy choice, for the genetic algorithm's variety.
pub(crate) struct Noise<'a> {
    pub rng: &'a mut StdRng,
    /// Chance of taking a random one of the top `top` candidates instead of the best.
    pub probability: f64,
    pub top: usize,
}

/// Gives idle slots of `solution` to services that still lack throughput.
pub(crate) fn fill_idle(
    space: &Space,
    solution: &mut Solution,
    cap: &mut [f64],
    price: &[f64],
    cache: &mut LatticeCache,
) {
    for config in solution.iter_mut() {
        let remaining: Vec<f64> = space.demand.iter().zip(cap.iter()).map(|(d, c)| space.unmet(*d, *c)).collect();
        if remaining.iter().all(|&r| r <= 0.0) {
            return;
        }
        if config.slots.iter().all(|s| s.is_some()) {
            continue;
        }
        let shape = &space.shapes[config.shape];
        let mut free = vec![0u8; space.types.len()];
        for (i, s) in config.slots.iter().enumerate() {
            if s.is_none() {
                free[shape.slot_type[i]] += 1;
            }
        }
        let lattice = cache.get(&free, &space.compute);
        let (_, picks) = best_assignment(space, lattice, &remaining, price);
        let mut per_type = picks_by_type(space, lattice, &picks);
        for (i, slot) in config.slots.iter_mut().enumerate() {
            if slot.is_none() {
                if let Some(w) = per_type[shape.slot_type[i]].pop() {
                    *slot = Some(w);
                    cap[w] += space.rate[w][shape.slot_type[i]];
                }
            }
        }
    }
}

/// Completes a partial solution: fills its idle slots, then opens GPUs greedily until
/// every demand is met.
pub(crate) fn complete(
    space: &Space,
    mut solution: Solution,
    price: &[f64],
    mut noise: Option<&mut Noise>,
    cache: &mut LatticeCache,
) -> Solution {
    let mut cap = space.capacity(&solution);
    fill_idle(space, &mut solution, &mut cap, price, cache);
    // A shape's utility can only fall as demand is met, so last step's value bounds this
    // step's: only shapes whose bound could still win are re-evaluated (lazy greedy).
    let mut bounds: Vec<(f64, Option<Config>)> = vec![(f64::INFINITY, None); space.shapes.len()];
    loop {
        let remaining: Vec<f64> = space.demand.iter().zip(&cap).map(|(d, c)| space.unmet(*d, *c)).collect();
        if remaining.iter().all(|&r| r <= 0.0) {
            return solution;
        }
        let want = match noise.as_deref_mut() {
            Some(n) => {
                let p = n.probability;
                if n.rng.gen_bool(p) {
                    n.top
                } else {
                    1
                }
            }
            None => 1,
        };
        for b in bounds.iter_mut() {
            b.1 = None;
        }
        let mut top: Vec<usize> = Vec::new();
        while top.len() < want {
            let best = (0..bounds.len())
                .filter(|i| !top.contains(i) && bounds[*i].0 > 0.0)
                .max_by(|&a, &b| bounds[a].0.total_cmp(&bounds[b].0).then(b.cmp(&a)));
            let Some(i) = best else { break };
            if bounds[i].1.is_some() {
                top.push(i);
                continue;
            }
            let shape = &space.shapes[i];
            let (utility, picks) = best_assignment(space, &shape.lattice, &remaining, price);
            bounds[i] = if utility > 0.0 && !picks.is_empty() {
                (utility, Some(space.config_from_types(i, &picks_by_type(space, &shape.lattice, &picks))))
            } else {
                (0.0, None)
            };
        }
        if top.is_empty() {
            // Every service has a profile, so some shape always helps; unreachable for
            // validated problems.
            return solution;
        }
        let pick = match noise.as_deref_mut() {
            Some(n) if top.len() > 1 => top[n.rng.gen_range(0..top.len())],
            _ => top[0],
        };
        let chosen = bounds[pick].1.take().expect("fresh candidate");
        space.add_capacity(&chosen, &mut cap);
        solution.push(chosen);
    }
}

/// Frees slots a service does not need (largest first) and drops GPUs left empty.
pub(crate) fn trim(space: &Space, solution: &mut Solution) {
    let mut cap = space.capacity(solution);
    let mut slots: Vec<(f64, usize, usize, usize)> = Vec::new();
    for (g, config) in solution.iter().enumerate() {
        for (i, s) in config.slots.iter().enumerate() {
            if let Some(w) = *s {
                slots.push((space.rate[w][space.shapes[config.shape].slot_type[i]], w, g, i));
            }
        }
    }
    slots.sort_by(|a, b| b.0.total_cmp(&a.0).then((a.1, a.2, a.3).cmp(&(b.1, b.2, b.3))));
    for (rate, w, g, i) in slots {
        if cap[w] - rate >= needed(space.demand[w]) {
            cap[w] -= rate;
            solution[g].slots[i] = None;
        }
    }
    Space::drop_empty(solution);
}

/// The utility-first greedy on its own.
pub(crate) fn solve(space: &Space, utility: Utility) -> Solution {
    let price = prices(space, utility);
    let mut solution = complete(space, Vec::new(), &price, None, &mut LatticeCache::default());
    trim(space, &mut solution);
    solution
}

/// MIG-serving's utility-first greedy with the paper's utility.
pub fn greedy(problem: &Problem) -> Plan {
    let space = Space::new(problem);
    space.to_plan(&solve(&space, Utility::DemandShare))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::mig::catalog::GpuModel;
    use crate::scheduler::mig::space::tests::bert_like;

    #[test]
    fn greedy_meets_every_demand_with_legal_partitions() {
        let services =
            (0..12).map(|i| bert_like(&format!("s{i}"), 150.0 + 220.0 * i as f64, 1.0 + 0.1 * i as f64)).collect();
        let problem = Problem { gpu: GpuModel::A100_80GB, services };
        let plan = greedy(&problem);
        plan.check(&problem).unwrap();
    }

    #[test]
    fn small_services_share_one_gpu_instead_of_one_each() {
        // Seven services each served by one 1g slice: one GPU, not seven.
        let services = (0..7).map(|i| bert_like(&format!("s{i}"), 200.0, 1.0)).collect();
        let problem = Problem { gpu: GpuModel::A100_80GB, services };
        let plan = greedy(&problem);
        plan.check(&problem).unwrap();
        assert_eq!(plan.gpu_count(), 1);
        assert_eq!(problem.whole_gpu_count(), Some(7));
    }

    #[test]
    fn the_issue_example_needs_one_gpu() {
        let problem = Problem { gpu: GpuModel::A100_80GB, services: vec![bert_like("bert", 1200.0, 1.0)] };
        let plan = greedy(&problem);
        plan.check(&problem).unwrap();
        assert_eq!(plan.gpu_count(), 1);
        // 7 × 1g gives 1470 req/s against 1500 for the whole GPU; either way one GPU, and
        // the slices not needed for 1200 req/s are left idle.
        let cap = plan.capacity(&problem)[0];
        assert!((1200.0..1500.1).contains(&cap), "{cap}");
    }

    #[test]
    fn trimming_never_breaks_a_demand() {
        let services = (0..20).map(|i| bert_like(&format!("s{i}"), 90.0 * (i as f64 + 1.0).powf(1.6), 1.0)).collect();
        let problem = Problem { gpu: GpuModel::A100_80GB, services };
        let space = Space::new(&problem);
        for utility in [Utility::DemandShare, Utility::Work] {
            let solution = solve(&space, utility);
            assert!(space.is_feasible(&solution));
            space.to_plan(&solution).check(&problem).unwrap();
        }
    }
}
