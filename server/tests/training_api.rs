//! Training jobs over real HTTP on SQLite and PostgreSQL: the issue's example body is
//! accepted, invalid specs get a 422 naming the field, ownership holds, metrics are
//! upserted (a resumed job reads as one run) and downsampled with 100k points, AutoLRS
//! stages are recorded, and checkpoints round-trip for resume.

mod support;

use std::time::Instant;

use serde_json::{json, Value};
use support::{backends, Backend, TestServer};

/// A small tabular dataset: four number features and a 3-class number label.
fn digits_csv() -> String {
    let mut csv = String::from("f0,f1,f2,f3,label,note\n");
    for i in 0..60 {
        csv.push_str(&format!("{},{},{},{},{},row{i}\n", i % 7, i % 5, i as f64 * 0.5, i % 3, i % 3));
    }
    csv
}

async fn upload_dataset(server: &TestServer, token: &str, name: &str) -> Value {
    upload_csv(server, token, name, digits_csv()).await
}

async fn upload_csv(server: &TestServer, token: &str, name: &str, csv: String) -> Value {
    let form = reqwest::multipart::Form::new()
        .text("name", name.to_string())
        .part("file", reqwest::multipart::Part::bytes(csv.into_bytes()).file_name(format!("{name}.csv")));
    let response = server.http.post(server.api("/datasets")).bearer_auth(token).multipart(form).send().await.unwrap();
    assert_eq!(response.status(), 201);
    response.json().await.unwrap()
}

/// The body of issue 6, with `dataset` filled in.
fn example(dataset: &str) -> Value {
    json!({"name":"digits","model":{"kind":"mlp","hidden":[64]},"dataset":dataset,
        "task":{"type":"classification","label_column":"label","validation_split":0.2},
        "optimizer":{"type":"sgd","momentum":0.9},"batch_size":64,"max_steps":3000,
        "eval_every":100,"checkpoint_every":500,"lr_schedule":{"type":"autolrs","min_lr":1e-4,"max_lr":1},"seed":1})
}

async fn submit(server: &TestServer, token: &str, body: Value) -> (u16, Value) {
    let response = server.post(token, "/jobs", body).await;
    (response.status().as_u16(), response.json().await.unwrap())
}

/// `body` with the value at `path` (dot-separated) replaced, or removed when `None`.
fn with(mut body: Value, path: &str, value: Option<Value>) -> Value {
    let mut target = &mut body;
    let parts: Vec<&str> = path.split('.').collect();
    for part in &parts[..parts.len() - 1] {
        target = &mut target[*part];
    }
    let object = target.as_object_mut().unwrap();
    match value {
        Some(value) => object.insert(parts[parts.len() - 1].to_string(), value),
        None => object.remove(parts[parts.len() - 1]),
    };
    body
}

#[tokio::test]
async fn the_issue_example_is_accepted_and_resolved() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let token = server.admin().await;
        let dataset = upload_dataset(&server, &token, "digits").await;
        let (status, job) = submit(&server, &token, example(dataset["id"].as_str().unwrap())).await;
        assert_eq!(status, 201, "{job}");
        assert_eq!(job["state"], "queued");
        assert_eq!(job["attempts"], 0);
        assert_eq!(job["progress"], json!({"step": 0, "max_steps": 3000}));
        let spec = &job["spec"];
        assert_eq!(spec["kind"], "train");
        assert_eq!(spec["model"], json!({"kind": "mlp", "hidden": [64]}));
        assert_eq!(spec["dataset"]["digest"], dataset["digest"]);
        // Left out, the features are every number column but the label.
        assert_eq!(spec["task"]["feature_columns"], json!(["f0", "f1", "f2", "f3"]));
        // The spec carries the columns the job reads ("note" is not one).
        let columns: Vec<&str> =
            spec["dataset"]["columns"].as_array().unwrap().iter().map(|c| c["name"].as_str().unwrap()).collect();
        assert_eq!(columns, ["f0", "f1", "f2", "f3", "label"]);
        assert_eq!(spec["lr_schedule"]["tau_prime"], 100, "AutoLRS defaults are filled in");
        let id = job["id"].as_str().unwrap();
        let fetched: Value = server.get(&token, &format!("/jobs/{id}")).await.json().await.unwrap();
        assert_eq!(fetched["progress"]["max_steps"], 3000);

        // The dataset may also be named; a training job cannot be deleted from under a job.
        let (status, _) = submit(&server, &token, example("digits")).await;
        assert_eq!(status, 201);
        let dataset_id = dataset["id"].as_str().unwrap();
        assert_eq!(server.delete(&token, &format!("/datasets/{dataset_id}")).await.status(), 409, "{backend:?}");

        // The generic form still queues other kinds.
        let response =
            server.post(&token, "/jobs", json!({"name": "p", "spec": {"kind": "prefetch", "model": "nope"}})).await;
        assert_eq!(response.status(), 404, "the prefetch path still resolves its model");
    }
}

