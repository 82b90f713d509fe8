//! Overload end to end (issue 14): the real server and worker binaries, one MiniLM replica
//! on a worker with a short queue wait limit and small per-request caps, hit by a burst of
//! concurrent requests on both client APIs. Every request is answered, 200 or 429, none
//! times out or fails; the 429s carry `Retry-After` in the route's error shape; a request
//! over a cap is a 413 naming it. Nothing here depends on timing beyond generous bounds.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tessera_tests::{eventually, minilm_dir, start_server, User, MINILM_FILES};

const WORKER_TOKEN: &str = "overload-e2e-worker-token-at-least-32-bytes";
/// The worker's limits: any work ahead past 50 ms is refused, so concurrent requests of a
/// few thousand tokens each (hundreds of milliseconds of CPU) cannot all be admitted.
const MAX_QUEUE_WAIT_MS: &str = "50";
const MAX_REQUEST_INPUTS: usize = 32;
const MAX_REQUEST_TOKENS: usize = 6000;
/// Concurrent requests of the burst, per route.
const BURST: usize = 16;
/// Longer than any answer should take, shorter than a client would wait: a request that
/// takes this long counts as timed out.
const ANSWER_BOUND: Duration = Duration::from_secs(30);

/// `count` distinct texts of about 250 tokens each (MiniLM keeps 256).
fn texts(seed: usize, count: usize) -> Vec<String> {
    let words = ["tokens", "queue", "replica", "batch", "answer", "client", "shed", "load", "wait", "limit", "refuse", "retry"];
    (0..count).map(|t| (0..240).map(|w| words[(seed * 31 + t * 7 + w * w) % words.len()]).collect::<Vec<_>>().join(" ")).collect()
}

/// One route's way of asking for embeddings, and of reading its answers and refusals.
#[derive(Clone, Copy, Debug)]
enum Route {
    OpenAi,
    KServe,
}

impl Route {
    fn request(self, user: &User, texts: &[String]) -> reqwest::RequestBuilder {
        let (path, body) = match self {
            Route::OpenAi => ("/v1/embeddings".to_string(), json!({"model": "minilm", "input": texts})),
            Route::KServe => (
                "/v2/models/minilm/infer".to_string(),
                json!({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [texts.len()], "data": texts}]}),
            ),
        };
        user.http.post(format!("{}{path}", user.url)).bearer_auth(&user.token).timeout(ANSWER_BOUND).json(&body)
    }

    /// Asserts an answer holds one 384-wide embedding per text.
    fn check_answer(self, body: &Value, texts: usize) {
        match self {
            Route::OpenAi => {
                let data = body["data"].as_array().expect("OpenAI's data");
                assert_eq!(data.len(), texts, "{body}");
                assert!(data.iter().all(|d| d["embedding"].as_array().map(Vec::len) == Some(384)), "{body}");
            }
            Route::KServe => assert_eq!(body["outputs"][0]["shape"], json!([texts, 384]), "{body}"),
        }
    }

    /// The `index`th embedding of an answer.
    fn embedding(self, body: &Value, index: usize) -> Vec<f64> {
        let values = match self {
            Route::OpenAi => &body["data"][index]["embedding"],
            Route::KServe => &body["outputs"][0]["data"],
        };
        let all: Vec<f64> = values.as_array().unwrap_or_else(|| panic!("{body}")).iter().map(|v| v.as_f64().unwrap()).collect();
        match self {
            Route::OpenAi => all,
            Route::KServe => all[index * 384..(index + 1) * 384].to_vec(),
        }
    }

    /// The refusal's sentence, from the route's error shape: OpenAI's
    /// `{"error": {"message", "type", "code"}}`, KServe's `{"error": "…"}`.
    fn error_message(self, body: &Value, status: u16) -> String {
        match self {
            Route::OpenAi => {
                assert_eq!(body["error"]["code"].as_u64(), Some(status as u64), "{body}");
                assert!(body["error"]["type"].is_string(), "{body}");
                body["error"]["message"].as_str().unwrap_or_else(|| panic!("OpenAI's error shape: {body}")).to_string()
            }
            Route::KServe => body["error"].as_str().unwrap_or_else(|| panic!("KServe's error shape: {body}")).to_string(),
        }
    }
}

/// What one request of the burst got.
struct Outcome {
    status: u16,
    retry_after: Option<u64>,
    body: Value,
    took: Duration,
}

