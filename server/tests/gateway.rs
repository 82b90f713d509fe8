//! The gateway over real HTTP, in front of stand-in engine endpoints (loopback HTTP
//! servers speaking the worker's engine protocol): requests feed the per-deployment stats
//! route, which only the owner and admins may read, and Prometheus histograms; the least
//! loaded replica gets the next request and an unreachable one is skipped; a replica that
//! never answers gets the client a 504; an API token stops working the moment it is
//! revoked even though the server remembers verified tokens.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Value};
use support::{backends, tiny_model, Backend, TestServer};
use tessera_api::engine::{EngineInput, InferRequest, InferResponse, Timings};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

/// A stand-in engine. It answers every embed with its own `vector` and fixed batch
/// figures; `"overload"` gets the 429 a full queue gives, `"break"` the 503 of a replica
/// that broke down on it; `"hold"` waits for a permit on `gate`, which stays shut until
/// the test opens it.
#[derive(Clone)]
struct StandIn {
    url: String,
    vector: Vec<f32>,
    /// Requests waiting at the gate now.
    held: Arc<AtomicUsize>,
    gate: Arc<Semaphore>,
    /// Requests it was sent.
    calls: Arc<AtomicUsize>,
}

impl StandIn {
    async fn start(vector: Vec<f32>) -> StandIn {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let engine = StandIn {
            url: format!("http://{address}/replica"),
            vector,
            held: Arc::default(),
            gate: Arc::new(Semaphore::new(0)),
            calls: Arc::default(),
        };
        let app = Router::new().route("/replica/embed", post(stand_in_embed)).with_state(engine.clone());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        engine
    }

    /// Lets every held request through.
    fn release(&self) {
        self.gate.add_permits(Semaphore::MAX_PERMITS / 2);
    }
}

async fn stand_in_embed(State(engine): State<StandIn>, Json(request): Json<InferRequest>) -> axum::response::Response {
    engine.calls.fetch_add(1, Ordering::SeqCst);
    if request.inputs.contains(&EngineInput::Text("overload".into())) {
        let body = json!({"error": "The queue is full; retry shortly.", "kind": "overloaded"});
        return (StatusCode::TOO_MANY_REQUESTS, Json(body)).into_response();
    }
    if request.inputs.contains(&EngineInput::Text("break".into())) {
        let body = json!({"error": "The replica stopped before answering.", "kind": "unhealthy"});
        return (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response();
    }
    if request.inputs.contains(&EngineInput::Text("hold".into())) {
        engine.held.fetch_add(1, Ordering::SeqCst);
        let _permit = engine.gate.acquire().await.unwrap();
        engine.held.fetch_sub(1, Ordering::SeqCst);
    }
    let n = request.inputs.len();
    let timings = Timings { queue_us: 10, tokenization_us: 5, inference_us: 100, batch_size: 3, batch_tokens: 42 };
    Json(InferResponse { outputs: vec![engine.vector.clone(); n], tokens: vec![2; n], labels: vec![], timings }).into_response()
}

/// An engine that no longer serves its replica (stopping, scaled down): a 503 to every request.
async fn stopped_endpoint() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let stopped = || async {
        let body = json!({"error": "Replica x is not served here.", "kind": "not_serving"});
        (StatusCode::SERVICE_UNAVAILABLE, Json(body))
    };
    let app = Router::new().route("/replica/embed", post(stopped));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{address}/replica")
}

/// An engine URL nothing listens on.
async fn unreachable_endpoint() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    drop(listener);
    format!("http://{address}/replica")
}

/// `owner` gets a model and a deployment, both called `name`, with one ready replica at
/// each of `endpoints`.
async fn deployment_at(server: &TestServer, owner: &str, name: &str, endpoints: &[String]) {
    let response = server.upload_model(owner, name, tiny_model()).await;
    assert_eq!(response.status(), 201);
    let response = server.post(owner, "/deployments", json!({"name": name, "model": name, "replicas": endpoints.len()})).await;
    assert_eq!(response.status(), 201);
    let (_, secret) = server.register_worker(&format!("{name}-box")).await;
    for endpoint in endpoints {
        let claimed: Value = server.post(&secret, "/agent/claim", json!({"kinds": ["serve"]})).await.json().await.unwrap();
        let job = claimed["job_id"].as_str().unwrap();
        let report = json!({"state": "running", "endpoint": endpoint});
        assert_eq!(server.post(&secret, &format!("/agent/jobs/{job}/status"), report).await.status(), 204);
    }
}

