//! The planners' working space. Profiles no service can use are dropped; each legal
//! partition becomes a vector of slot counts per remaining profile ("shape"), and only
//! shapes no other shape dominates are kept, since an idle slot costs nothing. A GPU
//! configuration is then a shape plus the service on each of its slots.
//!
//! Because slots of one profile are interchangeable between GPUs, this is the same problem
//! as MIG-serving's with its configurations grouped by partition, which is what makes
//! the per-GPU search of the greedy an exact small dynamic programme (see [`Lattice`]).

use std::collections::HashMap;

use super::catalog::{ProfileId, COMPUTE_SLICES};
use super::partition::{enumerate_maximal, Placed};
use super::plan::{Assigned, GpuLayout, Plan, Problem, DEMAND_TOLERANCE};

/// A GPU configuration: a shape and, per slot, the service it serves.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Config {
    pub shape: usize,
    pub slots: Vec<Option<usize>>,
}

/// A candidate answer: one configuration per GPU.
pub(crate) type Solution = Vec<Config>;

pub(crate) struct Space<'p> {
    pub problem: &'p Problem,
    /// The profiles some service can run on; "type" below indexes this list.
    pub types: Vec<ProfileId>,
    /// Compute slices per type.
    pub compute: Vec<u8>,
    pub shapes: Vec<Shape>,
    /// Throughput of each service on each type.
    pub rate: Vec<Vec<f64>>,
    pub demand: Vec<f64>,
}

/// A non-dominated partition.
pub(crate) struct Shape {
    /// A concrete placement of the shape's slots, sorted by start.
    pub placement: Vec<Placed>,
    /// Slots per type.
    pub counts: Vec<u8>,
    /// Type of each slot (aligned with `placement`).
    pub slot_type: Vec<usize>,
    pub lattice: Lattice,
}

/// All sub-multisets of a slot multiset, numbered in mixed radix (so for k ⊆ s the code
/// of s − k is code(s) − code(k)), with what the assignment programme walks over.
pub(crate) struct Lattice {
    /// Types present.
    pub dims: Vec<usize>,
    /// Number of sub-multisets; the last code is the full multiset.
    pub size: usize,
    /// Count per dim of each code.
    pub vectors: Vec<Vec<u8>>,
    /// Compute slices of each code.
    pub compute: Vec<u32>,
    /// For code > 0: the code with one slot fewer (of the first non-empty dim) and that dim.
    pub prev: Vec<(u16, u8)>,
    /// For each code k, the codes with exactly one slot fewer.
    pub below: Vec<Vec<u16>>,
    /// For each code k, every (s, s − k) with k ⊆ s.
    pub above: Vec<Vec<(u16, u16)>>,
}

impl Lattice {
    pub fn new(counts_per_type: &[u8], compute_per_type: &[u8]) -> Lattice {
        let dims: Vec<usize> = (0..counts_per_type.len()).filter(|&t| counts_per_type[t] > 0).collect();
        let counts: Vec<u8> = dims.iter().map(|&t| counts_per_type[t]).collect();
        let mut stride = Vec::with_capacity(dims.len());
        let mut size = 1usize;
        for &c in &counts {
            stride.push(size);
            size *= c as usize + 1;
        }
        let vectors: Vec<Vec<u8>> = (0..size)
            .map(|code| counts.iter().zip(&stride).map(|(&c, &st)| ((code / st) % (c as usize + 1)) as u8).collect())
            .collect();
        let compute = vectors
            .iter()
            .map(|v| v.iter().zip(&dims).map(|(&n, &t)| n as u32 * compute_per_type[t] as u32).sum())
            .collect();
        let prev = (0..size)
            .map(|code| match vectors[code].iter().position(|&n| n > 0) {
                Some(i) => ((code - stride[i]) as u16, i as u8),
                None => (0, 0),
            })
            .collect();
        let below = (0..size)
            .map(|code| (0..dims.len()).filter(|&i| vectors[code][i] > 0).map(|i| (code - stride[i]) as u16).collect())
            .collect();
        let above = (0..size)
            .map(|k| {
                (0..size)
                    .filter(|&s| vectors[k].iter().zip(&vectors[s]).all(|(a, b)| a <= b))
                    .map(|s| (s as u16, (s - k) as u16))
                    .collect()
            })
            .collect();
        Lattice { dims, size, vectors, compute, prev, below, above }
    }
}

