//! Deployments over real HTTP: replicas are placed through the leased queue, become
//! ready when a worker reports its engine endpoint, are re-placed when a worker dies, and
//! scale up and down.

mod support;

use serde_json::{json, Value};
use support::{backends, tiny_model, TestServer};

async fn deploy(server: &TestServer, token: &str, replicas: u32) -> Value {
    let response = server.upload_model(token, "tiny", tiny_model()).await;
    assert_eq!(response.status(), 201);
    let response = server.post(token, "/deployments", json!({"name": "embedder", "model": "tiny", "replicas": replicas})).await;
    assert_eq!(response.status(), 201);
    response.json().await.unwrap()
}

async fn claim_serve(server: &TestServer, secret: &str) -> Option<Value> {
    let response = server.post(secret, "/agent/claim", json!({"kinds": ["serve"]})).await;
    if response.status() != 200 {
        return None;
    }
    response.json().await.ok()
}

#[tokio::test]
async fn replicas_go_from_pending_to_ready_through_the_queue() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let created = deploy(&server, &admin, 2).await;
        assert_eq!(created["state"], "pending");
        assert!(created["reason"].as_str().unwrap().contains("waiting for a worker"));
        assert_eq!(created["replica_status"].as_array().unwrap().len(), 2);

        let (_, secret) = server.register_worker("gpu-1").await;
        let first = claim_serve(&server, &secret).await.expect("a replica to serve");
        assert_eq!(first["spec"]["kind"], "serve");
        assert_eq!(first["spec"]["max_batch_tokens"], 16384);
        let deployment: Value = server.get(&admin, "/deployments/embedder").await.json().await.unwrap();
        assert_eq!(deployment["state"], "loading");

        let job = first["job_id"].as_str().unwrap();
        let report = json!({"state": "running", "endpoint": "http://127.0.0.1:9/replicas/x"});
        assert_eq!(server.post(&secret, &format!("/agent/jobs/{job}/status"), report).await.status(), 204);
        let second = claim_serve(&server, &secret).await.unwrap();
        let job2 = second["job_id"].as_str().unwrap();
        let report = json!({"state": "running", "endpoint": "http://127.0.0.1:9/replicas/y"});
        server.post(&secret, &format!("/agent/jobs/{job2}/status"), report).await;
        let deployment: Value = server.get(&admin, "/deployments/embedder").await.json().await.unwrap();
        assert_eq!((deployment["state"].as_str(), deployment["ready_replicas"].as_u64()), (Some("ready"), Some(2)));

        // Scaling down stops one replica: its worker is told at the next heartbeat.
        let response = server.http.patch(server.api("/deployments/embedder")).bearer_auth(&admin).json(&json!({"replicas": 1})).send().await.unwrap();
        assert_eq!(response.status(), 200);
        let beat: Value = server.post(&secret, "/agent/heartbeat", json!({"jobs": [job, job2]})).await.json().await.unwrap();
        assert_eq!(beat["stop"].as_array().unwrap().len(), 1);
        let deployment: Value = server.get(&admin, "/deployments/embedder").await.json().await.unwrap();
        assert_eq!((deployment["state"].as_str(), deployment["replicas"].as_u64()), (Some("ready"), Some(1)));

        // Scaling up queues a new replica; deleting stops everything.
        let response = server.http.patch(server.api("/deployments/embedder")).bearer_auth(&admin).json(&json!({"replicas": 3})).send().await.unwrap();
        let deployment: Value = response.json().await.unwrap();
        assert_eq!(deployment["replica_status"].as_array().unwrap().len(), 3);
        assert_eq!(server.delete(&admin, "/deployments/embedder").await.status(), 204);
        assert_eq!(server.get(&admin, "/deployments/embedder").await.status(), 404);
        let beat: Value = server.post(&secret, "/agent/heartbeat", json!({"jobs": [job, job2]})).await.json().await.unwrap();
        assert_eq!(beat["stop"].as_array().unwrap().len(), 2);
    }
}

#[tokio::test]
async fn a_replica_whose_worker_dies_is_placed_again() {
    let server = TestServer::start_tweaked(support::Backend::Sqlite, |config| config.lease_ttl_secs = 1).await;
    let admin = server.admin().await;
    deploy(&server, &admin, 1).await;
    let (_, dead) = server.register_worker("dies").await;
    let claimed = claim_serve(&server, &dead).await.unwrap();
    let job = claimed["job_id"].as_str().unwrap().to_string();
    server.post(&dead, &format!("/agent/jobs/{job}/status"), json!({"state": "running", "endpoint": "http://127.0.0.1:9/r"})).await;
    // No heartbeat: the lease runs out and the server's expiry loop requeues the replica.
    tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
    tessera_server::store::jobs::expire_leases(&server.state.db).await.unwrap();
    let deployment: Value = server.get(&admin, "/deployments/embedder").await.json().await.unwrap();
    assert_eq!(deployment["state"], "pending", "{deployment}");
    let (_, alive) = server.register_worker("alive").await;
    let again = claim_serve(&server, &alive).await.unwrap();
    assert_eq!((again["job_id"].as_str(), again["attempt"].as_u64()), (Some(job.as_str()), Some(2)));
}