/// `alice` owns a deployment `embedder` whose one replica is ready at a stand-in engine.
async fn ready_deployment(server: &TestServer, alice: &str) {
    deployment_at(server, alice, "embedder", &[StandIn::start(vec![0.6, 0.8]).await.url]).await;
}

/// Polls until `done` holds; a test that waits for a background request to arrive.
async fn until(what: &str, done: impl Fn() -> bool) {
    for _ in 0..500 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting until {what}");
}

async fn api_token(server: &TestServer, session: &str) -> (String, String) {
    let created: Value = server.post(session, "/tokens", json!({"name": "client"})).await.json().await.unwrap();
    (created["id"].as_str().unwrap().to_string(), created["token"].as_str().unwrap().to_string())
}

async fn embed(server: &TestServer, token: &str, input: &str) -> reqwest::Response {
    embed_with(server, token, "embedder", input).await
}

/// An OpenAI embeddings request; the client gives up after 30 s so a hung gateway fails
/// the test instead of stalling it.
async fn embed_with(server: &TestServer, token: &str, model: &str, input: &str) -> reqwest::Response {
    let body = json!({"model": model, "input": input});
    let request = server.http.post(format!("{}/v1/embeddings", server.url)).bearer_auth(token).json(&body);
    request.timeout(Duration::from_secs(30)).send().await.unwrap()
}

async fn embedding_of(response: reqwest::Response) -> Value {
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    body["data"][0]["embedding"].clone()
}

#[tokio::test]
async fn gateway_requests_feed_the_owner_checked_stats_route() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let alice = server.user(&admin, "alice").await;
        let bob = server.user(&admin, "bob").await;
        ready_deployment(&server, &alice).await;
        let (_, token) = api_token(&server, &alice).await;

        let quiet: Value = server.get(&alice, "/deployments/embedder/stats").await.json().await.unwrap();
        assert_eq!((quiet["total"]["requests"].as_u64(), quiet["request_rate"].as_f64()), (Some(0), Some(0.0)), "{quiet}");
        assert!(quiet["window"]["latency_ms"].is_null());

        for _ in 0..5 {
            let response = embed(&server, &token, "hello world").await;
            assert_eq!(response.status(), 200);
            let body: Value = response.json().await.unwrap();
            assert_eq!(body["data"][0]["embedding"], json!([0.6, 0.8]), "floats are written as the engine's f32 values");
            assert_eq!(body["usage"]["total_tokens"], 2);
        }
        assert_eq!(embed(&server, &token, "overload").await.status(), 429);

        let stats: Value = server.get(&alice, "/deployments/embedder/stats").await.json().await.unwrap();
        assert_eq!(stats["total"]["requests"], 6, "{stats}");
        assert_eq!(stats["total"]["errors"], 1);
        assert_eq!(stats["total"]["tokens"], 10);
        assert_eq!(stats["window"]["mean_batch_size"], 3.0);
        assert_eq!(stats["window"]["mean_batch_tokens"], 42.0);
        let latency = &stats["window"]["latency_ms"];
        assert!(latency["p50"].as_f64().unwrap() > 0.0 && latency["p99"].as_f64() >= latency["p50"].as_f64(), "{latency}");
        assert!(stats["request_rate"].as_f64().unwrap() > 0.0);
        assert_eq!((stats["window_seconds"].as_u64(), stats["bucket_seconds"].as_u64()), (Some(600), Some(5)));
        let buckets = stats["buckets"].as_array().unwrap();
        assert_eq!(buckets.iter().map(|b| b["requests"].as_u64().unwrap()).sum::<u64>(), 6);

        // Prometheus gets histograms (bucketed, so they aggregate), not summaries.
        let metrics =
            server.http.get(format!("{}/metrics", server.url)).bearer_auth(&admin).send().await.unwrap().text().await.unwrap();
        for name in [
            "tessera_inference_queue_seconds",
            "tessera_inference_tokenization_seconds",
            "tessera_inference_compute_seconds",
            "tessera_inference_batch_size",
            "tessera_inference_batch_tokens",
        ] {
            assert!(metrics.contains(&format!("{name}_bucket{{deployment=\"embedder\",le=")), "{name} has no buckets:\n{metrics}");
            assert!(!metrics.contains(&format!("{name}{{deployment=\"embedder\",quantile=")), "{name} is a summary");
        }
        assert!(metrics.contains("tessera_inference_batch_size_bucket{deployment=\"embedder\",le=\"256\"}"), "{metrics}");
        assert!(metrics.contains("tessera_inference_batch_tokens_bucket{deployment=\"embedder\",le=\"32768\"}"), "{metrics}");

        assert_eq!(server.get(&bob, "/deployments/embedder/stats").await.status(), 404, "only the owner sees it");
        assert_eq!(server.get(&admin, "/deployments/embedder/stats").await.status(), 200, "and admins");
        assert_eq!(server.delete(&alice, "/deployments/embedder").await.status(), 204);
        assert_eq!(server.get(&alice, "/deployments/embedder/stats").await.status(), 404);
    }
}

