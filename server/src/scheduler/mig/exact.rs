//! An exact solver by branch and bound.
//!
//! Slots of one profile are interchangeable between GPUs, so a plan is fixed by two
//! choices: how many slots of each profile every service gets (it must meet its demand),
//! and which partitions the GPUs take (their slots must cover the sum). The search
//! branches over services, each taking one of its *minimal* slot vectors (no slot can be
//! dropped without breaking the demand; some optimal plan uses only those), and prunes
//! with slot prices from the lower bound ([`super::bound`]): the GPUs needed are at least
//! π·(slots chosen) + Σ (cheapest vector of each service still open). At a leaf, the
//! fewest partitions covering the slot vector is found by a memoised search that always
//! branches on the partitions containing one slot type still uncovered.
//!
//! MIG-serving (arXiv 2109.11067) has no exact solver; this exists so that plans can report
//! their gap to the optimum. Because the price bound is tight, it proves the optimum of
//! most 50-service benchmark instances in milliseconds. It gives up (and says so) beyond a
//! node limit or when a service has too many minimal vectors (a demand of many GPUs over
//! many profiles).

use std::collections::{HashMap, HashSet};

use super::bound::{lower_bound, normalise, price_bound, round_up};
use super::catalog::{COMPUTE_SLICES, MEMORY_SLICES};
use super::space::{needed, Solution, Space};

/// Limits that keep the exact search small.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExactOptions {
    /// Search nodes (service choices plus covering states) before giving up.
    pub node_limit: u64,
    /// Minimal slot vectors one service may have before the instance counts as too large.
    pub vector_limit: usize,
}

impl Default for ExactOptions {
    fn default() -> Self {
        ExactOptions { node_limit: 3_000_000, vector_limit: 20_000 }
    }
}

pub(crate) struct ExactOutcome {
    /// The optimum if `proven`, else the incumbent.
    pub solution: Solution,
    pub proven: bool,
}

/// Slot counts per type packed 16 bits each (at most 7 types).
type Packed = u128;

fn pack(v: &[u16]) -> Packed {
    v.iter().enumerate().fold(0, |acc, (i, &n)| acc | (n as u128) << (16 * i))
}

struct Search<'a> {
    space: &'a Space<'a>,
    order: Vec<usize>,
    vectors: Vec<Vec<Vec<u16>>>,
    prices: Vec<Vec<f64>>,
    /// suffix[p][i]: Σ over services order[i..] of their cheapest vector under prices p.
    suffix: Vec<Vec<f64>>,
    /// Shapes containing each type, for the covering search.
    holders: Vec<Vec<usize>>,
    cover_memo: HashMap<Packed, (u16, u16)>,
    visited: HashSet<(usize, Packed)>,
    best: usize,
    best_choice: Option<Vec<usize>>,
    stack: Vec<usize>,
    nodes: u64,
    limit: u64,
}

