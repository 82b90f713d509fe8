//! MIG slices in the platform over real HTTP: workers report slices, replicas are bound
//! to one slice each, throughput-SLO deployments are planned on the fleet (repartitioning
//! idle simulated GPUs when allowed, saying what would change otherwise), and the
//! throughput tables come from profile jobs.

mod support;

use serde_json::{json, Value};
use support::{backends, tiny_model, Backend, TestServer, WORKER_TOKEN};

fn slice(worker: &str, gpu: usize, i: usize, model: &str, profile: Option<&str>) -> Value {
    json!({
        "uuid": match profile { Some(_) => format!("MIG-sim-{worker}-{gpu}-{i}"), None => format!("GPU-sim-{worker}-{gpu}") },
        "gpu_uuid": format!("GPU-sim-{worker}-{gpu}"), "gpu_index": gpu, "gpu_model": model,
        "profile": profile, "start": null, "memory_bytes": 10u64 << 30, "simulated": true
    })
}

/// Registers a worker offering simulated H100 slices with these profiles on GPU 0.
async fn register(server: &TestServer, name: &str, profiles: &[&str], allow_repartition: bool) -> reqwest::Response {
    rejoin(server, name, profiles, allow_repartition, None).await
}

/// `register`, presenting the secret of the worker's last registration (a restart).
async fn rejoin(server: &TestServer, name: &str, profiles: &[&str], allow_repartition: bool, previous_secret: Option<&str>) -> reqwest::Response {
    let slices: Vec<Value> = profiles.iter().enumerate().map(|(i, p)| slice(name, 0, i, "H100-80GB", Some(p))).collect();
    let inventory = json!({"hostname": name, "cpu_cores": 2, "memory_bytes": 1024, "slices": slices});
    let body = json!({"name": name, "version": "test", "inventory": inventory, "allow_repartition": allow_repartition,
                      "previous_secret": previous_secret});
    server.post(WORKER_TOKEN, "/agent/register", body).await
}

async fn secret_of(response: reqwest::Response) -> String {
    assert_eq!(response.status(), 200, "{}", response.text().await.unwrap());
    response.json::<Value>().await.unwrap()["secret"].as_str().unwrap().to_string()
}

async fn upload_tiny(server: &TestServer, token: &str) {
    let response = server.upload_model(token, "tiny", tiny_model()).await;
    assert_eq!(response.status(), 201);
}

async fn claim(server: &TestServer, secret: &str, kinds: &[&str]) -> Option<Value> {
    let response = server.post(secret, "/agent/claim", json!({"kinds": kinds})).await;
    if response.status() != 200 {
        return None;
    }
    Some(response.json().await.unwrap())
}

/// Records a measured throughput table for `tiny` through a profile job, as a worker would.
async fn profile(server: &TestServer, admin: &str, secret: &str, table: &[(&str, f64)]) {
    let job: Value = server.post(admin, "/models/tiny/profiles", json!({})).await.json().await.unwrap();
    assert_eq!(job["spec"]["kind"], "profile");
    assert_eq!(job["spec"]["batch_sizes"], json!([1, 2, 4, 8, 16, 32, 64]));
    let leased = claim(server, secret, &["profile"]).await.expect("the profile job");
    let id = leased["job_id"].as_str().unwrap();
    let reports: Vec<Value> = table
        .iter()
        .map(|(profile, throughput)| {
            json!({"gpu_model": "H100-80GB", "profile": profile, "simulated": true,
                   "points": [{"batch_size": 1, "throughput": throughput / 4.0, "p99_ms": 5.0},
                              {"batch_size": 16, "throughput": throughput, "p99_ms": 30.0},
                              {"batch_size": 64, "throughput": throughput * 1.2, "p99_ms": 120.0}]})
        })
        .collect();
    let response = server.post(secret, &format!("/agent/jobs/{id}/profiles"), json!(reports)).await;
    assert_eq!(response.status(), 204, "{}", response.text().await.unwrap());
    server.post(secret, &format!("/agent/jobs/{id}/status"), json!({"state": "succeeded"})).await;
}

