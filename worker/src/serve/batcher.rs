//! The batching queue of one replica (TEI's design, `core/src/queue.rs`): requests wait in
//! a queue bounded by tokens and by estimated wait; a batching task packs them into
//! batches under a token budget and a request cap, while the previous batch is computing
//! on its own thread; requests whose client went away are dropped before they are computed.
//!
//! Admission sheds load instead of letting it queue: a request is refused at once (429,
//! `Retry-After`) when the work ahead of it, at the replica's measured tokens/s, would keep
//! it waiting past `Admission::max_queue_wait_ms`, so an overloaded replica answers in
//! bounded time and computes only what it can still answer in time.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tessera_api::deployments::BatchLimits;
use tessera_api::engine::Timings;
use tokio::sync::{mpsc, oneshot};

use crate::engine::{Batch, EmbeddingModel, EngineError};

/// What a replica computes for its model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Task {
    Embed,
    Classify,
}

/// What one replica takes on: the worker's flags (README, "Limits"), the same for every
/// replica it serves, passed on to its engine processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::Args)]
pub struct Admission {
    /// Longest a request may be expected to wait for its batch to start, in milliseconds
    /// (the tokens ahead of it at the replica's measured tokens/s); a request that would
    /// wait longer is refused at once with 429 and `Retry-After`.
    #[arg(long, env = "TESSERA_MAX_QUEUE_WAIT_MS", default_value_t = Admission::DEFAULT.max_queue_wait_ms)]
    pub max_queue_wait_ms: u64,
    /// Most inputs one request may hold (413 beyond).
    #[arg(long, env = "TESSERA_MAX_REQUEST_INPUTS", default_value_t = Admission::DEFAULT.max_request_inputs,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_request_inputs: u32,
    /// Most tokens one request may hold, all inputs together after tokenization (413
    /// beyond).
    #[arg(long, env = "TESSERA_MAX_REQUEST_TOKENS", default_value_t = Admission::DEFAULT.max_request_tokens,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_request_tokens: u32,
}

impl Admission {
    /// OpenAI's input cap (2048); 64k tokens are a few seconds of a CPU replica's work.
    pub const DEFAULT: Admission = Admission { max_queue_wait_ms: 3000, max_request_inputs: 2048, max_request_tokens: 65_536 };

    pub fn max_queue_wait(&self) -> Duration {
        Duration::from_millis(self.max_queue_wait_ms)
    }
}

impl Default for Admission {
    fn default() -> Admission {
        Admission::DEFAULT
    }
}

/// Tokens that may wait per replica, as a multiple of the batch's token budget (and never
/// fewer than one request of the largest size admitted).
const QUEUED_BATCHES: usize = 8;

/// How many of the latest computed tokens the throughput measure remembers, in batch
/// budgets: a run of small batches under light load does not erase what full batches
/// measured, but a lasting change of the replica's speed shows within a few batches.
const MEASURED_BATCHES: f64 = 4.0;

/// One client request, already tokenized.
pub struct Request {
    pub sequences: Vec<Vec<u32>>,
    pub tokenization_us: u64,
    /// When it joined the queue, tokenized (its queue time counts from here).
    pub enqueued: Instant,
}

impl Request {
    pub fn tokens(&self) -> usize {
        self.sequences.iter().map(Vec::len).sum()
    }
}

/// A queued request, answered through `reply`.
struct Job {
    request: Request,
    /// Its tokens while they count as queued (`Ticket`).
    ticket: Arc<Ticket>,
    /// The answer, or why the batch could not be computed (inputs were checked before
    /// they were queued, so this is the engine's failure, not the client's).
    reply: oneshot::Sender<Result<Answer, String>>,
}

impl Job {
    fn tokens(&self) -> usize {
        self.request.tokens()
    }
}

#[derive(Debug)]
pub struct Answer {
    pub outputs: Vec<Vec<f32>>,
    pub timings: Timings,
}

#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error(
        "The replica is at capacity: about {:.1} s of work is queued ahead (the limit is {:.1} s); retry in {retry_after_secs} s.",
        wait.as_secs_f64(), limit.as_secs_f64()
    )]
    Overloaded { wait: Duration, limit: Duration, retry_after_secs: u64 },
    #[error("The request holds {tokens} tokens; a request may hold at most {max} (max_request_tokens): send fewer or shorter inputs.")]
    TooManyTokens { tokens: usize, max: usize },
    #[error("the replica is shutting down")]
    Closed,
}

/// The replica's load, shared by admission, the compute thread and pending requests.
struct Load {
    /// Tokens admitted and not yet computing (their clients still waiting).
    queued_tokens: usize,
    /// The batch computing now: when it started and its tokens.
    computing: Option<(Instant, usize)>,
    throughput: Throughput,
    failing: Failing,
}

