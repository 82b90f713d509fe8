//! Fair use and bounded uploads over real HTTP (issue 14): per-user quotas, a queue that
//! one user's flood cannot starve the others with, log appends that never collide, and
//! uploads whose every part the server holds only up to a limit.

mod support;

use serde_json::{json, Value};
use support::{backends, tiny_model, Backend, TestServer};
use tessera_server::store::jobs as queue;

/// The `{"error":{"code","message"}}` body of a rejection, asserting its shape.
async fn error_body(response: reqwest::Response) -> Value {
    let text = response.text().await.unwrap();
    let body: Value =
        serde_json::from_str(&text).unwrap_or_else(|_| panic!("not the error shape: {text}"));
    assert!(
        body["error"]["code"].is_string() && body["error"]["message"].is_string(),
        "not the error shape: {body}"
    );
    body
}

async fn upload_dataset(
    server: &TestServer,
    token: &str,
    name: &str,
    file_name: &str,
    bytes: Vec<u8>,
) -> reqwest::Response {
    let form = reqwest::multipart::Form::new()
        .text("name", name.to_string())
        .part(
            "file",
            reqwest::multipart::Part::bytes(bytes).file_name(file_name.to_string()),
        );
    server
        .http
        .post(server.api("/datasets"))
        .bearer_auth(token)
        .multipart(form)
        .send()
        .await
        .unwrap()
}

async fn prefetch(server: &TestServer, token: &str, name: &str) -> reqwest::Response {
    server
        .post(
            token,
            "/jobs",
            json!({"name": name, "spec": {"kind": "prefetch", "model": "tiny"}}),
        )
        .await
}

async fn claim(server: &TestServer, secret: &str) -> Option<String> {
    let response = server
        .post(secret, "/agent/claim", json!({"kinds": ["prefetch"]}))
        .await;
    if response.status() != 200 {
        return None;
    }
    let body: Value = response.json().await.ok()?;
    body["job_id"].as_str().map(str::to_string)
}

// --- Fair queue ----------------------------------------------------------------------------

#[tokio::test]
async fn one_users_flood_does_not_starve_the_next_users_job() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let alice = server.user(&admin, "alice").await;
        let bob = server.user(&admin, "bob").await;
        for token in [&alice, &bob] {
            assert_eq!(
                server.upload_model(token, "tiny", tiny_model())
                    .await
                    .status(),
                201
            );
        }
        let mut flood = Vec::new();
        for i in 0..6 {
            let job: Value = prefetch(&server, &alice, &format!("flood {i}"))
                .await
                .json()
                .await
                .unwrap();
            flood.push(job["id"].as_str().unwrap().to_string());
        }
        let bobs: Value = prefetch(&server, &bob, "mine").await.json().await.unwrap();
        let bobs = bobs["id"].as_str().unwrap().to_string();

        let (_, secret) = server.register_worker("w0").await;
        // Nobody runs anything: the oldest job goes first, alice's.
        assert_eq!(
            claim(&server, &secret).await.as_deref(),
            Some(flood[0].as_str()),
            "{backend:?}"
        );
        // Alice now runs one and bob none: bob's job is next, ahead of alice's older five.
        assert_eq!(
            claim(&server, &secret).await.as_deref(),
            Some(bobs.as_str()),
            "{backend:?}"
        );
        // Both run one: alice's queue goes on oldest first.
        assert_eq!(
            claim(&server, &secret).await.as_deref(),
            Some(flood[1].as_str()),
            "{backend:?}"
        );
    }
}

// --- Quotas ----------------------------------------------------------------------------------

