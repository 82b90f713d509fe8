//! Data-parallel training jobs as gangs, over real HTTP on SQLite and PostgreSQL: ranks
//! are claimed all or none (a gang that does not form in time is released with no
//! attempt spent), they rendezvous through the server, a lost rank requeues the whole
//! gang, rank timings and logs land on the gang's job, and the job ends with its ranks.

mod support;

use std::time::Duration;

use serde_json::{json, Value};
use support::{backends, Backend, TestServer};
use tessera_server::store::db::now_ms;
use tessera_server::store::gangs;

fn body(dataset: &str, ranks: Value) -> Value {
    json!({"name": "dp", "model": {"kind": "mlp", "hidden": [8]}, "dataset": dataset,
        "task": {"type": "classification", "label_column": "label", "validation_split": 0.25},
        "optimizer": {"type": "sgd"}, "batch_size": 8, "max_steps": 10, "eval_every": 5, "checkpoint_every": 5,
        "lr_schedule": {"type": "constant", "lr": 0.1}, "seed": 1, "max_attempts": 2, "parallel": {"ranks": ranks}})
}

async fn claim(server: &TestServer, secret: &str) -> Option<Value> {
    let response = server.post(secret, "/agent/claim", json!({"kinds": ["train", "train_rank"]})).await;
    match response.status().as_u16() {
        204 => None,
        200 => Some(response.json().await.unwrap()),
        other => panic!("claim answered {other}"),
    }
}

