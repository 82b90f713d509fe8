//! Access control over real HTTP (issue 14): sessions end on the server (logout, a
//! password change, a disabled user), `/metrics` is for the scrape token and admins,
//! workers get least privilege, and users see other tenants' slices only as "in use".
//! Each test is a specification of the fixed behaviour and failed before it.

mod support;

use reqwest::header::{LOCATION, SET_COOKIE};
use reqwest::redirect::Policy;
use reqwest::{Client, StatusCode};
use serde_json::{json, Value};
use support::{backends, model_form, tiny_model, Backend, TestServer, ADMIN_PASSWORD, WORKER_TOKEN};
use tessera_api::accounts::ApiToken;
use tessera_server::store::db::now_ms;
use tessera_server::store::users;
use uuid::Uuid;

/// The `{"error":{"code","message"}}` body of a rejection, asserting its shape.
async fn error_body(response: reqwest::Response) -> Value {
    let text = response.text().await.unwrap();
    let body: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("not the error shape: {text}"));
    assert!(
        body["error"]["code"].is_string() && body["error"]["message"].is_string(),
        "not the error shape: {body}"
    );
    body
}

fn password_of(username: &str) -> String {
    format!("{username}-secret-pw") // what `TestServer::user` sets
}

async fn login_status(server: &TestServer, username: &str, password: &str) -> StatusCode {
    let body = json!({"username": username, "password": password});
    server
        .http
        .post(server.api("/auth/login"))
        .json(&body)
        .send()
        .await
        .unwrap()
        .status()
}

async fn me_status(server: &TestServer, token: &str) -> StatusCode {
    server.get(token, "/auth/me").await.status()
}

async fn api_token(server: &TestServer, session: &str) -> String {
    let created: Value = server
        .post(session, "/tokens", json!({"name": "script"}))
        .await
        .json()
        .await
        .unwrap();
    created["token"].as_str().unwrap().to_string()
}

async fn user_id(server: &TestServer, admin: &str, username: &str) -> String {
    let users: Vec<Value> = server.get(admin, "/users").await.json().await.unwrap();
    users.iter().find(|u| u["username"] == username).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string()
}

async fn patch_user(server: &TestServer, token: &str, id: &str, body: Value) -> reqwest::Response {
    server
        .http
        .patch(server.api(&format!("/users/{id}")))
        .bearer_auth(token)
        .json(&body)
        .send()
        .await
        .unwrap()
}

/// A browser-like client that shows redirects instead of following them.
fn browser() -> Client {
    Client::builder().redirect(Policy::none()).build().unwrap()
}

/// Signs in through the dashboard form; returns the `Cookie` header value.
async fn sign_in(server: &TestServer, http: &Client, username: &str, password: &str) -> String {
    let form = [("username", username), ("password", password), ("next", "/")];
    let response = http
        .post(format!("{}/login", server.url))
        .form(&form)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    let set_cookie = response.headers()[SET_COOKIE].to_str().unwrap();
    set_cookie.split(';').next().unwrap().to_string()
}

async fn page(server: &TestServer, http: &Client, cookie: &str, path: &str) -> reqwest::Response {
    http.get(format!("{}{path}", server.url))
        .header("cookie", cookie)
        .send()
        .await
        .unwrap()
}

async fn post_form(
    server: &TestServer,
    http: &Client,
    cookie: &str,
    path: &str,
    form: &[(&str, &str)],
) -> reqwest::Response {
    http.post(format!("{}{path}", server.url))
        .header("cookie", cookie)
        .form(form)
        .send()
        .await
        .unwrap()
}

fn sends_to_login(response: &reqwest::Response) -> bool {
    response.status().is_redirection()
        && response
            .headers()
            .get(LOCATION)
            .is_some_and(|l| l.to_str().unwrap().starts_with("/login"))
}

// --- Sessions ---------------------------------------------------------------------------

#[tokio::test]
async fn logout_ends_the_api_session_on_the_server() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let alice = server.user(&admin, "alice").await;
        let other = server.login("alice", &password_of("alice")).await;
        assert_eq!(me_status(&server, &alice).await, 200);

        let response = server.post(&alice, "/auth/logout", json!({})).await;
        assert_eq!(
            response.status(),
            204,
            "{backend:?}: {}",
            response.text().await.unwrap()
        );
        assert_eq!(
            me_status(&server, &alice).await,
            401,
            "{backend:?}: the logged-out token still works"
        );
        assert_eq!(me_status(&server, &other).await, 200, "only that session ended");

        // An API token is not a session: it is revoked under /tokens, and says so.
        let token = api_token(&server, &other).await;
        let response = server.post(&token, "/auth/logout", json!({})).await;
        assert_eq!(response.status(), 400);
        assert!(error_body(response).await["error"]["message"]
            .as_str()
            .unwrap()
            .contains("/api/v1/tokens"));
        assert_eq!(me_status(&server, &token).await, 200);
    }
}

