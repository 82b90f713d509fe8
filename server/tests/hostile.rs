//! Hostile input over real HTTP: what an attacker or a careless client sends gets a clear
//! 4xx in the platform's error shape, never a 500, a redirect off the site, or memory
//! the server keeps. Items of issue 14, each a specification of the fixed behaviour.

mod support;

use serde_json::{json, Value};
use support::{backends, model_form, tiny_model, Backend, TestServer, ADMIN_PASSWORD, WORKER_TOKEN};
use tessera_server::config::Config;
use tessera_server::state::AppState;

/// The `{"error":{"code","message"}}` body of a rejection, asserting its shape.
async fn error_body(response: reqwest::Response) -> Value {
    let text = response.text().await.unwrap();
    let body: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("not the error shape: {text}"));
    assert!(body["error"]["code"].is_string() && body["error"]["message"].is_string(), "not the error shape: {body}");
    body
}

// --- Secrets ---------------------------------------------------------------------------

#[tokio::test]
async fn refuses_to_start_with_a_short_or_empty_secret() {
    for (setting, value) in [
        ("TESSERA_WORKER_TOKEN", ""),
        ("TESSERA_WORKER_TOKEN", "short"),
        ("TESSERA_JWT_SECRET", ""),
        ("TESSERA_JWT_SECRET", "x".repeat(31).as_str()),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let mut config = Config::with_data_dir(dir.path().to_path_buf());
        if setting == "TESSERA_WORKER_TOKEN" {
            config.worker_token = Some(value.to_string());
        } else {
            config.jwt_secret = Some(value.to_string());
        }
        let error = AppState::open(config).await.err().unwrap_or_else(|| panic!("{setting}={value:?} was accepted"));
        assert!(error.to_string().contains(setting), "{error}");
    }
}

// The binary itself refusing them from its environment: tests/hostile.rs.

#[tokio::test]
async fn long_secrets_and_a_generated_jwt_secret_start() {
    let server = TestServer::start_tweaked(Backend::Sqlite, |config| {
        config.jwt_secret = Some("j".repeat(32));
    })
    .await;
    server.admin().await;
    // Without TESSERA_JWT_SECRET the key is generated into the data directory, twice in a row.
    let server = TestServer::start(Backend::Sqlite).await.restart().await;
    server.admin().await;
}

// --- Login -----------------------------------------------------------------------------