/// A replica is its deployment's: cancelling it through the jobs API is a 409 naming how
/// to scale (it would leave the deployment a replica short, with nothing to queue another).
#[tokio::test]
async fn a_replica_cannot_be_cancelled_behind_its_deployment_s_back() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let created = deploy(&server, &admin, 1).await;
        let replica = created["replica_status"][0]["id"].as_str().unwrap();
        let response = server.post(&admin, &format!("/jobs/{replica}/cancel"), json!({})).await;
        assert_eq!(response.status(), 409, "{backend:?}");
        let error: Value = response.json().await.unwrap();
        assert!(error["error"]["message"].as_str().unwrap().contains("PATCH /api/v1/deployments/"), "{error}");
        let deployment: Value = server.get(&admin, "/deployments/embedder").await.json().await.unwrap();
        assert_eq!(deployment["replica_status"].as_array().unwrap().len(), 1, "{backend:?}: {deployment}");
    }
}

#[tokio::test]
async fn bad_deployments_are_refused_with_a_reason() {
    let server = TestServer::start(support::Backend::Sqlite).await;
    let admin = server.admin().await;
    let alice = server.user(&admin, "alice").await;
    deploy(&server, &admin, 1).await;
    for (body, status) in [
        (json!({"name": "embedder", "model": "tiny"}), 409),
        (json!({"name": "x y", "model": "tiny"}), 422),
        // A name that reads as an id would be taken for one.
        (json!({"name": "0b5e3c1e-7d1a-4a7e-9f3b-2c1d0e9f8a7b", "model": "tiny"}), 422),
        (json!({"name": "ok", "model": "missing"}), 404),
        (json!({"name": "ok", "model": "tiny", "replicas": 1000}), 422),
        (json!({"name": "ok", "model": "tiny", "max_batch_tokens": 10}), 422),
        (json!({"model": "tiny"}), 400),
    ] {
        let response = server.post(&admin, "/deployments", body.clone()).await;
        assert_eq!(response.status(), status, "{body}");
    }
    // Alice neither sees the admin's deployment nor may use the admin's model.
    assert_eq!(server.get(&alice, "/deployments/embedder").await.status(), 404);
    assert_eq!(server.post(&alice, "/deployments", json!({"name": "mine", "model": "tiny"})).await.status(), 404);
    let list: Vec<Value> = server.get(&alice, "/deployments").await.json().await.unwrap();
    assert!(list.is_empty());
}

/// A deployment scaled while another request deletes it gets a 404 saying so, not the
/// foreign key's 500 (its new replicas used to name a deployment no longer there), and
/// a deletion during a scale waits for it.
#[tokio::test]
async fn scaling_a_deployment_being_deleted_is_a_404_and_leaves_no_replica() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let db = &server.state.db;
        let admin = server.admin().await;
        let id = deploy(&server, &admin, 1).await["id"].as_str().unwrap().to_string();

        // A scale holds the row: the deletion waits for it.
        let mut scaling = db.begin().await.unwrap();
        let id_uuid = id.parse().unwrap();
        assert!(tessera_server::store::deployments::set_replicas(&mut scaling, id_uuid, 2).await.unwrap());
        let request = server.http.delete(server.api("/deployments/embedder")).bearer_auth(&admin);
        let deletion = support::send_into_a_lock(request).await;
        assert!(!deletion.is_finished(), "{backend:?}: the deletion did not wait for the scale");
        scaling.commit().await.unwrap();
        assert_eq!(deletion.await.unwrap().status(), 204, "{backend:?}");

        // A deletion holds the row: a scale sent meanwhile waits, then finds it gone.
        let response = server.post(&admin, "/deployments", json!({"name": "embedder", "model": "tiny"})).await;
        assert_eq!(response.status(), 201);
        let id = response.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_string();
        let mut deleting = db.begin().await.unwrap();
        sqlx::query("DELETE FROM deployments WHERE id = $1").bind(&id).execute(&mut *deleting).await.unwrap();
        let request = server.http.patch(server.api("/deployments/embedder")).bearer_auth(&admin);
        let scaled = support::send_into_a_lock(request.json(&json!({"replicas": 3}))).await;
        assert!(!scaled.is_finished(), "{backend:?}: the scale did not wait for the deletion");
        deleting.commit().await.unwrap();
        let response = scaled.await.unwrap();
        let (status, body) = (response.status(), response.text().await.unwrap());
        assert_eq!(status, 404, "{backend:?}: {body}");
        assert!(body.contains("was deleted meanwhile"), "{body}");
        let replicas: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM jobs WHERE deployment_id IS NOT NULL")
            .fetch_one(db.pool())
            .await
            .unwrap();
        assert_eq!(replicas, 0, "{backend:?}: replicas outlived their deployment");
    }
}

