//! The fixed learning-rate schedules: a pure function from the step (0-based) to the LR.
//! Their wire form and checks are `tessera_api::train::LrSchedule` (turned into one of
//! these by `train::policy::build`); the run's length (`max_steps`) completes the
//! linear, cosine and one-cycle shapes.

use serde::{Deserialize, Serialize};
use std::f64::consts::PI;

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Schedule {
    Constant {
        lr: f64,
    },
    /// `lr · gamma^⌊step / step_size⌋` (PyTorch's `StepLR`).
    Step {
        lr: f64,
        step_size: u64,
        gamma: f64,
    },
    /// Linear warm-up reaching `lr` at the last warm-up step, then a straight line from
    /// `lr` at step `warmup_steps` down to 0 at step `total_steps` (Hugging Face's
    /// `get_linear_schedule_with_warmup`; the last step, `total − 1`, trains at
    /// `lr / (total − warmup)`).
    Linear {
        lr: f64,
        warmup_steps: u64,
        total_steps: u64,
    },
    /// Linear warm-up reaching `lr` at the last warm-up step, then a half cosine from
    /// `lr` at step `warmup_steps` down to `min_lr` at the last step.
    Cosine {
        lr: f64,
        min_lr: f64,
        warmup_steps: u64,
        total_steps: u64,
    },
    /// PyTorch's `OneCycleLR` with its defaults' shape (two phases, cosine annealing):
    /// from `max_lr/div_factor` up to `max_lr` at step `pct_start·total − 1`, then down
    /// to `max_lr/(div_factor·final_div_factor)` at step `total − 1`. (PyTorch also
    /// cycles momentum; that belongs to the optimizer, not here.)
    OneCycle {
        max_lr: f64,
        pct_start: f64,
        div_factor: f64,
        final_div_factor: f64,
        total_steps: u64,
    },
}

impl Schedule {
    pub fn lr(&self, step: u64) -> f64 {
        match *self {
            Schedule::Constant { lr } => lr,
            Schedule::Step {
                lr,
                step_size,
                gamma,
            } => lr * gamma.powf((step / step_size.max(1)) as f64),
            Schedule::Linear {
                lr,
                warmup_steps,
                total_steps,
            } => {
                if step < warmup_steps {
                    return lr * (step + 1) as f64 / warmup_steps as f64;
                }
                let span = total_steps.saturating_sub(warmup_steps).max(1) as f64;
                lr * (1.0 - (step - warmup_steps) as f64 / span).max(0.0)
            }
            Schedule::Cosine {
                lr,
                min_lr,
                warmup_steps,
                total_steps,
            } => {
                if step < warmup_steps {
                    return lr * (step + 1) as f64 / warmup_steps as f64;
                }
                let span = total_steps.saturating_sub(warmup_steps + 1).max(1) as f64;
                let progress = ((step - warmup_steps) as f64 / span).min(1.0);
                cosine_anneal(lr, min_lr, progress)
            }
            Schedule::OneCycle {
                max_lr,
                pct_start,
                div_factor,
                final_div_factor,
                total_steps,
            } => {
                let initial = max_lr / div_factor;
                let last = initial / final_div_factor;
                let peak_step = pct_start * total_steps as f64 - 1.0;
                let end_step = total_steps as f64 - 1.0;
                let step = step as f64;
                // A run too short for a rising phase starts at the peak.
                if step <= peak_step && peak_step > 0.0 {
                    cosine_anneal(initial, max_lr, step / peak_step)
                } else {
                    cosine_anneal(
                        max_lr,
                        last,
                        ((step - peak_step) / (end_step - peak_step)).min(1.0),
                    )
                }
            }
        }
    }
}

/// From `start` at `progress = 0` to `end` at `progress = 1` along a half cosine.
fn cosine_anneal(start: f64, end: f64, progress: f64) -> f64 {
    end + (start - end) / 2.0 * ((PI * progress).cos() + 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * b.abs().max(1e-12)
    }

    #[test]
    fn step_decays_by_gamma_every_step_size() {
        let s = Schedule::Step {
            lr: 0.1,
            step_size: 10,
            gamma: 0.5,
        };
        assert!(close(s.lr(0), 0.1) && close(s.lr(9), 0.1));
        assert!(close(s.lr(10), 0.05) && close(s.lr(25), 0.025));
        assert_eq!(Schedule::Constant { lr: 0.3 }.lr(12345), 0.3);
    }

    #[test]
    fn cosine_warms_up_then_decays_to_min_lr() {
        let s = Schedule::Cosine {
            lr: 1.0,
            min_lr: 0.1,
            warmup_steps: 10,
            total_steps: 111,
        };
        assert!(close(s.lr(0), 0.1) && close(s.lr(4), 0.5) && close(s.lr(9), 1.0));
        assert!(close(s.lr(10), 1.0));
        assert!(close(s.lr(60), 0.55), "{}", s.lr(60));
        assert!(close(s.lr(110), 0.1) && close(s.lr(500), 0.1));
        let no_warmup = Schedule::Cosine {
            lr: 1.0,
            min_lr: 0.0,
            warmup_steps: 0,
            total_steps: 3,
        };
        assert!(close(no_warmup.lr(0), 1.0) && close(no_warmup.lr(2), 0.0));
    }

    #[test]
    fn one_cycle_matches_pytorch_defaults() {
        let s = Schedule::OneCycle {
            max_lr: 1.0,
            pct_start: 0.3,
            div_factor: 25.0,
            final_div_factor: 1e4,
            total_steps: 100,
        };
        // OneCycleLR(max_lr=1, total_steps=100): 0.04 at step 0, peak at step 29,
        // halfway down at step 64, 0.04/1e4 at step 99.
        assert!(close(s.lr(0), 0.04));
        assert!(close(s.lr(29), 1.0));
        assert!(close(s.lr(64), 0.5 + 0.5 * 4e-6), "{}", s.lr(64));
        assert!(close(s.lr(99), 4e-6));
        let rising = (0..29).all(|t| s.lr(t) < s.lr(t + 1));
        let falling = (29..99).all(|t| s.lr(t) > s.lr(t + 1));
        assert!(rising && falling);
    }

    #[test]
    fn linear_warms_up_then_falls_to_zero_at_the_end() {
        let s = Schedule::Linear {
            lr: 1.0,
            warmup_steps: 10,
            total_steps: 110,
        };
        assert!(close(s.lr(0), 0.1) && close(s.lr(9), 1.0) && close(s.lr(10), 1.0));
        assert!(close(s.lr(60), 0.5) && close(s.lr(109), 0.01));
        assert_eq!(s.lr(110), 0.0);
        assert_eq!(s.lr(500), 0.0);
    }
}
