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
//!    with the lowest score (the scores, not the GP's posterior).
//! 4. `τ'` and `τ` double while `2τ ≤ τ_max` (with the defaults 1000, 2000, 4000, 8000,
//!    the code's `τ' < τ_max/10` rule); after that, candidates report validation loss
//!    every `τ'/16` steps instead of per-step training loss, and the forecast's horizon
//!    is `τ/(τ'/16)` evaluations.
//!
//! Scoring, as the code does it: a curve with a NaN scores 1e6; in the validation phase
//! a curve whose maximum reaches the loss AutoLRS started from scores its last value
//! instead of the forecast. Departures:
//! - A forecast counts only where it is credible ([`super::forecast::Forecast::judge`]:
//!   the fit follows the curve, stays at or above 0, and does not extrapolate a drop
//!   the window never showed); otherwise the candidate scores its observed loss (the
//!   mean of its last [`OBSERVED_WINDOW`] training losses, the code's `current_loss`; in
//!   the validation phase its last validation loss), and the record says so
//!   (`scored_by`, `note`). A curve too short to fit (under four points, only possible
//!   with a tiny `τ'`) scores its observed loss. (Until 2026-11-25 the score was the
//!   smoothing spline's end, which on a noisy curve can miss the losses by more than
//!   their spread: digits chose an LR on a score of −0.44.)
//! - The choice compares like with like: where some candidates that did not fail are
//!   scored by their observed loss, those with a credible forecast are re-scored by
//!   theirs too (the record notes it). A forecast at `τ` lies below the same curve's
//!   loss at `τ'` whenever the curve still falls, so mixing the two favoured whichever
//!   candidates had a credible forecast (smooth, bending curves) over those still
//!   falling fast, which are the better LRs early on. All candidates see the same
//!   batches (see below), so their observed losses compare fairly. Where every forecast
//!   is credible, the paper's choice stands.
//! - A candidate whose smoothed loss rises over its window, beyond the curve's noise,
//!   fails: it is never chosen (nor fallen back to) while one that did not fail
//!   remains. The GP is told its observed loss, not 1e6: later stages start from a low
//!   loss that most LRs raise, and a stage of 1e6 scores leaves the normalised GP
//!   nothing to model (its proposals then alternate between the range's ends).
//! - With the run's budget known ([`AutoLrs::with_budget`]), a stage that would not
//!   fit in the steps left is shrunk to fit: `τ'` and `τ` scaled down together while
//!   `τ'` stays at least the configured one; with fewer steps left than that, the last
//!   stage has no search and exploits the previous stage's LR to the end (its record
//!   lists no candidates and `tau_prime` 0). The authors' schedule (τ = 1000, 2000,
//!   4000, 8000, …) ignores the budget, so a run usually ends inside a search whose
//!   steps it then throws away.
//! - An exploitation that diverges — a loss that is not a number, or the smoothed
//!   (EMA, span [`EMA_SPAN`]) training loss above [`DIVERGENCE_FACTOR`] times the
//!   stage's starting loss after [`EMA_SPAN`] steps — is abandoned: its steps count,
//!   the snapshot is restored and the next-best candidate exploits a full `τ`; the
//!   record lists each fallback. With every candidate tried, `min_lr` is exploited;
//!   should that diverge too, the stage ends at its snapshot.
//!   The reference is the highest of the previous stage's smoothed exploitation loss,
//!   the snapshot's loss on the stage's first batch (every candidate's first loss) and
//!   the observed losses of the candidates that did not fail: what the stage's own
//!   batches cost the snapshot's model, not only what the last exploitation averaged.
//! - After the τ steps, a stage measured in validation loss is evaluated once more
//!   (`Evaluate`, no training step), so the forecast error compares like with like;
//!   a training-loss stage uses its smoothed exploitation loss.
//! - A run never ends on a model it would not keep: when the budget ends inside a search
//!   (a candidate's model) or on an exploitation that diverged in its last steps (or
//!   whose model evaluates to a number no longer), [`AutoLrs::finish`] has the trainer
//!   put the stage snapshot back, and the stage's record says so (`run_end`). The
//!   authors' code ends wherever the training loop stops.
//! - The candidate's LR is used from its first step (the code's `ckpt`/`restore`
//!   messages run one step at the previous LR).
//!
//! The trainer's restore rewinds the data loader with the model and optimizer (the
//! authors' callback restores only the model and optimizer): a choice, so that the `k`
//! candidates are compared on the same batches and a difference in their curves is the
//! LR's, not the data's. The exploitation then sees the batches the candidates saw.
//!
//! Every step the controller hands out, search included, counts towards the run:
//! [`AutoLrs::steps`] is the number trained so far. The whole state serialises, so a
//! checkpoint between two actions, or inside a stage's exploitation steps, resumes
//! exactly; a checkpoint inside a candidate's τ' steps resumes by running that
//! candidate again from the snapshot.

use serde::{Deserialize, Serialize};
use tessera_api::train::{CandidateScore, LrCandidate, LrFallback, LrStageRecord, StepPhase};

