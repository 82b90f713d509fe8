//! Placing a throughput-SLO deployment on the fleet's GPU slices, as plain data in and out.
//!
//! In order:
//! 1. **Existing slices.** Free slices (no live replica, not promised to a queued one)
//!    keep their partition; the deployment takes the fewest compute slices that meet its
//!    demand (greedy: the smallest free slice that covers what is left, else the one with
//!    the best throughput per compute slice).
//! 2. **Repartitioning idle GPUs.** If that falls short, GPUs whose worker allows
//!    repartitioning and that hold no replica are re-planned with the MIG planner
//!    (`mig::plan`, `Best`) for the whole demand, and the transition planner gives the
//!    steps; they are applied only when the plan fits on those GPUs. Touching only idle
//!    GPUs means the transition never drains a running replica, so applying the steps at
//!    once is safe.
//! 3. **What would change.** Otherwise the deployment keeps what step 1 found, and the
//!    planner re-plans the deployment with the other SLO deployments on the GPUs of one
//!    model (those running only SLO replicas); the transition from today's layout is
//!    reported, not applied, with the GPUs it would need beyond the fleet's.
//!
//! A GPU with MIG off is one whole-GPU slice, planned as its 7g profile and never
//! repartitioned here.

use super::mig::{
    plan, plan_transition, replay, Algorithm, Assigned, Demands, GpuLayout, GpuModel, Options,
    Placed, Problem, Service, Step,
};
use super::throughput::Rate;

/// A slice as the fleet has it now.
#[derive(Debug, Clone, PartialEq)]
pub struct FleetSlice {
    pub uuid: String,
    pub placed: Placed,
    /// The deployment whose live or queued replica holds it.
    pub holder: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct FleetGpu {
    pub uuid: String,
    pub worker: uuid::Uuid,
    pub model: GpuModel,
    /// MIG is off: one whole-GPU slice.
    pub whole: bool,
    /// The worker allows repartitioning and the GPU can be repartitioned (simulated).
    pub repartition: bool,
    pub slices: Vec<FleetSlice>,
}

/// A deployment's demand and its rates per GPU model (indexed by profile id).
#[derive(Debug, Clone, PartialEq)]
pub struct Demand {
    pub name: String,
    pub throughput: f64,
    pub rates: Vec<(GpuModel, Vec<Option<Rate>>)>,
}

impl Demand {
    /// A floor on the GPUs the demand needs: every slice of a GPU (at most seven) at its
    /// best measured rate, on the best GPU model; infinite without any rate.
    pub fn least_gpus(&self) -> f64 {
        let best = self
            .rates
            .iter()
            .flat_map(|(_, rates)| rates.iter().flatten())
            .map(|r| r.throughput)
            .fold(0.0, f64::max);
        if best > 0.0 {
            self.throughput / (best * 7.0)
        } else {
            f64::INFINITY
        }
    }

    pub fn rate(&self, gpu: GpuModel, placed: Placed) -> Option<Rate> {
        self.rates
            .iter()
            .find(|(m, _)| *m == gpu)
            .and_then(|(_, r)| r.get(placed.profile).copied().flatten())
    }

