//! The gateway under overload, in front of stand-in engine endpoints (loopback HTTP
//! servers speaking the worker's engine protocol): a replica's 429 sends the request to
//! another replica with room, and when every replica refuses, the client gets the 429 at
//! once with the soonest `Retry-After`, in the route's error shape; a client that hangs up
//! takes its forwarded request with it, so the replica can drop the work.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Value};
use support::{tiny_model, Backend, TestServer};
use tessera_api::engine::{EngineInput, InferRequest, InferResponse, Timings};
use tokio::sync::Semaphore;

/// A stand-in engine: it refuses every request with 429 and `Retry-After: refuse` when
/// set; otherwise it answers, except that `"hold"` waits at a gate the test never opens.
#[derive(Clone)]
struct StandIn {
    url: String,
    refuse: Option<u64>,
    /// Requests that reached it, and held requests whose caller went away.
    received: Arc<AtomicUsize>,
    held: Arc<AtomicUsize>,
    abandoned: Arc<AtomicUsize>,
    gate: Arc<Semaphore>,
}

impl StandIn {
    async fn start(refuse: Option<u64>) -> StandIn {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let engine = StandIn {
            url: format!("http://{address}/replica"),
            refuse,
            received: Arc::default(),
            held: Arc::default(),
            abandoned: Arc::default(),
            gate: Arc::new(Semaphore::new(0)),
        };
        let app = Router::new().route("/replica/embed", post(stand_in_embed)).with_state(engine.clone());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        engine
    }
}

/// Counts a held request whose handler was dropped before it answered (its caller left).
struct Abandoned(Option<Arc<AtomicUsize>>);

impl Drop for Abandoned {
    fn drop(&mut self) {
        if let Some(count) = self.0.take() {
            count.fetch_add(1, Ordering::SeqCst);
        }
    }
}

async fn stand_in_embed(State(engine): State<StandIn>, Json(request): Json<InferRequest>) -> axum::response::Response {
    engine.received.fetch_add(1, Ordering::SeqCst);
    if let Some(seconds) = engine.refuse {
        let body = json!({"error": format!("At capacity; retry in {seconds} s."), "kind": "overloaded"});
        return (StatusCode::TOO_MANY_REQUESTS, [(header::RETRY_AFTER, seconds.to_string())], Json(body)).into_response();
    }
    if request.inputs.contains(&EngineInput::Text("hold".into())) {
        let mut abandoned = Abandoned(Some(engine.abandoned.clone()));
        engine.held.fetch_add(1, Ordering::SeqCst);
        let _permit = engine.gate.acquire().await.unwrap();
        abandoned.0 = None;
    }
    let n = request.inputs.len();
    let timings = Timings { queue_us: 10, tokenization_us: 5, inference_us: 100, batch_size: 1, batch_tokens: 2 };
    Json(InferResponse { outputs: vec![vec![0.6, 0.8]; n], tokens: vec![2; n], labels: vec![], timings }).into_response()
}

/// `owner` gets a model and a deployment `name` with one ready replica at each of `engines`.
async fn deployment_at(server: &TestServer, owner: &str, name: &str, engines: &[&StandIn]) {
    let response = server.upload_model(owner, name, tiny_model()).await;
    assert_eq!(response.status(), 201);
    let response = server.post(owner, "/deployments", json!({"name": name, "model": name, "replicas": engines.len()})).await;
    assert_eq!(response.status(), 201);
    let (_, secret) = server.register_worker(&format!("{name}-box")).await;
    for engine in engines {
        let claimed: Value = server.post(&secret, "/agent/claim", json!({"kinds": ["serve"]})).await.json().await.unwrap();
        let job = claimed["job_id"].as_str().unwrap();
        let report = json!({"state": "running", "endpoint": engine.url});
        assert_eq!(server.post(&secret, &format!("/agent/jobs/{job}/status"), report).await.status(), 204);
    }
}

