//! Storage that survives crashes and several servers (issue 14): uploads in progress
//! outlive another server's start-up, blobs are collected only when the ledger says
//! nothing references them and the grace period has passed, orphans a crash left are
//! collected, and an S3-compatible store (moto, `scripts/s3-server.sh`) serves several
//! servers at once, workers' downloads included.

mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use futures_util::StreamExt;
use serde_json::{json, Value};
use support::{backends, model_form, tiny_model, Backend, TestServer};
use tessera_server::config::Config;
use tessera_server::registry::blobs::Kind;
use tessera_server::registry::gc;
use tessera_server::store::blobs as ledger;
use tessera_server::store::db::now_ms;

const WINE: &str = "alcohol,malic_acid,class\n14.23,1.71,0\n13.2,1.78,1\n";

fn blob_dir(server: &TestServer) -> PathBuf {
    server.dir.join("blobs/sha256")
}

/// Blob files in the local store.
fn local_blobs(server: &TestServer) -> usize {
    std::fs::read_dir(blob_dir(server)).map(|d| d.count()).unwrap_or(0)
}

fn sha256(bytes: &[u8]) -> String {
    use sha2::Digest;
    format!("sha256:{}", hex::encode(sha2::Sha256::digest(bytes)))
}

/// A second server over the same database (and, unless `tweak` changes it, the same data
/// directory), as a second replica behind a load balancer would be.
async fn second_server(first: &TestServer, tweak: impl FnOnce(&mut Config)) -> TestServer {
    let mut config = first.config.clone();
    config.database_url = Some(first.config.database_url());
    tweak(&mut config);
    let dir = config.data_dir.clone();
    TestServer::start_with(config, dir, None).await
}

async fn upload_dataset(server: &TestServer, token: &str, name: &str, csv: &str) -> Value {
    let form = reqwest::multipart::Form::new()
        .text("name", name.to_string())
        .part("file", reqwest::multipart::Part::bytes(csv.as_bytes().to_vec()).file_name("data.csv"));
    let response = server.http.post(server.api("/datasets")).bearer_auth(token).multipart(form).send().await.unwrap();
    assert_eq!(response.status(), 201, "{}", response.text().await.unwrap());
    response.json().await.unwrap()
}

async fn upload_model(server: &TestServer, token: &str, name: &str) -> Value {
    let response = server
        .http
        .post(server.api("/models"))
        .bearer_auth(token)
        .multipart(model_form(name, tiny_model()))
        .send()
        .await;
    let response = response.unwrap();
    assert_eq!(response.status(), 201, "{}", response.text().await.unwrap());
    response.json().await.unwrap()
}

// --- Start-up never deletes another server's uploads ------------------------------------