/// The dashboard's MIG page, signed in as admin through the form.
async fn mig_page(server: &TestServer) -> String {
    let http = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
    let form = [("username", "admin"), ("password", support::ADMIN_PASSWORD), ("next", "/")];
    let response = http.post(format!("{}/login", server.url)).form(&form).send().await.unwrap();
    let cookie = response.headers()["set-cookie"].to_str().unwrap().split(';').next().unwrap().to_string();
    let response = http.get(format!("{}/mig", server.url)).header("cookie", cookie).send().await.unwrap();
    assert_eq!(response.status(), 200);
    response.text().await.unwrap()
}

async fn deploy_slo(server: &TestServer, token: &str, name: &str, throughput: f64) -> reqwest::Response {
    server.post(token, "/deployments", json!({"name": name, "model": "tiny", "throughput": throughput, "latency_ms": 50})).await
}

async fn error_of(response: reqwest::Response) -> (u16, String) {
    let status = response.status().as_u16();
    let body: Value = response.json().await.unwrap();
    (status, body["error"]["message"].as_str().unwrap_or_default().to_string())
}

#[tokio::test]
async fn workers_report_slices_with_legal_starts_and_cpu_workers_have_none() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        secret_of(register(&server, "mig-1", &["2g.20gb", "3g.40gb", "2g.20gb"], false).await).await;
        server.register_worker("cpu-1").await;
        let workers: Value = server.get(&admin, "/workers").await.json().await.unwrap();
        let mig = workers.as_array().unwrap().iter().find(|w| w["name"] == "mig-1").unwrap();
        let slices = mig["slices"].as_array().unwrap();
        let layout: Vec<(&str, u64)> = slices.iter().map(|s| (s["profile"].as_str().unwrap(), s["start"].as_u64().unwrap())).collect();
        assert_eq!(layout, vec![("2g.20gb", 0), ("2g.20gb", 2), ("3g.40gb", 4)], "arranged legally (2+2+3), by start");
        assert!(slices.iter().all(|s| s["simulated"] == true && s["replica"].is_null()));
        let cpu = workers.as_array().unwrap().iter().find(|w| w["name"] == "cpu-1").unwrap();
        assert_eq!(cpu["slices"], json!([]));

        let (status, message) = error_of(register(&server, "mig-2", &["4g.40gb", "4g.40gb"], false).await).await;
        assert_eq!(status, 422);
        assert!(message.contains("GPU GPU-sim-mig-2-0: not a legal MIG partition"), "{message}");
        let (status, message) = error_of(register(&server, "mig-3", &["1g.5gb"], false).await).await;
        assert_eq!(status, 422);
        assert!(message.contains("H100-80GB has no MIG profile \"1g.5gb\""), "{message}");
    }
}

#[tokio::test]
async fn each_replica_is_bound_to_its_own_slice() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        upload_tiny(&server, &admin).await;
        let secret = secret_of(register(&server, "mig-1", &["4g.40gb", "3g.40gb"], false).await).await;
        let response = server.post(&admin, "/deployments", json!({"name": "e", "model": "tiny", "replicas": 3})).await;
        assert_eq!(response.status(), 201);

        let first = claim(&server, &secret, &["serve"]).await.unwrap();
        let second = claim(&server, &secret, &["serve"]).await.unwrap();
        let bound = [first["slice"]["uuid"].as_str().unwrap(), second["slice"]["uuid"].as_str().unwrap()];
        assert_ne!(bound[0], bound[1]);
        assert_eq!(first["slice"]["profile"], "4g.40gb");
        assert!(claim(&server, &secret, &["serve"]).await.is_none(), "both slices are busy");

        // A CPU-only worker serves the third replica on its CPU.
        let (_, cpu) = server.register_worker("cpu-1").await;
        let third = claim(&server, &cpu, &["serve"]).await.unwrap();
        assert!(third["slice"].is_null());

        let deployment: Value = server.get(&admin, "/deployments/e").await.json().await.unwrap();
        let mut slices: Vec<String> = deployment["replica_status"].as_array().unwrap().iter().map(|r| r["slice"].to_string()).collect();
        slices.sort();
        let mut expected = vec![Value::Null.to_string(), json!(bound[0]).to_string(), json!(bound[1]).to_string()];
        expected.sort();
        assert_eq!(slices, expected);
        let workers: Value = server.get(&admin, "/workers").await.json().await.unwrap();
        let mig = workers.as_array().unwrap().iter().find(|w| w["name"] == "mig-1").unwrap();
        assert!(mig["slices"].as_array().unwrap().iter().all(|s| s["deployment"] == "e"));
    }
}

