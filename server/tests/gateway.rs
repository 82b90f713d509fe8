//! The gateway over real HTTP, in front of a stand-in engine endpoint (a loopback HTTP
//! server speaking the worker's engine protocol): requests feed the per-deployment stats
//! route, which only the owner and admins may read, and an API token stops working the
//! moment it is revoked even though the server remembers verified tokens.

mod support;

use std::time::Duration;

use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Value};
use support::{backends, model_form, tiny_model, Backend, TestServer};
use tessera_api::engine::{EngineInput, InferRequest, InferResponse, Timings};

/// Answers every embed with a fixed vector and batch figures; `"overload"` gets the 429
/// a full queue gives.
async fn stand_in_engine() -> String {
    let embed = |Json(request): Json<InferRequest>| async move {
        if request.inputs.contains(&EngineInput::Text("overload".into())) {
            let body = json!({"error": "The queue is full; retry shortly.", "kind": "overloaded"});
            return (StatusCode::TOO_MANY_REQUESTS, Json(body)).into_response();
        }
        let n = request.inputs.len();
        let timings = Timings { queue_us: 10, tokenization_us: 5, inference_us: 100, batch_size: 3, batch_tokens: 42 };
        Json(InferResponse { outputs: vec![vec![0.6, 0.8]; n], tokens: vec![2; n], labels: vec![], timings }).into_response()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, Router::new().route("/replica/embed", post(embed))).await.unwrap() });
    format!("http://{address}/replica")
}

/// `alice` owns a deployment `embedder` whose one replica is ready at the stand-in engine.
async fn ready_deployment(server: &TestServer, alice: &str) {
    let response = server.http.post(server.api("/models")).bearer_auth(alice).multipart(model_form("tiny", tiny_model())).send().await.unwrap();
    assert_eq!(response.status(), 201);
    let response = server.post(alice, "/deployments", json!({"name": "embedder", "model": "tiny", "replicas": 1})).await;
    assert_eq!(response.status(), 201);
    let (_, secret) = server.register_worker("serving-box").await;
    let claimed: Value = server.post(&secret, "/agent/claim", json!({"kinds": ["serve"]})).await.json().await.unwrap();
    let job = claimed["job_id"].as_str().unwrap();
    let report = json!({"state": "running", "endpoint": stand_in_engine().await});
    assert_eq!(server.post(&secret, &format!("/agent/jobs/{job}/status"), report).await.status(), 204);
}

async fn api_token(server: &TestServer, session: &str) -> (String, String) {
    let created: Value = server.post(session, "/tokens", json!({"name": "client"})).await.json().await.unwrap();
    (created["id"].as_str().unwrap().to_string(), created["token"].as_str().unwrap().to_string())
}

async fn embed(server: &TestServer, token: &str, input: &str) -> reqwest::Response {
    let body = json!({"model": "embedder", "input": input});
    server.http.post(format!("{}/v1/embeddings", server.url)).bearer_auth(token).json(&body).send().await.unwrap()
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