#[tokio::test]
async fn quotas_refuse_jobs_replicas_and_storage_past_the_limit_naming_it() {
    for backend in backends() {
        let model_bytes: u64 = tiny_model()
            .iter()
            .map(|(_, bytes)| bytes.len() as u64)
            .sum();
        let server = TestServer::start_tweaked(backend, |config| {
            config.quota_jobs = 2;
            config.quota_replicas = 3;
            config.quota_storage_bytes = model_bytes + 100;
        })
        .await;
        let admin = server.admin().await;
        let alice = server.user(&admin, "alice").await;
        assert_eq!(
            server.upload_model(&alice, "tiny", tiny_model())
                .await
                .status(),
            201
        );

        // Storage: a second copy would pass the quota; a small dataset still fits.
        let response = server.upload_model(&alice, "tiny2", tiny_model()).await;
        assert_eq!(response.status(), 403, "{backend:?}");
        let body = error_body(response).await;
        assert_eq!(body["error"]["code"], "quota_exceeded");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("TESSERA_QUOTA_STORAGE_BYTES")
                && message.contains(&model_bytes.to_string()),
            "{message}"
        );
        let response = upload_dataset(
            &server,
            &alice,
            "big",
            "big.csv",
            format!("x\n{}\n", "1".repeat(200)).into_bytes(),
        )
        .await;
        assert_eq!(response.status(), 403, "{backend:?}");
        assert_eq!(
            upload_dataset(&server, &alice, "small", "s.csv", b"x\n1\n".to_vec())
                .await
                .status(),
            201
        );

        // Jobs: two queued, the third refused until one ends.
        let first: Value = prefetch(&server, &alice, "one").await.json().await.unwrap();
        assert_eq!(prefetch(&server, &alice, "two").await.status(), 201);
        let response = prefetch(&server, &alice, "three").await;
        assert_eq!(response.status(), 403, "{backend:?}");
        let message = error_body(response).await["error"]["message"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(
            message.contains("TESSERA_QUOTA_JOBS") && message.contains("You have 2 jobs"),
            "{message}"
        );
        // A profile job is a job like the others.
        let response = server.post(&alice, "/models/tiny/profiles", json!({})).await;
        assert_eq!(response.status(), 403, "{backend:?}");
        assert_eq!(error_body(response).await["error"]["code"], "quota_exceeded");
        let cancel = format!("/jobs/{}/cancel", first["id"].as_str().unwrap());
        assert_eq!(server.post(&alice, &cancel, json!({})).await.status(), 200);
        assert_eq!(prefetch(&server, &alice, "three").await.status(), 201);

        // Replicas: all deployments of one user together.
        let deploy = |name: &str, replicas: u32| json!({"name": name, "model": "tiny", "replicas": replicas});
        assert_eq!(
            server
                .post(&alice, "/deployments", deploy("a", 2))
                .await
                .status(),
            201
        );
        let response = server.post(&alice, "/deployments", deploy("b", 2)).await;
        assert_eq!(response.status(), 403, "{backend:?}");
        let message = error_body(response).await["error"]["message"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(
            message.contains("TESSERA_QUOTA_REPLICAS") && message.contains("2 in use"),
            "{message}"
        );
        assert_eq!(
            server
                .post(&alice, "/deployments", deploy("b", 1))
                .await
                .status(),
            201
        );
        let scale = server
            .http
            .patch(server.api("/deployments/a"))
            .bearer_auth(&alice)
            .json(&json!({"replicas": 3}));
        let response = scale.send().await.unwrap();
        assert_eq!(response.status(), 403, "{backend:?}");
        error_body(response).await;

        // Admins run the server and are not bound.
        assert_eq!(
            server.upload_model(&admin, "tiny", tiny_model())
                .await
                .status(),
            201
        );
        assert_eq!(
            server.upload_model(&admin, "tiny2", tiny_model())
                .await
                .status(),
            201
        );
    }
}

#[tokio::test]
async fn a_data_parallel_job_counts_once_against_the_jobs_quota() {
    for backend in backends() {
        let server = TestServer::start_tweaked(backend, |config| config.quota_jobs = 1).await;
        let admin = server.admin().await;
        let alice = server.user(&admin, "alice").await;
        let mut csv = String::from("f0,label\n");
        for i in 0..20 {
            csv.push_str(&format!("{},{}\n", i % 7, i % 2));
        }
        let response = upload_dataset(&server, &alice, "d", "d.csv", csv.into_bytes()).await;
        assert_eq!(response.status(), 201, "{backend:?}");
        let dataset = response.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_string();
        let gang = |name: &str| {
            json!({"name": name, "model": {"kind": "mlp", "hidden": [4]}, "dataset": dataset,
                "task": {"type": "classification", "label_column": "label", "validation_split": 0.25},
                "optimizer": {"type": "sgd"}, "batch_size": 4, "max_steps": 10, "eval_every": 5,
                "checkpoint_every": 5, "lr_schedule": {"type": "constant", "lr": 0.1}, "seed": 1,
                "parallel": {"ranks": [{"device": "cpu"}, {"device": "cpu"}, {"device": "cpu"}]}})
        };
        // Three ranks are one job the user asked for.
        let response = server.post(&alice, "/jobs", gang("first")).await;
        assert_eq!(response.status(), 201, "{backend:?}: {}", response.text().await.unwrap());
        let response = server.post(&alice, "/jobs", gang("second")).await;
        assert_eq!(response.status(), 403, "{backend:?}");
        let message = error_body(response).await["error"]["message"].as_str().unwrap().to_string();
        assert!(message.contains("TESSERA_QUOTA_JOBS") && message.contains("You have 1 jobs"), "{message}");
    }
}

#[tokio::test]
async fn a_user_at_the_storage_quota_cannot_submit_training_jobs() {
    for backend in backends() {
        let mut csv = String::from("f0,label\n");
        for i in 0..20 {
            csv.push_str(&format!("{},{}\n", i % 7, i % 2));
        }
        let size = csv.len() as u64;
        let server = TestServer::start_tweaked(backend, |config| config.quota_storage_bytes = 2 * size).await;
        let admin = server.admin().await;
        let alice = server.user(&admin, "alice").await;
        let response = upload_dataset(&server, &alice, "d", "d.csv", csv.clone().into_bytes()).await;
        assert_eq!(response.status(), 201, "{backend:?}");
        let dataset = response.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_string();
        let train = |name: &str, dataset: &str, parallel: bool| {
            let mut job = json!({"name": name, "model": {"kind": "mlp", "hidden": [4]}, "dataset": dataset,
                "task": {"type": "classification", "label_column": "label", "validation_split": 0.25},
                "optimizer": {"type": "sgd"}, "batch_size": 4, "max_steps": 10, "eval_every": 5,
                "checkpoint_every": 5, "lr_schedule": {"type": "constant", "lr": 0.1}, "seed": 1});
            if parallel {
                job["parallel"] = json!({"ranks": [{"device": "cpu"}, {"device": "cpu"}]});
            }
            job
        };
        // Below the quota a training job is queued, its checkpoints to come.
        let response = server.post(&alice, "/jobs", train("below", &dataset, false)).await;
        assert_eq!(response.status(), 201, "{backend:?}: {}", response.text().await.unwrap());

        // A second copy fills the quota exactly: an upload that fits, but no room is left
        // for checkpoints, which a running job uploads unrefused.
        let response = upload_dataset(&server, &alice, "d2", "d2.csv", csv.clone().into_bytes()).await;
        assert_eq!(response.status(), 201, "{backend:?}");
        for parallel in [false, true] {
            let response = server.post(&alice, "/jobs", train("at quota", &dataset, parallel)).await;
            assert_eq!(response.status(), 403, "{backend:?}: parallel {parallel}");
            let body = error_body(response).await;
            assert_eq!(body["error"]["code"], "quota_exceeded");
            let message = body["error"]["message"].as_str().unwrap();
            assert!(message.contains("TESSERA_QUOTA_STORAGE_BYTES") && message.contains("checkpoints"), "{message}");
        }
        let jobs: Vec<Value> = server.get(&alice, "/jobs").await.json().await.unwrap();
        assert_eq!(jobs.len(), 1, "{backend:?}: a refused job was queued: {jobs:?}");

        // Admins are not bound, past the quota too.
        let mut theirs = String::new();
        for name in ["a1", "a2", "a3"] {
            let response = upload_dataset(&server, &admin, name, "a.csv", csv.clone().into_bytes()).await;
            assert_eq!(response.status(), 201, "{backend:?}");
            theirs = response.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_string();
        }
        let response = server.post(&admin, "/jobs", train("admin's", &theirs, false)).await;
        assert_eq!(response.status(), 201, "{backend:?}: {}", response.text().await.unwrap());
    }
}

/// The replicas alice's deployments ask for, all together.
async fn replicas_asked(server: &TestServer, token: &str) -> u64 {
    let deployments: Value = server.get(token, "/deployments").await.json().await.unwrap();
    deployments.as_array().unwrap().iter().map(|d| d["replicas"].as_u64().unwrap()).sum()
}

/// Replica jobs alive in the queue (the quota is on these, not only on the counts).
async fn live_replica_jobs(server: &TestServer) -> usize {
    let all = tessera_server::store::Scope::all();
    let deployments = tessera_server::store::deployments::list(&server.state.db, &all).await.unwrap();
    let mut live = 0;
    for deployment in deployments {
        let replicas = tessera_server::store::deployments::replicas(&server.state.db, deployment.id).await.unwrap();
        live += replicas.len();
    }
    live
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_creates_and_scales_cannot_together_pass_the_replica_quota() {
    for backend in backends() {
        let server = TestServer::start_tweaked(backend, |config| config.quota_replicas = 4).await;
        let admin = server.admin().await;
        let alice = server.user(&admin, "alice").await;
        assert_eq!(server.upload_model(&alice, "tiny", tiny_model()).await.status(), 201);

        // Eight creates of two replicas each at once: each alone fits, only two together do.
        let creates = (0..8).map(|i| {
            server.post(&alice, "/deployments", json!({"name": format!("d{i}"), "model": "tiny", "replicas": 2}))
        });
        let statuses: Vec<u16> =
            futures_util::future::join_all(creates).await.iter().map(|r| r.status().as_u16()).collect();
        assert_eq!(statuses.iter().filter(|s| **s == 201).count(), 2, "{backend:?}: {statuses:?}");
        assert!(statuses.iter().all(|s| *s == 201 || *s == 403), "{backend:?}: {statuses:?}");
        assert_eq!(replicas_asked(&server, &alice).await, 4, "{backend:?}");
        assert_eq!(live_replica_jobs(&server).await, 4, "{backend:?}");

        // Down to one replica each; then both scale to three at once: each alone fits.
        let deployments: Value = server.get(&alice, "/deployments").await.json().await.unwrap();
        let names: Vec<String> =
            deployments.as_array().unwrap().iter().map(|d| d["name"].as_str().unwrap().to_string()).collect();
        let scale = |name: &str, replicas: u32| {
            server
                .http
                .patch(server.api(&format!("/deployments/{name}")))
                .bearer_auth(&alice)
                .json(&json!({"replicas": replicas}))
                .send()
        };
        for name in &names {
            assert_eq!(scale(name, 1).await.unwrap().status(), 200, "{backend:?}");
        }
        let scales = futures_util::future::join_all(names.iter().map(|name| scale(name, 3))).await;
        let statuses: Vec<u16> = scales.iter().map(|r| r.as_ref().unwrap().status().as_u16()).collect();
        assert_eq!(statuses.iter().filter(|s| **s == 200).count(), 1, "{backend:?}: {statuses:?}");
        assert_eq!(replicas_asked(&server, &alice).await, 4, "{backend:?}");
        assert_eq!(live_replica_jobs(&server).await, 4, "{backend:?}");
    }
}

// --- Job logs --------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_log_appends_never_collide() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        assert_eq!(
            server.upload_model(&admin, "tiny", tiny_model())
                .await
                .status(),
            201
        );
        let job: Value = prefetch(&server, &admin, "chatty")
            .await
            .json()
            .await
            .unwrap();
        let job: uuid::Uuid = job["id"].as_str().unwrap().parse().unwrap();
        let (writers, batches, lines) = (16, 10, 3);
        let mut tasks = Vec::new();
        for writer in 0..writers {
            let db = server.state.db.clone();
            tasks.push(tokio::spawn(async move {
                for batch in 0..batches {
                    let text: Vec<String> = (0..lines)
                        .map(|l| format!("w{writer} b{batch} l{l}"))
                        .collect();
                    queue::append_logs(&db, job, &text, 0).await?;
                }
                Ok::<_, tessera_server::store::StoreError>(())
            }));
        }
        for task in tasks {
            task.await
                .unwrap()
                .unwrap_or_else(|e| panic!("{backend:?}: an append failed: {e}"));
        }
        let logged = queue::logs(&server.state.db, job, 0, 10_000).await.unwrap();
        let total = (writers * batches * lines) as i64;
        assert_eq!(logged.len() as i64, total, "{backend:?}");
        assert!(
            logged.iter().map(|l| l.seq).eq(1..=total),
            "{backend:?}: sequence numbers are 1..={total}"
        );
        // Each batch keeps its lines together and in order.
        for window in logged.chunks(lines) {
            let prefix = window[0].line.rsplit_once(' ').unwrap().0;
            assert!(
                window
                    .iter()
                    .enumerate()
                    .all(|(i, l)| l.line == format!("{prefix} l{i}")),
                "{backend:?}"
            );
        }
    }
}

