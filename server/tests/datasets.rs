//! Dataset uploads over real HTTP on SQLite and PostgreSQL: CSV and JSONL are checked
//! and typed, broken files are refused with a 4xx naming the line and leave nothing
//! behind, ownership holds, and workers can download what they train on.

mod support;

use serde_json::{json, Value};
use support::{backends, TestServer};

/// Files under the blob store and temp area.
fn stored_files(server: &TestServer) -> usize {
    let blobs = std::fs::read_dir(server.dir.join("blobs/sha256")).map(|d| d.count()).unwrap_or(0);
    blobs + server.state.blobs.temp_files()
}

async fn upload(server: &TestServer, token: &str, name: &str, file_name: &str, bytes: &[u8]) -> reqwest::Response {
    let form = reqwest::multipart::Form::new()
        .text("name", name.to_string())
        .part("file", reqwest::multipart::Part::bytes(bytes.to_vec()).file_name(file_name.to_string()));
    server.http.post(server.api("/datasets")).bearer_auth(token).multipart(form).send().await.unwrap()
}

/// Uploads and expects `status`, a message mentioning `needle`, and no new files.
async fn assert_rejected(server: &TestServer, token: &str, file_name: &str, bytes: &[u8], status: u16, needle: &str) {
    let before = stored_files(server);
    let response = upload(server, token, "broken", file_name, bytes).await;
    let got = response.status().as_u16();
    let body: Value = response.json().await.unwrap();
    assert_eq!(got, status, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains(needle), "message {message:?} should mention {needle:?}");
    assert_eq!(stored_files(server), before, "a rejected upload left files behind");
    let datasets: Vec<Value> = server.get(token, "/datasets").await.json().await.unwrap();
    assert!(datasets.iter().all(|d| d["name"] != "broken"));
}

const WINE: &str = "fixed_acidity,alcohol,colour,quality\n7.4,9.4,red,5\n7.8,9.8,red,5\n6.3,10.5,white,6\n";

#[tokio::test]
async fn csv_and_jsonl_are_typed_counted_listed_downloaded_and_deleted() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let token = server.admin().await;
        let response = upload(&server, &token, "wine", "wine.csv", WINE.as_bytes()).await;
        assert_eq!(response.status(), 201, "{backend:?}");
        let wine: Value = response.json().await.unwrap();
        assert_eq!(wine["format"], "csv");
        assert_eq!(wine["rows"], 3);
        assert_eq!(wine["size_bytes"], WINE.len());
        assert!(wine["digest"].as_str().unwrap().starts_with("sha256:"));
        assert_eq!(
            wine["columns"],
            json!([{"name": "fixed_acidity", "type": "number", "distinct": 3},
                   {"name": "alcohol", "type": "number", "distinct": 3},
                   {"name": "colour", "type": "string", "distinct": 2},
                   {"name": "quality", "type": "number", "distinct": 2}])
        );
        for key in ["id", "name", "created_at"] {
            assert!(wine.get(key).is_some(), "{key} missing from {wine}");
        }

        let jsonl = "{\"text\":\"great film\",\"label\":\"pos\"}\n{\"text\":\"dull\",\"label\":\"neg\"}\n";
        let reviews: Value =
            upload(&server, &token, "reviews", "reviews.jsonl", jsonl.as_bytes()).await.json().await.unwrap();
        assert_eq!(reviews["format"], "jsonl");
        assert_eq!(reviews["rows"], 2);
        assert_eq!(reviews["columns"][0], json!({"name": "text", "type": "string", "distinct": 2}));

        let listed: Vec<Value> = server.get(&token, "/datasets").await.json().await.unwrap();
        assert_eq!(listed.len(), 2);
        let id = wine["id"].as_str().unwrap();
        let fetched: Value = server.get(&token, &format!("/datasets/{id}")).await.json().await.unwrap();
        assert_eq!(fetched["digest"], wine["digest"]);
        let bytes = server.get(&token, &format!("/datasets/{id}/file")).await.bytes().await.unwrap();
        assert_eq!(&bytes[..], WINE.as_bytes());
        // By name as by id.
        let by_name: Value = server.get(&token, "/datasets/reviews").await.json().await.unwrap();
        assert_eq!(by_name["id"], reviews["id"]);
        let bytes = server.get(&token, "/datasets/reviews/file").await.bytes().await.unwrap();
        assert_eq!(&bytes[..], jsonl.as_bytes());

        // Same bytes under another name share one blob; deleting one keeps the other's.
        let twin: Value = upload(&server, &token, "wine-copy", "w.csv", WINE.as_bytes()).await.json().await.unwrap();
        assert_eq!(twin["digest"], wine["digest"]);
        let blobs = stored_files(&server);
        assert_eq!(server.delete(&token, &format!("/datasets/{id}")).await.status(), 204);
        assert_eq!(stored_files(&server), blobs);
        assert_eq!(server.get(&token, &format!("/datasets/{id}")).await.status(), 404);
        assert_eq!(server.delete(&token, "/datasets/wine-copy").await.status(), 204);
        assert_eq!(server.get(&token, "/datasets/wine-copy").await.status(), 404);
        server.collect_garbage_after_grace().await;
        assert_eq!(stored_files(&server), blobs - 1, "the last reference's blob is collected ({backend:?})");
    }
}

