//! QSync precision plans over real HTTP on SQLite and PostgreSQL: only the worker holding
//! rank 0 of a formed gang posts one (another rank or worker gets 403, a lost lease 409, a
//! report that does not fit the gang 422), users read it back by the job they see (owner or
//! admin), and the job page shows it: rank cards, the layer × rank table, step time and
//! the final accuracy beside the owner's baseline jobs.

mod support;

use reqwest::redirect::Policy;
use serde_json::{json, Value};
use support::{backends, Backend, TestServer, ADMIN_PASSWORD};
use tessera_server::store::db::now_ms;
use tessera_server::store::training::{upsert_metrics, Point, Series};

/// A training job on `dataset`; `ranks` CPU ranks, or one process when 0.
async fn submit(server: &TestServer, token: &str, name: &str, dataset: &str, ranks: usize) -> String {
    let mut body = json!({"name": name, "model": {"kind": "mlp", "hidden": [8]}, "dataset": dataset,
        "task": {"type": "classification", "label_column": "label", "validation_split": 0.25},
        "optimizer": {"type": "sgd"}, "batch_size": 8, "max_steps": 10, "eval_every": 5, "checkpoint_every": 5,
        "lr_schedule": {"type": "constant", "lr": 0.1}, "seed": 1});
    if ranks > 0 {
        body["parallel"] = json!({"ranks": vec![json!({"device": "cpu"}); ranks]});
    }
    let response = server.post(token, "/jobs", body).await;
    assert_eq!(response.status(), 201);
    response.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_string()
}

/// Registers one worker per name; each claims the next rank (or job) and posts its ring
/// address, so a gang forms. Returns (secret, claimed job id) per worker.
async fn claim_and_form(server: &TestServer, names: &[&str]) -> Vec<(String, String)> {
    let mut held = Vec::new();
    for name in names {
        let (_, secret) = server.register_worker(name).await;
        let response = server.post(&secret, "/agent/claim", json!({"kinds": ["train", "train_rank"]})).await;
        assert_eq!(response.status(), 200, "{name} claims");
        let claimed: Value = response.json().await.unwrap();
        held.push((secret, claimed["job_id"].as_str().unwrap().to_string(), claimed["spec"]["kind"].clone()));
    }
    for (i, (secret, job, kind)) in held.iter().enumerate() {
        if kind == "train_rank" {
            let address = json!({"address": format!("127.0.0.1:{}", 7600 + i)});
            assert_eq!(server.post(secret, &format!("/agent/jobs/{job}/rendezvous"), address).await.status(), 200);
        }
    }
    held.into_iter().map(|(secret, job, _)| (secret, job)).collect()
}

/// A two-operator plan per rank: rank 0 keeps f32, the others run the query at int8.
fn report(world: usize, measured: Option<f64>) -> Value {
    let table = |device: String| {
        json!({"device": device, "overhead_ms": 0.4, "optimizer_ms": 0.2, "casts_in_op_time": false, "ops": [
            {"op": "layer0.query", "kind": "linear", "timings": [
                {"precision": "int8", "forward_ms": 0.5, "backward_ms": 1.0},
                {"precision": "bf16", "forward_ms": 0.8, "backward_ms": 1.5},
                {"precision": "f32", "forward_ms": 1.2, "backward_ms": 2.4}]},
            {"op": "head", "kind": "head", "timings": [{"precision": "f32", "forward_ms": 0.1, "backward_ms": 0.2}]}]})
    };
    let plan = |rank: usize| {
        let (precision, omega) = if rank == 0 { ("f32", 0.0) } else { ("int8", 0.0042) };
        json!({"rank": rank, "device": format!("cpu:{} threads", 12 / (rank + 1)), "predicted_ms": 4.0 + rank as f64,
            "indicator_sum": omega, "ops": [
                {"op": "layer0.query", "kind": "linear", "precision": precision, "indicator": omega},
                {"op": "head", "kind": "head", "precision": "f32", "indicator": 0.0}]})
    };
    let mut report = json!({
        "indicator": {"kind": "gradient_variance"},
        "cost_tables": (0..world).map(|r| table(format!("cpu:{} threads", 12 / (r + 1)))).collect::<Vec<_>>(),
        "cast_models": (0..world).map(|_| json!({"fits": [{"from": "f32", "to": "int8", "ms_per_element": 1e-6,
            "fixed_ms": 0.01, "r2": 0.97, "samples": 8}]})).collect::<Vec<_>>(),
        "ranks": (0..world).map(plan).collect::<Vec<_>>(),
        "budget_ms": 5.5, "predicted_step_ms": 5.2,
        "trace": [{"op": "layer0.query", "from": "int8", "to": "bf16", "gain": 0.003, "cost_ms": 0.8,
            "predicted_ms": 6.1, "accepted": false}]
    });
    if let Some(measured) = measured {
        report["measured_step_ms"] = json!(measured);
    }
    report
}