#[tokio::test]
async fn invalid_specs_get_a_422_naming_the_field() {
    let server = TestServer::start(Backend::Sqlite).await;
    let token = server.admin().await;
    let dataset = upload_dataset(&server, &token, "digits").await;
    let base = example(dataset["id"].as_str().unwrap());
    let cases: Vec<(Value, &str)> = vec![
        (with(base.clone(), "task.validation_split", Some(json!(1.5))), "task.validation_split"),
        (with(base.clone(), "task.validation_split", Some(json!(0.001))), "task.validation_split"),
        // 59.7 of the 60 rows held out: the worker rounds that to all of them.
        (with(base.clone(), "task.validation_split", Some(json!(0.995))), "task.validation_split"),
        (with(base.clone(), "task.label_column", Some(json!("colour"))), "task.label_column"),
        (
            // 60 rows, 54 held out: 6 training rows for 8 ranks.
            with(
                with(base.clone(), "task.validation_split", Some(json!(0.9))),
                "parallel",
                Some(json!({"ranks": vec![json!({"device": "cpu"}); 8]})),
            ),
            "parallel.ranks",
        ),
        (
            with(with(base.clone(), "task.type", Some(json!("regression"))), "task.label_column", Some(json!("note"))),
            "task.label_column",
        ),
        (with(base.clone(), "task.feature_columns", Some(json!(["f0", "note"]))), "task.feature_columns[1]"),
        (with(base.clone(), "task.feature_columns", Some(json!(["label"]))), "task.feature_columns[0]"),
        (with(base.clone(), "task.text_column", Some(json!("note"))), "task.text_column"),
        (with(base.clone(), "task.type", Some(json!("ranking"))), "task.type"),
        (with(base.clone(), "batch_size", Some(json!(0))), "batch_size"),
        (with(base.clone(), "batch_size", Some(json!("64"))), "batch_size"),
        (with(base.clone(), "max_steps", Some(json!(-5))), "max_steps"),
        (with(base.clone(), "eval_every", Some(json!(0))), "eval_every"),
        (with(base.clone(), "checkpoint_every", Some(json!(0))), "checkpoint_every"),
        (with(base.clone(), "seed", None), "seed"),
        (with(base.clone(), "optimizer.momentum", Some(json!(1.5))), "optimizer.momentum"),
        (with(base.clone(), "optimizer", Some(json!({"type": "adamw", "betas": [0.9, 1.2]}))), "optimizer.betas"),
        (with(base.clone(), "optimizer", Some(json!({"type": "lion"}))), "optimizer"),
        (with(base.clone(), "lr_schedule.max_lr", Some(json!(1e-5))), "lr_schedule.max_lr"),
        (with(base.clone(), "lr_schedule.k", Some(json!(0))), "lr_schedule.k"),
        (with(base.clone(), "lr_schedule", Some(json!({"type": "cosine", "lr": -1}))), "lr_schedule.lr"),
        (with(base.clone(), "lr_schedule", Some(json!({"type": "warp", "lr": 1}))), "lr_schedule"),
        (with(base.clone(), "model", Some(json!({"kind": "cnn"}))), "model"),
        (with(base.clone(), "model", Some(json!({"kind": "mlp", "hidden": [0]}))), "model.hidden"),
        (with(base.clone(), "model", Some(json!("no-such-model"))), "model"),
        (with(base.clone(), "dataset", Some(json!("no-such-dataset"))), "dataset"),
        (with(base.clone(), "name", Some(json!(""))), "name"),
        (with(base.clone(), "learning_rate", Some(json!(0.1))), "learning_rate"),
        // Jobs of other kinds refuse a misspelt field too, rather than drop it.
        (json!({"name": "warm", "spec": {"kind": "prefetch", "model": "nope"}, "max_attempt": 2}), "max_attempt"),
        (json!({"name": "warm", "spec": {"kind": "prefetch", "model": "nope", "modle": "x"}}), "modle"),
    ];
    for (body, field) in cases {
        let (status, error) = submit(&server, &token, body.clone()).await;
        assert_eq!(status, 422, "{field}: {error}");
        assert_eq!(error["error"]["code"], "invalid_spec", "{field}: {error}");
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains(field), "the message {message:?} should name {field:?}");
    }
    let jobs: Vec<Value> = server.get(&token, "/jobs").await.json().await.unwrap();
    assert!(jobs.is_empty(), "no invalid spec was queued");
}

