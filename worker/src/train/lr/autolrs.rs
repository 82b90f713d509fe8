//! The AutoLRS stage controller (Jin et al., "AutoLRS: automatic learning-rate schedule
//! by Bayesian optimization on the fly", ICLR 2021; defaults and control flow from the
//! authors' `autolrs_server.py`, note §2). A state machine the trainer drives: it says
//! what to do next ([`Action`]), the trainer does it and says what happened
//! ([`Report`]). It trains nothing itself, so it is tested with a toy loss landscape.
//!
//! One stage:
//!
//! 1. `Snapshot` — keep the model and optimizer state as the stage's starting point.
//! 2. `k` times: `TrainCandidate { lr, steps: τ' }` from that state, then `Restore`.
//!    The first LR is random, the rest come from the GP's lower confidence bound
//!    ([`super::bayesopt`]); each curve's forecast at `τ` ([`super::forecast`]) is told
//!    to the GP. A fresh GP every stage, as in the code.
//! 3. `TrainStage { lr: best, steps: τ }` from the snapshot, `best` being the candidate
//!    with the lowest forecast (the forecasts, not the GP's posterior).
//! 4. `τ'` and `τ` double while `2τ ≤ τ_max` (with the defaults 1000, 2000, 4000, 8000,
//!    the code's `τ' < τ_max/10` rule); after that, candidates report validation loss
//!    every `τ'/16` steps instead of per-step training loss, and the forecast's horizon
//!    is `τ/(τ'/16)` evaluations.
//!
//! Scoring, as the code does it: a curve with a NaN scores 1e6; in the validation phase
//! a curve whose maximum reaches the loss AutoLRS started from scores its last value
//! instead of the forecast. Departures: a curve too short to fit (under four points,
//! only possible with a tiny `τ'`) scores its observed loss; and the candidate's LR is
//! used from its first step (the code's `ckpt`/`restore` messages run one step at the
//! previous LR).
//!
//! Every step the controller hands out, search included, counts towards the run:
//! [`AutoLrs::steps`] is the number trained so far. The whole state serialises, so a
//! checkpoint between two actions, or inside a stage's exploitation steps, resumes
//! exactly; a checkpoint inside a candidate's τ' steps resumes by running that
//! candidate again from the snapshot.

use serde::{Deserialize, Serialize};
use tessera_api::train::{LrCandidate, LrSchedule, LrStageRecord};

use super::bayesopt::{self, LogRange, KAPPA};
use super::forecast::{forecast, ForecastError};
use super::gp::GpError;
use super::smoothing::CurveKind;
use crate::train::rng::Rng;

/// What AutoLRS tells the GP for a candidate whose loss was not a number.
pub const FAILED_SCORE: f64 = 1e6;
/// Validation losses per candidate in the validation phase (every τ'/16 steps).
const EVALS_PER_CANDIDATE: u64 = 16;
/// The training losses averaged into a candidate's observed loss (the code's
/// `current_loss`).
const OBSERVED_WINDOW: usize = 10;

/// The tuner's parameters; defaults live with the wire type.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AutoLrsConfig {
    pub min_lr: f64,
    pub max_lr: f64,
    pub tau_prime: u64,
    pub tau: u64,
    pub k: u32,
    pub tau_max: u64,
}

impl AutoLrsConfig {
    /// `None` unless the spec is `autolrs`.
    pub fn from_spec(spec: &LrSchedule) -> Option<AutoLrsConfig> {
        match *spec {
            LrSchedule::Autolrs {
                min_lr,
                max_lr,
                tau_prime,
                tau,
                k,
                tau_max,
            } => Some(AutoLrsConfig {
                min_lr,
                max_lr,
                tau_prime,
                tau,
                k,
                tau_max,
            }),
            _ => None,
        }
    }
}

/// Which curve a candidate reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Measure {
    /// The training loss of each of the `steps` steps.
    TrainingLoss,
    /// The validation loss after every `every` steps (`steps / every` values).
    ValidationLoss { every: u64 },
}

