//! The batching queue of one replica (TEI's design, `core/src/queue.rs`): requests wait in
//! a bounded queue; a batching task packs them into batches under a token budget and a
//! request cap, while the previous batch is computing on its own thread; requests whose
//! client went away are dropped before they are computed.

use std::sync::Arc;
use std::time::Instant;

use tessera_api::engine::Timings;
use tokio::sync::{mpsc, oneshot};

use crate::engine::{Batch, EmbeddingModel, EngineError};

/// What a replica computes for its model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Task {
    Embed,
    Classify,
}

#[derive(Debug, Clone, Copy)]
pub struct BatchLimits {
    pub max_batch_tokens: usize,
    pub max_batch_requests: usize,
    /// Requests that may wait; one more is refused (429).
    pub queue_capacity: usize,
}

/// One client request: already tokenized, answered through `reply`.
pub struct Job {
    pub sequences: Vec<Vec<u32>>,
    pub tokenization_us: u64,
    pub enqueued: Instant,
    /// The answer, or why the batch could not be computed (inputs were checked before
    /// they were queued, so this is the engine's failure, not the client's).
    pub reply: oneshot::Sender<Result<Answer, String>>,
}

impl Job {
    fn tokens(&self) -> usize {
        self.sequences.iter().map(Vec::len).sum()
    }
}

#[derive(Debug)]
pub struct Answer {
    pub outputs: Vec<Vec<f32>>,
    pub timings: Timings,
}

#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("the replica's queue is full; retry shortly")]
    QueueFull,
    #[error("the replica is shutting down")]
    Closed,
}

/// The sending side of a replica's queue.
#[derive(Clone)]
pub struct Queue {
    sender: mpsc::Sender<Job>,
}

impl Queue {
    /// Starts the batching task and the compute thread for `model`.
    pub fn start(model: Arc<EmbeddingModel>, task: Task, limits: BatchLimits) -> Queue {
        let (sender, receiver) = mpsc::channel(limits.queue_capacity.max(1));
        // Capacity 1: one batch computes while the next one is formed and waits.
        let (batches, compute) = mpsc::channel::<Vec<Job>>(1);
        tokio::spawn(form_batches(receiver, batches, limits));
        std::thread::Builder::new()
            .name("tessera-compute".into())
            .spawn(move || compute_batches(compute, &model, task))
            .expect("spawning the compute thread");
        Queue { sender }
    }

    pub fn submit(&self, job: Job) -> Result<(), SubmitError> {
        self.sender.try_send(job).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => SubmitError::QueueFull,
            mpsc::error::TrySendError::Closed(_) => SubmitError::Closed,
        })
    }
}

async fn form_batches(mut receiver: mpsc::Receiver<Job>, batches: mpsc::Sender<Vec<Job>>, limits: BatchLimits) {
    let mut carried: Option<Job> = None;
    loop {
        let first = match carried.take() {
            Some(job) => job,
            None => match receiver.recv().await {
                Some(job) => job,
                None => return,
            },
        };
        if first.reply.is_closed() {
            continue;
        }
        let mut tokens = first.tokens();
        let mut batch = vec![first];
        while batch.len() < limits.max_batch_requests {
            let Ok(next) = receiver.try_recv() else { break };
            if next.reply.is_closed() {
                continue;
            }
            if tokens + next.tokens() > limits.max_batch_tokens {
                carried = Some(next);
                break;
            }
            tokens += next.tokens();
            batch.push(next);
        }
        if batches.send(batch).await.is_err() {
            return;
        }
    }
}

fn compute_batches(mut batches: mpsc::Receiver<Vec<Job>>, model: &EmbeddingModel, task: Task) {
    while let Some(jobs) = batches.blocking_recv() {
        // A client may have gone while the batch waited for the compute thread.
        let jobs: Vec<Job> = jobs.into_iter().filter(|job| !job.reply.is_closed()).collect();
        if jobs.is_empty() {
            continue;
        }
        let started = Instant::now();
        let sequences: Vec<&[u32]> = jobs.iter().flat_map(|j| j.sequences.iter().map(Vec::as_slice)).collect();
        let result = run(model, task, &sequences);
        let inference_us = started.elapsed().as_micros() as u64;
        let batch_tokens = sequences.iter().map(|s| s.len()).sum::<usize>() as u32;
        let batch_size = jobs.len() as u32;
        match result {
            Ok(mut outputs) => {
                for job in jobs {
                    let rest = outputs.split_off(job.sequences.len());
                    let mine = std::mem::replace(&mut outputs, rest);
                    let timings = Timings {
                        queue_us: started.duration_since(job.enqueued).as_micros() as u64,
                        tokenization_us: job.tokenization_us,
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
                    let _ = job.reply.send(Err(error.to_string()));
                }
            }
        }
    }
}

fn run(model: &EmbeddingModel, task: Task, sequences: &[&[u32]]) -> Result<Vec<Vec<f32>>, EngineError> {
    let batch: Batch = model.pack(sequences, true)?;
    match task {
        Task::Embed => model.embed_batch(&batch),
        Task::Classify => Ok(model.classify_batch(&batch)?.into_iter().map(|p| p.logits).collect()),
    }
}