#[tokio::test]
async fn an_upload_in_progress_survives_another_server_starting_on_the_same_data_directory() {
    let first = TestServer::start(Backend::Sqlite).await;
    let token = first.admin().await;

    // A dead server's staging directory: its lock is free, so a start-up removes it.
    let dead = first.dir.join("tmp").join(uuid::Uuid::new_v4().to_string());
    std::fs::create_dir_all(&dead).unwrap();
    std::fs::write(dead.join(".lock"), b"").unwrap();
    std::fs::write(dead.join("half-written"), b"abc").unwrap();

    // The weights arrive in two halves; the second only once the other server has started.
    let files = tiny_model();
    let weights = files.iter().find(|(p, _)| p == "model.safetensors").unwrap().1.clone();
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    let (first_half, second_half) = weights.split_at(weights.len() / 2);
    let (first_half, second_half) = (first_half.to_vec(), second_half.to_vec());
    let stream = futures_util::stream::iter([Ok::<_, std::io::Error>(first_half)]).chain(futures_util::stream::once(
        async move {
            released.await.unwrap();
            Ok(second_half)
        },
    ));
    let mut form = reqwest::multipart::Form::new().text("name", "slow");
    for (path, bytes) in files.iter().filter(|(p, _)| p != "model.safetensors") {
        form = form.part("files", reqwest::multipart::Part::bytes(bytes.clone()).file_name(path.clone()));
    }
    form = form.part(
        "files",
        reqwest::multipart::Part::stream(reqwest::Body::wrap_stream(stream)).file_name("model.safetensors"),
    );
    let request = first.http.post(first.api("/models")).bearer_auth(&token).multipart(form).send();
    let upload = tokio::spawn(request);

    // Wait until the weights are being written on the first server.
    let staging = first.state.blobs.staging_dir().to_path_buf();
    let in_progress = async {
        while first.state.blobs.temp_files() < 4 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(20), in_progress).await.expect("the upload reaches the staging area");

    let second = second_server(&first, |_| {}).await;
    assert!(staging.is_dir(), "another server's start-up removed an upload in progress");
    assert_eq!(first.state.blobs.temp_files(), 4);
    assert!(!dead.exists(), "a dead server's staging directory stays");
    assert_ne!(second.state.blobs.staging_dir(), staging);

    release.send(()).unwrap();
    let response = upload.await.unwrap().unwrap();
    assert_eq!(response.status(), 201, "{}", response.text().await.unwrap());
    let model: Value = response.json().await.unwrap();
    let id = model["id"].as_str().unwrap();
    let fetched = second.get(&token, &format!("/models/{id}/files/model.safetensors")).await;
    assert_eq!(fetched.status(), 200);
    assert_eq!(&fetched.bytes().await.unwrap()[..], &weights[..]);

    // A garbage collection on the second server leaves the first one's staging alone too.
    second.collect_garbage_after_grace().await;
    assert!(staging.is_dir());
}

// --- One storage quota across servers -------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn uploads_through_two_servers_at_once_share_one_storage_quota() {
    for backend in backends() {
        let model_bytes: u64 = tiny_model().iter().map(|(_, bytes)| bytes.len() as u64).sum();
        // Room for two copies of the tiny model, not three.
        let first = TestServer::start_tweaked(backend, |c| c.quota_storage_bytes = 2 * model_bytes + 100).await;
        let second = second_server(&first, |_| {}).await;
        let admin = first.admin().await;
        let alice = first.user(&admin, "alice").await;
        let uploads = (0..8).map(|i| {
            let server = if i % 2 == 0 { &first } else { &second };
            server
                .http
                .post(server.api("/models"))
                .bearer_auth(&alice)
                .multipart(model_form(&format!("m{i}"), tiny_model()))
                .send()
        });
        let statuses: Vec<u16> =
            futures_util::future::join_all(uploads).await.iter().map(|r| r.as_ref().unwrap().status().as_u16()).collect();
        assert_eq!(statuses.iter().filter(|s| **s == 201).count(), 2, "{backend:?}: {statuses:?}");
        assert!(statuses.iter().all(|s| *s == 201 || *s == 403), "{backend:?}: {statuses:?}");
        let models: Value = second.get(&alice, "/models").await.json().await.unwrap();
        let stored: u64 = models.as_array().unwrap().iter().map(|m| m["size_bytes"].as_u64().unwrap()).sum();
        assert_eq!(stored, 2 * model_bytes, "{backend:?}");
    }
}

// --- Reference counting and the grace period ---------------------------------------------