    fn service(&self, gpu: GpuModel) -> Service {
        let throughput = (0..gpu.profiles().len())
            .map(|p| {
                self.rate(
                    gpu,
                    Placed {
                        profile: p,
                        start: 0,
                    },
                )
                .map_or(0.0, |r| r.throughput)
            })
            .collect();
        Service {
            name: self.name.clone(),
            demand: self.throughput,
            latency_ms: None,
            throughput,
        }
    }
}

/// A slice chosen for the deployment: an existing one (`uuid`) or one a repartition
/// creates on fleet GPU `gpu`.
#[derive(Debug, Clone, PartialEq)]
pub struct Chosen {
    pub gpu: usize,
    pub uuid: Option<String>,
    pub placed: Placed,
    pub rate: Rate,
}

/// A transition step on fleet GPU `gpu` (`None`: a GPU the fleet does not have).
#[derive(Debug, Clone, PartialEq)]
pub struct FleetStep {
    pub action: &'static str,
    pub gpu: Option<usize>,
    pub profile: &'static str,
    pub start: u8,
    pub service: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SloPlan {
    pub chosen: Vec<Chosen>,
    pub capacity: f64,
    /// New partitions to apply, per fleet GPU, when `applied`.
    pub partitions: Vec<(usize, Vec<Placed>)>,
    pub applied: bool,
    pub steps: Vec<FleetStep>,
    pub extra_gpus: usize,
    pub note: String,
}

/// Plans `want` on `fleet`; `others` are the SLO deployments already holding slices.
pub fn plan_slo(fleet: &[FleetGpu], want: &Demand, others: &[Demand]) -> SloPlan {
    let chosen = existing_slices(fleet, want);
    let capacity: f64 = chosen.iter().map(|c| c.rate.throughput).sum();
    if Problem::meets(capacity, want.throughput) {
        let note = format!(
            "{:.1} req/s of {:.1} planned on {} existing slice(s).",
            capacity,
            want.throughput,
            chosen.len()
        );
        return SloPlan {
            chosen,
            capacity,
            partitions: vec![],
            applied: false,
            steps: vec![],
            extra_gpus: 0,
            note,
        };
    }
    if let Some(plan) = repartition_idle(fleet, want) {
        return plan;
    }
    let mut plan = SloPlan {
        chosen,
        capacity,
        partitions: vec![],
        applied: false,
        steps: vec![],
        extra_gpus: 0,
        note: String::new(),
    };
    let short = format!(
        "{:.1} req/s of {:.1} planned on {} existing slice(s); the current partitions cannot meet the SLO.",
        capacity,
        want.throughput,
        plan.chosen.len()
    );
    plan.note = match would_change(fleet, want, others) {
        Some((steps, extra, model)) => {
            let more = if extra > 0 { format!(" and {extra} more {model} GPU(s)") } else { String::new() };
            plan.steps = steps;
            plan.extra_gpus = extra;
            format!(
                "{short} Repartitioning {model} GPUs as the steps show would meet it{more}; start their workers with \
                 --allow-repartition to let the scheduler apply such changes."
            )
        }
        None => format!("{short} No GPU model in the fleet has a throughput table for this model to re-plan with."),
    };
    plan
}

/// Step 1: free slices, fewest compute slices first.
fn existing_slices(fleet: &[FleetGpu], want: &Demand) -> Vec<Chosen> {
    let mut free: Vec<Chosen> = fleet
        .iter()
        .enumerate()
        .flat_map(|(g, gpu)| {
            gpu.slices
                .iter()
                .filter(|s| s.holder.is_none())
                .filter_map(move |s| {
                    let rate = want
                        .rate(gpu.model, s.placed)
                        .filter(|r| r.throughput > 0.0)?;
                    Some(Chosen {
                        gpu: g,
                        uuid: Some(s.uuid.clone()),
                        placed: s.placed,
                        rate,
                    })
                })
        })
        .collect();
    let compute = |c: &Chosen| fleet[c.gpu].model.profile(c.placed.profile).compute as f64;
    let mut chosen = Vec::new();
    let mut left = want.throughput;
    while left > 0.0 && !free.is_empty() {
        let covering = free
            .iter()
            .enumerate()
            .filter(|(_, c)| Problem::meets(c.rate.throughput, left))
            .min_by(|(_, a), (_, b)| {
                (compute(a), a.rate.throughput)
                    .partial_cmp(&(compute(b), b.rate.throughput))
                    .unwrap()
            })
            .map(|(i, _)| i);
        let pick = covering.unwrap_or_else(|| {
            free.iter()
                .enumerate()
                .max_by(|(_, a), (_, b)| {
                    (a.rate.throughput / compute(a), compute(a))
                        .partial_cmp(&(b.rate.throughput / compute(b), compute(b)))
                        .unwrap()
                })
                .map(|(i, _)| i)
                .expect("free is not empty")
        });
        let c = free.swap_remove(pick);
        left -= c.rate.throughput;
        chosen.push(c);
    }
    chosen
}

fn layout_of(gpu: &FleetGpu, service_of: impl Fn(&str) -> Option<usize>) -> GpuLayout {
    let mut slices: Vec<Assigned> = gpu
        .slices
        .iter()
        .map(|s| Assigned {
            slice: s.placed,
            service: s.holder.as_deref().and_then(&service_of),
        })
        .collect();
    slices.sort_by_key(|a| a.slice.start);
    GpuLayout { slices }
}

fn steps_json(model: GpuModel, steps: &[Step], gpus: &[usize], names: &[String]) -> Vec<FleetStep> {
    steps
        .iter()
        .map(|s| {
            let (action, gpu, slice, service) = match *s {
                Step::CreateSlice { gpu, slice } => ("create_slice", gpu, slice, None),
                Step::StartReplica {
                    gpu,
                    slice,
                    service,
                } => ("start_replica", gpu, slice, Some(service)),
                Step::StopReplica {
                    gpu,
                    slice,
                    service,
                } => ("drain_and_stop_replica", gpu, slice, Some(service)),
                Step::DestroySlice { gpu, slice } => ("destroy_slice", gpu, slice, None),
            };
            FleetStep {
                action,
                gpu: gpus.get(gpu).copied(),
                profile: model.profile(slice.profile).name,
                start: slice.start,
                service: service.and_then(|w| names.get(w).cloned()),
            }
        })
        .collect()
}

/// Step 2: re-plan idle, repartitionable MIG GPUs of one model for the whole demand.
fn repartition_idle(fleet: &[FleetGpu], want: &Demand) -> Option<SloPlan> {
    let mut models: Vec<GpuModel> = fleet.iter().map(|g| g.model).collect();
    models.sort();
    models.dedup();
    let idle = |m: GpuModel| -> Vec<usize> {
        (0..fleet.len())
            .filter(|&g| {
                let gpu = &fleet[g];
                gpu.model == m
                    && gpu.repartition
                    && !gpu.whole
                    && gpu.slices.iter().all(|s| s.holder.is_none())
            })
            .collect()
    };
    models.sort_by_key(|&m| std::cmp::Reverse(idle(m).len()));
    for model in models {
        let gpus = idle(model);
        let service = want.service(model);
        if gpus.is_empty() || service.throughput.iter().all(|&t| t <= 0.0) {
            continue;
        }
        let problem = Problem {
            gpu: model,
            services: vec![service],
        };
        let outcome = plan(&problem, Algorithm::Best, &Options::default());
        if outcome.plan.gpu_count() > gpus.len() {
            continue;
        }
        let current: Vec<GpuLayout> = gpus
            .iter()
            .map(|&g| layout_of(&fleet[g], |_| None))
            .collect();
        let demands = Demands::from_problem(&problem, 0);
        let Ok(transition) = plan_transition(model, &demands, &current, &outcome.plan) else {
            continue;
        };
        if transition.peak_gpus > gpus.len() {
            continue;
        }
        let Ok(after) = replay(model, &demands, &current, &transition.steps) else {
            continue;
        };
        let mut chosen = Vec::new();
        let mut partitions = Vec::new();
        for (i, layout) in after.iter().enumerate() {
            partitions.push((gpus[i], layout.placement()));
            for a in layout.slices.iter().filter(|a| a.service == Some(0)) {
                let rate = want
                    .rate(model, a.slice)
                    .expect("the planner only uses profiles with a rate");
                chosen.push(Chosen {
                    gpu: gpus[i],
                    uuid: None,
                    placed: a.slice,
                    rate,
                });
            }
        }
        let capacity = chosen.iter().map(|c| c.rate.throughput).sum();
        let names = vec![want.name.clone()];
        let note = format!(
            "{:.1} req/s of {:.1} planned by repartitioning {} idle {model} GPU(s) ({} planner, lower bound {} GPU(s)).",
            capacity,
            want.throughput,
            outcome.plan.gpu_count(),
            outcome.found_by.name(),
            outcome.lower_bound
        );
        return Some(SloPlan {
            chosen,
            capacity,
            partitions,
            applied: true,
            steps: steps_json(model, &transition.steps, &gpus, &names),
            extra_gpus: 0,
            note,
        });
    }
    None
}

/// Step 3: the steps a re-plan of one GPU model's SLO-only GPUs would take, the GPUs it
/// would need beyond them, and the model.
fn would_change(
    fleet: &[FleetGpu],
    want: &Demand,
    others: &[Demand],
) -> Option<(Vec<FleetStep>, usize, GpuModel)> {
    let mut models: Vec<GpuModel> = fleet.iter().map(|g| g.model).collect();
    models.sort();
    models.dedup();
    let mut services: Vec<&Demand> = vec![want];
    services.extend(others.iter().filter(|o| o.name != want.name));
    let names: Vec<String> = services.iter().map(|d| d.name.clone()).collect();
    let index = |name: &str| names.iter().position(|n| n == name);
    // The model with the most GPUs the re-plan may touch.
    let candidates = |m: GpuModel| -> Vec<usize> {
        (0..fleet.len())
            .filter(|&g| {
                let gpu = &fleet[g];
                gpu.model == m
                    && !gpu.whole
                    && gpu
                        .slices
                        .iter()
                        .all(|s| s.holder.as_deref().is_none_or(|h| index(h).is_some()))
            })
            .collect()
    };
    models.sort_by_key(|&m| std::cmp::Reverse(candidates(m).len()));
    let model = models
        .into_iter()
        .find(|&m| want.service(m).throughput.iter().any(|&t| t > 0.0))?;
    let gpus = candidates(model);
    // Services without a rate on this model keep what they have: they are left out of the
    // problem, and their slices are held as they are by dropping those GPUs.
    let planned: Vec<&Demand> = services
        .iter()
        .copied()
        .filter(|d| d.service(model).throughput.iter().any(|&t| t > 0.0))
        .collect();
    let names: Vec<String> = planned.iter().map(|d| d.name.clone()).collect();
    let index = |name: &str| names.iter().position(|n| n == name);
    let gpus: Vec<usize> = gpus
        .into_iter()
        .filter(|&g| {
            fleet[g]
                .slices
                .iter()
                .all(|s| s.holder.as_deref().is_none_or(|h| index(h).is_some()))
        })
        .collect();
    let problem = Problem {
        gpu: model,
        services: planned.iter().map(|d| d.service(model)).collect(),
    };
    let outcome = plan(&problem, Algorithm::Best, &Options::default());
    let current: Vec<GpuLayout> = gpus.iter().map(|&g| layout_of(&fleet[g], index)).collect();
    let demands = Demands::from_problem(&problem, 0);
    let transition = plan_transition(model, &demands, &current, &outcome.plan).ok()?;
    let extra = transition.peak_gpus.saturating_sub(gpus.len());
    Some((
        steps_json(model, &transition.steps, &gpus, &names),
        extra,
        model,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const H100: GpuModel = GpuModel::H100_80GB;

    /// An H100 table with MIG's non-linear scaling: seven 1g beat one 7g.
    fn demand(name: &str, throughput: f64) -> Demand {
        let table = [
            ("1g.10gb", 200.0),
            ("1g.20gb", 200.0),
            ("2g.20gb", 380.0),
            ("3g.40gb", 540.0),
            ("4g.40gb", 700.0),
            ("7g.80gb", 1000.0),
        ];
        let rates = H100
            .profiles()
            .iter()
            .map(|p| {
                table
                    .iter()
                    .find(|(n, _)| *n == p.name)
                    .map(|&(_, t)| Rate {
                        throughput: t,
                        estimated: false,
                    })
            })
            .collect();
        Demand {
            name: name.into(),
            throughput,
            rates: vec![(H100, rates)],
        }
    }

    fn gpu(uuid: &str, profiles: &[(&str, u8, Option<&str>)], repartition: bool) -> FleetGpu {
        FleetGpu {
            uuid: uuid.into(),
            worker: uuid::Uuid::nil(),
            model: H100,
            whole: false,
            repartition,
            slices: profiles
                .iter()
                .enumerate()
                .map(|(i, &(p, start, holder))| FleetSlice {
                    uuid: format!("{uuid}-{i}"),
                    placed: Placed {
                        profile: H100.profile_id(p).unwrap(),
                        start,
                    },
                    holder: holder.map(Into::into),
                })
                .collect(),
        }
    }

    #[test]
    fn a_small_demand_takes_the_smallest_free_slice_that_covers_it() {
        let fleet = [gpu(
            "g",
            &[
                ("3g.40gb", 0, None),
                ("2g.20gb", 4, None),
                ("2g.20gb", 6, Some("other")),
            ],
            false,
        )];
        let plan = plan_slo(&fleet, &demand("bert", 300.0), &[]);
        assert_eq!(plan.chosen.len(), 1);
        assert_eq!(
            plan.chosen[0].uuid.as_deref(),
            Some("g-1"),
            "the free 2g, not the 3g"
        );
        assert!(!plan.applied && plan.steps.is_empty());
        assert_eq!(plan.capacity, 380.0);
    }

    #[test]
    fn a_larger_demand_spreads_over_free_slices() {
        let fleet = [gpu(
            "g",
            &[
                ("3g.40gb", 0, None),
                ("2g.20gb", 4, None),
                ("2g.20gb", 6, None),
            ],
            false,
        )];
        let plan = plan_slo(&fleet, &demand("bert", 1200.0), &[]);
        assert_eq!(plan.chosen.len(), 3);
        assert_eq!(plan.capacity, 1300.0);
    }

    #[test]
    fn an_idle_gpu_that_allows_it_is_repartitioned_and_the_steps_are_applied() {
        // One 7g gives 1000 req/s; 1200 needs the GPU cut into smaller instances.
        let fleet = [gpu("g", &[("7g.80gb", 0, None)], true)];
        let plan = plan_slo(&fleet, &demand("bert", 1200.0), &[]);
        assert!(plan.applied, "{}", plan.note);
        assert!(plan.capacity >= 1200.0);
        assert!(plan.chosen.iter().all(|c| c.uuid.is_none() && c.gpu == 0));
        assert_eq!(plan.steps[0].action, "destroy_slice");
        assert!(plan.steps.iter().any(|s| s.action == "create_slice"));
        assert_eq!(
            plan.steps
                .iter()
                .filter(|s| s.action == "start_replica")
                .count(),
            plan.chosen.len()
        );
        let (g, partition) = &plan.partitions[0];
        assert_eq!(*g, 0);
        crate::scheduler::mig::validate(H100, partition).unwrap();
    }

    #[test]
    fn without_repartitioning_the_plan_says_what_it_would_change() {
        let fleet = [gpu("g", &[("7g.80gb", 0, None)], false)];
        let plan = plan_slo(&fleet, &demand("bert", 1200.0), &[]);
        assert!(!plan.applied);
        assert_eq!(plan.capacity, 1000.0, "it keeps the 7g it has");
        assert!(plan
            .steps
            .iter()
            .any(|s| s.action == "destroy_slice" && s.profile == "7g.80gb"));
        assert!(plan.steps.iter().all(|s| s.gpu == Some(0)));
        assert_eq!(plan.extra_gpus, 0);
        assert!(plan.note.contains("--allow-repartition"), "{}", plan.note);
    }

    #[test]
    fn a_busy_gpu_is_not_repartitioned_and_more_gpus_are_reported() {
        let fleet = [gpu(
            "g",
            &[("4g.40gb", 0, Some("old")), ("3g.40gb", 4, None)],
            true,
        )];
        let others = [demand("old", 700.0)];
        let plan = plan_slo(&fleet, &demand("bert", 2000.0), &others);
        assert!(!plan.applied);
        assert_eq!(plan.chosen.len(), 1);
        assert!(plan.extra_gpus >= 1, "{plan:?}");
        assert!(plan.steps.iter().any(|s| s.gpu.is_none()));
    }
}
