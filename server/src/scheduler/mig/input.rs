//! The planner's JSON: the request (GPU type, services, throughput tables, optional seed
//! and current layout), its validation into a [`Problem`] with errors that say what to
//! change, and the response (plan, bound, gap, baselines, optional transition).
//!
//! Throughput tables are keyed by service name, or by the service's `model` when several
//! services share a model. A profile missing from a table means the service cannot run on
//! that profile.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::catalog::GpuModel;
use super::partition::{validate, PartitionError, Placed};
use super::plan::{Assigned, GpuLayout, Plan, Problem, Service};
use super::planner::{best_homogeneous, plan, Algorithm, Options, Outcome};
use super::transition::{plan_transition, Demands, Step, TransitionError};

/// Most GPUs a request may need (a guard against demands typed in the wrong unit).
pub const MAX_GPUS: f64 = 10_000.0;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanRequest {
    pub gpu: String,
    pub services: Vec<ServiceRequest>,
    pub profiles: BTreeMap<String, BTreeMap<String, f64>>,
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default)]
    pub current: Option<LayoutRequest>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceRequest {
    pub name: String,
    #[serde(default)]
    pub model: Option<String>,
    /// Required throughput, requests per second.
    pub throughput: f64,
    #[serde(default)]
    pub latency_ms: Option<f64>,
}