#[tokio::test]
async fn a_revoked_api_token_is_refused_at_once() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let alice = server.user(&admin, "alice").await;
        ready_deployment(&server, &alice).await;
        let (id, token) = api_token(&server, &alice).await;
        // Used twice, so the second time it came from the server's memory of it.
        for _ in 0..2 {
            assert_eq!(embed(&server, &token, "hello").await.status(), 200);
        }
        assert_eq!(server.delete(&alice, &format!("/tokens/{id}")).await.status(), 204);
        let response = embed(&server, &token, "hello").await;
        assert_eq!(response.status(), 401);
        let body: Value = response.json().await.unwrap();
        assert!(body["error"]["message"].as_str().unwrap().contains("revoked"), "{body}");
        assert_eq!(server.get(&token, "/auth/me").await.status(), 401);
    }
}

#[tokio::test]
async fn a_token_deleted_by_another_server_stops_working_within_the_cache_ttl() {
    let server = TestServer::start_tweaked(Backend::Sqlite, |config| config.auth_cache_secs = 1).await;
    let admin = server.admin().await;
    let (_, token) = api_token(&server, &admin).await;
    assert_eq!(server.get(&token, "/auth/me").await.status(), 200);
    // What a second server sharing the database would do: this server is not told.
    sqlx::query("DELETE FROM api_tokens").execute(server.state.db.pool()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(server.get(&token, "/auth/me").await.status(), 401);
}

#[tokio::test]
async fn the_least_loaded_ready_replica_gets_the_next_request() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let (first, second) = (StandIn::start(vec![1.0, 0.0]).await, StandIn::start(vec![0.0, 1.0]).await);
        deployment_at(&server, &admin, "pair", &[first.url.clone(), second.url.clone()]).await;
        let (_, token) = api_token(&server, &admin).await;

        // One replica is busy with a request that has not finished...
        let held = tokio::spawn({
            let (server_url, token) = (server.url.clone(), token.clone());
            async move {
                let body = json!({"model": "pair", "input": "hold"});
                reqwest::Client::new().post(format!("{server_url}/v1/embeddings")).bearer_auth(token).json(&body).send().await.unwrap()
            }
        });
        until("a replica holds the request", || first.held.load(Ordering::SeqCst) + second.held.load(Ordering::SeqCst) == 1).await;
        let (busy, idle) = if first.held.load(Ordering::SeqCst) == 1 { (&first, &second) } else { (&second, &first) };

        // ...so every request meanwhile goes to the other one.
        for _ in 0..4 {
            assert_eq!(embedding_of(embed_with(&server, &token, "pair", "hello").await).await, json!(idle.vector));
        }
        busy.release();
        assert_eq!(embedding_of(held.await.unwrap()).await, json!(busy.vector), "the held request finishes where it started");
    }
}

/// Sends a request to `deployment` that `live`, one of its replicas, holds (which makes
/// the others the least loaded); returns it once held.
async fn hold_on(server: &TestServer, token: &str, deployment: &str, live: &StandIn) -> JoinHandle<reqwest::Response> {
    let held = tokio::spawn({
        let (server_url, token) = (server.url.clone(), token.to_string());
        let body = json!({"model": deployment, "input": "hold"});
        async move {
            reqwest::Client::new().post(format!("{server_url}/v1/embeddings")).bearer_auth(token).json(&body).send().await.unwrap()
        }
    });
    until("the live replica holds the request", || live.held.load(Ordering::SeqCst) == 1).await;
    held
}

