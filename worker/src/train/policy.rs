//! The session's learning-rate policies, built from a job's `LrSchedule` in one match
//! ([`build`]): a fixed schedule (a function of the step, nothing to remember) or the
//! AutoLRS stage controller, whose actions (snapshot, candidate runs, restore, stage
//! steps, a closing evaluation) this adapter turns into the session's one-step
//! directives and whose reports it assembles from the losses the session observes.
//!
//! The adapter keeps the running candidate's partial curve in its own state, so a
//! checkpoint taken in the middle of a candidate's τ' steps resumes that candidate where
//! it stopped (the controller alone would run it again from the stage snapshot).

use serde::{Deserialize, Serialize};
use tessera_api::train::{LrSchedule, LrStageRecord, StepPhase};

use super::lr::{Action, AutoLrs, AutoLrsConfig, Measure, Report, Schedule};
use super::session::{Directive, LrPolicy};

/// A fixed schedule: the LR of step `n` (0-based) is `schedule.lr(n)`.
pub struct Fixed(pub Schedule);

impl LrPolicy for Fixed {
    fn next(&mut self, step: u64) -> Result<Directive, String> {
        Ok(Directive::Train { lr: self.0.lr(step) })
    }

    fn observe_train_loss(&mut self, _loss: f64) -> Result<(), String> {
        Ok(())
    }

    fn observe_val_loss(&mut self, _loss: f64) -> Result<(), String> {
        Ok(())
    }

    fn take_stage_updates(&mut self) -> Vec<LrStageRecord> {
        Vec::new()
    }

    fn state(&self) -> serde_json::Value {
        serde_json::Value::Null
    }

    fn restore(&mut self, _state: serde_json::Value) -> Result<(), String> {
        Ok(())
    }
}

/// Where the adapter is within the controller's current action.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
struct Progress {
    /// A snapshot or restore was directed; the controller hears of it on the next call.
    awaiting_ack: bool,
    /// Steps of the current candidate done.
    steps: u64,
    /// The current candidate's curve so far.
    curve: Vec<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct AutoLrsState {
    tuner: AutoLrs,
    progress: Progress,
}

pub struct AutoLrsPolicy {
    state: AutoLrsState,
    /// Stage records already handed out (not checkpointed: re-sending one is harmless).
    sent: Vec<LrStageRecord>,
}

impl AutoLrsPolicy {
    pub fn new(tuner: AutoLrs) -> AutoLrsPolicy {
        AutoLrsPolicy { state: AutoLrsState { tuner, progress: Progress::default() }, sent: Vec::new() }
    }

    fn report(&mut self, report: Report) -> Result<(), String> {
        self.state.tuner.report(report).map_err(|e| e.to_string())?;
        self.state.progress = Progress::default();
        Ok(())
    }

    /// Tells the controller of the snapshot or restore the session did since the last call.
    fn acknowledge(&mut self) -> Result<(), String> {
        if self.state.progress.awaiting_ack {
            let report = match self.state.tuner.action() {
                Action::Snapshot => Report::SnapshotTaken,
                Action::Restore => Report::Restored,
                other => return Err(format!("AutoLRS moved on to {other:?} before its snapshot or restore was done")),
            };
            self.report(report)?;
        }
        Ok(())
    }
}

impl LrPolicy for AutoLrsPolicy {
    fn next(&mut self, _step: u64) -> Result<Directive, String> {
        self.acknowledge()?;
        let progress = &mut self.state.progress;
        Ok(match self.state.tuner.action() {
            Action::Snapshot => {
                progress.awaiting_ack = true;
                Directive::Snapshot
            }
            Action::Restore => {
                progress.awaiting_ack = true;
                Directive::Restore
            }
            Action::Evaluate => Directive::Evaluate,
            // In the validation phase a candidate's curve is its validation loss every
            // `every` steps.
            Action::TrainCandidate { measure: Measure::ValidationLoss { every }, .. }
                if progress.steps > 0
                    && progress.steps % every == 0
                    && (progress.curve.len() as u64) < progress.steps / every =>
            {
                Directive::Evaluate
            }
            Action::TrainCandidate { lr, .. } | Action::TrainStage { lr, .. } => Directive::Train { lr },
        })
    }

    fn observe_train_loss(&mut self, loss: f64) -> Result<(), String> {
        match self.state.tuner.action() {
            Action::TrainCandidate { steps, measure, .. } => {
                let progress = &mut self.state.progress;
                progress.steps += 1;
                let done = match measure {
                    Measure::TrainingLoss => {
                        progress.curve.push(loss);
                        progress.steps == steps
                    }
                    // Where `every` does not divide τ' the curve's last point came before
                    // the candidate's last step (the points stay evenly spaced). A candidate
                    // resumed past τ' (checkpointed by a worker before this rule) ends too,
                    // on its first τ'/every points.
                    Measure::ValidationLoss { every } => {
                        let points = (steps / every) as usize;
                        let done = progress.steps >= steps && progress.curve.len() >= points;
                        if done {
                            progress.curve.truncate(points);
                        }
                        done
                    }
                };
                if done {
                    let curve = std::mem::take(&mut progress.curve);
                    self.report(Report::CandidateTrained { curve })?;
                }
                Ok(())
            }
            Action::TrainStage { .. } => self.report(Report::StageTrained { steps: 1, loss }),
            other => Err(format!("a training step was taken while AutoLRS asked for {other:?}")),
        }
    }