async fn login(server: &TestServer, username: &str, password: &str) -> reqwest::Response {
    server
        .http
        .post(server.api("/auth/login"))
        .json(&json!({"username": username, "password": password}))
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn oversized_logins_are_refused_before_the_rate_limiter() {
    let server = TestServer::start_tweaked(Backend::Sqlite, |config| {
        config.login_burst = 3;
        config.login_refill_secs = 3600;
    })
    .await;
    let huge = "a".repeat(64 * 1024);
    for _ in 0..10 {
        let response = login(&server, &huge, "pw").await;
        assert_eq!(response.status(), 400);
        error_body(response).await;
        let response = login(&server, "admin", &huge).await;
        assert_eq!(response.status(), 400);
    }
    assert_eq!(server.state.login_limiter.tracked(), 0, "refused logins keep no limiter state");
    assert_eq!(login(&server, "admin", ADMIN_PASSWORD).await.status(), 200);
}

#[tokio::test]
async fn one_address_cannot_lock_admin_out_for_everyone() {
    let server = TestServer::start_tweaked(Backend::Sqlite, |config| {
        config.login_burst = 3;
        config.login_refill_secs = 3600;
    })
    .await;
    let limiter = &server.state.login_limiter;
    let attacker: std::net::IpAddr = "203.0.113.9".parse().unwrap();
    let now = std::time::Instant::now();
    while limiter.attempt(attacker, "admin", now).is_ok() {}
    // The attacker's address is throttled for admin; admin on loopback still signs in.
    assert!(limiter.attempt(attacker, "admin", now).is_err());
    assert_eq!(login(&server, "admin", ADMIN_PASSWORD).await.status(), 200);
}

// --- Error shape -------------------------------------------------------------------------

#[tokio::test]
async fn every_rejection_has_the_platform_error_shape() {
    let server = TestServer::start(Backend::Sqlite).await;
    let admin = server.admin().await;

    let response = server.http.put(server.api("/models")).bearer_auth(&admin).send().await.unwrap();
    assert_eq!(response.status(), 405);
    assert_eq!(error_body(response).await["error"]["code"], "method_not_allowed");

    let response = server.get(&admin, "/jobs/00000000-0000-0000-0000-000000000001/logs?after=lots").await;
    assert_eq!(response.status(), 400);
    assert_eq!(error_body(response).await["error"]["code"], "bad_request");

    for (path, content_type) in [("/models", "multipart/form-data"), ("/datasets", "text/plain")] {
        let response = server
            .http
            .post(server.api(path))
            .bearer_auth(&admin)
            .header("content-type", content_type)
            .body("no parts here")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 400, "{path}");
        error_body(response).await;
    }

    let oversized = json!({"username": "x".repeat(3 << 20), "password": "pw"});
    let response = server.http.post(server.api("/auth/login")).json(&oversized).send().await.unwrap();
    assert_eq!(response.status(), 413);
    assert_eq!(error_body(response).await["error"]["code"], "payload_too_large");

    // The dashboard's routes too: a path that is not UTF-8 or not a number, a query field
    // of the wrong type, a form without its content type. A browser gets the error page
    // (web.rs checks its sentence and headers), a script's request the error shape.
    let http = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
    let cookie = dashboard_cookie(&server, &http).await;
    let job = "00000000-0000-0000-0000-000000000001";
    let form = |scripted: bool| {
        let request = http.post(format!("{}/deployments", server.url)).header("cookie", &cookie);
        let request = request.header("content-type", "application/json").body("{}");
        if scripted { request.header("x-requested-with", "fetch") } else { request }
    };
    let paths = [
        "/models/%FF".to_string(),
        "/deployments/%FF".to_string(),
        format!("/jobs/{job}/series?max_points=lots"),
        format!("/jobs/{job}/checkpoints/latest/files/w.bin"),
    ];
    let mut requests = vec![(form(false), form(true), 415)];
    for path in paths {
        let page = http.get(format!("{}{path}", server.url)).header("cookie", &cookie);
        requests.push((page.try_clone().unwrap(), page.header("x-requested-with", "fetch"), 400));
    }
    for (page, scripted, status) in requests {
        let response = page.send().await.unwrap();
        let what = format!("{status} {}", response.url());
        assert_eq!(response.status(), status, "{what}");
        let content_type = response.headers()["content-type"].to_str().unwrap();
        assert!(content_type.starts_with("text/html"), "{what}: {content_type}");
        let response = scripted.send().await.unwrap();
        assert_eq!(response.status(), status, "{what}, scripted");
        let body = error_body(response).await;
        if status == 415 {
            assert_eq!(body["error"]["code"], "unsupported_media_type");
        }
    }
}

#[tokio::test]
async fn gateway_405s_and_413s_use_the_gateways_shapes() {
    let server = TestServer::start(Backend::Sqlite).await;
    let admin = server.admin().await;
    // KServe finds the model before it reads a body.
    deployment_named(&server, &admin, "m").await;
    let response = server.http.get(format!("{}/v1/embeddings", server.url)).bearer_auth(&admin).send().await.unwrap();
    assert_eq!(response.status(), 405);
    let body: Value = response.json().await.unwrap();
    assert!(body["error"]["message"].is_string() && body["error"]["type"].is_string(), "{body}");

    let response =
        server.http.get(format!("{}/v2/models/m/infer", server.url)).bearer_auth(&admin).send().await.unwrap();
    assert_eq!(response.status(), 405);
    let body: Value = response.json().await.unwrap();
    assert!(body["error"].is_string(), "{body}");

    let response = server
        .http
        .post(format!("{}/v2/models/m/infer", server.url))
        .bearer_auth(&admin)
        .body(vec![b' '; 3 << 20])
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 413);
    let body: Value = response.json().await.unwrap();
    assert!(body["error"].as_str().unwrap().contains("bytes at most"), "{body}");

    let oversized = json!({"model": "m", "input": "x".repeat(3 << 20)});
    let response =
        server.http.post(format!("{}/v1/embeddings", server.url)).bearer_auth(&admin).json(&oversized).send().await.unwrap();
    assert_eq!(response.status(), 413);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("bytes at most"), "{body}");
}