/// Two claims of one worker that read its free slices before either took one (a slice
/// worker and a CPU claim loop, say): the second finds the slice gone and gives its
/// replica back, rather than binding it to the slice the first holds.
#[tokio::test]
async fn a_slice_taken_since_the_claim_read_it_is_not_bound_twice() {
    use tessera_server::store::{jobs, slices};
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        upload_tiny(&server, &admin).await;
        secret_of(register(&server, "mig-1", &["7g.80gb"], false).await).await;
        let response = server.post(&admin, "/deployments", json!({"name": "e", "model": "tiny", "replicas": 2})).await;
        assert_eq!(response.status(), 201);
        let workers: Value = server.get(&admin, "/workers").await.json().await.unwrap();
        let worker: uuid::Uuid = workers[0]["id"].as_str().unwrap().parse().unwrap();

        let db = &server.state.db;
        let stale = slices::free_for(db, worker).await.unwrap();
        assert_eq!(stale.unreserved.len(), 1);
        let kinds = ["serve".to_string()];
        let mut bound = Vec::new();
        for _ in 0..2 {
            let claimed = jobs::claim(db, worker, &kinds, 60_000, &stale).await.unwrap().expect("a replica to claim");
            bound.push(slices::bind_claimed(db, worker, claimed.job_id, &stale).await.unwrap());
        }
        assert!(matches!(&bound[0], slices::Bound::Job(Some(slice)) if slice.profile.as_deref() == Some("7g.80gb")), "{bound:?}");
        assert!(matches!(bound[1], slices::Bound::Gone), "the second replica took a held slice: {bound:?}");
        let deployment: Value = server.get(&admin, "/deployments/e").await.json().await.unwrap();
        let placed: Vec<(bool, u64)> = deployment["replica_status"].as_array().unwrap().iter()
            .map(|r| (r["worker_id"].is_string(), r["attempts"].as_u64().unwrap()))
            .collect();
        assert!(placed.contains(&(true, 1)) && placed.contains(&(false, 0)), "the given-back replica waits unspent: {placed:?}");
    }
}

#[tokio::test]
async fn an_slo_deployment_is_planned_on_existing_slices_and_its_replicas_wait_for_them() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        upload_tiny(&server, &admin).await;
        let secret = secret_of(register(&server, "mig-1", &["3g.40gb", "2g.20gb", "2g.20gb"], false).await).await;
        let (_, other) = server.register_worker("cpu-1").await;
        profile(&server, &admin, &secret, &[("3g.40gb", 540.0), ("2g.20gb", 380.0)]).await;

        let table: Value = server.get(&admin, "/models/tiny/profiles").await.json().await.unwrap();
        let entries = table["entries"].as_array().unwrap();
        assert!(entries.iter().any(|e| e["profile"] == "7g.80gb" && e["estimated"] == true));
        assert!(entries.iter().any(|e| e["profile"] == "3g.40gb" && e["estimated"] == false && e["simulated"] == true));

        let response = deploy_slo(&server, &admin, "bert", 900.0).await;
        assert_eq!(response.status(), 201, "{}", response.text().await.unwrap());
        let deployment: Value = response.json().await.unwrap();
        let slo = &deployment["slo"];
        assert!(slo["capacity"].as_f64().unwrap() >= 900.0, "{slo}");
        assert_eq!(slo["applied"], false);
        assert_eq!(slo["steps"], json!([]));
        let planned: Vec<&str> = slo["slices"].as_array().unwrap().iter().map(|s| s["slice"].as_str().unwrap()).collect();
        assert_eq!(planned.len(), 2, "a 2g and the 3g: {slo}");
        assert_eq!(deployment["replicas"], 2);
        let pinned: Vec<&str> = deployment["replica_status"].as_array().unwrap().iter().map(|r| r["slice"].as_str().unwrap()).collect();
        assert_eq!(pinned.len(), 2);

        // Another worker cannot take a replica pinned to this worker's slices.
        assert!(claim(&server, &other, &["serve"]).await.is_none());
        let mut bound = Vec::new();
        while let Some(assignment) = claim(&server, &secret, &["serve"]).await {
            bound.push(assignment["slice"]["uuid"].as_str().unwrap().to_string());
        }
        bound.sort();
        let mut planned: Vec<String> = planned.into_iter().map(String::from).collect();
        planned.sort();
        assert_eq!(bound, planned);
    }
}