#[tokio::test]
async fn broken_files_are_refused_naming_the_line_and_leave_nothing_behind() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let token = server.admin().await;
        assert_rejected(&server, &token, "a.csv", b"a,b\n1,2\n3\n", 422, "line 3").await;
        assert_rejected(&server, &token, "a.csv", b"a,b\n1,\xff\n", 422, "UTF-8").await;
        assert_rejected(&server, &token, "a.csv", b"a,a\n1,2\n", 422, "twice").await;
        assert_rejected(&server, &token, "a.csv", b"a,\x01b\n1,2\n", 422, "control characters").await;
        let wide: Vec<String> = (0..1400).map(|i| format!("{i:0>199}")).collect();
        let wide = format!("{}\n{}\n", wide.join(","), vec!["1"; 1400].join(","));
        assert_rejected(&server, &token, "a.csv", wide.as_bytes(), 422, "column names take").await;
        assert_rejected(&server, &token, "a.csv", b"a,b\n", 422, "no data rows").await;
        assert_rejected(&server, &token, "a.jsonl", b"{\"a\":1}\n{\"b\":2}\n", 422, "line 2").await;
        assert_rejected(&server, &token, "a.jsonl", b"{\"a\":{\"x\":1}}\n", 422, "flat").await;
        assert_rejected(&server, &token, "a.jsonl", b"{\"a\":1}\nnot json\n", 422, "line 2").await;
        assert_rejected(&server, &token, "a.jsonl", b"{\"a\":1}\n{\"a\":\"x\"}\n", 422, "one type").await;

        // No file part, a bad name, an unknown field.
        let form = reqwest::multipart::Form::new().text("name", "nofile");
        let response =
            server.http.post(server.api("/datasets")).bearer_auth(&token).multipart(form).send().await.unwrap();
        assert_eq!(response.status(), 422);
        let response = upload(&server, &token, "bad name!", "a.csv", WINE.as_bytes()).await;
        assert_eq!(response.status(), 422);
        assert_eq!(stored_files(&server), 0, "{backend:?}");
        let form = reqwest::multipart::Form::new().text("name", "x").text("colour", "red");
        let response =
            server.http.post(server.api("/datasets")).bearer_auth(&token).multipart(form).send().await.unwrap();
        assert_eq!(response.status(), 400);
        assert_eq!(stored_files(&server), 0, "{backend:?}");
    }
}