/// Batches the engine failed in a row (not for their inputs: a device error, or a panic
/// on a batch of several requests), when the first and the latest of them started, and
/// the last error; cleared by a batch that succeeds.
#[derive(Default)]
struct Failing {
    batches: u32,
    first: Option<Instant>,
    latest: Option<Instant>,
    last: String,
}

/// A replica whose engine failed this many batches in a row, the first and the latest at
/// least [`BROKEN_FOR`] apart, is broken (a lost device, a sticky CUDA error): it stops
/// serving, so the server restarts it, rather than answering every request it attracts
/// with a 500. A burst of failures that then stops is not: there is no later evidence.
const BROKEN_BATCHES: u32 = 5;
const BROKEN_FOR: Duration = Duration::from_secs(10);

/// Watches whether a replica's engine still computes (see [`BROKEN_BATCHES`]).
#[derive(Clone)]
pub struct Health(Arc<Mutex<Load>>);

impl Health {
    /// Why the replica should stop serving; `None` while it computes.
    pub fn why_broken(&self) -> Option<String> {
        let load = self.0.lock().expect("load lock");
        let failing = &load.failing;
        let lasted = failing.latest?.saturating_duration_since(failing.first?);
        (failing.batches >= BROKEN_BATCHES && lasted >= BROKEN_FOR).then(|| {
            format!(
                "the engine failed its last {} batches over {:.0} s (the last: {}); the replica stopped serving",
                failing.batches,
                lasted.as_secs_f64(),
                failing.last
            )
        })
    }