#[tokio::test]
async fn unknown_api_paths_are_json_404s() {
    let server = TestServer::start(Backend::Sqlite).await;
    let admin = server.admin().await;
    for (method, path) in [("GET", "/api"), ("GET", "/api/"), ("POST", "/api/"), ("GET", "/api/v1/nope"), ("DELETE", "/api/v2")] {
        let method: reqwest::Method = method.parse().unwrap();
        let response = server.http.request(method, format!("{}{path}", server.url)).bearer_auth(&admin).send().await.unwrap();
        assert_eq!(response.status(), 404, "{path}");
        let body: Value = response.json().await.unwrap_or_else(|e| panic!("{path}: not JSON: {e}"));
        assert!(body["error"]["message"].as_str().unwrap().contains("/api/openapi.json"), "{path}: {body}");
    }
}

#[tokio::test]
async fn unknown_gateway_paths_are_404s_in_the_gateways_shapes() {
    let server = TestServer::start(Backend::Sqlite).await;
    let admin = server.admin().await;
    let request = |method: reqwest::Method, path: &str| {
        server.http.request(method, format!("{}{path}", server.url)).bearer_auth(&admin)
    };
    // A cross-site POST is the dashboard guard's business, not the gateway's.
    let openai = [
        // An OpenAI route this server does not serve (`/v1/models/{model}` it does).
        request(reqwest::Method::GET, "/v1/files"),
        request(reqwest::Method::POST, "/v1/chat/completions").json(&json!({"model": "m", "messages": []})),
        request(reqwest::Method::POST, "/v1/chat/completions").header("origin", "https://evil.example").json(&json!({})),
        request(reqwest::Method::GET, "/v1/"),
        request(reqwest::Method::GET, "/v1"),
    ];
    for request in openai {
        let request = request.build().unwrap();
        let what = format!("{} {}", request.method(), request.url().path());
        let response = server.http.execute(request).await.unwrap();
        assert_eq!(response.status(), 404, "{what}");
        let body: Value = response.json().await.unwrap_or_else(|e| panic!("{what}: not JSON: {e}"));
        assert_eq!(body["error"]["type"], "invalid_request_error", "{what}: {body}");
        assert!(body["error"]["message"].as_str().unwrap().contains("/v1/embeddings"), "{what}: {body}");
    }
    for path in ["/v2/repository/index", "/v2/", "/v2/models/m/stats"] {
        let response = request(reqwest::Method::GET, path).send().await.unwrap();
        assert_eq!(response.status(), 404, "{path}");
        let body: Value = response.json().await.unwrap_or_else(|e| panic!("{path}: not JSON: {e}"));
        assert!(body["error"].as_str().unwrap().contains("KServe"), "{path}: {body}");
    }
    // A path that exists but not for this method stays a 405, in the same shapes.
    let response = request(reqwest::Method::POST, "/v1/models").send().await.unwrap();
    assert_eq!(response.status(), 405);
    assert_eq!(response.json::<Value>().await.unwrap()["error"]["type"], "invalid_request_error");
    let response = request(reqwest::Method::POST, "/v2/models/m/ready").send().await.unwrap();
    assert_eq!(response.status(), 405);
    assert!(response.json::<Value>().await.unwrap()["error"].is_string());
}

// --- KServe ------------------------------------------------------------------------------

#[tokio::test]
async fn kserve_shapes_must_agree_with_the_data() {
    let server = TestServer::start(Backend::Sqlite).await;
    let admin = server.admin().await;
    deployment_named(&server, &admin, "m").await;
    let infer = |shape: Value| {
        let body = json!({"inputs": [{"name": "text", "datatype": "BYTES", "shape": shape, "data": ["one text"]}]});
        server.http.post(format!("{}/v2/models/m/infer", server.url)).bearer_auth(&admin).json(&body).send()
    };
    for shape in [json!([7]), json!([-3]), json!([0])] {
        let response = infer(shape.clone()).await.unwrap();
        assert_eq!(response.status(), 400, "{shape}");
        let body: Value = response.json().await.unwrap();
        assert!(body["error"].as_str().unwrap().contains("shape"), "{body}");
    }
    // A shape that agrees gets past the check (to the replica that is not up).
    assert_eq!(infer(json!([1])).await.unwrap().status(), 503);
}

