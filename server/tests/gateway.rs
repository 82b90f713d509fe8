//! The gateway over real HTTP, in front of stand-in engine endpoints (loopback HTTP
//! servers speaking the worker's engine protocol): requests feed the per-deployment stats
//! route, which only the owner and admins may read, and Prometheus histograms; the least
//! loaded replica gets the next request, one that is unreachable or computed nothing is
//! skipped, and one that failed lately is tried last; a replica that never answers gets the
//! client a 504; KServe's readiness and versions (checked before the body is read); OpenAI's
//! model retrieval; an API token stops working the moment it is revoked even though the
//! server remembers verified tokens.

mod support;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
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
/// figures; `"overload"` gets the 429 a full queue gives, `"break"` the 500 of an engine
/// that failed on its batch; `"hold"` waits for a permit on `gate`, which stays shut until
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
    /// While set, every request gets the 500 that `"break"` gets.
    failing: Arc<AtomicBool>,
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
            failing: Arc::default(),
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
    if engine.failing.load(Ordering::SeqCst) || request.inputs.contains(&EngineInput::Text("break".into())) {
        let body = json!({"error": "The engine failed; see the worker's log.", "kind": "backend"});
        return (StatusCode::INTERNAL_SERVER_ERROR, Json(body)).into_response();
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

/// An engine that refuses every request with `status` and an engine error of `kind`.
async fn refusing_endpoint(status: StatusCode, kind: &'static str, message: &'static str) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let refuse = move || async move { (status, Json(json!({"error": message, "kind": kind}))) };
    let app = Router::new().route("/replica/embed", post(refuse));
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

/// A GET of a gateway path (outside `/api/v1`).
async fn gateway_get(server: &TestServer, token: &str, path: &str) -> reqwest::Response {
    server.http.get(format!("{}{path}", server.url)).bearer_auth(token).send().await.unwrap()
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
        let held = hold_on(&server, &token, "pair", &[&first, &second]).await;
        let (busy, idle) = if first.held.load(Ordering::SeqCst) == 1 { (&first, &second) } else { (&second, &first) };

        // ...so every request meanwhile goes to the other one.
        for _ in 0..4 {
            assert_eq!(embedding_of(embed_with(&server, &token, "pair", "hello").await).await, json!(idle.vector));
        }
        busy.release();
        assert_eq!(embedding_of(held.await.unwrap()).await, json!(busy.vector), "the held request finishes where it started");
    }
}

/// Sends a request to `deployment` that one of `engines`, its replicas, holds (which makes
/// the others the least loaded); returns it once held.
async fn hold_on(
    server: &TestServer,
    token: &str,
    deployment: &str,
    engines: &[&StandIn],
) -> JoinHandle<reqwest::Response> {
    let held = tokio::spawn({
        let (server_url, token) = (server.url.clone(), token.to_string());
        let body = json!({"model": deployment, "input": "hold"});
        async move {
            reqwest::Client::new().post(format!("{server_url}/v1/embeddings")).bearer_auth(token).json(&body).send().await.unwrap()
        }
    });
    let holding = || engines.iter().map(|engine| engine.held.load(Ordering::SeqCst)).sum::<usize>() == 1;
    until("a replica holds the request", holding).await;
    held
}

/// With a request held on `live`, a replica of `deployment`, its other replica is the
/// least loaded; the next request still gets `live`'s answer, and so does the held one
/// once released.
async fn reaches_the_live_replica(server: &TestServer, token: &str, deployment: &str, live: &StandIn) {
    let held = hold_on(server, token, deployment, &[live]).await;
    assert_eq!(embedding_of(embed_with(server, token, deployment, "hello").await).await, json!(live.vector));
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

    // With a request held on the live replica, the unreachable one is the least loaded (and
    // tried first, unless a request before found it unreachable); the request still
    // reaches the live one.
    reaches_the_live_replica(&server, &token, "patchy", &live).await;

    let response = embed_with(&server, &token, "gone", "hello").await;
    assert_eq!(response.status(), 503);
    assert_eq!(response.headers()["retry-after"], "1");
    let body: Value = response.json().await.unwrap();
    assert!(body["error"]["message"].as_str().unwrap().contains("No replica of 'gone' could be reached"), "{body}");
}