async fn send(route: Route, user: &User, texts: &[String]) -> Outcome {
    let started = Instant::now();
    let response = match route.request(user, texts).send().await {
        Ok(response) => response,
        Err(e) => panic!("{route:?}: no answer within {ANSWER_BOUND:?}: {e}"),
    };
    let status = response.status().as_u16();
    let retry_after = response.headers().get("retry-after").map(|v| v.to_str().unwrap().parse::<u64>().expect("Retry-After in seconds"));
    let body = response.json().await.unwrap_or_else(|e| panic!("{route:?}: a {status} without a JSON body: {e}"));
    Outcome { status, retry_after, body, took: started.elapsed() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overloaded_replica_answers_every_request_at_once_with_200_or_429_and_caps_requests_with_413() {
    let Some(model_dir) = minilm_dir() else { return };
    let data = tempfile::tempdir().unwrap();
    let (mut server, url) = start_server(&data.path().join("server"), WORKER_TOKEN, 10);
    let user = User::login(&mut server, &url).await;
    let mut form = reqwest::multipart::Form::new().text("name", "minilm");
    for path in MINILM_FILES {
        form = form.part("files", reqwest::multipart::Part::bytes(std::fs::read(model_dir.join(path)).unwrap()).file_name(path.to_string()));
    }
    let uploaded = user.http.post(format!("{url}/api/v1/models")).bearer_auth(&user.token).multipart(form).send().await.unwrap();
    assert_eq!(uploaded.status(), 201);

    let mut command = std::process::Command::new(tessera_tests::binary("tessera-worker"));
    command
        .args(["--server", &url, "--name", "overload-worker", "--data-dir"])
        .arg(data.path().join("worker"))
        .env("TESSERA_WORKER_TOKEN", WORKER_TOKEN)
        .env("TESSERA_MAX_QUEUE_WAIT_MS", MAX_QUEUE_WAIT_MS)
        .env("TESSERA_MAX_REQUEST_INPUTS", MAX_REQUEST_INPUTS.to_string())
        .env("TESSERA_MAX_REQUEST_TOKENS", MAX_REQUEST_TOKENS.to_string());
    let worker = tessera_tests::Process::spawn(&mut command);
    let created = user.http.post(format!("{url}/api/v1/deployments")).bearer_auth(&user.token)
        .json(&json!({"name": "minilm", "model": "minilm", "replicas": 1})).send().await.unwrap();
    assert_eq!(created.status(), 201);
    eventually("the deployment is ready", Duration::from_secs(120), || async {
        let d = user.get("/deployments/minilm").await;
        assert_ne!(d["state"], "failed", "{d}\n{}", worker.output());
        (d["state"] == "ready").then_some(())
    })
    .await;

    for route in [Route::OpenAi, Route::KServe] {
        // The burst: 16 texts of about 250 tokens per request (about 4000 tokens, under the
        // cap), all at once.
        let user = std::sync::Arc::new(User { http: user.http.clone(), url: user.url.clone(), token: user.token.clone() });
        let calls: Vec<_> = (0..BURST)
            .map(|i| {
                let user = user.clone();
                tokio::spawn(async move { send(route, &user, &texts(i, 16)).await })
            })
            .collect();
        let mut outcomes = Vec::new();
        for call in calls {
            outcomes.push(call.await.unwrap());
        }
        for outcome in &outcomes {
            assert!(outcome.took < ANSWER_BOUND, "{route:?}: an answer took {:?}", outcome.took);
            match outcome.status {
                200 => route.check_answer(&outcome.body, 16),
                429 => {
                    let seconds = outcome.retry_after.unwrap_or_else(|| panic!("{route:?}: a 429 without Retry-After: {}", outcome.body));
                    assert!(seconds >= 1, "{route:?}: Retry-After {seconds}");
                    let message = route.error_message(&outcome.body, 429);
                    assert!(message.contains("at capacity") && message.contains("retry in"), "{route:?}: {message}");
                }
                other => panic!("{route:?}: {other} under overload (only 200 or 429 may come back): {}\n{}", outcome.body, worker.output()),
            }
        }
        let refused = outcomes.iter().filter(|o| o.status == 429).count();
        // The first request finds the replica idle; the rest arrive while it computes.
        eprintln!("{route:?}: {refused} of {BURST} refused");
        assert!(refused >= 1 && refused < BURST, "{route:?}: {refused} of {BURST} refused");

        // Once the burst is over the replica has room again. 8 texts of about 250 tokens
        // are more than one CPU pass of MiniLM (1365 tokens): each text's embedding is the
        // one it gets alone.
        let batch = texts(99, 8);
        let after = send(route, &user, &batch).await;
        assert_eq!(after.status, 200, "{route:?} after the burst: {}", after.body);
        route.check_answer(&after.body, 8);
        for i in [0, 7] {
            let alone = send(route, &user, &batch[i..=i]).await;
            assert_eq!(alone.status, 200, "{}", alone.body);
            let (together, alone) = (route.embedding(&after.body, i), route.embedding(&alone.body, 0));
            let gap = together.iter().zip(&alone).map(|(a, b)| (a - b).abs()).fold(0.0f64, f64::max);
            assert!(gap < 1e-4, "{route:?}: text {i} differs by {gap} computed with the others and alone");
        }

        // Per-request caps: 413 naming the limit, in the route's shape.
        let too_many = vec!["a short text".to_string(); MAX_REQUEST_INPUTS + 1];
        let too_long = texts(7, MAX_REQUEST_INPUTS); // 32 × about 250 tokens
        for (inputs, limit) in [(too_many, "max_request_inputs"), (too_long, "max_request_tokens")] {
            let outcome = send(route, &user, &inputs).await;
            assert_eq!(outcome.status, 413, "{route:?}, {limit}: {}", outcome.body);
            let message = route.error_message(&outcome.body, 413);
            assert!(message.contains(limit), "{route:?}: {message}");
        }
    }
}
