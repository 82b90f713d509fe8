//! The worker's engine endpoint over real HTTP on a loopback port, serving a tiny random
//! BERT the test writes itself (`engine::synthetic`), so no model is downloaded.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use tempfile::TempDir;
use tessera_api::deployments::BatchLimits;
use tessera_api::engine::{EngineError as WireError, EngineInfo, EngineInput, InferRequest, InferResponse};
use tessera_worker::engine::synthetic::{word_level_tokenizer, RandomBert};
use tessera_worker::engine::LoadOptions;
use tessera_worker::serve::batcher::{Admission, Queue, Request, Task};
use tessera_worker::serve::endpoint::{Endpoint, Registration, Replica};
use tessera_worker::serve::load_replica;
use tokio::sync::mpsc;
use uuid::Uuid;

const TOKEN: &str = "engine-token-from-the-server";
const HIDDEN: usize = 16;
const MAX_POSITIONS: usize = 16;
const WORDS: &[&str] = &["the", "cat", "sat", "on", "a", "mat"];

fn write_tokenizer(dir: &Path) {
    let tokenizer = word_level_tokenizer(WORDS, None);
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
}

fn tiny_model() -> TempDir {
    let tokenizer = tempfile::tempdir().unwrap();
    write_tokenizer(tokenizer.path());
    let model = tempfile::tempdir().unwrap();
    let shape = RandomBert { hidden: HIDDEN, layers: 1, heads: 2, intermediate: 32, vocab: WORDS.len() + 4, max_positions: MAX_POSITIONS };
    shape.write(model.path(), 3, tokenizer.path()).unwrap();
    model
}

fn limits(max_batch_tokens: usize, max_batch_requests: u32) -> BatchLimits {
    BatchLimits { max_batch_tokens: max_batch_tokens as u32, max_batch_requests }
}

async fn endpoint_with_token() -> Arc<Endpoint> {
    let endpoint = Endpoint::start("127.0.0.1:0", None).await.unwrap();
    endpoint.set_token(TOKEN.into());
    endpoint
}

/// An endpoint serving the tiny model as replica `id`, with its real batching queue.
async fn serving() -> (Arc<Endpoint>, Registration, Uuid, TempDir) {
    let folder = tiny_model();
    let endpoint = endpoint_with_token().await;
    let (replica, _) = load_replica(folder.path().into(), LoadOptions::default(), Uuid::new_v4(), limits(256, 8), Admission::DEFAULT).await.unwrap();
    let id = Uuid::new_v4();
    let registration = endpoint.add(id, replica);
    (endpoint, registration, id, folder)
}

fn texts(texts: &[&str]) -> InferRequest {
    InferRequest { inputs: texts.iter().map(|t| EngineInput::Text(t.to_string())).collect(), truncate: true }
}

fn http() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(30)).build().unwrap()
}

#[tokio::test]
async fn the_engine_endpoint_refuses_callers_without_the_worker_s_engine_token() {
    let (endpoint, _registration, id, _folder) = serving().await;
    let url = endpoint.replica_url(id);
    let http = http();
    for authorization in [None, Some("Bearer not-the-token".to_string()), Some(format!("Basic {TOKEN}")), Some(format!("Bearer {TOKEN}x"))] {
        let mut embed = http.post(format!("{url}/embed")).json(&texts(&["the cat"]));
        let mut info = http.get(format!("{url}/info"));
        if let Some(value) = &authorization {
            embed = embed.header("authorization", value);
            info = info.header("authorization", value);
        }
        let response = embed.send().await.unwrap();
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED, "embed with {authorization:?}");
        assert_eq!(response.json::<WireError>().await.unwrap().kind, "unauthorized");
        assert_eq!(info.send().await.unwrap().status(), StatusCode::UNAUTHORIZED, "info with {authorization:?}");
    }
}