/// Submits `body`, which must get a 422 naming `field`; returns the message.
async fn refused(server: &TestServer, token: &str, body: Value, field: &str) -> String {
    let (status, error) = submit(server, token, body).await;
    assert_eq!(status, 422, "{field}: {error}");
    assert_eq!(error["error"]["code"], "invalid_spec", "{field}: {error}");
    let message = error["error"]["message"].as_str().unwrap().to_string();
    assert!(message.starts_with(field), "the message {message:?} should name {field:?}");
    message
}

#[tokio::test]
async fn models_and_batches_too_large_to_train_get_a_422_naming_the_field() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let token = server.admin().await;
        let digits = upload_dataset(&server, &token, "digits").await;
        // Sixteen layers of 65536 pass the spec's own checks; 64 billion parameters would
        // abort the worker that allocated them.
        let sixteen = json!({"kind": "mlp", "hidden": vec![65_536; 16]});
        let body = with(example(digits["id"].as_str().unwrap()), "model", Some(sixteen));
        let message = refused(&server, &token, body, "model.hidden").await;
        assert!(message.contains("64426016771 parameters"), "{message}");

        // Wide layers between narrow ones are few parameters (1.8 million), but a row of them
        // is 2·524303 activations: 2048 rows of them pass 2^31, 2047 stay within it.
        let rows: String = (0..2600).map(|i| format!("{},{},{},{},{}\n", i % 7, i % 5, i, i % 3, i % 3)).collect();
        let tall = upload_csv(&server, &token, "tall", format!("f0,f1,f2,f3,label\n{rows}")).await;
        let alternating: Vec<u32> = (0..16).map(|i| if i % 2 == 0 { 65_536 } else { 1 }).collect();
        let model = json!({"kind": "mlp", "hidden": alternating});
        let body = with(example(tall["id"].as_str().unwrap()), "model", Some(model));
        let message = refused(&server, &token, with(body.clone(), "batch_size", Some(json!(2048))), "batch_size").await;
        assert!(message.contains("at most 2047"), "{message}");
        let (status, job) = submit(&server, &token, with(body, "batch_size", Some(json!(2047)))).await;
        assert_eq!(status, 201, "{backend:?}: {job}");
    }
}