/// Polls `check` every 20 ms for up to two seconds (far below the auth cache's 10 s).
async fn within_two_seconds(mut check: impl AsyncFnMut() -> bool) -> bool {
    for _ in 0..100 {
        if check().await {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    false
}

#[tokio::test]
async fn a_revocation_on_one_server_reaches_the_others_sharing_postgres_at_once() {
    if !backends().contains(&Backend::Postgres) {
        return;
    }
    let first = TestServer::start_tweaked(Backend::Postgres, |c| c.jwt_secret = Some("j".repeat(40))).await;
    let dir = tempfile::tempdir().unwrap();
    let mut config = first.config.clone();
    config.data_dir = dir.path().to_path_buf();
    let second = TestServer::start_with(config, dir.path().to_path_buf(), Some(dir)).await;
    let admin = first.admin().await;
    let alice = first.user(&admin, "alice").await;
    let token = api_token(&first, &alice).await;
    let bob = first.user(&admin, "bob").await;
    // The second server checks each credential once and caches it for 10 s.
    for credential in [&alice, &token, &bob] {
        assert_eq!(me_status(&second, credential).await, 200);
    }

    assert_eq!(first.post(&alice, "/auth/logout", json!({})).await.status(), 204);
    assert!(within_two_seconds(async || me_status(&second, &alice).await == 401).await, "the session lived on");
    let tokens: Vec<Value> = first.get(&admin, "/tokens").await.json().await.unwrap();
    let id = tokens[0]["id"].as_str().unwrap();
    assert_eq!(first.delete(&admin, &format!("/tokens/{id}")).await.status(), 204);
    assert!(within_two_seconds(async || me_status(&second, &token).await == 401).await, "the token lived on");
    let bob_id = user_id(&first, &admin, "bob").await;
    assert_eq!(patch_user(&first, &admin, &bob_id, json!({"disabled": true})).await.status(), 200);
    assert!(within_two_seconds(async || me_status(&second, &bob).await == 401).await, "the disabled user lived on");
}

#[tokio::test]
async fn dashboard_logout_ends_the_cookie_session_on_the_server() {
    let server = TestServer::start(Backend::Sqlite).await;
    let http = browser();
    let cookie = sign_in(&server, &http, "admin", ADMIN_PASSWORD).await;
    assert_eq!(page(&server, &http, &cookie, "/models").await.status(), 200);
    let response = post_form(&server, &http, &cookie, "/logout", &[]).await;
    assert_eq!(response.status(), StatusCode::SEE_OTHER);

    // A copy of the cookie (a shared machine, a stolen header) no longer signs anyone in.
    assert!(
        sends_to_login(&page(&server, &http, &cookie, "/models").await),
        "the old cookie still signs in"
    );
    let jwt = cookie.trim_start_matches("tessera_session=");
    assert_eq!(me_status(&server, jwt).await, 401);
}

#[tokio::test]
async fn changing_the_password_ends_the_other_sessions_but_not_this_one() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let alice = server.user(&admin, "alice").await;
        let elsewhere = server.login("alice", &password_of("alice")).await;
        let token = api_token(&server, &alice).await;

        let change = |current: &str, new: &str| json!({"current_password": current, "new_password": new});
        let response = server
            .post(&alice, "/auth/password", change("wrong-password", "a-new-password"))
            .await;
        assert_eq!(response.status(), 403, "{backend:?}");
        error_body(response).await;
        let response = server
            .post(&alice, "/auth/password", change(&password_of("alice"), "short"))
            .await;
        assert_eq!(response.status(), 422);
        assert_eq!(error_body(response).await["error"]["code"], "weak_password");
        assert_eq!(
            me_status(&server, &elsewhere).await,
            200,
            "a refused change ends nothing"
        );

        let response = server
            .post(
                &alice,
                "/auth/password",
                change(&password_of("alice"), "a-new-password"),
            )
            .await;
        assert_eq!(response.status(), 204, "{}", response.text().await.unwrap());
        assert_eq!(
            me_status(&server, &alice).await,
            200,
            "the session that changed it stays"
        );
        assert_eq!(
            me_status(&server, &elsewhere).await,
            401,
            "{backend:?}: the other session still works"
        );
        assert_eq!(
            me_status(&server, &token).await,
            200,
            "API tokens are revoked separately"
        );
        assert_eq!(login_status(&server, "alice", &password_of("alice")).await, 401);
        assert_eq!(login_status(&server, "alice", "a-new-password").await, 200);
    }
}