async fn put(server: &TestServer, secret: &str, job: &str, body: Value) -> (u16, Value) {
    let response = server
        .http
        .put(server.api(&format!("/agent/jobs/{job}/precision-plan")))
        .bearer_auth(secret)
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

fn message(body: &Value) -> &str {
    body["error"]["message"].as_str().unwrap_or_default()
}

#[tokio::test]
async fn only_rank_0s_worker_posts_a_plan_and_its_owner_reads_it_back() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let alice = server.user(&admin, "alice").await;
        let bob = server.user(&admin, "bob").await;
        let data = server.toy_dataset(&alice).await;
        let id = submit(&server, &alice, "qsync", &data, 2).await;
        let plan_path = format!("/jobs/{id}/precision-plan");

        let response = server.get(&alice, &plan_path).await;
        assert_eq!(response.status(), 404, "{backend:?}");
        let body: Value = response.json().await.unwrap();
        assert!(message(&body).contains("no precision plan yet"), "{body}");

        let held = claim_and_form(&server, &["a", "b"]).await;
        let ((secret0, rank0), (secret1, rank1)) = (&held[0], &held[1]);
        let (_, stranger) = server.register_worker("c").await;

        // Only the worker holding rank 0 may post.
        let (status, body) = put(&server, secret1, rank1, report(2, None)).await;
        assert_eq!(status, 403, "rank 1 posts through its own rank ({backend:?})");
        assert!(message(&body).contains("rank 0 of the gang posts"), "{body}");
        let (status, _) = put(&server, secret1, rank0, report(2, None)).await;
        assert_eq!(status, 403, "rank 1's worker posts through rank 0's job");
        let (status, body) = put(&server, &stranger, rank0, report(2, None)).await;
        assert_eq!(status, 403, "a worker holding nothing");
        assert!(message(&body).contains("Another worker holds"), "{body}");
        let response =
            server.http.put(server.api(&format!("/agent/jobs/{rank0}/precision-plan"))).json(&report(2, None));
        assert_eq!(response.send().await.unwrap().status(), 401, "no worker secret");

        // A report that does not fit the gang: 422 with the reason.
        let (status, body) = put(&server, secret0, rank0, report(3, None)).await;
        assert_eq!(status, 422, "{backend:?}");
        assert!(message(&body).contains("ranks has 3 entries but the job runs 2 ranks"), "{body}");
        let mut unmeasured = report(2, None);
        unmeasured["ranks"][1]["ops"][1]["precision"] = json!("int8");
        let (status, body) = put(&server, secret0, rank0, unmeasured).await;
        assert_eq!(status, 422);
        assert!(message(&body).contains("which its cost table did not measure"), "{body}");
        let (status, _) = put(&server, secret0, rank0, json!({"ranks": []})).await;
        assert_eq!(status, 400, "a body that is not a report");

        // Posted after planning, then again with the measured step: the last one is kept.
        assert_eq!(put(&server, secret0, rank0, report(2, None)).await.0, 204, "{backend:?}");
        let read: Value = server.get(&alice, &plan_path).await.json().await.unwrap();
        assert_eq!(read, report(2, None), "{backend:?}");
        assert_eq!(put(&server, secret0, rank0, report(2, Some(5.4))).await.0, 204);
        let read: Value = server.get(&alice, &plan_path).await.json().await.unwrap();
        assert_eq!(read["measured_step_ms"], 5.4);
        assert_eq!(server.get(&admin, &plan_path).await.status(), 200, "admins read every plan");
        assert_eq!(server.get(&bob, &plan_path).await.status(), 404, "another user's job does not exist for bob");
        assert_eq!(server.http.get(server.api(&plan_path)).send().await.unwrap().status(), 401);

        // The ranks' step timings carry the plan's prediction.
        let timing = json!({"ranks": [{"rank": 1, "step": 1, "iter_ms": 5.6, "wait_ms": 0.2, "allreduce_ms": 0.4,
            "predicted_ms": 5.2}]});
        assert_eq!(server.post(secret1, &format!("/agent/jobs/{rank1}/training-metrics"), timing).await.status(), 204);
        let metrics: Value = server.get(&alice, &format!("/jobs/{id}/metrics")).await.json().await.unwrap();
        assert_eq!(metrics["ranks"][0]["predicted_ms"], 5.2, "{backend:?}");
        let negative = json!({"ranks": [{"rank": 1, "step": 2, "iter_ms": 5.6, "wait_ms": 0.2, "allreduce_ms": 0.4,
            "predicted_ms": -1.0}]});
        assert_eq!(
            server.post(secret1, &format!("/agent/jobs/{rank1}/training-metrics"), negative).await.status(),
            422
        );

        // Once the job is cancelled the lease is gone: 409, and the plan stays readable.
        assert_eq!(server.post(&alice, &format!("/jobs/{id}/cancel"), json!({})).await.status(), 200);
        let (status, body) = put(&server, secret0, rank0, report(2, None)).await;
        assert_eq!(status, 409, "{backend:?}");
        assert!(message(&body).contains("does not hold the job's lease"), "{body}");
        assert_eq!(server.get(&alice, &plan_path).await.status(), 200);

        // A one-process job has no plan: its worker gets 422, its owner a 404 saying why.
        let single = submit(&server, &alice, "single", &data, 0).await;
        let held = claim_and_form(&server, &["d"]).await;
        assert_eq!(held[0].1, single);
        let (status, body) = put(&server, &held[0].0, &single, report(2, None)).await;
        assert_eq!(status, 422);
        assert!(message(&body).contains("runs as one process"), "{body}");
        let body: Value = server.get(&alice, &format!("/jobs/{single}/precision-plan")).await.json().await.unwrap();
        assert!(message(&body).contains("only data-parallel jobs"), "{body}");
    }
}