#[tokio::test]
async fn columns_with_missing_values_or_too_many_classes_get_a_422_naming_them() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let token = server.admin().await;
        // f1 lacks a value in 3 rows, grade in 1, note (never read) in half of them.
        let rows: String = (0..60)
            .map(|i| {
                let f1 = if i % 20 == 0 { String::new() } else { (i % 5).to_string() };
                let grade = if i == 7 { "" } else { ["a", "b"][i % 2] };
                let note = if i % 2 == 0 { "" } else { "seen" };
                format!("{},{f1},{},{grade},{note}\n", i % 7, i % 3)
            })
            .collect();
        let patchy = upload_csv(&server, &token, "patchy", format!("f0,f1,label,grade,note\n{rows}")).await;
        let columns = &patchy["columns"];
        assert_eq!((columns[1]["missing"].as_u64(), columns[2].get("missing")), (Some(3), None), "{patchy}");
        let base = example(patchy["id"].as_str().unwrap());

        let listed = with(base.clone(), "task.feature_columns", Some(json!(["f0", "f1"])));
        let message = refused(&server, &token, listed, "task.feature_columns[1]").await;
        assert!(message.contains("\"f1\" has no value in 3 of the dataset's 60 rows"), "{message}");
        // Left out, the features would be f0 and f1: the gap is named all the same.
        refused(&server, &token, base.clone(), "task.feature_columns").await;
        let f0 = with(base.clone(), "task.feature_columns", Some(json!(["f0"])));
        let graded = with(f0.clone(), "task.label_column", Some(json!("grade")));
        refused(&server, &token, graded, "task.label_column").await;
        // A column the job does not read may lack values.
        let (status, job) = submit(&server, &token, f0).await;
        assert_eq!(status, 201, "{backend:?}: {job}");

        // An id column has a value per row: too many to be classes, fine as a regression target.
        let ids: String = (0..10_005).map(|i| format!("{},{i}\n", i % 7)).collect();
        let wide = upload_csv(&server, &token, "ids", format!("f0,label\n{ids}")).await;
        assert_eq!(wide["columns"][1]["distinct"], 10_001, "counted to one past the cap");
        let base = example(wide["id"].as_str().unwrap());
        let message = refused(&server, &token, base.clone(), "task.label_column").await;
        assert!(message.contains("more than 10000 distinct values"), "{message}");
        let (status, job) = submit(&server, &token, with(base, "task.type", Some(json!("regression")))).await;
        assert_eq!(status, 201, "{backend:?}: {job}");
    }
}

#[tokio::test]
async fn users_cannot_train_on_or_see_each_others_data() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let alice = server.user(&admin, "alice").await;
        let bob = server.user(&admin, "bob").await;
        let dataset = upload_dataset(&server, &alice, "digits").await;
        let id = dataset["id"].as_str().unwrap();
        let (status, error) = submit(&server, &bob, example(id)).await;
        assert_eq!(status, 422, "{error}");
        assert!(error["error"]["message"].as_str().unwrap().starts_with("dataset"));
        let (status, job) = submit(&server, &alice, example(id)).await;
        assert_eq!(status, 201);
        let job = job["id"].as_str().unwrap();
        for path in ["", "/metrics", "/lr-stages", "/checkpoints", "/logs"] {
            assert_eq!(server.get(&bob, &format!("/jobs/{job}{path}")).await.status(), 404, "{path} ({backend:?})");
            assert_eq!(server.get(&admin, &format!("/jobs/{job}{path}")).await.status(), 200, "{path} ({backend:?})");
        }
    }
}

/// Queues the example job and leases it to a new worker; returns (job id, worker secret).
async fn leased_job(server: &TestServer, token: &str, worker: &str) -> (String, String) {
    let dataset = upload_dataset(server, token, &format!("data-{worker}")).await;
    let (status, job) = submit(server, token, example(dataset["id"].as_str().unwrap())).await;
    assert_eq!(status, 201);
    let (_, secret) = server.register_worker(worker).await;
    let claim = server.post(&secret, "/agent/claim", json!({"kinds": ["train"]})).await;
    assert_eq!(claim.status(), 200);
    let assignment: Value = claim.json().await.unwrap();
    assert_eq!(assignment["job_id"], job["id"]);
    assert_eq!(assignment["spec"]["kind"], "train");
    (job["id"].as_str().unwrap().to_string(), secret)
}