#[tokio::test]
async fn a_disabled_user_loses_every_session_and_token_and_cannot_log_in() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let alice = server.user(&admin, "alice").await;
        let bob = server.user(&admin, "bob").await;
        let token = api_token(&server, &alice).await;
        let id = user_id(&server, &admin, "alice").await;

        assert_eq!(
            patch_user(&server, &bob, &id, json!({"disabled": true})).await.status(),
            403
        );
        let admin_id = user_id(&server, &admin, "admin").await;
        let response = patch_user(&server, &admin, &admin_id, json!({"disabled": true})).await;
        assert_eq!(response.status(), 409, "an admin cannot lock itself out");
        error_body(response).await;

        let response = patch_user(&server, &admin, &id, json!({"disabled": true})).await;
        assert_eq!(
            response.status(),
            200,
            "{backend:?}: {}",
            response.text().await.unwrap()
        );
        assert_eq!(response.json::<Value>().await.unwrap()["disabled"], true);
        assert_eq!(
            me_status(&server, &alice).await,
            401,
            "{backend:?}: the session outlived the disable"
        );
        assert_eq!(
            me_status(&server, &token).await,
            401,
            "{backend:?}: the API token outlived the disable"
        );
        let response = server
            .http
            .post(format!("{}/v1/embeddings", server.url))
            .bearer_auth(&token)
            .json(&json!({"model": "any", "input": "hi"}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 401, "nor does it reach the gateway");
        let refused = server
            .http
            .post(server.api("/auth/login"))
            .json(&json!({"username": "alice", "password": password_of("alice")}))
            .send()
            .await
            .unwrap();
        assert_eq!(refused.status(), 403);
        assert!(error_body(refused).await["error"]["message"]
            .as_str()
            .unwrap()
            .contains("disabled"));
        let listed: Vec<Value> = server.get(&admin, "/users").await.json().await.unwrap();
        assert!(listed.iter().any(|u| u["username"] == "alice" && u["disabled"] == true));

        // Enabled again, the user signs in; what it held before stays revoked.
        assert_eq!(
            patch_user(&server, &admin, &id, json!({"disabled": false}))
                .await
                .status(),
            200
        );
        assert_eq!(login_status(&server, "alice", &password_of("alice")).await, 200);
        assert_eq!(me_status(&server, &token).await, 401);
        assert_eq!(
            patch_user(&server, &admin, &id, json!({"role": "admin"}))
                .await
                .status(),
            400,
            "unknown field"
        );
    }
}

#[tokio::test]
async fn no_session_or_api_token_is_stored_for_a_disabled_user() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        server.user(&admin, "alice").await;
        let id = user_id(&server, &admin, "alice").await;
        let alice: Uuid = id.parse().unwrap();
        let db = &server.state.db;
        let token = |name: &str| ApiToken {
            id: Uuid::new_v4(),
            name: name.into(),
            prefix: "tsk_000000".into(),
            owner: "alice".into(),
            created_at: chrono::Utc::now(),
            last_used_at: None,
        };

        // What a login or a token request that checked alice just before the disable
        // would store just after it: nothing, so nothing outlives the disable.
        assert_eq!(patch_user(&server, &admin, &id, json!({"disabled": true})).await.status(), 200);
        let session = Uuid::new_v4();
        let expires_at = now_ms() + 3_600_000;
        let stored = users::insert_session(db, session, alice, expires_at).await.unwrap();
        assert!(!stored, "{backend:?}: a session was stored for a disabled user");
        assert_eq!(users::session_user(db, session).await.unwrap(), None);
        let stored = users::insert_token(db, alice, &token("late"), "digest-of-late").await.unwrap();
        assert!(!stored, "{backend:?}: a token was stored for a disabled user");
        assert_eq!(users::use_token(db, "digest-of-late").await.unwrap(), None);

        // Enabled again, alice's new sessions and tokens are stored as before.
        assert_eq!(patch_user(&server, &admin, &id, json!({"disabled": false})).await.status(), 200);
        assert!(users::insert_session(db, session, alice, expires_at).await.unwrap(), "{backend:?}");
        assert_eq!(users::session_user(db, session).await.unwrap(), Some(alice));
        assert!(users::insert_token(db, alice, &token("later"), "digest-of-later").await.unwrap(), "{backend:?}");
        assert_eq!(users::use_token(db, "digest-of-later").await.unwrap(), Some(alice));
    }
}

