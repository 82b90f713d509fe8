//! Preemption of training jobs (issue 16), over real HTTP on SQLite and PostgreSQL: who may
//! preempt which job, the heartbeat signal, the `preempted` state (claimable, no attempt
//! spent, in the queue's order), a gang preempted once every rank has checkpointed, an
//! elastic gang resized while it waits, a `preempted` report sent again (its answer lost),
//! and a worker that dies instead of checkpointing.

mod support;

use std::time::Duration;

use serde_json::{json, Value};
use support::{backends, TestServer};
use tessera_server::store::jobs as jobs_store;

/// A training body; `extra` is merged in (resources, parallel).
fn body(dataset: &str, extra: Value) -> Value {
    let mut body = json!({"name": "t", "model": {"kind": "mlp", "hidden": [8]}, "dataset": dataset,
        "task": {"type": "classification", "label_column": "label", "validation_split": 0.25},
        "optimizer": {"type": "sgd"}, "batch_size": 8, "max_steps": 100, "eval_every": 10, "checkpoint_every": 10,
        "lr_schedule": {"type": "constant", "lr": 0.1}, "seed": 1, "max_attempts": 2});
    for (key, value) in extra.as_object().unwrap() {
        body[key] = value.clone();
    }
    body
}

async fn submit(server: &TestServer, token: &str, body: Value) -> String {
    let response = server.post(token, "/jobs", body).await;
    assert_eq!(response.status(), 201, "{}", response.text().await.unwrap());
    response.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_string()
}

async fn claim(server: &TestServer, secret: &str) -> Option<Value> {
    let response = server.post(secret, "/agent/claim", json!({"kinds": ["train", "train_rank"]})).await;
    match response.status().as_u16() {
        204 => None,
        200 => Some(response.json().await.unwrap()),
        other => panic!("claim answered {other}"),
    }
}

async fn job(server: &TestServer, token: &str, id: &str) -> Value {
    server.get(token, &format!("/jobs/{id}")).await.json().await.unwrap()
}

async fn heartbeat(server: &TestServer, secret: &str, jobs: &[&str]) -> Value {
    server.post(secret, "/agent/heartbeat", json!({"jobs": jobs})).await.json().await.unwrap()
}

async fn status(server: &TestServer, secret: &str, job: &str, state: &str, message: &str) -> u16 {
    let report = json!({"state": state, "message": message});
    server.post(secret, &format!("/agent/jobs/{job}/status"), report).await.status().as_u16()
}

