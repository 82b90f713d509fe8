//! Test support: a real server on a loopback port over a real database, either SQLite in
//! a temp dir or a fresh database in the throwaway PostgreSQL cluster the test script
//! starts (`TESSERA_TEST_POSTGRES_URL`).

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;

use serde_json::{json, Value};
use tessera_server::app::router;
use tessera_server::config::Config;
use tessera_server::state::AppState;

pub const ADMIN_PASSWORD: &str = "admin-password-for-tests";
pub const WORKER_TOKEN: &str = "worker-token-for-tests-at-least-32-bytes";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

/// The backends this run can test: SQLite always; PostgreSQL when a cluster is given.
/// With `TESSERA_REQUIRE_POSTGRES=1` (the test script sets it) a missing cluster fails.
pub fn backends() -> Vec<Backend> {
    if std::env::var("TESSERA_TEST_POSTGRES_URL").is_ok() {
        vec![Backend::Sqlite, Backend::Postgres]
    } else if std::env::var("TESSERA_REQUIRE_POSTGRES").as_deref() == Ok("1") {
        panic!("TESSERA_REQUIRE_POSTGRES=1 but TESSERA_TEST_POSTGRES_URL is not set");
    } else {
        eprintln!("note: TESSERA_TEST_POSTGRES_URL not set; testing SQLite only");
        vec![Backend::Sqlite]
    }
}

/// A fresh, empty database URL for one test.
pub async fn fresh_database(backend: Backend, dir: &std::path::Path) -> Option<String> {
    match backend {
        Backend::Sqlite => None,
        Backend::Postgres => {
            use sqlx::Connection;
            let base = std::env::var("TESSERA_TEST_POSTGRES_URL").expect("postgres url");
            let name = format!("t_{}", uuid::Uuid::new_v4().simple());
            let mut admin = sqlx::PgConnection::connect(&base).await.expect("connect to the test cluster");
            sqlx::Executor::execute(&mut admin, sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}"))).await.expect("create db");
            let _ = dir;
            let (prefix, _) = base.rsplit_once('/').expect("url has a database");
            Some(format!("{prefix}/{name}"))
        }
    }
}

pub struct TestServer {
    pub url: String,
    pub state: AppState,
    pub config: Config,
    pub dir: PathBuf,
    _tempdir: Option<tempfile::TempDir>,
    task: tokio::task::JoinHandle<()>,
    pub http: reqwest::Client,
}

impl TestServer {
    pub async fn start(backend: Backend) -> TestServer {
        Self::start_tweaked(backend, |_| {}).await
    }

    /// Starts with the test defaults changed by `tweak`.
    pub async fn start_tweaked(backend: Backend, tweak: impl FnOnce(&mut Config)) -> TestServer {
        let tempdir = tempfile::tempdir().unwrap();
        let mut config = Config::with_data_dir(tempdir.path().to_path_buf());
        config.database_url = fresh_database(backend, tempdir.path()).await;
        config.admin_password = Some(ADMIN_PASSWORD.into());
        config.worker_token = Some(WORKER_TOKEN.into());
        config.login_burst = 1000;
        tweak(&mut config);
        let dir = tempdir.path().to_path_buf();
        Self::start_with(config, dir, Some(tempdir)).await
    }

    pub async fn start_with(config: Config, dir: PathBuf, tempdir: Option<tempfile::TempDir>) -> TestServer {
        let state = AppState::open(config.clone()).await.expect("server state opens");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let app = router(state.clone()).into_make_service_with_connect_info::<SocketAddr>();
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        TestServer {
            url: format!("http://{address}"),
            state,
            config,
            dir,
            _tempdir: tempdir,
            task,
            http: reqwest::Client::new(),
        }
    }

    /// Stops this server and starts another over the same data directory and database.
    pub async fn restart(mut self) -> TestServer {
        self.task.abort();
        let _ = (&mut self.task).await;
        let tempdir = self._tempdir.take();
        let config = self.config.clone();
        let dir = self.dir.clone();
        drop(self);
        Self::start_with(config, dir, tempdir).await
    }

