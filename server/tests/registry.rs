//! Model uploads over real HTTP: every kind of broken upload is refused with a clear 4xx
//! and leaves no file behind; a valid one round-trips byte for byte.

mod support;

use serde_json::{json, Value};
use support::{backends, minilm_dir, safetensors_bytes, tiny_model, Backend, TestServer};

/// Files under the blob store and temp area.
fn stored_files(server: &TestServer) -> usize {
    let blobs = std::fs::read_dir(server.dir.join("blobs/sha256")).map(|d| d.count()).unwrap_or(0);
    blobs + server.state.blobs.temp_files()
}

fn with_file(path: &str, bytes: Vec<u8>) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<_> = tiny_model().into_iter().filter(|(p, _)| p != path).collect();
    files.push((path.to_string(), bytes));
    files
}

/// Uploads and expects `status`, an error message mentioning `needle`, and no new files.
async fn assert_rejected(server: &TestServer, token: &str, files: Vec<(String, Vec<u8>)>, status: u16, needle: &str) {
    let before = stored_files(server);
    let response = server.upload_model(token, "broken", files).await;
    let got = response.status().as_u16();
    let body: Value = response.json().await.unwrap();
    assert_eq!(got, status, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.to_lowercase().contains(&needle.to_lowercase()), "message {message:?} should mention {needle:?}");
    assert_eq!(stored_files(server), before, "a rejected upload left files behind");
    let models: Vec<Value> = server.get(token, "/models").await.json().await.unwrap();
    assert!(models.iter().all(|m| m["name"] != "broken"));
}

fn header_with_length(declared: u64, json: &[u8], data: usize) -> Vec<u8> {
    let mut bytes = declared.to_le_bytes().to_vec();
    bytes.extend_from_slice(json);
    bytes.resize(bytes.len() + data, 0);
    bytes
}

#[tokio::test]
async fn broken_safetensors_are_rejected_and_leave_nothing_behind() {
    let server = TestServer::start(Backend::Sqlite).await;
    let token = server.admin().await;
    let valid = safetensors_bytes(&[("embeddings.word_embeddings.weight", "F32", vec![5, 4])]);
    let mut truncated = valid.clone();
    truncated.truncate(valid.len() - 7);
    assert_rejected(&server, &token, with_file("model.safetensors", truncated), 422, "word_embeddings").await;
    assert_rejected(&server, &token, with_file("model.safetensors", vec![1, 2, 3]), 422, "").await;
    let json = br#"{"embeddings.word_embeddings.weight":{"dtype":"F32","shape":[5,4],"data_offsets":[0,80]}}"#;
    assert_rejected(&server, &token, with_file("model.safetensors", header_with_length(1 << 40, json, 80)), 422, "header").await;
    assert_rejected(&server, &token, with_file("model.safetensors", header_with_length(json.len() as u64 - 5, json, 80)), 422, "").await;
    assert_rejected(&server, &token, with_file("model.safetensors", header_with_length(200_000_000, json, 80)), 422, "header").await;
    let overlapping = br#"{"embeddings.word_embeddings.weight":{"dtype":"F32","shape":[5,4],"data_offsets":[0,80]},"b":{"dtype":"F32","shape":[2],"data_offsets":[72,80]}}"#;
    assert_rejected(&server, &token, with_file("model.safetensors", header_with_length(overlapping.len() as u64, overlapping, 80)), 422, "overlap").await;
    let wrong_dtype = br#"{"embeddings.word_embeddings.weight":{"dtype":"F31","shape":[5,4],"data_offsets":[0,80]}}"#;
    assert_rejected(&server, &token, with_file("model.safetensors", header_with_length(wrong_dtype.len() as u64, wrong_dtype, 80)), 422, "F31").await;
    assert_rejected(&server, &token, with_file("model.safetensors", header_with_length(9, b"not json!", 0)), 422, "JSON").await;
    let wrong_shape = safetensors_bytes(&[("embeddings.word_embeddings.weight", "F32", vec![5, 3])]);
    assert_rejected(&server, &token, with_file("model.safetensors", wrong_shape), 422, "word_embeddings").await;
}