    /// Waits until the replica is broken, and says why.
    pub async fn broken(&self) -> String {
        loop {
            if let Some(why) = self.why_broken() {
                return why;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
}

/// Tokens/s over the latest computed tokens: a moving average of each batch's rate in
/// which a batch weighs by its tokens, seeded with a prior (the warm-up batch's rate).
#[derive(Debug, Clone, Copy)]
struct Throughput {
    per_second: f64,
    memory_tokens: f64,
}

impl Throughput {
    fn record(&mut self, tokens: usize, secs: f64) {
        if tokens == 0 || secs <= 0.0 {
            return;
        }
        let keep = (-(tokens as f64) / self.memory_tokens).exp();
        self.per_second = self.per_second * keep + (tokens as f64 / secs) * (1.0 - keep);
    }

    fn per_second(&self) -> f64 {
        self.per_second.max(1.0)
    }
}

impl Load {
    /// How long a request admitted now would wait for its batch to start: what is left of
    /// the computing batch and the queued tokens, at the measured rate. It counts the
    /// tokens that would share its batch as ahead of it, so it errs on the long side by at
    /// most one batch.
    fn wait(&self, now: Instant) -> Duration {
        let rate = self.throughput.per_second();
        let computing = self.computing.map_or(0.0, |(started, tokens)| {
            (tokens as f64 / rate - now.saturating_duration_since(started).as_secs_f64()).max(0.0)
        });
        Duration::from_secs_f64(computing + self.queued_tokens as f64 / rate)
    }
}

/// A request's tokens while they count as queued: released once, when its batch starts
/// or when its client goes away, whichever comes first.
struct Ticket {
    tokens: std::sync::atomic::AtomicUsize,
    load: Arc<Mutex<Load>>,
}

impl Ticket {
    fn release_in(&self, load: &mut Load) {
        let tokens = self.tokens.swap(0, std::sync::atomic::Ordering::AcqRel);
        load.queued_tokens -= tokens;
    }
}

/// An admitted request's answer to come. Dropping it (the client went away) takes its
/// tokens off the queue's estimate at once, and the request is dropped before it is
/// batched.
pub struct Pending {
    answer: oneshot::Receiver<Result<Answer, String>>,
    ticket: Arc<Ticket>,
}

impl Pending {
    /// The answer; `None` when the replica stopped before computing it.
    pub async fn answer(mut self) -> Option<Result<Answer, String>> {
        (&mut self.answer).await.ok()
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let mut load = self.ticket.load.lock().expect("load lock");
        self.ticket.release_in(&mut load);
    }
}

/// The sending side of a replica's queue.
#[derive(Clone)]
pub struct Queue {
    sender: mpsc::UnboundedSender<Job>,
    load: Arc<Mutex<Load>>,
    admission: Admission,
    max_queued_tokens: usize,
}

impl Queue {
    /// Starts the batching task and the compute thread for `model`. Batches keep within
    /// `limits`, requests within `admission`; `prior_tokens_per_s` (the warm-up batch's)
    /// estimates waits until the first batches are measured.
    pub fn start(model: Arc<EmbeddingModel>, task: Task, limits: BatchLimits, admission: Admission, prior_tokens_per_s: f64) -> Queue {
        let limits = compute_limits(&model, limits);
        Queue::with_compute(limits, admission, prior_tokens_per_s, move |sequences: &[&[u32]]| run(&model, task, sequences))
    }

    /// Starts the batching task and a compute thread that runs `compute` on each batch's
    /// sequences (one output per sequence, in order). `start` passes the model; tests pass
    /// a compute they can hold back.
    pub fn with_compute<F>(limits: BatchLimits, admission: Admission, prior_tokens_per_s: f64, compute: F) -> Queue
    where
        F: FnMut(&[&[u32]]) -> Result<Vec<Vec<f32>>, EngineError> + Send + 'static,
    {
        let budget = limits.max_batch_tokens as usize;
        let prior = Throughput { per_second: prior_tokens_per_s, memory_tokens: MEASURED_BATCHES * budget as f64 };
        let load = Arc::new(Mutex::new(Load { queued_tokens: 0, computing: None, throughput: prior, failing: Failing::default() }));
        let (sender, receiver) = mpsc::unbounded_channel();
        // The compute thread says when it is free; only then does a batch go to it.
        let (batches, compute_side) = mpsc::channel::<Vec<Job>>(1);
        let (idle, idle_side) = mpsc::unbounded_channel();
        tokio::spawn(form_batches(receiver, batches, idle_side, limits));
        let measured = load.clone();
        std::thread::Builder::new()
            .name("tessera-compute".into())
            .spawn(move || compute_batches(compute_side, idle, &measured, compute))
            .expect("spawning the compute thread");
        let max_queued_tokens = (QUEUED_BATCHES * budget).max(admission.max_request_tokens as usize);
        Queue { sender, load, admission, max_queued_tokens }
    }

    pub fn admission(&self) -> Admission {
        self.admission
    }

    /// A watch on whether the engine behind this queue still computes.
    pub fn health(&self) -> Health {
        Health(self.load.clone())
    }

    /// Tokens admitted whose batch has not started, their clients still waiting.
    pub fn queued_tokens(&self) -> usize {
        self.load.lock().expect("load lock").queued_tokens
    }

    /// Queues `request`, or refuses it at once: over the per-request token cap, or when
    /// it would wait past the wait limit or take the queue past its token bound.
    pub fn submit(&self, request: Request) -> Result<Pending, SubmitError> {
        let tokens = request.tokens();
        let max = self.admission.max_request_tokens as usize;
        if tokens > max {
            return Err(SubmitError::TooManyTokens { tokens, max });
        }
        let mut load = self.load.lock().expect("load lock");
        self.refusal(&load, tokens)?;
        let ticket = Arc::new(Ticket { tokens: tokens.into(), load: self.load.clone() });
        let (reply, answer) = oneshot::channel();
        self.sender.send(Job { request, ticket: ticket.clone(), reply }).map_err(|_| SubmitError::Closed)?;
        load.queued_tokens += tokens;
        drop(load);
        Ok(Pending { answer, ticket })
    }

    /// Refuses at once when the work already queued would keep any request waiting past
    /// the wait limit. The endpoint asks before it tokenizes, so under overload a request
    /// costs the replica no tokenization before its 429 (`submit` checks again, with the
    /// request's own tokens).
    pub fn check(&self) -> Result<(), SubmitError> {
        self.refusal(&self.load.lock().expect("load lock"), 0)
    }

    /// Why a request of `tokens` cannot be queued now, if it cannot: it would wait past
    /// the wait limit or take the queue past its token bound.
    fn refusal(&self, load: &Load, tokens: usize) -> Result<(), SubmitError> {
        let limit = self.admission.max_queue_wait();
        let wait = load.wait(Instant::now());
        let over_bound = load.queued_tokens + tokens > self.max_queued_tokens;
        if wait <= limit && !over_bound {
            return Ok(());
        }
        // When the queue, draining at the measured rate, will have room for it.
        let rate = load.throughput.per_second();
        let excess = (wait.saturating_sub(limit).as_secs_f64())
            .max((load.queued_tokens + tokens).saturating_sub(self.max_queued_tokens) as f64 / rate);
        let retry_after_secs = (excess.ceil() as u64).max(1);
        Err(SubmitError::Overloaded { wait, limit, retry_after_secs })
    }
}

/// The batch limits a replica of `model` batches under: the deployment's, with the token
/// budget cut to the model's pass size where it has one (on the CPU), so a batch is one
/// pass and a request waits for no more than that behind it.
pub fn compute_limits(model: &EmbeddingModel, limits: BatchLimits) -> BatchLimits {
    match model.pass_tokens() {
        Some(pass) => BatchLimits { max_batch_tokens: limits.max_batch_tokens.min(pass.try_into().unwrap_or(u32::MAX)), ..limits },
        None => limits,
    }
}

/// The next batch, open while the current one computes: it takes each request as it
/// arrives, in order, up to the request cap and the token budget, and goes to the compute
/// thread the moment that thread is free. So a burst that arrives during one batch is
/// computed together as the next (TEI's batching task waits on its `notify` the same way);
/// what does not fit waits in the queue.
async fn form_batches(
    mut receiver: mpsc::UnboundedReceiver<Job>,
    batches: mpsc::Sender<Vec<Job>>,
    mut idle: mpsc::UnboundedReceiver<()>,
    limits: BatchLimits,
) {
    let mut next = Forming { jobs: Vec::new(), tokens: 0, carried: None, limits };
    let (mut compute_idle, mut closed) = (false, false);
    loop {
        if compute_idle {
            while next.has_room() {
                let Ok(job) = receiver.try_recv() else { break };
                next.admit(job);
            }
            let batch = next.take();
            if !batch.is_empty() {
                if batches.send(batch).await.is_err() {
                    return;
                }
                compute_idle = false;
                continue;
            }
            if !next.is_empty() {
                // Every request of the batch left; the one it carried starts the next at once.
                continue;
            }
        }
        if closed && next.is_empty() {
            return;
        }
        tokio::select! {
            Some(()) = idle.recv(), if !compute_idle => compute_idle = true,
            job = receiver.recv(), if !closed && next.has_room() => match job {
                Some(job) => next.admit(job),
                None => closed = true,
            },
            else => return,
        }
    }
}

/// The batch being formed: requests in arrival order within the limits, and the one that
/// would have gone over the token budget, which starts the batch after. A request over the
/// budget on its own is a batch of its own.
struct Forming {
    jobs: Vec<Job>,
    tokens: usize,
    carried: Option<Job>,
    limits: BatchLimits,
}

impl Forming {
    fn has_room(&self) -> bool {
        self.carried.is_none() && self.jobs.len() < self.limits.max_batch_requests as usize
    }

    fn is_empty(&self) -> bool {
        self.jobs.is_empty() && self.carried.is_none()
    }

    fn admit(&mut self, job: Job) {
        if job.reply.is_closed() {
            return;
        }
        if !self.jobs.is_empty() && self.tokens + job.tokens() > self.limits.max_batch_tokens as usize {
            self.carried = Some(job);
            return;
        }
        self.tokens += job.tokens();
        self.jobs.push(job);
    }

    /// The batch, less the requests whose client went away meanwhile; the carried request
    /// starts the next one.
    fn take(&mut self) -> Vec<Job> {
        let batch = std::mem::take(&mut self.jobs).into_iter().filter(|job| !job.reply.is_closed()).collect();
        self.tokens = 0;
        if let Some(job) = self.carried.take() {
            self.admit(job);
        }
        batch
    }
}

/// Computes each batch it is given and measures the replica's tokens/s for admission.
fn compute_batches<F>(mut batches: mpsc::Receiver<Vec<Job>>, idle: mpsc::UnboundedSender<()>, load: &Mutex<Load>, mut compute: F)
where
    F: FnMut(&[&[u32]]) -> Result<Vec<Vec<f32>>, EngineError>,
{
    while idle.send(()).is_ok() {
        let Some(jobs) = batches.blocking_recv() else { return };
        // A client may have gone while the batch waited for the compute thread.
        let jobs: Vec<Job> = jobs.into_iter().filter(|job| !job.reply.is_closed()).collect();
        if jobs.is_empty() {
            continue;
        }
        let sequences: Vec<&[u32]> = jobs.iter().flat_map(|j| j.request.sequences.iter().map(Vec::as_slice)).collect();
        let tokens = sequences.iter().map(|s| s.len()).sum::<usize>();
        let started = Instant::now();
        {
            let mut load = load.lock().expect("load lock");
            for job in &jobs {
                job.ticket.release_in(&mut load);
            }
            load.computing = Some((started, tokens));
        }
        // A panic in the engine fails its batch, not the replica (its queue would close, and
        // a retried request would take the next replica down with it).
        let computed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| compute(&sequences)));
        let (result, engine_fault) = match computed {
            Ok(Ok(outputs)) => (Ok(outputs), false),
            Ok(Err(e)) => (Err(e.to_string()), !e.is_input_error()),
            // One request alone that panics the engine is that request's trouble.
            Err(_) => {
                let error = "the engine failed on this batch (a panic); the worker's log has the details".to_string();
                (Err(error), jobs.len() > 1)
            }
        };
        let elapsed = started.elapsed();
        {
            let mut load = load.lock().expect("load lock");
            load.computing = None;
            match &result {
                Ok(_) => {
                    load.throughput.record(tokens, elapsed.as_secs_f64());
                    load.failing = Failing::default();
                }
                Err(error) if engine_fault => {
                    let failing = &mut load.failing;
                    failing.batches += 1;
                    failing.first.get_or_insert(started);
                    failing.latest = Some(started);
                    failing.last.clone_from(error);
                }
                Err(_) => {}
            }
        }
        let inference_us = elapsed.as_micros() as u64;
        let batch_tokens = tokens as u32;
        let batch_size = jobs.len() as u32;
        match result {
            Ok(mut outputs) => {
                for job in jobs {
                    let rest = outputs.split_off(job.request.sequences.len());
                    let mine = std::mem::replace(&mut outputs, rest);
                    let timings = Timings {
                        queue_us: started.duration_since(job.request.enqueued).as_micros() as u64,
                        tokenization_us: job.request.tokenization_us,
                        inference_us,
                        batch_size,
                        batch_tokens,
                    };
                    let _ = job.reply.send(Ok(Answer { outputs: mine, timings }));
                }
            }
            Err(error) => {
                tracing::error!(%error, "batch failed");
                for job in jobs {
                    let _ = job.reply.send(Err(error.clone()));
                }
            }
        }
    }
}

/// Sequences one pass holds at most: the CUDA attention kernel's grid takes 65535.
const PASS_SEQUENCES: usize = u16::MAX as usize;

/// Computes `sequences` in passes of at most the model's pass size (a request over the
/// batch budget is a batch of its own, and may be larger) and [`PASS_SEQUENCES`], one output
/// per sequence in order.
pub fn run(model: &EmbeddingModel, task: Task, sequences: &[&[u32]]) -> Result<Vec<Vec<f32>>, EngineError> {
    let mut outputs = Vec::with_capacity(sequences.len());
    for pass in passes(sequences, model.pass_tokens().unwrap_or(usize::MAX), PASS_SEQUENCES) {
        let batch: Batch = model.pack(pass, true)?;
        match task {
            Task::Embed => outputs.extend(model.embed_batch(&batch)?),
            Task::Classify => outputs.extend(model.classify_batch(&batch)?.into_iter().map(|p| p.logits)),
        }
    }
    Ok(outputs)
}

/// `sequences` cut, in order, into runs of at most `max_tokens` tokens (a longer sequence is
/// a run of its own) and `max_sequences` sequences.
fn passes<'a, 's>(
    sequences: &'a [&'s [u32]],
    max_tokens: usize,
    max_sequences: usize,
) -> impl Iterator<Item = &'a [&'s [u32]]> {
    let mut rest = sequences;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut tokens = rest[0].len();
        let mut end = 1;
        while end < rest.len() && end < max_sequences && tokens + rest[end].len() <= max_tokens {
            tokens += rest[end].len();
            end += 1;
        }
        let (pass, after) = rest.split_at(end);
        rest = after;
        Some(pass)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sequences of request `id` are `[id; length]`, so a batch says whose inputs it holds.
    fn request(id: u32, lengths: &[usize]) -> Request {
        Request { sequences: lengths.iter().map(|&n| vec![id; n]).collect(), tokenization_us: 0, enqueued: Instant::now() }
    }

    fn submit(queue: &Queue, id: u32, lengths: &[usize]) -> Pending {
        queue.submit(request(id, lengths)).unwrap_or_else(|e| panic!("request {id} refused: {e}"))
    }

    /// Admission that never refuses for waiting (the batching tests are about batches).
    fn patient() -> Admission {
        Admission { max_queue_wait_ms: u64::MAX / 2, ..Admission::DEFAULT }
    }

    /// A compute thread that reports each batch's sequences as it starts it, then holds
    /// every batch until `release` is dropped (`finish`). Each sequence's output is its
    /// first token.
    struct Gated {
        queue: Queue,
        started: mpsc::UnboundedReceiver<Vec<Vec<u32>>>,
        release: mpsc::UnboundedSender<()>,
    }

    fn gated(limits: BatchLimits, admission: Admission, prior_tokens_per_s: f64) -> Gated {
        let (report, started) = mpsc::unbounded_channel();
        let (release, mut gate) = mpsc::unbounded_channel::<()>();
        let queue = Queue::with_compute(limits, admission, prior_tokens_per_s, move |sequences: &[&[u32]]| {
            let _ = report.send(sequences.iter().map(|s| s.to_vec()).collect());
            let _ = gate.blocking_recv();
            Ok(sequences.iter().map(|s| vec![s[0] as f32]).collect())
        });
        Gated { queue, started, release }
    }

    impl Gated {
        /// Lets every batch run, closes the queue and returns the request ids of each
        /// batch computed from now on, in order.
        async fn finish(self) -> Vec<Vec<u32>> {
            let Gated { queue, mut started, release } = self;
            drop(release);
            drop(queue);
            let mut batches = Vec::new();
            while let Some(sequences) = started.recv().await {
                let mut ids: Vec<u32> = sequences.iter().map(|s| s[0]).collect();
                ids.dedup();
                batches.push(ids);
            }
            batches
        }
    }

    /// Lets the batching task act on what was just submitted (the tests run on one thread).
    async fn settle() {
        for _ in 0..32 {
            tokio::task::yield_now().await;
        }
    }

    fn limits(max_batch_tokens: usize, max_batch_requests: usize) -> BatchLimits {
        BatchLimits { max_batch_tokens: max_batch_tokens as u32, max_batch_requests: max_batch_requests as u32 }
    }

    /// An engine that fails every batch is broken after five in a row spread over ten
    /// seconds; batches refused for their inputs do not count, and one success clears the
    /// count.
    #[tokio::test]
    async fn a_replica_whose_engine_fails_batch_after_batch_is_broken() {
        let outcomes = Arc::new(Mutex::new(std::collections::VecDeque::new()));
        let queued = outcomes.clone();
        let queue = Queue::with_compute(limits(1000, 1), patient(), 1e6, move |sequences: &[&[u32]]| {
            match queued.lock().unwrap().pop_front() {
                Some("device") => Err(EngineError::Compute(candle_core::Error::Msg("device lost".into()))),
                Some("input") => Err(EngineError::EmptyInput { index: 0 }),
                _ => Ok(sequences.iter().map(|_| vec![0.0]).collect()),
            }
        });
        let health = queue.health();
        // As if the streak so far had begun BROKEN_FOR ago.
        let began_earlier = || {
            let mut load = health.0.lock().unwrap();
            load.failing.first = load.failing.first.map(|first| first - BROKEN_FOR);
        };
        let run = |plan: &[&'static str]| {
            outcomes.lock().unwrap().extend(plan.iter().copied());
            let pending: Vec<Pending> = (0..plan.len() as u32).map(|id| submit(&queue, id, &[2])).collect();
            async move {
                for p in pending {
                    let _ = p.answer().await.expect("answered");
                }
            }
        };
        run(&["device", "device", "device", "device", "input", "input"]).await;
        began_earlier();
        assert_eq!(health.why_broken(), None, "four engine faults; inputs do not count");
        run(&["device", "ok", "device", "device", "device", "device"]).await;
        began_earlier();
        assert_eq!(health.why_broken(), None, "a success in between clears the count");
        run(&["ok", "device", "device", "device", "device", "device"]).await;
        assert_eq!(health.why_broken(), None, "five in a row, but within a second");
        began_earlier();
        let why = health.why_broken().expect("broken");
        assert!(why.contains("last 5 batches") && why.contains("device lost"), "{why}");
    }

    #[tokio::test]
    async fn requests_queued_while_a_batch_computes_all_join_the_next_batch() {
        let mut g = gated(limits(1000, 64), patient(), 1e6);
        let _computing = submit(&g.queue, 0, &[3]);
        assert_eq!(g.started.recv().await.unwrap(), vec![vec![0; 3]]);
        // These arrive one by one while batch 0 computes.
        let mut answers = Vec::new();
        for id in 1..6 {
            answers.push((id, submit(&g.queue, id, &[2])));
            settle().await;
        }
        assert_eq!(g.finish().await, vec![vec![1, 2, 3, 4, 5]]);
        for (id, answer) in answers {
            let answer = answer.answer().await.unwrap().unwrap();
            assert_eq!(answer.outputs, vec![vec![id as f32]], "request {id} got another request's output");
            assert_eq!((answer.timings.batch_size, answer.timings.batch_tokens), (5, 10));
        }
    }

    /// A request carried to the batch after the open one (it would have gone over the
    /// budget) is computed when every request of the open batch left, not when another
    /// request comes along.
    #[tokio::test]
    async fn a_carried_request_is_computed_when_every_request_before_it_left() {
        let mut g = gated(limits(10, 64), patient(), 1e6);
        let _computing = submit(&g.queue, 0, &[1]);
        g.started.recv().await.unwrap();
        let leaves = submit(&g.queue, 1, &[8]);
        settle().await;
        let stays = submit(&g.queue, 2, &[8]);
        settle().await;
        drop(leaves);
        g.release.send(()).unwrap();
        let next = tokio::time::timeout(Duration::from_secs(5), g.started.recv()).await;
        assert_eq!(next.expect("the carried request was never batched").unwrap(), vec![vec![2; 8]]);
        g.release.send(()).unwrap();
        assert!(stays.answer().await.unwrap().is_ok());
    }

    /// A panic in the engine fails the batch it computed (a 500, which the gateway does not
    /// send elsewhere), and the replica goes on serving.
    #[tokio::test]
    async fn a_batch_whose_engine_panics_fails_alone() {
        let mut first = true;
        let queue = Queue::with_compute(limits(1000, 64), patient(), 1e6, move |sequences: &[&[u32]]| {
            if std::mem::take(&mut first) {
                panic!("an engine bug");
            }
            Ok(sequences.iter().map(|s| vec![s[0] as f32]).collect())
        });
        let failed = submit(&queue, 1, &[2]).answer().await.expect("an answer, not a closed queue");
        assert!(failed.is_err_and(|message| message.contains("panic")));
        let served = submit(&queue, 2, &[2]).answer().await.unwrap().unwrap();
        assert_eq!(served.outputs, vec![vec![2.0]]);
    }

    #[tokio::test]
    async fn a_free_compute_thread_gets_the_first_request_at_once() {
        let mut g = gated(limits(1000, 64), patient(), 1e6);
        let _first = submit(&g.queue, 7, &[2]);
        let started = tokio::time::timeout(Duration::from_secs(5), g.started.recv()).await;
        assert_eq!(started.expect("the idle compute thread was not given the request").unwrap(), vec![vec![7; 2]]);
    }

    #[tokio::test]
    async fn a_batch_never_exceeds_the_token_budget_or_the_request_cap() {
        let (max_tokens, max_requests) = (10, 3);
        let g = gated(limits(max_tokens, max_requests), patient(), 1e6);
        // Request 3 has two inputs: a request's tokens are those of all its inputs.
        let requests: [(u32, &[usize]); 9] =
            [(1, &[4]), (2, &[4]), (3, &[2, 2]), (4, &[1]), (5, &[1]), (6, &[1]), (7, &[1]), (8, &[9]), (9, &[2])];
        let tokens_of = |id: u32| requests.iter().find(|j| j.0 == id).map_or(0, |j| j.1.iter().sum::<usize>());
        let answers: Vec<_> = requests.iter().map(|(id, lengths)| submit(&g.queue, *id, lengths)).collect();
        let batches = g.finish().await;
        for batch in &batches {
            assert!(batch.len() <= max_requests, "{batch:?} holds more than {max_requests} requests");
            let tokens: usize = batch.iter().map(|&id| tokens_of(id)).sum();
            assert!(tokens <= max_tokens, "{batch:?} holds {tokens} tokens, over the budget of {max_tokens}");
        }
        // Packed greedily in arrival order: a request that would overflow starts the next batch.
        assert_eq!(batches, vec![vec![1, 2], vec![3, 4, 5], vec![6, 7], vec![8], vec![9]]);
        for answer in answers {
            assert!(answer.answer().await.unwrap().is_ok());
        }
    }

    #[tokio::test]
    async fn a_request_whose_client_went_away_is_not_computed() {
        let mut g = gated(limits(1000, 64), patient(), 1e6);
        let _computing = submit(&g.queue, 0, &[1]);
        g.started.recv().await.unwrap();
        // This one is in the open batch when its client leaves.
        drop(submit(&g.queue, 1, &[1]));
        settle().await;
        // This one's client leaves while it is still queued.
        drop(submit(&g.queue, 2, &[1]));
        let stays = submit(&g.queue, 3, &[1]);
        // And this one's had left before it was even queued.
        drop(submit(&g.queue, 4, &[1]));
        assert_eq!(g.finish().await, vec![vec![3]]);
        assert_eq!(stays.answer().await.unwrap().unwrap().outputs, vec![vec![3.0]]);
    }

    /// At a prior of 10 tokens/s, a computing batch of 50 tokens keeps the queue busy for
    /// 5 s and each queued token adds 0.1 s (seconds of margin against the test's own time).
    #[tokio::test]
    async fn a_request_that_would_wait_past_the_limit_is_refused_with_when_to_retry() {
        let admission = Admission { max_queue_wait_ms: 10_000, ..Admission::DEFAULT };
        let mut g = gated(limits(1000, 64), admission, 10.0);
        let _computing = submit(&g.queue, 0, &[50]);
        g.started.recv().await.unwrap();
        let leaves = submit(&g.queue, 1, &[40]); // would wait 5 s
        let _stays = submit(&g.queue, 2, &[30]); // 9 s
        match g.queue.submit(request(3, &[10])) {
            // 12 s of work ahead, 2 s past the limit.
            Err(SubmitError::Overloaded { wait, retry_after_secs, .. }) => {
                assert!(wait > Duration::from_secs(11) && wait <= Duration::from_secs(12), "{wait:?}");
                assert_eq!(retry_after_secs, 2);
            }
            other => panic!("admitted past the wait limit: {:?}", other.map(|_| ())),
        }
        // A client that leaves takes its 4 s off the estimate: now it fits.
        drop(leaves);
        let admitted = submit(&g.queue, 3, &[10]);
        assert_eq!(g.finish().await, vec![vec![2, 3]]);
        assert!(admitted.answer().await.unwrap().is_ok());
    }

    #[tokio::test]
    async fn the_queue_holds_at_most_eight_batch_budgets_of_tokens() {
        let admission = Admission { max_request_tokens: 10, ..patient() };
        let mut g = gated(limits(10, 64), admission, 1e9);
        let _computing = submit(&g.queue, 0, &[10]);
        g.started.recv().await.unwrap();
        let queued: Vec<_> = (1..=8).map(|id| submit(&g.queue, id, &[10])).collect();
        assert!(matches!(g.queue.submit(request(9, &[1])), Err(SubmitError::Overloaded { .. })));
        drop(g.finish().await);
        for answer in queued {
            assert!(answer.answer().await.unwrap().is_ok());
        }
    }

    #[tokio::test]
    async fn a_request_over_the_token_cap_is_refused_whatever_the_load() {
        let g = gated(limits(1000, 64), Admission { max_request_tokens: 8, ..patient() }, 1e6);
        match g.queue.submit(request(1, &[5, 4])) {
            Err(e @ SubmitError::TooManyTokens { tokens: 9, max: 8 }) => assert!(e.to_string().contains("max_request_tokens")),
            other => panic!("{:?}", other.map(|_| ())),
        }
        assert_eq!(g.finish().await, Vec::<Vec<u32>>::new());
    }

    #[test]
    fn a_batch_is_computed_in_passes_of_at_most_the_pass_size_in_order() {
        let sequences: Vec<Vec<u32>> = [3, 4, 2, 9, 1, 1, 5].iter().enumerate().map(|(i, &n)| vec![i as u32; n]).collect();
        let refs: Vec<&[u32]> = sequences.iter().map(Vec::as_slice).collect();
        let cut: Vec<Vec<u32>> =
            passes(&refs, 8, PASS_SEQUENCES).map(|pass| pass.iter().map(|s| s[0]).collect()).collect();
        // 3+4 fit in 8; 2 alone (2+9 would not); 9 is over the size on its own; 1+1+5.
        assert_eq!(cut, vec![vec![0, 1], vec![2], vec![3], vec![4, 5, 6]]);
        assert_eq!(passes(&refs, usize::MAX, PASS_SEQUENCES).count(), 1);
        assert_eq!(passes(&[], 8, PASS_SEQUENCES).count(), 0);
    }

    /// A GPU's pass has no token size, but the attention kernel takes at most 65535
    /// sequences a launch: a batch of more is cut there.
    #[test]
    fn a_pass_holds_at_most_the_kernel_s_sequences() {
        let one = [1u32];
        let many: Vec<&[u32]> = vec![&one[..]; 70_000];
        let lengths: Vec<usize> = passes(&many, usize::MAX, PASS_SEQUENCES).map(<[_]>::len).collect();
        assert_eq!(lengths, [65_535, 4_465]);
    }

    #[tokio::test]
    async fn a_replica_past_its_wait_limit_refuses_before_the_request_is_tokenized() {
        let admission = Admission { max_queue_wait_ms: 1000, ..Admission::DEFAULT };
        let mut g = gated(limits(1000, 64), admission, 10.0);
        assert!(g.queue.check().is_ok(), "an idle replica refused");
        let _computing = submit(&g.queue, 0, &[5]);
        g.started.recv().await.unwrap();
        // 0.5 s of work left: within the limit, so a request may still be tokenized.
        assert!(g.queue.check().is_ok());
        let _queued = submit(&g.queue, 1, &[10]);
        // 1.5 s ahead of anything that arrives now.
        assert!(matches!(g.queue.check(), Err(SubmitError::Overloaded { retry_after_secs: 1, .. })));
        drop(g.finish().await);
    }

    #[test]
    fn measured_batches_replace_the_prior_within_a_few_budgets() {
        let budget = 1000.0;
        let mut rate = Throughput { per_second: 10.0, memory_tokens: MEASURED_BATCHES * budget };
        assert_eq!(rate.per_second(), 10.0);
        // Many small batches do not erase what full batches measured...
        for _ in 0..20 {
            rate.record(1000, 0.1);
        }
        let full = rate.per_second();
        assert!((full - 10_000.0).abs() < 100.0, "{full}");
        for _ in 0..20 {
            rate.record(10, 0.01);
        }
        assert!(rate.per_second() > 0.9 * full, "{} after small batches", rate.per_second());
    }

    #[tokio::test]
    async fn a_failed_batch_answers_each_of_its_requests_with_the_error() {
        let queue = Queue::with_compute(limits(1000, 64), patient(), 1e6, |_: &[&[u32]]| {
            Err(EngineError::Unsupported("no device".into()))
        });
        let answers = [submit(&queue, 1, &[2]), submit(&queue, 2, &[3])];
        for answer in answers {
            let message = answer.answer().await.unwrap().unwrap_err();
            assert!(message.contains("no device"), "{message}");
        }
    }
}
