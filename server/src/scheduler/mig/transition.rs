//! From the layout running now to a new plan without ever letting a service's capacity
//! fall below its demand: an ordered list of steps (create slice, start replica, drain and
//! stop replica, destroy slice).
//!
//! After MIG-serving's exchange-and-compact (Tan et al., arXiv 2109.11067; research note
//! §1, from the Jormungandr deployer): new instances are created before the old ones
//! they replace are stopped, and when a swap cannot be ordered that way (the new slice
//! needs the place the old one holds) the service is first given temporary replicas,
//! placed on free, unclaimed slices of the fleet or, failing that, on extra GPUs that are
//! given back at the end. Departures: the target is already the compacted plan, so there
//! is no separate compaction pass; plan GPUs are matched to physical GPUs to keep as many
//! slices (and replicas) in place as possible; a slice whose shape and place stay but
//! whose service changes is reused (stop, then start) instead of destroyed and recreated.
//!
//! A service whose current capacity is already below its new demand is held at its
//! current capacity (it can only rise); every other service at its demand.

use super::catalog::{GpuModel, ProfileId};
use super::partition::{fits, memory_mask, Placed};
use super::plan::{Assigned, GpuLayout, Plan, Problem};

/// Demand and throughput per service id; ids past the planned services are services that
/// run now but are no longer wanted (demand 0).
#[derive(Debug, Clone, PartialEq)]
pub struct Demands {
    pub demand: Vec<f64>,
    /// Throughput per service and [`ProfileId`]; 0 where it cannot run or is unknown.
    pub rate: Vec<Vec<f64>>,
}

impl Demands {
    /// The problem's services followed by `retired` services with no demand.
    pub fn from_problem(problem: &Problem, retired: usize) -> Demands {
        let profiles = problem.gpu.profiles().len();
        let mut demand: Vec<f64> = problem.services.iter().map(|s| s.demand).collect();
        let mut rate: Vec<Vec<f64>> =
            problem.services.iter().map(|s| (0..profiles).map(|p| s.rate(p)).collect()).collect();
        demand.extend(std::iter::repeat_n(0.0, retired));
        rate.extend(std::iter::repeat_n(vec![0.0; profiles], retired));
        Demands { demand, rate }
    }

    fn rate(&self, service: usize, profile: ProfileId) -> f64 {
        self.rate.get(service).and_then(|r| r.get(profile)).copied().unwrap_or(0.0)
    }

    fn capacity(&self, layout: &[GpuLayout]) -> Vec<f64> {
        let mut cap = vec![0.0; self.demand.len()];
        for gpu in layout {
            for a in &gpu.slices {
                if let Some(w) = a.service {
                    cap[w] += self.rate(w, a.slice.profile);
                }
            }
        }
        cap
    }
}

/// One operation on one physical GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    CreateSlice {
        gpu: usize,
        slice: Placed,
    },
    StartReplica {
        gpu: usize,
        slice: Placed,
        service: usize,
    },
    /// Drain the replica's requests, then stop it.
    StopReplica {
        gpu: usize,
        slice: Placed,
        service: usize,
    },
    DestroySlice {
        gpu: usize,
        slice: Placed,
    },
}

