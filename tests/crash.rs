//! Crash safety of the data directory, against the real `tessera-server` binary (issue 14):
//! a server killed with SIGKILL in the middle of uploads loses nothing it answered 201
//! for, never has a half-written file under a digest, removes the dead staging directory
//! when it starts again, and collects what the crash left once the grace period passed.

use std::collections::BTreeSet;
use std::io::Write;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tessera_tests::{binary, eventually, Process};

/// Short enough for a test to wait it out; the collector then runs every 10 s.
const GRACE_SECS: u64 = 6;

/// The server on a free loopback port over SQLite in `data_dir`; returns it and its URL.
fn start_server(data_dir: &Path) -> (Process, String) {
    let mut process = Process::spawn(
        Command::new(binary("tessera-server"))
            .args(["--bind", "127.0.0.1:0", "--data-dir"])
            .arg(data_dir)
            .env(
                "TESSERA_WORKER_TOKEN",
                "crash-test-worker-token-of-32-bytes-or-more",
            )
            .env("TESSERA_BLOB_GRACE_SECS", GRACE_SECS.to_string())
            .env_remove("TESSERA_ADMIN_PASSWORD")
            .env_remove("TESSERA_DATABASE_URL")
            .env_remove("TESSERA_BLOB_STORE"),
    );
    let line = process.wait_for_line("listening on http://", Duration::from_secs(60));
    let url = line.rsplit(' ').next().unwrap().trim().to_string();
    (process, url)
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Every file under the local blob store, by name.
fn blob_files(data_dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(data_dir.join("blobs/sha256"))
        .map(|dir| {
            dir.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Asserts that each file in the blob store holds exactly the bytes its name is the
/// digest of: nothing half-written, nothing torn, is ever found under a digest.
fn assert_blobs_whole(data_dir: &Path) {
    for name in blob_files(data_dir) {
        let bytes = std::fs::read(data_dir.join("blobs/sha256").join(&name)).unwrap();
        assert_eq!(
            sha256_hex(&bytes),
            name,
            "blob {name} does not hold the bytes of its digest"
        );
    }
}

/// Files being uploaded: everything in the staging directories under `tmp/`.
fn staged_files(data_dir: &Path) -> Vec<(PathBuf, u64)> {
    let mut files = Vec::new();
    for dir in std::fs::read_dir(data_dir.join("tmp"))
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
    {
        for file in std::fs::read_dir(dir.path())
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok())
        {
            if file.file_name() != ".lock" {
                files.push((file.path(), file.metadata().map(|m| m.len()).unwrap_or(0)));
            }
        }
    }
    files
}

fn staging_dirs(data_dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(data_dir.join("tmp"))
        .map(|dir| {
            dir.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// A small CSV dataset whose bytes differ per `seed`.
fn csv(seed: u64) -> Vec<u8> {
    let mut text = String::from("a,b,label\n");
    for row in 0..50 {
        text.push_str(&format!("{seed},{},{}\n", row * 7 + seed % 13, row % 2));
    }
    text.into_bytes()
}

async fn upload(
    http: &reqwest::Client,
    url: &str,
    token: &str,
    name: &str,
    bytes: Vec<u8>,
) -> reqwest::Result<u16> {
    let form = reqwest::multipart::Form::new()
        .text("name", name.to_string())
        .part(
            "file",
            reqwest::multipart::Part::bytes(bytes).file_name("data.csv"),
        );
    let response = http
        .post(format!("{url}/api/v1/datasets"))
        .bearer_auth(token)
        .multipart(form)
        .send()
        .await?;
    Ok(response.status().as_u16())
}

/// The datasets the server lists: name → digest.
async fn datasets(http: &reqwest::Client, url: &str, token: &str) -> Vec<(String, String)> {
    let response = http
        .get(format!("{url}/api/v1/datasets"))
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    body.as_array()
        .unwrap()
        .iter()
        .map(|d| {
            (
                d["name"].as_str().unwrap().to_string(),
                d["digest"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// Begins a dataset upload over a raw connection that announces `total` bytes of body and
/// sends only `sent` of them: an upload in the middle of its transfer.
fn begin_partial_upload(url: &str, token: &str, total: usize, sent: usize) -> TcpStream {
    let address = url.trim_start_matches("http://");
    let mut stream = TcpStream::connect(address).unwrap();
    let boundary = "crash-test-boundary";
    let head = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"name\"\r\n\r\npartial\r\n\
         --{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"big.csv\"\r\n\
         Content-Type: text/csv\r\n\r\nx\n"
    );
    let request = format!(
        "POST /api/v1/datasets HTTP/1.1\r\nHost: {address}\r\nAuthorization: Bearer {token}\r\n\
         Content-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {total}\r\n\r\n{head}"
    );
    stream.write_all(request.as_bytes()).unwrap();
    let row = b"1\n".repeat(32 * 1024);
    let mut body = head.len();
    while body < sent {
        stream.write_all(&row).unwrap();
        body += row.len();
    }
    stream.flush().unwrap();
    stream
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_server_killed_mid_upload_loses_nothing_committed_and_collects_what_the_crash_left() {
    let data = tempfile::tempdir().unwrap();
    let data_dir = data.path();
    let (mut server, url) = start_server(data_dir);
    let password = server
        .wait_for_line("with password: ", Duration::from_secs(5))
        .rsplit(' ')
        .next()
        .unwrap()
        .to_string();
    let http = reqwest::Client::new();
    let login = http
        .post(format!("{url}/api/v1/auth/login"))
        .json(&json!({"username": "admin", "password": password}))
        .send()
        .await
        .unwrap();
    assert_eq!(login.status(), 200);
    let token = login.json::<Value>().await.unwrap()["token"]
        .as_str()
        .unwrap()
        .to_string();

    // Committed before anything goes wrong.
    let mut committed: Vec<(String, String)> = Vec::new();
    for i in 0..3 {
        let bytes = csv(i);
        assert_eq!(
            upload(&http, &url, &token, &format!("before-{i}"), bytes.clone())
                .await
                .unwrap(),
            201
        );
        committed.push((
            format!("before-{i}"),
            format!("sha256:{}", sha256_hex(&bytes)),
        ));
    }

    // One upload stopped in the middle of its transfer, 8 of its 64 MiB on the disk.
    let partial = begin_partial_upload(&url, &token, 64 << 20, 8 << 20);
    let staged = eventually(
        "the partial upload reaches the staging directory",
        Duration::from_secs(30),
        || async {
            let files = staged_files(data_dir);
            files
                .iter()
                .any(|(_, size)| *size > 1 << 20)
                .then_some(files)
        },
    )
    .await;

    // Uploads in full flow while the server dies.
    let answered: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let mut uploaders = Vec::new();
    for writer in 0..6u64 {
        let (http, url, token, answered) =
            (http.clone(), url.clone(), token.clone(), answered.clone());
        uploaders.push(tokio::spawn(async move {
            for i in 0.. {
                let (name, bytes) = (
                    format!("during-{writer}-{i}"),
                    csv(1000 + writer * 1000 + i),
                );
                let digest = format!("sha256:{}", sha256_hex(&bytes));
                match upload(&http, &url, &token, &name, bytes).await {
                    Ok(201) => answered.lock().unwrap().push((name, digest)),
                    Ok(status) => panic!("upload {name} answered {status}"),
                    Err(_) => return,
                }
            }
        }));
    }
    eventually(
        "uploads are answered while the server runs",
        Duration::from_secs(60),
        || async { (answered.lock().unwrap().len() >= 12).then_some(()) },
    )
    .await;
    server.kill();
    let killed_at = Instant::now();
    for uploader in uploaders {
        uploader.await.unwrap();
    }
    drop(partial);
    committed.extend(answered.lock().unwrap().iter().cloned());
    let dead_staging = staging_dirs(data_dir);
    assert!(
        staged.iter().all(|(path, _)| path.exists()),
        "a SIGKILL leaves the staging files behind"
    );

    // What a crash between a blob's rename into place and its row leaves: bytes under their
    // digest that no row names (planted, as the moment cannot be hit on demand).
    let orphan = b"bytes a crash left without a row".to_vec();
    let orphan_name = sha256_hex(&orphan);
    std::fs::write(data_dir.join("blobs/sha256").join(&orphan_name), &orphan).unwrap();

    let (server, url) = start_server(data_dir);
    let listed = datasets(&http, &url, &token).await;
    for (name, digest) in &committed {
        assert!(
            listed.contains(&(name.clone(), digest.clone())),
            "{name} was answered 201 but is gone: {listed:?}"
        );
    }
    // Nothing half-written is under a digest; each listed dataset's bytes are there.
    assert_blobs_whole(data_dir);
    let blobs = blob_files(data_dir);
    for (name, digest) in &listed {
        assert!(
            blobs.contains(digest.trim_start_matches("sha256:")),
            "{name}'s blob is missing"
        );
    }
    assert!(
        listed.iter().all(|(name, _)| name != "partial"),
        "the interrupted upload was registered"
    );
    // The dead server's staging directory (with the partial file) went at start-up.
    assert!(
        staged.iter().all(|(path, _)| !path.exists()),
        "the dead server's uploads are still staged"
    );
    let now_staging = staging_dirs(data_dir);
    assert_eq!(now_staging.len(), 1, "{now_staging:?}");
    assert!(
        dead_staging.is_disjoint(&now_staging),
        "{dead_staging:?} {now_staging:?}"
    );
    // Within the grace period the crash's leftovers stay (an upload may be about to name them).
    if killed_at.elapsed() < Duration::from_secs(GRACE_SECS - 1) {
        assert!(
            blob_files(data_dir).contains(&orphan_name),
            "collected before the grace period"
        );
    }

    // After it, the collector on the restarted server takes every blob no row names.
    let referenced: BTreeSet<String> = listed
        .iter()
        .map(|(_, digest)| digest.trim_start_matches("sha256:").to_string())
        .collect();
    eventually(
        "the crash's orphans are collected",
        Duration::from_secs(40),
        || async { (blob_files(data_dir) == referenced).then_some(()) },
    )
    .await;
    assert_eq!(datasets(&http, &url, &token).await, listed);
    assert_blobs_whole(data_dir);
    drop(server);
}