#[tokio::test]
async fn an_idle_simulated_gpu_is_repartitioned_when_its_worker_allows_it() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        upload_tiny(&server, &admin).await;
        let secret = secret_of(register(&server, "mig-1", &["7g.80gb"], true).await).await;
        profile(&server, &admin, &secret, &[("1g.10gb", 200.0), ("7g.80gb", 1000.0)]).await;

        let deployment: Value = deploy_slo(&server, &admin, "bert", 1200.0).await.json().await.unwrap();
        let slo = &deployment["slo"];
        assert_eq!(slo["applied"], true, "{slo}");
        assert!(slo["capacity"].as_f64().unwrap() >= 1200.0);
        let actions: Vec<&str> = slo["steps"].as_array().unwrap().iter().map(|s| s["action"].as_str().unwrap()).collect();
        assert_eq!(actions[0], "destroy_slice");
        assert!(actions.contains(&"create_slice") && actions.contains(&"start_replica"));

        // The worker's recorded partition is the new one, and the replicas wait on it.
        let workers: Value = server.get(&admin, "/workers").await.json().await.unwrap();
        let slices = workers[0]["slices"].as_array().unwrap();
        assert!(slices.iter().all(|s| s["profile"] != "7g.80gb"));
        let planned = slo["slices"].as_array().unwrap();
        assert!(planned.iter().all(|p| slices.iter().any(|s| s["uuid"] == p["slice"] && s["deployment"] == "bert")));
        let assignment = claim(&server, &secret, &["serve"]).await.unwrap();
        assert!(planned.iter().any(|p| p["slice"] == assignment["slice"]["uuid"]));

        // The MIG page draws the new slices in the deployment's colour, with the steps.
        let html = mig_page(&server).await;
        let drawn = html.matches("data-service=\"bert\"").count();
        assert_eq!(drawn, planned.len() + 1, "one box per planned slice, and the SLO row");
        assert!(html.contains("Steps applied") && html.contains("destroy slice"), "{html}");

        // Registering again (a restart) keeps the partition the scheduler applied.
        secret_of(rejoin(&server, "mig-1", &["7g.80gb"], true, Some(&secret)).await).await;
        let workers: Value = server.get(&admin, "/workers").await.json().await.unwrap();
        assert_eq!(workers[0]["slices"].as_array().unwrap().len(), slices.len());
    }
}

#[tokio::test]
async fn without_repartitioning_the_deployment_says_what_would_change() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        upload_tiny(&server, &admin).await;
        let secret = secret_of(register(&server, "mig-1", &["7g.80gb"], false).await).await;
        profile(&server, &admin, &secret, &[("1g.10gb", 200.0), ("7g.80gb", 1000.0)]).await;

        let deployment: Value = deploy_slo(&server, &admin, "bert", 1200.0).await.json().await.unwrap();
        let slo = &deployment["slo"];
        assert_eq!(slo["applied"], false);
        assert_eq!(slo["capacity"], 1000.0, "it runs on the 7g it has");
        let steps = slo["steps"].as_array().unwrap();
        assert!(steps.iter().any(|s| s["action"] == "destroy_slice" && s["profile"] == "7g.80gb"));
        assert!(steps.iter().any(|s| s["action"] == "start_replica" && s["service"] == "bert"));
        assert!(slo["note"].as_str().unwrap().contains("--allow-repartition"));
        let workers: Value = server.get(&admin, "/workers").await.json().await.unwrap();
        assert_eq!(workers[0]["slices"][0]["profile"], "7g.80gb", "nothing was changed");
    }
}