/// The steps, and what they cost in GPUs.
#[derive(Debug, Clone, PartialEq)]
pub struct Transition {
    pub steps: Vec<Step>,
    /// Physical GPU of each plan GPU. Physical GPUs `0..current.len()` are the current
    /// ones; higher indices are GPUs the fleet does not use now.
    pub gpu_of_plan: Vec<usize>,
    /// GPUs used only for temporary replicas.
    pub temporary_gpus: Vec<usize>,
    /// Most GPUs holding a slice at any point.
    pub peak_gpus: usize,
    /// `peak_gpus` beyond the larger of the current and the target GPU count.
    pub extra_gpus: usize,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TransitionError {
    #[error("step {index} is not possible: {reason}")]
    IllegalStep { index: usize, reason: String },
    #[error("step {index} drops service #{service} to {capacity:.1} req/s, below the {floor:.1} it must keep")]
    CapacityDrop { index: usize, service: usize, capacity: f64, floor: f64 },
    #[error("no order of steps keeps every service's capacity; the transition is stuck")]
    Stuck,
}

/// The capacity each service must keep throughout: its demand, or what it has now if
/// that is less.
fn floors(demands: &Demands, current: &[GpuLayout]) -> Vec<f64> {
    demands.demand.iter().zip(demands.capacity(current)).map(|(d, c)| d.min(c)).collect()
}

/// Applies `steps` to `current`, checking each step's legality and, after each, that no
/// service is below its floor. Returns the final layout.
pub fn replay(
    gpu: GpuModel,
    demands: &Demands,
    current: &[GpuLayout],
    steps: &[Step],
) -> Result<Vec<GpuLayout>, TransitionError> {
    let floor = floors(demands, current);
    let mut layout = current.to_vec();
    let mut cap = demands.capacity(current);
    for (index, step) in steps.iter().enumerate() {
        let illegal = |reason: String| TransitionError::IllegalStep { index, reason };
        let g = match *step {
            Step::CreateSlice { gpu, .. }
            | Step::StartReplica { gpu, .. }
            | Step::StopReplica { gpu, .. }
            | Step::DestroySlice { gpu, .. } => gpu,
        };
        if g >= layout.len() {
            layout.resize(g + 1, GpuLayout::default());
        }
        let slices = &mut layout[g].slices;
        let find = |slices: &Vec<Assigned>, slice: Placed| slices.iter().position(|a| a.slice == slice);
        match *step {
            Step::CreateSlice { slice, .. } => {
                let placement: Vec<Placed> = slices.iter().map(|a| a.slice).collect();
                if !fits(gpu, &placement, slice) {
                    return Err(illegal(format!(
                        "{} at {} does not fit on GPU {g}",
                        gpu.profile(slice.profile).name,
                        slice.start
                    )));
                }
                slices.push(Assigned { slice, service: None });
                slices.sort_by_key(|a| a.slice.start);
            }
            Step::StartReplica { slice, service, .. } => {
                let i =
                    find(slices, slice).ok_or_else(|| illegal(format!("GPU {g} has no slice at {}", slice.start)))?;
                if slices[i].service.is_some() {
                    return Err(illegal(format!("the slice at {} on GPU {g} already runs a replica", slice.start)));
                }
                slices[i].service = Some(service);
                cap[service] += demands.rate(service, slice.profile);
            }
            Step::StopReplica { slice, service, .. } => {
                let i =
                    find(slices, slice).ok_or_else(|| illegal(format!("GPU {g} has no slice at {}", slice.start)))?;
                if slices[i].service != Some(service) {
                    return Err(illegal(format!(
                        "the slice at {} on GPU {g} does not run service #{service}",
                        slice.start
                    )));
                }
                slices[i].service = None;
                cap[service] -= demands.rate(service, slice.profile);
                if !Problem::meets(cap[service], floor[service]) {
                    return Err(TransitionError::CapacityDrop {
                        index,
                        service,
                        capacity: cap[service],
                        floor: floor[service],
                    });
                }
            }
            Step::DestroySlice { slice, .. } => {
                let i =
                    find(slices, slice).ok_or_else(|| illegal(format!("GPU {g} has no slice at {}", slice.start)))?;
                if slices[i].service.is_some() {
                    return Err(illegal(format!("the slice at {} on GPU {g} still runs a replica", slice.start)));
                }
                slices.remove(i);
            }
        }
    }
    Ok(layout)
}

#[derive(Debug, Clone, Copy)]
struct Live {
    slice: Placed,
    service: Option<usize>,
    temporary: bool,
}

struct Planner<'a> {
    gpu: GpuModel,
    demands: &'a Demands,
    live: Vec<Vec<Live>>,
    goal: Vec<Vec<Assigned>>,
    cap: Vec<f64>,
    floor: Vec<f64>,
    steps: Vec<Step>,
    peak: usize,
    physical: usize,
}