fn step_rows(range: std::ops::Range<u64>, offset: f64) -> Vec<Value> {
    range.map(|s| json!({"step": s, "loss": 2.0 / (1.0 + s as f64 * 1e-3) + offset, "lr": 0.1})).collect()
}

#[tokio::test]
async fn metrics_are_upserted_per_step_and_downsampled_with_100k_points() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let token = server.admin().await;
        let (job, secret) = leased_job(&server, &token, "w1").await;
        let report = format!("/agent/jobs/{job}/training-metrics");
        let started = Instant::now();
        for chunk in 0..10u64 {
            let steps = step_rows(chunk * 10_000..(chunk + 1) * 10_000, 0.0);
            let evals: Vec<Value> = (chunk * 100..(chunk + 1) * 100)
                .map(|e| json!({"step": e * 100, "val_loss": 1.0 / (1.0 + e as f64), "accuracy": e as f64 / 1000.0}))
                .collect();
            let response = server.post(&secret, &report, json!({"steps": steps, "evals": evals})).await;
            assert_eq!(response.status(), 204, "{}", response.text().await.unwrap());
        }
        eprintln!("{backend:?}: stored 100k steps x 2 metrics + 1k evals in {:?}", started.elapsed());

        // The worker died after step 60_000 and its successor re-ran from the checkpoint
        // at 50_000: the re-reported steps replace the first run's.
        let response = server.post(&secret, &report, json!({"steps": step_rows(50_000..60_000, 5.0)})).await;
        assert_eq!(response.status(), 204);

        let started = Instant::now();
        let all: Value = server.get(&token, &format!("/jobs/{job}/metrics")).await.json().await.unwrap();
        eprintln!("{backend:?}: read every point in {:?}", started.elapsed());
        let steps = all["steps"].as_array().unwrap();
        assert_eq!(steps.len(), 100_000, "one row per step, no duplicates");
        assert_eq!(steps[0]["step"], 0);
        assert_eq!(steps[99_999]["step"], 99_999);
        let replaced = 2.0 / (1.0 + 55_000.0 * 1e-3) + 5.0;
        assert_eq!(steps[55_000]["loss"].as_f64().unwrap(), replaced);
        assert_eq!(steps[60_000]["loss"].as_f64().unwrap(), 2.0 / (1.0 + 60_000.0 * 1e-3));
        assert_eq!(all["evals"].as_array().unwrap().len(), 1000);
        assert!(all["evals"][3].get("accuracy").is_some() && all["evals"][3].get("val_loss").is_some());

        let started = Instant::now();
        let small: Value =
            server.get(&token, &format!("/jobs/{job}/metrics?max_points=1000")).await.json().await.unwrap();
        eprintln!("{backend:?}: read downsampled to 1000 points per metric in {:?}", started.elapsed());
        let steps = small["steps"].as_array().unwrap();
        let losses: Vec<&Value> = steps.iter().filter(|r| r.get("loss").is_some()).collect();
        assert!(losses.len() <= 1000 && losses.len() > 900, "{} loss points", losses.len());
        assert_eq!(steps[0]["step"], 0);
        assert_eq!(steps.last().unwrap()["step"], 99_999);
        let peak = losses.iter().map(|r| r["loss"].as_f64().unwrap()).fold(f64::MIN, f64::max);
        assert_eq!(peak, 2.0 / (1.0 + 50_000.0 * 1e-3) + 5.0, "the resumed run's jump survives downsampling");
        assert!(small["evals"].as_array().unwrap().len() <= 1000);

        let job_now: Value = server.get(&token, &format!("/jobs/{job}")).await.json().await.unwrap();
        assert_eq!(job_now["progress"], json!({"step": 99_999, "max_steps": 3000}));

        assert_eq!(server.get(&token, &format!("/jobs/{job}/metrics?max_points=2")).await.status(), 400);
        let bad = server.post(&secret, &report, json!({"steps": [{"step": 1, "step_time": "slow"}]})).await;
        assert_eq!(bad.status(), 400, "a non-number value is refused");
        let bad = server.post(&token, &report, json!({"steps": []})).await;
        assert_eq!(bad.status(), 401, "users cannot report metrics");
    }
}