/// The layout running now; a previous plan's output is accepted as is (other fields are
/// ignored).
#[derive(Debug, Clone, Deserialize)]
pub struct LayoutRequest {
    pub gpus: Vec<GpuRequest>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct GpuRequest {
    #[serde(default)]
    pub slices: Vec<SliceJson>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SliceJson {
    pub profile: String,
    pub start: u8,
    #[serde(default)]
    pub service: Option<String>,
}

/// What is wrong with a request, phrased so the user knows what to change.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InputError {
    #[error("the input is not valid planner JSON: {0}")]
    Json(String),
    #[error("unknown GPU type \"{0}\"; use one of A100-40GB, A100-80GB, H100-80GB, H200-141GB")]
    UnknownGpu(String),
    #[error("the input lists no services; add at least one to \"services\"")]
    NoServices,
    #[error("a service has an empty name; give every service a name")]
    EmptyName,
    #[error("service \"{0}\" is listed twice; service names must be unique")]
    DuplicateService(String),
    #[error("service \"{service}\" has throughput {value}; it must be a positive number of requests per second")]
    BadThroughput { service: String, value: f64 },
    #[error("service \"{service}\" has latency_ms {value}; it must be a positive number of milliseconds")]
    BadLatency { service: String, value: f64 },
    #[error("service \"{0}\" has no throughput table; add one under \"profiles\" keyed by its name or model")]
    NoTable(String),
    #[error("the throughput table \"{table}\" names profile \"{profile}\", which {gpu} does not have; its profiles are {valid}")]
    UnknownProfile { table: String, profile: String, gpu: GpuModel, valid: String },
    #[error("the throughput table \"{table}\" gives {profile} {value} req/s; give a positive number, or leave the profile out if the service cannot run there")]
    BadRate { table: String, profile: String, value: f64 },
    #[error("service \"{0}\" cannot run on any profile: its throughput table is empty")]
    NoProfile(String),
    #[error("the throughput table \"{0}\" matches no service name or model; remove it or fix the name")]
    UnusedTable(String),
    #[error("the services need at least {0:.0} GPUs and the planner handles at most {MAX_GPUS}; check that throughputs are in requests per second")]
    TooLarge(f64),
    #[error("current GPU {gpu} is not a legal partition: {source}")]
    CurrentPartition { gpu: usize, source: PartitionError },
    #[error("current GPU {gpu} runs \"{service}\" on {profile}, which its throughput table does not list")]
    CurrentCannotRun { gpu: usize, service: String, profile: String },
    #[error("the transition from the current layout could not be planned: {0}")]
    Transition(#[from] TransitionError),
}

/// A validated request.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub problem: Problem,
    pub seed: Option<u64>,
    /// The layout running now, with service ids past the problem's for services that run
    /// but are no longer wanted (named in `retired`).
    pub current: Option<Vec<GpuLayout>>,
    pub retired: Vec<String>,
}

/// Parses and validates a request.
pub fn parse_request(text: &str) -> Result<Request, InputError> {
    let raw: PlanRequest = serde_json::from_str(text).map_err(|e| InputError::Json(e.to_string()))?;
    let gpu = GpuModel::parse(&raw.gpu).ok_or_else(|| InputError::UnknownGpu(raw.gpu.clone()))?;
    if raw.services.is_empty() {
        return Err(InputError::NoServices);
    }
    // Every table first, so a typo in a profile name is reported even for an unused table.
    let mut tables: HashMap<&str, Vec<f64>> = HashMap::new();
    for (table, rates) in &raw.profiles {
        let mut throughput = vec![0.0; gpu.profiles().len()];
        for (profile, &value) in rates {
            let id = gpu.profile_id(profile).ok_or_else(|| InputError::UnknownProfile {
                table: table.clone(),
                profile: profile.clone(),
                gpu,
                valid: gpu.profile_names(),
            })?;
            if !(value.is_finite() && value > 0.0) {
                return Err(InputError::BadRate { table: table.clone(), profile: profile.clone(), value });
            }
            throughput[id] = value;
        }
        tables.insert(table.as_str(), throughput);
    }
    let mut names = HashSet::new();
    let mut used_tables = HashSet::new();
    let mut services = Vec::with_capacity(raw.services.len());
    let mut least_gpus = 0.0;
    for s in &raw.services {
        if s.name.trim().is_empty() {
            return Err(InputError::EmptyName);
        }
        if !names.insert(s.name.as_str()) {
            return Err(InputError::DuplicateService(s.name.clone()));
        }
        if !(s.throughput.is_finite() && s.throughput > 0.0) {
            return Err(InputError::BadThroughput { service: s.name.clone(), value: s.throughput });
        }
        if let Some(value) = s.latency_ms.filter(|v| !(v.is_finite() && *v > 0.0)) {
            return Err(InputError::BadLatency { service: s.name.clone(), value });
        }
        let key = if tables.contains_key(s.name.as_str()) {
            s.name.as_str()
        } else {
            s.model.as_deref().filter(|m| tables.contains_key(m)).ok_or_else(|| InputError::NoTable(s.name.clone()))?
        };
        used_tables.insert(key);
        let throughput = tables[key].clone();
        let best = throughput.iter().copied().fold(0.0, f64::max);
        if best <= 0.0 {
            return Err(InputError::NoProfile(s.name.clone()));
        }
        least_gpus += s.throughput / (best * 7.0);
        services.push(Service { name: s.name.clone(), demand: s.throughput, latency_ms: s.latency_ms, throughput });
    }
    if let Some(unused) = raw.profiles.keys().find(|k| !used_tables.contains(k.as_str())) {
        return Err(InputError::UnusedTable(unused.clone()));
    }
    if least_gpus > MAX_GPUS {
        return Err(InputError::TooLarge(least_gpus));
    }
    let problem = Problem { gpu, services };
    let (current, retired) = match &raw.current {
        Some(layout) => {
            let (c, r) = parse_layout(&problem, layout)?;
            (Some(c), r)
        }
        None => (None, Vec::new()),
    };
    Ok(Request { problem, seed: raw.seed, current, retired })
}

fn parse_layout(problem: &Problem, layout: &LayoutRequest) -> Result<(Vec<GpuLayout>, Vec<String>), InputError> {
    let gpu = problem.gpu;
    let mut retired: Vec<String> = Vec::new();
    let mut gpus = Vec::with_capacity(layout.gpus.len());
    for (i, g) in layout.gpus.iter().enumerate() {
        let mut slices = Vec::with_capacity(g.slices.len());
        for s in &g.slices {
            let profile = gpu.profile_id(&s.profile).ok_or_else(|| InputError::CurrentPartition {
                gpu: i,
                source: PartitionError::UnknownProfile { gpu, name: s.profile.clone(), valid: gpu.profile_names() },
            })?;
            let service = match &s.service {
                None => None,
                Some(name) => Some(match problem.services.iter().position(|x| &x.name == name) {
                    Some(w) => {
                        if problem.services[w].rate(profile) <= 0.0 {
                            return Err(InputError::CurrentCannotRun {
                                gpu: i,
                                service: name.clone(),
                                profile: s.profile.clone(),
                            });
                        }
                        w
                    }
                    None => {
                        let r = retired.iter().position(|x| x == name).unwrap_or_else(|| {
                            retired.push(name.clone());
                            retired.len() - 1
                        });
                        problem.services.len() + r
                    }
                }),
            };
            slices.push(Assigned { slice: Placed { profile, start: s.start }, service });
        }
        slices.sort_by_key(|a| a.slice.start);
        let placement: Vec<Placed> = slices.iter().map(|a| a.slice).collect();
        validate(gpu, &placement).map_err(|source| InputError::CurrentPartition { gpu: i, source })?;
        gpus.push(GpuLayout { slices });
    }
    Ok((gpus, retired))
}

#[derive(Debug, Clone, Serialize)]
pub struct PlanResponse {
    pub gpus: Vec<GpuJson>,
    pub gpu_count: usize,
    pub lower_bound: usize,
    /// (gpu_count − lower_bound) / lower_bound.
    pub gap: f64,
    pub optimal: bool,
    pub algorithm: &'static str,
    pub found_by: &'static str,
    pub elapsed_ms: f64,
    pub gpu: &'static str,
    pub seed: u64,
    pub services: Vec<ServiceJson>,
    pub baselines: Baselines,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub transition: Option<TransitionJson>,
}

#[derive(Debug, Clone, Serialize)]
pub struct GpuJson {
    pub partition: Vec<&'static str>,
    pub slices: Vec<SliceJson>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ServiceJson {
    pub name: String,
    pub demand: f64,
    pub capacity: f64,
    pub replicas: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct Baselines {
    /// Each service on whole GPUs of its own; null if some service cannot use a whole GPU.
    pub whole_gpu: Option<usize>,
    pub best_homogeneous: Option<HomogeneousJson>,
}

#[derive(Debug, Clone, Serialize)]
pub struct HomogeneousJson {
    pub partition: Vec<&'static str>,
    pub gpus: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct TransitionJson {
    pub steps: Vec<StepJson>,
    /// Physical GPU (index into `current.gpus`, or beyond for GPUs not in use now) of each
    /// plan GPU.
    pub gpu_of_plan: Vec<usize>,
    pub temporary_gpus: Vec<usize>,
    pub peak_gpus: usize,
    pub extra_gpus: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct StepJson {
    pub action: &'static str,
    pub gpu: usize,
    pub profile: &'static str,
    pub start: u8,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
}

fn round(x: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (x * f).round() / f
}

fn plan_json(problem: &Problem, plan: &Plan, name_of: &dyn Fn(usize) -> String) -> Vec<GpuJson> {
    plan.gpus
        .iter()
        .map(|g| GpuJson {
            partition: g.slices.iter().map(|a| problem.gpu.profile(a.slice.profile).name).collect(),
            slices: g
                .slices
                .iter()
                .map(|a| SliceJson {
                    profile: problem.gpu.profile(a.slice.profile).name.to_string(),
                    start: a.slice.start,
                    service: a.service.map(name_of),
                })
                .collect(),
        })
        .collect()
}

/// Plans a validated request; `elapsed_ms` covers the bound and the planner.
pub fn respond(request: &Request, algorithm: Algorithm) -> Result<PlanResponse, InputError> {
    let problem = &request.problem;
    let options = Options { seed: request.seed.unwrap_or(super::planner::DEFAULT_SEED), ..Options::default() };
    let started = Instant::now();
    let outcome: Outcome = plan(problem, algorithm, &options);
    let elapsed_ms = started.elapsed().as_secs_f64() * 1000.0;
    let name_of = |w: usize| match problem.services.get(w) {
        Some(s) => s.name.clone(),
        None => request.retired[w - problem.services.len()].clone(),
    };
    let capacity = outcome.plan.capacity(problem);
    let services = problem
        .services
        .iter()
        .enumerate()
        .map(|(w, s)| ServiceJson {
            name: s.name.clone(),
            demand: s.demand,
            capacity: round(capacity[w], 3),
            replicas: outcome.plan.gpus.iter().flat_map(|g| &g.slices).filter(|a| a.service == Some(w)).count(),
        })
        .collect();
    let transition = match &request.current {
        None => None,
        Some(current) => {
            let demands = Demands::from_problem(problem, request.retired.len());
            let t = plan_transition(problem.gpu, &demands, current, &outcome.plan)?;
            let steps = t
                .steps
                .iter()
                .map(|s| {
                    let (action, gpu, slice, service) = match *s {
                        Step::CreateSlice { gpu, slice } => ("create_slice", gpu, slice, None),
                        Step::StartReplica { gpu, slice, service } => ("start_replica", gpu, slice, Some(service)),
                        Step::StopReplica { gpu, slice, service } => {
                            ("drain_and_stop_replica", gpu, slice, Some(service))
                        }
                        Step::DestroySlice { gpu, slice } => ("destroy_slice", gpu, slice, None),
                    };
                    StepJson {
                        action,
                        gpu,
                        profile: problem.gpu.profile(slice.profile).name,
                        start: slice.start,
                        service: service.map(name_of),
                    }
                })
                .collect();
            Some(TransitionJson {
                steps,
                gpu_of_plan: t.gpu_of_plan,
                temporary_gpus: t.temporary_gpus,
                peak_gpus: t.peak_gpus,
                extra_gpus: t.extra_gpus,
            })
        }
    };
    Ok(PlanResponse {
        gpus: plan_json(problem, &outcome.plan, &name_of),
        gpu_count: outcome.plan.gpu_count(),
        lower_bound: outcome.lower_bound,
        gap: round(outcome.gap, 4),
        optimal: outcome.optimal,
        algorithm: outcome.algorithm.name(),
        found_by: outcome.found_by.name(),
        elapsed_ms: round(elapsed_ms, 3),
        gpu: problem.gpu.name(),
        seed: options.seed,
        services,
        baselines: Baselines {
            whole_gpu: problem.whole_gpu_count(),
            best_homogeneous: best_homogeneous(problem)
                .map(|h| HomogeneousJson { partition: h.partition, gpus: h.gpus }),
        },
        transition,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = r#"{"gpu":"A100-80GB","services":[{"name":"bert","throughput":1200,"latency_ms":50}],
        "profiles":{"bert":{"1g.10gb":210,"2g.20gb":430,"3g.40gb":650,"4g.40gb":860,"7g.80gb":1500}}}"#;

    fn error_of(text: &str) -> String {
        parse_request(text).unwrap_err().to_string()
    }

    #[test]
    fn the_issue_example_parses_and_plans_one_gpu() {
        let request = parse_request(EXAMPLE).unwrap();
        let response = respond(&request, Algorithm::Best).unwrap();
        assert_eq!(response.gpu_count, 1);
        assert_eq!(response.lower_bound, 1);
        assert!(response.optimal);
        assert_eq!(response.gpus[0].partition.len(), response.gpus[0].slices.len());
    }

    #[test]
    fn rejects_an_unknown_gpu_type() {
        assert_eq!(
            error_of(&EXAMPLE.replace("A100-80GB", "V100")),
            "unknown GPU type \"V100\"; use one of A100-40GB, A100-80GB, H100-80GB, H200-141GB"
        );
    }

    #[test]
    fn rejects_a_profile_the_gpu_does_not_have() {
        let err = error_of(&EXAMPLE.replace("1g.10gb", "1g.5gb"));
        assert!(
            err.starts_with("the throughput table \"bert\" names profile \"1g.5gb\", which A100-80GB does not have"),
            "{err}"
        );
    }

    #[test]
    fn rejects_zero_and_negative_throughput() {
        assert!(error_of(&EXAMPLE.replace("1200", "0")).contains("must be a positive number of requests per second"));
        assert!(error_of(&EXAMPLE.replace("1200", "-5")).contains("has throughput -5"));
        assert!(
            error_of(&EXAMPLE.replace(":210", ":-1")).contains("leave the profile out if the service cannot run there")
        );
    }

    #[test]
    fn rejects_a_service_no_profile_can_serve() {
        let text = r#"{"gpu":"A100-80GB","services":[{"name":"bert","throughput":10}],"profiles":{"bert":{}}}"#;
        assert_eq!(error_of(text), "service \"bert\" cannot run on any profile: its throughput table is empty");
        let text = r#"{"gpu":"A100-80GB","services":[{"name":"bert","throughput":10}],"profiles":{}}"#;
        assert!(error_of(text).starts_with("service \"bert\" has no throughput table"));
    }

    #[test]
    fn rejects_unknown_fields_duplicates_and_stray_tables() {
        assert!(error_of(&EXAMPLE.replace("\"latency_ms\"", "\"latency\"")).contains("unknown field `latency`"));
        let twice = EXAMPLE.replace(
            r#"{"name":"bert","throughput":1200,"latency_ms":50}"#,
            r#"{"name":"bert","throughput":1},{"name":"bert","throughput":2}"#,
        );
        assert_eq!(error_of(&twice), "service \"bert\" is listed twice; service names must be unique");
        let stray = EXAMPLE.replace(r#""profiles":{"#, r#""profiles":{"gpt":{"7g.80gb":5},"#);
        assert!(error_of(&stray).starts_with("the throughput table \"gpt\" matches no service"));
        assert!(error_of("{").starts_with("the input is not valid planner JSON"));
        assert_eq!(
            error_of(r#"{"gpu":"A100-80GB","services":[],"profiles":{}}"#),
            "the input lists no services; add at least one to \"services\""
        );
    }

    #[test]
    fn tables_may_be_keyed_by_model() {
        let text = r#"{"gpu":"H100-80GB","services":[{"name":"a","model":"bert","throughput":100},{"name":"b","model":"bert","throughput":300}],
            "profiles":{"bert":{"1g.10gb":210,"7g.80gb":1500}}}"#;
        let request = parse_request(text).unwrap();
        assert_eq!(request.problem.services.len(), 2);
        assert_eq!(respond(&request, Algorithm::Greedy).unwrap().gpu_count, 1);
    }

    #[test]
    fn rejects_an_illegal_current_layout() {
        let text = EXAMPLE.replace(
            r#""profiles""#,
            r#""current":{"gpus":[{"slices":[{"profile":"4g.40gb","start":0,"service":"bert"},{"profile":"4g.40gb","start":4}]}]},"profiles""#,
        );
        assert_eq!(
            error_of(&text),
            "current GPU 0 is not a legal partition: the instances need 8 compute slices and a GPU has 7"
        );
    }

    #[test]
    fn a_current_layout_yields_a_transition_with_retired_services_drained() {
        let text = EXAMPLE.replace(
            r#""profiles""#,
            r#""current":{"gpus":[{"slices":[{"profile":"4g.40gb","start":0,"service":"bert"},{"profile":"3g.40gb","start":4,"service":"old"}]}]},"profiles""#,
        );
        let request = parse_request(&text).unwrap();
        assert_eq!(request.retired, vec!["old".to_string()]);
        let response = respond(&request, Algorithm::Best).unwrap();
        let t = response.transition.unwrap();
        assert!(t.steps.iter().any(|s| s.action == "drain_and_stop_replica" && s.service.as_deref() == Some("old")));
    }
}
