//! A training session: the loop that runs a trainer for `max_steps` optimizer steps as a
//! learning-rate policy directs it, evaluating every `eval_every` steps and checkpointing
//! every `checkpoint_every` steps and at the end. It does no I/O: what happens goes out
//! as [`Event`]s, so the worker job streams them to the server and the benchmark and the
//! tests just collect them.
//!
//! Every optimizer step counts, AutoLRS search steps included: the step number only ever
//! grows, and a restored stage snapshot rewinds the model, never the step count. A run
//! whose budget ends inside a search, or on a diverged exploitation, ends on the stage
//! snapshot (the last model it kept), never on a candidate's or a diverged model.
//!
//! Preemption: once its preemption flag is set (a data-parallel gang: once any rank's is,
//! agreed in the step's all-reduce), the session checkpoints after the step it is on,
//! whatever `checkpoint_every` says, and stops with [`SessionError::Preempted`]. That
//! checkpoint holds everything the next steps depend on (weights, optimizer moments and
//! step count, loader position and RNG, the LR policy's state, an AutoLRS stage's
//! snapshot), so a run resumed from it takes exactly the steps the uninterrupted run took.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use candle_core::Device;
use tessera_api::parallel::RankStep;
use tessera_api::precision::PrecisionPlanReport;
use tessera_api::train::{LrStageRecord, MetricRow, StepPhase};

use super::checkpoint::{self, CheckpointError, CheckpointFiles, Restored};
use super::hybrid::{Planner, PlanningError};
use super::trainer::{Evaluation, Snapshot, Trainer};

/// What the loop does next.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Directive {
    /// One optimizer step at this learning rate; the policy is then told its loss.
    Train { lr: f64 },
    /// Keep the trainable state as the current stage's starting point.
    Snapshot,
    /// Return to the stage's starting point (step count unchanged).
    Restore,
    /// Evaluate on the validation split; the policy is then told the loss.
    Evaluate,
}