impl Planner<'_> {
    fn record(&mut self, step: Step) {
        self.steps.push(step);
        let busy = self.live.iter().filter(|g| !g.is_empty()).count();
        self.peak = self.peak.max(busy);
    }

    fn placement(&self, g: usize) -> Vec<Placed> {
        self.live[g].iter().map(|l| l.slice).collect()
    }

    fn can_stop(&self, service: usize, profile: ProfileId) -> bool {
        Problem::meets(self.cap[service] - self.demands.rate(service, profile), self.floor[service])
    }

    fn create(&mut self, g: usize, slice: Placed, service: Option<usize>, temporary: bool) {
        self.live[g].push(Live { slice, service: None, temporary });
        self.record(Step::CreateSlice { gpu: g, slice });
        if let Some(w) = service {
            self.start(g, slice, w);
        }
    }

    fn start(&mut self, g: usize, slice: Placed, w: usize) {
        let l = self.live[g].iter_mut().find(|l| l.slice == slice).expect("slice exists");
        l.service = Some(w);
        self.cap[w] += self.demands.rate(w, slice.profile);
        self.record(Step::StartReplica { gpu: g, slice, service: w });
    }

    fn stop(&mut self, g: usize, slice: Placed, w: usize) {
        let l = self.live[g].iter_mut().find(|l| l.slice == slice).expect("slice exists");
        l.service = None;
        self.cap[w] -= self.demands.rate(w, slice.profile);
        self.record(Step::StopReplica { gpu: g, slice, service: w });
    }

    fn destroy(&mut self, g: usize, slice: Placed) {
        self.live[g].retain(|l| l.slice != slice);
        self.record(Step::DestroySlice { gpu: g, slice });
    }

    /// Creates goal slices that fit and starts goal replicas on idle goal slices.
    fn build(&mut self) -> bool {
        let mut progress = false;
        for g in 0..self.goal.len() {
            for t in self.goal[g].clone() {
                match self.live[g].iter().find(|l| l.slice == t.slice).copied() {
                    Some(l) => {
                        if l.service.is_none() {
                            if let Some(w) = t.service {
                                self.start(g, t.slice, w);
                                progress = true;
                            }
                        }
                    }
                    None => {
                        if fits(self.gpu, &self.placement(g), t.slice) {
                            self.create(g, t.slice, t.service, false);
                            progress = true;
                        }
                    }
                }
            }
        }
        progress
    }

    /// Stops replicas and destroys slices that are not in the goal, where that is safe.
    fn tear_down(&mut self, temporary: bool) -> bool {
        let mut progress = false;
        for g in 0..self.live.len() {
            for l in self.live[g].clone() {
                if l.temporary != temporary {
                    continue;
                }
                let target = self.goal.get(g).and_then(|goal| goal.iter().find(|t| t.slice == l.slice)).copied();
                if target.is_some_and(|t| t.service == l.service) {
                    continue;
                }
                if let Some(w) = l.service {
                    if !self.can_stop(w, l.slice.profile) {
                        continue;
                    }
                    self.stop(g, l.slice, w);
                    progress = true;
                }
                if target.is_none() {
                    self.destroy(g, l.slice);
                    progress = true;
                }
            }
        }
        progress
    }

    fn done(&self) -> bool {
        (0..self.live.len()).all(|g| {
            let goal = self.goal.get(g).map(Vec::as_slice).unwrap_or(&[]);
            self.live[g].len() == goal.len()
                && goal.iter().all(|t| self.live[g].iter().any(|l| l.slice == t.slice && l.service == t.service))
        })
    }

    /// Memory slices of goal slices not yet created, which temporary replicas must leave
    /// free.
    fn claimed(&self, g: usize) -> u8 {
        self.goal.get(g).map_or(0, |goal| {
            goal.iter()
                .filter(|t| !self.live[g].iter().any(|l| l.slice == t.slice))
                .fold(0, |m, t| m | memory_mask(self.gpu, t.slice))
        })
    }

    /// Breaks a deadlock: finds a replica in the way of a goal slice whose stop is not yet
    /// safe, and gives its service temporary capacity so that it becomes safe.
    fn unblock(&mut self) -> bool {
        for g in 0..self.goal.len() {
            for t in self.goal[g].clone() {
                let ready = self.live[g].iter().any(|l| l.slice == t.slice && l.service == t.service);
                if ready {
                    continue;
                }
                let mask = memory_mask(self.gpu, t.slice);
                let mut blockers: Vec<Live> = self.live[g]
                    .iter()
                    .filter(|l| !self.goal[g].iter().any(|x| x.slice == l.slice) || l.slice == t.slice)
                    .copied()
                    .collect();
                blockers.sort_by_key(|l| memory_mask(self.gpu, l.slice) & mask == 0);
                for b in blockers {
                    let Some(w) = b.service else { continue };
                    if self.can_stop(w, b.slice.profile) {
                        continue;
                    }
                    let deficit = self.floor[w] - (self.cap[w] - self.demands.rate(w, b.slice.profile));
                    self.add_temporary(w, deficit);
                    return true;
                }
            }
        }
        false
    }

    /// Temporary replicas of service w worth at least `deficit`, on free unclaimed slices,
    /// opening extra GPUs when the fleet has none.
    fn add_temporary(&mut self, w: usize, deficit: f64) {
        let mut profiles: Vec<ProfileId> =
            (0..self.gpu.profiles().len()).filter(|&p| self.demands.rate(w, p) > 0.0).collect();
        profiles.sort_by(|&a, &b| self.demands.rate(w, b).total_cmp(&self.demands.rate(w, a)).then(a.cmp(&b)));
        let mut got = 0.0;
        while got < deficit * (1.0 + 1e-9) {
            let lacking = deficit - got;
            // The smallest profile that covers what is lacking, else the biggest.
            let covering: Vec<ProfileId> =
                profiles.iter().rev().copied().filter(|&p| self.demands.rate(w, p) >= lacking).collect();
            let order: Vec<ProfileId> = covering.into_iter().chain(profiles.iter().copied()).collect();
            let mut placed = None;
            'search: for &p in &order {
                for g in 0..self.live.len() {
                    let claimed = self.claimed(g);
                    for &start in self.gpu.profile(p).starts {
                        let slice = Placed { profile: p, start };
                        if memory_mask(self.gpu, slice) & claimed == 0 && fits(self.gpu, &self.placement(g), slice) {
                            placed = Some((g, slice));
                            break 'search;
                        }
                    }
                }
            }
            match placed {
                Some((g, slice)) => {
                    self.create(g, slice, Some(w), true);
                    got += self.demands.rate(w, slice.profile);
                }
                None => self.live.push(Vec::new()),
            }
        }
    }
}