async fn until(what: &str, done: impl Fn() -> bool) {
    for _ in 0..500 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting until {what}");
}

fn embeddings(server: &TestServer, token: &str, model: &str, input: &str) -> reqwest::RequestBuilder {
    let body = json!({"model": model, "input": input});
    server.http.post(format!("{}/v1/embeddings", server.url)).bearer_auth(token).json(&body).timeout(Duration::from_secs(30))
}

fn kserve(server: &TestServer, token: &str, model: &str, input: &str) -> reqwest::RequestBuilder {
    let body = json!({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [input]}]});
    server.http.post(format!("{}/v2/models/{model}/infer", server.url)).bearer_auth(token).json(&body).timeout(Duration::from_secs(30))
}

#[tokio::test]
async fn when_every_replica_refuses_the_client_gets_429_with_the_soonest_retry_after() {
    let server = TestServer::start(Backend::Sqlite).await;
    let admin = server.admin().await;
    let (later, sooner) = (StandIn::start(Some(9)).await, StandIn::start(Some(2)).await);
    deployment_at(&server, &admin, "busy", &[&later, &sooner]).await;

    let response = embeddings(&server, &admin, "busy", "hello").send().await.unwrap();
    assert_eq!(response.status(), 429);
    assert_eq!(response.headers()[header::RETRY_AFTER], "2");
    let body: Value = response.json().await.unwrap();
    assert_eq!((body["error"]["type"].as_str(), body["error"]["code"].as_u64()), (Some("overloaded"), Some(429)), "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("retry in 2 s"), "{body}");
    assert_eq!((later.received.load(Ordering::SeqCst), sooner.received.load(Ordering::SeqCst)), (1, 1), "both were asked");

    let response = kserve(&server, &admin, "busy", "hello").send().await.unwrap();
    assert_eq!(response.status(), 429);
    assert_eq!(response.headers()[header::RETRY_AFTER], "2");
    let body: Value = response.json().await.unwrap();
    assert!(body["error"].as_str().unwrap().contains("retry in 2 s"), "KServe's {{\"error\": \"…\"}}: {body}");
}

#[tokio::test]
async fn a_replica_at_capacity_passes_the_request_to_one_with_room() {
    let server = TestServer::start(Backend::Sqlite).await;
    let admin = server.admin().await;
    let (full, free) = (StandIn::start(Some(5)).await, StandIn::start(None).await);
    deployment_at(&server, &admin, "mixed", &[&full, &free]).await;

    // One request held at the free replica makes the full one the least loaded, so it is
    // asked first from now on.
    let held = tokio::spawn(embeddings(&server, &admin, "mixed", "hold").send());
    until("a request is held at the free replica", || free.held.load(Ordering::SeqCst) == 1).await;
    let before = full.received.load(Ordering::SeqCst);
    for api in ["v1", "v2"] {
        let request = if api == "v1" { embeddings(&server, &admin, "mixed", "hello") } else { kserve(&server, &admin, "mixed", "hello") };
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), 200, "{api}: {}", response.text().await.unwrap());
    }
    assert_eq!(full.received.load(Ordering::SeqCst), before + 2, "the full replica was asked first and refused");
    held.abort();
}

#[tokio::test]
async fn a_client_that_hangs_up_takes_its_forwarded_request_with_it() {
    let server = TestServer::start(Backend::Sqlite).await;
    let admin = server.admin().await;
    let engine = StandIn::start(None).await;
    deployment_at(&server, &admin, "slow", &[&engine]).await;

    for (n, request) in [embeddings(&server, &admin, "slow", "hold"), kserve(&server, &admin, "slow", "hold")].into_iter().enumerate() {
        let client = tokio::spawn(request.send());
        until("the request reaches the replica", || engine.held.load(Ordering::SeqCst) == n + 1).await;
        client.abort();
        until("the replica sees its caller gone", || engine.abandoned.load(Ordering::SeqCst) == n + 1).await;
    }
}
