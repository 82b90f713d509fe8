//! Access control over real HTTP: every route refuses anonymous calls, users only see
//! and change what they own, tokens revoke, logins are throttled.

mod support;

use serde_json::{json, Value};
use support::{backends, tiny_model, Backend, TestServer, ADMIN_PASSWORD};

/// Every route in the OpenAPI document, with `{param}`s filled in.
async fn all_routes(server: &TestServer) -> Vec<(String, String)> {
    let doc: Value = server.http.get(format!("{}/api/openapi.json", server.url)).send().await.unwrap().json().await.unwrap();
    let mut routes = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for method in item.as_object().unwrap().keys() {
            let filled = path
                .replace("{id}", "00000000-0000-0000-0000-000000000001")
                .replace("{path}", "config.json");
            routes.push((method.to_uppercase(), filled));
        }
    }
    assert!(routes.len() >= 20, "the OpenAPI document lists every route: {routes:?}");
    routes
}

#[tokio::test]
async fn every_route_but_login_refuses_anonymous_and_bad_tokens() {
    let server = TestServer::start(Backend::Sqlite).await;
    for (method, path) in all_routes(&server).await {
        if path == "/api/v1/auth/login" || path == "/api/v1/agent/register" {
            continue;
        }
        for token in [None, Some("not-a-token"), Some("tsk_0000"), Some("tsw_0000")] {
            let mut request = server.http.request(method.parse().unwrap(), format!("{}{path}", server.url));
            if let Some(token) = token {
                request = request.bearer_auth(token);
            }
            let response = request.json(&json!({})).send().await.unwrap();
            assert_eq!(response.status(), 401, "{method} {path} with {token:?}");
            let body: Value = response.json().await.unwrap();
            assert_eq!(body["error"]["code"], "unauthorized", "{method} {path}");
        }
    }
    // Registration needs the worker token, not a user's.
    let admin = server.admin().await;
    let response = server.post(&admin, "/agent/register", json!({"name": "x", "version": "1", "inventory": {"hostname": "x", "cpu_cores": 1, "memory_bytes": 1}})).await;
    assert_eq!(response.status(), 401);
}

#[tokio::test]
async fn a_user_cannot_read_change_or_delete_another_users_things() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let alice = server.user(&admin, "alice").await;
        let bob = server.user(&admin, "bob").await;

        let response = server.upload_model(&alice, "tiny", tiny_model()).await;
        assert_eq!(response.status(), 201, "{}", response.text().await.unwrap());
        let model: Value = response.json().await.unwrap();
        let model_id = model["id"].as_str().unwrap();
        let job: Value = server.post(&alice, "/jobs", json!({"name": "warm", "spec": {"kind": "prefetch", "model": "tiny"}})).await.json().await.unwrap();
        let job_id = job["id"].as_str().unwrap();
        let token: Value = server.post(&alice, "/tokens", json!({"name": "ci"})).await.json().await.unwrap();
        let token_id = token["id"].as_str().unwrap();

        for path in [format!("/models/{model_id}"), format!("/models/{model_id}/files/config.json"), format!("/jobs/{job_id}"), format!("/jobs/{job_id}/logs"), format!("/jobs/{job_id}/metrics")] {
            assert_eq!(server.get(&bob, &path).await.status(), 404, "bob reads {path}");
            assert_eq!(server.get(&alice, &path).await.status(), 200, "alice reads {path}");
            assert_eq!(server.get(&admin, &path).await.status(), 200, "admin reads {path}");
        }
        for (path, visible_to_bob) in [("/models", 0), ("/jobs", 0), ("/tokens", 0)] {
            let list: Vec<Value> = server.get(&bob, path).await.json().await.unwrap();
            assert_eq!(list.len(), visible_to_bob, "bob lists {path}");
            let list: Vec<Value> = server.get(&admin, path).await.json().await.unwrap();
            assert!(!list.is_empty(), "admin lists {path}");
        }
        // Bob cannot use Alice's model by name or id in a job of his.
        let response = server.post(&bob, "/jobs", json!({"name": "steal", "spec": {"kind": "prefetch", "model": model_id}})).await;
        assert_eq!(response.status(), 404);
        assert_eq!(server.post(&bob, &format!("/jobs/{job_id}/cancel"), json!({})).await.status(), 404);
        assert_eq!(server.delete(&bob, &format!("/tokens/{token_id}")).await.status(), 404);
        assert_eq!(server.delete(&bob, &format!("/models/{model_id}")).await.status(), 404);
        assert_eq!(server.get(&alice, &format!("/models/{model_id}")).await.status(), 200, "still there");
        // Users cannot create users or list them.
        assert_eq!(server.post(&bob, "/users", json!({"username": "mallory", "password": "long-enough"})).await.status(), 403);
        assert_eq!(server.get(&bob, "/users").await.status(), 403);
        // The owner can, once no unfinished job reads the model.
        assert_eq!(server.post(&alice, &format!("/jobs/{job_id}/cancel"), json!({})).await.status(), 200);
        assert_eq!(server.delete(&alice, &format!("/models/{model_id}")).await.status(), 204);
    }
}