/// A deployment `name` of the tiny model (uploaded under that name), its replica queued.
async fn deployment_named(server: &TestServer, admin: &str, name: &str) {
    assert_eq!(server.upload_model(admin, name, tiny_model()).await.status(), 201);
    let response = server.post(admin, "/deployments", json!({"name": name, "model": name, "replicas": 1})).await;
    assert_eq!(response.status(), 201);
}

// --- Deleting what is in use -------------------------------------------------------------

#[tokio::test]
async fn deleting_a_served_model_is_a_409_naming_the_deployment() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let response = server.upload_model(&admin, "tiny", tiny_model()).await;
        assert_eq!(response.status(), 201);
        let model: Value = response.json().await.unwrap();
        let id = model["id"].as_str().unwrap();
        let response =
            server.post(&admin, "/deployments", json!({"name": "embedder", "model": "tiny", "replicas": 1})).await;
        assert_eq!(response.status(), 201);

        let response = server.delete(&admin, &format!("/models/{id}")).await;
        assert_eq!(response.status(), 409, "{backend:?}");
        assert!(error_body(response).await["error"]["message"].as_str().unwrap().contains("'embedder'"));

        // The dashboard says the same on its error page.
        let http = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
        let cookie = dashboard_cookie(&server, &http).await;
        let response =
            http.post(format!("{}/models/{id}/delete", server.url)).header("cookie", &cookie).send().await.unwrap();
        assert_eq!(response.status(), 409, "{backend:?}");
        assert!(response.text().await.unwrap().contains("embedder"));

        // The dashboard's upload answers the API's way, a broken multipart body included.
        let response = http
            .post(format!("{}/models/upload", server.url))
            .header("cookie", &cookie)
            .header("x-requested-with", "XMLHttpRequest")
            .header("content-type", "multipart/form-data")
            .body("no boundary")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 400);
        error_body(response).await;

        // Once the deployment is gone, the model can go.
        assert_eq!(server.delete(&admin, "/deployments/embedder").await.status(), 204);
        assert_eq!(server.delete(&admin, &format!("/models/{id}")).await.status(), 204);
    }
}

#[tokio::test]
async fn deleting_a_model_unfinished_jobs_use_is_a_409_naming_them() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let response = server.upload_model(&admin, "tiny", tiny_model()).await;
        assert_eq!(response.status(), 201);
        let id = response.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_string();
        assert_eq!(server.upload_model(&admin, "other", tiny_model()).await.status(), 201);
        let csv = (0..20).fold(String::from("text,label\n"), |csv, i| csv + &format!("hello world {i},{}\n", i % 2));
        let form = reqwest::multipart::Form::new()
            .text("name", "reviews")
            .part("file", reqwest::multipart::Part::bytes(csv.into_bytes()).file_name("reviews.csv"));
        let response = server.http.post(server.api("/datasets")).bearer_auth(&admin).multipart(form).send().await.unwrap();
        assert_eq!(response.status(), 201);

        let train = json!({"name": "fine-tune", "model": "tiny", "dataset": "reviews",
            "task": {"type": "classification", "label_column": "label", "text_column": "text", "validation_split": 0.25},
            "optimizer": {"type": "sgd"}, "batch_size": 4, "max_steps": 10, "eval_every": 5, "checkpoint_every": 5,
            "lr_schedule": {"type": "constant", "lr": 0.1}, "seed": 1});
        let mut using = Vec::new();
        for (path, body) in [
            ("/jobs", train),
            ("/jobs", json!({"name": "warm", "spec": {"kind": "prefetch", "model": "tiny"}})),
            ("/models/tiny/profiles", json!({})),
        ] {
            let response = server.post(&admin, path, body).await;
            assert_eq!(response.status(), 201, "{path}: {}", response.text().await.unwrap());
            using.push(response.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_string());
        }
        // Jobs of another model, and jobs that ended, hold nothing.
        let response = server.post(&admin, "/jobs", json!({"name": "warm", "spec": {"kind": "prefetch", "model": "other"}})).await;
        assert_eq!(response.status(), 201);

        let response = server.delete(&admin, &format!("/models/{id}")).await;
        assert_eq!(response.status(), 409, "{backend:?}");
        let message = error_body(response).await["error"]["message"].as_str().unwrap().to_string();
        assert!(message.contains("3 unfinished job(s)"), "{message}");
        for (kind, job) in ["train", "prefetch", "profile"].iter().zip(&using) {
            assert!(message.contains(&format!("{kind} job {job}")), "{message} should name {kind} job {job}");
        }

        for job in &using[..2] {
            assert_eq!(server.post(&admin, &format!("/jobs/{job}/cancel"), json!({})).await.status(), 200);
        }
        let response = server.delete(&admin, &format!("/models/{id}")).await;
        assert_eq!(response.status(), 409, "the profile job still reads it ({backend:?})");
        assert_eq!(server.post(&admin, &format!("/jobs/{}/cancel", using[2]), json!({})).await.status(), 200);
        assert_eq!(server.delete(&admin, &format!("/models/{id}")).await.status(), 204, "{backend:?}");
    }
}

