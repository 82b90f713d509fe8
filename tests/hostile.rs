//! Hostile input against the real `tessera-server` (and `tessera-worker`) binaries, one test
//! per family of issue 14: what an attacker or a careless client sends gets a clear 4xx in
//! the platform's error shape, never a 500, a redirect off the site, or memory kept.

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tessera_tests::{
    admin_password, binary, databases, error_body, eventually, minilm_dir, start_server_with,
    start_worker, success_json, Process, User,
};
use tessera_worker::engine::synthetic::{word_level_tokenizer, RandomBert};

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

/// `POST /api/v1{path}` with `body`, as `user`.
async fn post(user: &User, path: &str, body: Value) -> reqwest::Response {
    let request = user
        .http
        .post(user.api(path))
        .bearer_auth(&user.token)
        .json(&body);
    request.send().await.unwrap()
}

/// `GET /api/v1{path}`, as `user`.
async fn fetch(user: &User, path: &str) -> reqwest::Response {
    let request = user.http.get(user.api(path)).bearer_auth(&user.token);
    request.send().await.unwrap()
}

/// The same server, with `token` as the bearer (another session, an API token, a worker).
fn bearer(of: &User, token: &str) -> User {
    User {
        http: of.http.clone(),
        url: of.url.clone(),
        token: token.to_string(),
    }
}

/// `POST /api/v1/auth/login` as `username` with `password`.
async fn login(on: &User, username: &str, password: &str) -> reqwest::Response {
    let body = json!({"username": username, "password": password});
    on.http
        .post(on.api("/auth/login"))
        .json(&body)
        .send()
        .await
        .unwrap()
}

/// A new session of `username`.
async fn sign_in(on: &User, username: &str, password: &str) -> User {
    let session = success_json(login(on, username, password).await).await;
    bearer(on, session["token"].as_str().unwrap())
}

/// The message of a rejection in the platform's error shape.
fn message(body: &Value) -> &str {
    body["error"]["message"].as_str().unwrap()
}

/// The status of `GET /api/v1/auth/me`: whether `user`'s bearer still signs anyone in.
async fn me(user: &User) -> u16 {
    fetch(user, "/auth/me").await.status().as_u16()
}

/// The user `username` (role `user`, password `{username}-secret-pw`), created by `admin`:
/// its id and a session of it.
async fn user(admin: &User, username: &str) -> (String, User) {
    let password = format!("{username}-secret-pw");
    let body = json!({"username": username, "password": password, "role": "user"});
    let created = success_json(post(admin, "/users", body).await).await;
    (
        created["id"].as_str().unwrap().to_string(),
        sign_in(admin, username, &password).await,
    )
}

/// The files of [`tiny_model`]'s folder.
const TINY_FILES: &[&str] = &["config.json", "model.safetensors", "tokenizer.json"];

/// A one-layer random BERT with a word-level tokenizer, written under `dir` (needs no
/// assets): the folder.
fn tiny_model(dir: &Path) -> PathBuf {
    let (tokenizer, model) = (dir.join("tokenizer"), dir.join("tiny"));
    std::fs::create_dir_all(&tokenizer).unwrap();
    let words = word_level_tokenizer(&["hello", "world"], None).to_string();
    std::fs::write(tokenizer.join("tokenizer.json"), words).unwrap();
    let sizes = RandomBert {
        hidden: 8,
        layers: 1,
        heads: 2,
        intermediate: 16,
        vocab: 6,
        max_positions: 16,
    };
    sizes.write(&model, 1, &tokenizer).unwrap();
    model
}

/// A server in `dir` on `database` where hand-registered workers stay online through the
/// test (no heartbeat due for 30 s), signed in as admin: the server, the admin session and
/// [`tiny_model`]'s folder.
async fn agents_server(dir: &Path, database: Option<&str>) -> (Process, User, PathBuf) {
    let model = tiny_model(dir);
    let heartbeats = [("TESSERA_HEARTBEAT_SECS", "30")];
    let (mut server, url) = server(&dir.join("server"), database, &heartbeats);
    let admin = User::login(&mut server, &url).await;
    (server, admin, model)
}