#[tokio::test]
async fn a_refused_slo_deployment_leaves_nothing_behind_so_its_retry_succeeds() {
    for backend in backends() {
        let server = TestServer::start_tweaked(backend, |config| config.quota_replicas = 1).await;
        let admin = server.admin().await;
        let alice = server.user(&admin, "alice").await;
        upload_tiny(&server, &alice).await;
        let secret = secret_of(register(&server, "mig-1", &["7g.80gb"], false).await).await;
        profile(&server, &alice, &secret, &[("7g.80gb", 1000.0)]).await;
        let names = |deployments: Vec<Value>| -> Vec<String> {
            deployments.iter().map(|d| d["name"].as_str().unwrap().to_string()).collect()
        };

        // No measured batch answers within 1 ms at p99.
        let strict = json!({"name": "bert", "model": "tiny", "throughput": 100.0, "latency_ms": 1});
        let (status, message) = error_of(server.post(&alice, "/deployments", strict).await).await;
        assert_eq!(status, 422, "{backend:?}");
        assert!(message.contains("relax latency_ms"), "{message}");
        assert_eq!(server.get(&alice, "/deployments/bert").await.status(), 404, "{backend:?}");

        // The planned slice would pass alice's replica quota, which another deployment uses.
        let plain = json!({"name": "plain", "model": "tiny", "replicas": 1});
        assert_eq!(server.post(&alice, "/deployments", plain).await.status(), 201);
        let (status, message) = error_of(deploy_slo(&server, &alice, "bert", 100.0).await).await;
        assert_eq!(status, 403, "{backend:?}");
        assert!(message.contains("TESSERA_QUOTA_REPLICAS"), "{message}");
        let listed: Vec<Value> = server.get(&alice, "/deployments").await.json().await.unwrap();
        assert_eq!(names(listed), ["plain"], "{backend:?}");

        // Corrected, the same request under the same name goes through.
        assert_eq!(server.delete(&alice, "/deployments/plain").await.status(), 204);
        let response = deploy_slo(&server, &alice, "bert", 100.0).await;
        assert_eq!(response.status(), 201, "{backend:?}: {}", response.text().await.unwrap());
        let deployment: Value = response.json().await.unwrap();
        assert_eq!(deployment["replicas"], 1);
        assert_eq!(deployment["replica_status"].as_array().unwrap().len(), 1);
    }
}

/// The slices of `mig-1`'s GPU 0, by start: of equal free slices the planner takes the first.
async fn slices_by_start(server: &TestServer, admin: &str) -> Vec<String> {
    let workers: Value = server.get(admin, "/workers").await.json().await.unwrap();
    let mig = workers.as_array().unwrap().iter().find(|w| w["name"] == "mig-1").unwrap();
    let mut slices: Vec<(u64, String)> = mig["slices"].as_array().unwrap().iter()
        .map(|s| (s["start"].as_u64().unwrap(), s["uuid"].as_str().unwrap().to_string()))
        .collect();
    slices.sort();
    slices.into_iter().map(|(_, uuid)| uuid).collect()
}

fn planned_slices(deployment: &Value) -> Vec<String> {
    deployment["slo"]["slices"].as_array().unwrap().iter().map(|s| s["slice"].as_str().unwrap().to_string()).collect()
}

/// A server whose worker `mig-1` offers two free 3g.40gb slices, each of which meets an
/// SLO of 400 req/s for `tiny` at 50 ms; the admin's token.
async fn two_free_slices(backend: Backend) -> (TestServer, String) {
    let server = TestServer::start(backend).await;
    let admin = server.admin().await;
    upload_tiny(&server, &admin).await;
    let secret = secret_of(register(&server, "mig-1", &["3g.40gb", "3g.40gb"], false).await).await;
    profile(&server, &admin, &secret, &[("3g.40gb", 540.0)]).await;
    (server, admin)
}