#[tokio::test]
async fn the_plan_route_is_in_the_openapi_document() {
    let server = TestServer::start(Backend::Sqlite).await;
    let doc: Value =
        server.http.get(format!("{}/api/openapi.json", server.url)).send().await.unwrap().json().await.unwrap();
    assert!(doc["paths"]["/api/v1/jobs/{id}/precision-plan"]["get"].is_object());
    assert!(doc["paths"]["/api/v1/agent/jobs/{id}/precision-plan"]["put"].is_object());
    assert!(doc["components"]["schemas"]["PrecisionPlanReport"].is_object());
}

fn accuracy(step: i64, value: f64) -> Point {
    Point { series: Series::Eval, name: "accuracy".into(), step, value, at: now_ms(), phase: None }
}

#[tokio::test]
async fn the_job_page_shows_ranks_the_layer_table_step_time_and_baselines() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let data = server.toy_dataset(&admin).await;
        let baseline = submit(&server, &admin, "f32-baseline", &data, 2).await;
        let wider = submit(&server, &admin, "three-ranks", &data, 3).await;
        let id = submit(&server, &admin, "qsync-run", &data, 2).await;
        for (job, value) in [(&baseline, 0.91), (&wider, 0.5)] {
            upsert_metrics(&server.state.db, job.parse().unwrap(), &[accuracy(10, value)]).await.unwrap();
        }
        // The gangs are claimed oldest first: cancel the two others so the workers get ours.
        for other in [&baseline, &wider] {
            assert_eq!(server.post(&admin, &format!("/jobs/{other}/cancel"), json!({})).await.status(), 200);
        }
        let held = claim_and_form(&server, &["a", "b"]).await;

        let http = reqwest::Client::builder().redirect(Policy::none()).build().unwrap();
        let login = http
            .post(format!("{}/login", server.url))
            .form(&[("username", "admin"), ("password", ADMIN_PASSWORD), ("next", "/")])
            .send()
            .await
            .unwrap();
        let cookie = login.headers()["set-cookie"].to_str().unwrap().split(';').next().unwrap().to_string();
        let page = |path: String| {
            let request = http.get(format!("{}{path}", server.url)).header("cookie", cookie.clone());
            async move { request.send().await.unwrap().text().await.unwrap() }
        };
        let before = page(format!("/jobs/{id}")).await;
        assert!(!before.contains("id=\"precision-plan\""), "no panel before a plan ({backend:?})");

        assert_eq!(put(&server, &held[0].0, &held[0].1, report(2, None)).await.0, 204);
        let steps = json!({"evals": [{"step": 10, "accuracy": 0.9}],
            "ranks": [{"rank": 0, "step": 1, "iter_ms": 5.0, "wait_ms": 1.5, "allreduce_ms": 0.5},
                      {"rank": 0, "step": 2, "iter_ms": 7.0, "wait_ms": 1.5, "allreduce_ms": 0.5}]});
        let path = format!("/agent/jobs/{}/training-metrics", held[0].1);
        assert_eq!(server.post(&held[0].0, &path, steps).await.status(), 204);

        let html = page(format!("/jobs/{id}")).await;
        assert!(html.contains("id=\"precision-plan\""), "{html}");
        for rank in ["data-rank=\"0\"", "data-rank=\"1\""] {
            assert!(html.contains(rank), "a card per rank: {rank}");
        }
        // Rank 0 measured a 6 ms median step, 1.5 ms of it waiting: 4 ms of compute against 4 predicted.
        assert!(html.contains("6.00 ms"), "median step");
        assert!(html.contains("25 % of the step"), "waiting share");
        assert!(html.contains("+0.0 %"), "prediction error");
        assert!(html.contains("<th scope=\"row\"><code>layer0.query</code></th>"), "a row per operator");
        assert!(html.contains("data-precision=\"int8\">int8 <span class=\"omega\">ω 4.200e-3</span>"), "{html}");
        assert!(html.contains("50 %"), "one of two steps within the 5.5 ms budget");
        assert!(html.contains("<path class=\"line-1\" d=\"M"), "the step-time line is drawn");
        // The f32 gang on the same model, dataset and ranks is a baseline; the 3-rank one is not.
        assert!(html.contains(&format!("href=\"/jobs/{baseline}\">f32-baseline</a>")), "baseline linked");
        assert!(!html.contains("three-ranks"), "another rank count is no baseline");
        assert!(html.contains("accuracy 0.9 @ 10") && html.contains("-1.00 points"), "accuracies side by side");
        assert!(html.contains("Allocator trace: 1 steps, 0 taken"));
        assert!(!html.contains("id=\"precision-replans\""), "nothing replanned yet");

        // A plan made again after step 1: the drop is listed, and the cards read only the
        // steps since (rank 0's step 2: 7 ms).
        let mut again = report(2, None);
        again["replaced"] =
            json!([{"step": 1, "predicted_ms": [4.0, 4.0], "measured_ms": [4.2, 12.0], "lowered": [0, 1]}]);
        assert_eq!(put(&server, &held[0].0, &held[0].1, again).await.0, 204);
        let html = page(format!("/jobs/{id}")).await;
        assert!(html.contains("id=\"precision-replans\"") && html.contains("Dropped after step 1"), "{html}");
        assert!(html.contains("rank 1: 12.0 ms measured, 4.00 ms predicted (+200 %), 1 operators below f32"), "{html}");
        assert!(html.contains("7.00 ms") && !html.contains("6.00 ms"), "the cards read the steps since: {html}");
    }
}