use super::bayesopt::{self, LogRange, KAPPA};
use super::forecast::{forecast, ForecastError, Verdict, MIN_POINTS};
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
/// The span of the exponential moving average that smooths exploitation losses, and
/// the steps an exploitation runs before its average is judged.
pub const EMA_SPAN: u64 = 20;
/// An exploitation whose smoothed loss exceeds this many times the stage's starting
/// loss has diverged.
pub const DIVERGENCE_FACTOR: f64 = 2.0;

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
    /// Evaluate the exploited model on the validation split (no training step).
    Evaluate,
}

impl Action {
    fn name(&self) -> &'static str {
        match self {
            Action::Snapshot => "a snapshot",
            Action::TrainCandidate { .. } => "a candidate's curve",
            Action::Restore => "a restore",
            Action::TrainStage { .. } => "stage steps",
            Action::Evaluate => "an evaluation",
        }
    }

    /// What the steps of this action are spent on; `None` for those that train nothing.
    pub fn phase(&self) -> Option<StepPhase> {
        match self {
            Action::TrainCandidate { .. } => Some(StepPhase::Search),
            Action::TrainStage { .. } | Action::Evaluate => Some(StepPhase::Exploit),
            Action::Snapshot | Action::Restore => None,
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
    Evaluated {
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
            Report::Evaluated { .. } => "an evaluation",
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
    Candidate {
        unit: f64,
        lr: f64,
    },
    Restore,
    Stage {
        lr: f64,
        remaining: u64,
        /// Exploitation steps done at `lr`, and their smoothed loss.
        #[serde(default)]
        done: u64,
        #[serde(default)]
        smoothed: Option<f64>,
    },
    /// The exploitation at the abandoned LR diverged: restore, then exploit `next`, or
    /// with nothing left to try end the stage there.
    Fallback {
        next: Option<f64>,
    },
    /// The stage's τ steps are done; its validation loss is wanted.
    Measure {
        smoothed: Option<f64>,
    },
}

/// One candidate of the current stage: where it sits in the GP's `[0, 1]`, and what the
/// GP was told.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Tried {
    unit: f64,
    score: f64,
    /// Not a number, or rising: chosen only when every candidate failed.
    #[serde(default)]
    failed: bool,
    /// The training loss of its first step (the snapshot's loss on the first batch).
    #[serde(default)]
    first_loss: Option<f64>,
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
    /// The loss the current stage started from, which an exploitation must not run far
    /// above; the previous stage's smoothed exploitation loss once there is one.
    #[serde(default)]
    start_loss: Option<f64>,
    history: Vec<LrStageRecord>,
    /// The run's steps in all, when known: the last stage is fitted to what is left.
    #[serde(default)]
    budget: Option<u64>,
}

impl AutoLrs {
    /// A tuner for a run of `budget` steps: the stage the budget would cut is shrunk to
    /// fit it (see the module comment).
    pub fn with_budget(mut self, budget: u64) -> AutoLrs {
        self.budget = Some(budget);
        self
    }

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
            start_loss: None,
            history: Vec::new(),
            budget: None,
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
            Phase::Restore | Phase::Fallback { .. } => Action::Restore,
            Phase::Stage { lr, remaining, .. } => Action::TrainStage {
                lr,
                steps: remaining,
            },
            Phase::Measure { .. } => Action::Evaluate,
        }
    }

    /// Takes the trainer's report of the current action and returns the next one. A
    /// report that does not answer the current action is refused and changes nothing.
    pub fn report(&mut self, report: Report) -> Result<Action, AutoLrsError> {
        match (self.phase, report) {
            (Phase::Snapshot, Report::SnapshotTaken) => {
                self.stage_start = self.steps;
                self.tried.clear();
                self.phase = match self.fit_to_budget() {
                    Some(lr) => {
                        self.history.push(self.record(lr));
                        Phase::Stage {
                            lr,
                            remaining: self.tau,
                            done: 0,
                            smoothed: None,
                        }
                    }
                    None => self.next_candidate()?,
                };
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
            (Phase::Fallback { next: None }, Report::Restored) => self.close_stage(None, None),
            (Phase::Fallback { next: Some(next) }, Report::Restored) => {
                if let Some(record) = self.history.last_mut() {
                    record.chosen_lr = next;
                }
                self.phase = Phase::Stage {
                    lr: next,
                    remaining: self.tau,
                    done: 0,
                    smoothed: None,
                };
            }
            (
                Phase::Stage {
                    lr,
                    remaining,
                    done,
                    smoothed,
                },
                Report::StageTrained { steps, loss },
            ) => {
                let steps = steps.min(remaining);
                self.steps += steps;
                let done = done + steps;
                let smoothed = loss.is_finite().then(|| ema(smoothed, loss, steps));
                if let Some(reason) = self.diverged(loss, done, smoothed) {
                    self.fall_back(lr, done, reason);
                } else if steps < remaining {
                    self.phase = Phase::Stage {
                        lr,
                        remaining: remaining - steps,
                        done,
                        smoothed,
                    };
                } else if self.validation {
                    self.phase = Phase::Measure { smoothed };
                } else {
                    self.close_stage(smoothed, smoothed);
                }
            }
            (Phase::Measure { smoothed }, Report::Evaluated { loss }) => {
                self.close_stage(Some(loss).filter(|l| l.is_finite()), smoothed);
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

    /// The budget is spent, with the model in hand whose validation loss is `val_loss`:
    /// `None` if the run may end on it, or why not. A search candidate's model is never
    /// kept (the search would have restored it away), nor one whose exploitation
    /// diverged, nor one whose validation loss is not a number; the trainer then puts the
    /// stage snapshot back, the last model the run kept (the previous stage's exploited
    /// model, or the one it started from), and the stage's record says so (`run_end`).
    /// An exploitation still running keeps its model if that evaluates to a number.
    pub fn finish(&mut self, val_loss: f64) -> Option<String> {
        let k = self.config.k;
        let reason = match self.phase {
            Phase::Candidate { lr, .. } => format!(
                "the budget ended in the search, in candidate {} of {k} (lr {lr:.3e})",
                self.tried.len() + 1
            ),
            Phase::Restore => format!(
                "the budget ended in the search, after candidate {} of {k}",
                self.tried.len()
            ),
            Phase::Fallback { .. } => {
                let last = self.history.last().and_then(|r| r.fallbacks.last());
                format!(
                    "the exploitation diverged in the last steps ({})",
                    last.map_or("", |f| f.reason.as_str())
                )
            }
            _ if !val_loss.is_finite() => {
                format!("the exploited model's validation loss is {val_loss}")
            }
            _ => return None,
        };
        let reason = format!("{reason}: the run ends on the stage's snapshot");
        let searching = matches!(self.phase, Phase::Candidate { .. } | Phase::Restore);
        // Asked again (a run resumed from its final checkpoint), the record is there.
        if searching && self.history.last().map(|r| r.stage) != Some(self.stage) {
            // The stage's record as far as its search went; nothing was exploited.
            let chosen_lr = match (self.ranking().first(), self.phase) {
                (Some(&best), _) => self.tried[best].record.lr,
                (None, Phase::Candidate { lr, .. }) => lr,
                (None, _) => self.config.min_lr,
            };
            self.history.push(self.record(chosen_lr));
        }
        if let Some(record) = self.history.last_mut() {
            record.run_end = Some(reason.clone());
        }
        Some(reason)
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
            Phase::Candidate { .. } | Phase::Restore => {
                self.tried.iter().map(|t| t.record.clone()).collect()
            }
            _ => Vec::new(),
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
        let (observed, horizon, first_loss) = match self.measure() {
            Measure::TrainingLoss => {
                self.init_loss.get_or_insert(curve[0]);
                let window = &curve[curve.len().saturating_sub(OBSERVED_WINDOW)..];
                (
                    window.iter().sum::<f64>() / window.len() as f64,
                    self.tau as f64,
                    Some(curve[0]).filter(|l| l.is_finite()),
                )
            }
            Measure::ValidationLoss { every } => {
                (curve[curve.len() - 1], self.tau as f64 / every as f64, None)
            }
        };
        let guarded = self.validation
            && self
                .init_loss
                .is_some_and(|init| curve.iter().copied().fold(f64::MIN, f64::max) >= init);
        let fitted = forecast(curve, kind, horizon);
        let (score, scored_by, note) = match &fitted {
            Err(ForecastError::NonFinite) => (
                FAILED_SCORE,
                CandidateScore::Failed,
                Some("the loss was not a number".to_string()),
            ),
            Err(ForecastError::TooShort) => (
                observed,
                CandidateScore::Observed,
                Some("too few points to fit".to_string()),
            ),
            Ok(f) => match f.judge() {
                Verdict::Rising(why) => (observed, CandidateScore::Failed, Some(why)),
                _ if guarded => (
                    observed,
                    CandidateScore::Observed,
                    Some("the validation loss reached the loss AutoLRS started from".to_string()),
                ),
                Verdict::NotCredible(why) => (observed, CandidateScore::Observed, Some(why)),
                Verdict::Credible => (f.loss, CandidateScore::Forecast, None),
            },
        };
        // A score that is not a number tells the GP nothing; it counts as failed.
        let (score, scored_by) = if score.is_finite() {
            (score, scored_by)
        } else {
            (FAILED_SCORE, CandidateScore::Failed)
        };
        let finite = |v: f64| Some(v).filter(|v| v.is_finite());
        Tried {
            unit,
            score,
            failed: scored_by == CandidateScore::Failed,
            first_loss,
            record: LrCandidate {
                lr,
                forecast_loss: fitted.ok().map(|f| f.loss).and_then(finite),
                observed_loss: finite(observed),
                score: Some(score),
                scored_by,
                note,
            },
        }
    }

    /// The candidates' indices, best first: those that did not fail by score, then the
    /// failed ones by score.
    fn ranking(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.tried.len()).collect();
        order.sort_by(|&a, &b| {
            let (a, b) = (&self.tried[a], &self.tried[b]);
            a.failed
                .cmp(&b.failed)
                .then(a.score.total_cmp(&b.score))
                .then(a.record.lr.total_cmp(&b.record.lr))
        });
        order
    }

    /// Puts the stage's candidates on one footing before the choice: where a candidate
    /// that did not fail is scored by its observed loss, those scored by a forecast are
    /// re-scored by theirs (the GP was told their forecasts; the choice compares like
    /// with like).
    fn compare_like_with_like(&mut self) {
        let live = || self.tried.iter().filter(|t| !t.failed);
        let observed = live()
            .filter(|t| t.record.scored_by == CandidateScore::Observed)
            .count();
        let forecast = live()
            .filter(|t| t.record.scored_by == CandidateScore::Forecast)
            .count();
        if observed == 0 || forecast == 0 {
            return;
        }
        let note = format!(
            "forecast credible, but {observed} of {} candidates had none: the stage compares observed losses",
            observed + forecast
        );
        for tried in self.tried.iter_mut().filter(|t| !t.failed) {
            let record = &mut tried.record;
            if let (CandidateScore::Forecast, Some(loss)) = (record.scored_by, record.observed_loss)
            {
                tried.score = loss;
                record.score = Some(loss);
                record.scored_by = CandidateScore::Observed;
                record.note = Some(note.clone());
            }
        }
    }

    fn close_search(&mut self) -> Phase {
        self.compare_like_with_like();
        let best = &self.tried[self.ranking()[0]];
        let lr = best.record.lr;
        // What the snapshot's model does on the stage's own batches raises the
        // reference: its loss on the first batch (every candidate's first loss), and the
        // losses the candidates that did not fail reached. Judged against the previous
        // exploitation's smoothed loss alone, a stage starting from a model worse than
        // that figure said (a loss climbing in its last steps, or batches much harder
        // than the ones it was smoothed over) saw every LR down to `min_lr` "diverge"
        // and fell back through all of them (digits, 2026-11-25: 45 fallbacks).
        let firsts: Vec<f64> = self.tried.iter().filter_map(|t| t.first_loss).collect();
        let snapshot =
            (!firsts.is_empty()).then(|| firsts.iter().sum::<f64>() / firsts.len() as f64);
        let reached = self
            .tried
            .iter()
            .filter(|t| !t.failed)
            .filter_map(|t| t.record.observed_loss)
            .fold(None, |worst: Option<f64>, l| {
                Some(worst.map_or(l, |w| w.max(l)))
            });
        self.start_loss = [self.start_loss, snapshot, reached]
            .into_iter()
            .flatten()
            .fold(None, |high: Option<f64>, l| {
                Some(high.map_or(l, |h| h.max(l)))
            });
        self.history.push(self.record(lr));
        Phase::Stage {
            lr,
            remaining: self.tau,
            done: 0,
            smoothed: None,
        }
    }

    /// Fits a stage that the budget would cut to the steps left: `τ'` and `τ` shrink in
    /// proportion while `τ'` stays at least the configured one; below that, `Some(lr)`:
    /// the stage has no search and exploits the previous stage's choice to the end.
    fn fit_to_budget(&mut self) -> Option<f64> {
        let remaining = self.budget?.saturating_sub(self.steps);
        let k = u64::from(self.config.k);
        let full = k * self.tau_prime + self.tau;
        if remaining == 0 || remaining >= full {
            return None;
        }
        let tau_prime = self.tau_prime * remaining / full;
        match self.history.last() {
            Some(previous) if tau_prime < self.config.tau_prime => {
                let lr = previous.chosen_lr;
                self.tau_prime = 0;
                self.tau = remaining;
                Some(lr)
            }
            // The first stage always searches, however short.
            _ if tau_prime >= MIN_POINTS as u64 => {
                self.tau_prime = tau_prime;
                self.tau = remaining - k * tau_prime;
                None
            }
            _ => None,
        }
    }

    /// The current stage's record, its candidates as far as the search went.
    fn record(&self, chosen_lr: f64) -> LrStageRecord {
        LrStageRecord {
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
            chosen_lr,
            observed_loss_after_tau: None,
            forecast_error: None,
            fallbacks: Vec::new(),
            run_end: None,
        }
    }

    /// Why the exploitation at this point has diverged, if it has.
    fn diverged(&self, loss: f64, done: u64, smoothed: Option<f64>) -> Option<String> {
        if !loss.is_finite() {
            return Some(format!("the loss became {loss}"));
        }
        let (start, smoothed) = (self.start_loss?, smoothed?);
        (done >= EMA_SPAN && smoothed > DIVERGENCE_FACTOR * start).then(|| {
            format!("the smoothed loss reached {smoothed:.4}, above {DIVERGENCE_FACTOR}× the stage's start {start:.4}")
        })
    }

    /// Abandons the exploitation at `lr`: the next candidate in the ranking not yet
    /// exploited (among those that did not fail), then `min_lr`; once that too has been
    /// abandoned the stage ends at its snapshot (the same state and batches would only
    /// diverge again).
    fn fall_back(&mut self, lr: f64, done: u64, reason: String) {
        let ranking = self.ranking();
        let record = self.history.last_mut().expect("a stage is being exploited");
        record.fallbacks.push(LrFallback {
            lr,
            at_step: self.steps,
            steps: done,
            reason,
        });
        let abandoned: Vec<f64> = record.fallbacks.iter().map(|f| f.lr).collect();
        let next = ranking
            .iter()
            .map(|&i| &self.tried[i])
            .filter(|t| !t.failed)
            .map(|t| t.record.lr)
            .chain([self.config.min_lr])
            .find(|lr| !abandoned.contains(lr));
        self.phase = Phase::Fallback { next };
    }

    /// Ends the stage: `observed` is the loss after τ in the stage's metric, `smoothed`
    /// the smoothed training loss the next stage starts from.
    fn close_stage(&mut self, observed: Option<f64>, smoothed: Option<f64>) {
        let chosen = self.history.last().map(|r| r.chosen_lr);
        let predicted = chosen
            .and_then(|lr| self.tried.iter().find(|t| t.record.lr == lr))
            .filter(|t| !t.failed)
            .map(|t| t.score);
        if let Some(record) = self.history.last_mut() {
            record.observed_loss_after_tau = observed;
            record.forecast_error = observed.zip(predicted).map(|(o, p)| o - p);
        }
        if smoothed.is_some() {
            self.start_loss = smoothed;
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

/// The exponential moving average with span [`EMA_SPAN`], after `steps` more steps whose
/// last loss is `loss` (a report of several steps carries only its last loss).
fn ema(previous: Option<f64>, loss: f64, steps: u64) -> f64 {
    let alpha = 2.0 / (EMA_SPAN as f64 + 1.0);
    match previous {
        None => loss,
        Some(previous) => {
            let keep = (1.0 - alpha).powi(steps.min(i32::MAX as u64) as i32);
            keep * previous + (1.0 - keep) * loss
        }
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
                Action::Evaluate => Report::Evaluated { loss: model.level },
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
            // The choice is the lowest score, and τ steps at it come close to the
            // landscape's best floor, 0.1.
            let best = stage
                .candidates
                .iter()
                .find(|c| c.lr == stage.chosen_lr)
                .unwrap();
            let lowest = stage
                .candidates
                .iter()
                .filter_map(|c| c.score)
                .fold(f64::MAX, f64::min);
            assert_eq!(best.score, Some(lowest));
            let reached = stage.observed_loss_after_tau.unwrap();
            assert!(reached < 0.15, "seed {seed}: reached {reached}");
            // The forecast error is the chosen score's miss after τ steps.
            let error = stage.forecast_error.unwrap();
            assert!(
                (error - (reached - lowest)).abs() < 1e-12 && error.abs() < 0.1,
                "{error}"
            );
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
        // A validation-loss stage ends with one evaluation of the exploited model, so its
        // observed loss (and forecast error) is a validation loss like its forecasts.
        let evaluations = actions.iter().filter(|a| **a == Action::Evaluate).count();
        assert_eq!(evaluations, 2);
        let last = &tuner.stages()[4];
        assert_eq!(last.observed_loss_after_tau, Some(model.level));
        assert!(last.forecast_error.is_some());
    }

    #[test]
    fn a_restored_state_continues_identically_mid_stage() {
        let (mut model, mut snapshot) = (Toy::new(), Toy::new());
        let mut tuner = AutoLrs::new(config(), 3);
        // Into stage 1: its snapshot and four candidates done.
        drive(&mut tuner, &mut model, &mut snapshot, STAGE_ACTIONS + 1 + 8);
        assert_eq!(tuner.searching().len(), 4, "{:#?}", tuner.stages());

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

    /// Runs one stage's search from a fresh controller, reporting the given curves, and
    /// returns the first exploitation action.
    fn search(tuner: &mut AutoLrs, curves: &[Vec<f64>]) -> Action {
        tuner.report(Report::SnapshotTaken).unwrap();
        let mut action = tuner.action();
        for curve in curves {
            tuner
                .report(Report::CandidateTrained {
                    curve: curve.clone(),
                })
                .unwrap();
            action = tuner.report(Report::Restored).unwrap();
        }
        action
    }

    fn decay(start: f64, end: f64, rate: f64) -> Vec<f64> {
        (0..100)
            .map(|t| end + (start - end) * (-rate * t as f64).exp())
            .collect()
    }

    /// The digits stage: a curve still falling in a straight line was forecast
    /// far below 0 and chosen over curves that had settled lower than it had reached.
    #[test]
    fn a_forecast_that_is_not_credible_scores_the_observed_loss() {
        let config = AutoLrsConfig { k: 2, ..config() };
        let mut tuner = AutoLrs::new(config, 1);
        let straight: Vec<f64> = (0..100).map(|t| 1.2 - 0.006 * t as f64).collect();
        let settled = decay(1.2, 0.45, 0.1);
        let Action::TrainStage { lr, .. } = search(&mut tuner, &[straight, settled]) else {
            panic!("the stage should start");
        };
        let record = &tuner.stages()[0];
        let (line, bent) = (&record.candidates[0], &record.candidates[1]);
        assert_eq!(line.scored_by, CandidateScore::Observed);
        assert!(
            line.note.as_deref().unwrap().contains("below 0"),
            "{line:?}"
        );
        // The mean of its last 10 losses (1.2 − 0.006 · 94.5), not the smoothed end.
        assert!((line.score.unwrap() - 0.633).abs() < 1e-9, "{line:?}");
        assert_eq!(line.score, line.observed_loss);
        assert!(line.forecast_loss.unwrap() >= 0.0, "{line:?}");
        // The settled curve's forecast was credible, but the stage compares observed
        // losses: it is chosen on the loss it reached.
        assert_eq!(bent.scored_by, CandidateScore::Observed);
        assert!(bent.note.as_deref().unwrap().contains("compares observed"));
        assert!(
            (bent.forecast_loss.unwrap() - 0.45).abs() < 0.01,
            "{bent:?}"
        );
        assert_eq!(bent.score, bent.observed_loss);
        assert_eq!(lr, bent.lr);
    }

    /// A credible forecast at τ is below the same curve's loss at τ': compared with a
    /// curve scored by its observed loss it wins by that gap alone. Here the curve still
    /// falling fast has reached a lower loss than the one that settled, and is chosen.
    #[test]
    fn a_stage_with_forecasts_and_observed_losses_compares_observed_losses() {
        let config = AutoLrsConfig { k: 2, ..config() };
        let mut tuner = AutoLrs::new(config, 1);
        let settling = decay(2.0, 0.5, 0.03);
        let falling: Vec<f64> = (0..100).map(|t| 1.1 - 0.006 * t as f64).collect();
        let Action::TrainStage { lr, .. } = search(&mut tuner, &[settling, falling]) else {
            panic!("the stage should start");
        };
        let record = &tuner.stages()[0];
        let (settled, line) = (&record.candidates[0], &record.candidates[1]);
        // Its forecast (0.5) is credible and below the falling curve's 0.533 …
        assert!(
            (settled.forecast_loss.unwrap() - 0.5).abs() < 0.01,
            "{settled:?}"
        );
        assert!(settled.observed_loss.unwrap() > 0.57, "{settled:?}");
        assert!((line.score.unwrap() - 0.533).abs() < 1e-9, "{line:?}");
        // … but the losses reached decide.
        assert_eq!(settled.score, settled.observed_loss);
        assert_eq!(lr, line.lr);
        // Where every forecast is credible, the forecasts decide (the paper).
        let mut tuner = AutoLrs::new(config, 1);
        let (slow, fast) = (decay(2.0, 0.3, 0.015), decay(2.0, 0.5, 0.2));
        let Action::TrainStage { lr, .. } = search(&mut tuner, &[slow, fast]) else {
            panic!("the stage should start");
        };
        let record = &tuner.stages()[0];
        assert!(record
            .candidates
            .iter()
            .all(|c| c.scored_by == CandidateScore::Forecast));
        assert!(record.candidates[0].observed_loss > record.candidates[1].observed_loss);
        assert_eq!(lr, record.candidates[0].lr);
    }

    #[test]
    fn the_last_stage_is_fitted_to_the_budget() {
        let (mut model, mut snapshot) = (Toy::new(), Toy::new());
        // Stage 0 takes 2000 steps; stage 1 would take 4000 but 2000 are left: τ' = 100
        // (the configured one) still fits, so τ' 200 → 100 and τ 2000 → 1000.
        let mut tuner = AutoLrs::new(config(), 1).with_budget(4000);
        while tuner.steps() < 4000 {
            drive(&mut tuner, &mut model, &mut snapshot, 1);
        }
        let shape: Vec<(u64, u64, u64)> = tuner
            .stages()
            .iter()
            .map(|s| (s.start_step, s.tau_prime, s.tau))
            .collect();
        assert_eq!(shape, [(0, 100, 1000), (2000, 100, 1000)]);
        assert_eq!(tuner.stages()[1].candidates.len(), 10);
        assert!(tuner.stages()[1].observed_loss_after_tau.is_some());
        assert_eq!(tuner.steps(), 4000);

        // With 600 left, a search of 10 candidates of 100 steps no longer fits: the last
        // stage exploits stage 0's choice for the 600 steps.
        let (mut model, mut snapshot) = (Toy::new(), Toy::new());
        let mut tuner = AutoLrs::new(config(), 1).with_budget(2600);
        let mut actions = Vec::new();
        while tuner.steps() < 2600 {
            actions.extend(drive(&mut tuner, &mut model, &mut snapshot, 1));
        }
        let last = &tuner.stages()[1];
        assert_eq!((last.start_step, last.tau_prime, last.tau), (2000, 0, 600));
        assert!(last.candidates.is_empty());
        assert_eq!(last.chosen_lr, tuner.stages()[0].chosen_lr);
        assert!(last.observed_loss_after_tau.is_some());
        assert_eq!(candidate_lrs(&actions).len(), 10);
        assert_eq!(tuner.steps(), 2600);
        // Without a budget, the paper's schedule.
        let (mut model, mut snapshot) = (Toy::new(), Toy::new());
        let mut tuner = AutoLrs::new(config(), 1);
        drive(&mut tuner, &mut model, &mut snapshot, STAGE_ACTIONS + 1);
        assert!(matches!(
            tuner.action(),
            Action::TrainCandidate { steps: 200, .. }
        ));
    }

    #[test]
    fn a_candidate_whose_loss_rises_scores_as_failed() {
        let config = AutoLrsConfig { k: 2, ..config() };
        let mut tuner = AutoLrs::new(config, 1);
        let rising = decay(1.0, 1.3, 0.05);
        let flat_high = vec![2.0; 100];
        let Action::TrainStage { lr, .. } = search(&mut tuner, &[rising, flat_high]) else {
            panic!("the stage should start");
        };
        let record = &tuner.stages()[0];
        assert_eq!(record.candidates[0].scored_by, CandidateScore::Failed);
        assert!(record.candidates[0]
            .note
            .as_deref()
            .unwrap()
            .contains("rose"));
        // The GP hears the loss it reached; the choice passes it over although its
        // score is lower than the flat candidate's.
        assert!((record.candidates[0].score.unwrap() - 1.3).abs() < 0.01);
        assert_eq!(lr, record.candidates[1].lr);
    }

    /// Stage 0's exploitation ends on a smoothed loss of 1.0, but the model it leaves
    /// has a loss of 3.0 on stage 1's first batch: an exploitation at 2.5 is improving
    /// on the snapshot, not diverging.
    #[test]
    fn divergence_is_judged_against_the_snapshots_own_loss() {
        let config = AutoLrsConfig { k: 1, ..config() };
        let mut tuner = AutoLrs::new(config, 1);
        search(&mut tuner, &[decay(2.0, 0.5, 0.1)]);
        tuner
            .report(Report::StageTrained {
                steps: 1000,
                loss: 1.0,
            })
            .unwrap();
        search(&mut tuner, &[decay(3.0, 2.4, 0.1)]);
        let mut action = tuner.action();
        for _ in 0..2 * EMA_SPAN {
            action = tuner
                .report(Report::StageTrained {
                    steps: 1,
                    loss: 2.5,
                })
                .unwrap();
        }
        assert!(matches!(action, Action::TrainStage { .. }), "{action:?}");
        assert!(tuner.stages()[1].fallbacks.is_empty());
        // Well above the snapshot's loss, it still falls back.
        while action != Action::Restore {
            action = tuner
                .report(Report::StageTrained {
                    steps: 1,
                    loss: 7.0,
                })
                .unwrap();
        }
        assert_eq!(tuner.stages()[1].fallbacks.len(), 1);
    }

    #[test]
    fn a_diverging_exploitation_restores_the_snapshot_and_exploits_the_next_best() {
        let config = AutoLrsConfig { k: 3, ..config() };
        let mut tuner = AutoLrs::new(config, 1);
        let curves = [
            decay(2.0, 0.8, 0.1),
            decay(2.0, 0.3, 0.1),
            decay(2.0, 0.5, 0.1),
        ];
        let Action::TrainStage {
            lr: first,
            steps: 1000,
        } = search(&mut tuner, &curves)
        else {
            panic!("the stage should start");
        };
        let lrs: Vec<f64> = tuner.stages()[0].candidates.iter().map(|c| c.lr).collect();
        assert_eq!(first, lrs[1]);

        // A loss that is not a number: restore, then the second best for a full τ.
        tuner
            .report(Report::StageTrained {
                steps: 10,
                loss: 0.3,
            })
            .unwrap();
        let action = tuner
            .report(Report::StageTrained {
                steps: 1,
                loss: f64::NAN,
            })
            .unwrap();
        assert_eq!(action, Action::Restore);
        let action = tuner.report(Report::Restored).unwrap();
        assert_eq!(
            action,
            Action::TrainStage {
                lr: lrs[2],
                steps: 1000
            }
        );

        // A smoothed loss well above the stage's start (2.0) after EMA_SPAN steps: the
        // third candidate.
        let mut action = action;
        for _ in 0..EMA_SPAN {
            action = tuner
                .report(Report::StageTrained {
                    steps: 1,
                    loss: 5.0,
                })
                .unwrap();
        }
        assert_eq!(action, Action::Restore);
        assert_eq!(
            tuner.report(Report::Restored).unwrap(),
            Action::TrainStage {
                lr: lrs[0],
                steps: 1000
            }
        );
        tuner
            .report(Report::StageTrained {
                steps: 1000,
                loss: 0.7,
            })
            .unwrap();

        let record = &tuner.stages()[0];
        let fallbacks: Vec<(f64, u64, u64)> = record
            .fallbacks
            .iter()
            .map(|f| (f.lr, f.at_step, f.steps))
            .collect();
        assert_eq!(
            fallbacks,
            [
                (lrs[1], 300 + 11, 11),
                (lrs[2], 300 + 11 + EMA_SPAN, EMA_SPAN)
            ]
        );
        assert!(record.fallbacks[1].reason.contains("smoothed loss"));
        assert_eq!(record.chosen_lr, lrs[0]);
        assert_eq!(record.observed_loss_after_tau, Some(0.7));
        let forecast = record.candidates[0].score.unwrap();
        assert!((record.forecast_error.unwrap() - (0.7 - forecast)).abs() < 1e-12);
        // Every step counts: the search, both abandoned exploitations, the full τ.
        assert_eq!(tuner.steps(), 300 + 11 + EMA_SPAN + 1000);
        assert_eq!(tuner.action(), Action::Snapshot);
    }

    #[test]
    fn with_every_candidate_abandoned_the_lowest_lr_is_exploited_then_the_stage_ends() {
        let config = AutoLrsConfig { k: 1, ..config() };
        let mut tuner = AutoLrs::new(config, 1);
        search(&mut tuner, &[decay(2.0, 0.5, 0.1)]);
        tuner
            .report(Report::StageTrained {
                steps: 1,
                loss: f64::INFINITY,
            })
            .unwrap();
        assert_eq!(
            tuner.report(Report::Restored).unwrap(),
            Action::TrainStage {
                lr: 1e-4,
                steps: 1000
            }
        );
        tuner
            .report(Report::StageTrained {
                steps: 1,
                loss: f64::NAN,
            })
            .unwrap();
        assert_eq!(tuner.report(Report::Restored).unwrap(), Action::Snapshot);
        let record = &tuner.stages()[0];
        assert_eq!(record.fallbacks.len(), 2);
        assert_eq!(record.observed_loss_after_tau, None);
        assert_eq!(tuner.steps(), 100 + 2);
    }

    #[test]
    fn a_run_ends_only_on_a_model_it_keeps() {
        let config = AutoLrsConfig { k: 3, ..config() };
        let curves = [decay(2.0, 0.8, 0.1), decay(2.0, 0.3, 0.1)];
        // Inside the search, in the third of three candidates: the stage's partial
        // record says the run ends on its snapshot, the best candidate so far as its
        // choice.
        let mut tuner = AutoLrs::new(config, 1);
        search(&mut tuner, &curves);
        let why = tuner.finish(0.5).expect("a candidate's model is not kept");
        assert!(why.contains("in candidate 3 of 3"), "{why}");
        let record = &tuner.stages()[0];
        assert_eq!(record.run_end.as_deref(), Some(why.as_str()));
        assert_eq!(record.chosen_lr, record.candidates[1].lr);
        // Asked again (a resumed run), nothing is added.
        tuner.finish(0.5).unwrap();
        assert_eq!(tuner.stages().len(), 1);

        // An exploitation that evaluates to a number is kept; one that does not, or one
        // that diverged on its last step (a restore pending), is not.
        let mut tuner = AutoLrs::new(config, 1);
        search(
            &mut tuner,
            &[curves[0].clone(), curves[1].clone(), curves[1].clone()],
        );
        tuner
            .report(Report::StageTrained {
                steps: 5,
                loss: 0.3,
            })
            .unwrap();
        assert_eq!(tuner.clone().finish(0.4), None);
        let why = tuner.clone().finish(f64::NAN).unwrap();
        assert!(why.contains("validation loss is NaN"), "{why}");
        tuner
            .report(Report::StageTrained {
                steps: 1,
                loss: f64::INFINITY,
            })
            .unwrap();
        let why = tuner.finish(0.4).unwrap();
        assert!(why.contains("diverged") && why.contains("inf"), "{why}");
        assert_eq!(tuner.stages()[0].run_end.as_deref(), Some(why.as_str()));
        assert_eq!(tuner.stages().len(), 1);
    }

    #[test]
    fn search_steps_and_exploitation_steps_are_told_apart() {
        let (mut model, mut snapshot) = (Toy::new(), Toy::new());
        let mut tuner = AutoLrs::new(config(), 2);
        let actions = drive(&mut tuner, &mut model, &mut snapshot, STAGE_ACTIONS);
        for action in actions {
            let expected = match action {
                Action::TrainCandidate { .. } => Some(StepPhase::Search),
                Action::TrainStage { .. } => Some(StepPhase::Exploit),
                _ => None,
            };
            assert_eq!(action.phase(), expected, "{action:?}");
        }
    }
}