async fn preempt(server: &TestServer, token: &str, job: &str, body: Value) -> (u16, Value) {
    let response = server.post(token, &format!("/jobs/{job}/preempt"), body).await;
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

#[tokio::test]
async fn a_preempted_job_waits_as_preempted_without_spending_an_attempt_and_is_claimed_first() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let token = server.user(&admin, "ada").await;
        let data = server.toy_dataset(&token).await;
        let preemptible = json!({"resources": {"preemptible": true}});
        let id = submit(&server, &token, body(&data, preemptible.clone())).await;
        let created = job(&server, &token, &id).await;
        assert_eq!(created["spec"]["resources"], json!({"min_ranks": 1, "max_ranks": 1, "preemptible": true}));

        let (_, secret) = server.register_worker("w1").await;
        assert_eq!(claim(&server, &secret).await.unwrap()["job_id"], id);
        assert_eq!(status(&server, &secret, &id, "running", "").await, 204);
        assert!(heartbeat(&server, &secret, &[&id]).await.get("preempt").is_none(), "nothing asked yet");
        // Queued behind it: a newer job of the same owner.
        let newer = submit(&server, &token, body(&data, preemptible.clone())).await;

        let (code, answer) = preempt(&server, &token, &id, json!({"reason": "slices reclaimed"})).await;
        assert_eq!((code, answer["state"].as_str()), (202, Some("running")), "{backend:?}: {answer}");
        let beat = heartbeat(&server, &secret, &[&id]).await;
        assert_eq!((beat["stop"].clone(), beat["preempt"].clone()), (json!([]), json!([id])), "{backend:?}");
        let (code, _) = preempt(&server, &token, &id, json!({})).await;
        assert_eq!(code, 202, "asking again is harmless");
        let logs: Value = server.get(&token, &format!("/jobs/{id}/logs")).await.json().await.unwrap();
        let lines: Vec<&str> = logs.as_array().unwrap().iter().map(|l| l["line"].as_str().unwrap()).collect();
        assert!(lines.contains(&"Preempted by ada: slices reclaimed"), "the log says why: {lines:?}");

        assert_eq!(status(&server, &secret, &id, "preempted", "Preempted at step 37.").await, 204);
        let preempted = job(&server, &token, &id).await;
        assert_eq!(preempted["state"], "preempted", "{backend:?}");
        assert_eq!((preempted["attempts"].as_u64(), preempted["preemptions"].as_u64()), (Some(0), Some(1)));
        assert_eq!(preempted["message"], "Preempted at step 37.");
        assert!(preempted["worker_id"].is_null());
        let listed: Vec<Value> = server.get(&token, "/jobs?state=preempted").await.json().await.unwrap();
        assert_eq!(listed.iter().map(|j| j["id"].clone()).collect::<Vec<_>>(), [json!(id)]);
        assert_eq!(jobs_store::depth(&server.state.db).await.unwrap(), 2, "a preempted job is waiting");
        // The worker no longer holds it: what it still says is refused.
        assert_eq!(status(&server, &secret, &id, "succeeded", "late").await, 409);

        // The preempted job is older than the queued one: it is claimed first, its request gone.
        let (_, secret2) = server.register_worker("w2").await;
        let again = claim(&server, &secret2).await.unwrap();
        assert_eq!((again["job_id"].as_str(), again["attempt"].as_u64()), (Some(id.as_str()), Some(1)), "{backend:?}");
        assert!(heartbeat(&server, &secret2, &[&id]).await.get("preempt").is_none());
        assert_eq!(claim(&server, &secret).await.unwrap()["job_id"], newer);
        assert_eq!(status(&server, &secret2, &id, "running", "").await, 204);
        assert_eq!(status(&server, &secret2, &id, "succeeded", "done").await, 204);
        let done = job(&server, &token, &id).await;
        assert_eq!((done["state"].as_str(), done["attempts"].as_u64()), (Some("succeeded"), Some(1)));
    }
}

#[tokio::test]
async fn who_may_preempt_what() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let owner = server.user(&admin, "owner").await;
        let other = server.user(&admin, "other").await;
        let data = server.toy_dataset(&owner).await;
        let fixed = submit(&server, &owner, body(&data, json!({}))).await;
        let (_, secret) = server.register_worker("w").await;
        assert_eq!(claim(&server, &secret).await.unwrap()["job_id"], fixed);

        assert_eq!(preempt(&server, &other, &fixed, json!({})).await.0, 404, "another user's job is not seen");
        let (code, answer) = preempt(&server, &owner, &fixed, json!({})).await;
        assert_eq!(code, 409, "{backend:?}");
        assert!(answer["error"]["message"].as_str().unwrap().contains("not preemptible"), "{answer}");
        assert_eq!(preempt(&server, &owner, &fixed, json!({"force": true})).await.0, 403, "only admins force");
        assert_eq!(preempt(&server, &admin, &fixed, json!({})).await.0, 409, "an admin too must say force");
        assert_eq!(preempt(&server, &admin, &fixed, json!({"forse": true})).await.0, 422, "a misspelt field");
        let (code, answer) = preempt(&server, &admin, &fixed, json!({"force": true, "reason": "maintenance"})).await;
        assert_eq!(code, 202, "{backend:?}: {answer}");
        assert_eq!(heartbeat(&server, &secret, &[&fixed]).await["preempt"], json!([fixed]));

        // A worker reports `preempted` only when asked to.
        let unasked = submit(&server, &owner, body(&data, json!({"resources": {"preemptible": true}}))).await;
        let (code, answer) = preempt(&server, &owner, &unasked, json!({})).await;
        assert_eq!(code, 409, "a queued job has nothing running to preempt");
        assert!(answer["error"]["message"].as_str().unwrap().contains("queued"), "{answer}");
        let (_, secret2) = server.register_worker("w2").await;
        assert_eq!(claim(&server, &secret2).await.unwrap()["job_id"], unasked);
        assert_eq!(status(&server, &secret2, &unasked, "preempted", "").await, 409, "{backend:?}");
        assert_eq!(job(&server, &owner, &unasked).await["state"], "leased");

        // Cancelling a job with a preemption pending ends it; so does cancelling a preempted one.
        assert_eq!(server.post(&owner, &format!("/jobs/{fixed}/cancel"), json!({})).await.status(), 200);
        assert_eq!(heartbeat(&server, &secret, &[&fixed]).await["stop"], json!([fixed]));
        assert_eq!(preempt(&server, &owner, &unasked, json!({})).await.0, 202);
        assert_eq!(status(&server, &secret2, &unasked, "preempted", "").await, 204);
        assert_eq!(server.post(&owner, &format!("/jobs/{unasked}/cancel"), json!({})).await.status(), 200);
        assert_eq!(job(&server, &owner, &unasked).await["state"], "cancelled");

        // Spec mistakes about resources are 422s naming the field.
        for (resources, field) in [
            (json!({"max_ranks": 2}), "resources.max_ranks"),
            (json!({"min_ranks": 0}), "resources.min_ranks"),
            (json!({"preemptable": true}), "resources"),
        ] {
            let response = server.post(&owner, "/jobs", body(&data, json!({"resources": resources}))).await;
            assert_eq!(response.status(), 422);
            let answer: Value = response.json().await.unwrap();
            assert!(answer["error"]["message"].as_str().unwrap().starts_with(field), "{answer}");
        }
        let ranks = json!([{"device": "cpu"}, {"device": "cpu"}]);
        let response = server
            .post(&owner, "/jobs", body(&data, json!({"parallel": {"ranks": ranks}, "resources": {"min_ranks": 3}})))
            .await;
        assert_eq!(response.status(), 422);
    }
}