/// A replica whose answer computed nothing is passed over for the next one: one that no
/// longer serves the request (stopping, or scaled down since the route was read), one that
/// stopped before answering, and one that refuses the gateway's engine token (its worker
/// registered again since the route was read). With no other replica the client gets a 503
/// to send again, never the replica's 401, which it would read as its own key refused.
#[tokio::test]
async fn a_replica_that_computed_nothing_is_skipped_and_none_left_is_a_503() {
    let server = TestServer::start(Backend::Sqlite).await;
    let admin = server.admin().await;
    let (_, token) = api_token(&server, &admin).await;
    let refusals = [
        ("stopping", StatusCode::SERVICE_UNAVAILABLE, "not_serving", "Replica x is not served here."),
        ("stopped", StatusCode::SERVICE_UNAVAILABLE, "unhealthy", "The replica stopped before answering."),
        ("re-registered", StatusCode::UNAUTHORIZED, "unauthorized", "Only the Tessera server may call this endpoint."),
    ];
    for (name, status, kind, message) in refusals {
        // The held request makes the refusing replica the least loaded, so it is tried first.
        let live = StandIn::start(vec![1.0, 0.0]).await;
        deployment_at(&server, &admin, name, &[refusing_endpoint(status, kind, message).await, live.url.clone()]).await;
        reaches_the_live_replica(&server, &token, name, &live).await;

        let alone = format!("{name}-alone");
        deployment_at(&server, &admin, &alone, &[refusing_endpoint(status, kind, message).await]).await;
        let response = embed_with(&server, &token, &alone, "hello").await;
        assert_eq!(response.status(), 503, "{name}");
        assert_eq!(response.headers()["retry-after"], "1", "{name}");
        let body: Value = response.json().await.unwrap();
        assert!(body["error"]["message"].as_str().unwrap().contains("could be reached or is serving"), "{body}");
    }
}

/// A replica that broke down on a request (its engine's 500) is not passed over: the
/// request could break the next one too, so the client hears of it.
#[tokio::test]
async fn a_replica_that_broke_down_on_a_request_is_not_retried_elsewhere() {
    let server = TestServer::start(Backend::Sqlite).await;
    let admin = server.admin().await;
    let (a, b) = (StandIn::start(vec![1.0, 0.0]).await, StandIn::start(vec![0.0, 1.0]).await);
    deployment_at(&server, &admin, "fragile", &[a.url.clone(), b.url.clone()]).await;
    let (_, token) = api_token(&server, &admin).await;
    assert_eq!(embed_with(&server, &token, "fragile", "break").await.status(), 500);
    let calls = a.calls.load(Ordering::SeqCst) + b.calls.load(Ordering::SeqCst);
    assert_eq!(calls, 1, "one replica was asked");
}

/// A replica whose engine fails every request fast is, once it has failed one, tried after
/// the healthy replicas for a while, though it stays the least loaded: failing fast must
/// not win it the traffic.
#[tokio::test]
async fn a_replica_that_keeps_failing_is_tried_after_the_healthy_ones() {
    let server = TestServer::start(Backend::Sqlite).await;
    let admin = server.admin().await;
    let (first, second) = (StandIn::start(vec![1.0, 0.0]).await, StandIn::start(vec![0.0, 1.0]).await);
    deployment_at(&server, &admin, "pair", &[first.url.clone(), second.url.clone()]).await;
    let (_, token) = api_token(&server, &admin).await;
    let held = hold_on(&server, &token, "pair", &[&first, &second]).await;
    let (busy, idle) = if first.held.load(Ordering::SeqCst) == 1 { (&first, &second) } else { (&second, &first) };

    // The idle replica, the least loaded, breaks: the request that meets it fails...
    idle.failing.store(true, Ordering::SeqCst);
    assert_eq!(embed_with(&server, &token, "pair", "hello").await.status(), 500);
    // ...and the next ones go to the busy replica, which answers them.
    for _ in 0..4 {
        assert_eq!(embedding_of(embed_with(&server, &token, "pair", "hello").await).await, json!(busy.vector));
    }
    assert_eq!(idle.calls.load(Ordering::SeqCst), 1, "the failing replica was asked once");
    busy.release();
    assert_eq!(embedding_of(held.await.unwrap()).await, json!(busy.vector));
}