/// Plans the move from `current` (physical GPUs) to `target`.
pub fn plan_transition(
    gpu: GpuModel,
    demands: &Demands,
    current: &[GpuLayout],
    target: &Plan,
) -> Result<Transition, TransitionError> {
    let gpu_of_plan = match_gpus(current, target);
    let physical = current.len().max(gpu_of_plan.iter().map(|&p| p + 1).max().unwrap_or(0));
    let mut goal = vec![Vec::new(); physical];
    for (j, &p) in gpu_of_plan.iter().enumerate() {
        goal[p] = target.gpus[j].slices.clone();
    }
    let mut live: Vec<Vec<Live>> = current
        .iter()
        .map(|g| g.slices.iter().map(|a| Live { slice: a.slice, service: a.service, temporary: false }).collect())
        .collect();
    live.resize(physical, Vec::new());
    let cap = demands.capacity(current);
    let mut planner = Planner {
        gpu,
        demands,
        live,
        goal,
        floor: floors(demands, current),
        cap,
        steps: Vec::new(),
        peak: current.iter().filter(|g| !g.is_empty()).count(),
        physical,
    };
    let total_slices: usize = current.iter().map(|g| g.slices.len()).sum::<usize>()
        + target.gpus.iter().map(|g| g.slices.len()).sum::<usize>();
    let mut rounds = 0;
    while !planner.done() {
        rounds += 1;
        if rounds > 4 * total_slices + 16 {
            return Err(TransitionError::Stuck);
        }
        let built = planner.build();
        let torn = planner.tear_down(false);
        let untemp = planner.tear_down(true);
        if !(built || torn || untemp || planner.unblock()) {
            return Err(TransitionError::Stuck);
        }
    }
    let temporary_gpus: Vec<usize> = (planner.physical..planner.live.len()).collect();
    let now = current.iter().filter(|g| !g.is_empty()).count();
    let extra_gpus = planner.peak.saturating_sub(now.max(target.gpus.len()));
    Ok(Transition { steps: planner.steps, gpu_of_plan, temporary_gpus, peak_gpus: planner.peak, extra_gpus })
}