async fn rendezvous(server: &TestServer, secret: &str, rank_job: &str, port: u16) -> (u16, Value) {
    let path = format!("/agent/jobs/{rank_job}/rendezvous");
    let response = server.post(secret, &path, json!({"address": format!("127.0.0.1:{port}")})).await;
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

async fn job(server: &TestServer, token: &str, id: &str) -> Value {
    server.get(token, &format!("/jobs/{id}")).await.json().await.unwrap()
}

/// Registers `n` workers and has each claim one rank; returns (secret, rank job id, rank).
async fn claim_ranks(server: &TestServer, names: &[&str]) -> Vec<(String, String, u64)> {
    let mut held = Vec::new();
    for name in names {
        let (_, secret) = server.register_worker(name).await;
        let assignment = claim(server, &secret).await.expect("a rank to claim");
        assert_eq!(assignment["spec"]["kind"], "train_rank");
        let rank = assignment["spec"]["rank"].as_u64().unwrap();
        held.push((secret, assignment["job_id"].as_str().unwrap().to_string(), rank));
    }
    held
}

#[tokio::test]
async fn a_gang_is_claimed_all_or_none() {
    for backend in backends() {
        let server = TestServer::start_tweaked(backend, |c| c.gang_rendezvous_secs = 1).await;
        let token = server.admin().await;
        let data = server.toy_dataset(&token).await;
        let response = server
            .post(&token, "/jobs", body(&data, json!([{"device": "cpu"}, {"device": "cpu"}, {"device": "cpu"}])))
            .await;
        assert_eq!(response.status(), 201);
        let created: Value = response.json().await.unwrap();
        let id = created["id"].as_str().unwrap().to_string();
        assert_eq!(created["spec"]["parallel"]["ranks"].as_array().unwrap().len(), 3);
        let listed: Vec<Value> = server.get(&token, "/jobs").await.json().await.unwrap();
        assert_eq!(listed.len(), 1, "the ranks are the job's, not jobs of their own ({backend:?})");

        // Two of three ranks claimed: they wait, then the gang is released, no attempt spent.
        let two = claim_ranks(&server, &["a", "b"]).await;
        assert_eq!(two.iter().map(|h| h.2).collect::<Vec<_>>(), [0, 1], "lowest ranks first");
        for (secret, rank_job, rank) in &two {
            let (status, answer) = rendezvous(&server, secret, rank_job, 7000 + *rank as u16).await;
            assert_eq!((status, answer), (200, json!({"state": "waiting"})), "{backend:?}");
        }
        assert_eq!(job(&server, &token, &id).await["state"], "queued");
        tokio::time::sleep(Duration::from_millis(1300)).await;
        let (status, _) = rendezvous(&server, &two[0].0, &two[0].1, 7000).await;
        assert_eq!(status, 409, "released after the rendezvous time-out ({backend:?})");
        let (status, _) = rendezvous(&server, &two[1].0, &two[1].1, 7001).await;
        assert_eq!(status, 409);
        let released = job(&server, &token, &id).await;
        assert_eq!((released["state"].as_str(), released["attempts"].as_u64()), (Some("queued"), Some(0)));

        // All three claimed and posted: the gang forms, every rank gets every address.
        let three = claim_ranks(&server, &["c", "d", "e"]).await;
        assert_eq!(three.iter().map(|h| h.2).collect::<Vec<_>>(), [0, 1, 2], "the released ranks are claimable again");
        let mut answers = Vec::new();
        for (secret, rank_job, rank) in &three {
            answers.push(rendezvous(&server, secret, rank_job, 7100 + *rank as u16).await);
        }
        assert_eq!(answers[0].1, json!({"state": "waiting"}));
        let formed = json!({"state": "formed", "generation": 1,
            "peers": ["127.0.0.1:7100", "127.0.0.1:7101", "127.0.0.1:7102"]});
        assert_eq!(answers[2].1, formed, "{backend:?}");
        let again = rendezvous(&server, &three[0].0, &three[0].1, 7100).await;
        assert_eq!(again.1, formed, "an earlier rank learns it on its next poll");
        let running = job(&server, &token, &id).await;
        assert_eq!((running["state"].as_str(), running["attempts"].as_u64()), (Some("running"), Some(1)));

        // Cancelling the job stops every rank at its worker's next heartbeat.
        assert_eq!(server.post(&token, &format!("/jobs/{id}/cancel"), json!({})).await.status(), 200);
        for (secret, rank_job, _) in &three {
            let beat: Value =
                server.post(secret, "/agent/heartbeat", json!({"jobs": [rank_job]})).await.json().await.unwrap();
            assert_eq!(beat["stop"], json!([rank_job]), "{backend:?}");
        }

        // A rank that fails before its gang forms fails the job (the gang would never form).
        let response = server.post(&token, "/jobs", body(&data, json!([{"device": "cpu"}, {"device": "cpu"}]))).await;
        let early: Value = response.json().await.unwrap();
        let ranks = claim_ranks(&server, &["f"]).await;
        let failure = json!({"state": "failed", "message": "no CUDA here"});
        assert_eq!(
            server.post(&ranks[0].0, &format!("/agent/jobs/{}/status", ranks[0].1), failure).await.status(),
            204
        );
        let failed = job(&server, &token, early["id"].as_str().unwrap()).await;
        assert_eq!(
            (failed["state"].as_str(), failed["message"].as_str()),
            (Some("failed"), Some("Rank 0 failed: no CUDA here"))
        );

        // A worker offering no GPU never claims a CUDA rank.
        let response = server.post(&token, "/jobs", body(&data, json!([{"device": "cuda"}, {"device": "cuda"}]))).await;
        assert_eq!(response.status(), 201);
        let (_, secret) = server.register_worker("cpu-only").await;
        assert!(claim(&server, &secret).await.is_none(), "{backend:?}");
    }
}

/// Ranks that post at the same moment, round after round as workers poll, form their gang
/// once. On PostgreSQL two rendezvous that each held their own rank row and both saw the
/// gang complete deadlocked (a 500, and the job failed), until every rendezvous locked the
/// gang's row first.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ranks_posting_at_once_form_their_gang_once() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let token = server.admin().await;
        let data = server.toy_dataset(&token).await;
        for attempt in 0..5 {
            let ranks = json!([{"device": "cpu"}, {"device": "cpu"}, {"device": "cpu"}, {"device": "cpu"}]);
            let created: Value = server.post(&token, "/jobs", body(&data, ranks)).await.json().await.unwrap();
            let names: Vec<String> = (0..4).map(|r| format!("w{attempt}-{r}")).collect();
            let held = claim_ranks(&server, &names.iter().map(String::as_str).collect::<Vec<_>>()).await;
            let mut formed = 0;
            for _round in 0..20 {
                let answers = futures_util::future::join_all(
                    held.iter()
                        .map(|(secret, rank_job, rank)| rendezvous(&server, secret, rank_job, 7300 + *rank as u16)),
                )
                .await;
                for (status, answer) in &answers {
                    assert_eq!(*status, 200, "{answer} ({backend:?})");
                }
                formed = answers.iter().filter(|(_, a)| a["state"] == "formed").count();
                if formed == 4 {
                    assert!(answers.iter().all(|(_, a)| a["generation"] == 1), "{answers:?}");
                    break;
                }
            }
            assert_eq!(formed, 4, "every rank learns its gang formed ({backend:?})");
            let running = job(&server, &token, created["id"].as_str().unwrap()).await;
            assert_eq!((running["state"].as_str(), running["attempts"].as_u64()), (Some("running"), Some(1)));
        }
    }
}