/// Signs in through the dashboard's form; returns the `Cookie` header value.
async fn dashboard_cookie(server: &TestServer, http: &reqwest::Client) -> String {
    let response = http
        .post(format!("{}/login", server.url))
        .form(&[("username", "admin"), ("password", ADMIN_PASSWORD), ("next", "/")])
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 303);
    let cookie = response.headers()["set-cookie"].to_str().unwrap();
    cookie.split(';').next().unwrap().to_string()
}

// --- Dashboard sign-in -------------------------------------------------------------------

#[tokio::test]
async fn dashboard_login_only_redirects_to_paths_on_this_site() {
    let server = TestServer::start(Backend::Sqlite).await;
    let http = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
    for next in ["/\t/evil.example", "//evil", "https://evil", "/\\evil", "/jobs\r\nSet-Cookie: a=b", "/a\nb", "/login"]
    {
        let response = http
            .post(format!("{}/login", server.url))
            .form(&[("username", "admin"), ("password", ADMIN_PASSWORD), ("next", next)])
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 303, "{next:?}");
        assert_eq!(response.headers()["location"], "/", "{next:?}");
        // The sign-in form carries the same fallback.
        let response = http.get(format!("{}/login", server.url)).query(&[("next", next)]).send().await.unwrap();
        assert_eq!(response.status(), 200, "{next:?}");
    }
    let response = http
        .post(format!("{}/login", server.url))
        .form(&[("username", "admin"), ("password", ADMIN_PASSWORD), ("next", "/jobs?state=failed")])
        .send()
        .await
        .unwrap();
    assert_eq!(response.headers()["location"], "/jobs?state=failed");
}

// --- NUL bytes ---------------------------------------------------------------------------