#[tokio::test]
async fn bad_paths_configs_and_tokenizers_are_rejected() {
    let server = TestServer::start(Backend::Sqlite).await;
    let token = server.admin().await;
    for path in ["../evil.json", "/etc/passwd", "a/../../b", "1_Pooling/../../x", "C:\\x", "unknown.bin"] {
        let mut files = tiny_model();
        files.push((path.to_string(), b"{}".to_vec()));
        assert_rejected(&server, &token, files, 422, "").await;
    }
    assert_rejected(&server, &token, with_file("config.json", b"{not json".to_vec()), 422, "JSON").await;
    assert_rejected(&server, &token, with_file("config.json", br#"{"model_type": "gpt2"}"#.to_vec()), 422, "gpt2").await;
    assert_rejected(&server, &token, with_file("tokenizer.json", b"{}".to_vec()), 422, "tokenizer").await;
    let no_tokenizer: Vec<_> = tiny_model().into_iter().filter(|(p, _)| p != "tokenizer.json").collect();
    assert_rejected(&server, &token, no_tokenizer, 422, "tokenizer.json").await;
    let mut twice = tiny_model();
    twice.push(("config.json".into(), tiny_model()[0].1.clone()));
    assert_rejected(&server, &token, twice, 422, "twice").await;
}

/// A RoBERTa-family config is well formed, but the engine would refuse it on every replica;
/// the upload is refused instead, naming what the engine runs.
#[tokio::test]
async fn a_model_type_the_engine_cannot_run_is_refused_with_the_supported_ones() {
    let server = TestServer::start(Backend::Sqlite).await;
    let token = server.admin().await;
    for model_type in ["roberta", "xlm-roberta", "distilbert", "camembert"] {
        let mut config: Value = serde_json::from_slice(&tiny_model()[0].1).unwrap();
        config["model_type"] = json!(model_type);
        let files = with_file("config.json", serde_json::to_vec(&config).unwrap());
        let needle = format!("`model_type` `{model_type}`, which the serving engine cannot run; it runs `model_type` `bert` only");
        assert_rejected(&server, &token, files, 422, &needle).await;
    }
}

#[tokio::test]
async fn oversized_upload_is_refused_with_413() {
    let server = TestServer::start_tweaked(Backend::Sqlite, |config| config.max_upload_bytes = 64).await;
    let token = server.admin().await;
    assert_rejected(&server, &token, tiny_model(), 413, "limit").await;
}

#[tokio::test]
async fn a_name_is_required_and_unique_per_owner() {
    let server = TestServer::start(Backend::Sqlite).await;
    let token = server.admin().await;
    let response = server.upload_model(&token, "", tiny_model()).await;
    assert_eq!(response.status(), 422);
    // Specs and paths name a model by id or name: a name that reads as an id is refused.
    let response = server.upload_model(&token, "0b5e3c1e-7d1a-4a7e-9f3b-2c1d0e9f8a7b", tiny_model()).await;
    assert_eq!(response.status(), 422);
    let body: serde_json::Value = response.json().await.unwrap();
    assert!(body["error"]["message"].as_str().unwrap().contains("reads as an id"), "{body}");
    assert_eq!(server.upload_model(&token, "tiny", tiny_model()).await.status(), 201);
    let before = stored_files(&server);
    let response = server.upload_model(&token, "tiny", tiny_model()).await;
    assert_eq!(response.status(), 409);
    assert_eq!(stored_files(&server), before);
}

#[tokio::test]
async fn valid_upload_round_trips_byte_for_byte() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let token = server.admin().await;
        let files = match minilm_dir() {
            Some(dir) => ["config.json", "model.safetensors", "tokenizer.json", "1_Pooling/config.json", "vocab.txt"]
                .iter()
                .map(|p| (p.to_string(), std::fs::read(dir.join(p)).unwrap()))
                .collect(),
            None => tiny_model(),
        };
        let response = server.upload_model(&token, "minilm", files.clone()).await;
        assert_eq!(response.status(), 201);
        let model: Value = response.json().await.unwrap();
        assert_eq!(model["files"].as_array().unwrap().len(), files.len());
        assert!(model["digest"].as_str().unwrap().starts_with("sha256:"));
        let id = model["id"].as_str().unwrap();
        for (path, bytes) in &files {
            let response = server.get(&token, &format!("/models/{id}/files/{path}")).await;
            assert_eq!(response.status(), 200);
            assert_eq!(&response.bytes().await.unwrap()[..], &bytes[..], "{path} round-trips");
        }
        let listed: Vec<Value> = server.get(&token, "/models").await.json().await.unwrap();
        assert_eq!(listed.len(), 1);
        // By name as by id; a name that is none of yours is a 404 saying so.
        let by_name: Value = server.get(&token, "/models/minilm").await.json().await.unwrap();
        assert_eq!(by_name["id"], model["id"]);
        let response = server.get(&token, "/models/minilm/files/config.json").await;
        assert_eq!(&response.bytes().await.unwrap()[..], &files[0].1[..]);
        let response = server.get(&token, "/models/nothing-by-that-name").await;
        assert_eq!(response.status(), 404);
        let error: Value = response.json().await.unwrap();
        assert!(error["error"]["message"].as_str().unwrap().contains("nothing-by-that-name"), "{error}");
        // Same content under another name shares blobs; deleting one keeps the other's.
        assert_eq!(server.upload_model(&token, "copy", files.clone()).await.status(), 201);
        assert_eq!(server.delete(&token, &format!("/models/{id}")).await.status(), 204);
        let copy: Vec<Value> = server.get(&token, "/models").await.json().await.unwrap();
        let copy_id = copy[0]["id"].as_str().unwrap();
        let response = server.get(&token, &format!("/models/{copy_id}/files/config.json")).await;
        assert_eq!(response.status(), 200, "{copy:?} {}", response.text().await.unwrap());
        assert_eq!(server.delete(&token, "/models/copy").await.status(), 204);
        server.collect_garbage_after_grace().await;
        assert_eq!(stored_files(&server), 0, "deleting the last model removes its blobs");
    }
}