/// Uploads [`tiny_model`]'s folder `dir` as the model `name`: the response.
async fn upload_tiny(user: &User, dir: &Path, name: &str) -> reqwest::Response {
    let mut form = reqwest::multipart::Form::new().text("name", name.to_string());
    for file in TINY_FILES {
        let part = reqwest::multipart::Part::bytes(std::fs::read(dir.join(file)).unwrap());
        form = form.part("files", part.file_name(file.to_string()));
    }
    let request = user
        .http
        .post(user.api("/models"))
        .bearer_auth(&user.token)
        .multipart(form);
    request.send().await.unwrap()
}

/// Registers a worker named `name` with the worker token and `slices`, as the worker
/// binary does: the response.
async fn register(on: &User, name: &str, slices: Value) -> reqwest::Response {
    let inventory =
        json!({"hostname": name, "cpu_cores": 2, "memory_bytes": 1 << 30, "slices": slices});
    let body = json!({"name": name, "version": "hostile", "inventory": inventory});
    post(&bearer(on, WORKER_TOKEN), "/agent/register", body).await
}

/// A worker registered as [`register`] does, signed in with its secret.
async fn worker(on: &User, name: &str, slices: Value) -> User {
    let registered = success_json(register(on, name, slices).await).await;
    bearer(on, registered["secret"].as_str().unwrap())
}

/// The job `worker` claims of the kind `kind` (asserting there is one).
async fn claim(worker: &User, kind: &str) -> Value {
    let response = post(worker, "/agent/claim", json!({"kinds": [kind]})).await;
    assert_eq!(response.status(), 200, "nothing to claim");
    response.json().await.unwrap()
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

// --- Sessions ----------------------------------------------------------------------------

/// Sessions end on the server (a JWT used to live until it expired, whatever happened):
/// logging out ends that session, changing the password ends the user's other sessions
/// but not the one making the change, and an admin disabling a user ends its sessions and
/// API tokens and refuses its logins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logout_password_changes_and_disabled_users_end_sessions_on_the_server() {
    for database in databases() {
        let dir = tempfile::tempdir().unwrap();
        let (mut server, url) = server(dir.path(), database.as_deref(), &[]);
        let admin = User::login(&mut server, &url).await;
        let (id, alice) = user(&admin, "alice").await;
        let password = "alice-secret-pw";
        let laptop = sign_in(&admin, "alice", password).await;
        let phone = sign_in(&admin, "alice", password).await;

        assert_eq!(
            post(&alice, "/auth/logout", json!({})).await.status(),
            204,
            "{database:?}"
        );
        assert_eq!(
            me(&alice).await,
            401,
            "{database:?}: the logged-out bearer still works"
        );
        assert_eq!(me(&laptop).await, 200, "only that session ended");

        let change = json!({"current_password": password, "new_password": "a-new-password"});
        assert_eq!(
            post(&laptop, "/auth/password", change).await.status(),
            204,
            "{database:?}"
        );
        assert_eq!(me(&laptop).await, 200, "the session that changed it stays");
        assert_eq!(
            me(&phone).await,
            401,
            "{database:?}: the other session still works"
        );
        assert_eq!(login(&admin, "alice", password).await.status(), 401);

        let created = success_json(post(&laptop, "/tokens", json!({"name": "script"})).await).await;
        let script = bearer(&admin, created["token"].as_str().unwrap());
        assert_eq!(me(&script).await, 200);
        let disable = admin.http.patch(admin.api(&format!("/users/{id}")));
        let disable = disable
            .bearer_auth(&admin.token)
            .json(&json!({"disabled": true}));
        assert_eq!(
            success_json(disable.send().await.unwrap()).await["disabled"],
            true
        );
        assert_eq!(
            me(&laptop).await,
            401,
            "{database:?}: the session outlived the disable"
        );
        assert_eq!(
            me(&script).await,
            401,
            "{database:?}: the API token outlived the disable"
        );
        let refused = error_body(login(&admin, "alice", "a-new-password").await, 403).await;
        assert!(message(&refused).contains("disabled"), "{refused}");
    }
}