pub(crate) fn solve(space: &Space, incumbent: Solution, options: ExactOptions) -> ExactOutcome {
    let ub = incumbent.len();
    let bound = lower_bound(space);
    let give_up = || ExactOutcome { solution: incumbent.clone(), proven: false };
    if ub <= bound.gpus {
        return ExactOutcome { solution: incumbent, proven: true };
    }
    let types = space.types.len();
    let most: Vec<usize> =
        (0..types).map(|t| space.shapes.iter().map(|s| s.counts[t] as usize).max().unwrap_or(0)).collect();
    let caps: Vec<usize> = most.iter().map(|m| m * (ub - 1)).collect();
    if caps.iter().any(|&c| c > u16::MAX as usize / 2) {
        return give_up();
    }

    let mut vectors = Vec::with_capacity(space.services());
    for w in 0..space.services() {
        let mut out = Vec::new();
        let usable: Vec<usize> = (0..types).filter(|&t| space.rate[w][t] > 0.0).collect();
        if !minimal_vectors(space, w, &usable, &caps, options.vector_limit, &mut out) {
            return give_up();
        }
        vectors.push(out);
    }

    // Prices normalised so that no shape costs more than one GPU.
    let compute: Vec<f64> = space.compute.iter().map(|&c| c as f64 / COMPUTE_SLICES as f64).collect();
    let memory: Vec<f64> =
        space.types.iter().map(|&p| space.problem.gpu.profile(p).memory as f64 / MEMORY_SLICES as f64).collect();
    let prices: Vec<Vec<f64>> = [bound.prices.clone(), compute, memory].iter().map(|p| normalise(space, p)).collect();
    debug_assert!(prices.iter().all(|p| price_bound(space, p) <= bound.fractional + 1e-6));

    let cost = |p: &[f64], v: &[u16]| v.iter().zip(p).map(|(&n, q)| n as f64 * q).sum::<f64>();
    // Big services first: their choices move the bound most.
    let mut order: Vec<usize> = (0..space.services()).collect();
    order.sort_by(|&a, &b| {
        let ca = vectors[a].iter().map(|v| cost(&prices[0], v)).fold(f64::INFINITY, f64::min);
        let cb = vectors[b].iter().map(|v| cost(&prices[0], v)).fold(f64::INFINITY, f64::min);
        cb.total_cmp(&ca).then(a.cmp(&b))
    });
    for v in vectors.iter_mut() {
        v.sort_by(|x, y| cost(&prices[0], x).total_cmp(&cost(&prices[0], y)).then(x.cmp(y)));
    }
    let suffix = prices
        .iter()
        .map(|p| {
            let mut s = vec![0.0; order.len() + 1];
            for i in (0..order.len()).rev() {
                s[i] = s[i + 1] + vectors[order[i]].iter().map(|v| cost(p, v)).fold(f64::INFINITY, f64::min);
            }
            s
        })
        .collect();
    let holders =
        (0..types).map(|t| (0..space.shapes.len()).filter(|&m| space.shapes[m].counts[t] > 0).collect()).collect();

    let mut search = Search {
        space,
        order,
        vectors,
        prices,
        suffix,
        holders,
        cover_memo: HashMap::new(),
        visited: HashSet::new(),
        best: ub,
        best_choice: None,
        stack: Vec::new(),
        nodes: 0,
        limit: options.node_limit,
    };
    let complete = search.branch(0, &vec![0u16; types]);
    if !complete {
        return give_up();
    }
    match search.best_choice.clone() {
        None => ExactOutcome { solution: incumbent, proven: true },
        Some(choice) => {
            let solution = search.realise(&choice);
            debug_assert!(space.is_feasible(&solution));
            ExactOutcome { solution, proven: true }
        }
    }
}

/// Slot vectors meeting service w's demand from which no slot can be dropped. False if
/// there are more than `limit`.
fn minimal_vectors(
    space: &Space,
    w: usize,
    usable: &[usize],
    caps: &[usize],
    limit: usize,
    out: &mut Vec<Vec<u16>>,
) -> bool {
    let mut walk = Minimal {
        rates: usable.iter().map(|&t| (t, space.rate[w][t])).collect(),
        caps,
        target: needed(space.demand[w]),
        limit,
        current: vec![0u16; space.types.len()],
        out,
    };
    walk.from(0, walk.target)
}

/// Enumeration of minimal vectors, one type at a time; the last type gets exactly what is
/// still missing.
struct Minimal<'a> {
    rates: Vec<(usize, f64)>,
    caps: &'a [usize],
    target: f64,
    limit: usize,
    current: Vec<u16>,
    out: &'a mut Vec<Vec<u16>>,
}

impl Minimal<'_> {
    fn from(&mut self, j: usize, left: f64) -> bool {
        let (t, rate) = self.rates[j];
        let last = j + 1 == self.rates.len();
        let most = if left > 0.0 { (left / rate - 1e-12).ceil() as usize } else { 0 };
        for n in if last { most..=most } else { 0..=most } {
            if n > self.caps[t] {
                break;
            }
            self.current[t] = n as u16;
            if !last {
                if !self.from(j + 1, left - n as f64 * rate) {
                    return false;
                }
                continue;
            }
            let total: f64 = self.rates.iter().map(|&(u, r)| self.current[u] as f64 * r).sum();
            let smallest =
                self.rates.iter().filter(|&&(u, _)| self.current[u] > 0).map(|&(_, r)| r).fold(f64::INFINITY, f64::min);
            if total >= self.target && total - smallest < self.target {
                self.out.push(self.current.clone());
                if self.out.len() > self.limit {
                    return false;
                }
            }
        }
        self.current[t] = 0;
        true
    }
}