#[tokio::test]
async fn autolrs_step_phases_and_stage_credibility_are_stored_and_served() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let token = server.admin().await;
        let (job, secret) = leased_job(&server, &token, "w1").await;
        let steps: Vec<Value> = (1..=6u64)
            .map(|s| json!({"step": s, "loss": 1.0, "lr": 0.1, "phase": if s <= 4 { "search" } else { "exploit" }}))
            .chain([json!({"step": 7, "loss": 0.9, "lr": 0.05})])
            .collect();
        let evals =
            json!([{"step": 4, "val_loss": 1.2, "phase": "search"}, {"step": 6, "val_loss": 1.0, "phase": "exploit"}]);
        let report = format!("/agent/jobs/{job}/training-metrics");
        let response = server.post(&secret, &report, json!({"steps": steps, "evals": evals})).await;
        assert_eq!(response.status(), 204, "{}", response.text().await.unwrap());
        for query in ["", "?max_points=1000"] {
            let all: Value = server.get(&token, &format!("/jobs/{job}/metrics{query}")).await.json().await.unwrap();
            let phases: Vec<Value> = all["steps"].as_array().unwrap().iter().map(|r| r["phase"].clone()).collect();
            let (search, exploit) = (json!("search"), json!("exploit"));
            assert_eq!(phases[..4], [search.clone(), search.clone(), search.clone(), search.clone()], "{backend:?}");
            assert_eq!(phases[4..6], [exploit.clone(), exploit.clone()]);
            assert_eq!(phases[6], Value::Null, "an untagged step stays untagged");
            assert_eq!(all["evals"][0]["phase"], search);
            assert_eq!(all["evals"][1]["phase"], exploit);
        }

        let stage = json!({"stage": 0, "start_step": 0, "tau_prime": 2, "tau": 10, "metric": "train_loss",
            "candidates": [{"lr": 0.01, "forecast_loss": -3.0, "observed_loss": 0.6, "score": 0.61,
                            "scored_by": "observed", "note": "the unbounded fit forecasts -3.0, below 0"},
                           {"lr": 0.3, "forecast_loss": 0.4, "observed_loss": 0.5, "score": 0.4, "scored_by": "forecast"}],
            "chosen_lr": 0.01, "observed_loss_after_tau": 0.55, "forecast_error": -0.06,
            "fallbacks": [{"lr": 0.3, "at_step": 25, "steps": 21, "reason": "the loss became NaN"}]});
        let path = format!("/agent/jobs/{job}/lr-stages");
        assert_eq!(server.post(&secret, &path, stage).await.status(), 204);
        let stages: Vec<Value> = server.get(&token, &format!("/jobs/{job}/lr-stages")).await.json().await.unwrap();
        assert_eq!(stages[0]["candidates"][0]["scored_by"], "observed");
        assert_eq!(stages[0]["forecast_error"], -0.06);
        assert_eq!(stages[0]["fallbacks"][0]["lr"], 0.3);
    }
}