#[tokio::test]
async fn deleted_models_blobs_go_only_once_unreferenced_for_the_grace_period() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let token = server.admin().await;
        let model = upload_model(&server, &token, "tiny").await;
        let copy = upload_model(&server, &token, "copy").await;
        let digests: Vec<String> =
            model["files"].as_array().unwrap().iter().map(|f| f["digest"].as_str().unwrap().to_string()).collect();
        let refs = |expected: i64| {
            let (db, digests) = (server.state.db.clone(), digests.clone());
            async move {
                for digest in &digests {
                    assert_eq!(ledger::refs(&db, digest).await.unwrap(), Some(expected), "{backend:?} {digest}");
                }
            }
        };
        refs(2).await;

        let id = model["id"].as_str().unwrap();
        assert_eq!(server.delete(&token, &format!("/models/{id}")).await.status(), 204);
        refs(1).await;
        let copy_id = copy["id"].as_str().unwrap();
        assert_eq!(server.delete(&token, &format!("/models/{copy_id}")).await.status(), 204);
        refs(0).await;
        // Deleting does not delete bytes: a download that began before may still be reading.
        assert_eq!(local_blobs(&server), 4, "blobs went before the grace period ({backend:?})");
        let grace = Duration::from_secs(server.config.blob_grace_secs);
        let now = gc::collect(&server.state.blobs, &server.state.db, now_ms(), grace).await.unwrap();
        assert_eq!(now.deleted, 0, "{backend:?}");
        assert_eq!(local_blobs(&server), 4);

        let later = server.collect_garbage_after_grace().await;
        assert_eq!(later.deleted, 4, "{backend:?}");
        assert_eq!(local_blobs(&server), 0, "{backend:?}");
        for digest in &digests {
            assert!(!server.state.blobs.exists(digest).await.unwrap(), "{backend:?}");
            assert!(!ledger::known(&server.state.db, digest).await.unwrap(), "{backend:?}");
        }
    }
}

#[tokio::test]
async fn a_blob_another_server_is_registering_survives_a_delete_and_a_collection() {
    for backend in backends() {
        let first = TestServer::start(backend).await;
        let second = second_server(&first, |_| {}).await;
        let token = first.admin().await;
        let wine = upload_dataset(&first, &token, "wine", WINE).await;
        let digest = wine["digest"].as_str().unwrap().to_string();

        // The second server has written the same bytes into the store and is about to
        // write the row that references them ...
        let mut blob = second.state.blobs.begin().await.unwrap();
        blob.write(WINE.as_bytes()).await.unwrap();
        assert_eq!(blob.finish().await.unwrap(), digest);
        second.state.blobs.commit(&second.state.db, vec![blob]).await.unwrap();

        // ... when the first deletes the only dataset that references them and collects.
        let id = wine["id"].as_str().unwrap();
        assert_eq!(first.delete(&token, &format!("/datasets/{id}")).await.status(), 204);
        let grace = Duration::from_secs(first.config.blob_grace_secs);
        gc::collect(&first.state.blobs, &first.state.db, now_ms(), grace).await.unwrap();
        assert!(
            first.state.blobs.exists(&digest).await.unwrap(),
            "a blob being registered was collected ({backend:?})"
        );

        // The second server's upload of the same bytes registers and downloads.
        let twin = upload_dataset(&second, &token, "wine-again", WINE).await;
        assert_eq!(twin["digest"], digest.as_str());
        let twin_id = twin["id"].as_str().unwrap();
        let bytes = first.get(&token, &format!("/datasets/{twin_id}/file")).await;
        assert_eq!(bytes.status(), 200, "{backend:?}");
        assert_eq!(bytes.text().await.unwrap(), WINE);
        assert_eq!(second.collect_garbage_after_grace().await.deleted, 0, "{backend:?}");
        assert!(first.state.blobs.exists(&digest).await.unwrap());
    }
}

#[tokio::test]
async fn a_collection_in_progress_holds_back_a_server_writing_the_same_blob() {
    for backend in backends() {
        let first = TestServer::start(backend).await;
        let second = second_server(&first, |_| {}).await;
        let token = first.admin().await;
        let wine = upload_dataset(&first, &token, "wine", WINE).await;
        let digest = wine["digest"].as_str().unwrap().to_string();
        let id = wine["id"].as_str().unwrap();
        assert_eq!(first.delete(&token, &format!("/datasets/{id}")).await.status(), 204);

        // The first server's collector has found the blob collectable and holds its row.
        // (A second ahead: the release was stamped by the database's clock.)
        let cutoff = now_ms() + 1000;
        let deletion = ledger::begin_deletion(&first.state.db, &digest, cutoff).await.unwrap().expect("collectable");

        // Meanwhile the second server commits the same bytes: it must wait for the
        // collection, or the collection would delete what it just wrote.
        let mut blob = second.state.blobs.begin().await.unwrap();
        blob.write(WINE.as_bytes()).await.unwrap();
        blob.finish().await.unwrap();
        let before_commit = now_ms();
        let blobs = second.state.blobs.clone();
        let db = second.state.db.clone();
        let writer = tokio::spawn(async move { blobs.commit(&db, vec![blob]).await });
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!writer.is_finished(), "a commit did not wait for the collection of its blob ({backend:?})");

        first.state.blobs.remove(&digest).await.unwrap();
        deletion.finish().await.unwrap();
        writer.await.unwrap().unwrap();
        assert!(second.state.blobs.exists(&digest).await.unwrap(), "{backend:?}");
        assert_eq!(ledger::refs(&second.state.db, &digest).await.unwrap(), Some(0), "{backend:?}");
        // Touched again by the commit: not collectable by anything that started before it.
        assert!(ledger::begin_deletion(&first.state.db, &digest, before_commit).await.unwrap().is_none());
    }
}

