//! Hostile input against the real `tessera-server` (and `tessera-worker`) binaries, one test
//! per family of issue 14: what an attacker or a careless client sends gets a clear 4xx in
//! the platform's error shape, never a 500, a redirect off the site, or memory kept.

use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tessera_tests::{
    admin_password, binary, databases, error_body, eventually, minilm_dir, start_server_with,
    start_worker, Process, User,
};
use tessera_worker::engine::synthetic::RandomBert;

const WORKER_TOKEN: &str = "hostile-worker-token-of-32-bytes-or-more";

/// A server over SQLite in `dir` (or `database`), with the extra settings in `env`.
fn server(dir: &Path, database: Option<&str>, env: &[(&str, &str)]) -> (Process, String) {
    let mut settings = vec![("TESSERA_WORKER_TOKEN", WORKER_TOKEN)];
    settings.extend(database.map(|url| ("TESSERA_DATABASE_URL", url)));
    settings.extend_from_slice(env);
    start_server_with(dir, &settings)
}

fn no_redirects() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
}

// --- Secrets ---------------------------------------------------------------------------

#[test]
fn the_binary_refuses_to_start_with_an_empty_or_short_secret() {
    for (setting, value) in [
        ("TESSERA_WORKER_TOKEN", String::new()),
        ("TESSERA_WORKER_TOKEN", "short".to_string()),
        ("TESSERA_JWT_SECRET", String::new()),
        ("TESSERA_JWT_SECRET", "x".repeat(31)),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let mut command = Command::new(binary("tessera-server"));
        command
            .args(["--bind", "127.0.0.1:0", "--data-dir"])
            .arg(dir.path())
            .env("TESSERA_WORKER_TOKEN", WORKER_TOKEN)
            .env_remove("TESSERA_JWT_SECRET")
            .env_remove("TESSERA_DATABASE_URL")
            .env(setting, &value);
        let mut server = Process::spawn(&mut command);
        let status = server.wait_for_exit_unless("listening on http://", Duration::from_secs(30));
        assert!(!status.success(), "{setting}={value:?}: {status}");
        let output = server.output();
        assert!(
            output.contains(setting) && output.contains("32"),
            "{setting}={value:?}: {output}"
        );
    }
}

// --- Login -----------------------------------------------------------------------------

/// Oversized logins are refused before the rate limiter and keep no memory (on the old
/// code 150 logins with 1 MiB usernames grew the server by ~180 MB); the lock-out is by
/// address and username, so an address guessing `admin`'s password does not lock the
/// real admin out on another address (127.0.0.2 is on loopback too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logins_are_capped_cost_no_memory_and_lock_out_only_the_guessing_address() {
    let dir = tempfile::tempdir().unwrap();
    let (mut server, url) = server(
        dir.path(),
        None,
        &[
            ("TESSERA_LOGIN_BURST", "3"),
            ("TESSERA_LOGIN_REFILL_SECS", "3600"),
        ],
    );
    let password = admin_password(&mut server);
    let http = reqwest::Client::new();
    let login = |http: &reqwest::Client, username: &str, password: &str| {
        http.post(format!("{url}/api/v1/auth/login"))
            .json(&json!({"username": username, "password": password}))
            .send()
    };

    // A different username each time, as a limiter keyed by username kept one per name.
    let huge = "a".repeat(1 << 20);
    let attempt = |round: usize| {
        let (http, username) = (&http, format!("{round:04}{huge}"));
        async move {
            let started = Instant::now();
            let response = login(http, &username, "pw").await.unwrap();
            let body = error_body(response, 400).await;
            assert!(
                body["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("at most"),
                "{body}"
            );
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "attempt {round} took {:?}",
                started.elapsed()
            );
        }
    };
    for round in 0..10 {
        attempt(round).await;
    }
    let before = server.rss_bytes();
    for round in 10..160 {
        attempt(round).await;
    }
    let grown = server.rss_bytes().saturating_sub(before);
    assert!(
        grown < 64 << 20,
        "150 oversized logins grew the server by {} MB",
        grown >> 20
    );

    // An address guessing admin's password is throttled, for the right password too...
    let guesser = reqwest::Client::builder()
        .local_address(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2)))
        .build()
        .unwrap();
    let mut throttled = false;
    for _ in 0..10 {
        let response = login(&guesser, "admin", "wrong password").await.unwrap();
        if response.status() == 429 {
            throttled = true;
            break;
        }
        error_body(response, 401).await;
    }
    assert!(throttled, "3 wrong guesses a burst, yet never a 429");
    assert_eq!(
        login(&guesser, "admin", &password).await.unwrap().status(),
        429
    );
    // ...while admin on another address (after 160 refused oversized logins) still signs in.
    assert_eq!(
        login(&http, "admin", &password).await.unwrap().status(),
        200
    );
}

// --- Error shape -------------------------------------------------------------------------