/// With a request held on `live`, a replica of deployment "patchy", its other replica is
/// the least loaded; the next request still gets `live`'s answer, and so does the held one
/// once released.
async fn reaches_the_live_replica(server: &TestServer, token: &str, live: &StandIn) {
    let held = hold_on(server, token, "patchy", live).await;
    assert_eq!(embedding_of(embed_with(server, token, "patchy", "hello").await).await, json!(live.vector));
    live.release();
    assert_eq!(embedding_of(held.await.unwrap()).await, json!(live.vector));
}

#[tokio::test]
async fn an_unreachable_replica_is_skipped_and_none_reachable_is_a_503() {
    let server = TestServer::start(Backend::Sqlite).await;
    let admin = server.admin().await;
    let live = StandIn::start(vec![1.0, 0.0]).await;
    deployment_at(&server, &admin, "patchy", &[unreachable_endpoint().await, live.url.clone()]).await;
    deployment_at(&server, &admin, "gone", &[unreachable_endpoint().await]).await;
    let (_, token) = api_token(&server, &admin).await;

    // With a request held on the live replica, the unreachable one is the least loaded and
    // is tried first; the request still reaches the live one.
    reaches_the_live_replica(&server, &token, &live).await;

    let response = embed_with(&server, &token, "gone", "hello").await;
    assert_eq!(response.status(), 503);
    assert_eq!(response.headers()["retry-after"], "1");
    let body: Value = response.json().await.unwrap();
    assert!(body["error"]["message"].as_str().unwrap().contains("No replica of 'gone' could be reached"), "{body}");
}

/// A replica that answers it no longer serves (a 503: it is stopping, or was scaled down
/// since the route was read) computed nothing: the request goes on to the next replica.
#[tokio::test]
async fn a_replica_that_no_longer_serves_is_skipped() {
    let server = TestServer::start(Backend::Sqlite).await;
    let admin = server.admin().await;
    let live = StandIn::start(vec![1.0, 0.0]).await;
    deployment_at(&server, &admin, "patchy", &[stopped_endpoint().await, live.url.clone()]).await;
    let (_, token) = api_token(&server, &admin).await;
    // The held request makes the stopped replica the least loaded, so it is tried first.
    reaches_the_live_replica(&server, &token, &live).await;
}

/// A replica that broke down on a request (a 503 of another kind) is not passed over: the
/// request could break the next one too, so the client hears of it.
#[tokio::test]
async fn a_replica_that_broke_down_on_a_request_is_not_retried_elsewhere() {
    let server = TestServer::start(Backend::Sqlite).await;
    let admin = server.admin().await;
    let (a, b) = (StandIn::start(vec![1.0, 0.0]).await, StandIn::start(vec![0.0, 1.0]).await);
    deployment_at(&server, &admin, "fragile", &[a.url.clone(), b.url.clone()]).await;
    let (_, token) = api_token(&server, &admin).await;
    assert_eq!(embed_with(&server, &token, "fragile", "break").await.status(), 503);
    let calls = a.calls.load(Ordering::SeqCst) + b.calls.load(Ordering::SeqCst);
    assert_eq!(calls, 1, "one replica was asked");
}

/// What the model cannot answer (more dimensions than it has) is a 400 before any
/// replica computes it.
#[tokio::test]
async fn an_impossible_request_is_refused_before_a_replica_computes_it() {
    let server = TestServer::start(Backend::Sqlite).await;
    let admin = server.admin().await;
    let engine = StandIn::start(vec![0.6, 0.8]).await;
    deployment_at(&server, &admin, "embedder", &[engine.url.clone()]).await;
    let body = json!({"model": "embedder", "input": "hi", "dimensions": 99_999});
    let response = server.http.post(format!("{}/v1/embeddings", server.url)).bearer_auth(&admin).json(&body).send().await.unwrap();
    assert_eq!(response.status(), 400);
    let error: Value = response.json().await.unwrap();
    assert!(error["error"]["message"].as_str().unwrap().contains("'dimensions' must be between 1 and"), "{error}");
    assert_eq!(engine.calls.load(Ordering::SeqCst), 0, "no replica computed it");
}