#[tokio::test]
async fn before_the_server_hands_out_a_token_the_endpoint_refuses_everyone() {
    let folder = tiny_model();
    let endpoint = Endpoint::start("127.0.0.1:0", None).await.unwrap();
    let (replica, _) = load_replica(folder.path().into(), LoadOptions::default(), Uuid::new_v4(), limits(256, 8), Admission::DEFAULT).await.unwrap();
    let id = Uuid::new_v4();
    let _registration = endpoint.add(id, replica);
    let response = http()
        .post(format!("{}/embed", endpoint.replica_url(id)))
        .header("authorization", "Bearer ")
        .json(&texts(&["the cat"]))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn the_engine_endpoint_answers_a_caller_with_the_engine_token() {
    let (endpoint, _registration, id, _folder) = serving().await;
    let url = endpoint.replica_url(id);
    let http = http();
    let response = http.post(format!("{url}/embed")).bearer_auth(TOKEN).json(&texts(&["the cat sat", "a mat"])).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let answer: InferResponse = response.json().await.unwrap();
    assert_eq!(answer.tokens, vec![5, 4], "[CLS] and [SEP] around each text");
    assert_eq!(answer.outputs.len(), 2);
    assert!(answer.outputs.iter().all(|v| v.len() == HIDDEN && v.iter().all(|x| x.is_finite())));

    let info = http.get(format!("{url}/info")).bearer_auth(TOKEN).send().await.unwrap();
    assert_eq!(info.status(), StatusCode::OK);
    let info: EngineInfo = info.json().await.unwrap();
    assert_eq!((info.dimensions, info.max_input_tokens), (HIDDEN as u32, MAX_POSITIONS as u32));
}

/// A tokenizer that adds no special tokens gives no ids for a blank text: that input is
/// refused with a 422 naming it, before it can join (and fail) a batch of other requests.
#[tokio::test]
async fn a_blank_text_under_a_tokenizer_without_special_tokens_is_a_422_naming_the_input() {
    let folder = tiny_model();
    let mut tokenizer = word_level_tokenizer(WORDS, None);
    tokenizer["post_processor"] = serde_json::Value::Null;
    std::fs::write(folder.path().join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let endpoint = endpoint_with_token().await;
    let (replica, _) = load_replica(folder.path().into(), LoadOptions::default(), Uuid::new_v4(), limits(256, 8), Admission::DEFAULT).await.unwrap();
    let id = Uuid::new_v4();
    let _registration = endpoint.add(id, replica);
    let url = format!("{}/embed", endpoint.replica_url(id));
    let http = http();
    let blank = http.post(&url).bearer_auth(TOKEN).json(&texts(&["the cat", "   "])).send();
    let other = http.post(&url).bearer_auth(TOKEN).json(&texts(&["a mat"])).send();
    let (blank, other) = tokio::join!(blank, other);
    let blank = blank.unwrap();
    assert_eq!(blank.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let error: WireError = blank.json().await.unwrap();
    assert!(error.error.contains("input 1"), "{}", error.error);
    let other = other.unwrap();
    assert_eq!(other.status(), StatusCode::OK, "another caller's request is served");
    assert_eq!(other.json::<InferResponse>().await.unwrap().tokens, vec![2], "no special tokens added");
}

#[tokio::test]
async fn load_replica_runs_a_full_warm_up_batch_before_it_returns_the_replica() {
    let folder = tiny_model();
    // Room for three of the longest inputs (and a bit), under a cap of eight requests.
    let max_batch_tokens = 3 * MAX_POSITIONS + 1;
    let (replica, report) =
        load_replica(folder.path().into(), LoadOptions::default(), Uuid::new_v4(), limits(max_batch_tokens, 8), Admission::DEFAULT).await.unwrap();
    assert_eq!(report.warmup_tokens, 3 * MAX_POSITIONS);
    assert_eq!(replica.task, Task::Embed);
}

#[tokio::test]
async fn a_full_replica_queue_is_answered_429() {
    let folder = tiny_model();
    let endpoint = endpoint_with_token().await;
    let (loaded, _) = load_replica(folder.path().into(), LoadOptions::default(), Uuid::new_v4(), limits(256, 8), Admission::DEFAULT).await.unwrap();
    // The same model, behind a queue whose compute thread holds its first batch until the
    // test ends; at a measured 1 token/s, that batch keeps the queue busy for 3 s, past the
    // 1 s the queue lets a request wait.
    let (started, mut computing) = mpsc::unbounded_channel();
    let (_release, mut gate) = mpsc::unbounded_channel::<()>();
    let admission = Admission { max_queue_wait_ms: 1000, ..Admission::DEFAULT };
    let queue = Queue::with_compute(limits(256, 1), admission, 1.0, move |sequences: &[&[u32]]| {
        let _ = started.send(());
        let _ = gate.blocking_recv();
        Ok(vec![vec![0.0; HIDDEN]; sequences.len()])
    });
    let _first = queue.submit(Request { sequences: vec![vec![2, 4, 3]], tokenization_us: 0, enqueued: Instant::now() }).unwrap();
    computing.recv().await.unwrap();

    let id = Uuid::new_v4();
    let _registration = endpoint.add(id, Replica { model: loaded.model.clone(), model_id: loaded.model_id, task: loaded.task, queue });
    let response = http()
        .post(format!("{}/embed", endpoint.replica_url(id)))
        .bearer_auth(TOKEN)
        .json(&texts(&["the cat"]))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(response.json::<WireError>().await.unwrap().kind, "overloaded");
}

/// A stopping replica answers what it admitted: new requests hear `not_serving` at once
/// (the gateway tries another replica), the one being computed gets its answer, and the
/// drain ends when it has.
#[tokio::test]
async fn a_draining_replica_answers_what_it_admitted_and_refuses_the_rest() {
    let folder = tiny_model();
    let endpoint = endpoint_with_token().await;
    let (loaded, _) = load_replica(folder.path().into(), LoadOptions::default(), Uuid::new_v4(), limits(256, 8), Admission::DEFAULT).await.unwrap();
    let (started, mut computing) = mpsc::unbounded_channel();
    let (release, mut gate) = mpsc::unbounded_channel::<()>();
    let queue = Queue::with_compute(limits(256, 8), Admission::DEFAULT, 1000.0, move |sequences: &[&[u32]]| {
        let _ = started.send(());
        let _ = gate.blocking_recv();
        Ok(vec![vec![0.5; HIDDEN]; sequences.len()])
    });
    let id = Uuid::new_v4();
    let registration = endpoint.add(id, Replica { model: loaded.model.clone(), model_id: loaded.model_id, task: loaded.task, queue });
    let url = format!("{}/embed", endpoint.replica_url(id));
    let in_flight = tokio::spawn(http().post(&url).bearer_auth(TOKEN).json(&texts(&["the cat"])).send());
    computing.recv().await.unwrap();

    let drained = tokio::spawn(registration.drain(Duration::from_secs(20)));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let refused = http().post(&url).bearer_auth(TOKEN).json(&texts(&["a mat"])).send().await.unwrap();
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(refused.json::<WireError>().await.unwrap().kind, "not_serving");
    assert!(!drained.is_finished(), "the drain waits for the request being computed");

    release.send(()).unwrap();
    let answered = in_flight.await.unwrap().unwrap();
    assert_eq!(answered.status(), StatusCode::OK);
    assert_eq!(answered.json::<InferResponse>().await.unwrap().outputs, vec![vec![0.5; HIDDEN]]);
    assert!(drained.await.unwrap(), "drained before the deadline");
}