/// A learning-rate policy: a fixed schedule, or a tuner that searches as it goes.
pub trait LrPolicy: Send {
    /// What to do before optimizer step `step + 1` (`step` steps are done).
    fn next(&mut self, step: u64) -> Result<Directive, String>;
    fn observe_train_loss(&mut self, loss: f64) -> Result<(), String>;
    fn observe_val_loss(&mut self, loss: f64) -> Result<(), String>;
    /// Stage records created or changed since the last call.
    fn take_stage_updates(&mut self) -> Vec<LrStageRecord>;
    /// Everything needed to continue exactly from here, for a checkpoint.
    fn state(&self) -> serde_json::Value;
    fn restore(&mut self, state: serde_json::Value) -> Result<(), String>;
    /// Whether a loss that blows up at the current step is the policy's to handle (AutoLRS
    /// scores a candidate 1e6 and restores a diverged exploitation's snapshot), not the
    /// end of the run.
    fn recovers_from_divergence(&self) -> bool {
        false
    }
    /// The budget is spent and the model in hand evaluates to `val_loss`: whether the run
    /// must end on the stage snapshot instead (a tuner's search candidate, or a diverged
    /// exploitation), the policy's stage record saying why. Only a policy that takes
    /// snapshots asks for it.
    fn finish(&mut self, _val_loss: f64) -> Result<bool, String> {
        Ok(false)
    }
    /// What the current step is spent on, recorded with its metrics (AutoLRS only).
    fn phase(&self) -> Option<StepPhase> {
        None
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_steps: u64,
    pub eval_every: u64,
    pub checkpoint_every: u64,
}

#[derive(Debug)]
pub enum Event {
    Step(MetricRow),
    Eval(MetricRow),
    Stage(LrStageRecord),
    Checkpoint(CheckpointFiles),
    /// A data-parallel replica's timing of the step just taken.
    RankStep(RankStep),
    /// The gang's precision plan (rank 0): once made, and at the end with the step time
    /// measured under it.
    PrecisionPlan(PrecisionPlanReport),
}

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("training failed: {0}")]
    Tensor(#[from] candle_core::Error),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("the loss became {loss} at step {step}; lower the learning rate")]
    Diverged { step: u64, loss: f64 },
    #[error("the LR policy's checkpointed state does not fit: {0}")]
    PolicyState(String),
    #[error("the LR policy failed: {0}")]
    Policy(String),
    #[error("the LR policy asked to restore before any snapshot")]
    NoSnapshot,
    #[error(transparent)]
    Planning(#[from] PlanningError),
    #[error("cancelled")]
    Cancelled,
    /// Not a failure: asked to preempt, the run checkpointed at `step` and stopped.
    #[error("preempted: checkpointed at step {step} and stopped")]
    Preempted { step: u64 },
}

pub struct Session {
    trainer: Trainer,
    policy: Box<dyn LrPolicy>,
    limits: Limits,
    step: u64,
    stage: Option<Snapshot>,
    planner: Option<Planner>,
    /// Set from outside to preempt the run (see the module comment).
    preempt: Arc<AtomicBool>,
}

/// A metric row of the finite values among `values`: JSON has no NaN, so a value of a
/// diverged model (AutoLRS recovers from a candidate's divergence) is left out of the row
/// rather than failing the whole report.
fn row(step: u64, phase: Option<StepPhase>, values: impl IntoIterator<Item = (&'static str, f64)>) -> MetricRow {
    let values = values.into_iter().filter(|(_, v)| v.is_finite()).map(|(k, v)| (k.to_string(), v));
    MetricRow { step, phase, values: values.collect::<BTreeMap<_, _>>() }
}

/// An evaluation's row; `phase` says which model it measured (a search candidate's or
/// the exploited one) under AutoLRS.
pub fn eval_row(step: u64, phase: Option<StepPhase>, evaluation: &Evaluation) -> MetricRow {
    let mut values = vec![("val_loss", evaluation.val_loss)];
    values.extend(evaluation.accuracy.map(|a| ("accuracy", a)));
    values.extend(evaluation.rmse.map(|r| ("rmse", r)));
    row(step, phase, values)
}

impl Session {
    pub fn new(trainer: Trainer, policy: Box<dyn LrPolicy>, limits: Limits) -> Session {
        Session { trainer, policy, limits, step: 0, stage: None, planner: None, preempt: Arc::default() }
    }

    /// The same session planning per-operator precision after its first steps (a
    /// data-parallel rank whose job asks for it).
    pub fn with_planner(self, planner: Planner) -> Session {
        Session { planner: Some(planner), ..self }
    }

    /// The session with `flag` as its preemption flag.
    pub fn with_preemption(self, flag: Arc<AtomicBool>) -> Session {
        Session { preempt: flag, ..self }
    }

    /// The same session with its trainer changed (a data-parallel rank's gradient sync
    /// is attached after the checkpoint has been restored).
    pub fn with_trainer(session: Session, change: impl FnOnce(Trainer) -> Trainer) -> Session {
        Session { trainer: change(session.trainer), ..session }
    }

    pub fn step(&self) -> u64 {
        self.step
    }

    pub fn trainer(&self) -> &Trainer {
        &self.trainer
    }

    fn parameter_names(&self) -> Vec<String> {
        self.trainer.network().parameters().iter().map(|(n, _)| n.clone()).collect()
    }

    pub fn checkpoint(&self) -> Result<CheckpointFiles, SessionError> {
        let current = self.trainer.snapshot()?;
        let moment_names = self.trainer.optimizer().names();
        Ok(checkpoint::encode(
            self.step,
            &self.parameter_names(),
            &moment_names,
            &current,
            self.stage.as_ref(),
            self.policy.state(),
        )?)
    }

    /// Continues from checkpoint files (by name) instead of the start.
    pub fn resume(
        &mut self,
        files: &std::collections::HashMap<String, Vec<u8>>,
        device: &Device,
    ) -> Result<(), SessionError> {
        let moment_names = self.trainer.optimizer().names();
        let Restored { step, current, stage, lr_policy } =
            checkpoint::decode(files, &self.parameter_names(), &moment_names, device)?;
        self.trainer.restore(&current)?;
        self.policy.restore(lr_policy).map_err(SessionError::PolicyState)?;
        self.stage = stage;
        self.step = step;
        Ok(())
    }

    fn evaluate(&mut self, phase: Option<StepPhase>, emit: &mut dyn FnMut(Event)) -> Result<Evaluation, SessionError> {
        let evaluation = self.trainer.evaluate()?;
        emit(Event::Eval(eval_row(self.step, phase, &evaluation)));
        Ok(evaluation)
    }

    /// Runs to `max_steps` (or until `cancel` is set); returns the final evaluation.
    pub fn run(&mut self, cancel: &AtomicBool, emit: &mut dyn FnMut(Event)) -> Result<Evaluation, SessionError> {
        let mut last_eval: Option<(u64, Evaluation)> = None;
        while self.step < self.limits.max_steps {
            if cancel.load(Ordering::Relaxed) {
                return Err(SessionError::Cancelled);
            }
            let directive = self.policy.next(self.step).map_err(SessionError::Policy)?;
            // Asked before the policy hears of the step, which may end the phase.
            let phase = self.policy.phase();
            match directive {
                Directive::Snapshot => self.stage = Some(self.trainer.snapshot()?),
                Directive::Restore => {
                    let stage = self.stage.as_ref().ok_or(SessionError::NoSnapshot)?;
                    self.trainer.restore(stage)?;
                }
                Directive::Evaluate => {
                    let evaluation = self.evaluate(phase, emit)?;
                    self.policy.observe_val_loss(evaluation.val_loss).map_err(SessionError::Policy)?;
                    last_eval = Some((self.step, evaluation));
                }
                Directive::Train { lr } => {
                    let started = Instant::now();
                    let loss = self.trainer.step(lr)?;
                    self.step += 1;
                    if !loss.is_finite() && !self.policy.recovers_from_divergence() {
                        return Err(SessionError::Diverged { step: self.step, loss });
                    }
                    let elapsed = started.elapsed();
                    let throughput = self.trainer.batch_size() as f64 / elapsed.as_secs_f64().max(1e-9);
                    emit(Event::Step(row(self.step, phase, [("loss", loss), ("lr", lr), ("throughput", throughput)])));
                    if let Some(timing) = self.trainer.last_timing() {
                        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
                        emit(Event::RankStep(RankStep {
                            rank: self.trainer.share().rank as u32,
                            step: self.step,
                            iter_ms: ms(elapsed),
                            wait_ms: ms(timing.wait),
                            allreduce_ms: ms(timing.reduce),
                            predicted_ms: self.planner.as_ref().and_then(Planner::predicted_ms),
                        }));
                    }
                    // Every rank plans at the same step, between two steps.
                    if let Some(planner) = &mut self.planner {
                        let (step, max_steps) = (self.step, self.limits.max_steps);
                        if let Some(report) = planner.after_step(&mut self.trainer, step, max_steps, elapsed)? {
                            emit(Event::PrecisionPlan(report));
                        }
                    }
                    self.policy.observe_train_loss(loss).map_err(SessionError::Policy)?;
                    for record in self.policy.take_stage_updates() {
                        emit(Event::Stage(record));
                    }
                    let last = self.step == self.limits.max_steps;
                    if self.step % self.limits.eval_every == 0 || last {
                        last_eval = Some((self.step, self.evaluate(phase, emit)?));
                    }
                    // In a gang the ranks hold the same state; the leader writes it.
                    let checkpoint = self.step % self.limits.checkpoint_every == 0 || last;
                    if checkpoint && self.trainer.share().is_leader() {
                        emit(Event::Checkpoint(self.checkpoint()?));
                    }
                    // The last step ends the run anyway; a preemption then has nothing to save.
                    if !last && self.trainer.agreed_stop(self.preempt.load(Ordering::Relaxed)) {
                        if !checkpoint && self.trainer.share().is_leader() {
                            emit(Event::Checkpoint(self.checkpoint()?));
                        }
                        return Err(SessionError::Preempted { step: self.step });
                    }
                }
            }
        }
        let evaluation = match last_eval {
            Some((step, evaluation)) if step == self.step => evaluation,
            _ => self.evaluate(self.policy.phase(), emit)?,
        };
        if let Some(report) = self.planner.as_ref().and_then(Planner::finish) {
            emit(Event::PrecisionPlan(report));
        }
        self.end_on_a_kept_model(evaluation, emit)
    }

    /// The run never ends on a model its policy would not keep: where the policy says so,
    /// the stage snapshot goes back, is evaluated (the row replaces the last one at this
    /// step, tagged `exploit`: a kept model) and checkpointed.
    fn end_on_a_kept_model(
        &mut self,
        evaluation: Evaluation,
        emit: &mut dyn FnMut(Event),
    ) -> Result<Evaluation, SessionError> {
        let restore = self.policy.finish(evaluation.val_loss).map_err(SessionError::Policy)?;
        let evaluation = match &self.stage {
            Some(stage) if restore => {
                self.trainer.restore(stage)?;
                let phase = self.policy.phase().map(|_| StepPhase::Exploit);
                let evaluation = self.evaluate(phase, emit)?;
                emit(Event::Checkpoint(self.checkpoint()?));
                evaluation
            }
            _ => evaluation,
        };
        for record in self.policy.take_stage_updates() {
            emit(Event::Stage(record));
        }
        Ok(evaluation)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tessera_api::train::LrSchedule;

    use super::*;
    use crate::train::data::{prepare, Table, TaskColumns, TaskKind};
    use crate::train::model::mlp::Mlp;
    use crate::train::optim::OptimizerKind;
    use crate::train::policy;

    fn trainer() -> Trainer {
        let mut csv = String::from("x1,x2,y\n");
        for i in 0..64 {
            let (a, b) = ((i % 8) as f64 / 8.0, (i / 8) as f64 / 8.0);
            csv += &format!("{a},{b},{}\n", 2.0 * a - b);
        }
        let task = TaskColumns {
            kind: TaskKind::Regression,
            label: "y".into(),
            features: None,
            text: None,
            validation_split: 0.25,
        };
        let data = Arc::new(prepare(&Table::parse(csv.as_bytes()).unwrap(), &task, 1).unwrap());
        let sgd = OptimizerKind::Sgd { momentum: 0.9, nesterov: false, weight_decay: 0.0 };
        let mlp = Mlp::new(data.input_dim(), &[8], 1, 1, &Device::Cpu).unwrap();
        Trainer::new(Box::new(mlp), sgd, data, TaskKind::Regression, 8, 1, Device::Cpu).unwrap()
    }

    fn run(schedule: &LrSchedule, max_steps: u64) -> (Evaluation, Vec<Event>) {
        let limits = Limits { max_steps, eval_every: 5, checkpoint_every: u64::MAX };
        let mut session = Session::new(trainer(), policy::build(schedule, max_steps, 1), limits);
        let mut events = Vec::new();
        let evaluation = session.run(&AtomicBool::new(false), &mut |e| events.push(e)).unwrap();
        (evaluation, events)
    }

    /// Every LR of the range blows the model up within a few steps, and the budget ends
    /// in the first stage's search: the run ends on the model it started from, not on
    /// the candidate it was training.
    #[test]
    fn a_budget_that_ends_inside_a_search_ends_on_the_stage_snapshot() {
        let start = trainer().evaluate().unwrap();
        let schedule = LrSchedule::Autolrs { min_lr: 1e3, max_lr: 1e4, tau_prime: 10, tau: 100, k: 10, tau_max: 800 };
        let (evaluation, events) = run(&schedule, 25);
        assert!(evaluation.val_loss.is_finite(), "{evaluation:?}");
        assert_eq!(evaluation, start);
        // The last evaluation row measured the kept model.
        let last = events
            .iter()
            .rev()
            .find_map(|e| match e {
                Event::Eval(row) => Some(row),
                _ => None,
            })
            .unwrap();
        assert_eq!((last.step, last.phase), (25, Some(StepPhase::Exploit)));
        assert_eq!(last.values["val_loss"], start.val_loss);
        // The stage's record says why, with the two candidates that finished.
        let record = events
            .iter()
            .rev()
            .find_map(|e| match e {
                Event::Stage(record) => Some(record),
                _ => None,
            })
            .expect("a stage record");
        let why = record.run_end.as_deref().expect("run_end is set");
        assert!(why.contains("candidate 3 of 10") && why.contains("snapshot"), "{why}");
        assert_eq!(record.candidates.len(), 2);
        assert_eq!(record.observed_loss_after_tau, None);
    }

    #[test]
    fn a_diverged_model_s_evaluation_is_recorded_without_its_non_finite_values() {
        let diverged = Evaluation { val_loss: f64::NAN, accuracy: Some(0.1), rmse: Some(f64::INFINITY) };
        let row = eval_row(7, Some(StepPhase::Search), &diverged);
        assert_eq!(row.values.into_iter().collect::<Vec<_>>(), [("accuracy".to_string(), 0.1)]);
    }

    #[test]
    fn a_fixed_schedule_ends_on_its_last_model() {
        let (evaluation, events) = run(&LrSchedule::Constant { lr: 0.05 }, 20);
        assert!(evaluation.val_loss < trainer().evaluate().unwrap().val_loss);
        assert!(!events.iter().any(|e| matches!(e, Event::Stage(_))));
    }
}