#[tokio::test]
async fn a_preempted_report_sent_again_by_its_worker_is_a_204_that_changes_nothing() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let token = server.admin().await;
        let data = server.toy_dataset(&token).await;
        let id = submit(&server, &token, body(&data, json!({"resources": {"preemptible": true}}))).await;
        let (_, secret) = server.register_worker("w1").await;
        let (_, other) = server.register_worker("w2").await;
        claim(&server, &secret).await.unwrap();
        assert_eq!(status(&server, &secret, &id, "running", "").await, 204);
        assert_eq!(preempt(&server, &token, &id, json!({})).await.0, 202);

        // The first answer was lost: the worker sends the same report again.
        for _ in 0..2 {
            assert_eq!(status(&server, &secret, &id, "preempted", "Preempted at step 12.").await, 204, "{backend:?}");
        }
        let preempted = job(&server, &token, &id).await;
        assert_eq!(preempted["state"], "preempted", "{backend:?}");
        assert_eq!((preempted["attempts"].as_u64(), preempted["preemptions"].as_u64()), (Some(0), Some(1)));
        assert!(preempted["worker_id"].is_null(), "still claimable");
        assert_eq!(status(&server, &other, &id, "preempted", "").await, 409, "w2 never held it ({backend:?})");

        // Claimed again, the job is the new holder's: the old report is stale now, and stays
        // so once that holder restarts and the job is back in the queue.
        assert_eq!(claim(&server, &other).await.unwrap()["job_id"], id);
        assert_eq!(status(&server, &secret, &id, "preempted", "Preempted at step 12.").await, 409, "{backend:?}");
        let claimed = job(&server, &token, &id).await;
        assert_eq!((claimed["state"].as_str(), claimed["attempts"].as_u64()), (Some("leased"), Some(1)));
        server.rejoin_worker("w2", &other).await;
        assert_eq!(job(&server, &token, &id).await["state"], "queued", "{backend:?}");
        assert_eq!(status(&server, &secret, &id, "preempted", "Preempted at step 12.").await, 409, "{backend:?}");
        let requeued = job(&server, &token, &id).await;
        assert_eq!((requeued["state"].as_str(), requeued["preemptions"].as_u64()), (Some("queued"), Some(1)));
    }
}

