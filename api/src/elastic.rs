//! Elastic and preemptible training (issue 16, Aryl): the `resources` of a training spec
//! (how many ranks a job may run at, whether the scheduler may stop it to take its slices
//! back) and the body of a preemption request.
//!
//! An elastic job lists in `parallel.ranks` a device for every rank it may grow to
//! (`max_ranks`); it runs on the first n of them, `min_ranks <= n <= max_ranks`. The
//! global batch (`batch_size`) stays fixed whatever n is: each rank takes a contiguous
//! share of every batch and the shares' gradients are summed, so the run computes the
//! same mathematical update at any rank count, and the results differ only by the order
//! of float summation. The same spec at the same n is bit-identical, preempted or not.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::train::SpecError;

/// `"resources"` of a training spec, as the user writes it. Every field may be left out:
/// a job without it runs as before, at exactly its `parallel.ranks` (or one device) and
/// never preempted.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResourcesSpec {
    /// The fewest ranks the job may run at (default: `max_ranks`, an inelastic job).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_ranks: Option<u32>,
    /// The most ranks it may run at; must be the number of `parallel.ranks` (1 without
    /// `parallel`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_ranks: Option<u32>,
    /// Whether the scheduler (or the job's owner) may stop the job to free its slices:
    /// it checkpoints at the step it is on, waits as `preempted` and resumes from there.
    #[serde(default)]
    pub preemptible: bool,
}

/// The resources of a queued job, every default filled in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Resources {
    pub min_ranks: u32,
    pub max_ranks: u32,
    pub preemptible: bool,
}

impl Resources {
    /// A job as before issue 16: `ranks` fixed, not preemptible.
    pub fn fixed(ranks: u32) -> Resources {
        Resources { min_ranks: ranks, max_ranks: ranks, preemptible: false }
    }

    /// Whether the job may run at more than one rank count.
    pub fn is_elastic(&self) -> bool {
        self.min_ranks < self.max_ranks
    }
}

impl ResourcesSpec {
    /// Checks the fields against the job's `ranks` (the length of `parallel.ranks`, 1
    /// without it) and returns them with the defaults filled in.
    pub fn resolve(&self, ranks: u32) -> Result<Resources, SpecError> {
        let max_ranks = self.max_ranks.unwrap_or(ranks);
        if max_ranks != ranks {
            let message = if ranks == 1 {
                format!(
                    "a job without `parallel` runs on one device; to run at up to {max_ranks} ranks list a device \
                     for each under parallel.ranks"
                )
            } else {
                format!(
                    "must equal the number of parallel.ranks ({ranks}): list a device for every rank the job may \
                     grow to"
                )
            };
            return Err(SpecError::new("resources.max_ranks", message));
        }
        let min_ranks = self.min_ranks.unwrap_or(max_ranks);
        if min_ranks == 0 || min_ranks > max_ranks {
            return Err(SpecError::new(
                "resources.min_ranks",
                format!("must be 1 to max_ranks ({max_ranks}): the fewest ranks the job may run at"),
            ));
        }
        Ok(Resources { min_ranks, max_ranks, preemptible: self.preemptible })
    }
}

/// `POST /api/v1/jobs/{id}/preempt`; the body may be left out.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PreemptRequest {
    /// Why, recorded in the job's message (default: who asked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Admins only: preempt a job whose spec is not `preemptible`.
    #[serde(default)]
    pub force: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(json: serde_json::Value) -> ResourcesSpec {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn left_out_fields_keep_a_job_as_it_was() {
        assert_eq!(ResourcesSpec::default().resolve(1).unwrap(), Resources::fixed(1));
        assert_eq!(ResourcesSpec::default().resolve(4).unwrap(), Resources::fixed(4));
        let elastic = spec(serde_json::json!({"min_ranks": 2, "preemptible": true})).resolve(4).unwrap();
        assert_eq!(elastic, Resources { min_ranks: 2, max_ranks: 4, preemptible: true });
        assert!(elastic.is_elastic() && !Resources::fixed(4).is_elastic());
    }

    #[test]
    fn ranks_outside_the_spec_s_devices_are_refused_by_field() {
        let error = spec(serde_json::json!({"max_ranks": 3})).resolve(4).unwrap_err();
        assert_eq!(error.field, "resources.max_ranks");
        assert!(error.message.contains("parallel.ranks (4)"), "{error}");
        let error = spec(serde_json::json!({"max_ranks": 2})).resolve(1).unwrap_err();
        assert!(error.message.contains("without `parallel`"), "{error}");
        assert_eq!(spec(serde_json::json!({"min_ranks": 5})).resolve(4).unwrap_err().field, "resources.min_ranks");
        assert_eq!(spec(serde_json::json!({"min_ranks": 0})).resolve(4).unwrap_err().field, "resources.min_ranks");
        let unknown = serde_json::from_value::<ResourcesSpec>(serde_json::json!({"ranks": 2})).unwrap_err();
        assert!(unknown.to_string().contains("ranks"), "{unknown}");
    }
}