impl<'p> Space<'p> {
    pub fn new(problem: &'p Problem) -> Space<'p> {
        let gpu = problem.gpu;
        let types: Vec<ProfileId> =
            (0..gpu.profiles().len()).filter(|&p| problem.services.iter().any(|s| s.rate(p) > 0.0)).collect();
        let compute: Vec<u8> = types.iter().map(|&p| gpu.profile(p).compute).collect();
        let rate = problem.services.iter().map(|s| types.iter().map(|&p| s.rate(p)).collect()).collect();
        let demand = problem.services.iter().map(|s| s.demand).collect();

        // Partitions of the usable profiles, grouped by slot counts; dominated ones dropped.
        let mut by_counts: Vec<(Vec<u8>, Vec<Placed>)> = Vec::new();
        for placement in enumerate_maximal(gpu, &types) {
            let mut counts = vec![0u8; types.len()];
            for s in &placement {
                counts[types.iter().position(|&p| p == s.profile).expect("only usable profiles")] += 1;
            }
            if !by_counts.iter().any(|(c, _)| *c == counts) {
                by_counts.push((counts, placement));
            }
        }
        let dominated = |a: &[u8], b: &[u8]| a != b && a.iter().zip(b).all(|(x, y)| x <= y);
        let keep: Vec<bool> = by_counts.iter().map(|(a, _)| !by_counts.iter().any(|(b, _)| dominated(a, b))).collect();
        let shapes = by_counts
            .into_iter()
            .zip(keep)
            .filter(|(_, k)| *k)
            .map(|((counts, placement), _)| {
                let slot_type = placement.iter().map(|s| types.iter().position(|&p| p == s.profile).unwrap()).collect();
                let lattice = Lattice::new(&counts, &compute);
                Shape { placement, counts, slot_type, lattice }
            })
            .collect();
        Space { problem, types, compute, shapes, rate, demand }
    }

    pub fn services(&self) -> usize {
        self.demand.len()
    }

    /// Throughput the configuration gives each service, added to `cap`.
    pub fn add_capacity(&self, config: &Config, cap: &mut [f64]) {
        let shape = &self.shapes[config.shape];
        for (slot, service) in config.slots.iter().enumerate() {
            if let Some(w) = *service {
                cap[w] += self.rate[w][shape.slot_type[slot]];
            }
        }
    }

    pub fn capacity(&self, solution: &[Config]) -> Vec<f64> {
        let mut cap = vec![0.0; self.services()];
        for c in solution {
            self.add_capacity(c, &mut cap);
        }
        cap
    }

    /// Demand not yet met by `solution`, never negative.
    pub fn remaining(&self, solution: &[Config]) -> Vec<f64> {
        let cap = self.capacity(solution);
        self.demand.iter().zip(cap).map(|(d, c)| self.unmet(*d, c)).collect()
    }

    /// What is left of `demand` after `capacity`, zero within the tolerance.
    pub fn unmet(&self, demand: f64, capacity: f64) -> f64 {
        if Problem::meets(capacity, demand) {
            0.0
        } else {
            demand - capacity
        }
    }

    pub fn is_feasible(&self, solution: &[Config]) -> bool {
        self.remaining(solution).iter().all(|&r| r <= 0.0)
    }

    /// Share of the GPU's compute slices that serve something.
    pub fn fill(&self, config: &Config) -> f64 {
        let shape = &self.shapes[config.shape];
        let used: u32 = config
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.is_some())
            .map(|(i, _)| self.compute[shape.slot_type[i]] as u32)
            .sum();
        used as f64 / COMPUTE_SLICES as f64
    }