/// PostgreSQL refuses text holding a NUL byte with an error; SQLite stores it. Either
/// way a client sending one gets a 4xx.
#[tokio::test]
async fn nul_bytes_in_names_usernames_and_paths_are_client_errors() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let response = server.upload_model(&admin, "tiny", tiny_model()).await;
        assert_eq!(response.status(), 201);
        let model: Value = response.json().await.unwrap();
        let id = model["id"].as_str().unwrap();
        let nul = "ti\0ny";
        let requests = [
            server.http.post(server.api("/auth/login")).json(&json!({"username": "ad\0min", "password": "pw"})),
            server
                .http
                .post(server.api("/users"))
                .bearer_auth(&admin)
                .json(&json!({"username": "a\0b", "password": "long-enough-pw"})),
            server.http.post(server.api("/models")).bearer_auth(&admin).multipart(model_form(nul, tiny_model())),
            server
                .http
                .post(server.api("/deployments"))
                .bearer_auth(&admin)
                .json(&json!({"name": "e\0", "model": "tiny"})),
            server.http.post(server.api("/deployments")).bearer_auth(&admin).json(&json!({"name": "e", "model": nul})),
            server.http.get(server.api("/deployments/e%00")).bearer_auth(&admin),
            server.http.get(server.api("/datasets/d%00")).bearer_auth(&admin),
            server.http.get(server.api(&format!("/models/{id}/files/config.json%00"))).bearer_auth(&admin),
            server.http.get(server.api("/jobs?state=queued%00")).bearer_auth(&admin),
            server
                .http
                .post(format!("{}/v1/embeddings", server.url))
                .bearer_auth(&admin)
                .json(&json!({"model": nul, "input": "x"})),
            server
                .http
                .post(format!("{}/v2/models/ti%00ny/infer", server.url))
                .bearer_auth(&admin)
                .json(&json!({"inputs": [{"name": "t", "datatype": "BYTES", "shape": [1], "data": ["x"]}]})),
            server.http.get(format!("{}/v2/models/ti%00ny", server.url)).bearer_auth(&admin),
        ];
        for request in requests {
            let request = request.build().unwrap();
            let what = format!("{backend:?} {} {}", request.method(), request.url());
            let response = server.http.execute(request).await.unwrap();
            assert!(response.status().is_client_error(), "{what}: {}", response.status());
        }

        // A config.json's architecture is stored as given: a NUL in it is the upload's mistake.
        let mut files = tiny_model();
        let (_, config) = files.iter_mut().find(|(path, _)| path == "config.json").unwrap();
        let mut parsed: Value = serde_json::from_slice(config).unwrap();
        parsed["architectures"] = json!(["Bert\u{0}Model"]);
        *config = serde_json::to_vec(&parsed).unwrap();
        let response = server.upload_model(&admin, "nul-architecture", files).await;
        assert_eq!(response.status(), 422, "{backend:?}");
        let body = error_body(response).await;
        assert_eq!(body["error"]["code"], "invalid_model", "{backend:?}");
        assert!(body["error"]["message"].as_str().unwrap().contains("architectures[0]"), "{body}");

        // Free-text names and a preemption's reason are stored as given: a 422 says what to fix.
        let job: Value = server
            .post(&admin, "/jobs", json!({"name": "warm", "spec": {"kind": "prefetch", "model": "tiny"}}))
            .await
            .json()
            .await
            .unwrap();
        let preempt = format!("/jobs/{}/preempt", job["id"].as_str().unwrap());
        let refused = [
            ("/jobs", json!({"name": "w\0rm", "spec": {"kind": "prefetch", "model": "tiny"}})),
            ("/tokens", json!({"name": "ci\0"})),
            (preempt.as_str(), json!({"reason": "maintenance\0"})),
        ];
        for (path, body) in refused {
            let response = server.post(&admin, path, body).await;
            assert_eq!(response.status(), 422, "{backend:?} {path}");
        }

        // What a worker reports comes from processes' output: a NUL is kept as U+FFFD, not
        // a failed report.
        let (_, secret) = server.register_worker("w-nul").await;
        let claimed = server.post(&secret, "/agent/claim", json!({"kinds": ["prefetch"]})).await;
        let id = claimed.json::<Value>().await.unwrap()["job_id"].as_str().unwrap().to_string();
        let reports = [
            ("logs", json!({"lines": ["bin\0ary"]})),
            ("status", json!({"state": "failed", "message": "crashed\0"})),
        ];
        for (report, body) in reports {
            let response = server.post(&secret, &format!("/agent/jobs/{id}/{report}"), body).await;
            assert_eq!(response.status(), 204, "{backend:?} {report}");
        }
        let logs: Value = server.get(&admin, &format!("/jobs/{id}/logs")).await.json().await.unwrap();
        assert_eq!(logs[0]["line"], "bin\u{FFFD}ary", "{backend:?}");
        let job: Value = server.get(&admin, &format!("/jobs/{id}")).await.json().await.unwrap();
        assert_eq!(job["message"], "crashed\u{FFFD}", "{backend:?}");
    }
}