#[tokio::test]
async fn api_tokens_authenticate_until_revoked() {
    let server = TestServer::start(Backend::Sqlite).await;
    let admin = server.admin().await;
    let alice = server.user(&admin, "alice").await;
    let response = server.post(&alice, "/tokens", json!({"name": "script"})).await;
    assert_eq!(response.status(), 201);
    let created: Value = response.json().await.unwrap();
    let secret = created["token"].as_str().unwrap().to_string();
    assert!(secret.starts_with("tsk_"));
    let me: Value = server.get(&secret, "/auth/me").await.json().await.unwrap();
    assert_eq!(me["username"], "alice");
    let listed: Vec<Value> = server.get(&alice, "/tokens").await.json().await.unwrap();
    assert_eq!(listed.len(), 1);
    assert!(listed[0].get("token").is_none(), "the secret is shown only at creation");
    assert!(listed[0]["last_used_at"].is_string());
    // Only the digest is stored.
    let stored: Vec<String> = sqlx::query_scalar("SELECT token_hash FROM api_tokens").fetch_all(server.state.db.pool()).await.unwrap();
    assert!(!stored.iter().any(|s| s.contains(&secret[4..])));
    let id = created["id"].as_str().unwrap();
    assert_eq!(server.delete(&alice, &format!("/tokens/{id}")).await.status(), 204);
    assert_eq!(server.get(&secret, "/auth/me").await.status(), 401);
}

#[tokio::test]
async fn passwords_are_stored_only_as_argon2_hashes() {
    let server = TestServer::start(Backend::Sqlite).await;
    let admin = server.admin().await;
    server.user(&admin, "carol").await;
    let hashes: Vec<String> = sqlx::query_scalar("SELECT password_hash FROM users").fetch_all(server.state.db.pool()).await.unwrap();
    assert_eq!(hashes.len(), 2);
    for hash in &hashes {
        assert!(hash.starts_with("$argon2id$"), "{hash}");
        assert!(!hash.contains(ADMIN_PASSWORD) && !hash.contains("carol-secret-pw"));
    }
    let db_bytes = std::fs::read(server.dir.join("tessera.db")).unwrap();
    let text = String::from_utf8_lossy(&db_bytes);
    assert!(!text.contains(ADMIN_PASSWORD) && !text.contains("carol-secret-pw"));
}

#[tokio::test]
async fn wrong_passwords_and_weak_or_duplicate_users_are_refused() {
    let server = TestServer::start(Backend::Sqlite).await;
    let response = server.http.post(server.api("/auth/login")).json(&json!({"username": "admin", "password": "nope"})).send().await.unwrap();
    assert_eq!(response.status(), 401);
    let response = server.http.post(server.api("/auth/login")).body("{not json").header("content-type", "application/json").send().await.unwrap();
    assert_eq!(response.status(), 400);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "bad_request");
    let admin = server.admin().await;
    assert_eq!(server.post(&admin, "/users", json!({"username": "dave", "password": "short"})).await.status(), 422);
    assert_eq!(server.post(&admin, "/users", json!({"username": "bad name!", "password": "long-enough-pw"})).await.status(), 422);
    assert_eq!(server.post(&admin, "/users", json!({"username": "admin", "password": "long-enough-pw"})).await.status(), 409);
}