// --- Uploads ---------------------------------------------------------------------------------

/// A raw `multipart/form-data` body: a preamble, then parts of (extra header lines,
/// `Content-Disposition` field name, optional file name, bytes).
fn raw_form(preamble: &[u8], parts: &[(&str, &str, Option<&str>, Vec<u8>)]) -> (String, Vec<u8>) {
    let boundary = "hostile-fair-boundary";
    let mut body = preamble.to_vec();
    for (extra, name, file_name, bytes) in parts {
        body.extend_from_slice(format!("--{boundary}\r\n").as_bytes());
        let file = file_name
            .map(|f| format!("; filename=\"{f}\""))
            .unwrap_or_default();
        body.extend_from_slice(
            format!("Content-Disposition: form-data; name=\"{name}\"{file}\r\n{extra}\r\n")
                .as_bytes(),
        );
        body.extend_from_slice(bytes);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    (format!("multipart/form-data; boundary={boundary}"), body)
}

async fn post_raw(
    server: &TestServer,
    token: &str,
    path: &str,
    (content_type, body): (String, Vec<u8>),
) -> reqwest::Response {
    server
        .http
        .post(server.api(path))
        .bearer_auth(token)
        .header("content-type", content_type)
        .body(body)
        .send()
        .await
        .unwrap()
}

/// The tiny model's parts, for raw bodies.
fn model_parts(name: &str) -> Vec<(&'static str, &'static str, Option<String>, Vec<u8>)> {
    let mut parts = vec![("", "name", None, name.as_bytes().to_vec())];
    for (path, bytes) in tiny_model() {
        parts.push(("", "files", Some(path), bytes));
    }
    parts
}

fn as_raw<'p>(
    parts: &'p [(&'static str, &'static str, Option<String>, Vec<u8>)],
) -> Vec<(&'p str, &'p str, Option<&'p str>, Vec<u8>)> {
    parts
        .iter()
        .map(|(extra, name, file, bytes)| (*extra, *name, file.as_deref(), bytes.clone()))
        .collect()
}