/// What names a thing (a worker, its version and slices, a metric) is matched on later,
/// so a worker sending a NUL or another control character in one gets a 422, on
/// PostgreSQL as on SQLite, where the text it reports is cleaned instead.
#[tokio::test]
async fn nul_bytes_in_what_a_worker_names_are_422s() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let inventory = json!({"hostname": "h", "cpu_cores": 2, "memory_bytes": 1024});
        let slice = json!({"uuid": "MIG-\u{0}", "gpu_uuid": "GPU-0", "gpu_index": 0, "gpu_model": "H100-80GB",
                           "profile": "7g.80gb", "start": 0, "memory_bytes": 1024, "simulated": true});
        let with_slice = json!({"hostname": "h", "cpu_cores": 2, "memory_bytes": 1024, "slices": [slice]});
        for (field, body) in [
            ("invalid_name", json!({"name": "w\u{0}", "version": "test", "inventory": inventory})),
            ("invalid_version", json!({"name": "w", "version": "1.0\u{0}", "inventory": inventory})),
            ("invalid_slices", json!({"name": "w", "version": "test", "inventory": with_slice})),
        ] {
            let response = server.post(WORKER_TOKEN, "/agent/register", body).await;
            assert_eq!(response.status(), 422, "{backend:?} {field}");
            assert_eq!(error_body(response).await["error"]["code"], field, "{backend:?}");
        }

        let (_, secret) = server.register_worker("w").await;
        let response = server.post(&secret, "/agent/claim", json!({"kinds": ["pre\u{0}fetch"]})).await;
        assert_eq!(response.status(), 422, "{backend:?} claim");
        // A gang's own row is the server's: a worker leasing it would strand its ranks.
        let response = server.post(&secret, "/agent/claim", json!({"kinds": ["train_gang"]})).await;
        assert_eq!(response.status(), 422, "{backend:?} claim a gang");
        assert!(error_body(response).await["error"]["message"].as_str().unwrap().contains("\"train_gang\" is not a kind"));
        // A list past the database's parameter limit (or one statement per entry) is refused.
        let kinds: Vec<String> = (0..70_000).map(|i| format!("k{i}")).collect();
        let response = server.post(&secret, "/agent/claim", json!({ "kinds": kinds })).await;
        assert_eq!(response.status(), 422, "{backend:?} many kinds");
        assert_eq!(error_body(response).await["error"]["code"], "invalid_kind", "{backend:?}");
        let jobs: Vec<String> = (0..2000).map(|_| uuid::Uuid::new_v4().to_string()).collect();
        let response = server.post(&secret, "/agent/heartbeat", json!({ "jobs": jobs })).await;
        assert_eq!(response.status(), 422, "{backend:?} many jobs");
        assert_eq!(server.upload_model(&admin, "tiny", tiny_model()).await.status(), 201);
        let response = server.post(&admin, "/jobs", json!({"name": "warm", "spec": {"kind": "prefetch", "model": "tiny"}})).await;
        assert_eq!(response.status(), 201);
        let claimed: Value = server.post(&secret, "/agent/claim", json!({"kinds": ["prefetch"]})).await.json().await.unwrap();
        let job = claimed["job_id"].as_str().unwrap();
        let reports = [
            ("metrics", json!({"points": [{"name": "lo\u{0}ss", "step": 1, "value": 0.5}]})),
            ("training-metrics", json!({"steps": [{"step": 1, "lo\u{0}ss": 0.5}]})),
        ];
        for (route, body) in reports {
            let response = server.post(&secret, &format!("/agent/jobs/{job}/{route}"), body).await;
            assert_eq!(response.status(), 422, "{backend:?} {route}");
            assert_eq!(error_body(response).await["error"]["code"], "invalid_metric", "{backend:?} {route}");
        }
        let response = server.post(&secret, &format!("/agent/jobs/{job}/metrics"), json!({"points": [
            {"name": "loss", "step": 1, "value": 0.5}]})).await;
        assert_eq!(response.status(), 204, "{backend:?}: a plain name is stored");
    }
}

// --- Every route ------------------------------------------------------------------------