#[tokio::test]
async fn the_dashboard_changes_passwords_and_disables_users() {
    let server = TestServer::start(Backend::Sqlite).await;
    let admin = server.admin().await;
    let first = server.user(&admin, "alice").await;
    let http = browser();
    let alice = sign_in(&server, &http, "alice", &password_of("alice")).await;
    let elsewhere = server.login("alice", &password_of("alice")).await;

    let response = page(&server, &http, &alice, "/account").await;
    assert_eq!(response.status(), 200);
    assert!(response.text().await.unwrap().contains("action=\"/account/password\""));
    let form = [("current_password", "nope-nope"), ("new_password", "a-new-password")];
    let response = post_form(&server, &http, &alice, "/account/password", &form).await;
    assert_eq!(response.status(), 403);
    assert!(response.text().await.unwrap().contains("The current password is wrong"));
    let pw = password_of("alice");
    let form = [("current_password", pw.as_str()), ("new_password", "a-new-password")];
    let response = post_form(&server, &http, &alice, "/account/password", &form).await;
    let (location, html) = support::follow_notice(&server, &http, &alice, response).await;
    assert_eq!(location, "/account");
    assert!(html.contains("2 other session(s) were signed out"), "{html}");
    assert_eq!(
        (me_status(&server, &first).await, me_status(&server, &elsewhere).await),
        (StatusCode::UNAUTHORIZED, StatusCode::UNAUTHORIZED)
    );
    assert_eq!(
        page(&server, &http, &alice, "/models").await.status(),
        200,
        "this browser stays signed in"
    );

    // Only admins see the users page; from it an admin disables alice.
    assert_eq!(page(&server, &http, &alice, "/users").await.status(), 403);
    let admin_cookie = sign_in(&server, &http, "admin", ADMIN_PASSWORD).await;
    let html = page(&server, &http, &admin_cookie, "/users")
        .await
        .text()
        .await
        .unwrap();
    assert!(
        html.contains("data-user=\"alice\"") && html.contains("href=\"/users\""),
        "{html}"
    );
    let id = user_id(&server, &admin, "alice").await;
    let response = post_form(&server, &http, &admin_cookie, &format!("/users/{id}/disable"), &[]).await;
    let (_, html) = support::follow_notice(&server, &http, &admin_cookie, response).await;
    assert!(html.contains("alice was disabled"), "{html}");
    assert!(
        sends_to_login(&page(&server, &http, &alice, "/models").await),
        "the disabled user's browser is signed out"
    );
    let form = [("username", "alice"), ("password", "a-new-password"), ("next", "/")];
    let response = http
        .post(format!("{}/login", server.url))
        .form(&form)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 403);
}

// --- /metrics -----------------------------------------------------------------------------