#[tokio::test]
async fn a_lost_rank_requeues_the_gang_and_rank_reports_land_on_its_job() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let token = server.admin().await;
        let data = server.toy_dataset(&token).await;
        let created: Value = server
            .post(&token, "/jobs", body(&data, json!([{"device": "cpu", "threads": 1}, {"device": "cpu"}])))
            .await
            .json()
            .await
            .unwrap();
        let id = created["id"].as_str().unwrap().to_string();
        let ranks = claim_ranks(&server, &["a", "b"]).await;
        for (secret, rank_job, rank) in &ranks {
            rendezvous(&server, secret, rank_job, 7200 + *rank as u16).await;
        }
        assert_eq!(job(&server, &token, &id).await["state"], "running");

        // Rank 0 reports the job's metrics and its timing, rank 1 only its own timing.
        let (secret0, rank0, _) = &ranks[0];
        let (secret1, rank1, _) = &ranks[1];
        let report = json!({"steps": [{"step": 1, "loss": 0.5, "lr": 0.1}],
            "ranks": [{"rank": 0, "step": 1, "iter_ms": 9.0, "wait_ms": 1.0, "allreduce_ms": 2.0}]});
        let response = server.post(secret0, &format!("/agent/jobs/{rank0}/training-metrics"), report).await;
        assert_eq!(response.status(), 204);
        let spoofed = json!({"ranks": [{"rank": 0, "step": 1, "iter_ms": 1.0, "wait_ms": 0.0, "allreduce_ms": 0.0}]});
        let response = server.post(secret1, &format!("/agent/jobs/{rank1}/training-metrics"), spoofed).await;
        assert_eq!(response.status(), 422, "a rank reports its own timings only");
        let own = json!({"ranks": [{"rank": 1, "step": 1, "iter_ms": 8.0, "wait_ms": 3.0, "allreduce_ms": 2.0}]});
        assert_eq!(server.post(secret1, &format!("/agent/jobs/{rank1}/training-metrics"), own).await.status(), 204);
        assert_eq!(
            server.post(secret1, &format!("/agent/jobs/{rank1}/logs"), json!({"lines": ["hello"]})).await.status(),
            204
        );
        let metrics: Value = server.get(&token, &format!("/jobs/{id}/metrics")).await.json().await.unwrap();
        assert_eq!(metrics["steps"], json!([{"step": 1, "loss": 0.5, "lr": 0.1}]));
        assert_eq!(
            metrics["ranks"],
            json!([{"rank": 0, "step": 1, "iter_ms": 9.0, "wait_ms": 1.0, "allreduce_ms": 2.0},
                   {"rank": 1, "step": 1, "iter_ms": 8.0, "wait_ms": 3.0, "allreduce_ms": 2.0}])
        );
        assert_eq!(job(&server, &token, &id).await["progress"]["step"], 1);
        let logs: Vec<Value> = server.get(&token, &format!("/jobs/{id}/logs")).await.json().await.unwrap();
        assert_eq!(logs.last().unwrap()["line"], "rank 1: hello");

        // Rank 1's worker restarts (proving itself with its last secret): the gang's
        // attempt ends, both ranks go back.
        server.rejoin_worker("b", secret1).await;
        let swept = gangs::sweep(&server.state.db, now_ms(), None).await.unwrap();
        assert_eq!(swept.requeued, 1, "{backend:?}");
        let requeued = job(&server, &token, &id).await;
        assert_eq!(requeued["state"], "queued");
        assert!(requeued["message"].as_str().unwrap().contains("Rank 1 was lost"), "{requeued}");
        let beat: Value =
            server.post(secret0, "/agent/heartbeat", json!({"jobs": [rank0]})).await.json().await.unwrap();
        assert_eq!(beat["stop"], json!([rank0]), "the surviving rank is told to stop");

        // The second attempt forms, both ranks succeed, and so does the job.
        let ranks = claim_ranks(&server, &["c", "d"]).await;
        let mut last = Value::Null;
        for (secret, rank_job, rank) in &ranks {
            last = rendezvous(&server, secret, rank_job, 7300 + *rank as u16).await.1;
        }
        assert_eq!(last["generation"], 2);
        for (secret, rank_job, _) in &ranks {
            let done = json!({"state": "succeeded", "message": "Trained 10 steps."});
            assert_eq!(server.post(secret, &format!("/agent/jobs/{rank_job}/status"), done).await.status(), 204);
        }
        let finished = job(&server, &token, &id).await;
        assert_eq!(
            (finished["state"].as_str(), finished["message"].as_str()),
            (Some("succeeded"), Some("Trained 10 steps."))
        );

        // A gang out of attempts fails; a rank reporting a failure fails the job at once.
        let created: Value = server
            .post(&token, "/jobs", body(&data, json!([{"device": "cpu"}, {"device": "cpu"}])))
            .await
            .json()
            .await
            .unwrap();
        let id = created["id"].as_str().unwrap().to_string();
        let ranks = claim_ranks(&server, &["e", "f"]).await;
        for (secret, rank_job, rank) in &ranks {
            rendezvous(&server, secret, rank_job, 7400 + *rank as u16).await;
        }
        let failure = json!({"state": "failed", "message": "dataset: no rows"});
        assert_eq!(
            server.post(&ranks[1].0, &format!("/agent/jobs/{}/status", ranks[1].1), failure).await.status(),
            204
        );
        let failed = job(&server, &token, &id).await;
        assert_eq!(failed["state"], "failed", "{backend:?}");
        assert_eq!(failed["message"], "Rank 1 failed: dataset: no rows");
        let beat: Value =
            server.post(&ranks[0].0, "/agent/heartbeat", json!({"jobs": [ranks[0].1]})).await.json().await.unwrap();
        assert_eq!(beat["stop"], json!([ranks[0].1]));
    }
}