async fn assert_413(response: reqwest::Response, needle: &str) {
    assert_eq!(response.status(), 413, "{needle}");
    let body = error_body(response).await;
    assert_eq!(body["error"]["code"], "payload_too_large");
    assert!(
        body["error"]["message"].as_str().unwrap().contains(needle),
        "{body}"
    );
}

#[tokio::test]
async fn text_fields_part_headers_part_counts_and_preambles_are_capped() {
    let server = TestServer::start(Backend::Sqlite).await;
    let admin = server.admin().await;
    let long = "n".repeat(1 << 20);

    assert_413(
        server.upload_model(&admin, &long, tiny_model()).await,
        "'name'",
    )
    .await;
    assert_413(
        upload_dataset(&server, &admin, &long, "d.csv", b"x\n1\n".to_vec()).await,
        "'name'",
    )
    .await;

    // A part header of 64 KiB (an extra header line), before the file's bytes.
    let mut parts = model_parts("padded");
    let pad = format!("X-Pad: {}\r\n", "p".repeat(64 << 10));
    let raw: Vec<_> = as_raw(&parts)
        .into_iter()
        .enumerate()
        .map(|(i, (_, name, file, bytes))| {
            (if i == 1 { pad.as_str() } else { "" }, name, file, bytes)
        })
        .collect();
    assert_413(
        post_raw(&server, &admin, "/models", raw_form(b"", &raw)).await,
        "headers",
    )
    .await;

    // A megabyte before the first boundary.
    let raw = as_raw(&parts);
    assert_413(
        post_raw(
            &server,
            &admin,
            "/models",
            raw_form(&vec![b'x'; 1 << 20], &raw),
        )
        .await,
        "headers",
    )
    .await;

    // Hundreds of parts, each small and harmless on its own.
    for _ in 0..200 {
        parts.push(("", "name", None, b"many".to_vec()));
    }
    assert_413(
        post_raw(&server, &admin, "/models", raw_form(b"", &as_raw(&parts))).await,
        "parts",
    )
    .await;

    // A config.json padded past what validation reads whole (valid JSON all the same).
    let mut padded = tiny_model();
    let (_, config) = padded.iter_mut().find(|(path, _)| path == "config.json").unwrap();
    let mut value: Value = serde_json::from_slice(config).unwrap();
    value["pad"] = json!("a".repeat(2 << 20));
    *config = serde_json::to_vec(&value).unwrap();
    assert_413(server.upload_model(&admin, "padded-config", padded).await, "config.json").await;

    // The same model within the limits is accepted, so the limits leave real uploads be.
    let fine = model_parts("fine");
    let raw = as_raw(&fine);
    assert_eq!(
        post_raw(&server, &admin, "/models", raw_form(b"", &raw))
            .await
            .status(),
        201
    );
}