/// 405s, bad query strings, broken multipart bodies, oversized JSON (413, was a 400) and
/// an anonymous `/metrics` (which named every tenant's deployments) all answer in the
/// platform's `{"error":{"code","message"}}` shape.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rejection_has_the_platform_error_shape() {
    let dir = tempfile::tempdir().unwrap();
    let scrape_token = "hostile-scrape-token-of-32-bytes-or-more";
    let (mut server, url) = server(dir.path(), None, &[("TESSERA_METRICS_TOKEN", scrape_token)]);
    let admin = User::login(&mut server, &url).await;
    let http = &admin.http;

    let response = http
        .put(admin.api("/models"))
        .bearer_auth(&admin.token)
        .send()
        .await
        .unwrap();
    assert_eq!(
        error_body(response, 405).await["error"]["code"],
        "method_not_allowed"
    );
    let job = "00000000-0000-0000-0000-000000000001";
    let response = http
        .get(admin.api(&format!("/jobs/{job}/logs?after=lots")))
        .bearer_auth(&admin.token)
        .send();
    assert_eq!(
        error_body(response.await.unwrap(), 400).await["error"]["code"],
        "bad_request"
    );
    for path in ["/models", "/datasets"] {
        let response = http
            .post(admin.api(path))
            .bearer_auth(&admin.token)
            .header("content-type", "multipart/form-data")
            .body("no boundary, no parts")
            .send()
            .await
            .unwrap();
        error_body(response, 400).await;
    }
    let oversized = json!({"username": "x".repeat(3 << 20), "password": "pw"});
    let response = http
        .post(admin.api("/auth/login"))
        .json(&oversized)
        .send()
        .await
        .unwrap();
    // The rest of the body stays unread: the server says the connection is done, so the
    // client opens a new one for the next request rather than failing on this one.
    assert_eq!(response.headers()["connection"], "close");
    assert_eq!(
        error_body(response, 413).await["error"]["code"],
        "payload_too_large"
    );

    let response = http.get(format!("{url}/metrics")).send().await.unwrap();
    let body = error_body(response, 401).await;
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("TESSERA_METRICS_TOKEN"),
        "{body}"
    );
    let response = http
        .get(format!("{url}/metrics"))
        .bearer_auth("not-the-scrape-token")
        .send()
        .await
        .unwrap();
    error_body(response, 401).await;
    let response = http
        .get(format!("{url}/metrics"))
        .bearer_auth(scrape_token)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let metrics = response.text().await.unwrap();
    assert!(metrics.contains("tessera_workers_online"), "{metrics}");
}

// --- Dashboard sign-in -------------------------------------------------------------------

/// `next=` only ever sends the browser to a path on this site (`/%09/evil.example` left it)
/// and a CR/LF in it is no 500.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_sign_in_only_redirects_to_paths_on_this_site() {
    let dir = tempfile::tempdir().unwrap();
    let (mut server, url) = server(dir.path(), None, &[]);
    let password = admin_password(&mut server);
    let http = no_redirects();
    for next in [
        "/\t/evil.example",
        "//evil.example",
        "https://evil.example",
        "/\\evil.example",
        "/jobs\r\nSet-Cookie: a=b",
    ] {
        let form = [
            ("username", "admin"),
            ("password", password.as_str()),
            ("next", next),
        ];
        let response = http
            .post(format!("{url}/login"))
            .form(&form)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 303, "{next:?}");
        assert_eq!(response.headers()["location"], "/", "{next:?}");
        // The raw query string, as a link in a phishing mail would carry it.
        let encoded = next
            .replace('\t', "%09")
            .replace('\r', "%0D")
            .replace('\n', "%0A")
            .replace(' ', "%20");
        let response = http
            .get(format!("{url}/login?next={encoded}"))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "{next:?}");
        assert!(
            !response.text().await.unwrap().contains("evil.example"),
            "{next:?} is on the sign-in form"
        );
    }
    let form = [
        ("username", "admin"),
        ("password", password.as_str()),
        ("next", "/jobs?state=failed"),
    ];
    let response = http
        .post(format!("{url}/login"))
        .form(&form)
        .send()
        .await
        .unwrap();
    assert_eq!(response.headers()["location"], "/jobs?state=failed");
}

// --- NUL bytes ---------------------------------------------------------------------------

