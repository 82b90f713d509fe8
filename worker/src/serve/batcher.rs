//! The batching queue of one replica (TEI's design, `core/src/queue.rs`): requests wait in
//! a bounded queue; a batching task packs them into batches under a token budget and a
//! request cap, while the previous batch is computing on its own thread; requests whose
//! client went away are dropped before they are computed.

use std::sync::Arc;
use std::time::Instant;

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
    /// Starts the batching task and the compute thread for `model`. Batches keep within
    /// `limits`; `queue_capacity` requests may wait, and one more is refused (429).
    pub fn start(model: Arc<EmbeddingModel>, task: Task, limits: BatchLimits, queue_capacity: usize) -> Queue {
        Queue::with_compute(limits, queue_capacity, move |sequences: &[&[u32]]| run(&model, task, sequences))
    }

    /// Starts the batching task and a compute thread that runs `compute` on each batch's
    /// sequences (one output per sequence, in order). `start` passes the model; tests pass
    /// a compute they can hold back.
    pub fn with_compute<F>(limits: BatchLimits, queue_capacity: usize, compute: F) -> Queue
    where
        F: FnMut(&[&[u32]]) -> Result<Vec<Vec<f32>>, EngineError> + Send + 'static,
    {
        let (sender, receiver) = mpsc::channel(queue_capacity.max(1));
        // The compute thread says when it is free; only then does a batch go to it.
        let (batches, compute_side) = mpsc::channel::<Vec<Job>>(1);
        let (idle, idle_side) = mpsc::unbounded_channel();
        tokio::spawn(form_batches(receiver, batches, idle_side, limits));
        std::thread::Builder::new()
            .name("tessera-compute".into())
            .spawn(move || compute_batches(compute_side, idle, compute))
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

/// The next batch, open while the current one computes: it takes each request as it
/// arrives, in order, up to the request cap and the token budget, and goes to the compute
/// thread the moment that thread is free. So a burst that arrives during one batch is
/// computed together as the next (TEI's batching task waits on its `notify` the same way);
/// what does not fit waits in the bounded queue.
async fn form_batches(
    mut receiver: mpsc::Receiver<Job>,
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

fn compute_batches<F>(mut batches: mpsc::Receiver<Vec<Job>>, idle: mpsc::UnboundedSender<()>, mut compute: F)
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
        let started = Instant::now();
        let sequences: Vec<&[u32]> = jobs.iter().flat_map(|j| j.sequences.iter().map(Vec::as_slice)).collect();
        let result = compute(&sequences);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Sequences of job `id` are `[id; length]`, so a batch says whose inputs it holds.
    fn job(id: u32, lengths: &[usize]) -> (Job, oneshot::Receiver<Result<Answer, String>>) {
        let (reply, answer) = oneshot::channel();
        let sequences = lengths.iter().map(|&n| vec![id; n]).collect();
        (Job { sequences, tokenization_us: 0, enqueued: Instant::now(), reply }, answer)
    }

    fn submit(queue: &Queue, id: u32, lengths: &[usize]) -> oneshot::Receiver<Result<Answer, String>> {
        let (job, answer) = job(id, lengths);
        queue.submit(job).unwrap_or_else(|e| panic!("job {id} refused: {e}"));
        answer
    }

    /// A compute thread that reports each batch's sequences as it starts it, then holds
    /// every batch until `release` is dropped (`finish`). Each sequence's output is its
    /// first token.
    struct Gated {
        queue: Queue,
        started: mpsc::UnboundedReceiver<Vec<Vec<u32>>>,
        release: mpsc::UnboundedSender<()>,
    }

    fn gated(limits: BatchLimits, queue_capacity: usize) -> Gated {
        let (report, started) = mpsc::unbounded_channel();
        let (release, mut gate) = mpsc::unbounded_channel::<()>();
        let queue = Queue::with_compute(limits, queue_capacity, move |sequences: &[&[u32]]| {
            let _ = report.send(sequences.iter().map(|s| s.to_vec()).collect());
            let _ = gate.blocking_recv();
            Ok(sequences.iter().map(|s| vec![s[0] as f32]).collect())
        });
        Gated { queue, started, release }
    }

    impl Gated {
        /// Lets every batch run, closes the queue and returns the job ids of each batch
        /// computed from now on, in order.
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

    #[tokio::test]
    async fn requests_queued_while_a_batch_computes_all_join_the_next_batch() {
        let mut g = gated(limits(1000, 64), 64);
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
            let answer = answer.await.unwrap().unwrap();
            assert_eq!(answer.outputs, vec![vec![id as f32]], "job {id} got another job's output");
            assert_eq!((answer.timings.batch_size, answer.timings.batch_tokens), (5, 10));
        }
    }

    #[tokio::test]
    async fn a_free_compute_thread_gets_the_first_request_at_once() {
        let mut g = gated(limits(1000, 64), 64);
        let _first = submit(&g.queue, 7, &[2]);
        let started = tokio::time::timeout(std::time::Duration::from_secs(5), g.started.recv()).await;
        assert_eq!(started.expect("the idle compute thread was not given the request").unwrap(), vec![vec![7; 2]]);
    }

    #[tokio::test]
    async fn a_batch_never_exceeds_the_token_budget_or_the_request_cap() {
        let (max_tokens, max_requests) = (10, 3);
        let g = gated(limits(max_tokens, max_requests), 64);
        // Job 3 has two inputs: a job's tokens are those of all its inputs.
        let jobs: [(u32, &[usize]); 9] =
            [(1, &[4]), (2, &[4]), (3, &[2, 2]), (4, &[1]), (5, &[1]), (6, &[1]), (7, &[1]), (8, &[9]), (9, &[2])];
        let tokens_of = |id: u32| jobs.iter().find(|j| j.0 == id).map_or(0, |j| j.1.iter().sum::<usize>());
        let answers: Vec<_> = jobs.iter().map(|(id, lengths)| submit(&g.queue, *id, lengths)).collect();
        let batches = g.finish().await;
        for batch in &batches {
            assert!(batch.len() <= max_requests, "{batch:?} holds more than {max_requests} requests");
            let tokens: usize = batch.iter().map(|&id| tokens_of(id)).sum();
            assert!(tokens <= max_tokens, "{batch:?} holds {tokens} tokens, over the budget of {max_tokens}");
        }
        // Packed greedily in arrival order: a request that would overflow starts the next batch.
        assert_eq!(batches, vec![vec![1, 2], vec![3, 4, 5], vec![6, 7], vec![8], vec![9]]);
        for answer in answers {
            assert!(answer.await.unwrap().is_ok());
        }
    }

    #[tokio::test]
    async fn a_request_whose_client_went_away_is_not_computed() {
        let mut g = gated(limits(1000, 64), 64);
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
        assert_eq!(stays.await.unwrap().unwrap().outputs, vec![vec![3.0]]);
    }

    #[tokio::test]
    async fn a_full_queue_refuses_the_next_request() {
        let capacity = 2;
        let mut g = gated(limits(1000, 1), capacity);
        let _computing = submit(&g.queue, 0, &[1]);
        g.started.recv().await.unwrap();
        let _open = submit(&g.queue, 1, &[1]);
        settle().await;
        // One batch computes and the next is full (one request per batch): the queue itself
        // holds `capacity` more.
        let queued: Vec<_> = (2..2 + capacity as u32).map(|id| submit(&g.queue, id, &[1])).collect();
        settle().await;
        let (refused, _) = job(9, &[1]);
        assert!(matches!(g.queue.submit(refused), Err(SubmitError::QueueFull)));
        assert_eq!(g.finish().await, vec![vec![1], vec![2], vec![3]]);
        for answer in queued {
            assert!(answer.await.unwrap().is_ok());
        }
    }

    #[tokio::test]
    async fn a_failed_batch_answers_each_of_its_requests_with_the_error() {
        let queue = Queue::with_compute(limits(1000, 64), 64, |_: &[&[u32]]| {
            Err(EngineError::Unsupported("no device".into()))
        });
        let answers = [submit(&queue, 1, &[2]), submit(&queue, 2, &[3])];
        for answer in answers {
            let message = answer.await.unwrap().unwrap_err();
            assert!(message.contains("no device"), "{message}");
        }
    }
}