#[tokio::test]
async fn restart_keeps_users_models_and_queued_jobs() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let alice = server.user(&admin, "alice").await;
        assert_eq!(server.upload_model(&alice, "tiny", tiny_model()).await.status(), 201);
        let job: Value = server.post(&alice, "/jobs", json!({"name": "warm", "spec": {"kind": "prefetch", "model": "tiny"}})).await.json().await.unwrap();
        assert_eq!(job["state"], "queued");
        let server = server.restart().await;
        // The session survives too: the signing key is kept in the data directory.
        let me: Value = server.get(&alice, "/auth/me").await.json().await.unwrap();
        assert_eq!(me["username"], "alice");
        let alice = server.login("alice", "alice-secret-pw").await;
        let models: Vec<Value> = server.get(&alice, "/models").await.json().await.unwrap();
        assert_eq!(models.len(), 1);
        let jobs: Vec<Value> = server.get(&alice, "/jobs").await.json().await.unwrap();
        assert_eq!((jobs.len(), jobs[0]["state"].as_str()), (1, Some("queued")));
        assert_eq!(jobs[0]["id"], job["id"]);
    }
}

/// A model's deletion and what comes to use it, on one server or several, run one after
/// the other: the deletion waits for the transaction queuing a job on the model and then
/// refuses (409); a deployment created while a deletion holds the model finds it gone
/// (404, where its insert used to break the foreign key with a 500).
#[tokio::test]
async fn a_model_deletion_and_what_comes_to_use_it_run_one_after_the_other() {
    use tessera_api::jobs::JobSpec;
    use tessera_server::store::{self, jobs::NewJob, RowLock};
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let db = &server.state.db;
        let token = server.admin().await;
        let response = server.upload_model(&token, "tiny", tiny_model()).await;
        assert_eq!(response.status(), 201);
        let id = response.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_string();
        let model = id.parse().unwrap();
        let owner = store::users::find_by_name(db, "admin").await.unwrap().unwrap().id;

        // A prefetch job being queued holds the model: its deletion waits, then sees the job.
        let mut queuing = db.begin().await.unwrap();
        tessera_server::registry::hold(db, &mut queuing, model).await.unwrap();
        let request = server.http.delete(server.api(&format!("/models/{id}"))).bearer_auth(&token);
        let deletion = support::send_into_a_lock(request).await;
        assert!(!deletion.is_finished(), "{backend:?}: the deletion did not wait for the job being queued");
        let spec = JobSpec::Prefetch { model };
        let queued = store::jobs::insert_in(&mut queuing, &NewJob::new(owner, "prefetch", &spec, 1)).await.unwrap();
        queuing.commit().await.unwrap();
        let response = deletion.await.unwrap();
        let (status, refusal) = (response.status(), response.text().await.unwrap());
        assert_eq!(status, 409, "{backend:?}: {refusal}");
        assert!(refusal.contains(&format!("prefetch job {queued}")), "{refusal}");

        // A deletion holds the model: a deployment created meanwhile waits, then finds it gone.
        assert_eq!(server.post(&token, &format!("/jobs/{queued}/cancel"), json!({})).await.status(), 200);
        let mut deleting = db.begin().await.unwrap();
        assert!(store::models::lock(&mut deleting, db.backend(), model, RowLock::Update).await.unwrap());
        let request = server.http.post(server.api("/deployments")).bearer_auth(&token);
        let request = request.json(&json!({"name": "embedder", "model": id, "replicas": 1}));
        let creation = support::send_into_a_lock(request).await;
        assert!(!creation.is_finished(), "{backend:?}: the deployment did not wait for the deletion");
        store::models::delete_in(&mut deleting, model).await.unwrap();
        deleting.commit().await.unwrap();
        let response = creation.await.unwrap();
        let (status, refusal) = (response.status(), response.text().await.unwrap());
        assert_eq!(status, 404, "{backend:?}: {refusal}");
        let deployments: Vec<Value> = server.get(&token, "/deployments").await.json().await.unwrap();
        assert!(deployments.is_empty(), "no deployment serves the deleted model: {deployments:?}");
    }
}

/// `GET /api/v1/models` pages as the job list does (see `assert_list_pages`).
#[tokio::test]
async fn the_model_list_pages_through_every_model_once_and_a_user_through_theirs() {
    for backend in backends() {
        let server = &TestServer::start(backend).await;
        let upload = |token: String, name: String| async move {
            server.upload_model(&token, &name, tiny_model()).await
        };
        server.assert_list_pages("/models", "model", upload).await;
    }
}