#[tokio::test]
async fn logins_are_rate_limited_per_client() {
    let server = TestServer::start_tweaked(Backend::Sqlite, |config| {
        config.login_burst = 3;
        config.login_refill_secs = 3600;
    })
    .await;
    for _ in 0..3 {
        let response = server.http.post(server.api("/auth/login")).json(&json!({"username": "admin", "password": "wrong"})).send().await.unwrap();
        assert_eq!(response.status(), 401);
    }
    let response = server.http.post(server.api("/auth/login")).json(&json!({"username": "admin", "password": ADMIN_PASSWORD})).send().await.unwrap();
    assert_eq!(response.status(), 429);
    assert!(response.headers().contains_key("retry-after"));
}

/// Behind a trusted proxy (here: loopback) each client has its own bucket, read from the
/// address the proxy appended to `X-Forwarded-For`; a server trusting no proxy ignores it.
#[tokio::test]
async fn behind_a_trusted_proxy_logins_are_limited_per_forwarded_client() {
    async fn login_from(server: &TestServer, forwarded_for: &str, password: &str) -> u16 {
        let request = server.http.post(server.api("/auth/login")).header("x-forwarded-for", forwarded_for);
        let response = request.json(&json!({"username": "admin", "password": password})).send().await.unwrap();
        response.status().as_u16()
    }
    for trusted in [true, false] {
        let server = TestServer::start_tweaked(Backend::Sqlite, |config| {
            config.login_burst = 3;
            config.login_refill_secs = 3600;
            if trusted {
                config.trusted_proxies = vec!["127.0.0.0/8".parse().unwrap(), "::1".parse().unwrap()];
            }
        })
        .await;
        for _ in 0..3 {
            assert_eq!(login_from(&server, "203.0.113.9", "wrong").await, 401);
        }
        assert_eq!(login_from(&server, "203.0.113.9", ADMIN_PASSWORD).await, 429, "the guesser is throttled");
        // A client writing its own X-Forwarded-For gets no new bucket: the proxy appends.
        assert_eq!(login_from(&server, "198.51.100.1, 203.0.113.9", ADMIN_PASSWORD).await, 429);
        let other = login_from(&server, "198.51.100.7", ADMIN_PASSWORD).await;
        assert_eq!(other, if trusted { 200 } else { 429 }, "trusted proxies: {trusted}");
    }
}

/// Two servers starting at once on one empty database both find no user and both try to
/// create `admin`: both start, and the one password printed is the one that signs in.
#[tokio::test]
async fn servers_starting_at_once_create_one_admin_and_print_only_its_password() {
    use tessera_server::accounts::bootstrap_admin;
    use tessera_server::auth::password;
    use tessera_server::store::{db::Db, users};
    for backend in backends() {
        let dir = tempfile::tempdir().unwrap();
        let url = support::fresh_database(backend, dir.path())
            .await
            .unwrap_or_else(|| format!("sqlite://{}?mode=rwc", dir.path().join("tessera.db").display()));
        let (first, second) = (Db::connect(&url).await.unwrap(), Db::connect(&url).await.unwrap());
        let (a, b) = tokio::join!(bootstrap_admin(&first, None), bootstrap_admin(&second, None));
        let printed: Vec<String> = [a, b].into_iter().filter_map(|r| r.expect("both servers start")).collect();
        assert_eq!(printed.len(), 1, "{backend:?}: exactly one server prints a password");
        assert_eq!(users::count(&first).await.unwrap(), 1, "{backend:?}");
        let admin = users::find_by_name(&second, "admin").await.unwrap().unwrap();
        assert!(password::verify(printed[0].clone(), admin.password_hash).await.unwrap(), "{backend:?}");
        // A later start finds the admin and prints nothing.
        assert_eq!(bootstrap_admin(&first, None).await.unwrap(), None);
    }
}