#[tokio::test]
async fn metrics_need_the_scrape_token_or_an_admin() {
    let scrape = "s".repeat(40);
    let server = TestServer::start_tweaked(Backend::Sqlite, |config| config.metrics_token = Some(scrape.clone())).await;
    let admin = server.admin().await;
    let alice = server.user(&admin, "alice").await;
    let metrics = format!("{}/metrics", server.url);

    let anonymous = server.http.get(&metrics).send().await.unwrap();
    assert_eq!(
        anonymous.status(),
        401,
        "anonymous callers read every tenant's deployment names"
    );
    assert!(error_body(anonymous).await["error"]["message"]
        .as_str()
        .unwrap()
        .contains("TESSERA_METRICS_TOKEN"));
    assert_eq!(
        server
            .http
            .get(&metrics)
            .bearer_auth(&alice)
            .send()
            .await
            .unwrap()
            .status(),
        403
    );
    assert_eq!(
        server
            .http
            .get(&metrics)
            .bearer_auth("s".repeat(39))
            .send()
            .await
            .unwrap()
            .status(),
        401
    );
    for token in [scrape.as_str(), admin.as_str()] {
        let response = server.http.get(&metrics).bearer_auth(token).send().await.unwrap();
        assert_eq!(response.status(), 200);
        assert!(response.text().await.unwrap().contains("tessera_workers_online"));
    }

    // Without the setting only admins scrape; a short scrape token is refused at start.
    let server = TestServer::start(Backend::Sqlite).await;
    let admin = server.admin().await;
    let metrics = format!("{}/metrics", server.url);
    assert_eq!(server.http.get(&metrics).send().await.unwrap().status(), 401);
    assert_eq!(
        server
            .http
            .get(&metrics)
            .bearer_auth(&scrape)
            .send()
            .await
            .unwrap()
            .status(),
        401
    );
    assert_eq!(
        server
            .http
            .get(&metrics)
            .bearer_auth(&admin)
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let dir = tempfile::tempdir().unwrap();
    let mut config = tessera_server::config::Config::with_data_dir(dir.path().to_path_buf());
    config.metrics_token = Some("short".into());
    let error = tessera_server::state::AppState::open(config)
        .await
        .err()
        .expect("a short scrape token starts");
    assert!(error.to_string().contains("TESSERA_METRICS_TOKEN"), "{error}");
}

#[tokio::test]
async fn unknown_http_methods_share_one_metric_label() {
    let server = TestServer::start(Backend::Sqlite).await;
    let admin = server.admin().await;
    for method in ["FOOBAR", "XYZZY"] {
        let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        let response = server.http.request(method, server.api("/models")).send().await.unwrap();
        assert_eq!(response.status(), 405);
    }
    let text = server
        .http
        .get(format!("{}/metrics", server.url))
        .bearer_auth(&admin)
        .send()
        .await
        .unwrap();
    let text = text.text().await.unwrap();
    assert!(
        !text.contains("FOOBAR") && !text.contains("XYZZY"),
        "a client minted its own label values"
    );
    assert!(
        text.contains("method=\"other\",route=\"/api/v1/models\",status=\"405\""),
        "{text}"
    );
}

// --- Workers ----------------------------------------------------------------------------

async fn upload_tiny(server: &TestServer, token: &str, name: &str) -> String {
    let form = model_form(name, tiny_model());
    let response = server
        .http
        .post(server.api("/models"))
        .bearer_auth(token)
        .multipart(form)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    response.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string()
}

async fn upload_dataset(server: &TestServer, token: &str) -> String {
    let csv = (0..40).fold(String::from("a,b,label\n"), |csv, i| {
        csv + &format!("{},{},{}\n", i % 7, i % 5, i % 2)
    });
    let form = reqwest::multipart::Form::new().text("name", "tabular").part(
        "file",
        reqwest::multipart::Part::bytes(csv.into_bytes()).file_name("tabular.csv"),
    );
    let response = server
        .http
        .post(server.api("/datasets"))
        .bearer_auth(token)
        .multipart(form)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    response.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string()
}

async fn claim(server: &TestServer, secret: &str, kind: &str) -> Value {
    let response = server.post(secret, "/agent/claim", json!({"kinds": [kind]})).await;
    assert_eq!(response.status(), 200, "nothing to claim");
    response.json().await.unwrap()
}

#[tokio::test]
async fn a_worker_downloads_only_models_and_datasets_of_jobs_it_holds() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let model = upload_tiny(&server, &admin, "tiny").await;
        let dataset = upload_dataset(&server, &admin).await;
        let (_, first) = server.register_worker("w1").await;
        let (_, second) = server.register_worker("w2").await;
        let model_routes = [
            format!("/agent/models/{model}"),
            format!("/agent/models/{model}/files/config.json"),
        ];
        let dataset_routes = [
            format!("/agent/datasets/{dataset}"),
            format!("/agent/datasets/{dataset}/file"),
        ];
        for path in model_routes.iter().chain(&dataset_routes) {
            let response = server.get(&first, path).await;
            assert_eq!(response.status(), 403, "{backend:?}: {path} without a job");
            assert!(error_body(response).await["error"]["message"]
                .as_str()
                .unwrap()
                .contains("holds no job"));
        }

        // While w1 holds a prefetch of the model it may fetch it; w2 may not.
        let body = json!({"name": "warm", "spec": {"kind": "prefetch", "model": model}});
        assert_eq!(server.post(&admin, "/jobs", body).await.status(), 201);
        let job = claim(&server, &first, "prefetch").await["job_id"]
            .as_str()
            .unwrap()
            .to_string();
        for path in &model_routes {
            assert_eq!(server.get(&first, path).await.status(), 200, "{path} with the job");
            assert_eq!(
                server.get(&second, path).await.status(),
                403,
                "{path} for another worker"
            );
        }
        assert_eq!(
            server.get(&first, &dataset_routes[0]).await.status(),
            403,
            "the prefetch uses no dataset"
        );

        // Once the job is over, so is the access.
        let done = json!({"state": "succeeded", "message": "cached"});
        assert_eq!(
            server
                .post(&first, &format!("/agent/jobs/{job}/status"), done)
                .await
                .status(),
            204
        );
        assert_eq!(server.get(&first, &model_routes[1]).await.status(), 403);

        // A training job on the dataset opens the dataset to the worker that holds it.
        let train = json!({"name": "t", "model": {"kind": "mlp", "hidden": [8]}, "dataset": dataset,
            "task": {"type": "classification", "label_column": "label", "validation_split": 0.2},
            "optimizer": {"type": "sgd"}, "batch_size": 8, "max_steps": 10, "eval_every": 5, "checkpoint_every": 5,
            "lr_schedule": {"type": "constant", "lr": 0.1}, "seed": 1});
        let response = server.post(&admin, "/jobs", train).await;
        assert_eq!(response.status(), 201, "{}", response.text().await.unwrap());
        claim(&server, &second, "train").await;
        for path in &dataset_routes {
            assert_eq!(
                server.get(&second, path).await.status(),
                200,
                "{path} with the training job"
            );
            assert_eq!(server.get(&first, path).await.status(), 403);
        }
    }
}