#[tokio::test]
async fn a_replica_that_never_answers_gets_the_client_a_504_on_both_apis() {
    let server = TestServer::start_tweaked(Backend::Sqlite, |config| config.inference_timeout_secs = 1).await;
    let admin = server.admin().await;
    // Every request below says "hold", and this engine's gate is never opened.
    deployment_at(&server, &admin, "stuck", &[StandIn::start(vec![1.0, 0.0]).await.url]).await;
    let (_, token) = api_token(&server, &admin).await;

    let response = embed_with(&server, &token, "stuck", "hold").await;
    assert_eq!(response.status(), 504);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["type"], "timeout", "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("'stuck' did not answer within 1 s"), "{body}");

    let request = json!({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hold"]}]});
    let response = server.http.post(format!("{}/v2/models/stuck/infer", server.url)).bearer_auth(&token).json(&request)
        .timeout(Duration::from_secs(30)).send().await.unwrap();
    assert_eq!(response.status(), 504);
    let body: Value = response.json().await.unwrap();
    assert!(body["error"].as_str().unwrap().contains("'stuck' did not answer within 1 s"), "{body}");
}

#[tokio::test]
async fn a_request_over_the_replicas_body_limit_is_a_413_on_both_apis() {
    let server = TestServer::start(Backend::Sqlite).await;
    let admin = server.admin().await;
    deployment_at(&server, &admin, "embedder", &[StandIn::start(vec![1.0, 0.0]).await.url]).await;

    // 1.5 MB of control characters as a KServe binary tensor: within the gateway's body
    // limit, but 9 MB once escaped into the JSON the replica reads, past its limit.
    let text = vec![1u8; 1_500_000];
    let header = json!({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1],
        "parameters": {"binary_data_size": text.len() + 4}}]});
    let header = serde_json::to_vec(&header).unwrap();
    let mut body = header.clone();
    body.extend_from_slice(&(text.len() as u32).to_le_bytes());
    body.extend_from_slice(&text);
    let response = server
        .http
        .post(format!("{}/v2/models/embedder/infer", server.url))
        .bearer_auth(&admin)
        .header("inference-header-content-length", header.len().to_string())
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 413);
    let body: Value = response.json().await.unwrap();
    assert!(body["error"].as_str().unwrap().contains("larger than a replica accepts"), "{body}");

    // A JSON body past the gateway's own limit is a 413 too, in OpenAI's shape.
    let response = embed_with(&server, &admin, "embedder", &"\u{1}".repeat(3 << 20)).await;
    assert_eq!(response.status(), 413);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
}

/// An engine URL whose server reads the request and closes the connection unanswered, as
/// a replica stopped mid-request does.
async fn hang_up_endpoint() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut buffer = [0u8; 4096];
            let _ = tokio::io::AsyncReadExt::read(&mut socket, &mut buffer).await;
        }
    });
    format!("http://{address}/replica")
}

/// An engine URL answered by something that is not an engine: a 500 with an HTML page.
async fn not_an_engine_endpoint() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let page = || async { (StatusCode::INTERNAL_SERVER_ERROR, "<html>oops</html>") };
    let app = Router::new().route("/replica/embed", post(page));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{address}/replica")
}

#[tokio::test]
async fn a_replica_that_fails_mid_request_gets_the_client_a_502_on_both_apis() {
    let server = TestServer::start(Backend::Sqlite).await;
    let admin = server.admin().await;
    deployment_at(&server, &admin, "broken", &[hang_up_endpoint().await]).await;
    deployment_at(&server, &admin, "garbled", &[not_an_engine_endpoint().await]).await;
    let (_, token) = api_token(&server, &admin).await;
    for (model, says) in [("broken", "broke off while answering"), ("garbled", "answered what no engine says")] {
        let response = embed_with(&server, &token, model, "hello").await;
        assert_eq!(response.status(), 502, "{model}");
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["error"]["type"], "bad_gateway", "{body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains(&format!("A replica of '{model}' {says}; retry")), "{body}");
        assert!(!message.contains("127.0.0.1"), "no replica address: {body}");

        let request = json!({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hello"]}]});
        let response = server.http.post(format!("{}/v2/models/{model}/infer", server.url)).bearer_auth(&token)
            .json(&request).send().await.unwrap();
        assert_eq!(response.status(), 502, "{model}");
        let body: Value = response.json().await.unwrap();
        assert!(body["error"].as_str().unwrap().contains(says), "{body}");
    }
}