impl Search<'_> {
    /// Depth-first over services; false if the node limit was hit.
    fn branch(&mut self, i: usize, used: &[u16]) -> bool {
        self.nodes += 1;
        if self.nodes > self.limit {
            return false;
        }
        let lb = self
            .prices
            .iter()
            .zip(&self.suffix)
            .map(|(p, s)| round_up(used.iter().zip(p).map(|(&n, q)| n as f64 * q).sum::<f64>() + s[i]))
            .max()
            .unwrap_or(0);
        if lb >= self.best {
            return true;
        }
        if i == self.order.len() {
            let Some(g) = self.cover(used) else { return false };
            if (g as usize) < self.best {
                self.best = g as usize;
                self.best_choice = Some(self.stack.clone());
            }
            return true;
        }
        if !self.visited.insert((i, pack(used))) {
            return true;
        }
        let w = self.order[i];
        for k in 0..self.vectors[w].len() {
            let mut next = used.to_vec();
            let mut fits = true;
            for (n, add) in next.iter_mut().zip(&self.vectors[w][k]) {
                match n.checked_add(*add) {
                    Some(v) => *n = v,
                    None => fits = false,
                }
            }
            if !fits {
                continue;
            }
            self.stack.push(k);
            let ok = self.branch(i + 1, &next);
            self.stack.pop();
            if !ok {
                return false;
            }
        }
        true
    }

    /// Fewest shapes whose slots cover `need`, memoised; `None` past the node limit.
    fn cover(&mut self, need: &[u16]) -> Option<u16> {
        let key = pack(need);
        if key == 0 {
            return Some(0);
        }
        if let Some(&(g, _)) = self.cover_memo.get(&key) {
            return Some(g);
        }
        self.nodes += 1;
        if self.nodes > self.limit {
            return None;
        }
        // Some GPU must hold a slot of the type with the fewest holders.
        let t = (0..need.len()).filter(|&t| need[t] > 0).min_by_key(|&t| (self.holders[t].len(), t)).unwrap();
        let mut best = (u16::MAX, 0u16);
        for m in self.holders[t].clone() {
            let rest: Vec<u16> =
                need.iter().zip(&self.space.shapes[m].counts).map(|(a, &b)| a.saturating_sub(b as u16)).collect();
            let g = self.cover(&rest)?.saturating_add(1);
            if g < best.0 {
                best = (g, m as u16);
            }
        }
        self.cover_memo.insert(key, best);
        Some(best.0)
    }

    /// GPUs for the chosen vectors: the covering shapes, slots handed out service by
    /// service so each service's replicas sit together.
    fn realise(&mut self, choice: &[usize]) -> Solution {
        let types = self.space.types.len();
        let mut total = vec![0u16; types];
        let mut queues: Vec<Vec<usize>> = vec![Vec::new(); types];
        for (i, &k) in choice.iter().enumerate() {
            let w = self.order[i];
            for (t, &n) in self.vectors[w][k].iter().enumerate() {
                total[t] += n;
                queues[t].extend(std::iter::repeat_n(w, n as usize));
            }
        }
        let mut shapes = Vec::new();
        let mut need = total;
        while pack(&need) != 0 {
            self.cover(&need).expect("covered while searching");
            let (_, m) = self.cover_memo[&pack(&need)];
            shapes.push(m as usize);
            need = need
                .iter()
                .zip(&self.space.shapes[m as usize].counts)
                .map(|(a, &b)| a.saturating_sub(b as u16))
                .collect();
        }
        for q in queues.iter_mut() {
            q.reverse();
        }
        shapes
            .into_iter()
            .map(|m| {
                let per_type: Vec<Vec<usize>> = (0..types)
                    .map(|t| {
                        let n = (self.space.shapes[m].counts[t] as usize).min(queues[t].len());
                        (0..n).map(|_| queues[t].pop().unwrap()).collect()
                    })
                    .collect();
                self.space.config_from_types(m, &per_type)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::mig::catalog::GpuModel;
    use crate::scheduler::mig::greedy::{solve as greedy, Utility};
    use crate::scheduler::mig::plan::Problem;
    use crate::scheduler::mig::space::tests::bert_like;

    #[test]
    fn exact_pairs_four_and_three_slice_services_on_three_gpus() {
        // Demands chosen so that a 4g+3g pair per GPU is the only zero-waste fit.
        let gpu = GpuModel::A100_80GB;
        let mut services = Vec::new();
        for i in 0..3 {
            services.push(bert_like(&format!("four{i}"), 860.0, 1.0));
            services.push(bert_like(&format!("three{i}"), 650.0, 1.0));
        }
        let problem = Problem { gpu, services };
        let space = Space::new(&problem);
        let incumbent = greedy(&space, Utility::DemandShare);
        let outcome = solve(&space, incumbent, ExactOptions::default());
        assert!(outcome.proven);
        assert_eq!(outcome.solution.len(), 3);
        space.to_plan(&outcome.solution).check(&problem).unwrap();
    }

    #[test]
    fn exact_agrees_with_the_bound_when_the_bound_is_tight() {
        let services = (0..9).map(|i| bert_like(&format!("s{i}"), 200.0 + 100.0 * i as f64, 1.0)).collect();
        let problem = Problem { gpu: GpuModel::A100_80GB, services };
        let space = Space::new(&problem);
        let incumbent = greedy(&space, Utility::Work);
        let outcome = solve(&space, incumbent.clone(), ExactOptions::default());
        assert!(outcome.proven);
        assert!(outcome.solution.len() <= incumbent.len());
        assert!(outcome.solution.len() >= lower_bound(&space).gpus);
        space.to_plan(&outcome.solution).check(&problem).unwrap();
    }

    #[test]
    fn exact_says_when_it_gives_up() {
        let services = (0..30).map(|i| bert_like(&format!("s{i}"), 900.0 + 333.0 * i as f64, 1.0)).collect();
        let problem = Problem { gpu: GpuModel::A100_80GB, services };
        let space = Space::new(&problem);
        let incumbent = greedy(&space, Utility::DemandShare);
        let outcome = solve(&space, incumbent.clone(), ExactOptions { node_limit: 1000, vector_limit: 20_000 });
        if !outcome.proven {
            assert_eq!(outcome.solution, incumbent);
        }
    }

    /// On random small instances the exact answer is valid, never above any heuristic and
    /// never below the bound.
    #[test]
    fn exact_is_sandwiched_between_the_bound_and_every_heuristic() {
        use crate::scheduler::mig::compact::compact;
        use crate::scheduler::mig::space::LatticeCache;
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for case in 0..25 {
            let n = rng.gen_range(2..7);
            let services = (0..n)
                .map(|i| bert_like(&format!("s{i}"), rng.gen_range(50.0..2500.0), rng.gen_range(0.6..1.6)))
                .collect();
            // The example table is by profile index, which means the same shapes on every GPU.
            let problem = Problem { gpu: GpuModel::ALL[case % 4], services };
            let space = Space::new(&problem);
            let mut heuristic = greedy(&space, Utility::Work);
            compact(&space, &mut heuristic, &mut LatticeCache::default());
            let outcome = solve(&space, greedy(&space, Utility::DemandShare), ExactOptions::default());
            assert!(outcome.proven, "case {case}");
            assert!(outcome.solution.len() <= heuristic.len(), "case {case}");
            assert!(outcome.solution.len() >= lower_bound(&space).gpus, "case {case}");
            space.to_plan(&outcome.solution).check(&problem).unwrap();
        }
    }
}