#[tokio::test]
async fn a_worker_reports_engine_endpoints_only_on_its_own_host() {
    for allow_advertised in [false, true] {
        let server =
            TestServer::start_tweaked(Backend::Sqlite, |c| c.allow_advertised_endpoints = allow_advertised).await;
        let admin = server.admin().await;
        let model = upload_tiny(&server, &admin, "tiny").await;
        let (_, secret) = server.register_worker("w1").await;
        let body = json!({"name": "warm", "spec": {"kind": "prefetch", "model": model}});
        assert_eq!(server.post(&admin, "/jobs", body).await.status(), 201);
        let job = claim(&server, &secret, "prefetch").await["job_id"]
            .as_str()
            .unwrap()
            .to_string();
        let status = format!("/agent/jobs/{job}/status");
        let running = |endpoint: &str| json!({"state": "running", "endpoint": endpoint});

        // The test's worker connects from 127.0.0.1; 203.0.113.0/24 is a documentation net.
        let response = server.post(&secret, &status, running("http://203.0.113.9:9000")).await;
        if allow_advertised {
            assert_eq!(response.status(), 204, "the operator trusts advertised URLs");
        } else {
            assert_eq!(response.status(), 422, "a worker pointed the gateway at another host");
            let message = error_body(response).await["error"]["message"]
                .as_str()
                .unwrap()
                .to_string();
            assert!(message.contains("TESSERA_ALLOW_ADVERTISED_ENDPOINTS"), "{message}");
        }
        let long = format!("http://127.0.0.1:9000/{}", "r".repeat(3000));
        for endpoint in ["ftp://127.0.0.1:21", "not a url", "http://", "http://127.0.0.1:9000/r\0", &long] {
            let response = server.post(&secret, &status, running(endpoint)).await;
            assert_eq!(response.status(), 422, "{endpoint}");
            error_body(response).await;
        }
        for endpoint in [
            "http://127.0.0.1:9000/replicas/x",
            "http://localhost:9000",
            "http://[::1]:9000",
        ] {
            assert_eq!(
                server.post(&secret, &status, running(endpoint)).await.status(),
                204,
                "{endpoint}"
            );
        }
    }
}

#[tokio::test]
async fn a_worker_joins_with_a_lowercase_bearer_and_extra_spaces() {
    let server = TestServer::start(Backend::Sqlite).await;
    let inventory = json!({"hostname": "w1", "cpu_cores": 2, "memory_bytes": 1024});
    let register = |authorization: String| {
        server
            .http
            .post(server.api("/agent/register"))
            .header("authorization", authorization)
            .json(&json!({"name": "w1", "version": "test", "inventory": inventory}))
            .send()
    };
    let response = register(format!("bearer  {WORKER_TOKEN}")).await.unwrap();
    assert_eq!(response.status(), 200, "{}", response.text().await.unwrap());
    let response = register(format!("bearer  {WORKER_TOKEN}-wrong")).await.unwrap();
    assert_eq!(response.status(), 401, "the token itself is still checked");
    error_body(response).await;
}