/// The repair tick restarts a replica that ended while its deployment is short: at once
/// the first time, then after a back-off that doubles; a replica that served has its
/// attempts counted afresh; a deployment scaled below its live replicas restarts none.
#[tokio::test]
async fn an_ended_replica_is_restarted_in_place_after_its_back_off() {
    use tessera_server::deployments::repair;
    use tessera_server::store::db::now_ms;
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        deploy(&server, &admin, 2).await;
        let (_, secret) = server.register_worker("gpu-1").await;
        let mut ids = Vec::new();
        for port in [1, 2] {
            let replica = claim_serve(&server, &secret).await.unwrap();
            let id = replica["job_id"].as_str().unwrap().to_string();
            let report = json!({"state": "running", "endpoint": format!("http://127.0.0.1:{port}/r")});
            assert_eq!(server.post(&secret, &format!("/agent/jobs/{id}/status"), report).await.status(), 204);
            ids.push(id);
        }
        let crashed = &ids[0];
        let report = json!({"state": "failed", "message": "the engine crashed"});
        assert_eq!(server.post(&secret, &format!("/agent/jobs/{crashed}/status"), report).await.status(), 204);
        let db = &server.state.db;
        assert_eq!(repair(db, now_ms(), 0).await.unwrap(), 1, "{backend:?}");
        let replica = |d: &Value| d["replica_status"].as_array().unwrap().iter().find(|r| r["id"] == crashed.as_str()).cloned().unwrap();
        let deployment: Value = server.get(&admin, "/deployments/embedder").await.json().await.unwrap();
        let restarted = replica(&deployment);
        assert_eq!((restarted["state"].as_str(), restarted["attempts"].as_u64()), (Some("pending"), Some(0)), "{deployment}");
        assert!(restarted["message"].as_str().unwrap().contains("Restarted after it ended: the engine crashed"), "{restarted}");
        assert_eq!(deployment["replica_status"].as_array().unwrap().len(), 2, "in place, not a new replica");

        // It fails again before serving: the next restart waits 10 s.
        let again = claim_serve(&server, &secret).await.unwrap();
        assert_eq!(again["job_id"].as_str(), Some(crashed.as_str()));
        let report = json!({"state": "failed", "message": "out of memory"});
        server.post(&secret, &format!("/agent/jobs/{crashed}/status"), report).await;
        assert_eq!(repair(db, now_ms(), 0).await.unwrap(), 0, "backing off");
        assert_eq!(repair(db, now_ms() + 10_500, 0).await.unwrap(), 1);

        // Released by a worker restart, placed again (attempt 2), then serving: attempts
        // count from 1 again.
        let again = claim_serve(&server, &secret).await.unwrap();
        assert_eq!(again["attempt"], 1);
        let (_, secret) = server.rejoin_worker("gpu-1", &secret).await;
        let mut placed = Vec::new();
        while let Some(replica) = claim_serve(&server, &secret).await {
            placed.push(replica["attempt"].as_u64().unwrap());
            let report = json!({"state": "running", "endpoint": "http://127.0.0.1:3/r"});
            server.post(&secret, &format!("/agent/jobs/{}/status", replica["job_id"].as_str().unwrap()), report).await;
        }
        assert_eq!(placed, [2, 2], "both were released by the restart");
        let deployment: Value = server.get(&admin, "/deployments/embedder").await.json().await.unwrap();
        assert!(deployment["replica_status"].as_array().unwrap().iter().all(|r| r["attempts"] == 1), "{deployment}");

        // Scaled to one with one serving: the other ending restarts nothing.
        let response = server.http.patch(server.api("/deployments/embedder")).bearer_auth(&admin)
            .json(&json!({"replicas": 1})).send().await.unwrap();
        assert_eq!(response.status(), 200);
        let live: Vec<String> = server.get(&admin, "/deployments/embedder").await.json::<Value>().await.unwrap()["replica_status"]
            .as_array().unwrap().iter().filter(|r| r["state"] == "ready").map(|r| r["id"].as_str().unwrap().to_string()).collect();
        assert_eq!(live.len(), 1);
        server.post(&secret, &format!("/agent/jobs/{}/status", live[0]), json!({"state": "failed"})).await;
        assert_eq!(repair(db, now_ms() + 3_600_000, 0).await.unwrap(), 1, "one replica wanted, none live");
        assert_eq!(repair(db, now_ms() + 3_600_000, 0).await.unwrap(), 0, "and then none short");
    }
}