    /// Orders GPUs fullest first, so plans read the same however they were found.
    pub fn to_plan(&self, solution: &[Config]) -> Plan {
        let mut order: Vec<&Config> = solution.iter().collect();
        order.sort_by(|a, b| self.fill(b).total_cmp(&self.fill(a)).then(a.shape.cmp(&b.shape)));
        let gpus = order
            .into_iter()
            .map(|c| {
                let shape = &self.shapes[c.shape];
                let slices = shape
                    .placement
                    .iter()
                    .zip(&c.slots)
                    .map(|(&slice, &service)| Assigned { slice, service })
                    .collect();
                GpuLayout { slices }
            })
            .collect();
        Plan { gpus }
    }

    /// A configuration of `shape` with `per_type[t]` listing the service of each slot of
    /// type t in turn (missing entries leave slots idle).
    pub fn config_from_types(&self, shape: usize, per_type: &[Vec<usize>]) -> Config {
        let s = &self.shapes[shape];
        let mut next = vec![0usize; self.types.len()];
        let slots = s
            .slot_type
            .iter()
            .map(|&t| {
                let w = per_type[t].get(next[t]).copied();
                next[t] += 1;
                w
            })
            .collect();
        Config { shape, slots }
    }

    /// Services on each type of a configuration, in slot order.
    pub fn services_by_type(&self, config: &Config) -> Vec<Vec<usize>> {
        let mut out = vec![Vec::new(); self.types.len()];
        for (i, s) in config.slots.iter().enumerate() {
            if let Some(w) = s {
                out[self.shapes[config.shape].slot_type[i]].push(*w);
            }
        }
        out
    }

    /// Drops configurations with nothing assigned.
    pub fn drop_empty(solution: &mut Solution) {
        solution.retain(|c| c.slots.iter().any(|s| s.is_some()));
    }
}

/// The best way to give the slots of `lattice` to services, where giving service w a
/// throughput of x is worth `min(x, remaining[w]) · price[w]`: a dynamic programme over the
/// services whose state is the sub-multiset of slots still free, exact because slots of one
/// type are interchangeable. Returns the total worth and, per service that gets slots, the
/// lattice code of what it gets. Among equal worths it prefers fewer compute slices.
pub(crate) fn best_assignment(
    space: &Space,
    lattice: &Lattice,
    remaining: &[f64],
    price: &[f64],
) -> (f64, Vec<(usize, usize)>) {
    const TIE: f64 = 1e-9;
    let size = lattice.size;
    let active: Vec<usize> = (0..space.services())
        .filter(|&w| remaining[w] > 0.0 && lattice.dims.iter().any(|&t| space.rate[w][t] > 0.0))
        .collect();
    let mut dp = vec![0.0f64; size];
    let mut next = vec![0.0f64; size];
    let mut choice = vec![0u16; active.len() * size];
    let mut thr = vec![0.0f64; size];
    let mut worth = vec![0.0f64; size];
    for (j, &w) in active.iter().enumerate() {
        for code in 1..size {
            let (p, i) = lattice.prev[code];
            thr[code] = thr[p as usize] + space.rate[w][lattice.dims[i as usize]];
            worth[code] = thr[code].min(remaining[w]) * price[w] - TIE * lattice.compute[code] as f64;
        }
        next.copy_from_slice(&dp);
        let row = &mut choice[j * size..(j + 1) * size];
        for k in 1..size {
            // A subset worth as much leaves more slots free, so k itself need not be tried.
            if worth[k] <= 0.0 || lattice.below[k].iter().any(|&b| b != 0 && worth[b as usize] >= worth[k]) {
                continue;
            }
            for &(s, rest) in &lattice.above[k] {
                let value = dp[rest as usize] + worth[k];
                if value > next[s as usize] {
                    next[s as usize] = value;
                    row[s as usize] = k as u16;
                }
            }
        }
        std::mem::swap(&mut dp, &mut next);
    }
    let mut picks = Vec::new();
    let mut s = size - 1;
    for (j, &w) in active.iter().enumerate().rev() {
        let k = choice[j * size + s] as usize;
        if k != 0 {
            picks.push((w, k));
            s -= k;
        }
    }
    (dp[size - 1], picks)
}