#[tokio::test]
async fn bogus_credentials_are_refused_without_waiting_for_the_write_lock() {
    let server = TestServer::start(Backend::Sqlite).await;
    // Anyone may send a bogus worker secret or API token: checking one must be a read,
    // answered at once while a slow write holds SQLite's one write lock.
    let writer = server.state.db.begin().await.unwrap();
    let heartbeat =
        server.http.post(server.api("/agent/heartbeat")).bearer_auth("tsw_bogus").json(&json!({"jobs": []}));
    let me = server.http.get(server.api("/auth/me")).bearer_auth("tsk_bogus");
    for (what, request) in [("worker secret", heartbeat), ("API token", me)] {
        let sent = support::send_into_a_lock(request).await;
        assert!(sent.is_finished(), "a bogus {what} waited for the write lock");
        let response = sent.await.unwrap();
        assert_eq!(response.status(), 401, "{what}");
        error_body(response).await;
    }
    writer.rollback().await.unwrap();
}

#[tokio::test]
async fn a_second_worker_cannot_take_a_live_workers_name() {
    for backend in backends() {
        let server = TestServer::start_tweaked(backend, |c| c.heartbeat_secs = 1).await;
        let (id, secret) = server.register_worker("w1").await;
        let inventory = json!({"hostname": "intruder", "cpu_cores": 64, "memory_bytes": 1024});
        let intruder = json!({"name": "w1", "version": "evil", "inventory": inventory});
        let response = server.post(WORKER_TOKEN, "/agent/register", intruder.clone()).await;
        assert_eq!(
            response.status(),
            409,
            "{backend:?}: a second worker took over a live name"
        );
        assert!(error_body(response).await["error"]["message"]
            .as_str()
            .unwrap()
            .contains("'w1' is online"));
        let beat = server.post(&secret, "/agent/heartbeat", json!({"jobs": []})).await;
        assert_eq!(beat.status(), 200, "the live worker keeps its name and secret");
        let wrong = json!({"name": "w1", "version": "evil", "inventory": inventory, "previous_secret": "tsw_guess"});
        assert_eq!(server.post(WORKER_TOKEN, "/agent/register", wrong).await.status(), 409);

        // The same worker restarting proves itself with its secret and rejoins at once.
        let (same_id, _) = server.rejoin_worker("w1", &secret).await;
        assert_eq!(same_id, id);
        assert_eq!(
            server
                .post(&secret, "/agent/heartbeat", json!({"jobs": []}))
                .await
                .status(),
            401
        );

        // A worker silent for three heartbeats is gone, and its name is free.
        tokio::time::sleep(std::time::Duration::from_millis(3_300)).await;
        assert_eq!(
            server.post(WORKER_TOKEN, "/agent/register", intruder).await.status(),
            200
        );
    }
}

// --- Other tenants' deployments -----------------------------------------------------------

#[tokio::test]
async fn users_see_other_tenants_slices_as_in_use_without_names() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let alice = server.user(&admin, "alice").await;
        let bob = server.user(&admin, "bob").await;
        let slice = json!({"uuid": "MIG-sim-1", "gpu_uuid": "GPU-sim-1", "gpu_index": 0, "gpu_model": "H100-80GB",
            "profile": "3g.40gb", "start": null, "memory_bytes": 40u64 << 30, "simulated": true});
        let inventory = json!({"hostname": "gpu-1", "cpu_cores": 2, "memory_bytes": 1024, "slices": [slice]});
        let response = server
            .post(
                WORKER_TOKEN,
                "/agent/register",
                json!({"name": "gpu-1", "version": "t", "inventory": inventory}),
            )
            .await;
        assert_eq!(response.status(), 200);
        let secret = response.json::<Value>().await.unwrap()["secret"]
            .as_str()
            .unwrap()
            .to_string();
        upload_tiny(&server, &alice, "tiny").await;
        let response = server
            .post(
                &alice,
                "/deployments",
                json!({"name": "alice-secret-project", "model": "tiny", "replicas": 1}),
            )
            .await;
        assert_eq!(response.status(), 201);
        assert_eq!(claim(&server, &secret, "serve").await["slice"]["uuid"], "MIG-sim-1");

        let slice_seen_by = |workers: Value| workers[0]["slices"][0].clone();
        let owner: Value = server.get(&alice, "/workers").await.json().await.unwrap();
        assert_eq!(slice_seen_by(owner)["deployment"], "alice-secret-project");
        let seen: Value = server.get(&admin, "/workers").await.json().await.unwrap();
        assert_eq!(slice_seen_by(seen)["deployment"], "alice-secret-project");
        let text = server.get(&bob, "/workers").await.text().await.unwrap();
        assert!(
            !text.contains("alice-secret-project"),
            "{backend:?}: bob reads alice's deployment: {text}"
        );
        let other = slice_seen_by(serde_json::from_str(&text).unwrap());
        assert_eq!(
            (
                other["in_use"].clone(),
                other["deployment"].clone(),
                other["replica"].clone()
            ),
            (json!(true), Value::Null, Value::Null)
        );

        // The dashboard's MIG page draws the slice taken, without the name.
        if backend == Backend::Sqlite {
            let http = browser();
            let cookie = sign_in(&server, &http, "bob", &password_of("bob")).await;
            let html = page(&server, &http, &cookie, "/mig").await.text().await.unwrap();
            assert!(
                !html.contains("alice-secret-project") && html.contains("in use"),
                "{html}"
            );
            let cookie = sign_in(&server, &http, "alice", &password_of("alice")).await;
            let html = page(&server, &http, &cookie, "/mig").await.text().await.unwrap();
            assert!(html.contains("alice-secret-project"));
        }
    }
}