    fn observe_val_loss(&mut self, loss: f64) -> Result<(), String> {
        if self.state.tuner.action() == Action::Evaluate {
            return self.report(Report::Evaluated { loss });
        }
        let Action::TrainCandidate { steps, measure: Measure::ValidationLoss { every }, .. } =
            self.state.tuner.action()
        else {
            return Ok(());
        };
        let progress = &mut self.state.progress;
        progress.curve.push(loss);
        if progress.curve.len() as u64 == steps / every && progress.steps == steps {
            let curve = std::mem::take(&mut progress.curve);
            self.report(Report::CandidateTrained { curve })?;
        }
        Ok(())
    }

    fn take_stage_updates(&mut self) -> Vec<LrStageRecord> {
        let stages = self.state.tuner.stages();
        let changed: Vec<LrStageRecord> = stages
            .iter()
            .enumerate()
            .filter(|(i, record)| self.sent.get(*i) != Some(record))
            .map(|(_, r)| r.clone())
            .collect();
        self.sent = stages.to_vec();
        changed
    }

    fn state(&self) -> serde_json::Value {
        serde_json::to_value(&self.state).expect("AutoLRS state serialises")
    }

    fn restore(&mut self, state: serde_json::Value) -> Result<(), String> {
        self.state = serde_json::from_value(state).map_err(|e| e.to_string())?;
        Ok(())
    }

    fn finish(&mut self, val_loss: f64) -> Result<bool, String> {
        self.acknowledge()?;
        Ok(self.state.tuner.finish(val_loss).is_some())
    }

    /// A candidate that blows up scores 1e6; an exploitation that does is restored.
    fn recovers_from_divergence(&self) -> bool {
        matches!(self.state.tuner.action(), Action::TrainCandidate { .. } | Action::TrainStage { .. })
    }

    fn phase(&self) -> Option<StepPhase> {
        self.state.tuner.action().phase()
    }
}

/// The policy a job's `lr_schedule` asks for, for a run of `max_steps`; `spec` must have
/// passed `LrSchedule::validate`.
pub fn build(spec: &LrSchedule, max_steps: u64, seed: u64) -> Box<dyn LrPolicy> {
    let fixed = |schedule: Schedule| -> Box<dyn LrPolicy> { Box::new(Fixed(schedule)) };
    match *spec {
        LrSchedule::Constant { lr } => fixed(Schedule::Constant { lr }),
        LrSchedule::Step { lr, step_size, gamma } => fixed(Schedule::Step { lr, step_size, gamma }),
        LrSchedule::Linear { lr, warmup_steps } => fixed(Schedule::Linear { lr, warmup_steps, total_steps: max_steps }),
        LrSchedule::Cosine { lr, warmup_steps, min_lr } => {
            fixed(Schedule::Cosine { lr, min_lr, warmup_steps, total_steps: max_steps })
        }
        LrSchedule::Onecycle { max_lr, pct_start, div_factor, final_div_factor } => {
            fixed(Schedule::OneCycle { max_lr, pct_start, div_factor, final_div_factor, total_steps: max_steps })
        }
        LrSchedule::Autolrs { min_lr, max_lr, tau_prime, tau, k, tau_max } => {
            let config = AutoLrsConfig { min_lr, max_lr, tau_prime, tau, k, tau_max };
            Box::new(AutoLrsPolicy::new(AutoLrs::new(config, seed).with_budget(max_steps)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// In the validation phase a candidate's curve is its validation loss every
    /// `every` = τ'/16 steps; where that does not divide τ' (100 / 6) the candidate still
    /// ends after its τ' steps, with its 16 evenly spaced points.
    #[test]
    fn a_validation_candidate_ends_after_its_steps_where_every_does_not_divide_them() {
        let config = AutoLrsConfig { min_lr: 1e-3, max_lr: 1e-1, tau_prime: 100, tau: 1000, k: 2, tau_max: 1000 };
        let mut policy = AutoLrsPolicy::new(AutoLrs::new(config, 1));
        // Steps and evaluations since the last snapshot, of the second stage's (the
        // validation phase's) first candidate once its snapshot was taken.
        let (mut snapshots, mut trained, mut evaluated) = (0, 0, 0);
        let mut loss = 2.0;
        for step in 0..5000 {
            loss *= 0.999;
            match policy.next(step).unwrap() {
                Directive::Train { .. } => {
                    trained += 1;
                    policy.observe_train_loss(loss).unwrap();
                }
                Directive::Evaluate => {
                    evaluated += 1;
                    policy.observe_val_loss(loss).unwrap();
                }
                Directive::Snapshot => (snapshots, trained, evaluated) = (snapshots + 1, 0, 0),
                Directive::Restore if snapshots == 2 => {
                    assert_eq!((trained, evaluated), (100, 16));
                    return;
                }
                Directive::Restore => {}
            }
        }
        panic!("the validation phase's first candidate never ended: {trained} steps, {evaluated} evaluations");
    }
}
