//! Train: fetch the dataset (through the worker's cache) and the model to fine-tune,
//! resume from the job's latest checkpoint when there is one, and run the training session
//! on a blocking thread while this task streams what it produces to the server: step and
//! eval metrics in batches, AutoLRS stage records, checkpoints, log lines. Metrics up to a
//! checkpoint's step are sent before the checkpoint itself, so a resumed run re-reports
//! (and so overwrites) only steps after the checkpoint. Dropping this task (lease revoked,
//! job cancelled) stops the training thread at its next step.
//!
//! A rank of a data-parallel job (`run_rank`) does the same after meeting the other ranks
//! through the server's rendezvous and joining their all-reduce ring; rank 0 reports the
//! job's metrics and checkpoints, every rank its own step timings. When the job asks for
//! per-operator precision the ranks plan it after their first steps (`train::hybrid`) and
//! rank 0 sends the plan (`PUT …/precision-plan`), again at the end with the measured step.
//!
//! Preemption: the job's flag (set by the agent from a heartbeat answer) reaches the
//! session (and a rank's ring, so the gang agrees on the step); the session checkpoints
//! at that step and stops, the checkpoint is uploaded like any other, and the job ends
//! as `JobError::Preempted`, which `jobs::run` reports as `preempted`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::Device;
use reqwest::StatusCode;
use tessera_api::jobs::JobState;
use tessera_api::parallel::{RankDevice, RankJob, RegroupResponse, RendezvousResponse};
use tessera_api::precision::{Precision, PrecisionPlanReport};
use tessera_api::train::{OptimizerSpec, TaskType, TrainJob, TrainModel, TrainingMetrics};
use tokio::sync::mpsc;

use super::{prefetch, JobContext, JobError};
use crate::cache::Found;
use crate::client::ClientError;
use crate::collective::ring::{Hello, Ring};
use crate::collective::{self, RingFault, Transport};
use crate::train::data::{self, TaskColumns, TaskKind};
use crate::train::hybrid::Planner;
use crate::train::model::bert::BertClassifier;
use crate::train::model::mlp::Mlp;
use crate::train::model::Network;
use crate::train::optim::OptimizerKind;
use crate::train::policy;
use crate::train::session::{Event, Limits, Session, SessionError};
use crate::train::trainer::{Evaluation, Slowdown, Trainer};

/// Metric rows are sent when this many are waiting, or after `FLUSH_EVERY`.
const FLUSH_ROWS: usize = 500;
const FLUSH_EVERY: Duration = Duration::from_secs(1);

/// Sets the flag when dropped, which the training thread polls every step, and shuts a
/// rank's ring connections so a thread blocked on its neighbours stops at once.
struct CancelOnDrop(Arc<AtomicBool>, Vec<std::net::TcpStream>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
        for stream in &self.1 {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
    }
}

fn task_columns(spec: &TrainJob) -> TaskColumns {
    TaskColumns {
        kind: match spec.task.kind {
            TaskType::Classification => TaskKind::Classification,
            TaskType::Regression => TaskKind::Regression,
        },
        label: spec.task.label_column.clone(),
        features: (!spec.task.feature_columns.is_empty()).then(|| spec.task.feature_columns.clone()),
        text: spec.task.text_column.clone(),
        validation_split: spec.task.validation_split,
    }
}

pub fn optimizer_kind(spec: &OptimizerSpec) -> OptimizerKind {
    match *spec {
        OptimizerSpec::Sgd { momentum, nesterov, weight_decay } => {
            OptimizerKind::Sgd { momentum, nesterov, weight_decay }
        }
        OptimizerSpec::Adamw { betas, eps, weight_decay } => {
            OptimizerKind::AdamW { beta1: betas.0, beta2: betas.1, eps, weight_decay }
        }
    }
}

fn summary(step: u64, evaluation: &Evaluation) -> String {
    let metric = match (evaluation.accuracy, evaluation.rmse) {
        (Some(accuracy), _) => format!(", accuracy {accuracy:.4}"),
        (_, Some(rmse)) => format!(", rmse {rmse:.4}"),
        _ => String::new(),
    };
    format!("Trained {step} steps: val_loss {:.4}{metric}.", evaluation.val_loss)
}