/// `slice_rank` asks only for a rank pinned to one of the worker's slices (it holds the
/// slice, not a batch slot): a rank on a device placement waits for a `train_rank` claim.
#[tokio::test]
async fn a_slice_rank_claim_gets_no_device_rank() {
    let server = TestServer::start(Backend::Sqlite).await;
    let token = server.admin().await;
    let data = server.toy_dataset(&token).await;
    let (_, secret) = server.register_worker("w").await;
    let response = server.post(&token, "/jobs", body(&data, json!([{"device": "cpu"}, {"device": "cpu"}]))).await;
    assert_eq!(response.status(), 201);
    let response = server.post(&secret, "/agent/claim", json!({"kinds": ["slice_rank"]})).await;
    assert_eq!(response.status(), 204);
    assert!(claim(&server, &secret).await.is_some(), "a train_rank claim gets it");
}

/// Every rank connects to the addresses posted: one whose host holds a NUL (which
/// PostgreSQL cannot store), another control character or a space is a 422, not a peer.
#[tokio::test]
async fn a_ring_address_whose_host_no_rank_can_reach_is_a_422() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let token = server.admin().await;
        let data = server.toy_dataset(&token).await;
        let response = server.post(&token, "/jobs", body(&data, json!([{"device": "cpu"}, {"device": "cpu"}]))).await;
        assert_eq!(response.status(), 201);
        let held = claim_ranks(&server, &["a"]).await;
        let (secret, rank_job, _) = &held[0];
        let path = format!("/agent/jobs/{rank_job}/rendezvous");
        for address in ["10.0.0.1\u{0}:7000", "host\n:7000", "my host:7000"] {
            let response = server.post(secret, &path, json!({"address": address})).await;
            assert_eq!(response.status(), 422, "{backend:?} {address:?}");
            let error: Value = response.json().await.unwrap();
            assert_eq!(error["error"]["code"], "invalid_address", "{backend:?}");
        }
        let (status, answer) = rendezvous(&server, secret, rank_job, 7000).await;
        assert_eq!((status, answer), (200, json!({"state": "waiting"})), "{backend:?}");
    }
}

