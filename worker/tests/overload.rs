//! A replica under overload, over real HTTP on a loopback port: it refuses at once (429,
//! `Retry-After`) what it could not start in time, drops the work of a caller that hung
//! up before computing it, and refuses requests over its input and token caps (413). The
//! queue's compute is held back by the test, so load is made by construction, not timing.

use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use tempfile::TempDir;
use tessera_api::deployments::BatchLimits;
use tessera_api::engine::{EngineError as WireError, EngineInput, InferRequest, InferResponse};
use tessera_worker::engine::synthetic::{word_level_tokenizer, RandomBert};
use tessera_worker::engine::LoadOptions;
use tessera_worker::serve::batcher::{Admission, Queue, Request};
use tessera_worker::serve::endpoint::{Endpoint, Registration, Replica};
use tessera_worker::serve::load_replica;
use tokio::sync::mpsc;
use uuid::Uuid;

const TOKEN: &str = "engine-token-from-the-server";
const HIDDEN: usize = 16;
const WORDS: &[&str] = &["the", "cat", "sat", "on", "a", "mat"];

fn tiny_model() -> (TempDir, TempDir) {
    let tokenizer = tempfile::tempdir().unwrap();
    std::fs::write(tokenizer.path().join("tokenizer.json"), word_level_tokenizer(WORDS, None).to_string()).unwrap();
    let model = tempfile::tempdir().unwrap();
    let shape = RandomBert { hidden: HIDDEN, layers: 1, heads: 2, intermediate: 32, vocab: WORDS.len() + 4, max_positions: 16 };
    shape.write(model.path(), 3, tokenizer.path()).unwrap();
    (model, tokenizer)
}

fn limits() -> BatchLimits {
    BatchLimits { max_batch_tokens: 256, max_batch_requests: 8 }
}

fn texts(texts: &[&str]) -> InferRequest {
    InferRequest { inputs: texts.iter().map(|t| EngineInput::Text(t.to_string())).collect(), truncate: true }
}

/// The tiny model behind a queue whose compute thread reports the input count of each
/// batch as it starts it, then holds it until the test sends on `release`.
struct Held {
    endpoint: Arc<Endpoint>,
    queue: Queue,
    id: Uuid,
    started: mpsc::UnboundedReceiver<Vec<usize>>,
    release: mpsc::UnboundedSender<()>,
    _registration: Registration,
    _model: (TempDir, TempDir),
}

async fn held(admission: Admission, prior_tokens_per_s: f64) -> Held {
    let model = tiny_model();
    let (loaded, _) = load_replica(model.0.path().into(), LoadOptions::default(), Uuid::new_v4(), limits(), admission).await.unwrap();
    let (report, started) = mpsc::unbounded_channel();
    let (release, mut gate) = mpsc::unbounded_channel::<()>();
    let queue = Queue::with_compute(limits(), admission, prior_tokens_per_s, move |sequences: &[&[u32]]| {
        let _ = report.send(sequences.iter().map(|s| s.len()).collect());
        let _ = gate.blocking_recv();
        Ok(vec![vec![0.0; HIDDEN]; sequences.len()])
    });
    let endpoint = Endpoint::start("127.0.0.1:0", None).await.unwrap();
    endpoint.set_token(TOKEN.into());
    let id = Uuid::new_v4();
    let replica = Replica { model: loaded.model.clone(), model_id: loaded.model_id, task: loaded.task, queue: queue.clone() };
    let registration = endpoint.add(id, replica);
    Held { endpoint, queue, id, started, release, _registration: registration, _model: model }
}

impl Held {
    fn embed(&self, request: &InferRequest) -> reqwest::RequestBuilder {
        http().post(format!("{}/embed", self.endpoint.replica_url(self.id))).bearer_auth(TOKEN).json(request)
    }
}

fn http() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(30)).build().unwrap()
}