// --- Fair use ----------------------------------------------------------------------------

/// A 403 `quota_exceeded` whose message names `quota`.
async fn assert_quota(response: reqwest::Response, quota: &str) {
    let body = error_body(response, 403).await;
    assert_eq!(body["error"]["code"], "quota_exceeded", "{body}");
    assert!(message(&body).contains(quota), "{body}");
}

/// Quotas from the binary's environment refuse a user past the limit, naming the quota;
/// and the queue is fair across users: alice's flood of queued jobs (claimed oldest first
/// on the old code) does not keep bob's job waiting behind all of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quotas_refuse_past_the_limit_and_one_users_flood_does_not_starve_another() {
    for database in databases() {
        let dir = tempfile::tempdir().unwrap();
        let model = tiny_model(dir.path());
        let model_bytes: u64 = TINY_FILES
            .iter()
            .map(|f| std::fs::metadata(model.join(f)).unwrap().len())
            .sum();
        let storage = (model_bytes + 100).to_string();
        let quotas = [
            ("TESSERA_QUOTA_JOBS", "3"),
            ("TESSERA_QUOTA_REPLICAS", "1"),
            ("TESSERA_QUOTA_STORAGE_BYTES", storage.as_str()),
            ("TESSERA_HEARTBEAT_SECS", "30"),
        ];
        let (mut server, url) = server(&dir.path().join("server"), database.as_deref(), &quotas);
        let admin = User::login(&mut server, &url).await;
        let (_, alice) = user(&admin, "alice").await;
        let (_, bob) = user(&admin, "bob").await;
        for user in [&alice, &bob] {
            user.upload_model(&model, TINY_FILES, "tiny").await;
        }

        assert_quota(
            upload_tiny(&alice, &model, "tiny-again").await,
            "TESSERA_QUOTA_STORAGE_BYTES",
        )
        .await;
        let deployment = json!({"name": "wide", "model": "tiny", "replicas": 2});
        assert_quota(
            post(&alice, "/deployments", deployment).await,
            "TESSERA_QUOTA_REPLICAS",
        )
        .await;
        let prefetch =
            |name: &str| json!({"name": name, "spec": {"kind": "prefetch", "model": "tiny"}});
        let mut flood = Vec::new();
        for i in 0..3 {
            flood.push(alice.submit(prefetch(&format!("flood {i}"))).await);
        }
        assert_quota(
            post(&alice, "/jobs", prefetch("one too many")).await,
            "TESSERA_QUOTA_JOBS",
        )
        .await;
        let bobs = bob.submit(prefetch("mine")).await;

        // Nobody runs anything: alice's oldest goes first. Then bob, who runs none, comes
        // ahead of alice's older jobs; then both run one, and alice's queue goes on.
        let worker = worker(&admin, "w0", json!([])).await;
        let mut order = Vec::new();
        for _ in 0..3 {
            order.push(claim(&worker, "prefetch").await["job_id"].clone());
        }
        assert_eq!(
            Value::from(order),
            json!([flood[0], bobs, flood[1]]),
            "{database:?}"
        );
    }
}

// --- Workers -----------------------------------------------------------------------------