/// PostgreSQL refuses text holding a NUL byte (a 500 on the old code), SQLite stores it:
/// on both, a client sending one gets a 4xx.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nul_bytes_in_names_usernames_and_paths_are_client_errors() {
    for database in databases() {
        let dir = tempfile::tempdir().unwrap();
        let (mut server, url) = server(dir.path(), database.as_deref(), &[]);
        let admin = User::login(&mut server, &url).await;
        let (http, token) = (&admin.http, &admin.token);
        let nul = "ti\0ny";
        let form = reqwest::multipart::Form::new().text("name", nul).part(
            "files",
            reqwest::multipart::Part::bytes(b"{}".to_vec()).file_name("config.json"),
        );
        let requests = [
            http.post(admin.api("/auth/login"))
                .json(&json!({"username": "ad\0min", "password": "pw"})),
            http.post(admin.api("/users"))
                .bearer_auth(token)
                .json(&json!({"username": "a\0b", "password": "long-enough-pw"})),
            http.post(admin.api("/models"))
                .bearer_auth(token)
                .multipart(form),
            http.post(admin.api("/deployments"))
                .bearer_auth(token)
                .json(&json!({"name": "e\0", "model": "tiny"})),
            http.post(admin.api("/deployments"))
                .bearer_auth(token)
                .json(&json!({"name": "e", "model": nul})),
            http.get(admin.api("/deployments/e%00")).bearer_auth(token),
            http.get(admin.api("/datasets/d%00")).bearer_auth(token),
            http.get(admin.api("/jobs?state=queued%00"))
                .bearer_auth(token),
            http.post(format!("{url}/v1/embeddings"))
                .bearer_auth(token)
                .json(&json!({"model": nul, "input": "x"})),
            http.get(format!("{url}/v2/models/ti%00ny"))
                .bearer_auth(token),
        ];
        for request in requests {
            let request = request.build().unwrap();
            let what = format!("{database:?} {} {}", request.method(), request.url());
            let response = http.execute(request).await.unwrap();
            assert!(
                response.status().is_client_error(),
                "{what}: {}\n{}",
                response.status(),
                server.output()
            );
        }
    }
}

// --- Serving -----------------------------------------------------------------------------

/// With a replica serving a small random BERT (MiniLM's tokenizer) on the worker binary:
/// a KServe `shape` that disagrees with the data is a 400 in KServe's shape (`[7]` with one
/// element and `[-3]` answered 200), and deleting the model is a 409 naming the deployment
/// (a 500 from the foreign key), on SQLite and PostgreSQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn served_models_check_kserve_shapes_and_cannot_be_deleted() {
    let Some(tokenizer_dir) = minilm_dir() else {
        return;
    };
    for database in databases() {
        let dir = tempfile::tempdir().unwrap();
        let model_dir = dir.path().join("model");
        let sizes = RandomBert {
            hidden: 32,
            layers: 2,
            heads: 2,
            intermediate: 64,
            vocab: 30522,
            max_positions: 128,
        };
        sizes.write(&model_dir, 5, &tokenizer_dir).unwrap();
        let (mut server, url) = server(&dir.path().join("server"), database.as_deref(), &[]);
        let admin = User::login(&mut server, &url).await;
        let model = admin
            .upload_model(
                &model_dir,
                &["config.json", "model.safetensors", "tokenizer.json"],
                "tiny",
            )
            .await;
        let model_id = model["id"].as_str().unwrap();
        let worker = start_worker(
            &url,
            WORKER_TOKEN,
            &dir.path().join("worker"),
            "hostile-worker",
        );
        let response = admin
            .http
            .post(admin.api("/deployments"))
            .bearer_auth(&admin.token)
            .json(&json!({"name": "embedder", "model": "tiny", "replicas": 1}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 201, "{database:?}");
        eventually(
            "the deployment is ready",
            Duration::from_secs(60),
            || async {
                let deployment = admin.get("/deployments/embedder").await;
                assert_ne!(
                    deployment["state"],
                    "failed",
                    "{deployment}\n{}",
                    worker.output()
                );
                (deployment["state"] == "ready").then_some(())
            },
        )
        .await;

        let infer = |shape: Value| {
            let body = json!({"inputs": [{"name": "text", "datatype": "BYTES", "shape": shape, "data": ["one text"]}]});
            admin
                .http
                .post(format!("{url}/v2/models/embedder/infer"))
                .bearer_auth(&admin.token)
                .json(&body)
                .send()
        };
        for shape in [json!([7]), json!([-3])] {
            let response = infer(shape.clone()).await.unwrap();
            assert_eq!(response.status(), 400, "{database:?} {shape}");
            let body: Value = response.json().await.unwrap();
            assert!(
                body["error"].as_str().is_some_and(|m| m.contains("shape")),
                "{body}"
            );
        }
        // The same request with a shape that agrees is served.
        let response = infer(json!([1])).await.unwrap();
        assert_eq!(response.status(), 200, "{database:?}");
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["outputs"][0]["shape"], json!([1, 32]), "{body}");

        let response = admin
            .http
            .delete(admin.api(&format!("/models/{model_id}")))
            .bearer_auth(&admin.token)
            .send();
        let body = error_body(response.await.unwrap(), 409).await;
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("'embedder'"),
            "{body}"
        );
        let response = admin
            .http
            .delete(admin.api("/deployments/embedder"))
            .bearer_auth(&admin.token)
            .send();
        assert_eq!(response.await.unwrap().status(), 204);
        let response = admin
            .http
            .delete(admin.api(&format!("/models/{model_id}")))
            .bearer_auth(&admin.token)
            .send();
        assert_eq!(response.await.unwrap().status(), 204, "{database:?}");
    }
}