/// KServe's model readiness is its status: 200 when a replica is ready, and 400 (as Triton
/// answers; a 503 reads as the server failing) while none is. A deployment has one
/// version, "1": a path naming another is a 404 that says so, on every route, and no
/// replica computes it.
#[tokio::test]
async fn kserve_readiness_is_a_400_when_not_ready_and_only_version_1_exists() {
    let server = TestServer::start(Backend::Sqlite).await;
    let admin = server.admin().await;
    let engine = StandIn::start(vec![0.6, 0.8]).await;
    deployment_at(&server, &admin, "embedder", &[engine.url.clone()]).await;
    // A deployment whose replica no worker has taken yet.
    assert_eq!(server.upload_model(&admin, "waiting", tiny_model()).await.status(), 201);
    let waiting = json!({"name": "waiting", "model": "waiting", "replicas": 1});
    assert_eq!(server.post(&admin, "/deployments", waiting).await.status(), 201);

    for path in ["/v2/models/embedder/ready", "/v2/models/embedder/versions/1/ready"] {
        let response = gateway_get(&server, &admin, path).await;
        assert_eq!(response.status(), 200, "{path}");
        assert_eq!(response.json::<Value>().await.unwrap()["ready"], true, "{path}");
    }
    let response = gateway_get(&server, &admin, "/v2/models/waiting/ready").await;
    assert_eq!(response.status(), 400);
    assert_eq!(response.json::<Value>().await.unwrap()["ready"], false);

    let infer = json!({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hello"]}]});
    let url = |path: &str| format!("{}/v2/models/embedder{path}", server.url);
    let requests = [
        server.http.get(url("/versions/2")),
        server.http.get(url("/versions/2/ready")),
        server.http.post(url("/versions/2/infer")).json(&infer),
    ];
    for request in requests {
        let response = request.bearer_auth(&admin).send().await.unwrap();
        assert_eq!(response.status(), 404);
        let body: Value = response.json().await.unwrap();
        assert!(body["error"].as_str().unwrap().contains("its only version is \"1\""), "{body}");
    }
    assert_eq!(engine.calls.load(Ordering::SeqCst), 0, "no replica computed version 2");
    let response = server.http.post(url("/versions/1/infer")).bearer_auth(&admin).json(&infer).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.json::<Value>().await.unwrap()["model_version"], "1");
}

/// As Triton does, a KServe inference request's model and version are looked up before its
/// body is read: what does not exist is the 404 saying so whatever the body holds (even one
/// that never finishes arriving), and only then is a malformed body the 400 about it.
#[tokio::test]
async fn a_kserve_request_for_a_missing_version_is_a_404_before_its_body_is_read() {
    let server = TestServer::start(Backend::Sqlite).await;
    let admin = server.admin().await;
    let engine = StandIn::start(vec![0.6, 0.8]).await;
    deployment_at(&server, &admin, "embedder", std::slice::from_ref(&engine.url)).await;

    let cases = [
        ("embedder/versions/2", 404, "Model 'embedder' has no version '2'; its only version is \"1\"."),
        ("absent/versions/2", 404, "No deployment named 'absent'."),
        ("embedder/versions/1", 400, "The inference request header is not valid JSON"),
        ("embedder", 400, "The inference request header is not valid JSON"),
    ];
    for (path, status, says) in cases {
        let response = server
            .http
            .post(format!("{}/v2/models/{path}/infer", server.url))
            .bearer_auth(&admin)
            .header("content-type", "application/json")
            .body(r#"{"inputs": [{"name": "text", "#)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), status, "{path}");
        let body: Value = response.json().await.unwrap();
        assert_eq!(body.as_object().map(|o| o.len()), Some(1), "KServe's shape: {body}");
        assert!(body["error"].as_str().unwrap().starts_with(says), "{path}: {body}");
    }

    let mut socket = tokio::net::TcpStream::connect(server.url.trim_start_matches("http://")).await.unwrap();
    let head = format!(
        "POST /v2/models/embedder/versions/2/infer HTTP/1.1\r\nhost: tessera\r\nauthorization: Bearer {admin}\r\n\
         content-type: application/json\r\ncontent-length: 100000\r\n\r\n{{\"inputs\": ["
    );
    tokio::io::AsyncWriteExt::write_all(&mut socket, head.as_bytes()).await.unwrap();
    let mut answer = [0u8; 1024];
    let read = tokio::io::AsyncReadExt::read(&mut socket, &mut answer);
    let n = tokio::time::timeout(Duration::from_secs(10), read).await.expect("answered with the body unsent").unwrap();
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(answer.starts_with("HTTP/1.1 404"), "{answer}");
    assert_eq!(engine.calls.load(Ordering::SeqCst), 0, "no replica was asked");
}

/// `GET /v1/models/{model}` (the OpenAI SDK's `models.retrieve`) answers the object the
/// list holds for it, and a 404 in OpenAI's shape for a model the caller may not call.
#[tokio::test]
async fn a_model_is_retrieved_as_the_list_shows_it() {
    let server = TestServer::start(Backend::Sqlite).await;
    let admin = server.admin().await;
    let alice = server.user(&admin, "alice").await;
    let bob = server.user(&admin, "bob").await;
    ready_deployment(&server, &alice).await;

    let list: Value = gateway_get(&server, &alice, "/v1/models").await.json().await.unwrap();
    let response = gateway_get(&server, &alice, "/v1/models/embedder").await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.json::<Value>().await.unwrap(), list["data"][0], "{list}");
    assert_eq!(gateway_get(&server, &admin, "/v1/models/embedder").await.status(), 200, "admins see it too");

    for (token, path) in [(&bob, "/v1/models/embedder"), (&alice, "/v1/models/absent")] {
        let response = gateway_get(&server, token, path).await;
        assert_eq!(response.status(), 404, "{path}");
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["error"]["code"], 404, "{body}");
        assert!(body["error"]["message"].as_str().unwrap().contains("No deployment named"), "{body}");
    }
    let anonymous = server.http.get(format!("{}/v1/models/embedder", server.url)).send().await.unwrap();
    assert_eq!(anonymous.status(), 401);
}