/// Turns picks from [`best_assignment`] on a shape's lattice into slot services per type.
pub(crate) fn picks_by_type(space: &Space, lattice: &Lattice, picks: &[(usize, usize)]) -> Vec<Vec<usize>> {
    let mut per_type = vec![Vec::new(); space.types.len()];
    for &(w, code) in picks {
        for (i, &n) in lattice.vectors[code].iter().enumerate() {
            per_type[lattice.dims[i]].extend(std::iter::repeat_n(w, n as usize));
        }
    }
    per_type
}

/// Lattices for slot multisets that are not shapes (free slots left in a GPU), built once.
#[derive(Default)]
pub(crate) struct LatticeCache {
    map: HashMap<Vec<u8>, Lattice>,
}

impl LatticeCache {
    pub fn get(&mut self, counts: &[u8], compute: &[u8]) -> &Lattice {
        self.map.entry(counts.to_vec()).or_insert_with(|| Lattice::new(counts, compute))
    }
}

/// `demand · (1 − tolerance)`, the least capacity that counts as meeting `demand`.
pub(crate) fn needed(demand: f64) -> f64 {
    demand * (1.0 - DEMAND_TOLERANCE)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::scheduler::mig::catalog::GpuModel;
    use crate::scheduler::mig::plan::Service;

    /// The example table for one service on an A100-80GB.
    pub fn bert_like(name: &str, demand: f64, scale: f64) -> Service {
        let gpu = GpuModel::A100_80GB;
        let mut throughput = vec![0.0; gpu.profiles().len()];
        for (profile, rate) in
            [("1g.10gb", 210.0), ("2g.20gb", 430.0), ("3g.40gb", 650.0), ("4g.40gb", 860.0), ("7g.80gb", 1500.0)]
        {
            throughput[gpu.profile_id(profile).unwrap()] = rate * scale;
        }
        Service { name: name.into(), demand, latency_ms: Some(50.0), throughput }
    }

    #[test]
    fn shapes_of_the_classic_profiles_are_the_non_dominated_realisations() {
        let problem = Problem { gpu: GpuModel::A100_80GB, services: vec![bert_like("bert", 1200.0, 1.0)] };
        let space = Space::new(&problem);
        assert_eq!(space.types.len(), 5);
        // 19 realisations, 14 distinct slot multisets, of which 3,x,2,1 and 3,x,1,1,1 (the
        // 3g at start 0 wastes a compute slice) are dominated by 2,1,1,3 and 1,1,1,1,3.
        assert_eq!(space.shapes.len(), 12);
    }

    #[test]
    fn the_assignment_programme_caps_each_service_at_what_it_still_needs() {
        let problem = Problem {
            gpu: GpuModel::A100_80GB,
            services: vec![bert_like("a", 200.0, 1.0), bert_like("b", 10_000.0, 1.0)],
        };
        let space = Space::new(&problem);
        let seven_ones = space.shapes.iter().position(|s| s.counts == vec![7, 0, 0, 0, 0]).unwrap();
        let lattice = &space.shapes[seven_ones].lattice;
        // Worth is the share of demand covered: a's whole demand for one slice beats
        // another 2% of b's.
        let price = vec![1.0 / 200.0, 1.0 / 10_000.0];
        let (value, picks) = best_assignment(&space, lattice, &space.demand, &price);
        assert!((value - (1.0 + 1260.0 / 10_000.0)).abs() < 1e-6, "{value}");
        let per_type = picks_by_type(&space, lattice, &picks);
        assert_eq!(per_type[0].iter().filter(|&&w| w == 0).count(), 1);
        assert_eq!(per_type[0].iter().filter(|&&w| w == 1).count(), 6);
    }
}