#[tokio::test]
async fn autolrs_stages_are_recorded_replaced_and_listed_in_order() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let token = server.admin().await;
        let (job, secret) = leased_job(&server, &token, "w1").await;
        let stage = |n: u32, after: Option<f64>| {
            json!({"stage": n, "start_step": n as u64 * 2000, "tau_prime": 100, "tau": 1000, "metric": "train_loss",
                   "candidates": [{"lr": 0.01, "forecast_loss": 0.9, "observed_loss": 1.1},
                                  {"lr": 0.3, "forecast_loss": null, "observed_loss": 5.0}],
                   "chosen_lr": 0.01, "observed_loss_after_tau": after})
        };
        let path = format!("/agent/jobs/{job}/lr-stages");
        assert_eq!(server.post(&secret, &path, stage(1, None)).await.status(), 204);
        assert_eq!(server.post(&secret, &path, stage(0, None)).await.status(), 204);
        assert_eq!(server.post(&secret, &path, stage(0, Some(0.8))).await.status(), 204);
        let stages: Vec<Value> = server.get(&token, &format!("/jobs/{job}/lr-stages")).await.json().await.unwrap();
        assert_eq!(stages.len(), 2, "{backend:?}");
        assert_eq!(stages[0]["stage"], 0);
        assert_eq!(stages[0]["observed_loss_after_tau"], 0.8);
        assert_eq!(stages[0]["candidates"][1]["forecast_loss"], Value::Null);
        assert_eq!(stages[1]["start_step"], 2000);
        let bad = with(stage(2, None), "chosen_lr", Some(json!(0)));
        assert_eq!(server.post(&secret, &path, bad).await.status(), 422);
    }
}

async fn upload_checkpoint(
    server: &TestServer,
    secret: &str,
    job: &str,
    step: u64,
    weights: &[u8],
) -> reqwest::Response {
    let form = reqwest::multipart::Form::new()
        .text("step", step.to_string())
        .part("files", reqwest::multipart::Part::bytes(weights.to_vec()).file_name("model.safetensors"))
        .part(
            "files",
            reqwest::multipart::Part::bytes(format!("{{\"step\":{step}}}").into_bytes()).file_name("state.json"),
        );
    server
        .http
        .post(server.api(&format!("/agent/jobs/{job}/checkpoints")))
        .bearer_auth(secret)
        .multipart(form)
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn checkpoints_round_trip_and_a_resuming_worker_gets_the_latest() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let token = server.admin().await;
        let (job, secret) = leased_job(&server, &token, "w1").await;
        let latest = format!("/agent/jobs/{job}/checkpoints/latest");
        assert_eq!(server.get(&secret, &latest).await.status(), 204, "no checkpoint yet");

        let weights_500: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let response = upload_checkpoint(&server, &secret, &job, 500, &weights_500).await;
        assert_eq!(response.status(), 201, "{}", response.text().await.unwrap());
        let weights_1000 = vec![7u8; 5000];
        let created: Value = upload_checkpoint(&server, &secret, &job, 1000, &weights_1000).await.json().await.unwrap();
        assert_eq!(created["step"], 1000);
        assert_eq!(created["files"].as_array().unwrap().len(), 2);

        // The worker dies; its restart re-registers (proving itself with its secret), which
        // requeues its job, and another worker claims it.
        server.rejoin_worker("w1", &secret).await;
        let (_, second) = server.register_worker("w2").await;
        let claim: Value =
            server.post(&second, "/agent/claim", json!({"kinds": ["train"]})).await.json().await.unwrap();
        assert_eq!(claim["job_id"], job.as_str());
        assert_eq!(claim["attempt"], 2);
        assert_eq!(server.get(&secret, &latest).await.status(), 401, "the dead worker's old secret no longer works");
        let found: Value = server.get(&second, &latest).await.json().await.unwrap();
        assert_eq!(found["step"], 1000, "{backend:?}");
        let names: Vec<&str> = found["files"].as_array().unwrap().iter().map(|f| f["name"].as_str().unwrap()).collect();
        assert_eq!(names, ["model.safetensors", "state.json"]);
        let bytes = server.get(&second, &format!("/agent/jobs/{job}/checkpoints/1000/files/model.safetensors")).await;
        assert_eq!(&bytes.bytes().await.unwrap()[..], &weights_1000[..]);

        // Users list and download them.
        let listed: Vec<Value> = server.get(&token, &format!("/jobs/{job}/checkpoints")).await.json().await.unwrap();
        let steps: Vec<u64> = listed.iter().map(|c| c["step"].as_u64().unwrap()).collect();
        assert_eq!(steps, [500, 1000]);
        assert_eq!(listed[0]["size_bytes"], weights_500.len() + "{\"step\":500}".len());
        let bytes = server.get(&token, &format!("/jobs/{job}/checkpoints/500/files/model.safetensors")).await;
        assert_eq!(bytes.status(), 200);
        assert_eq!(&bytes.bytes().await.unwrap()[..], &weights_500[..]);
        assert_eq!(server.get(&token, &format!("/jobs/{job}/checkpoints/500/files/other.bin")).await.status(), 404);

        // Only the newest few are kept, and their blobs with them.
        for step in 2..=8u64 {
            let weights = vec![step as u8; 1000];
            assert_eq!(upload_checkpoint(&server, &second, &job, step * 500, &weights).await.status(), 201);
        }
        let listed: Vec<Value> = server.get(&token, &format!("/jobs/{job}/checkpoints")).await.json().await.unwrap();
        let steps: Vec<u64> = listed.iter().map(|c| c["step"].as_u64().unwrap()).collect();
        assert_eq!(steps, [2000, 2500, 3000, 3500, 4000], "{backend:?}");
        server.collect_garbage_after_grace().await;
        let blobs = std::fs::read_dir(server.dir.join("blobs/sha256")).unwrap().count();
        assert_eq!(blobs, 5 + 5 + 1, "5 weights, 5 states and the dataset ({backend:?})");

        // A running job keeps its checkpoints; an ended one's can be deleted, blobs and all.
        let checkpoints = server.api(&format!("/jobs/{job}/checkpoints"));
        let response = server.http.delete(&checkpoints).bearer_auth(&token).send().await.unwrap();
        assert_eq!(response.status(), 409);
        assert!(response.text().await.unwrap().contains("may still resume from its checkpoints"));

        // A cancelled job takes no more checkpoints.
        assert_eq!(server.post(&token, &format!("/jobs/{job}/cancel"), json!({})).await.status(), 200);
        assert_eq!(upload_checkpoint(&server, &second, &job, 9000, b"late").await.status(), 409);
        assert_eq!(server.state.blobs.temp_files(), 0);
        assert_eq!(server.http.delete(&checkpoints).bearer_auth(&token).send().await.unwrap().status(), 204);
        let listed: Vec<Value> = server.get(&token, &format!("/jobs/{job}/checkpoints")).await.json().await.unwrap();
        assert!(listed.is_empty(), "{listed:?}");
        server.collect_garbage_after_grace().await;
        let blobs = std::fs::read_dir(server.dir.join("blobs/sha256")).unwrap().count();
        assert_eq!(blobs, 1, "the dataset's ({backend:?})");
    }
}

