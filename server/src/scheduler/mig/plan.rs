//! The planning problem and its answer as plain data: services with a throughput demand
//! and a throughput per MIG profile, and a plan that gives each GPU a legal partition and
//! each slice the service it serves (or none).
//!
//! This is the Reconfigurable Machine Scheduling problem of MIG-serving (Tan et al.,
//! arXiv 2109.11067): meet every service's throughput with the fewest GPUs, where a
//! GPU's partition is chosen freely among the legal ones and a slice serves one service.
//! The latency SLO is folded into the throughput table (measured at the best batch size
//! that meets it), as in the paper.

use super::catalog::{GpuModel, ProfileId};
use super::partition::{validate, PartitionError, Placed};

/// Relative slack when comparing capacity with demand, so that sums of floating-point
/// throughputs equal to the demand count as meeting it.
pub const DEMAND_TOLERANCE: f64 = 1e-9;

/// One service to place.
#[derive(Debug, Clone, PartialEq)]
pub struct Service {
    pub name: String,
    /// Required throughput, requests per second.
    pub demand: f64,
    /// The p99 latency SLO the throughput table was measured under, for the record.
    pub latency_ms: Option<f64>,
    /// Throughput per profile of the problem's GPU (indexed by [`ProfileId`]); 0 where the
    /// service cannot run.
    pub throughput: Vec<f64>,
}

impl Service {
    pub fn rate(&self, profile: ProfileId) -> f64 {
        self.throughput.get(profile).copied().unwrap_or(0.0)
    }
}

/// Services to place on GPUs of one model.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    pub gpu: GpuModel,
    pub services: Vec<Service>,
}

/// A slice of a GPU and the service whose replica runs on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Assigned {
    pub slice: Placed,
    /// Index into [`Problem::services`]; `None` leaves the slice idle.
    pub service: Option<usize>,
}

/// The slices of one GPU, sorted by start.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GpuLayout {
    pub slices: Vec<Assigned>,
}

impl GpuLayout {
    pub fn placement(&self) -> Vec<Placed> {
        self.slices.iter().map(|a| a.slice).collect()
    }

    pub fn is_empty(&self) -> bool {
        self.slices.is_empty()
    }
}

/// A partition and slice assignment for each GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    pub gpus: Vec<GpuLayout>,
}

/// Why a plan does not solve its problem.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    #[error("GPU {gpu} is not a legal partition: {source}")]
    IllegalPartition { gpu: usize, source: PartitionError },
    #[error("GPU {gpu} puts service {service} on {profile}, where it cannot run")]
    CannotRun { gpu: usize, service: String, profile: &'static str },
    #[error("GPU {gpu} names service #{service}, which the problem does not have")]
    UnknownService { gpu: usize, service: usize },
    #[error("service {service} gets {capacity:.1} req/s of the {demand:.1} it needs")]
    Unmet { service: String, capacity: f64, demand: f64 },
}

impl Problem {
    /// Whether `capacity` meets `demand` within [`DEMAND_TOLERANCE`].
    pub fn meets(capacity: f64, demand: f64) -> bool {
        capacity >= demand * (1.0 - DEMAND_TOLERANCE)
    }

    /// The whole-GPU baseline ("A100 as-is" in MIG-serving): each service on whole GPUs of
    /// its own, ⌈demand / whole-GPU throughput⌉ of them. `None` if a service cannot run on a
    /// whole GPU.
    pub fn whole_gpu_count(&self) -> Option<usize> {
        let whole = self.gpu.whole_gpu_profile();
        self.services
            .iter()
            .map(|s| {
                let rate = s.rate(whole);
                (rate > 0.0).then(|| (s.demand / rate * (1.0 - DEMAND_TOLERANCE)).ceil().max(1.0) as usize)
            })
            .sum()
    }
}

impl Plan {
    pub fn gpu_count(&self) -> usize {
        self.gpus.len()
    }

    /// Throughput each service gets from the plan.
    pub fn capacity(&self, problem: &Problem) -> Vec<f64> {
        let mut cap = vec![0.0; problem.services.len()];
        for gpu in &self.gpus {
            for a in &gpu.slices {
                if let Some(w) = a.service.filter(|&w| w < cap.len()) {
                    cap[w] += problem.services[w].rate(a.slice.profile);
                }
            }
        }
        cap
    }

    /// Checks every GPU's partition, every slice's service, and every service's demand.
    pub fn check(&self, problem: &Problem) -> Result<(), PlanError> {
        for (i, gpu) in self.gpus.iter().enumerate() {
            validate(problem.gpu, &gpu.placement()).map_err(|source| PlanError::IllegalPartition { gpu: i, source })?;
            for a in &gpu.slices {
                let Some(w) = a.service else { continue };
                let service = problem.services.get(w).ok_or(PlanError::UnknownService { gpu: i, service: w })?;
                if service.rate(a.slice.profile) <= 0.0 {
                    return Err(PlanError::CannotRun {
                        gpu: i,
                        service: service.name.clone(),
                        profile: problem.gpu.profile(a.slice.profile).name,
                    });
                }
            }
        }
        for (service, capacity) in problem.services.iter().zip(self.capacity(problem)) {
            if !Problem::meets(capacity, service.demand) {
                return Err(PlanError::Unmet { service: service.name.clone(), capacity, demand: service.demand });
            }
        }
        Ok(())
    }
}

/// How far `gpus` is above a lower bound, as a fraction of the bound (0 = optimal).
pub fn gap(gpus: usize, lower_bound: usize) -> f64 {
    if lower_bound == 0 {
        return if gpus == 0 { 0.0 } else { f64::INFINITY };
    }
    (gpus as f64 - lower_bound as f64) / lower_bound as f64
}