/// What the trainer does next.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Action {
    /// Keep the model and optimizer state as the stage's starting point.
    Snapshot,
    /// Train `steps` steps at `lr` (from the snapshot's state) and report the curve.
    TrainCandidate {
        index: u32,
        lr: f64,
        steps: u64,
        measure: Measure,
    },
    /// Put the snapshot's model and optimizer state back.
    Restore,
    /// Train at `lr`; `steps` are those left in the stage and may be reported in parts.
    TrainStage { lr: f64, steps: u64 },
}

impl Action {
    fn name(&self) -> &'static str {
        match self {
            Action::Snapshot => "a snapshot",
            Action::TrainCandidate { .. } => "a candidate's curve",
            Action::Restore => "a restore",
            Action::TrainStage { .. } => "stage steps",
        }
    }
}

/// What the trainer did.
#[derive(Debug, Clone, PartialEq)]
pub enum Report {
    SnapshotTaken,
    /// The candidate's curve, as its [`Measure`] asked.
    CandidateTrained {
        curve: Vec<f64>,
    },
    Restored,
    /// `steps` more exploitation steps are done; `loss` is the latest training loss.
    StageTrained {
        steps: u64,
        loss: f64,
    },
}

impl Report {
    fn name(&self) -> &'static str {
        match self {
            Report::SnapshotTaken => "a snapshot",
            Report::CandidateTrained { .. } => "a candidate's curve",
            Report::Restored => "a restore",
            Report::StageTrained { .. } => "stage steps",
        }
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AutoLrsError {
    #[error("AutoLRS expected {expected} but the trainer reported {got}")]
    OutOfOrder {
        expected: &'static str,
        got: &'static str,
    },
    #[error("a candidate reported an empty loss curve")]
    EmptyCurve,
    #[error("the LR search failed: {0}")]
    Search(#[from] GpError),
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "phase", rename_all = "snake_case")]
enum Phase {
    Snapshot,
    Candidate { unit: f64, lr: f64 },
    Restore,
    Stage { lr: f64, remaining: u64 },
}

/// One candidate of the current stage: where it sits in the GP's `[0, 1]`, and what the
/// GP was told.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Tried {
    unit: f64,
    score: f64,
    record: LrCandidate,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AutoLrs {
    config: AutoLrsConfig,
    seed: u64,
    stage: u32,
    tau_prime: u64,
    tau: u64,
    validation: bool,
    phase: Phase,
    tried: Vec<Tried>,
    steps: u64,
    stage_start: u64,
    /// The first training loss seen: the validation phase's guard compares with it.
    init_loss: Option<f64>,
    history: Vec<LrStageRecord>,
}

impl AutoLrs {
    pub fn new(config: AutoLrsConfig, seed: u64) -> AutoLrs {
        AutoLrs {
            config,
            seed,
            stage: 0,
            tau_prime: config.tau_prime,
            tau: config.tau,
            validation: false,
            phase: Phase::Snapshot,
            tried: Vec::new(),
            steps: 0,
            stage_start: 0,
            init_loss: None,
            history: Vec::new(),
        }
    }

    pub fn action(&self) -> Action {
        match self.phase {
            Phase::Snapshot => Action::Snapshot,
            Phase::Candidate { lr, .. } => Action::TrainCandidate {
                index: self.tried.len() as u32,
                lr,
                steps: self.tau_prime,
                measure: self.measure(),
            },
            Phase::Restore => Action::Restore,
            Phase::Stage { lr, remaining } => Action::TrainStage {
                lr,
                steps: remaining,
            },
        }
    }