/// An admin removes a worker that is gone: it leaves the list and its secret stops
/// working; a running one cannot be removed (it would register again), nor can a user
/// remove one. The same name joining later comes back.
#[tokio::test]
async fn an_admin_removes_an_offline_worker_and_its_secret_stops_working() {
    for backend in backends() {
        let server = TestServer::start_tweaked(backend, |c| c.heartbeat_secs = 1).await;
        let admin = server.admin().await;
        let user = server.user(&admin, "mallory").await;
        let (id, secret) = server.register_worker("retired-box").await;
        let remove = |token: &str, id: &str| server.http.delete(server.api(&format!("/workers/{id}"))).bearer_auth(token).send();
        assert_eq!(remove(&user, &id).await.unwrap().status(), 403, "{backend:?}");
        let online = remove(&admin, &id).await.unwrap();
        assert_eq!(online.status(), 409, "{backend:?}");
        assert!(error_body(online).await["error"]["message"].as_str().unwrap().contains("stop it first"));

        // Three missed heartbeats of a second each, and it is offline.
        tokio::time::sleep(std::time::Duration::from_millis(3500)).await;
        assert_eq!(remove(&admin, &id).await.unwrap().status(), 204, "{backend:?}");
        assert_eq!(remove(&admin, &id).await.unwrap().status(), 404, "removed once");
        assert_eq!(remove(&admin, &Uuid::new_v4().to_string()).await.unwrap().status(), 404);
        let listed: Value = server.get(&admin, "/workers").await.json().await.unwrap();
        assert!(listed.as_array().unwrap().iter().all(|w| w["name"] != "retired-box"), "{listed}");
        let beat = server.post(&secret, "/agent/heartbeat", json!({"jobs": []})).await;
        assert_eq!(beat.status(), 401, "{backend:?}: the removed worker's secret still works");

        let (again, _) = server.register_worker("retired-box").await;
        assert_eq!(again, id, "the same name comes back as the same worker");
        let listed: Value = server.get(&admin, "/workers").await.json().await.unwrap();
        assert!(listed.as_array().unwrap().iter().any(|w| w["name"] == "retired-box"), "{listed}");
    }
}

/// Changing TESSERA_WORKER_TOKEN cuts off every worker admitted with the old one: its
/// secret is refused, and it cannot join again with the old token.
#[tokio::test]
async fn a_new_worker_token_cuts_off_workers_admitted_with_the_old_one() {
    let mut server = TestServer::start(Backend::Sqlite).await;
    let (_, secret) = server.register_worker("old-box").await;
    assert_eq!(server.post(&secret, "/agent/heartbeat", json!({"jobs": []})).await.status(), 200);
    server.config.worker_token = Some("a-rotated-worker-token-of-at-least-32-bytes".into());
    let server = server.restart().await;
    let refused = server.post(&secret, "/agent/heartbeat", json!({"jobs": []})).await;
    assert_eq!(refused.status(), 401);
    assert!(error_body(refused).await["error"]["message"].as_str().unwrap().contains("TESSERA_WORKER_TOKEN"));
    let inventory = json!({"hostname": "old-box", "cpu_cores": 2, "memory_bytes": 1024});
    let rejoin = json!({"name": "old-box", "version": "test", "inventory": inventory, "previous_secret": secret});
    assert_eq!(server.post(WORKER_TOKEN, "/agent/register", rejoin.clone()).await.status(), 401);
    let joined = server.post("a-rotated-worker-token-of-at-least-32-bytes", "/agent/register", rejoin).await;
    assert_eq!(joined.status(), 200, "the current token admits it");
}