    pub fn api(&self, path: &str) -> String {
        format!("{}/api/v1{path}", self.url)
    }

    pub async fn login(&self, username: &str, password: &str) -> String {
        let response = self
            .http
            .post(self.api("/auth/login"))
            .json(&json!({"username": username, "password": password}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "login as {username}: {}", response.text().await.unwrap());
        response.json::<Value>().await.unwrap()["token"].as_str().unwrap().to_string()
    }

    pub async fn admin(&self) -> String {
        self.login("admin", ADMIN_PASSWORD).await
    }

    /// Creates a user with role `user` and returns a session token for them.
    pub async fn user(&self, admin: &str, username: &str) -> String {
        let password = format!("{username}-secret-pw");
        let response = self
            .http
            .post(self.api("/users"))
            .bearer_auth(admin)
            .json(&json!({"username": username, "password": password, "role": "user"}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 201, "{}", response.text().await.unwrap());
        self.login(username, &password).await
    }

    /// Uploads `files` as model `name` (multipart, as the dashboard does); the response.
    pub async fn upload_model(&self, token: &str, name: &str, files: Vec<(String, Vec<u8>)>) -> reqwest::Response {
        self.http.post(self.api("/models")).bearer_auth(token).multipart(model_form(name, files)).send().await.unwrap()
    }

    /// A 40-row classification CSV (`f0`, `f1`, `label`) uploaded as dataset `d`; its id.
    pub async fn toy_dataset(&self, token: &str) -> String {
        let mut csv = String::from("f0,f1,label\n");
        for i in 0..40 {
            csv.push_str(&format!("{},{},{}\n", i % 7, i % 5, i % 2));
        }
        let form = reqwest::multipart::Form::new()
            .text("name", "d")
            .part("file", reqwest::multipart::Part::bytes(csv.into_bytes()).file_name("d.csv"));
        let response = self.http.post(self.api("/datasets")).bearer_auth(token).multipart(form).send().await.unwrap();
        assert_eq!(response.status(), 201);
        response.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_string()
    }

    pub async fn get(&self, token: &str, path: &str) -> reqwest::Response {
        self.http.get(self.api(path)).bearer_auth(token).send().await.unwrap()
    }

    pub async fn post(&self, token: &str, path: &str, body: Value) -> reqwest::Response {
        self.http.post(self.api(path)).bearer_auth(token).json(&body).send().await.unwrap()
    }

    pub async fn delete(&self, token: &str, path: &str) -> reqwest::Response {
        self.http.delete(self.api(path)).bearer_auth(token).send().await.unwrap()
    }

    /// Follows a paged list from `path` (under `/api/v1`) through each page's
    /// `Link: <…>; rel="next"` to the last page, which has none; the rows of every page.
    pub async fn pages(&self, token: &str, path: &str) -> Vec<Vec<Value>> {
        let mut pages = Vec::new();
        let mut next = Some(self.api(path));
        while let Some(url) = next {
            let response = self.http.get(&url).bearer_auth(token).send().await.unwrap();
            assert_eq!(response.status(), 200, "{url}");
            next = response.headers().get("link").map(|link| {
                let link = link.to_str().unwrap();
                let path = link.strip_prefix('<').and_then(|l| l.strip_suffix(">; rel=\"next\""));
                format!("{}{}", self.url, path.unwrap_or_else(|| panic!("not a next link: {link}")))
            });
            let page: Vec<Value> = response.json().await.unwrap();
            assert!(!page.is_empty(), "{url} is an empty page");
            pages.push(page);
            assert!(pages.len() < 1000, "the pages of {path} never end");
        }
        pages
    }

    /// Expects `GET path?query` to be a 400 in the platform's error body whose message
    /// holds `says`, for every `(query, says)` of `cases`.
    pub async fn assert_bad_requests(&self, token: &str, path: &str, cases: &[(&str, &str)]) {
        for (query, says) in cases {
            let response = self.get(token, &format!("{path}?{query}")).await;
            assert_eq!(response.status(), 400, "{path}?{query}");
            let body: Value = response.json().await.unwrap();
            assert_eq!(body["error"]["code"], "bad_request", "{path}?{query}: {body}");
            assert!(body["error"]["message"].as_str().unwrap().contains(says), "{path}?{query}: {body}");
        }
    }

    /// Expects the page requests a list at `path` (holding `what`s) must refuse, and `more`
    /// of its own, to be 400s saying what to fix: a limit outside 1 to 500, a `before` that
    /// is no id or names no row, a misspelt parameter.
    pub async fn assert_bad_pages(&self, token: &str, path: &str, what: &str, more: &[(&str, &str)]) {
        let unknown = format!("before={}", uuid::Uuid::new_v4());
        let names_none = format!("before names no {what}");
        let mut cases = vec![
            ("limit=0", "limit must be 1 to 500"),
            ("limit=501", "limit must be 1 to 500"),
            (&*unknown, &*names_none),
            ("before=last", "before"),
            ("limt=3", "limt"),
        ];
        cases.extend_from_slice(more);
        self.assert_bad_requests(token, path, &cases).await;
    }

    /// Gives the rows of `table` the `created_at` (ms) of `times`, by id, and returns the ids
    /// in the order its list shows them: newest first, the rows of one millisecond by id.
    pub async fn date_rows(&self, table: &str, times: &[(String, i64)]) -> Vec<String> {
        for (id, at) in times {
            sqlx::query(sqlx::AssertSqlSafe(format!("UPDATE {table} SET created_at = $1 WHERE id = $2")))
                .bind(at)
                .bind(id)
                .execute(self.state.db.pool())
                .await
                .unwrap();
        }
        let mut newest_first = times.to_vec();
        newest_first.sort_by(|(a, at_a), (b, at_b)| (at_b, b).cmp(&(at_a, a)));
        newest_first.into_iter().map(|(id, _)| id).collect()
    }

    /// The paging of a list of owned rows (`/models`, `/datasets`: the table's name, holding
    /// `what`s), whose rows `upload(token, name)` adds, answering 201 with the row. Alice
    /// and the admin add seven, four in one millisecond: pages of two follow the `Link`
    /// header through every row once, newest first (those of one millisecond by id), and
    /// Alice's only through hers; the last page has no `Link`, nor does an unpaged list
    /// holding every row; a `before` the caller cannot see and a bad page are 400s.
    pub async fn assert_list_pages<F, Fut>(&self, path: &str, what: &str, upload: F)
    where
        F: Fn(String, String) -> Fut,
        Fut: std::future::Future<Output = reqwest::Response>,
    {
        let admin = self.admin().await;
        let alice = self.user(&admin, "alice").await;
        // Who adds each row, and when (ms).
        let (a, b) = (&alice, &admin);
        let owners = [(a, 1000), (a, 1000), (b, 1000), (a, 2000), (b, 3000), (a, 1000), (a, 4000)];
        let mut times = Vec::new();
        let mut alices = Vec::new();
        for (i, (token, at)) in owners.into_iter().enumerate() {
            let response = upload(token.clone(), format!("{what}-{i}")).await;
            assert_eq!(response.status(), 201, "{what}-{i}");
            let id = response.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_string();
            if token == &alice {
                alices.push(id.clone());
            }
            times.push((id, at));
        }
        let all = self.date_rows(path.trim_start_matches('/'), &times).await;
        let hers: Vec<String> = all.iter().filter(|id| alices.contains(id)).cloned().collect();
        let ids = |pages: &[Vec<Value>]| -> Vec<String> {
            pages.iter().flatten().map(|row| row["id"].as_str().unwrap().to_string()).collect()
        };
        let pages = self.pages(&admin, &format!("{path}?limit=2")).await;
        assert_eq!(ids(&pages), all, "every {what} once, newest first");
        assert!(pages.iter().all(|page| page.len() <= 2) && pages.len() == all.len().div_ceil(2), "{pages:?}");
        let pages = self.pages(&alice, &format!("{path}?limit=2")).await;
        assert_eq!(ids(&pages), hers, "only Alice's {what}s, newest first");

        let response = self.get(&admin, &format!("{path}?limit={}", all.len() - 1)).await;
        let link = response.headers()["link"].to_str().unwrap().to_string();
        let expected = format!("</api/v1{path}?limit={}&before={}>; rel=\"next\"", all.len() - 1, all[all.len() - 2]);
        assert_eq!(link, expected);
        for query in [format!("?limit={}", all.len()), String::new()] {
            let response = self.get(&admin, &format!("{path}{query}")).await;
            assert!(response.headers().get("link").is_none(), "{path}{query} is the last page");
            assert_eq!(response.json::<Vec<Value>>().await.unwrap().len(), all.len(), "{path}{query}");
        }

        let admins = all.iter().find(|id| !hers.contains(id)).expect("a row of the admin's");
        let hidden = format!("before={admins}");
        self.assert_bad_requests(&alice, path, &[(&hidden, &format!("before names no {what} you can see"))]).await;
        self.assert_bad_pages(&admin, path, what, &[]).await;

        // The API document says so.
        let document: Value =
            self.http.get(format!("{}/api/openapi.json", self.url)).send().await.unwrap().json().await.unwrap();
        let list = &document["paths"][format!("/api/v1{path}")]["get"];
        let parameters = list["parameters"].as_array().unwrap();
        let names: Vec<&str> = parameters.iter().map(|p| p["name"].as_str().unwrap()).collect();
        assert_eq!(names, ["limit", "before"], "{list}");
        assert!(list["parameters"][0]["description"].as_str().unwrap().contains("1 to 500 (default 500)"), "{list}");
        assert!(list["responses"]["200"]["headers"]["link"].is_object(), "{list}");
        assert!(list["responses"]["400"].is_object(), "{list}");
    }

    /// Runs blob garbage collection as if the grace period had passed (a second ago, so
    /// that a millisecond's rounding between the database's clock and ours cannot matter).
    pub async fn collect_garbage_after_grace(&self) -> tessera_server::registry::gc::Collected {
        let grace = std::time::Duration::from_secs(self.config.blob_grace_secs);
        let later = tessera_server::store::db::now_ms() + grace.as_millis() as i64 + 1000;
        tessera_server::registry::gc::collect(&self.state.blobs, &self.state.db, later, grace)
            .await
            .expect("blob garbage collection")
    }

    /// Registers a worker over the agent protocol; returns (worker id, secret).
    pub async fn register_worker(&self, name: &str) -> (String, String) {
        let response = self
            .post(
                WORKER_TOKEN,
                "/agent/register",
                json!({"name": name, "version": "test", "inventory": {"hostname": name, "cpu_cores": 2, "memory_bytes": 1024}}),
            )
            .await;
        assert_eq!(response.status(), 200, "{}", response.text().await.unwrap());
        let body: Value = response.json().await.unwrap();
        (body["worker_id"].as_str().unwrap().into(), body["secret"].as_str().unwrap().into())
    }

    /// Registers a worker again under its name, proving it is the same one with the
    /// secret of its last registration (a restart); returns (worker id, new secret).
    pub async fn rejoin_worker(&self, name: &str, previous_secret: &str) -> (String, String) {
        let inventory = json!({"hostname": name, "cpu_cores": 2, "memory_bytes": 1024});
        let body = json!({"name": name, "version": "test", "inventory": inventory, "previous_secret": previous_secret});
        let response = self.post(WORKER_TOKEN, "/agent/register", body).await;
        assert_eq!(response.status(), 200, "{}", response.text().await.unwrap());
        let body: Value = response.json().await.unwrap();
        (body["worker_id"].as_str().unwrap().into(), body["secret"].as_str().unwrap().into())
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Where the real all-MiniLM-L6-v2 folder is (fetched by scripts/fetch-assets.sh).
pub fn minilm_dir() -> Option<PathBuf> {
    let root = std::env::var("TESSERA_ASSETS")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.assets"));
    let dir = root.join("all-MiniLM-L6-v2");
    if dir.join("model.safetensors").exists() {
        Some(dir)
    } else if std::env::var("TESSERA_REQUIRE_ASSETS").as_deref() == Ok("1") {
        panic!("TESSERA_REQUIRE_ASSETS=1 but {} is missing; run scripts/fetch-assets.sh", dir.display());
    } else {
        eprintln!("note: {} missing; run scripts/fetch-assets.sh", dir.display());
        None
    }
}

/// A multipart form with `name` and the given (path, bytes) files.
pub fn model_form(name: &str, files: Vec<(String, Vec<u8>)>) -> reqwest::multipart::Form {
    let mut form = reqwest::multipart::Form::new().text("name", name.to_string());
    for (path, bytes) in files {
        form = form.part("files", reqwest::multipart::Part::bytes(bytes).file_name(path));
    }
    form
}

/// A tiny but valid BERT model: config, safetensors with just the word embeddings, and
/// a real tokenizer (from MiniLM when present, else a minimal WordPiece one).
pub fn tiny_model() -> Vec<(String, Vec<u8>)> {
    let config = json!({
        "architectures": ["BertModel"], "model_type": "bert", "hidden_size": 4, "num_hidden_layers": 1,
        "num_attention_heads": 2, "intermediate_size": 8, "vocab_size": 5, "max_position_embeddings": 16
    });
    vec![
        ("config.json".into(), serde_json::to_vec(&config).unwrap()),
        ("model.safetensors".into(), safetensors_bytes(&[("embeddings.word_embeddings.weight", "F32", vec![5, 4])])),
        ("tokenizer.json".into(), tiny_tokenizer()),
        (
            "1_Pooling/config.json".into(),
            br#"{"word_embedding_dimension": 4, "pooling_mode_mean_tokens": true}"#.to_vec(),
        ),
    ]
}

/// Serialises tensors (zero-filled) in the safetensors layout.
pub fn safetensors_bytes(tensors: &[(&str, &str, Vec<u64>)]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut offset = 0u64;
    for (name, dtype, shape) in tensors {
        let size = shape.iter().product::<u64>() * 4;
        header
            .insert(name.to_string(), json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}));
        offset += size;
    }
    let header = serde_json::to_vec(&Value::Object(header)).unwrap();
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&header);
    bytes.resize(bytes.len() + offset as usize, 0);
    bytes
}

pub fn tiny_tokenizer() -> Vec<u8> {
    serde_json::to_vec(&json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": {"type": "BertNormalizer", "clean_text": true, "handle_chinese_chars": true, "strip_accents": null, "lowercase": true},
        "pre_tokenizer": {"type": "BertPreTokenizer"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##", "max_input_chars_per_word": 100,
                  "vocab": {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "world": 4}}
    }))
    .unwrap()
}