/// One line on a precision plan: which ranks lowered how many operators and the predicted
/// step, or (at the end) the step measured under it.
fn plan_summary(report: &PrecisionPlanReport) -> String {
    match report.measured_step_ms {
        None => {
            let ranks: Vec<String> = report
                .ranks
                .iter()
                .map(|rank| {
                    let lowered = rank.ops.iter().filter(|op| op.precision < Precision::F32).count();
                    format!("rank {} ({}) {lowered} of {} operators below f32", rank.rank, rank.device, rank.ops.len())
                })
                .collect();
            let again = match report.replaced.last() {
                Some(dropped) => format!(
                    " (planned again: at step {} the ranks' compute, measured against predicted, was {})",
                    dropped.step,
                    dropped
                        .measured_ms
                        .iter()
                        .zip(&dropped.predicted_ms)
                        .enumerate()
                        .map(|(rank, (m, p))| format!("rank {rank} {m:.1}/{p:.1} ms"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                None => String::new(),
            };
            format!(
                "precision plan: {}; predicted step {:.1} ms (budget {:.1} ms){again}",
                ranks.join(", "),
                report.predicted_step_ms,
                report.budget_ms
            )
        }
        Some(measured) => format!(
            "precision plan: median step {measured:.1} ms measured under the plan, {:.1} ms predicted",
            report.predicted_step_ms
        ),
    }
}

/// Downloads the latest checkpoint's files, if the job has one.
async fn latest_checkpoint(context: &JobContext) -> Result<Option<(u64, HashMap<String, Vec<u8>>)>, JobError> {
    let Some(checkpoint) = context.client.latest_checkpoint(context.job).await? else { return Ok(None) };
    let mut files = HashMap::new();
    for file in &checkpoint.files {
        let bytes = context.client.checkpoint_file(context.job, checkpoint.step, file).await?;
        files.insert(file.name.clone(), bytes);
    }
    Ok(Some((checkpoint.step, files)))
}

/// Sends what the session produced, batching metric rows.
struct Uplink<'a> {
    context: &'a JobContext,
    pending: TrainingMetrics,
    last_flush: Instant,
    /// Reports the job's metrics, stages and checkpoints (a gang's rank 0, or a one-device run).
    leader: bool,
}

impl Uplink<'_> {
    async fn flush(&mut self) -> Result<(), JobError> {
        if !self.pending.steps.is_empty() || !self.pending.evals.is_empty() || !self.pending.ranks.is_empty() {
            let batch = std::mem::take(&mut self.pending);
            self.context.client.training_metrics(self.context.job, &batch).await?;
        }
        self.last_flush = Instant::now();
        Ok(())
    }

    async fn handle(&mut self, event: Event) -> Result<(), JobError> {
        match event {
            // The other ranks' copies of what the leader reports.
            Event::Step(_) | Event::Eval(_) | Event::Stage(_) | Event::Checkpoint(_) | Event::PrecisionPlan(_)
                if !self.leader => {}
            Event::RankStep(timing) => self.pending.ranks.push(timing),
            Event::Step(row) => self.pending.steps.push(row),
            Event::Eval(row) => {
                let line = row.values.iter().map(|(k, v)| format!("{k} {v:.4}")).collect::<Vec<_>>().join(", ");
                self.context.log(format!("step {}: {line}", row.step)).await?;
                self.pending.evals.push(row);
            }
            Event::Stage(record) => {
                self.flush().await?;
                self.context.client.lr_stage(self.context.job, &record).await?;
            }
            Event::PrecisionPlan(report) => {
                self.context.log(plan_summary(&report)).await?;
                match self.context.client.precision_plan(self.context.job, &report).await {
                    Ok(()) => {}
                    // A server from before precision plans, or a plan of many ranks past the
                    // server's body limit: the job runs on, the plan is in its log.
                    Err(ClientError::Status { status, .. })
                        if status == StatusCode::NOT_FOUND || status == StatusCode::PAYLOAD_TOO_LARGE =>
                    {
                        tracing::warn!(job = %self.context.job, %status, "the server did not store the precision plan")
                    }
                    Err(error) => return Err(error.into()),
                }
            }
            Event::Checkpoint(checkpoint) => {
                self.flush().await?;
                let size: usize = checkpoint.files.iter().map(|(_, b)| b.len()).sum();
                let files = checkpoint.files.into_iter().map(|(n, b)| (n.to_string(), b)).collect();
                self.context.client.upload_checkpoint(self.context.job, checkpoint.step, files).await?;
                self.context.log(format!("checkpoint at step {} uploaded ({size} bytes)", checkpoint.step)).await?;
            }
        }
        if self.pending.steps.len() + self.pending.evals.len() + self.pending.ranks.len() >= FLUSH_ROWS
            || self.last_flush.elapsed() >= FLUSH_EVERY
        {
            self.flush().await?;
        }
        Ok(())
    }
}

/// Where training runs: the first visible GPU in a cuda build that finds one, else the CPU.
fn training_device() -> Device {
    #[cfg(feature = "cuda")]
    if let Ok(device) = Device::new_cuda(0) {
        return device;
    }
    Device::Cpu
}

/// What a run needs before its session is built: the dataset's bytes, the model's
/// folder (fine-tuning) and the checkpoint to resume from.
struct Inputs {
    bytes: Vec<u8>,
    model_folder: Option<std::path::PathBuf>,
    resume: Option<(u64, HashMap<String, Vec<u8>>)>,
}

async fn fetch_data(context: &JobContext, spec: &TrainJob) -> Result<(Vec<u8>, Option<std::path::PathBuf>), JobError> {
    let (bytes, found) = context.dataset(&spec.dataset).await?;
    let from = match found {
        Found::Cached => "from this worker's cache",
        Found::Fetched => "from the server",
    };
    let (id, rows) = (spec.dataset.id, spec.dataset.rows);
    context.log(format!("dataset {id} fetched {from} ({} bytes, {rows} rows)", bytes.len())).await?;
    let model_folder = match &spec.model {
        TrainModel::Registered { id, .. } => Some(prefetch::fetch(context, *id).await?.0),
        TrainModel::Mlp { .. } => None,
    };
    Ok((bytes, model_folder))
}

async fn fetch_checkpoint(context: &JobContext) -> Result<Option<(u64, HashMap<String, Vec<u8>>)>, JobError> {
    let resume = latest_checkpoint(context).await?;
    if let Some((step, _)) = &resume {
        context.log(format!("resuming from the checkpoint at step {step}")).await?;
    }
    Ok(resume)
}

/// Builds the session (on the calling thread: it parses and loads), resumed when
/// `inputs` hold a checkpoint.
fn build_session(spec: &TrainJob, inputs: Inputs, device: &Device) -> Result<Session, JobError> {
    let columns = task_columns(spec);
    let table = data::Table::read(&inputs.bytes, spec.dataset.format)?;
    let prepared = Arc::new(data::prepare(&table, &columns, spec.seed)?);
    // The server checked these sizes, but not for a job queued by an older server; past
    // them an allocation fails and aborts the worker, then every worker the job reaches.
    let too_large = |error: tessera_api::train::SpecError| JobError::Train(format!("the job is too large: {error}"));
    // As the loader clamps it.
    let batch = (spec.batch_size as usize).min(prepared.train.len()) as u64;
    let network: Box<dyn Network> = match (&spec.model, &inputs.model_folder) {
        (TrainModel::Mlp { hidden }, _) => {
            let hidden: Vec<usize> = hidden.iter().map(|&h| h as usize).collect();
            let outputs = if columns.kind == TaskKind::Classification { prepared.classes.len() } else { 1 };
            let widths: Vec<u64> = std::iter::once(prepared.input_dim())
                .chain(hidden.iter().copied())
                .chain([outputs])
                .map(|width| width as u64)
                .collect();
            tessera_api::train::check_mlp(&widths, batch).map_err(too_large)?;
            Box::new(Mlp::new(prepared.input_dim(), &hidden, outputs, spec.seed, device)?)
        }
        (TrainModel::Registered { .. }, folder) => {
            let folder = folder.as_ref().expect("the model folder is fetched first");
            let model = BertClassifier::load(folder, &prepared, columns.kind, spec.seed, device)?;
            tessera_api::train::check_activations(batch, model.activations_per_row()).map_err(too_large)?;
            Box::new(model)
        }
    };
    let trainer = Trainer::new(
        network,
        optimizer_kind(&spec.optimizer),
        prepared,
        columns.kind,
        spec.batch_size as usize,
        spec.seed,
        device.clone(),
    )?;
    let policy = policy::build(&spec.lr_schedule, spec.max_steps, spec.seed);
    let limits =
        Limits { max_steps: spec.max_steps, eval_every: spec.eval_every, checkpoint_every: spec.checkpoint_every };
    let mut session = Session::new(trainer, policy, limits);
    if let Some((_, files)) = &inputs.resume {
        session.resume(files, device)?;
    }
    Ok(session)
}

pub async fn run(context: &JobContext, spec: TrainJob) -> Result<String, JobError> {
    context.client.status(context.job, JobState::Running, None, None).await?;
    let (bytes, model_folder) = fetch_data(context, &spec).await?;
    let resume = fetch_checkpoint(context).await?;
    let device = training_device();
    context.log(format!("training on {}", if device.is_cuda() { "CUDA device 0" } else { "the CPU" })).await?;
    let setup_spec = spec.clone();
    let session = tokio::task::spawn_blocking(move || {
        build_session(&setup_spec, Inputs { bytes, model_folder, resume }, &device)
    })
    .await
    .map_err(|e| JobError::Train(format!("the set-up thread panicked: {e}")))??;
    context.log(format!("training from step {} to {}", session.step(), spec.max_steps)).await?;
    let session = session.with_preemption(context.preempt().flag());
    let (session, outcome, _) = drive(context, session, None, Vec::new(), true).await?;
    match outcome {
        Ok(evaluation) => Ok(summary(session.step(), &evaluation)),
        Err(SessionError::Preempted { step }) => Err(JobError::Preempted { step }),
        Err(error) => Err(error.into()),
    }
}

/// Runs the session on a blocking thread (inside `pool` when given) and streams what it
/// produces; `leader`: this run reports the job's metrics and checkpoints (a gang's other
/// ranks report only their timings). `breakers` are shut down if this task is dropped.
/// Gives the session back with how its run ended and when it stopped (before the uploads
/// that followed).
async fn drive(
    context: &JobContext,
    session: Session,
    pool: Option<Arc<rayon::ThreadPool>>,
    breakers: Vec<std::net::TcpStream>,
    leader: bool,
) -> Result<(Session, Result<Evaluation, SessionError>, Instant), JobError> {
    let cancel = Arc::new(AtomicBool::new(false));
    let _cancel_on_drop = CancelOnDrop(cancel.clone(), breakers);
    let (sender, mut events) = mpsc::unbounded_channel();
    let thread_cancel = cancel.clone();
    let training = tokio::task::spawn_blocking(move || {
        let mut session = session;
        let mut run = || {
            session.run(&thread_cancel, &mut |event| {
                let _ = sender.send(event);
            })
        };
        let outcome = match &pool {
            Some(pool) => pool.install(run),
            None => run(),
        };
        (session, outcome, Instant::now())
    });
    let mut uplink = Uplink { context, pending: TrainingMetrics::default(), last_flush: Instant::now(), leader };
    let mut tick = tokio::time::interval(FLUSH_EVERY);
    loop {
        tokio::select! {
            event = events.recv() => match event {
                Some(event) => uplink.handle(event).await?,
                None => break,
            },
            _ = tick.tick() => uplink.flush().await?,
        }
    }
    uplink.flush().await?;
    training.await.map_err(|e| JobError::Train(format!("the training thread panicked: {e}")))
}

/// How long a rank waits on a silent neighbour before calling it dead (its lease and the
/// breakers usually tell sooner). Not while the leader evaluates the whole validation
/// split: the others wait on its result without a time-out (`Ring::broadcast_unhurried`).
const RING_TIMEOUT: Duration = Duration::from_secs(300);
/// How often a rank asks whether its gang formed.
const RENDEZVOUS_POLL: Duration = Duration::from_millis(250);

/// Where a rank trains: CPU ranks (and ranks on simulated slices) on the CPU, CUDA ranks
/// on the worker's first GPU. A real MIG slice needs a process confined to it, which
/// training does not have yet.
fn rank_device(context: &JobContext, rank: &RankJob) -> Result<Device, JobError> {
    match (&rank.device.device, &rank.device.slice) {
        (_, Some(profile)) => {
            let simulated =
                context.offered.iter().any(|s| s.profile.as_deref() == Some(profile.as_str()) && s.simulated);
            if simulated {
                Ok(Device::Cpu)
            } else {
                Err(JobError::Train(format!(
                    "training ranks on real MIG slices ({profile}) need a process confined to the slice, which is not built yet"
                )))
            }
        }
        (Some(RankDevice::Cuda), None) => {
            let device = training_device();
            if device.is_cuda() || context.offered.iter().all(|s| s.simulated) {
                Ok(device)
            } else {
                Err(JobError::Train("this worker build has no CUDA; run a cuda build for CUDA ranks".into()))
            }
        }
        _ => Ok(Device::Cpu),
    }
}

/// This rank's place in its gang's ring: the ring's generation, its rank, every rank's
/// address (the world is their number).
struct Member {
    generation: u32,
    rank: u32,
    peers: Vec<String>,
}

/// A listener for this rank's ring neighbour, and the address to post for it.
fn listen(context: &JobContext) -> Result<(std::net::TcpListener, String), JobError> {
    let listener = std::net::TcpListener::bind((context.host().as_str(), 0))?;
    let address = format!("{}:{}", context.host(), listener.local_addr()?.port());
    Ok((listener, address))
}

/// Posts `address` at `…/regroup` until the answer is more than "wait".
async fn regroup(context: &JobContext, address: &str, generation: u32) -> Result<RegroupResponse, JobError> {
    loop {
        match context.client.regroup(context.job, address, generation).await? {
            RegroupResponse::Waiting => tokio::time::sleep(RENDEZVOUS_POLL).await,
            answer => return Ok(answer),
        }
    }
}

/// One rank of a data-parallel job: meet the other ranks through the server, fetch the
/// data, resume from the gang's latest checkpoint, join the ring and train on this
/// rank's share of every global batch. A lost ring neighbour ends the run as
/// `RankLost`, which leaves the gang's recovery to the server.
///
/// In-place resizes (`store::regroup` in the server): when the session stops at a step
/// the ranks agreed on, the rank asks the server whether its gang regroups. If so it keeps
/// its session (weights, optimizer, data position, schedule), joins the new world's ring
/// and trains on, or leaves when it is not in the new world; otherwise the stop was a
/// preemption. A rank joining a running gang readies its session first, so the gang
/// trains on while it loads, and resumes from the checkpoint rank 0 takes at the stop.
pub async fn run_rank(context: &JobContext, rank: RankJob) -> Result<String, JobError> {
    let spec = rank.train.clone();
    let device = rank_device(context, &rank)?;
    let (mut listener, address) = listen(context)?;
    let (mut member, session) = match rank.joining {
        true => join(context, &spec, &device, &address).await?,
        false => meet(context, &rank, &spec, &device, &address).await?,
    };
    let threads = rank.device.threads;
    let slowdown = Slowdown::new(context.test_slowdown);
    let planner = spec.parallel.as_ref().and_then(|p| p.precision.clone()).map(|precision| {
        Planner::new(precision, spec.seed, device_label(&device, threads.map(|n| n as usize), &slowdown))
    });
    let preempt = context.preempt();
    let mut session = session.with_preemption(preempt.flag());
    if let Some(planner) = planner {
        session = session.with_planner(planner);
    }
    let pool = match threads {
        Some(n) => Some(Arc::new(
            rayon::ThreadPoolBuilder::new()
                .num_threads(n as usize)
                .build()
                .map_err(|e| JobError::Train(format!("cannot start {n} training threads: {e}")))?,
        )),
        None => None,
    };
    // When the session last stopped for a regroup: the pause is logged once the ring is back.
    let mut stopped_at: Option<(u64, Instant)> = None;
    loop {
        let world = member.peers.len();
        let hello = Hello {
            gang: rank.gang,
            generation: member.generation,
            world: world as u32,
            rank: member.rank,
            start_step: session.step(),
        };
        let (ring_device, ring_preempt, peers) = (device.clone(), preempt.flag(), member.peers.clone());
        let slowdown = slowdown.clone();
        let setup = tokio::task::spawn_blocking(
            move || -> Result<(Session, Vec<std::net::TcpStream>, RingFault, Transport), JobError> {
                let ring =
                    Ring::connect(&listener, &peers, hello, RING_TIMEOUT).map_err(|e| JobError::RankLost(e.to_string()))?;
                let breakers = ring.breakers()?;
                // NCCL when every rank is a CUDA GPU in an `nccl` build, else the ring itself.
                let (sync, fault, transport) =
                    collective::for_gang(ring, &ring_device, RING_TIMEOUT, ring_preempt).map_err(|e| {
                        if e.is_rank_lost() {
                            JobError::RankLost(e.to_string())
                        } else {
                            JobError::Train(e.to_string())
                        }
                    })?;
                let session = Session::with_trainer(session, |trainer| trainer.with_sync(sync).with_slowdown(slowdown));
                Ok((session, breakers, fault, transport))
            },
        );
        let (ready, breakers, fault, transport) =
            setup.await.map_err(|e| JobError::Train(format!("the set-up thread panicked: {e}")))??;
        if let Some((step, at)) = stopped_at.take() {
            let paused = at.elapsed().as_secs_f64();
            context.log(format!("rank {} re-formed in place {paused:.2} s after stopping at step {step}", member.rank)).await?;
        }
        let transport = match transport {
            Transport::Nccl => "NCCL (GPU to GPU)",
            Transport::Ring => "the host-staged TCP ring",
        };
        context
            .log(format!(
                "rank {} of {world} (attempt {}) all-reduces its gradients over {transport}; training from step {} to {}",
                member.rank,
                member.generation,
                ready.step(),
                spec.max_steps
            ))
            .await?;
        let (stopped, outcome, at) = drive(context, ready, pool.clone(), breakers, member.rank == 0).await?;
        session = stopped;
        let step = match outcome {
            Ok(evaluation) => return Ok(summary(session.step(), &evaluation)),
            Err(SessionError::Preempted { step }) => step,
            Err(error) => {
                return match fault.get() {
                    Some(reason) => Err(JobError::RankLost(reason.clone())),
                    None => Err(error.into()),
                }
            }
        };
        // Stopped at an agreed step: a regroup, or a preemption.
        let (next_listener, address) = listen(context)?;
        listener = next_listener;
        match regroup(context, &address, member.generation).await? {
            RegroupResponse::Formed { generation, rank, world, peers } => {
                preempt.resume();
                stopped_at = Some((step, at));
                context
                    .log(format!(
                        "regrouped in place at step {step}: rank {} of {} is now rank {rank} of {world}",
                        member.rank,
                        member.peers.len()
                    ))
                    .await?;
                member = Member { generation, rank, peers };
            }
            RegroupResponse::Leave => return Err(JobError::LeftGang { step }),
            RegroupResponse::Stop | RegroupResponse::Waiting => return Err(JobError::Preempted { step }),
        }
    }
}

/// A rank of a forming gang: meet the others first, then fetch and build the session.
async fn meet(
    context: &JobContext,
    rank: &RankJob,
    spec: &TrainJob,
    device: &Device,
    address: &str,
) -> Result<(Member, Session), JobError> {
    // Meet first, fetch after: the rendezvous clock runs from the first rank's claim, and a
    // large model's download must not let it run out (the ring waits RING_TIMEOUT instead).
    let (generation, peers) = loop {
        match context.client.rendezvous(context.job, address).await? {
            RendezvousResponse::Formed { generation, peers } => break (generation, peers),
            RendezvousResponse::Waiting => tokio::time::sleep(RENDEZVOUS_POLL).await,
        }
    };
    context
        .log(format!(
            "rank {} of {} joined attempt {generation} at {address} on {}",
            rank.rank,
            rank.world,
            describe(device)
        ))
        .await?;
    let (bytes, model_folder) = fetch_data(context, spec).await?;
    let resume = fetch_checkpoint(context).await?;
    let (spec, device) = (spec.clone(), device.clone());
    let session = tokio::task::spawn_blocking(move || build_session(&spec, Inputs { bytes, model_folder, resume }, &device))
        .await
        .map_err(|e| JobError::Train(format!("the set-up thread panicked: {e}")))??;
    Ok((Member { generation, rank: rank.rank, peers }, session))
}

/// A rank joining a running gang: build the session first (the gang trains on), then post
/// and, once the gang stopped and the new world formed, load the checkpoint of that stop.
async fn join(context: &JobContext, spec: &TrainJob, device: &Device, address: &str) -> Result<(Member, Session), JobError> {
    let (bytes, model_folder) = fetch_data(context, spec).await?;
    let (setup_spec, setup_device) = (spec.clone(), device.clone());
    let session = tokio::task::spawn_blocking(move || {
        build_session(&setup_spec, Inputs { bytes, model_folder, resume: None }, &setup_device)
    })
    .await
    .map_err(|e| JobError::Train(format!("the set-up thread panicked: {e}")))??;
    context.log(format!("joining the running gang on {}: ready, waiting for it to stop", describe(device))).await?;
    let member = match regroup(context, address, 0).await? {
        RegroupResponse::Formed { generation, rank, peers, .. } => Member { generation, rank, peers },
        // The gang was preempted meanwhile (its joining ranks are gone): nothing to report.
        _ => return Err(JobError::Client(ClientError::LeaseLost)),
    };
    let Some((step, files)) = fetch_checkpoint(context).await? else {
        return Err(JobError::Train("the gang regrouped without a checkpoint to join from".into()));
    };
    let device = device.clone();
    let session = tokio::task::spawn_blocking(move || {
        let mut session = session;
        session.resume(&files, &device).map(|()| session)
    })
    .await
    .map_err(|e| JobError::Train(format!("the set-up thread panicked: {e}")))??;
    debug_assert_eq!(session.step(), step);
    Ok((member, session))
}

/// The rank's device in words for its precision plan: `cpu, 4 threads`, `cuda:0`, with a
/// test slowdown named.
fn device_label(device: &Device, threads: Option<usize>, slowdown: &Slowdown) -> String {
    let mut label = match (device.is_cuda(), threads.unwrap_or_else(rayon::current_num_threads)) {
        (true, _) => "cuda:0".to_string(),
        (false, 1) => "cpu, 1 thread".to_string(),
        (false, n) => format!("cpu, {n} threads"),
    };
    if slowdown.factor() > 1.0 {
        label += &format!(", test slowdown {}×", slowdown.factor());
    }
    label
}

fn describe(device: &Device) -> &'static str {
    if device.is_cuda() {
        "CUDA device 0"
    } else {
        "the CPU"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A classification job on `f` → `y` of eight rows, with the given MLP widths.
    fn job(hidden: Vec<u32>, feature: &str) -> TrainJob {
        serde_json::from_value(serde_json::json!({
            "model": {"kind": "mlp", "hidden": hidden},
            "dataset": {"id": "00000000-0000-0000-0000-000000000000", "digest": "sha256:0", "format": "csv",
                        "columns": [], "rows": 8},
            "task": {"type": "classification", "label_column": "y", "feature_columns": [feature],
                     "validation_split": 0.25},
            "optimizer": {"type": "sgd"}, "batch_size": 4, "max_steps": 10, "eval_every": 5, "checkpoint_every": 5,
            "lr_schedule": {"type": "constant", "lr": 0.1}, "seed": 1
        }))
        .unwrap()
    }

    fn build(spec: &TrainJob, csv: &str) -> Result<Session, JobError> {
        let inputs = Inputs { bytes: csv.as_bytes().to_vec(), model_folder: None, resume: None };
        build_session(spec, inputs, &Device::Cpu)
    }

    const CSV: &str = "f,y\n1,0\n2,1\n3,0\n4,1\n5,0\n6,1\n7,0\n8,1\n";

    #[test]
    fn an_mlp_too_large_to_allocate_fails_the_job_before_building_it() {
        // Queued by a server that did not check sizes: 64 billion parameters would abort the worker.
        let error = build(&job(vec![65_536; 16], "f"), CSV).err().expect("refused");
        assert!(matches!(&error, JobError::Train(message) if message.contains("model.hidden")), "{error}");
        build(&job(vec![8], "f"), CSV).map(|_| ()).unwrap();
    }

    #[test]
    fn the_dataset_is_read_in_the_format_the_server_recorded() {
        // CSV whose first column name starts with a brace, which sniffing took for JSONL.
        build(&job(vec![8], "{f}"), &CSV.replacen("f,y", "{f},y", 1)).map(|_| ()).unwrap();
    }
}