#[tokio::test]
async fn a_rank_s_preempted_report_sent_again_is_a_204_before_and_after_its_gang_is_preempted() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let token = server.admin().await;
        let data = server.toy_dataset(&token).await;
        let gang = json!({"parallel": {"ranks": [{"device": "cpu"}, {"device": "cpu"}]},
            "resources": {"preemptible": true}});
        let id = submit(&server, &token, body(&data, gang)).await;
        let ranks = form_gang(&server, &["a", "b"], 7500).await;
        let (_, stranger) = server.register_worker("c").await;
        assert_eq!(preempt(&server, &token, &id, json!({})).await.0, 202);

        // Rank 1 stops first and repeats itself while the gang still runs; rank 0's report
        // preempts the gang, and both ranks' repeats come after that.
        let (first, second) = (&ranks[1], &ranks[0]);
        for _ in 0..2 {
            assert_eq!(status(&server, &first.0, &first.1, "preempted", "Preempted at step 5.").await, 204);
        }
        assert_eq!(job(&server, &token, &id).await["state"], "running", "{backend:?}");
        assert_eq!(status(&server, &second.0, &second.1, "preempted", "Preempted at step 5.").await, 204);
        assert_eq!(job(&server, &token, &id).await["state"], "preempted", "{backend:?}");
        for (secret, rank_job, _) in [second, first] {
            let again = status(&server, secret, rank_job, "preempted", "Preempted at step 5.").await;
            assert_eq!(again, 204, "{backend:?}");
        }
        let preempted = job(&server, &token, &id).await;
        assert_eq!(preempted["state"], "preempted", "{backend:?}: {preempted}");
        assert_eq!((preempted["attempts"].as_u64(), preempted["preemptions"].as_u64()), (Some(0), Some(1)));

        for (_, rank_job, _) in &ranks {
            assert_eq!(status(&server, &stranger, rank_job, "preempted", "").await, 409, "{backend:?}");
        }
        // The ranks wait in the queue, claimable as before; a rank claimed since is not the
        // old holder's to report on, nor once its new holder restarts and it is queued again.
        let rank = claim(&server, &stranger).await.expect("a rank to claim");
        let held = rank["job_id"].as_str().unwrap();
        let previous = ranks.iter().find(|(_, rank_job, _)| rank_job == held).unwrap();
        assert_eq!(status(&server, &previous.0, held, "preempted", "Preempted at step 5.").await, 409, "{backend:?}");
        server.rejoin_worker("c", &stranger).await;
        assert_eq!(status(&server, &previous.0, held, "preempted", "Preempted at step 5.").await, 409, "{backend:?}");
        let waiting = job(&server, &token, &id).await;
        assert_eq!((waiting["state"].as_str(), waiting["preemptions"].as_u64()), (Some("preempted"), Some(1)));
    }
}

/// Registers a worker per rank and has each claim one and post its address.
async fn form_gang(server: &TestServer, names: &[&str], port: u16) -> Vec<(String, String, Value)> {
    let mut held = Vec::new();
    for name in names {
        let (_, secret) = server.register_worker(name).await;
        let assignment = claim(server, &secret).await.expect("a rank to claim");
        held.push((secret, assignment["job_id"].as_str().unwrap().to_string(), assignment["spec"].clone()));
    }
    let mut last = Value::Null;
    for (i, (secret, rank_job, _)) in held.iter().enumerate() {
        let address = json!({"address": format!("127.0.0.1:{}", port + i as u16)});
        let response = server.post(secret, &format!("/agent/jobs/{rank_job}/rendezvous"), address).await;
        last = response.json().await.unwrap();
    }
    assert_eq!(last["state"], "formed", "{last}");
    held
}