#[tokio::test]
async fn checkpoint_uploads_are_capped_like_the_others() {
    let server = TestServer::start(Backend::Sqlite).await;
    let admin = server.admin().await;
    let response = upload_dataset(&server, &admin, "d", "d.csv", b"f0,label\n1,0\n2,1\n3,0\n4,1\n".to_vec()).await;
    assert_eq!(response.status(), 201);
    let dataset = response.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_string();
    let train = json!({"name": "t", "model": {"kind": "mlp", "hidden": [4]}, "dataset": dataset,
        "task": {"type": "classification", "label_column": "label", "validation_split": 0.25},
        "optimizer": {"type": "sgd"}, "batch_size": 2, "max_steps": 10, "eval_every": 5, "checkpoint_every": 5,
        "lr_schedule": {"type": "constant", "lr": 0.1}, "seed": 1});
    assert_eq!(server.post(&admin, "/jobs", train).await.status(), 201);
    let (_, secret) = server.register_worker("w0").await;
    let claimed: Value = server.post(&secret, "/agent/claim", json!({"kinds": ["train"]})).await.json().await.unwrap();
    let path = format!("/agent/jobs/{}/checkpoints", claimed["job_id"].as_str().unwrap());

    let step = |value: Vec<u8>| ("", "step", None, value);
    let long_step = raw_form(b"", &[step(vec![b'1'; 1 << 20]), ("", "files", Some("w.bin"), b"w".to_vec())]);
    assert_413(post_raw(&server, &secret, &path, long_step).await, "'step'").await;
    let pad = format!("X-Pad: {}\r\n", "p".repeat(64 << 10));
    let padded = raw_form(b"", &[step(b"5".to_vec()), (pad.as_str(), "files", Some("w.bin"), b"w".to_vec())]);
    assert_413(post_raw(&server, &secret, &path, padded).await, "headers").await;
    let names: Vec<String> = (0..200).map(|i| format!("f{i}.bin")).collect();
    let mut many = vec![step(b"5".to_vec())];
    many.extend(names.iter().map(|name| ("", "files", Some(name.as_str()), b"w".to_vec())));
    assert_413(post_raw(&server, &secret, &path, raw_form(b"", &many)).await, "parts").await;

    let fine = raw_form(b"", &[step(b"5".to_vec()), ("", "files", Some("w.bin"), b"w".to_vec())]);
    assert_eq!(post_raw(&server, &secret, &path, fine).await.status(), 201);
}