#[tokio::test]
async fn bad_checkpoint_uploads_are_refused() {
    let server = TestServer::start(Backend::Sqlite).await;
    let token = server.admin().await;
    let (job, secret) = leased_job(&server, &token, "w1").await;
    let url = server.api(&format!("/agent/jobs/{job}/checkpoints"));
    let no_step =
        reqwest::multipart::Form::new().part("files", reqwest::multipart::Part::bytes(vec![1]).file_name("a.bin"));
    let response = server.http.post(&url).bearer_auth(&secret).multipart(no_step).send().await.unwrap();
    assert_eq!(response.status(), 422);
    let bad_name = reqwest::multipart::Form::new()
        .text("step", "5")
        .part("files", reqwest::multipart::Part::bytes(vec![1]).file_name("../escape"));
    let response = server.http.post(&url).bearer_auth(&secret).multipart(bad_name).send().await.unwrap();
    assert_eq!(response.status(), 422);
    let no_files = reqwest::multipart::Form::new().text("step", "5");
    let response = server.http.post(&url).bearer_auth(&secret).multipart(no_files).send().await.unwrap();
    assert_eq!(response.status(), 422);
    assert_eq!(server.state.blobs.temp_files(), 0);
    let listed: Vec<Value> = server.get(&token, &format!("/jobs/{job}/checkpoints")).await.json().await.unwrap();
    assert!(listed.is_empty());
}