#[tokio::test]
async fn a_row_cannot_reference_a_blob_the_ledger_has_collected() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let token = server.admin().await;
        let wine = upload_dataset(&server, &token, "wine", WINE).await;
        let id = wine["id"].as_str().unwrap();
        assert_eq!(server.delete(&token, &format!("/datasets/{id}")).await.status(), 204);
        assert_eq!(server.collect_garbage_after_grace().await.deleted, 1);

        // A registration that skipped the ledger (or outlived the grace period) is refused
        // by the database instead of pointing at bytes that are gone.
        let mut dataset: tessera_api::datasets::Dataset = serde_json::from_value(wine.clone()).unwrap();
        dataset.id = uuid::Uuid::new_v4();
        let me = tessera_server::store::users::find_by_name(&server.state.db, "admin").await.unwrap().unwrap();
        let mut conn = server.state.db.pool().acquire().await.unwrap();
        let refused = tessera_server::store::datasets::insert(&mut conn, me.id, &dataset).await;
        assert!(refused.is_err(), "{backend:?}");
        assert!(format!("{:?}", refused.unwrap_err()).contains("blob_collected"), "{backend:?}");
    }
}

// --- Orphans a crash left ----------------------------------------------------------------

/// Writes `bytes` straight into the local store, as a crash between the rename and the
/// ledger row of an older version would have left them, last modified `age` ago.
fn plant_orphan(server: &TestServer, bytes: &[u8], age: Duration) -> String {
    let digest = sha256(bytes);
    let path = blob_dir(server).join(digest.strip_prefix("sha256:").unwrap());
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, bytes).unwrap();
    let file = std::fs::File::options().write(true).open(&path).unwrap();
    file.set_modified(std::time::SystemTime::now() - age).unwrap();
    digest
}

#[tokio::test]
async fn garbage_collection_takes_what_a_crash_left_once_the_grace_period_has_passed() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let grace = Duration::from_secs(server.config.blob_grace_secs);
        let old = plant_orphan(&server, b"written before a crash, long ago", grace * 2);
        let young = plant_orphan(&server, b"written a moment ago", Duration::ZERO);
        // Committed (in the ledger) but the server died before writing its row.
        let mut blob = server.state.blobs.begin().await.unwrap();
        blob.write(b"committed, row never written").await.unwrap();
        let committed = blob.finish().await.unwrap();
        server.state.blobs.commit(&server.state.db, vec![blob]).await.unwrap();

        let now = gc::collect(&server.state.blobs, &server.state.db, now_ms(), grace).await.unwrap();
        assert_eq!((now.adopted, now.deleted), (1, 1), "{backend:?}");
        assert!(!server.state.blobs.exists(&old).await.unwrap(), "{backend:?}");
        assert!(server.state.blobs.exists(&young).await.unwrap(), "an upload a moment old was collected");
        assert!(server.state.blobs.exists(&committed).await.unwrap());

        let later = server.collect_garbage_after_grace().await;
        assert_eq!((later.adopted, later.deleted), (1, 2), "{backend:?}");
        assert_eq!(local_blobs(&server), 0, "{backend:?}");
    }
}