/// Polls `done` until it holds (what the server does in the background), or panics.
async fn until(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_replica_at_capacity_refuses_at_once_with_retry_after() {
    // At a measured 1 token/s, the 3-token batch computing keeps the replica busy for 3 s,
    // past the 1 s a request may wait: 2 s until there is room.
    let mut replica = held(Admission { max_queue_wait_ms: 1000, ..Admission::DEFAULT }, 1.0).await;
    let _computing = replica.queue.submit(Request { sequences: vec![vec![2, 4, 3]], tokenization_us: 0, enqueued: Instant::now() }).unwrap();
    assert_eq!(replica.started.recv().await.unwrap(), vec![3]);

    // The batch stays held for the whole test: an answer at all means it did not queue.
    let response = replica.embed(&texts(&["the cat"])).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(response.headers()["retry-after"], "2");
    let error: WireError = response.json().await.unwrap();
    assert_eq!(error.kind, "overloaded");
    assert!(error.error.contains("retry in 2 s"), "{}", error.error);
    assert_eq!(replica.queue.queued_tokens(), 0, "a refused request holds no place in the queue");
}

#[tokio::test]
async fn the_work_of_a_caller_that_hung_up_is_dropped_before_it_is_computed() {
    let mut replica = held(Admission { max_queue_wait_ms: 60_000, ..Admission::DEFAULT }, 1e6).await;
    let first = tokio::spawn(replica.embed(&texts(&["the"])).send());
    assert_eq!(replica.started.recv().await.unwrap(), vec![3], "the first request computes, held");

    // The second queues behind it (three inputs: [CLS] word [SEP] each), then its caller
    // hangs up: the connection closes with the request in flight.
    let leaving = tokio::spawn(replica.embed(&texts(&["cat", "sat", "on"])).send());
    until("the second request is queued", || replica.queue.queued_tokens() == 9).await;
    leaving.abort();
    until("the replica notices the caller left", || replica.queue.queued_tokens() == 0).await;

    let staying = tokio::spawn(replica.embed(&texts(&["a", "mat"])).send());
    until("the third request is queued", || replica.queue.queued_tokens() == 6).await;
    replica.release.send(()).unwrap();
    assert_eq!(replica.started.recv().await.unwrap(), vec![3, 3], "only the third request is computed next");
    replica.release.send(()).unwrap();
    for request in [first, staying] {
        let response = request.await.unwrap().unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        response.json::<InferResponse>().await.unwrap();
    }
    assert!(replica.started.try_recv().is_err(), "nothing else was computed");
}

#[tokio::test]
async fn requests_over_the_input_or_token_cap_get_413_naming_the_limit() {
    let model = tiny_model();
    let admission = Admission { max_request_inputs: 3, max_request_tokens: 10, ..Admission::DEFAULT };
    let (loaded, _) = load_replica(model.0.path().into(), LoadOptions::default(), Uuid::new_v4(), limits(), admission).await.unwrap();
    let endpoint = Endpoint::start("127.0.0.1:0", None).await.unwrap();
    endpoint.set_token(TOKEN.into());
    let id = Uuid::new_v4();
    let _registration = endpoint.add(id, loaded);
    let url = format!("{}/embed", endpoint.replica_url(id));
    let cases: [(&[&str], StatusCode, &str); 3] = [
        (&["the", "cat", "sat", "on"], StatusCode::PAYLOAD_TOO_LARGE, "at most 3 (max_request_inputs)"),
        // 4 + 5 + 3 tokens with [CLS] and [SEP].
        (&["the cat", "the cat sat", "on"], StatusCode::PAYLOAD_TOO_LARGE, "12 tokens; a request may hold at most 10 (max_request_tokens)"),
        (&["the cat", "the cat sat"], StatusCode::OK, ""),
    ];
    for (inputs, status, says) in cases {
        let response = http().post(&url).bearer_auth(TOKEN).json(&texts(inputs)).send().await.unwrap();
        assert_eq!(response.status(), status, "{inputs:?}");
        if status != StatusCode::OK {
            let error: WireError = response.json().await.unwrap();
            assert_eq!(error.kind, "too_large");
            assert!(error.error.contains(says), "{}", error.error);
        }
    }
}