#[tokio::test]
async fn a_gang_is_preempted_once_every_rank_has_stopped_and_an_elastic_one_resizes_while_it_waits() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let token = server.admin().await;
        let data = server.toy_dataset(&token).await;
        let elastic = json!({"parallel": {"ranks": [{"device": "cpu"}, {"device": "cpu"}]},
            "resources": {"min_ranks": 1, "preemptible": true}});
        let id = submit(&server, &token, body(&data, elastic)).await;
        let gang_id: uuid::Uuid = id.parse().unwrap();
        let ranks = form_gang(&server, &["a", "b"], 7300).await;
        assert_eq!(ranks[1].2["world"], 2);
        let err = tessera_server::gangs::resize(&server.state.db, gang_id, 1).await.unwrap_err();
        assert!(err.to_string().contains("running or forming"), "{err}");

        let (code, _) = preempt(&server, &token, &id, json!({"reason": "reclaim"})).await;
        assert_eq!(code, 202);
        for (secret, rank_job, _) in &ranks {
            assert_eq!(heartbeat(&server, secret, &[rank_job]).await["preempt"], json!([rank_job]), "{backend:?}");
        }
        // Rank 1 stops first; the gang waits for rank 0, which uploads the checkpoint.
        assert_eq!(status(&server, &ranks[1].0, &ranks[1].1, "preempted", "Preempted at step 24.").await, 204);
        assert_eq!(job(&server, &token, &id).await["state"], "running", "{backend:?}");
        assert_eq!(status(&server, &ranks[0].0, &ranks[0].1, "preempted", "Preempted at step 24.").await, 204);
        let preempted = job(&server, &token, &id).await;
        assert_eq!(preempted["state"], "preempted", "{backend:?}: {preempted}");
        assert_eq!((preempted["attempts"].as_u64(), preempted["preemptions"].as_u64()), (Some(0), Some(1)));

        // While it waits it may run at 1 or 2 ranks, not 3.
        let err = tessera_server::gangs::resize(&server.state.db, gang_id, 3).await.unwrap_err();
        assert!(err.to_string().contains("1 to 2 ranks"), "{err}");
        tessera_server::gangs::resize(&server.state.db, gang_id, 1).await.unwrap();
        let (_, secret) = server.register_worker("c").await;
        let rank = claim(&server, &secret).await.unwrap();
        assert_eq!((rank["spec"]["rank"].as_u64(), rank["spec"]["world"].as_u64()), (Some(0), Some(1)));
        let (_, idle) = server.register_worker("d").await;
        assert!(claim(&server, &idle).await.is_none(), "one rank only now ({backend:?})");
        let rank_job = rank["job_id"].as_str().unwrap();
        let path = format!("/agent/jobs/{rank_job}/rendezvous");
        let formed: Value =
            server.post(&secret, &path, json!({"address": "127.0.0.1:7400"})).await.json().await.unwrap();
        // Generation 2: ranks of the preempted attempt (generation 1) cannot join this one.
        assert_eq!(formed, json!({"state": "formed", "generation": 2, "peers": ["127.0.0.1:7400"]}), "{backend:?}");
        let running = job(&server, &token, &id).await;
        assert_eq!((running["state"].as_str(), running["attempts"].as_u64()), (Some("running"), Some(1)));
        assert_eq!(status(&server, &secret, rank_job, "succeeded", "Trained 100 steps.").await, 204);
        assert_eq!(job(&server, &token, &id).await["state"], "succeeded", "{backend:?}");
    }
}

#[tokio::test]
async fn a_worker_that_dies_instead_of_checkpointing_is_requeued_as_a_lost_lease() {
    for backend in backends() {
        let server = TestServer::start_tweaked(backend, |c| c.lease_ttl_secs = 1).await;
        let token = server.admin().await;
        let data = server.toy_dataset(&token).await;
        let id = submit(&server, &token, body(&data, json!({"resources": {"preemptible": true}}))).await;
        let (_, secret) = server.register_worker("w").await;
        claim(&server, &secret).await.unwrap();
        assert_eq!(preempt(&server, &token, &id, json!({})).await.0, 202);
        tokio::time::sleep(Duration::from_millis(1200)).await;
        assert_eq!(jobs_store::expire_leases(&server.state.db).await.unwrap(), 1);
        // No checkpoint came: the attempt counts, and it resumes from its last periodic one.
        let requeued = job(&server, &token, &id).await;
        assert_eq!(requeued["state"], "queued", "{backend:?}");
        assert_eq!((requeued["attempts"].as_u64(), requeued["preemptions"].as_u64()), (Some(1), Some(0)));
        let (_, secret2) = server.register_worker("w2").await;
        claim(&server, &secret2).await.unwrap();
        assert!(heartbeat(&server, &secret2, &[&id]).await.get("preempt").is_none(), "the request died with it");
    }
}