#[tokio::test]
async fn two_slo_deployments_created_at_once_take_different_slices() {
    for backend in backends() {
        let (server, admin) = two_free_slices(backend).await;
        let (first, second) =
            tokio::join!(deploy_slo(&server, &admin, "a", 400.0), deploy_slo(&server, &admin, "b", 400.0));
        let mut planned = Vec::new();
        for response in [first, second] {
            assert_eq!(response.status(), 201, "{backend:?}");
            let deployment: Value = response.json().await.unwrap();
            assert_eq!(planned_slices(&deployment).len(), 1, "{backend:?}: one slice covers 400 req/s: {deployment}");
            planned.extend(planned_slices(&deployment));
        }
        planned.sort();
        let mut slices = slices_by_start(&server, &admin).await;
        slices.sort();
        assert_eq!(planned, slices, "{backend:?}: one slice each");
    }
}

/// Servers sharing a PostgreSQL database plan SLO deployments one at a time. Here another
/// server holds the planning lock, having pinned a replica to the slice the plan would
/// take and not yet committed: the plan waits for its commit and then takes the other one.
/// (Two servers in one test process would share the in-process lock, so the other server
/// is a second pool here, taking only the database's lock and writing what `slo::apply` does.)
#[tokio::test]
async fn an_slo_plan_waits_for_the_plan_another_server_is_applying() {
    use tessera_server::store::{db::Db, deployments, jobs, Scope};
    if !backends().contains(&Backend::Postgres) {
        return;
    }
    let (server, admin) = two_free_slices(Backend::Postgres).await;
    let slices = slices_by_start(&server, &admin).await;
    let plain = json!({"name": "a", "model": "tiny", "replicas": 0});
    assert_eq!(server.post(&admin, "/deployments", plain).await.status(), 201);

    let other = Db::connect(server.config.database_url.as_deref().unwrap()).await.unwrap();
    let a = deployments::get(&other, &Scope::all(), "a").await.unwrap().unwrap();
    let mut applying = other.begin().await.unwrap();
    deployments::lock_slo_planning(&mut applying).await.unwrap();
    let spec = tessera_server::deployments::replica_spec(&a);
    let replica = jobs::NewJob {
        deployment: Some(a.id),
        pinned_slice: Some(&slices[0]),
        ..jobs::NewJob::new(a.owner_id, "replica of a", &spec, tessera_server::deployments::REPLICA_MAX_ATTEMPTS)
    };
    jobs::insert_in(&mut applying, &replica).await.unwrap();

    let body = json!({"name": "b", "model": "tiny", "throughput": 400.0, "latency_ms": 50});
    let creating = tokio::spawn(server.http.post(server.api("/deployments")).bearer_auth(&admin).json(&body).send());
    let waiting = "SELECT COUNT(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
                   AND database = (SELECT oid FROM pg_database WHERE datname = current_database())";
    // Until the plan queues behind the other server's lock, or (had it not waited) is done.
    let mut waited = false;
    for _ in 0..500 {
        waited = sqlx::query_scalar::<_, i64>(waiting).fetch_one(other.pool()).await.unwrap() > 0;
        if waited || creating.is_finished() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    applying.commit().await.unwrap();
    let response = creating.await.unwrap().unwrap();
    assert_eq!(response.status(), 201);
    let deployment: Value = response.json().await.unwrap();
    assert_eq!(planned_slices(&deployment), [slices[1].clone()], "planned onto the slice the other server pinned");
    assert!(waited, "the plan did not wait for the lock the other server held");
}

#[tokio::test]
async fn a_profile_job_needs_no_body_and_refuses_a_misspelt_field() {
    let server = TestServer::start(Backend::Sqlite).await;
    let admin = server.admin().await;
    upload_tiny(&server, &admin).await;
    let response = server.http.post(server.api("/models/tiny/profiles")).bearer_auth(&admin).send().await.unwrap();
    assert_eq!(response.status(), 201, "{}", response.text().await.unwrap());
    let job: Value = response.json().await.unwrap();
    assert_eq!(job["spec"]["batch_sizes"], json!([1, 2, 4, 8, 16, 32, 64]));

    let (status, message) = error_of(server.post(&admin, "/models/tiny/profiles", json!({"batch_size": [8]})).await).await;
    assert_eq!(status, 422);
    assert!(message.contains("unknown field `batch_size`"), "{message}");
    let jobs: Vec<Value> = server.get(&admin, "/jobs").await.json().await.unwrap();
    assert_eq!(jobs.len(), 1, "the refused request queued nothing");
}

#[tokio::test]
async fn bad_slo_requests_are_refused_with_what_to_fix() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        upload_tiny(&server, &admin).await;
        let body = json!({"name": "b", "model": "tiny", "replicas": 2, "throughput": 100});
        let (status, message) = error_of(server.post(&admin, "/deployments", body).await).await;
        assert_eq!(status, 400);
        assert!(message.contains("either \"replicas\" or a throughput SLO"), "{message}");
        let (status, message) = error_of(server.post(&admin, "/deployments", json!({"name": "b", "model": "tiny", "latency_ms": 5})).await).await;
        assert_eq!(status, 400);
        assert!(message.contains("comes with \"throughput\""), "{message}");
        let (status, message) = error_of(deploy_slo(&server, &admin, "b", -3.0).await).await;
        assert_eq!(status, 422);
        assert!(message.contains("positive number of requests per second"));
        let (status, message) = error_of(deploy_slo(&server, &admin, "b", 100.0).await).await;
        assert_eq!(status, 422);
        assert!(message.contains("has no throughput table yet"), "{message}");

        let secret = secret_of(register(&server, "mig-1", &["7g.80gb"], false).await).await;
        server.post(&admin, "/models/tiny/profiles", json!({})).await;
        let job = claim(&server, &secret, &["profile"]).await.unwrap();
        let id = job["job_id"].as_str().unwrap();
        let report = json!([{"gpu_model": "H100-80GB", "profile": "5g.50gb", "simulated": true,
                             "points": [{"batch_size": 1, "throughput": 10.0, "p99_ms": 1.0}]}]);
        let (status, message) = error_of(server.post(&secret, &format!("/agent/jobs/{id}/profiles"), report).await).await;
        assert_eq!(status, 422);
        assert!(message.contains("no MIG profile \"5g.50gb\""), "{message}");
        // A rate that would size a plan in billions of GPUs is no measurement.
        let report = json!([{"gpu_model": "H100-80GB", "profile": "7g.80gb", "simulated": true,
                             "points": [{"batch_size": 1, "throughput": 1e-12, "p99_ms": 1.0}]}]);
        let (status, message) = error_of(server.post(&secret, &format!("/agent/jobs/{id}/profiles"), report).await).await;
        assert_eq!(status, 422);
        assert!(message.contains("throughput at least 0.001 req/s"), "{message}");
        let (status, message) = error_of(server.post(&admin, "/models/tiny/profiles", json!({"batch_sizes": [0]})).await).await;
        assert_eq!(status, 422);
        assert!(message.contains("batch_sizes"), "{message}");

        // 10^7 req/s at 12 a GPU is more GPUs than the planner plans.
        profile(&server, &admin, &secret, &[("7g.80gb", 10.0)]).await;
        let (status, message) = error_of(deploy_slo(&server, &admin, "huge", 1e7).await).await;
        assert_eq!(status, 422);
        assert!(message.contains("GPUs for 10000000 req/s") && message.contains("at most 10000;"), "{message}");
        profile(&server, &admin, &secret, &[("7g.80gb", 1000.0)]).await;
        assert_eq!(deploy_slo(&server, &admin, "ok", 100.0).await.status(), 201);
        let response = server.http.patch(server.api("/deployments/ok")).bearer_auth(&admin).json(&json!({"replicas": 3})).send().await.unwrap();
        let (status, message) = error_of(response).await;
        assert_eq!(status, 422);
        assert!(message.contains("sized by its throughput SLO"));
    }
}
