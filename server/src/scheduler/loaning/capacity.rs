//! Loanable capacity of one serving deployment: how many of its slices may be lent to
//! training this round, given its measured request rate, with hysteresis so the loan does
//! not flap when the rate hovers around a threshold.
//!
//! Aryl (Li et al., "Aryl: An Elastic Cluster Scheduler for Deep Learning", arXiv
//! 2202.07896; EuroSys '23 as "Lyra"), capacity loaning: idle inference servers are lent
//! to training and reclaimed when inference needs them back. The paper decides per server
//! from the inference cluster's predicted load; here the unit is a deployment's slice and
//! the decision is per deployment.
//!
//! Departures and choices of our own:
//! - What a deployment needs is `ceil(rate × (1 + headroom) / per-slice rate)`, never below
//!   its floor of serving slices ([`serving_floor`]: what its SLO plan needs at that rate,
//!   at least one replica).
//! - Two thresholds: the loan shrinks at once when it would leave less than that need
//!   (inference keeps priority), but grows only when even a wider margin
//!   (`headroom + lend_band`) leaves slices idle, and only after the rate stayed there for
//!   `calm_rounds` consecutive rounds. So after a lend at rate r, the next reclaim needs a
//!   rate above r × (1 + headroom + band) / (1 + headroom) (tested below).

/// One deployment as the loaning policy sees it this round.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Deployment {
    /// Slices provisioned for the deployment (by its replica count or its SLO plan).
    pub slices: u32,
    /// Slices that always keep serving (at least one replica stays up).
    pub min_serving: u32,
    /// Requests per second one slice serves within the latency SLO (measured).
    pub slice_rate: f64,
    /// Requests per second measured over the last window.
    pub measured_rate: f64,
    /// The owner marked it `loanable`.
    pub loanable: bool,
}

/// The policy's knobs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoanPolicy {
    /// Fraction above the measured rate that stays served (0.2 = 20% headroom).
    pub headroom: f64,
    /// Extra fraction the rate must leave idle before the loan grows.
    pub lend_band: f64,
    /// Consecutive rounds the rate must allow a larger loan before it grows.
    pub calm_rounds: u32,
}

impl Default for LoanPolicy {
    fn default() -> Self {
        LoanPolicy { headroom: 0.2, lend_band: 0.15, calm_rounds: 2 }
    }
}

/// What the policy remembers between rounds for one deployment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LoanState {
    /// Slices lent to training now.
    pub loaned: u32,
    /// Consecutive rounds in which a larger loan was allowed.
    pub calm: u32,
}

/// What sized a deployment, for its serving floor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sizing<'a> {
    /// A throughput SLO: requests per second each slice of its plan serves under the
    /// latency SLO (the plan's own figures, measured or estimated when it was planned).
    Slo { planned: &'a [f64] },
    /// A replica count its owner chose.
    Replicas,
}

/// Slices that keep serving whatever the per-slice rate of the throughput table says: for
/// an SLO deployment, the slices its plan needs to carry `rate` with `margin` above it at
/// the plan's per-slice figures, counted weakest first since any slice may be the one
/// lent (all of them when the plan cannot carry it); at least one replica in every case.
///
/// Choice: a replica-count deployment's floor is one replica, not its replica count: the
/// owner made it loanable, and a floor of every replica would lend nothing. An SLO plan's
/// figures are kept as a floor because the table may have been measured again since the
/// plan (the deployment was sized by the plan's, lower or not).
pub fn serving_floor(sizing: &Sizing, rate: f64, margin: f64) -> u32 {
    let Sizing::Slo { planned } = sizing else {
        return 1;
    };
    let want = rate.max(0.0) * (1.0 + margin.max(0.0));
    if !want.is_finite() {
        return (planned.len() as u32).max(1);
    }
    let mut rates: Vec<f64> = planned.iter().map(|r| if r.is_finite() { r.max(0.0) } else { 0.0 }).collect();
    rates.sort_by(f64::total_cmp);
    let mut carried = 0.0;
    for (i, r) in rates.iter().enumerate() {
        if carried >= want && i > 0 {
            return i as u32;
        }
        carried += r;
    }
    (rates.len() as u32).max(1)
}