#[tokio::test]
async fn jsonl_lines_and_csv_records_have_a_length_cap() {
    let server = TestServer::start(Backend::Sqlite).await;
    let admin = server.admin().await;
    let long = "w".repeat(2 << 20);
    let jsonl =
        format!("{{\"text\":\"short\",\"label\":1}}\n{{\"text\":\"{long}\",\"label\":2}}\n");
    assert_413(
        upload_dataset(&server, &admin, "lines", "d.jsonl", jsonl.into_bytes()).await,
        "line 2",
    )
    .await;
    // One CSV record over many physical lines (a quoted field with newlines).
    let field = "a\n".repeat(1 << 20);
    let csv = format!("text,label\nshort,1\n\"{field}\",2\n");
    assert_413(
        upload_dataset(&server, &admin, "records", "d.csv", csv.into_bytes()).await,
        "longer than",
    )
    .await;
    // Rows under the cap are fine.
    let ok = format!("{{\"text\":\"{}\",\"label\":1}}\n", "w".repeat(100_000));
    assert_eq!(
        upload_dataset(&server, &admin, "ok", "d.jsonl", ok.into_bytes())
            .await
            .status(),
        201
    );
}

/// The tiny model with its safetensors header replaced by `header` (prefix fixed up).
fn with_weights_header(header: Vec<u8>, data_len: usize) -> Vec<(String, Vec<u8>)> {
    let mut weights = (header.len() as u64).to_le_bytes().to_vec();
    weights.extend_from_slice(&header);
    weights.resize(weights.len() + data_len, 0);
    tiny_model()
        .into_iter()
        .map(|(path, bytes)| {
            if path == "model.safetensors" {
                (path, weights.clone())
            } else {
                (path, bytes)
            }
        })
        .collect()
}