/// `template` with every `{parameter}` replaced by `value`.
fn fill(template: &str, value: &str) -> String {
    let mut path = String::new();
    let mut rest = template;
    while let (Some(open), Some(close)) = (rest.find('{'), rest.find('}')) {
        path.push_str(&rest[..open]);
        path.push_str(value);
        rest = &rest[close + 1..];
    }
    path + rest
}

/// Every route of the OpenAPI document, sent what a careless client or a fuzzer sends (an
/// unknown or malformed id in each path parameter; no body, JSON of every wrong shape,
/// text that is not JSON; query parameters of the wrong type), answers a client error in
/// its error shape, never a 5xx. Routes that end the caller's own session are left out.
#[tokio::test]
async fn no_route_answers_malformed_requests_with_a_5xx() {
    let server = TestServer::start(Backend::Sqlite).await;
    let admin = server.admin().await;
    let (worker, worker_secret) = server.register_worker("probe").await;
    let document: Value = server.http.get(format!("{}/api/openapi.json", server.url)).send().await.unwrap().json().await.unwrap();
    // Real ids too, each tried in every parameter, so requests get past the lookups.
    let model = server.upload_model(&admin, "tiny", tiny_model()).await.json::<Value>().await.unwrap();
    let dataset = server.toy_dataset(&admin).await;
    let deployment = server.post(&admin, "/deployments", json!({"name": "embedder", "model": "tiny"})).await;
    assert_eq!(deployment.status(), 201);
    let job = server.post(&admin, "/jobs", json!({"name": "p", "spec": {"kind": "prefetch", "model": "tiny"}})).await;
    let job = job.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_string();
    let model = model["id"].as_str().unwrap().to_string();
    let long = "x".repeat(300);
    let ids = [
        "00000000-0000-0000-0000-000000000001", "nope", "%FF", "a%00b", &long,
        &model, "tiny", &dataset, "embedder", &job, &worker, "latest", "1",
    ];
    let bodies: [Option<&str>; 8] = [
        None,
        Some("{}"),
        Some("[]"),
        Some("null"),
        Some("\"x\""),
        Some(r#"{"name": 7, "replicas": -1, "model": [], "dataset": {}, "limit": 1e400, "kinds": "serve"}"#),
        Some("{\"name\": "),
        Some("not json at all"),
    ];
    let queries = ["", "?limit=-1&after=x&before=x&state=x&max_points=99999999999999999999&fragment=1"];
    let mut failures = Vec::new();
    let mut sent = 0;
    // Deletes last, so the real ids stay for every other request.
    let mut routes: Vec<(reqwest::Method, &String)> = Vec::new();
    for (template, operations) in document["paths"].as_object().unwrap() {
        for method in operations.as_object().unwrap().keys() {
            routes.push((reqwest::Method::from_bytes(method.to_uppercase().as_bytes()).unwrap(), template));
        }
    }
    routes.sort_by_key(|(method, _)| *method == reqwest::Method::DELETE);
    for (method, template) in routes {
        if ["/api/v1/auth/logout", "/api/v1/auth/password"].contains(&template.as_str()) {
            continue;
        }
        let token = if template.starts_with("/api/v1/agent") { &worker_secret } else { &admin };
        let filled: Vec<String> = if template.contains('{') {
            ids.iter().map(|id| fill(template, id)).collect()
        } else {
            vec![template.clone()]
        };
        for path in &filled {
            for query in queries {
                for body in bodies {
                    let url = format!("{}{path}{query}", server.url);
                    let mut request = server.http.request(method.clone(), &url).bearer_auth(token);
                    if let Some(body) = body {
                        request = request.header("content-type", "application/json").body(body);
                    }
                    let response = request.send().await.unwrap();
                    sent += 1;
                    let status = response.status();
                    let text = response.text().await.unwrap();
                    let shaped = serde_json::from_str::<Value>(&text).is_ok_and(|v| !v["error"].is_null());
                    if status.is_server_error() || (status.is_client_error() && !shaped) {
                        failures.push(format!("{method} {path}{query} body {body:?}: {status} {text:.200}"));
                    }
                }
            }
        }
    }
    assert!(sent > 1000, "the document lists the routes: {sent} requests sent");
    assert!(failures.is_empty(), "{} of {sent} requests:\n{}", failures.len(), failures.join("\n"));
}