/// Workers get least privilege: one downloads a model only while it holds a job that uses
/// it (any registered worker could fetch any tenant's model), and a second worker cannot
/// take over the name of a live one (it got the name, and the first worker's secret died).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_fetch_only_what_their_jobs_use_and_keep_their_names() {
    for database in databases() {
        let dir = tempfile::tempdir().unwrap();
        let (_server, admin, model_dir) = agents_server(dir.path(), database.as_deref()).await;
        let model = admin.upload_model(&model_dir, TINY_FILES, "tiny").await;
        let model = model["id"].as_str().unwrap();
        let first = worker(&admin, "w1", json!([])).await;

        let file = format!("/agent/models/{model}/files/config.json");
        let refused = error_body(fetch(&first, &file).await, 403).await;
        assert!(
            message(&refused).contains("holds no job"),
            "{database:?}: {refused}"
        );
        admin
            .submit(json!({"name": "warm", "spec": {"kind": "prefetch", "model": model}}))
            .await;
        claim(&first, "prefetch").await;
        assert_eq!(
            fetch(&first, &file).await.status(),
            200,
            "{database:?}: the job's own model"
        );

        let taken = error_body(register(&admin, "w1", json!([])).await, 409).await;
        assert!(
            message(&taken).contains("'w1' is online"),
            "{database:?}: {taken}"
        );
        let beat = post(&first, "/agent/heartbeat", json!({"jobs": []})).await;
        assert_eq!(
            beat.status(),
            200,
            "{database:?}: the live worker keeps its name and secret"
        );
    }
}

// --- Tenant names ------------------------------------------------------------------------

/// `/api/v1/workers` shows a slice serving another tenant's deployment as in use, without
/// its name (bob read alice's deployment names there); the owner and admins see the name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn users_see_other_tenants_slices_as_in_use_without_names() {
    for database in databases() {
        let dir = tempfile::tempdir().unwrap();
        let (_server, admin, model) = agents_server(dir.path(), database.as_deref()).await;
        let (_, alice) = user(&admin, "alice").await;
        let (_, bob) = user(&admin, "bob").await;
        let slice = json!({"uuid": "MIG-sim-1", "gpu_uuid": "GPU-sim-1", "gpu_index": 0, "gpu_model": "H100-80GB",
            "profile": "3g.40gb", "start": null, "memory_bytes": 40u64 << 30, "simulated": true});
        let gpu = worker(&admin, "gpu-1", json!([slice])).await;
        alice.upload_model(&model, TINY_FILES, "tiny").await;
        let deployment = json!({"name": "alice-secret-project", "model": "tiny", "replicas": 1});
        success_json(post(&alice, "/deployments", deployment).await).await;
        assert_eq!(
            claim(&gpu, "serve").await["slice"]["uuid"],
            "MIG-sim-1",
            "{database:?}"
        );

        for user in [&alice, &admin] {
            let workers = user.get("/workers").await;
            assert_eq!(
                workers[0]["slices"][0]["deployment"], "alice-secret-project",
                "{database:?}"
            );
        }
        let workers = bob.get("/workers").await;
        assert!(
            !workers.to_string().contains("alice-secret-project"),
            "{database:?}: bob reads {workers}"
        );
        let slice = &workers[0]["slices"][0];
        assert_eq!(
            (&slice["in_use"], &slice["deployment"], &slice["replica"]),
            (&json!(true), &Value::Null, &Value::Null),
            "{database:?}: {slice}"
        );
    }
}

// --- /metrics ----------------------------------------------------------------------------

/// Unknown HTTP methods share one label value, `other`, in what the scrape token reads
/// (each method a client made up was a new time series, kept for the server's life).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_http_methods_share_one_metric_label() {
    let dir = tempfile::tempdir().unwrap();
    let scrape_token = "hostile-scrape-token-of-32-bytes-or-more";
    let (_server, url) = server(dir.path(), None, &[("TESSERA_METRICS_TOKEN", scrape_token)]);
    let http = reqwest::Client::new();
    let models = format!("{url}/api/v1/models");
    for method in ["FOOBAR", "XYZZY"] {
        let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        error_body(http.request(method, &models).send().await.unwrap(), 405).await;
    }
    let response = http
        .get(format!("{url}/metrics"))
        .bearer_auth(scrape_token)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let metrics = response.text().await.unwrap();
    assert!(
        !metrics.contains("FOOBAR") && !metrics.contains("XYZZY"),
        "a client minted its own label values"
    );
    assert!(
        metrics.contains("method=\"other\",route=\"/api/v1/models\",status=\"405\""),
        "{metrics}"
    );
}