#[tokio::test]
async fn parallel_specs_get_a_422_naming_the_field() {
    let server = TestServer::start(Backend::Sqlite).await;
    let token = server.admin().await;
    let data = server.toy_dataset(&token).await;
    let cases = [
        (json!([]), "parallel.ranks"),
        (json!([{"device": "cpu"}, {"device": "cuda", "threads": 2}]), "parallel.ranks[1].threads"),
        (json!([{"device": "cpu"}, {"device": "cpu", "slice": "1g.10gb"}]), "parallel.ranks[1]"),
        (json!([{"device": "cpu"}, {"slice": ""}]), "parallel.ranks[1].slice"),
        (json!([{"device": "cpu"}, {"device": "tpu"}]), "parallel.ranks[1].device"),
        (json!([{"device": "cpu"}, {"gpu": 0}]), "parallel.ranks[1]"),
        (json!((0..9).map(|_| json!({"device": "cpu"})).collect::<Vec<_>>()), "batch_size"),
    ];
    for (ranks, field) in cases {
        let response = server.post(&token, "/jobs", body(&data, ranks)).await;
        assert_eq!(response.status(), 422, "{field}");
        let error: Value = response.json().await.unwrap();
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains(field), "the message {message:?} should name {field:?}");
    }
}

async fn regroup(server: &TestServer, secret: &str, rank_job: &str, port: u16, generation: u32) -> (u16, Value) {
    let path = format!("/agent/jobs/{rank_job}/regroup");
    let body = json!({"address": format!("127.0.0.1:{port}"), "generation": generation});
    let response = server.post(secret, &path, body).await;
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

async fn told_to_stop(server: &TestServer, secret: &str, rank_job: &str) -> bool {
    let beat: Value = server.post(secret, "/agent/heartbeat", json!({"jobs": [rank_job]})).await.json().await.unwrap();
    beat["preempt"].as_array().is_some_and(|jobs| jobs.iter().any(|j| j == rank_job))
}

/// `gangs::regroup_in_place` for the running gang `id`, from `from` to `to` ranks.
async fn ask_regroup(server: &TestServer, id: &str, (from, to): (u32, u32), leaving: &[&str]) -> bool {
    let id: uuid::Uuid = id.parse().unwrap();
    let Some(tessera_api::jobs::JobSpec::Train(train)) =
        tessera_server::store::jobs::spec(&server.state.db, id).await.unwrap()
    else {
        panic!("a training job")
    };
    let leaving: Vec<uuid::Uuid> = leaving.iter().map(|j| j.parse().unwrap()).collect();
    tessera_server::gangs::regroup_in_place(&server.state, id, &train, (from, to), &leaving, &[]).await.unwrap()
}

#[tokio::test]
async fn a_running_gang_grows_and_shrinks_in_place() {
    for backend in backends() {
        let server = TestServer::start_tweaked(backend, |c| c.gang_rendezvous_secs = 2).await;
        let token = server.admin().await;
        let data = server.toy_dataset(&token).await;
        let mut spec = body(&data, json!([{"device": "cpu"}, {"device": "cpu"}, {"device": "cpu"}]));
        spec["resources"] = json!({"min_ranks": 1, "max_ranks": 3, "preemptible": true});
        let created: Value = server.post(&token, "/jobs", spec).await.json().await.unwrap();
        let id = created["id"].as_str().unwrap().to_string();
        tessera_server::gangs::resize(&server.state.db, id.parse().unwrap(), 2).await.unwrap();
        let two = claim_ranks(&server, &["a", "b"]).await;
        for (secret, rank_job, rank) in &two {
            rendezvous(&server, secret, rank_job, 7300 + *rank as u16).await;
        }
        assert_eq!(job(&server, &token, &id).await["state"], "running");
        let (a, b) = (&two[0], &two[1]);

        // Bad input to the regroup endpoint: a 422 or, for a body of the wrong shape, a 400,
        // each with a sentence; nothing changed.
        let path = format!("/agent/jobs/{}/regroup", a.1);
        let bad = [
            (json!({"address": "no-port", "generation": 1}), 422, "host:port"),
            (json!({"address": "127.0.0.1:7400", "generation": -1}), 400, "generation"),
        ];
        for (body, status, names) in bad {
            let response = server.post(&a.0, &path, body.clone()).await;
            assert_eq!(response.status(), status, "{body}");
            let error: Value = response.json().await.unwrap();
            assert!(error["error"]["message"].as_str().is_some_and(|m| m.contains(names)), "{error}");
        }
        assert_eq!(job(&server, &token, &id).await["state"], "running");

        // Grow 2 → 3: the gang trains on until the joining rank is ready, then stops.
        assert!(ask_regroup(&server, &id, (2, 3), &[]).await, "{backend:?}");
        assert!(!ask_regroup(&server, &id, (2, 1), &[]).await, "one regroup at a time");
        assert!(!told_to_stop(&server, &a.0, &a.1).await, "not before the joining rank is ready ({backend:?})");
        let c = claim_ranks(&server, &["c"]).await.remove(0);
        assert_eq!(job(&server, &token, &id).await["state"], "running", "the gang runs while a rank joins");
        assert_eq!(regroup(&server, &c.0, &c.1, 7402, 0).await, (200, json!({"state": "waiting"})));
        assert!(told_to_stop(&server, &a.0, &a.1).await, "{backend:?}");
        assert!(told_to_stop(&server, &b.0, &b.1).await);
        assert_eq!(regroup(&server, &a.0, &a.1, 7400, 1).await, (200, json!({"state": "waiting"})));
        let peers = json!(["127.0.0.1:7400", "127.0.0.1:7401", "127.0.0.1:7402"]);
        let formed = |rank: u32| json!({"state": "formed", "generation": 2, "rank": rank, "world": 3, "peers": peers});
        assert_eq!(regroup(&server, &b.0, &b.1, 7401, 1).await, (200, formed(1)), "{backend:?}");
        assert_eq!(regroup(&server, &a.0, &a.1, 7400, 1).await, (200, formed(0)), "learnt on the next poll");
        assert_eq!(regroup(&server, &c.0, &c.1, 7402, 0).await, (200, formed(2)));
        assert!(!told_to_stop(&server, &a.0, &a.1).await, "the stop request ends with the regroup");
        let grown = job(&server, &token, &id).await;
        assert_eq!((grown["state"].as_str(), grown["attempts"].as_u64()), (Some("running"), Some(1)), "no attempt spent");

        // Shrink 3 → 2 without rank 0: it leaves, the others are numbered afresh.
        assert!(ask_regroup(&server, &id, (3, 2), &[&a.1]).await, "{backend:?}");
        assert!(told_to_stop(&server, &b.0, &b.1).await, "nobody joins: the ranks stop at once");
        assert_eq!(regroup(&server, &b.0, &b.1, 7501, 2).await, (200, json!({"state": "waiting"})));
        let waiting = regroup(&server, &c.0, &c.1, 7502, 2).await;
        assert_eq!(waiting, (200, json!({"state": "waiting"})), "not before the leaving rank stopped ({backend:?})");
        assert_eq!(regroup(&server, &a.0, &a.1, 7500, 2).await, (200, json!({"state": "leave"})), "{backend:?}");
        let shrunk = |rank: u32| {
            json!({"state": "formed", "generation": 3, "rank": rank, "world": 2,
                "peers": ["127.0.0.1:7501", "127.0.0.1:7502"]})
        };
        assert_eq!(regroup(&server, &c.0, &c.1, 7502, 2).await, (200, shrunk(1)), "{backend:?}");
        assert_eq!(regroup(&server, &a.0, &a.1, 7500, 2).await.0, 409, "the leaving rank's row is gone");
        let logs: Value = server.get(&token, &format!("/jobs/{id}/logs")).await.json().await.unwrap();
        let said = logs.as_array().unwrap().iter().any(|l| l["line"] == "rank 0: left the gang, which shrank in place");
        assert!(said, "the server logs the leaving rank under the gang: {logs}");
        assert_eq!(regroup(&server, &b.0, &b.1, 7501, 2).await, (200, shrunk(0)));

        // A regroup not formed in time becomes a stop and a restart at the new size.
        assert!(ask_regroup(&server, &id, (2, 3), &[]).await);
        tokio::time::sleep(Duration::from_millis(2200)).await;
        gangs::sweep(&server.state.db, now_ms(), None).await.unwrap();
        assert!(claim(&server, &c.0).await.is_none(), "the joining rank went with its regroup ({backend:?})");
        assert!(told_to_stop(&server, &b.0, &b.1).await);
        assert_eq!(regroup(&server, &b.0, &b.1, 7601, 3).await, (200, json!({"state": "stop"})), "{backend:?}");
        for (secret, rank_job) in [(&b.0, &b.1), (&c.0, &c.1)] {
            let preempted = json!({"state": "preempted", "message": "Preempted at step 4."});
            let path = format!("/agent/jobs/{rank_job}/status");
            assert_eq!(server.post(secret, &path, preempted).await.status(), 204, "{backend:?}");
        }
        gangs::sweep(&server.state.db, now_ms(), None).await.unwrap();
        let stopped = job(&server, &token, &id).await;
        assert_eq!(stopped["state"], "preempted", "{backend:?}");
        let gangs_now = tessera_server::store::loaning::slice_gangs(&server.state.db).await.unwrap();
        assert!(gangs_now.is_empty(), "a CPU gang is not the loaning round's");
        let resize: Option<i64> = sqlx::query_scalar("SELECT resize_ranks FROM jobs WHERE id = $1")
            .bind(&id)
            .fetch_one(server.state.db.pool())
            .await
            .unwrap();
        assert_eq!(resize, Some(3), "it restarts at the size the regroup was for");
    }
}

/// A rank told to leave a shrinking gang has stopped for good: when the shrink is then
/// called off (here it does not form in time), the rank stays stopped as a preempted one,
/// so the gang stops at its checkpoint as asked, not a lease later as a gang that lost a
/// rank (an attempt spent).
#[tokio::test]
async fn a_rank_that_left_a_shrink_called_off_counts_as_stopped() {
    for backend in backends() {
        let server = TestServer::start_tweaked(backend, |c| c.gang_rendezvous_secs = 2).await;
        let token = server.admin().await;
        let data = server.toy_dataset(&token).await;
        let mut spec = body(&data, json!([{"device": "cpu"}, {"device": "cpu"}]));
        spec["resources"] = json!({"min_ranks": 1, "max_ranks": 2, "preemptible": true});
        let created: Value = server.post(&token, "/jobs", spec).await.json().await.unwrap();
        let id = created["id"].as_str().unwrap().to_string();
        let two = claim_ranks(&server, &["a", "b"]).await;
        for (secret, rank_job, rank) in &two {
            rendezvous(&server, secret, rank_job, 7700 + *rank as u16).await;
        }
        let (a, b) = (&two[0], &two[1]);
        assert!(ask_regroup(&server, &id, (2, 1), &[&b.1]).await, "{backend:?}");
        assert_eq!(regroup(&server, &b.0, &b.1, 7801, 1).await, (200, json!({"state": "leave"})), "{backend:?}");
        // Its worker no longer renews its lease, which lapses.
        let lapsed = sqlx::query("UPDATE jobs SET lease_expires_at = $1 WHERE id = $2").bind(now_ms() - 1).bind(&b.1);
        lapsed.execute(server.state.db.pool()).await.unwrap();
        assert_eq!(tessera_server::store::jobs::expire_leases(&server.state.db).await.unwrap(), 1);
        // Rank 0 does not post in time: the shrink becomes a stop and a restart at one rank.
        tokio::time::sleep(Duration::from_millis(2200)).await;
        gangs::sweep(&server.state.db, now_ms(), None).await.unwrap();
        assert_eq!(regroup(&server, &a.0, &a.1, 7800, 1).await, (200, json!({"state": "stop"})), "{backend:?}");
        let preempted = json!({"state": "preempted", "message": "Preempted at step 4."});
        assert_eq!(server.post(&a.0, &format!("/agent/jobs/{}/status", a.1), preempted).await.status(), 204);
        gangs::sweep(&server.state.db, now_ms(), None).await.unwrap();
        let stopped = job(&server, &token, &id).await;
        let stopped = (stopped["state"].as_str(), stopped["attempts"].as_u64());
        assert_eq!(stopped, (Some("preempted"), Some(0)), "{backend:?}");
    }
}

/// A sweep reads each gang under its row lock: a gang whose last rank forms it while a
/// sweep is about to release it for its passed deadline runs on, its ranks running (a sweep
/// that acted on what it read before its transaction sent them back to the queue under
/// a running gang). PostgreSQL only: SQLite's transactions take the write lock at once.
#[tokio::test]
async fn a_gang_formed_while_a_sweep_waits_on_it_runs_on() {
    for backend in backends().into_iter().filter(|b| *b == Backend::Postgres) {
        let server = TestServer::start(backend).await;
        let token = server.admin().await;
        let data = server.toy_dataset(&token).await;
        let spec = body(&data, json!([{"device": "cpu"}, {"device": "cpu"}]));
        let created: Value = server.post(&token, "/jobs", spec).await.json().await.unwrap();
        let id = created["id"].as_str().unwrap().to_string();
        let ranks = claim_ranks(&server, &["a", "b"]).await;
        rendezvous(&server, &ranks[0].0, &ranks[0].1, 7900).await;
        let pool = server.state.db.pool();
        let passed = sqlx::query("UPDATE jobs SET gang_deadline = $1 WHERE id = $2").bind(now_ms() - 1000).bind(&id);
        passed.execute(pool).await.unwrap();
        // The last rank's rendezvous, held open: it forms the gang under the gang's row lock.
        let mut forming = pool.begin().await.unwrap();
        sqlx::query("SELECT id FROM jobs WHERE id = $1 FOR UPDATE").bind(&id).fetch_one(&mut *forming).await.unwrap();
        sqlx::query("UPDATE jobs SET gang_address = '127.0.0.1:7901' WHERE id = $1")
            .bind(&ranks[1].1)
            .execute(&mut *forming)
            .await
            .unwrap();
        sqlx::query("UPDATE jobs SET state = 'running', attempts = attempts + 1, gang_deadline = NULL WHERE id = $1")
            .bind(&id)
            .execute(&mut *forming)
            .await
            .unwrap();
        let ranks_run = sqlx::query("UPDATE jobs SET state = 'running' WHERE gang_id = $1").bind(&id);
        ranks_run.execute(&mut *forming).await.unwrap();
        let db = server.state.db.clone();
        let sweep = tokio::spawn(async move { gangs::sweep(&db, now_ms(), None).await.unwrap() });
        tokio::time::sleep(Duration::from_millis(300)).await;
        forming.commit().await.unwrap();
        assert_eq!(sweep.await.unwrap().released, 0);
        let states: Vec<String> = sqlx::query_scalar("SELECT state FROM jobs WHERE id = $1 OR gang_id = $1 ORDER BY id")
            .bind(&id)
            .fetch_all(pool)
            .await
            .unwrap();
        assert_eq!(states, ["running"; 3]);
    }
}
