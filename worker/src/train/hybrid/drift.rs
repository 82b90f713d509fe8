//! When a plan stops fitting its gang. A plan is made for the ranks' speeds relative to
//! each other: a host that slows every rank alike (the drift a shared host shows between
//! the profile and the steps after it) leaves the plan as good as it was, one rank slowing
//! alone (another tenant, a throttled GPU) makes it wrong. So every
//! [`REPLAN_CHECK_STEPS`](tessera_api::parallel::REPLAN_CHECK_STEPS) steps under a plan each
//! rank reads its own drift (its measured compute over the plan's prediction), the ranks
//! share theirs, and the gang plans again when the drifts have come apart by more than the
//! spec's `replan_drift` in [`CHECKS_IN_A_ROW`] checks in a row.

/// Checks in a row the drifts must be apart before the gang plans again: one check can be a
/// burst of load on one rank.
pub const CHECKS_IN_A_ROW: u32 = 2;

/// One rank's drift from its plan: the median of its steps' compute per unit of work
/// (`per_work_ms`), at the plan's typical batch (`typical_work`), over the compute the plan
/// predicted for that batch. 1 when the rank runs as predicted.
pub fn drift(per_work_ms: &[f64], typical_work: f64, predicted_ms: f64) -> f64 {
    super::median(per_work_ms.to_vec()) * typical_work / predicted_ms.max(f64::MIN_POSITIVE)
}

/// How far apart the ranks' drifts are: the largest over the smallest, less 1 (0 when every
/// rank drifted alike, 1 when one runs twice as slow against its prediction as another).
pub fn spread(drifts: &[f64]) -> f64 {
    let largest = drifts.iter().copied().fold(f64::MIN, f64::max);
    let smallest = drifts.iter().copied().fold(f64::MAX, f64::min);
    if drifts.is_empty() || smallest <= 0.0 {
        return 0.0;
    }
    largest / smallest - 1.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_reads_its_median_step_at_the_typical_batch_against_the_prediction() {
        // 0.1 ms a unit of work with one slow outlier; the typical batch is 200 units.
        let steps = [0.1, 0.1, 0.5, 0.1, 0.1];
        assert!((drift(&steps, 200.0, 20.0) - 1.0).abs() < 1e-12, "as predicted");
        assert!((drift(&steps, 200.0, 10.0) - 2.0).abs() < 1e-12, "twice the prediction");
    }

    #[test]
    fn ranks_drifting_alike_are_not_apart_and_one_slowing_alone_is() {
        assert_eq!(spread(&[1.3, 1.3]), 0.0, "the host slowed both ranks alike");
        assert!((spread(&[1.0, 1.5, 1.2]) - 0.5).abs() < 1e-12);
        assert!((spread(&[0.5, 1.0]) - 1.0).abs() < 1e-12, "a rank faster than predicted counts too");
        assert_eq!(spread(&[]), 0.0);
        assert_eq!(spread(&[1.0]), 0.0);
    }
}