/// Sends `request` on a task of its own and gives it half a second to run into whatever
/// lock the test holds: long enough for it to reach its transaction, while a request that
/// wrongly does not wait finishes well within it. The test then checks `is_finished`.
pub async fn send_into_a_lock(request: reqwest::RequestBuilder) -> tokio::task::JoinHandle<reqwest::Response> {
    let sent = tokio::spawn(async move { request.send().await.unwrap() });
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    sent
}

/// Follows a dashboard form's 303 as a browser does, sending the notice cookie it set
/// along with the session `cookie`: where it went, and that page's body.
pub async fn follow_notice(server: &TestServer, http: &reqwest::Client, cookie: &str, response: reqwest::Response) -> (String, String) {
    assert_eq!(response.status(), 303, "a form that worked redirects");
    let location = response.headers()["location"].to_str().unwrap().to_string();
    let notice = response.headers()["set-cookie"].to_str().unwrap().split(';').next().unwrap().to_string();
    assert!(notice.starts_with("tessera_notice="), "{notice}");
    let page = http.get(format!("{}{location}", server.url)).header("cookie", format!("{cookie}; {notice}")).send().await.unwrap();
    assert_eq!(page.status(), 200);
    let cleared = page.headers().get_all("set-cookie").iter().any(|v| v.to_str().unwrap().starts_with("tessera_notice=;"));
    assert!(cleared, "the page clears the notice it showed");
    (location, page.text().await.unwrap())
}