#[tokio::test]
async fn uploads_over_the_size_cap_are_refused_with_413_and_leave_nothing() {
    let server = TestServer::start_tweaked(support::Backend::Sqlite, |c| c.max_upload_bytes = 64).await;
    let token = server.admin().await;
    let big = format!("a,b\n{}", "1,2\n".repeat(100));
    assert_rejected(&server, &token, "big.csv", big.as_bytes(), 413, "upload limit").await;
}

#[tokio::test]
async fn datasets_are_private_to_their_owner_and_a_duplicate_name_conflicts() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let alice = server.user(&admin, "alice").await;
        let bob = server.user(&admin, "bob").await;
        let mine: Value = upload(&server, &alice, "wine", "wine.csv", WINE.as_bytes()).await.json().await.unwrap();
        let id = mine["id"].as_str().unwrap();
        assert_eq!(upload(&server, &alice, "wine", "wine.csv", WINE.as_bytes()).await.status(), 409);
        assert_eq!(server.get(&bob, &format!("/datasets/{id}")).await.status(), 404);
        assert_eq!(server.get(&bob, &format!("/datasets/{id}/file")).await.status(), 404);
        assert_eq!(server.delete(&bob, &format!("/datasets/{id}")).await.status(), 404);
        let bobs: Vec<Value> = server.get(&bob, "/datasets").await.json().await.unwrap();
        assert!(bobs.is_empty());
        // Bob may use the same name for his own.
        assert_eq!(upload(&server, &bob, "wine", "wine.csv", WINE.as_bytes()).await.status(), 201);
        let all: Vec<Value> = server.get(&admin, "/datasets").await.json().await.unwrap();
        assert_eq!(all.len(), 2, "an admin sees every dataset ({backend:?})");
        assert_eq!(server.get(&admin, &format!("/datasets/{id}")).await.status(), 200);
    }
}

#[tokio::test]
async fn a_worker_downloads_a_dataset_and_users_cannot_use_the_agent_route() {
    let server = TestServer::start(support::Backend::Sqlite).await;
    let token = server.admin().await;
    let wine: Value = upload(&server, &token, "wine", "wine.csv", WINE.as_bytes()).await.json().await.unwrap();
    let id = wine["id"].as_str().unwrap();
    let (_, secret) = server.register_worker("w1").await;
    // A worker fetches a dataset only while it holds a training job on it.
    assert_eq!(server.get(&secret, &format!("/agent/datasets/{id}/file")).await.status(), 403);
    let train = json!({"name": "t", "model": {"kind": "mlp", "hidden": [8]}, "dataset": id,
        "task": {"type": "regression", "label_column": "quality", "feature_columns": ["fixed_acidity", "alcohol"],
                 "validation_split": 0.4},
        "optimizer": {"type": "sgd"}, "batch_size": 2, "max_steps": 10, "eval_every": 5, "checkpoint_every": 5,
        "lr_schedule": {"type": "constant", "lr": 0.1}, "seed": 1});
    let response = server.post(&token, "/jobs", train).await;
    assert_eq!(response.status(), 201, "{}", response.text().await.unwrap());
    assert_eq!(server.post(&secret, "/agent/claim", json!({"kinds": ["train"]})).await.status(), 200);
    let meta: Value = server.get(&secret, &format!("/agent/datasets/{id}")).await.json().await.unwrap();
    assert_eq!(meta["rows"], 3);
    let bytes = server.get(&secret, &format!("/agent/datasets/{id}/file")).await.bytes().await.unwrap();
    assert_eq!(&bytes[..], WINE.as_bytes());
    assert_eq!(server.get(&token, &format!("/agent/datasets/{id}/file")).await.status(), 401);
}