    /// Takes the trainer's report of the current action and returns the next one. A
    /// report that does not answer the current action is refused and changes nothing.
    pub fn report(&mut self, report: Report) -> Result<Action, AutoLrsError> {
        match (self.phase, report) {
            (Phase::Snapshot, Report::SnapshotTaken) => {
                self.stage_start = self.steps;
                self.tried.clear();
                self.phase = self.next_candidate()?;
            }
            (Phase::Candidate { unit, lr }, Report::CandidateTrained { curve }) => {
                if curve.is_empty() {
                    return Err(AutoLrsError::EmptyCurve);
                }
                self.steps += self.tau_prime;
                let tried = self.score(unit, lr, &curve);
                self.tried.push(tried);
                self.phase = Phase::Restore;
            }
            (Phase::Restore, Report::Restored) => {
                self.phase = if self.tried.len() < self.config.k as usize {
                    self.next_candidate()?
                } else {
                    self.close_search()
                };
            }
            (Phase::Stage { lr, remaining }, Report::StageTrained { steps, loss }) => {
                let steps = steps.min(remaining);
                self.steps += steps;
                if steps < remaining {
                    self.phase = Phase::Stage {
                        lr,
                        remaining: remaining - steps,
                    };
                } else {
                    self.close_stage(loss);
                }
            }
            (_, report) => {
                return Err(AutoLrsError::OutOfOrder {
                    expected: self.action().name(),
                    got: report.name(),
                });
            }
        }
        Ok(self.action())
    }

    /// Steps trained so far, candidates' included.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Every stage whose search has ended, in order; the last one's
    /// `observed_loss_after_tau` stays empty while its exploitation steps run.
    pub fn stages(&self) -> &[LrStageRecord] {
        &self.history
    }

    /// The candidates tried so far in a stage whose search is still running.
    pub fn searching(&self) -> Vec<LrCandidate> {
        match self.phase {
            Phase::Stage { .. } | Phase::Snapshot => Vec::new(),
            Phase::Candidate { .. } | Phase::Restore => {
                self.tried.iter().map(|t| t.record.clone()).collect()
            }
        }
    }

    fn measure(&self) -> Measure {
        if self.validation {
            Measure::ValidationLoss {
                every: (self.tau_prime / EVALS_PER_CANDIDATE).max(1),
            }
        } else {
            Measure::TrainingLoss
        }
    }

    fn range(&self) -> LogRange {
        LogRange {
            min: self.config.min_lr,
            max: self.config.max_lr,
        }
    }

    /// Each proposal draws from its own generator, named by stage and candidate, so the
    /// state needs no RNG position and a restored controller proposes the same LRs.
    fn next_candidate(&self) -> Result<Phase, AutoLrsError> {
        let observed: Vec<(f64, f64)> = self.tried.iter().map(|t| (t.unit, t.score)).collect();
        let purpose = format!(
            "autolrs stage {} candidate {}",
            self.stage,
            self.tried.len()
        );
        let unit = bayesopt::propose(&observed, KAPPA, &mut Rng::derive(self.seed, &purpose))?;
        Ok(Phase::Candidate {
            unit,
            lr: self.range().from_unit(unit),
        })
    }

    fn score(&mut self, unit: f64, lr: f64, curve: &[f64]) -> Tried {
        let kind = match self.measure() {
            Measure::TrainingLoss => CurveKind::Training,
            Measure::ValidationLoss { .. } => CurveKind::Validation,
        };
        let (observed, horizon) = match self.measure() {
            Measure::TrainingLoss => {
                self.init_loss.get_or_insert(curve[0]);
                let window = &curve[curve.len().saturating_sub(OBSERVED_WINDOW)..];
                (
                    window.iter().sum::<f64>() / window.len() as f64,
                    self.tau as f64,
                )
            }
            Measure::ValidationLoss { every } => {
                (curve[curve.len() - 1], self.tau as f64 / every as f64)
            }
        };
        let diverged = self.validation
            && self
                .init_loss
                .is_some_and(|init| curve.iter().copied().fold(f64::MIN, f64::max) >= init);
        let forecast_loss = forecast(curve, kind, horizon).map(|f| f.loss);
        let score = match forecast_loss {
            Err(ForecastError::NonFinite) => FAILED_SCORE,
            Err(ForecastError::TooShort) => observed,
            Ok(_) if diverged => observed,
            Ok(loss) if loss.is_finite() => loss,
            Ok(_) => FAILED_SCORE,
        };
        let finite = |v: f64| Some(v).filter(|v| v.is_finite());
        Tried {
            unit,
            score,
            record: LrCandidate {
                lr,
                forecast_loss: forecast_loss.ok().and_then(finite),
                observed_loss: finite(observed),
            },
        }
    }