/// Matches plan GPUs to current GPUs, most shared slices first (a slice with the same
/// service counts three times one that only has the same shape and place); the rest go to
/// unmatched current GPUs, emptiest first, then to GPUs not in use now.
fn match_gpus(current: &[GpuLayout], target: &Plan) -> Vec<usize> {
    let mut pairs = Vec::new();
    for (i, c) in current.iter().enumerate() {
        for (j, t) in target.gpus.iter().enumerate() {
            let score: usize = t
                .slices
                .iter()
                .map(|ts| {
                    c.slices.iter().find(|cs| cs.slice == ts.slice).map_or(0, |cs| {
                        if cs.service == ts.service {
                            3
                        } else {
                            1
                        }
                    })
                })
                .sum();
            if score > 0 {
                pairs.push((score, i, j));
            }
        }
    }
    pairs.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let mut of_plan = vec![usize::MAX; target.gpus.len()];
    let mut used = vec![false; current.len()];
    for (_, i, j) in pairs {
        if !used[i] && of_plan[j] == usize::MAX {
            used[i] = true;
            of_plan[j] = i;
        }
    }
    let mut free: Vec<usize> = (0..current.len()).filter(|&i| !used[i]).collect();
    free.sort_by_key(|&i| (current[i].slices.iter().filter(|a| a.service.is_some()).count(), i));
    let mut free = free.into_iter();
    let mut next_new = current.len();
    for p in of_plan.iter_mut().filter(|p| **p == usize::MAX) {
        *p = free.next().unwrap_or_else(|| {
            next_new += 1;
            next_new - 1
        });
    }
    of_plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::mig::partition::parse_partition;
    use crate::scheduler::mig::plan::Service;
    use crate::scheduler::mig::space::tests::bert_like;

    const GPU: GpuModel = GpuModel::A100_80GB;

    fn layout(parts: &[(&str, u8, Option<usize>)]) -> GpuLayout {
        let mut slices: Vec<Assigned> = parts
            .iter()
            .map(|&(name, start, service)| Assigned {
                slice: Placed { profile: GPU.profile_id(name).unwrap(), start },
                service,
            })
            .collect();
        slices.sort_by_key(|a| a.slice.start);
        GpuLayout { slices }
    }

    fn problem(services: Vec<Service>) -> Problem {
        Problem { gpu: GPU, services }
    }

    /// Replays the steps one by one, checking the floor after each, and compares the end
    /// state with the plan.
    fn assert_safe(problem: &Problem, retired: usize, current: &[GpuLayout], target: &Plan) -> Transition {
        let demands = Demands::from_problem(problem, retired);
        let t = plan_transition(GPU, &demands, current, target).unwrap();
        let floor = floors(&demands, current);
        for k in 0..=t.steps.len() {
            let state = replay(GPU, &demands, current, &t.steps[..k]).unwrap();
            let cap = demands.capacity(&state);
            for w in 0..floor.len() {
                assert!(Problem::meets(cap[w], floor[w]), "after step {k} service {w} has {} < {}", cap[w], floor[w]);
            }
            for g in &state {
                crate::scheduler::mig::partition::validate(GPU, &g.placement()).unwrap();
            }
        }
        let end = replay(GPU, &demands, current, &t.steps).unwrap();
        for (j, &p) in t.gpu_of_plan.iter().enumerate() {
            assert_eq!(end[p], target.gpus[j], "plan GPU {j} on physical GPU {p}");
        }
        let used: std::collections::HashSet<usize> = t.gpu_of_plan.iter().copied().collect();
        for (p, g) in end.iter().enumerate() {
            if !used.contains(&p) {
                assert!(g.is_empty(), "GPU {p} is not in the plan but still holds {g:?}");
            }
        }
        t
    }

    #[test]
    fn an_unchanged_plan_needs_no_steps() {
        let p = problem(vec![bert_like("a", 800.0, 1.0)]);
        let current = vec![layout(&[("4g.40gb", 0, Some(0)), ("3g.40gb", 4, None)])];
        let target = Plan { gpus: current.clone() };
        let t = assert_safe(&p, 0, &current, &target);
        assert!(t.steps.is_empty());
        assert_eq!(t.extra_gpus, 0);
    }

    #[test]
    fn repartitioning_a_busy_gpu_borrows_an_extra_gpu_and_gives_it_back() {
        // One GPU, whole 7g serving a (1400 req/s needed). New plan: the same GPU as
        // 4g+3g, both serving a (860 + 650 = 1510). The 7g cannot stop before the new
        // slices exist, and they need its place: a temporary GPU carries a meanwhile.
        let p = problem(vec![bert_like("a", 1400.0, 1.0)]);
        let current = vec![layout(&[("7g.80gb", 0, Some(0))])];
        let target = Plan { gpus: vec![layout(&[("4g.40gb", 0, Some(0)), ("3g.40gb", 4, Some(0))])] };
        let t = assert_safe(&p, 0, &current, &target);
        assert_eq!(t.peak_gpus, 2);
        assert_eq!(t.extra_gpus, 1);
        assert_eq!(t.temporary_gpus, vec![1]);
    }

    #[test]
    fn a_service_moves_to_its_new_gpu_before_its_old_slice_is_destroyed() {
        // b leaves GPU 0's 3g for a whole new GPU; c takes its place as 2g + 1g.
        let p = problem(vec![bert_like("a", 800.0, 1.0), bert_like("b", 600.0, 1.0), bert_like("c", 500.0, 1.0)]);
        let current = vec![layout(&[("4g.40gb", 0, Some(0)), ("3g.40gb", 4, Some(1))])];
        let target = Plan {
            gpus: vec![
                layout(&[("4g.40gb", 0, Some(0)), ("2g.20gb", 4, Some(2)), ("1g.10gb", 6, Some(2))]),
                layout(&[("7g.80gb", 0, Some(1))]),
            ],
        };
        let t = assert_safe(&p, 0, &current, &target);
        assert_eq!(t.gpu_of_plan, vec![0, 1]);
        assert_eq!(t.extra_gpus, 0);
        let first_destroy = t.steps.iter().position(|s| matches!(s, Step::DestroySlice { .. })).unwrap();
        let b_started =
            t.steps.iter().position(|s| matches!(s, Step::StartReplica { gpu: 1, service: 1, .. })).unwrap();
        assert!(b_started < first_destroy);
    }

    #[test]
    fn swapping_services_between_two_gpus_keeps_both_served() {
        // GPU 0: a on 4g, b on 3g; the plan wants a on 3g of a fresh layout and b on 4g.
        let p = problem(vec![bert_like("a", 600.0, 1.0), bert_like("b", 600.0, 1.0)]);
        let current = vec![layout(&[("4g.40gb", 0, Some(0)), ("3g.40gb", 4, Some(1))])];
        let target = Plan { gpus: vec![layout(&[("4g.40gb", 0, Some(1)), ("3g.40gb", 4, Some(0))])] };
        let t = assert_safe(&p, 0, &current, &target);
        assert!(t.extra_gpus <= 1);
    }

    #[test]
    fn retired_services_are_drained_and_their_slices_reused() {
        // Service #1 (retired) runs on 3g; the plan gives that place to a.
        let p = problem(vec![bert_like("a", 1400.0, 1.0)]);
        let current = vec![layout(&[("4g.40gb", 0, Some(0)), ("3g.40gb", 4, Some(1))])];
        let target = Plan { gpus: vec![layout(&[("4g.40gb", 0, Some(0)), ("3g.40gb", 4, Some(0))])] };
        let t = assert_safe(&p, 1, &current, &target);
        assert_eq!(t.extra_gpus, 0);
        assert_eq!(t.steps.len(), 2, "{:?}", t.steps);
    }

    #[test]
    fn a_service_below_its_new_demand_never_loses_capacity() {
        // a has 860 now and needs 1500: its floor is 860 until the new capacity is there.
        let p = problem(vec![bert_like("a", 1500.0, 1.0)]);
        let current = vec![layout(&[("4g.40gb", 0, Some(0))])];
        let target = Plan { gpus: vec![layout(&[("7g.80gb", 0, Some(0))])] };
        let t = assert_safe(&p, 0, &current, &target);
        assert_eq!(t.extra_gpus, 1);
    }

    #[test]
    fn replay_rejects_a_step_that_drops_capacity() {
        let p = problem(vec![bert_like("a", 800.0, 1.0)]);
        let demands = Demands::from_problem(&p, 0);
        let current = vec![layout(&[("4g.40gb", 0, Some(0))])];
        let slice = current[0].slices[0].slice;
        let err = replay(GPU, &demands, &current, &[Step::StopReplica { gpu: 0, slice, service: 0 }]).unwrap_err();
        assert!(matches!(err, TransitionError::CapacityDrop { index: 0, service: 0, .. }), "{err}");
    }

    #[test]
    fn replay_rejects_a_slice_that_overlaps() {
        let p = problem(vec![bert_like("a", 800.0, 1.0)]);
        let demands = Demands::from_problem(&p, 0);
        let current = vec![layout(&[("4g.40gb", 0, Some(0))])];
        let slice = parse_partition(GPU, &["3g.40gb"]).unwrap()[0];
        assert_eq!(slice.start, 0);
        let err = replay(GPU, &demands, &current, &[Step::CreateSlice { gpu: 0, slice }]).unwrap_err();
        assert!(matches!(err, TransitionError::IllegalStep { index: 0, .. }), "{err}");
    }

    #[test]
    fn a_planned_move_of_a_whole_fleet_is_safe_step_by_step() {
        use crate::scheduler::mig::greedy::greedy;
        // Plan for one demand mix, then for a shifted one, and move between the two plans.
        let before = problem((0..10).map(|i| bert_like(&format!("s{i}"), 150.0 + 180.0 * i as f64, 1.0)).collect());
        let after =
            problem((0..10).map(|i| bert_like(&format!("s{i}"), 150.0 + 180.0 * (9 - i) as f64, 1.0)).collect());
        let current = greedy(&before).gpus;
        let target = greedy(&after);
        let t = assert_safe(&after, 0, &current, &target);
        assert!(t.peak_gpus >= target.gpu_count().max(current.len()));
    }

    /// Random demand shifts between greedy plans: every step keeps every floor, and the end
    /// state is the plan.
    #[test]
    fn random_replans_are_safe_step_by_step() {
        use crate::scheduler::mig::greedy::greedy;
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        for _ in 0..20 {
            let n = rng.gen_range(3..9);
            let scale: Vec<f64> = (0..n).map(|_| rng.gen_range(0.7..1.4)).collect();
            let demand =
                |rng: &mut rand::rngs::StdRng| -> Vec<f64> { (0..n).map(|_| rng.gen_range(60.0..2600.0)).collect() };
            let (before, after) = (demand(&mut rng), demand(&mut rng));
            let make = |d: &[f64]| problem((0..n).map(|i| bert_like(&format!("s{i}"), d[i], scale[i])).collect());
            let current = greedy(&make(&before)).gpus;
            let target = greedy(&make(&after));
            assert_safe(&make(&after), 0, &current, &target);
        }
    }
}