#[tokio::test]
async fn a_server_restarted_after_a_crash_removes_its_dead_staging_directory() {
    let server = TestServer::start(Backend::Sqlite).await;
    let staging = server.state.blobs.staging_dir().to_path_buf();
    let mut blob = server.state.blobs.begin().await.unwrap();
    blob.write(b"half an upload").await.unwrap();
    // A crash: the temp file stays and the lock is released by the dying process.
    std::mem::forget(blob);
    let dead_copy = server.dir.join("tmp").join(uuid::Uuid::new_v4().to_string());
    copy_dir(&staging, &dead_copy);
    let server = server.restart().await;
    assert!(!dead_copy.exists(), "a dead server's staging directory outlived a start-up");
    assert_eq!(server.state.blobs.temp_files(), 0);
    let dirs: Vec<_> = std::fs::read_dir(server.dir.join("tmp")).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(dirs, [server.state.blobs.staging_dir().to_path_buf()]);
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

// --- S3 ----------------------------------------------------------------------------------

/// The throwaway S3 server's endpoint (`scripts/s3-server.sh`); with `TESSERA_REQUIRE_S3=1`
/// (the test script sets it) a missing one fails the test instead of skipping it.
fn s3_endpoint() -> Option<String> {
    match std::env::var("TESSERA_TEST_S3_ENDPOINT") {
        Ok(endpoint) => Some(endpoint),
        Err(_) if std::env::var("TESSERA_REQUIRE_S3").as_deref() == Ok("1") => {
            panic!("TESSERA_REQUIRE_S3=1 but TESSERA_TEST_S3_ENDPOINT is not set; run scripts/s3-server.sh start")
        }
        Err(_) => {
            eprintln!("note: TESSERA_TEST_S3_ENDPOINT not set; skipping the S3 blob store");
            None
        }
    }
}

/// A new, empty bucket for one test.
async fn fresh_bucket(endpoint: &str) -> String {
    let bucket = format!("t-{}", uuid::Uuid::new_v4().simple());
    let response = reqwest::Client::new().put(format!("{endpoint}/{bucket}")).send().await.unwrap();
    assert!(response.status().is_success(), "create bucket: {}", response.text().await.unwrap());
    bucket
}

fn use_s3(config: &mut Config, endpoint: &str, bucket: &str) {
    config.blob_store = Some(format!("s3://{bucket}/tessera"));
    config.s3_endpoint = Some(endpoint.to_string());
    config.s3_region = Some("us-east-1".into());
    config.s3_access_key_id = Some("testing".into());
    config.s3_secret_access_key = Some("testing".into());
    config.jwt_secret = Some("s3-test-servers-share-this-jwt-secret".into());
}

#[tokio::test]
async fn two_servers_share_an_s3_bucket_for_models_datasets_and_workers() {
    let Some(endpoint) = s3_endpoint() else { return };
    for backend in backends() {
        let bucket = fresh_bucket(&endpoint).await;
        let first = TestServer::start_tweaked(backend, |c| use_s3(c, &endpoint, &bucket)).await;
        assert_eq!(first.state.blobs.kind(), Kind::S3);
        // Its own data directory (own staging), the same database and bucket.
        let other_dir = tempfile::tempdir().unwrap();
        let second = second_server(&first, |c| c.data_dir = other_dir.path().to_path_buf()).await;
        let token = first.admin().await;

        let model = upload_model(&first, &token, "tiny").await;
        let id = model["id"].as_str().unwrap();
        // The worker holds a replica of the model, so it may download the model's files.
        let deployment = json!({"name": "embedder", "model": "tiny", "replicas": 1});
        assert_eq!(first.post(&token, "/deployments", deployment).await.status(), 201);
        let (_, worker_secret) = second.register_worker("w1").await;
        let claimed = second.post(&worker_secret, "/agent/claim", json!({"kinds": ["serve"]})).await;
        assert_eq!(claimed.status(), 200, "{backend:?}");
        for (path, bytes) in tiny_model() {
            let user = second.get(&token, &format!("/models/{id}/files/{path}")).await;
            assert_eq!(user.status(), 200, "{backend:?} {path}");
            assert_eq!(&user.bytes().await.unwrap()[..], &bytes[..], "{path} round-trips through S3");
            // Workers download through the server, whichever store it uses.
            let agent = second.get(&worker_secret, &format!("/agent/models/{id}/files/{path}")).await;
            assert_eq!(agent.status(), 200, "{backend:?} {path}");
            assert_eq!(&agent.bytes().await.unwrap()[..], &bytes[..]);
        }
        let wine = upload_dataset(&second, &token, "wine", WINE).await;
        let wine_id = wine["id"].as_str().unwrap();
        let fetched = first.get(&token, &format!("/datasets/{wine_id}/file")).await;
        assert_eq!(fetched.text().await.unwrap(), WINE);
        assert_eq!(local_blobs(&first) + local_blobs(&second), 0, "S3 blobs landed on local disk");
        assert_eq!(first.state.blobs.temp_files() + second.state.blobs.temp_files(), 0);

        // Deleted on one server, collected by the other after the grace period.
        assert_eq!(first.delete(&token, "/deployments/embedder").await.status(), 204);
        assert_eq!(first.delete(&token, &format!("/models/{id}")).await.status(), 204);
        let digests: Vec<String> =
            model["files"].as_array().unwrap().iter().map(|f| f["digest"].as_str().unwrap().to_string()).collect();
        for digest in &digests {
            assert!(second.state.blobs.exists(digest).await.unwrap(), "{backend:?}");
        }
        let collected = second.collect_garbage_after_grace().await;
        assert_eq!(collected.deleted, digests.len(), "{backend:?}");
        for digest in &digests {
            assert!(!first.state.blobs.exists(digest).await.unwrap(), "{backend:?}");
        }
        let still = first.get(&token, &format!("/datasets/{wine_id}/file")).await;
        assert_eq!(still.text().await.unwrap(), WINE);
    }
}

#[tokio::test]
async fn s3_orphans_are_collected_after_the_grace_period() {
    let Some(endpoint) = s3_endpoint() else { return };
    let bucket = fresh_bucket(&endpoint).await;
    let server = TestServer::start_tweaked(Backend::Sqlite, |c| use_s3(c, &endpoint, &bucket)).await;
    // Bytes in the bucket that no ledger row knows: a crash between the upload and the row.
    let bytes = b"uploaded, then the server died".to_vec();
    let digest = sha256(&bytes);
    let key = format!("{endpoint}/{bucket}/tessera/blobs/sha256/{}", digest.strip_prefix("sha256:").unwrap());
    let put = reqwest::Client::new().put(&key).body(bytes).send().await.unwrap();
    assert!(put.status().is_success());
    assert!(server.state.blobs.exists(&digest).await.unwrap());

    let grace = Duration::from_secs(server.config.blob_grace_secs);
    let now = gc::collect(&server.state.blobs, &server.state.db, now_ms(), grace).await.unwrap();
    assert_eq!((now.adopted, now.deleted), (0, 0));
    let later = server.collect_garbage_after_grace().await;
    assert_eq!((later.adopted, later.deleted), (1, 1));
    assert!(!server.state.blobs.exists(&digest).await.unwrap());
}

#[tokio::test]
async fn a_missing_bucket_stops_the_start_up_with_a_clear_error() {
    let Some(endpoint) = s3_endpoint() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut config = Config::with_data_dir(dir.path().to_path_buf());
    use_s3(&mut config, &endpoint, "no-such-bucket-here");
    let error = tessera_server::state::AppState::open(config).await.err().expect("started without its bucket");
    assert!(error.to_string().contains("blob store"), "{error}");
    let mut config = Config::with_data_dir(dir.path().to_path_buf());
    config.blob_store = Some("ftp://elsewhere".into());
    let error = tessera_server::state::AppState::open(config).await.err().expect("started with a bad setting");
    assert!(error.to_string().contains("TESSERA_BLOB_STORE"), "{error}");
}
