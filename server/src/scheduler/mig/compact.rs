//! Compaction of a finished plan: empty the least-filled GPU into idle slots elsewhere,
//! re-partitioning the receiving GPUs around the slots they already serve, and repeat.
//!
//! This is the "compact" half of MIG-serving's exchange-and-compact (arXiv 2109.11067;
//! research note §1, step 3) applied to a plan on paper instead of to a running cluster:
//! keep instances in place, move the rest into GPUs that are not full, give GPUs back.
//! The genetic algorithm and the tree search use it to repair their candidates.

use super::greedy::trim;
use super::space::{best_assignment, picks_by_type, LatticeCache, Solution, Space};

/// How many of the least-filled GPUs each pass tries to empty; fuller ones rarely fit
/// elsewhere, and trying every GPU makes compaction quadratic in the plan size.
const CANDIDATES: usize = 4;

/// Removes GPUs for as long as one of the least-filled can be emptied into the others.
pub(crate) fn compact(space: &Space, solution: &mut Solution, cache: &mut LatticeCache) {
    trim(space, solution);
    loop {
        let mut order: Vec<usize> = (0..solution.len()).collect();
        order.sort_by(|&a, &b| space.fill(&solution[a]).total_cmp(&space.fill(&solution[b])).then(a.cmp(&b)));
        let mut emptied = false;
        for g in order.into_iter().take(CANDIDATES) {
            if let Some(smaller) = evacuate(space, solution, g, cache) {
                *solution = smaller;
                trim(space, solution);
                emptied = true;
                break;
            }
        }
        if !emptied {
            return;
        }
    }
}

/// The solution without GPU `g`, if what `g` serves fits into the other GPUs.
fn evacuate(space: &Space, solution: &Solution, g: usize, cache: &mut LatticeCache) -> Option<Solution> {
    let mut rest: Solution = solution.iter().enumerate().filter(|&(i, _)| i != g).map(|(_, c)| c.clone()).collect();
    let cap = space.capacity(&rest);
    let mut need: Vec<f64> = space.demand.iter().zip(&cap).map(|(d, c)| space.unmet(*d, *c)).collect();
    if need.iter().all(|&n| n <= 0.0) {
        return Some(rest);
    }
    // Worth is the share of the moved load covered, so every lacking service counts.
    let price: Vec<f64> = need.iter().map(|&n| if n > 0.0 { 1.0 / n } else { 0.0 }).collect();
    let mut order: Vec<usize> = (0..rest.len()).collect();
    order.sort_by(|&a, &b| space.fill(&rest[a]).total_cmp(&space.fill(&rest[b])).then(a.cmp(&b)));
    for h in order {
        let kept = space.services_by_type(&rest[h]);
        let used: Vec<u8> = kept.iter().map(|v| v.len() as u8).collect();
        let mut best: Option<(f64, usize, Vec<Vec<usize>>)> = None;
        // The GPU's own shape first, so it is only re-partitioned when that helps.
        let shapes = std::iter::once(rest[h].shape).chain((0..space.shapes.len()).filter(|&s| s != rest[h].shape));
        for s in shapes {
            let counts = &space.shapes[s].counts;
            if counts.iter().zip(&used).any(|(c, u)| c < u) {
                continue;
            }
            let free: Vec<u8> = counts.iter().zip(&used).map(|(c, u)| c - u).collect();
            if free.iter().all(|&f| f == 0) {
                continue;
            }
            let lattice = cache.get(&free, &space.compute);
            let (value, picks) = best_assignment(space, lattice, &need, &price);
            if value > 0.0 && best.as_ref().is_none_or(|b| value > b.0 + 1e-12) {
                best = Some((value, s, picks_by_type(space, lattice, &picks)));
            }
        }
        let Some((_, s, added)) = best else { continue };
        let per_type: Vec<Vec<usize>> = kept
            .into_iter()
            .zip(added)
            .map(|(mut k, a)| {
                k.extend(a);
                k
            })
            .collect();
        let config = space.config_from_types(s, &per_type);
        let mut before = vec![0.0; space.services()];
        space.add_capacity(&rest[h], &mut before);
        let mut after = vec![0.0; space.services()];
        space.add_capacity(&config, &mut after);
        for w in 0..need.len() {
            if need[w] > 0.0 {
                let gained = after[w] - before[w];
                need[w] = if gained >= need[w] * (1.0 - 1e-9) { 0.0 } else { need[w] - gained };
            }
        }
        rest[h] = config;
        if need.iter().all(|&n| n <= 0.0) {
            return space.is_feasible(&rest).then_some(rest);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::mig::catalog::GpuModel;
    use crate::scheduler::mig::plan::Problem;
    use crate::scheduler::mig::space::tests::bert_like;
    use crate::scheduler::mig::space::Config;

    #[test]
    fn compaction_empties_a_gpu_whose_load_fits_in_idle_slots_elsewhere() {
        let problem = Problem {
            gpu: GpuModel::A100_80GB,
            services: vec![bert_like("a", 860.0, 1.0), bert_like("b", 650.0, 1.0)],
        };
        let space = Space::new(&problem);
        let four_three = space.shapes.iter().position(|s| s.counts == vec![0, 0, 1, 1, 0]).unwrap();
        let slot_of = |t: usize| space.shapes[four_three].slot_type.iter().position(|&x| x == t).unwrap();
        // Two GPUs, each 4g+3g, each using one slice: a on GPU 0's 4g, b on GPU 1's 3g.
        let mut first = Config { shape: four_three, slots: vec![None, None] };
        first.slots[slot_of(3)] = Some(0);
        let mut second = Config { shape: four_three, slots: vec![None, None] };
        second.slots[slot_of(2)] = Some(1);
        let mut solution = vec![first, second];
        assert!(space.is_feasible(&solution));
        compact(&space, &mut solution, &mut LatticeCache::default());
        assert_eq!(solution.len(), 1);
        assert!(space.is_feasible(&solution));
    }
}
