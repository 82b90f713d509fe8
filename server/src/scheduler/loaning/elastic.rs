//! Growing elastic training jobs onto spare slices: Aryl's multiple-choice knapsack (Li et
//! al., arXiv 2202.07896, elastic scaling; research note §3) with each option valued as the
//! job's expected JCT reduction from its measured step time per rank count.
//!
//! Departures:
//! - DeepBoot's reimplementation values k extra workers as `T · k / (k + min + 1)` (linear
//!   scaling assumed); here the value is `T(base) − T(base + k)` from the job's own step
//!   times ([`StepTimes`]), so a job that scales badly is worth less. Rank counts it never
//!   ran at (all of them for a new job) are valued by [`StepTimes`]' Amdahl prior, so a job
//!   grows before anyone measured it there, and its measurements correct the prior.
//! - A job already running at a rank count other than `base + k` pays the resize pause in
//!   that option's value (the ranks stop, checkpoint and re-form), which keeps the answer
//!   from moving extra ranks between jobs for a negligible gain every round.

use super::knapsack::{solve, Item};
use super::step_times::StepTimes;

/// An elastic job asking for extra ranks above its base this round.
#[derive(Debug, Clone, Copy)]
pub struct Candidate<'a> {
    /// Ranks it holds without the knapsack (its minimum, already placed).
    pub base: u32,
    pub max: u32,
    /// Ranks it runs at before this round; `None` when it starts this round or was just
    /// resized anyway (no extra pause to charge).
    pub current: Option<u32>,
    pub remaining_steps: f64,
    pub step_secs: &'a StepTimes,
}

/// Expected JCT reduction in seconds of running `c` at `base + extra` ranks instead of at
/// `base`, net of the resize pause when that differs from what it runs at now.
pub fn value(c: &Candidate, extra: u32, resize_pause_secs: f64) -> f64 {
    let ranks = c.base + extra;
    let saved = c.step_secs.remaining_secs(c.remaining_steps, c.base) - c.step_secs.remaining_secs(c.remaining_steps, ranks);
    let pause = match c.current {
        Some(now) if now != ranks => resize_pause_secs,
        _ => 0.0,
    };
    saved - pause
}

/// Extra ranks per candidate (same order) within `spare` slices, maximising the total
/// expected JCT reduction. Jobs without room above `base` get none.
pub fn grant(candidates: &[Candidate], spare: u32, resize_pause_secs: f64) -> Vec<u32> {
    let mut extras = vec![0u32; candidates.len()];
    let mut who = Vec::new();
    let mut classes = Vec::new();
    for (i, c) in candidates.iter().enumerate() {
        let room = c.max.saturating_sub(c.base).min(spare);
        if room == 0 {
            continue;
        }
        who.push(i);
        classes.push((0..=room).map(|k| Item { weight: k, value: value(c, k, resize_pause_secs) }).collect::<Vec<_>>());
    }
    // Every class holds a zero-weight item, so a selection always exists.
    let selection = solve(&classes, spare).expect("every class can take nothing");
    for (class, (&i, &k)) in who.iter().zip(&selection.chosen).enumerate() {
        extras[i] = classes[class][k].weight;
    }
    extras
}

#[cfg(test)]
mod tests {
    use super::*;

    fn amdahl(serial: f64, max: u32) -> StepTimes {
        StepTimes::new((1..=max).map(|r| (r, serial + (1.0 - serial) / r as f64)))
    }

    #[test]
    fn value_is_the_remaining_time_saved() {
        let s = StepTimes::new([(1, 1.0), (2, 0.5)]);
        let c = Candidate { base: 1, max: 2, current: None, remaining_steps: 100.0, step_secs: &s };
        assert!((value(&c, 1, 30.0) - 50.0).abs() < 1e-9);
        let running = Candidate { current: Some(1), ..c };
        assert!((value(&running, 1, 30.0) - 20.0).abs() < 1e-9);
        assert_eq!(value(&running, 0, 30.0), 0.0);
    }

    #[test]
    fn spare_slices_go_to_the_job_that_scales() {
        let good = amdahl(0.02, 8);
        let poor = amdahl(0.97, 8);
        let cands = [
            Candidate { base: 1, max: 8, current: None, remaining_steps: 1000.0, step_secs: &poor },
            Candidate { base: 1, max: 8, current: None, remaining_steps: 1000.0, step_secs: &good },
        ];
        let extras = grant(&cands, 4, 0.0);
        assert_eq!(extras, vec![0, 4]);
    }

    #[test]
    fn never_over_spare_and_never_past_max() {
        let s = amdahl(0.05, 16);
        let cands: Vec<Candidate> = (0..12)
            .map(|i| Candidate {
                base: 1 + i % 3,
                max: 2 + i % 7,
                current: (i % 2 == 0).then_some(1 + i % 3),
                remaining_steps: 100.0 * (i + 1) as f64,
                step_secs: &s,
            })
            .collect();
        for spare in 0..30 {
            let extras = grant(&cands, spare, 10.0);
            assert!(extras.iter().sum::<u32>() <= spare);
            for (c, e) in cands.iter().zip(&extras) {
                assert!(c.base + e <= c.max.max(c.base));
            }
        }
    }

    #[test]
    fn jobs_never_measured_at_more_ranks_are_grown_by_the_prior() {
        // A new job (nothing measured) and one measured only at its base of 2 ranks: the
        // prior values their extra ranks, so the spare slices go to them, up to their max.
        let new = StepTimes::new([]);
        let measured_at_base = StepTimes::new([(2, 0.5)]);
        let cands = [
            Candidate { base: 2, max: 3, current: None, remaining_steps: 10.0, step_secs: &new },
            Candidate { base: 2, max: 6, current: None, remaining_steps: 1000.0, step_secs: &measured_at_base },
        ];
        assert!(value(&cands[0], 1, 0.0) > 0.0);
        assert_eq!(grant(&cands, 5, 0.0), vec![1, 4]);
        // With too few spare slices for both, the longer job gains more from each.
        assert_eq!(grant(&cands, 2, 0.0), vec![0, 2]);
    }

    #[test]
    fn a_job_measured_to_scale_badly_is_not_grown_past_its_measurements() {
        // Slower at 4 than at 2: the fitted share is 1 and ranks above 4 are worth nothing.
        let s = StepTimes::new([(2, 0.5), (4, 0.6)]);
        let c = Candidate { base: 2, max: 8, current: None, remaining_steps: 1000.0, step_secs: &s };
        assert_eq!(grant(&[c], 6, 0.0), vec![0]);
    }

    #[test]
    fn resize_pause_keeps_a_small_gain_from_moving_ranks() {
        let s = amdahl(0.1, 4);
        // Running at 1 rank with little work left: growing saves less than the pause.
        let c = Candidate { base: 1, max: 4, current: Some(1), remaining_steps: 10.0, step_secs: &s };
        assert_eq!(grant(&[c], 3, 60.0), vec![0]);
    }
}