/// Slices the deployment must keep serving at `rate` with `margin` above it.
pub fn needed(d: &Deployment, rate: f64, margin: f64) -> u32 {
    let want = if d.slice_rate > 0.0 && rate.is_finite() {
        (rate.max(0.0) * (1.0 + margin) / d.slice_rate).ceil()
    } else {
        // No measured per-slice rate: nothing is known to be idle.
        f64::INFINITY
    };
    let want = if want >= d.slices as f64 { d.slices } else { want as u32 };
    want.max(d.min_serving).min(d.slices)
}

/// The loan after this round.
pub fn next_loan(d: &Deployment, policy: &LoanPolicy, prev: LoanState) -> LoanState {
    if !d.loanable {
        return LoanState::default();
    }
    let keep = d.slices - needed(d, d.measured_rate, policy.headroom);
    if prev.loaned > keep {
        return LoanState { loaned: keep, calm: 0 };
    }
    let lendable = d.slices - needed(d, d.measured_rate, policy.headroom + policy.lend_band);
    if lendable <= prev.loaned {
        return LoanState { loaned: prev.loaned, calm: 0 };
    }
    let calm = prev.calm + 1;
    if calm >= policy.calm_rounds {
        LoanState { loaned: lendable, calm: 0 }
    } else {
        LoanState { loaned: prev.loaned, calm }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn deployment(rate: f64) -> Deployment {
        Deployment { slices: 16, min_serving: 1, slice_rate: 100.0, measured_rate: rate, loanable: true }
    }

    #[test]
    fn idle_deployment_lends_all_but_its_floor_after_calm_rounds() {
        let p = LoanPolicy::default();
        let d = deployment(0.0);
        let s1 = next_loan(&d, &p, LoanState::default());
        assert_eq!(s1, LoanState { loaned: 0, calm: 1 });
        let s2 = next_loan(&d, &p, s1);
        assert_eq!(s2.loaned, 15);
    }

    #[test]
    fn demand_spike_reclaims_in_the_same_round() {
        let p = LoanPolicy::default();
        let s = LoanState { loaned: 15, calm: 0 };
        // 1000 req/s × 1.2 = 12 slices needed: at most 4 stay lent.
        let next = next_loan(&deployment(1000.0), &p, s);
        assert_eq!(next.loaned, 4);
    }

    #[test]
    fn not_loanable_or_unmeasured_lends_nothing() {
        let p = LoanPolicy::default();
        let mut d = deployment(0.0);
        d.loanable = false;
        assert_eq!(next_loan(&d, &p, LoanState { loaned: 3, calm: 5 }).loaned, 0);
        let mut d = deployment(0.0);
        d.slice_rate = 0.0;
        assert_eq!(next_loan(&d, &p, LoanState { loaned: 3, calm: 5 }).loaned, 0);
    }

    #[test]
    fn rate_inside_the_band_never_changes_the_loan() {
        let p = LoanPolicy { headroom: 0.2, lend_band: 0.2, calm_rounds: 1 };
        // At 700 req/s: keep needs ceil(8.4) = 9 (7 lendable), lend needs ceil(9.8) = 10 (6).
        let d = deployment(700.0);
        let mut s = next_loan(&d, &p, LoanState::default());
        assert_eq!(s.loaned, 6);
        let mut rng = StdRng::seed_from_u64(16);
        for _ in 0..1000 {
            // Any rate whose keep-need is <= 10 and whose lend-need is >= 10 leaves 6 alone.
            let rate = rng.gen_range(650.0..833.0);
            s = next_loan(&deployment(rate), &p, s);
            assert_eq!(s.loaned, 6, "rate {rate}");
        }
    }

    #[test]
    fn an_slo_deployment_keeps_what_its_plan_needs_at_the_measured_rate() {
        // Planned on four slices at 50 req/s each; the table now says 100 per slice.
        let planned = [50.0, 50.0, 50.0, 50.0];
        let sizing = Sizing::Slo { planned: &planned };
        let p = LoanPolicy { headroom: 0.2, lend_band: 0.0, calm_rounds: 1 };
        let floor = serving_floor(&sizing, 80.0, p.headroom);
        assert_eq!(floor, 2, "96 req/s needs two of the plan's 50 req/s slices");
        let d = Deployment { slices: 4, min_serving: floor, slice_rate: 100.0, measured_rate: 80.0, loanable: true };
        assert_eq!(next_loan(&d, &p, LoanState::default()).loaned, 2);
        // With a floor of one, the table alone would have lent three.
        let one = Deployment { min_serving: 1, ..d };
        assert_eq!(next_loan(&one, &p, LoanState::default()).loaned, 3);
    }

    #[test]
    fn the_floor_counts_the_weakest_planned_slices_first_and_keeps_one_replica() {
        let mixed = [300.0, 100.0, 100.0];
        let slo = Sizing::Slo { planned: &mixed };
        // 180 req/s: the two 100 req/s slices carry it, wherever the 300 one is.
        assert_eq!(serving_floor(&slo, 150.0, 0.2), 2);
        assert_eq!(serving_floor(&slo, 200.0, 0.0), 2);
        assert_eq!(serving_floor(&slo, 201.0, 0.0), 3);
        assert_eq!(serving_floor(&slo, 1e6, 0.2), 3, "more than the plan carries: all of it");
        assert_eq!(serving_floor(&slo, 0.0, 0.2), 1, "idle: one replica");
        assert_eq!(serving_floor(&Sizing::Slo { planned: &[] }, 50.0, 0.2), 1);
        assert_eq!(serving_floor(&Sizing::Replicas, 1e6, 0.2), 1);
    }

    /// Random walks of the rate: the serving side always keeps its need, and a reclaim that
    /// follows a lend needs the rate to have risen past the band.
    #[test]
    fn hysteresis_holds_on_random_walks() {
        let mut rng = StdRng::seed_from_u64(7);
        for case in 0..300 {
            let p = LoanPolicy {
                headroom: rng.gen_range(0.0..0.5),
                lend_band: rng.gen_range(0.0..0.5),
                calm_rounds: rng.gen_range(0..4),
            };
            let mut d = Deployment {
                slices: rng.gen_range(1..40),
                min_serving: 0,
                slice_rate: rng.gen_range(1.0..200.0),
                measured_rate: 0.0,
                loanable: true,
            };
            d.min_serving = rng.gen_range(0..=d.slices);
            let top = d.slices as f64 * d.slice_rate;
            let mut rate = rng.gen_range(0.0..top);
            let mut s = LoanState::default();
            let mut last_lend_rate: Option<f64> = None;
            for _ in 0..400 {
                rate = (rate * rng.gen_range(0.85..1.15) + rng.gen_range(-0.02..0.02) * top).clamp(0.0, top);
                d.measured_rate = rate;
                let next = next_loan(&d, &p, s);
                assert!(d.slices - next.loaned >= needed(&d, rate, p.headroom), "case {case}: serving below need");
                assert!(d.slices - next.loaned >= d.min_serving);
                if next.loaned > s.loaned {
                    last_lend_rate = Some(rate);
                }
                if next.loaned < s.loaned {
                    if let Some(r) = last_lend_rate {
                        let bound = r * (1.0 + p.headroom + p.lend_band) / (1.0 + p.headroom);
                        assert!(rate > bound * (1.0 - 1e-9), "case {case}: reclaim at {rate} after lend at {r}");
                    }
                }
                s = next;
            }
        }
    }
}