/// A dataset's deletion and a job queued on it, on one server or several, run one after
/// the other and never leave a job reading a deleted dataset: the deletion waits for the
/// transaction queuing the job and then refuses (409); a job submitted while a deletion
/// holds the dataset finds it gone (404).
#[tokio::test]
async fn a_dataset_deletion_and_a_job_queued_on_it_run_one_after_the_other() {
    use tessera_server::store::{self, jobs::NewJob, RowLock};
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let db = &server.state.db;
        let token = server.admin().await;
        let id = server.toy_dataset(&token).await;
        let body = json!({"name": "t", "model": {"kind": "mlp", "hidden": [8]}, "dataset": id,
            "task": {"type": "classification", "label_column": "label", "validation_split": 0.2},
            "optimizer": {"type": "sgd", "momentum": 0.9}, "batch_size": 8, "max_steps": 10, "eval_every": 5,
            "checkpoint_every": 5, "lr_schedule": {"type": "constant", "lr": 0.1}, "seed": 1});
        let response = server.post(&token, "/jobs", body.clone()).await;
        assert_eq!(response.status(), 201, "{}", response.text().await.unwrap());
        let first = response.json::<Value>().await.unwrap()["id"].as_str().unwrap().parse().unwrap();
        let spec = store::jobs::spec(db, first).await.unwrap().unwrap();
        assert_eq!(server.post(&token, &format!("/jobs/{first}/cancel"), json!({})).await.status(), 200);
        let owner = store::users::find_by_name(db, "admin").await.unwrap().unwrap().id;
        let dataset = id.parse().unwrap();

        // A job being queued holds the dataset: its deletion waits, then sees the job.
        let mut queuing = db.begin().await.unwrap();
        tessera_server::datasets::hold(db, &mut queuing, dataset).await.unwrap();
        let request = server.http.delete(server.api(&format!("/datasets/{id}"))).bearer_auth(&token);
        let deletion = support::send_into_a_lock(request).await;
        assert!(!deletion.is_finished(), "{backend:?}: the deletion did not wait for the job being queued");
        let job = NewJob { dataset: Some(dataset), ..NewJob::new(owner, "t", &spec, 1) };
        let queued = store::jobs::insert_in(&mut queuing, &job).await.unwrap();
        queuing.commit().await.unwrap();
        let response = deletion.await.unwrap();
        let (status, refusal) = (response.status(), response.text().await.unwrap());
        assert_eq!(status, 409, "{backend:?}: {refusal}");
        assert!(refusal.contains("1 unfinished training job"), "{refusal}");

        // A deletion holds the dataset: a job submitted meanwhile waits, then finds it gone.
        assert_eq!(server.post(&token, &format!("/jobs/{queued}/cancel"), json!({})).await.status(), 200);
        let mut deleting = db.begin().await.unwrap();
        assert!(store::datasets::lock(&mut deleting, db.backend(), dataset, RowLock::Update).await.unwrap());
        let request = server.http.post(server.api("/jobs")).bearer_auth(&token).json(&body);
        let submission = support::send_into_a_lock(request).await;
        assert!(!submission.is_finished(), "{backend:?}: the submission did not wait for the deletion");
        store::datasets::delete_in(&mut deleting, dataset).await.unwrap();
        deleting.commit().await.unwrap();
        let response = submission.await.unwrap();
        let (status, refusal) = (response.status(), response.text().await.unwrap());
        assert_eq!(status, 404, "{backend:?}: {refusal}");
        let jobs: Vec<Value> = server.get(&token, "/jobs").await.json().await.unwrap();
        assert_eq!(jobs.len(), 2, "no job was queued on the deleted dataset: {jobs:?}");
    }
}

/// `GET /api/v1/datasets` pages as the job list does (see `assert_list_pages`).
#[tokio::test]
async fn the_dataset_list_pages_through_every_dataset_once_and_a_user_through_theirs() {
    for backend in backends() {
        let server = &TestServer::start(backend).await;
        let add = |token: String, name: String| async move {
            upload(server, &token, &name, "w.csv", WINE.as_bytes()).await
        };
        server.assert_list_pages("/datasets", "dataset", add).await;
    }
}