#[tokio::test]
async fn safetensors_headers_are_bounded_by_their_tensor_count() {
    let server = TestServer::start(Backend::Sqlite).await;
    let admin = server.admin().await;
    let tensor = json!({"dtype": "F32", "shape": [5, 4], "data_offsets": [0, 80]});
    // One tensor behind 256 KiB of padding: far more header than one tensor needs.
    let mut padded =
        serde_json::to_vec(&json!({"embeddings.word_embeddings.weight": tensor})).unwrap();
    padded.resize(padded.len() + (256 << 10), b' ');
    assert_413(
        server.upload_model(&admin, "padded", with_weights_header(padded, 80)).await,
        "per tensor",
    )
    .await;
    // The same in metadata.
    let metadata = json!({"__metadata__": {"notes": "m".repeat(256 << 10)}, "embeddings.word_embeddings.weight": tensor});
    let response = server.upload_model(
        &admin,
        "meta",
        with_weights_header(serde_json::to_vec(&metadata).unwrap(), 80),
    )
    .await;
    assert_413(response, "per tensor").await;
    // A tensor whose own entry is huge (a name of 64 KiB).
    let name = "t".repeat(64 << 10);
    let entry = json!({
        "embeddings.word_embeddings.weight": tensor,
        name: {"dtype": "F32", "shape": [0], "data_offsets": [80, 80]},
    });
    let files = with_weights_header(serde_json::to_vec(&entry).unwrap(), 80);
    assert_413(
        server.upload_model(&admin, "named", files).await,
        "one tensor may take",
    )
    .await;
    // An honest header with a little padding passes.
    let mut honest = serde_json::to_vec(
        &json!({"__metadata__": {"format": "pt"}, "embeddings.word_embeddings.weight": tensor}),
    )
    .unwrap();
    honest.resize(honest.len().next_multiple_of(8), b' ');
    assert_eq!(
        server.upload_model(&admin, "honest", with_weights_header(honest, 80))
            .await
            .status(),
        201
    );
}

#[tokio::test]
async fn a_model_folder_holds_at_most_one_pooling_config() {
    let server = TestServer::start(Backend::Sqlite).await;
    let admin = server.admin().await;
    let mut files = tiny_model();
    files.push((
        "2_Pooling/config.json".into(),
        br#"{"pooling_mode_cls_token": true}"#.to_vec(),
    ));
    let response = server.upload_model(&admin, "two-poolings", files).await;
    assert_eq!(response.status(), 422);
    let message = error_body(response).await["error"]["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        message.contains("at most one pooling config") && message.contains("2_Pooling/config.json"),
        "{message}"
    );
}