/// An embeddings request without credentials is answered 401 before its body is read: one
/// whose body never finishes arriving gets the answer at once, so no anonymous client makes
/// the server buffer or parse what it sends.
#[tokio::test]
async fn an_unauthenticated_embeddings_request_is_refused_before_its_body_is_read() {
    let server = TestServer::start(Backend::Sqlite).await;
    let mut socket = tokio::net::TcpStream::connect(server.url.trim_start_matches("http://")).await.unwrap();
    let head = "POST /v1/embeddings HTTP/1.1\r\nhost: tessera\r\ncontent-type: application/json\r\n\
                content-length: 100000\r\n\r\n{\"model\": \"embedder\", \"input\": [";
    tokio::io::AsyncWriteExt::write_all(&mut socket, head.as_bytes()).await.unwrap();
    let mut answer = [0u8; 1024];
    let read = tokio::io::AsyncReadExt::read(&mut socket, &mut answer);
    let n = tokio::time::timeout(Duration::from_secs(10), read).await.expect("answered with the body unsent").unwrap();
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
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

/// A replica cannot send the gateway, with the user's request and the engine token, on to
/// another address: an engine's redirect is an answer no engine gives (502), not followed.
#[tokio::test]
async fn an_engine_s_redirect_is_not_followed() {
    let server = TestServer::start(Backend::Sqlite).await;
    let admin = server.admin().await;
    let elsewhere = StandIn::start(vec![9.0, 9.0]).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let target = format!("{}/embed", elsewhere.url);
    let redirect = move || async move { (StatusCode::TEMPORARY_REDIRECT, [(axum::http::header::LOCATION, target)]) };
    let app = Router::new().route("/replica/embed", post(redirect));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    deployment_at(&server, &admin, "sly", &[format!("http://{address}/replica")]).await;
    let (_, token) = api_token(&server, &admin).await;
    let response = embed_with(&server, &token, "sly", "hello").await;
    assert_eq!(response.status(), 502);
    assert_eq!(elsewhere.calls.load(Ordering::SeqCst), 0, "the redirect was followed");
}