    fn close_search(&mut self) -> Phase {
        let best = self
            .tried
            .iter()
            .min_by(|a, b| a.score.total_cmp(&b.score))
            .expect("k ≥ 1 candidates were tried");
        let lr = best.record.lr;
        self.history.push(LrStageRecord {
            stage: self.stage,
            start_step: self.stage_start,
            tau_prime: self.tau_prime,
            tau: self.tau,
            metric: if self.validation {
                "val_loss"
            } else {
                "train_loss"
            }
            .to_string(),
            candidates: self.tried.iter().map(|t| t.record.clone()).collect(),
            chosen_lr: lr,
            observed_loss_after_tau: None,
        });
        Phase::Stage {
            lr,
            remaining: self.tau,
        }
    }

    fn close_stage(&mut self, loss: f64) {
        if let Some(record) = self.history.last_mut() {
            record.observed_loss_after_tau = Some(loss).filter(|l| l.is_finite());
        }
        self.stage += 1;
        if self.tau.saturating_mul(2) <= self.config.tau_max {
            self.tau_prime *= 2;
            self.tau *= 2;
        } else {
            self.validation = true;
        }
        self.phase = Phase::Snapshot;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A one-number "model" on a landscape whose best LR for a long run is 0.03: each
    /// step pulls the loss towards a floor that rises with |log10(lr/0.03)|, at a rate
    /// that grows with the LR. Every LR's curve bends visibly within τ' steps, so this
    /// tests the search; how the forecaster copes with a barely-bending curve is its own
    /// module's concern. Training losses carry noise; validation loss is the level itself.
    #[derive(Debug, Clone, PartialEq)]
    struct Toy {
        level: f64,
        noise: Rng,
    }

    impl Toy {
        fn new() -> Toy {
            Toy {
                level: 2.0,
                noise: Rng::new(99),
            }
        }

        fn step(&mut self, lr: f64) -> f64 {
            let floor = 0.1 + 0.3 * (lr / 0.03).log10().powi(2);
            let rate = (0.02 + 0.5 * lr).min(0.2);
            self.level = floor + (self.level - floor) * (-rate).exp();
            self.level + 0.01 * (self.noise.next_f64() - 0.5)
        }
    }

    /// Plays the trainer for `count` actions, exploitation steps in chunks of 300 (as a
    /// trainer reporting between checkpoints would), and returns the actions it did.
    fn drive(
        tuner: &mut AutoLrs,
        model: &mut Toy,
        snapshot: &mut Toy,
        count: usize,
    ) -> Vec<Action> {
        let mut done = Vec::new();
        for _ in 0..count {
            let action = tuner.action();
            let report = match action {
                Action::Snapshot => {
                    *snapshot = model.clone();
                    Report::SnapshotTaken
                }
                Action::TrainCandidate {
                    lr, steps, measure, ..
                } => {
                    let mut curve = Vec::new();
                    for step in 1..=steps {
                        let loss = model.step(lr);
                        match measure {
                            Measure::TrainingLoss => curve.push(loss),
                            Measure::ValidationLoss { every } if step % every == 0 => {
                                curve.push(model.level)
                            }
                            Measure::ValidationLoss { .. } => {}
                        }
                    }
                    Report::CandidateTrained { curve }
                }
                Action::Restore => {
                    *model = snapshot.clone();
                    Report::Restored
                }
                Action::TrainStage { lr, steps } => {
                    let steps = steps.min(300);
                    let loss = (0..steps).map(|_| model.step(lr)).last().unwrap();
                    Report::StageTrained { steps, loss }
                }
            };
            tuner.report(report).unwrap();
            done.push(action);
        }
        done
    }

    fn config() -> AutoLrsConfig {
        AutoLrsConfig {
            min_lr: 1e-4,
            max_lr: 1.0,
            tau_prime: 100,
            tau: 1000,
            k: 10,
            tau_max: 8000,
        }
    }

    fn candidate_lrs(actions: &[Action]) -> Vec<f64> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::TrainCandidate { lr, .. } => Some(*lr),
                _ => None,
            })
            .collect()
    }

    /// Actions in one default stage: snapshot, 10 × (candidate, restore), 4 stage chunks.
    const STAGE_ACTIONS: usize = 1 + 2 * 10 + 4;

    #[test]
    fn same_seed_gives_the_same_lr_sequence() {
        let run = |seed| {
            let (mut model, mut snapshot) = (Toy::new(), Toy::new());
            let mut tuner = AutoLrs::new(config(), seed);
            let actions = drive(&mut tuner, &mut model, &mut snapshot, 2 * STAGE_ACTIONS);
            (actions, tuner)
        };
        let (first, tuner) = run(7);
        let (again, _) = run(7);
        let (other, _) = run(8);
        assert_eq!(first, again);
        assert_eq!(candidate_lrs(&first).len(), 20);
        assert_ne!(candidate_lrs(&first)[0], candidate_lrs(&other)[0]);
        // The candidates spread over the whole range and never repeat within a stage.
        let stage0 = &candidate_lrs(&first)[..10];
        assert!(
            stage0.iter().any(|&lr| lr < 1e-3) && stage0.iter().any(|&lr| lr > 0.1),
            "{stage0:?}"
        );
        for (i, a) in stage0.iter().enumerate() {
            assert!(
                stage0[..i].iter().all(|b| (a / b).ln().abs() > 1e-3),
                "{stage0:?}"
            );
        }
        assert_eq!(tuner.stages().len(), 2);
    }

    #[test]
    fn finds_the_best_lr_of_the_landscape() {
        for seed in 0..3 {
            let (mut model, mut snapshot) = (Toy::new(), Toy::new());
            let mut tuner = AutoLrs::new(config(), seed);
            drive(&mut tuner, &mut model, &mut snapshot, STAGE_ACTIONS);
            let stage = &tuner.stages()[0];
            assert!(
                (0.01..=0.09).contains(&stage.chosen_lr),
                "seed {seed}: chose {} from {:?}",
                stage.chosen_lr,
                stage.candidates
            );
            // The choice is the lowest forecast, and τ steps at it come close to the
            // landscape's best floor, 0.1.
            let best = stage
                .candidates
                .iter()
                .find(|c| c.lr == stage.chosen_lr)
                .unwrap();
            let lowest = stage
                .candidates
                .iter()
                .filter_map(|c| c.forecast_loss)
                .fold(f64::MAX, f64::min);
            assert_eq!(best.forecast_loss, Some(lowest));
            let reached = stage.observed_loss_after_tau.unwrap();
            assert!(reached < 0.15, "seed {seed}: reached {reached}");
            assert_eq!(tuner.steps(), 10 * 100 + 1000);
        }
    }

    #[test]
    fn tau_doubles_up_to_tau_max_then_validation_loss_is_used() {
        let config = AutoLrsConfig {
            min_lr: 1e-3,
            max_lr: 1.0,
            tau_prime: 20,
            tau: 100,
            k: 3,
            tau_max: 400,
        };
        let (mut model, mut snapshot) = (Toy::new(), Toy::new());
        let mut tuner = AutoLrs::new(config, 1);
        let mut actions = Vec::new();
        while tuner.stages().len() < 5 || tuner.action() != Action::Snapshot {
            actions.extend(drive(&mut tuner, &mut model, &mut snapshot, 1));
        }
        let shape: Vec<(u64, u64, &str)> = tuner
            .stages()
            .iter()
            .map(|s| (s.tau_prime, s.tau, s.metric.as_str()))
            .collect();
        assert_eq!(
            shape,
            [
                (20, 100, "train_loss"),
                (40, 200, "train_loss"),
                (80, 400, "train_loss"),
                (80, 400, "val_loss"),
                (80, 400, "val_loss")
            ]
        );
        // Every step counts, the search's included, and each stage starts where the last ended.
        let per_stage: Vec<u64> = shape
            .iter()
            .map(|&(tau_prime, tau, _)| 3 * tau_prime + tau)
            .collect();
        assert_eq!(tuner.steps(), per_stage.iter().sum::<u64>());
        let starts: Vec<u64> = tuner.stages().iter().map(|s| s.start_step).collect();
        assert_eq!(starts, [0, 160, 480, 1120, 1760]);
        // In the validation phase candidates report 16 evaluations, every τ'/16 steps.
        let last = actions
            .iter()
            .rev()
            .find(|a| matches!(a, Action::TrainCandidate { .. }))
            .unwrap();
        assert_eq!(
            *last,
            Action::TrainCandidate {
                index: 2,
                lr: tuner.stages()[4].candidates[2].lr,
                steps: 80,
                measure: Measure::ValidationLoss { every: 5 },
            }
        );
        assert!(tuner.stages()[4]
            .candidates
            .iter()
            .all(|c| c.forecast_loss.is_some()));
    }

    #[test]
    fn a_restored_state_continues_identically_mid_stage() {
        let (mut model, mut snapshot) = (Toy::new(), Toy::new());
        let mut tuner = AutoLrs::new(config(), 3);
        // Into stage 1: its snapshot and four candidates done.
        drive(&mut tuner, &mut model, &mut snapshot, STAGE_ACTIONS + 1 + 8);
        assert_eq!(tuner.searching().len(), 4);

        let saved = serde_json::to_string(&tuner).unwrap();
        let mut restored: AutoLrs = serde_json::from_str(&saved).unwrap();
        assert_eq!(restored, tuner);
        let (mut model2, mut snapshot2) = (model.clone(), snapshot.clone());

        // The rest of stage 1 (6 candidates, 7 chunks of τ = 2000) and stage 2's search.
        let expected = drive(&mut tuner, &mut model, &mut snapshot, 12 + 7 + 21);
        let resumed = drive(&mut restored, &mut model2, &mut snapshot2, 12 + 7 + 21);
        assert_eq!(expected, resumed);
        assert_eq!(tuner.stages(), restored.stages());
        assert_eq!(restored.stages().len(), 3);

        // Mid-exploitation too: the remaining steps survive the round trip.
        while !matches!(tuner.action(), Action::TrainStage { steps, .. } if steps < 1000) {
            drive(&mut tuner, &mut model, &mut snapshot, 1);
        }
        let restored: AutoLrs =
            serde_json::from_str(&serde_json::to_string(&tuner).unwrap()).unwrap();
        assert_eq!(restored.action(), tuner.action());
        assert_eq!(restored.steps(), tuner.steps());
    }

    #[test]
    fn refuses_a_report_out_of_order_and_keeps_its_state() {
        let mut tuner = AutoLrs::new(config(), 1);
        let before = tuner.clone();
        let error = tuner.report(Report::Restored).unwrap_err();
        assert_eq!(
            error,
            AutoLrsError::OutOfOrder {
                expected: "a snapshot",
                got: "a restore"
            }
        );
        assert_eq!(tuner, before);
        assert!(matches!(
            tuner.report(Report::SnapshotTaken).unwrap(),
            Action::TrainCandidate { index: 0, .. }
        ));
        assert_eq!(
            tuner
                .report(Report::CandidateTrained { curve: vec![] })
                .unwrap_err(),
            AutoLrsError::EmptyCurve
        );
    }

    #[test]
    fn a_diverged_candidate_scores_one_million_and_is_not_chosen() {
        let config = AutoLrsConfig { k: 2, ..config() };
        let mut tuner = AutoLrs::new(config, 1);
        tuner.report(Report::SnapshotTaken).unwrap();
        let falling: Vec<f64> = (0..100).map(|t| 1.0 + (-0.05 * t as f64).exp()).collect();
        let mut diverged = falling.clone();
        diverged[60] = f64::NAN;
        tuner
            .report(Report::CandidateTrained { curve: diverged })
            .unwrap();
        assert_eq!(tuner.tried[0].score, FAILED_SCORE);
        tuner.report(Report::Restored).unwrap();
        tuner
            .report(Report::CandidateTrained { curve: falling })
            .unwrap();
        let Action::TrainStage { lr, steps: 1000 } = tuner.report(Report::Restored).unwrap() else {
            panic!("the stage should start after k candidates");
        };
        let record = &tuner.stages()[0];
        assert_eq!(record.candidates[0].forecast_loss, None);
        assert_eq!(lr, record.candidates[1].lr);
        assert!((record.candidates[1].forecast_loss.unwrap() - 1.0).abs() < 0.01);
    }
}
