//! Capacity loaning (issue 16) over real HTTP on SQLite and PostgreSQL: a loanable
//! deployment lends the slices its measured traffic leaves idle once the rate stayed low
//! for the policy's calm rounds, a waiting gang is pinned onto the loaned slices and only
//! the slices' worker may claim its ranks, returning demand takes the slices back in one
//! round (the gang preempted, a replica queued on each slice), and the round's history is
//! what `/api/v1/fleet/loaning` and the fleet page show. Elastic gangs resize in place: grow
//! onto spare slices, shrink for a reclaim, take slices another gang gives up once its ranks are gone,
//! and move between pools as a shrink now and a grow later. Also the API's validation.

mod support;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::{backends, tiny_model, Backend, TestServer, WORKER_TOKEN};
use tessera_server::loaning::lease::lead_while;
use tessera_server::loaning::{lead_and_run, run_round};
use tessera_server::store::loaning as store;
use uuid::Uuid;

const PROFILE: &str = "1g.10gb";

/// A worker offering seven simulated 1g.10gb slices of one H100.
async fn register_mig(server: &TestServer, name: &str) -> String {
    let response = offer_slices(server, name, name, None).await;
    assert_eq!(response.status(), 200);
    response.json::<Value>().await.unwrap()["secret"]
        .as_str()
        .unwrap()
        .to_string()
}

/// Worker `name` registers, offering the seven slices of `host`'s H100.
async fn offer_slices(server: &TestServer, name: &str, host: &str, previous_secret: Option<&str>) -> reqwest::Response {
    let slices: Vec<Value> = (0..7)
        .map(|i| {
            json!({"uuid": format!("MIG-sim-{host}-0-{i}"), "gpu_uuid": format!("GPU-sim-{host}-0"), "gpu_index": 0,
                   "gpu_model": "H100-80GB", "profile": PROFILE, "start": null, "memory_bytes": 10u64 << 30, "simulated": true})
        })
        .collect();
    let inventory =
        json!({"hostname": host, "cpu_cores": 2, "memory_bytes": 1024, "slices": slices});
    let body = json!({"name": name, "version": "test", "inventory": inventory, "allow_repartition": false,
                      "previous_secret": previous_secret});
    server.post(WORKER_TOKEN, "/agent/register", body).await
}

async fn claim(server: &TestServer, secret: &str, kinds: &[&str]) -> Option<Value> {
    let response = server
        .post(secret, "/agent/claim", json!({"kinds": kinds}))
        .await;
    (response.status() == 200)
        .then(|| ())
        .map(|_| response)?
        .json()
        .await
        .ok()
}

/// A measured table: 100 req/s per 1g.10gb slice at p99 30 ms.
async fn profile(server: &TestServer, admin: &str, secret: &str) {
    profile_at(server, admin, secret, 100.0).await
}

/// A measured table: `throughput` req/s per 1g.10gb slice at p99 30 ms.
async fn profile_at(server: &TestServer, admin: &str, secret: &str, throughput: f64) {
    server.post(admin, "/models/tiny/profiles", json!({})).await;
    let leased = claim(server, secret, &["profile"])
        .await
        .expect("the profile job");
    let id = leased["job_id"].as_str().unwrap();
    let reports = json!([{"gpu_model": "H100-80GB", "profile": PROFILE, "simulated": true,
        "points": [{"batch_size": 16, "throughput": throughput, "p99_ms": 30.0}]}]);
    let response = server
        .post(secret, &format!("/agent/jobs/{id}/profiles"), reports)
        .await;
    assert_eq!(response.status(), 204);
    server
        .post(
            secret,
            &format!("/agent/jobs/{id}/status"),
            json!({"state": "succeeded"}),
        )
        .await;
}

async fn patch(server: &TestServer, token: &str, path: &str, body: Value) -> reqwest::Response {
    server
        .http
        .patch(server.api(path))
        .bearer_auth(token)
        .json(&body)
        .send()
        .await
        .unwrap()
}

async fn get(server: &TestServer, token: &str, path: &str) -> Value {
    let response = server.get(token, path).await;
    assert_eq!(response.status(), 200, "{path}");
    response.json().await.unwrap()
}

/// The worker's slices by loan state.
async fn slices(server: &TestServer, token: &str) -> Vec<Value> {
    let workers = get(server, token, "/workers").await;
    workers
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|w| w["slices"].as_array().unwrap().clone())
        .collect()
}

fn count(slices: &[Value], state: &str) -> usize {
    slices.iter().filter(|s| s["loan_state"] == state).count()
}

/// The lines of `job`'s log.
async fn logs(server: &TestServer, token: &str, job: &str) -> Vec<String> {
    let lines = get(server, token, &format!("/jobs/{job}/logs")).await;
    lines.as_array().unwrap().iter().map(|l| l["line"].as_str().unwrap().to_string()).collect()
}

/// One more round, a few milliseconds after the last: rounds recorded in one millisecond
/// count once for the hysteresis.
async fn next_round(server: &TestServer) -> tessera_server::loaning::RoundReport {
    tokio::time::sleep(std::time::Duration::from_millis(3)).await;
    run_round(&server.state).await.unwrap()
}

/// Rounds until one resizes a gang: that round's report, and how many rounds it took.
async fn until_resized(server: &TestServer) -> (tessera_server::loaning::RoundReport, u32) {
    for rounds in 1..40 {
        let report = next_round(server).await;
        if report.resized > 0 {
            return (report, rounds);
        }
    }
    panic!("no round resized a gang in 40");
}

/// The tiny model, a registered MIG worker and the model's throughput table on it: the
/// worker's secret.
async fn mig_worker_with_tiny(server: &TestServer, admin: &str) -> String {
    let response = server.upload_model(admin, "tiny", tiny_model()).await;
    assert_eq!(response.status(), 201);
    let secret = register_mig(server, "mig-1").await;
    profile(server, admin, &secret).await;
    secret
}

/// The worker claims `n` replicas and reports each one running.
async fn run_replicas(server: &TestServer, secret: &str, n: usize) {
    for _ in 0..n {
        let replica = claim(server, secret, &["serve"]).await.expect("a replica");
        let id = replica["job_id"].as_str().unwrap();
        let body = json!({"state": "running", "endpoint": "http://127.0.0.1:9/"});
        assert_eq!(server.post(secret, &format!("/agent/jobs/{id}/status"), body).await.status(), 204);
    }
}

#[tokio::test]
async fn idle_slices_are_lent_to_a_gang_and_taken_back_when_demand_returns() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let secret = mig_worker_with_tiny(&server, &admin).await;

        let response = server
            .post(&admin, "/deployments", json!({"name": "embed", "model": "tiny", "replicas": 4, "loanable": true, "reclaim_headroom": 0.2}))
            .await;
        assert_eq!(response.status(), 201);
        let deployment: Value = response.json().await.unwrap();
        assert_eq!(
            (
                deployment["loanable"].as_bool(),
                deployment["reclaim_headroom"].as_f64()
            ),
            (Some(true), Some(0.2))
        );
        run_replicas(&server, &secret, 4).await;
        let data = server.toy_dataset(&admin).await;
        let gang = preemptible_job(&data, "loan-dp", 2);
        let response = server.post(&admin, "/jobs", gang).await;
        assert_eq!(response.status(), 201);
        let job = response.json::<Value>().await.unwrap()["id"]
            .as_str()
            .unwrap()
            .to_string();
        // Until the round places it, no worker may claim a rank on a slice.
        assert!(claim(&server, &secret, &["train_rank"]).await.is_none());

        // No traffic: the first round counts a calm round, the second lends all but one.
        let first = run_round(&server.state).await.unwrap();
        assert_eq!(first.lent, 0, "{first:?}");
        let second = run_round(&server.state).await.unwrap();
        assert_eq!(second.lent, 3, "{second:?}");
        assert_eq!(
            second.started, 1,
            "the gang is placed in the same round: {second:?}"
        );
        let now = slices(&server, &admin).await;
        assert_eq!(count(&now, "loaned"), 3);
        assert!(now
            .iter()
            .filter(|s| s["loan_state"] == "loaned")
            .all(|s| s["lender"] == "embed"));
        let d = get(&server, &admin, "/deployments/embed").await;
        assert_eq!(d["loaned_slices"], 3);
        assert_eq!(
            d["replica_status"].as_array().unwrap().len(),
            1,
            "the lent slices' replicas stopped: {d}"
        );
        assert_eq!(d["state"], "ready", "one replica serves what is left: {d}");

        // The gang's ranks are pinned to loaned slices: the worker claims both, each bound.
        let mut ranks = Vec::new();
        for _ in 0..2 {
            let rank = claim(&server, &secret, &["train_rank"])
                .await
                .expect("a pinned rank");
            let slice = rank["slice"]["uuid"]
                .as_str()
                .expect("bound to its slice")
                .to_string();
            let lent = now.iter().find(|s| s["uuid"] == slice.as_str()).unwrap();
            assert_eq!(lent["loan_state"], "loaned", "{lent}");
            ranks.push(rank["job_id"].as_str().unwrap().to_string());
        }
        // A replica may not take a loaned slice: with the loan in place none is queued, and
        // the serve claim finds nothing.
        assert!(claim(&server, &secret, &["serve"]).await.is_none());
        for (i, rank) in ranks.iter().enumerate() {
            let body = json!({"address": format!("127.0.0.1:{}", 7000 + i)});
            assert_eq!(
                server
                    .post(&secret, &format!("/agent/jobs/{rank}/rendezvous"), body)
                    .await
                    .status(),
                200
            );
        }
        for rank in &ranks {
            let body = json!({"address": "127.0.0.1:7000"});
            let formed: Value = server
                .post(&secret, &format!("/agent/jobs/{rank}/rendezvous"), body)
                .await
                .json()
                .await
                .unwrap();
            assert_eq!(formed["state"], "formed", "{formed}");
        }
        assert_eq!(
            get(&server, &admin, &format!("/jobs/{job}")).await["state"],
            "running"
        );
        let training = slices(&server, &admin).await;
        assert_eq!(
            training
                .iter()
                .filter(|s| s["training_job"] == job.as_str())
                .count(),
            2
        );

        // Demand returns: 350 req/s × 1.2 needs 5 slices of 100 req/s, more than the 4 it
        // has, so everything lent comes back in this one round.
        store::record_rates(
            &server.state.db,
            Uuid::new_v4(),
            &[(d["id"].as_str().unwrap().parse().unwrap(), 350.0)],
        )
        .await
        .unwrap();
        let spike = run_round(&server.state).await.unwrap();
        // The idle lent slice comes back at once; the gang's two once it has checkpointed.
        assert_eq!((spike.preempted, spike.returned), (1, 1), "{spike:?}");
        let back = slices(&server, &admin).await;
        assert_eq!(count(&back, "reclaiming"), 2, "{back:?}");
        // The ranks' worker learns at its next heartbeat to checkpoint now and stop; it
        // reports each rank preempted, and the job waits as `preempted`.
        let beat: Value = server
            .post(&secret, "/agent/heartbeat", json!({"jobs": ranks}))
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(beat["preempt"].as_array().map(Vec::len), Some(2), "{beat}");
        for rank in &ranks {
            let body = json!({"state": "preempted", "message": "Preempted at step 5."});
            let response = server.post(&secret, &format!("/agent/jobs/{rank}/status"), body).await;
            assert_eq!(response.status(), 204);
        }
        let preempted = get(&server, &admin, &format!("/jobs/{job}")).await;
        assert_eq!(preempted["state"], "preempted", "{preempted}");

        // The next round takes the freed slices back (a replica queued on each) and
        // restarts the job on free serving slices, not the ones the deployment got back.
        let after = run_round(&server.state).await.unwrap();
        assert_eq!((after.returned, after.started), (2, 1), "{after:?}");
        let placed = slices(&server, &admin).await;
        assert_eq!(count(&placed, "loaned") + count(&placed, "reclaiming"), 0, "{placed:?}");
        let d = get(&server, &admin, "/deployments/embed").await;
        assert_eq!(d["loaned_slices"], 0);
        let pending: Vec<&Value> = d["replica_status"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["state"] == "pending")
            .collect();
        assert_eq!(pending.len(), 3, "a replica is queued on each slice taken back: {d}");
        assert!(pending.iter().all(|r| r["slice"].is_string()));
        let pinned: Vec<&Value> = placed
            .iter()
            .filter(|s| s["training_job"] == job.as_str())
            .collect();
        assert_eq!(pinned.len(), 2);
        assert!(pinned.iter().all(|s| s["loan_state"] == "serving"));

        // What the dashboard and the API show of it.
        let overview = get(&server, &admin, "/fleet/loaning").await;
        let reclaims = overview["reclaims"].as_array().unwrap();
        assert_eq!(reclaims.len(), 1, "{overview}");
        assert_eq!(reclaims[0]["job_id"], job.as_str());
        assert_eq!(
            (
                reclaims[0]["deployment"].as_str(),
                reclaims[0]["preempted"].as_bool()
            ),
            (Some("embed"), Some(true))
        );
        assert_eq!(overview["rounds"].as_array().unwrap().len(), 4);
        let states: Vec<&str> = overview["slice_events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["state"].as_str().unwrap())
            .collect();
        for state in ["loaned", "training", "reclaiming", "serving", "idle"] {
            assert!(states.contains(&state), "{state} in {states:?}");
        }
        let queue = overview["queue"].as_array().unwrap();
        assert_eq!(queue.len(), 1);
        assert_eq!(queue[0]["job_id"], job.as_str());
        let page = fleet_page(&server).await;
        assert!(
            page.contains("loan-dp") && page.contains("preempted") && page.contains("embed"),
            "{page}"
        );
        assert!(page.contains("data-now=\"training\""), "{page}");

        // Another user reads what the fleet did, but no name of the admin's deployment or job.
        let bob = server.user(&admin, "bob").await;
        let seen = get(&server, &bob, "/fleet/loaning").await;
        assert_eq!(seen["reclaims"][0]["deployment"], "another user's deployment", "{seen}");
        assert_eq!(seen["reclaims"][0]["job_name"], "another user's job", "{seen}");
        assert_eq!(seen["slice_events"].as_array().map(Vec::len), overview["slice_events"].as_array().map(Vec::len));
        for text in [seen["reclaims"].to_string(), seen["slice_events"].to_string()] {
            assert!(!text.contains("embed") && !text.contains("loan-dp"), "{backend:?}: {text}");
        }
    }
}

/// The dashboard's fleet page, signed in as admin through the form.
async fn fleet_page(server: &TestServer) -> String {
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let form = [
        ("username", "admin"),
        ("password", support::ADMIN_PASSWORD),
        ("next", "/"),
    ];
    let response = http
        .post(format!("{}/login", server.url))
        .form(&form)
        .send()
        .await
        .unwrap();
    let cookie = response.headers()["set-cookie"]
        .to_str()
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_string();
    let response = http
        .get(format!("{}/fleet", server.url))
        .header("cookie", cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    response.text().await.unwrap()
}

#[tokio::test]
async fn one_server_at_a_time_runs_the_round() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        assert!(lead_and_run(&server.state, a).await.unwrap().led);
        assert!(
            !lead_and_run(&server.state, b).await.unwrap().led,
            "b waits while a's lease runs"
        );
        assert!(
            lead_and_run(&server.state, a).await.unwrap().led,
            "a renews its own lease"
        );
        let now = tessera_server::store::db::now_ms();
        // Once a's lease lapses, b takes over.
        assert!(
            store::lead(&server.state.db, "loaning", b, now + 60_000, now + 90_000)
                .await
                .unwrap()
        );
        assert!(
            !store::lead(&server.state.db, "loaning", a, now, now + 15_000)
                .await
                .unwrap()
        );
    }
}

/// Whether server `other` could take the round's lease now.
async fn other_leads(server: &TestServer, other: Uuid) -> bool {
    let now = tessera_server::store::db::now_ms();
    store::lead(&server.state.db, "loaning", other, now, now + 3_000).await.unwrap()
}

#[tokio::test]
async fn a_lease_held_past_its_ttl_is_renewed_and_one_taken_stops_the_work() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        let ttl = Duration::from_millis(1500);
        let work = tokio::time::sleep(Duration::from_secs(4));
        let watch = async {
            for _ in 0..3 {
                tokio::time::sleep(Duration::from_millis(1200)).await;
                assert!(!other_leads(&server, b).await, "{backend:?}: a's lease is renewed while its work runs");
            }
        };
        let (held, ()) = tokio::join!(lead_while(&server.state.db, "loaning", a, ttl, work), watch);
        assert_eq!(held.unwrap(), Some(()), "{backend:?}");

        // b takes the lease as if a's had lapsed: a stops instead of running beside b.
        let started = Instant::now();
        let work = tokio::time::sleep(Duration::from_secs(30));
        let take = async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let later = tessera_server::store::db::now_ms() + 60_000;
            assert!(store::lead(&server.state.db, "loaning", b, later, later + 60_000).await.unwrap());
        };
        let (lost, ()) = tokio::join!(lead_while(&server.state.db, "loaning", a, ttl, work), take);
        assert_eq!(lost.unwrap(), None, "{backend:?}");
        assert!(started.elapsed() < Duration::from_secs(3), "{backend:?}: stopped at the next renewal");
    }
}

/// A round that runs past its lease's ttl (here: its first write waits on a table lock,
/// as on a slow database) keeps the lease, so no other server starts a round meanwhile.
#[tokio::test]
async fn a_round_held_open_past_the_lease_ttl_keeps_the_lease() {
    use sqlx::Connection;
    if !backends().contains(&Backend::Postgres) {
        return; // SQLite has one write lock: what holds the round would hold the lease too.
    }
    let server = TestServer::start_tweaked(Backend::Postgres, |c| c.loan_round_secs = 1).await;
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    let url = server.config.database_url.clone().unwrap();
    let mut blocker = sqlx::PgConnection::connect(&url).await.unwrap();
    let mut lock = blocker.begin().await.unwrap();
    sqlx::query("LOCK TABLE slices IN EXCLUSIVE MODE").execute(&mut *lock).await.unwrap();
    let state = server.state.clone();
    let round = tokio::spawn(async move { lead_and_run(&state, a).await });
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!other_leads(&server, b).await, "the round's lease (3 s) is renewed while it runs");
    }
    assert!(!round.is_finished(), "the round is still held open");
    lock.commit().await.unwrap();
    assert!(round.await.unwrap().unwrap().led);
}

async fn error(response: reqwest::Response) -> (u16, String, String) {
    let status = response.status().as_u16();
    let body: Value = response.json().await.unwrap();
    (
        status,
        body["error"]["code"].as_str().unwrap_or_default().into(),
        body["error"]["message"].as_str().unwrap_or_default().into(),
    )
}

#[tokio::test]
async fn loaning_settings_are_validated() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let response = server.upload_model(&admin, "tiny", tiny_model()).await;
        assert_eq!(response.status(), 201);
        let create = |body: Value| server.post(&admin, "/deployments", body);

        // A body whose fields do not go together is refused as the body's shape (400).
        let (status, _, message) =
            error(create(json!({"name": "a", "model": "tiny", "reclaim_headroom": 0.3})).await)
                .await;
        assert_eq!(status, 400);
        assert!(message.contains("\"loanable\": true"), "{message}");
        for bad in [-0.1, 4.5] {
            let body =
                json!({"name": "a", "model": "tiny", "loanable": true, "reclaim_headroom": bad});
            let (status, code, message) = error(create(body).await).await;
            assert_eq!(
                (status, code.as_str()),
                (422, "invalid_reclaim_headroom"),
                "{bad}"
            );
            assert!(message.contains("from 0 to 4"), "{message}");
        }
        let plain: Value = create(json!({"name": "plain", "model": "tiny", "replicas": 0}))
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(
            (plain["loanable"].as_bool(), plain["loaned_slices"].as_u64()),
            (Some(false), Some(0))
        );

        let (status, code, _) =
            error(patch(&server, &admin, "/deployments/plain", json!({})).await).await;
        assert_eq!((status, code.as_str()), (422, "empty_update"));
        let (status, _, message) = error(
            patch(
                &server,
                &admin,
                "/deployments/plain",
                json!({"reclaim_headroom": 0.5}),
            )
            .await,
        )
        .await;
        assert_eq!(status, 422);
        assert!(message.contains("loanable"), "{message}");
        let response = patch(
            &server,
            &admin,
            "/deployments/plain",
            json!({"lonable": true}),
        )
        .await;
        assert_eq!(response.status(), 400, "an unknown field is refused");
        let response = patch(
            &server,
            &admin,
            "/deployments/plain",
            json!({"loanable": true, "reclaim_headroom": 0.5}),
        )
        .await;
        assert_eq!(response.status(), 200);
        let changed: Value = response.json().await.unwrap();
        assert_eq!(
            (
                changed["loanable"].as_bool(),
                changed["reclaim_headroom"].as_f64(),
                changed["replicas"].as_u64()
            ),
            (Some(true), Some(0.5), Some(0))
        );
        let scaled: Value = patch(
            &server,
            &admin,
            "/deployments/plain",
            json!({"replicas": 2}),
        )
        .await
        .json()
        .await
        .unwrap();
        assert_eq!(
            (scaled["replicas"].as_u64(), scaled["loanable"].as_bool()),
            (Some(2), Some(true)),
            "{scaled}"
        );
        // A change that leaves the headroom as it is, then one that sets it, again and
        // again: on PostgreSQL a statement first prepared with the NULL headroom must
        // still take a headroom on that connection (sqlx binds a NULL f64 as float4).
        for i in 1..=6 {
            let response = patch(&server, &admin, "/deployments/plain", json!({"loanable": i % 2 == 0})).await;
            assert_eq!(response.status(), 200, "{}", response.text().await.unwrap());
            let headroom = 0.1 * i as f64;
            let body = json!({"loanable": true, "reclaim_headroom": headroom});
            let response = patch(&server, &admin, "/deployments/plain", body).await;
            assert_eq!(response.status(), 200, "{backend:?}: {}", response.text().await.unwrap());
            let changed: Value = response.json().await.unwrap();
            assert_eq!(changed["reclaim_headroom"].as_f64(), Some(headroom), "{changed}");
        }

        // Another user sees no other user's deployment to change.
        let user = server.user(&admin, "someone").await;
        assert_eq!(
            patch(
                &server,
                &user,
                "/deployments/plain",
                json!({"loanable": false})
            )
            .await
            .status(),
            404
        );
    }
}

/// The round sizes an elastic job when it starts (`gangs::resize`, within the spec's
/// `resources`): a waiting gang's rank rows are replaced and every rank's `world`
/// rewritten; a gang a worker holds a rank of is left alone.
#[tokio::test]
async fn a_waiting_gang_is_resized_and_a_claimed_one_is_not() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let secret = register_mig(&server, "mig-1").await;
        let data = server.toy_dataset(&admin).await;
        let body = json!({"name": "elastic", "model": {"kind": "mlp", "hidden": [8]}, "dataset": data,
            "task": {"type": "classification", "label_column": "label", "validation_split": 0.25},
            "optimizer": {"type": "sgd"}, "batch_size": 8, "max_steps": 10, "eval_every": 5, "checkpoint_every": 5,
            "lr_schedule": {"type": "constant", "lr": 0.1}, "seed": 1,
            "parallel": {"ranks": [{"slice": PROFILE}, {"slice": PROFILE}, {"slice": PROFILE}]},
            "resources": {"min_ranks": 2, "max_ranks": 3, "preemptible": true}});
        let job: Value = server
            .post(&admin, "/jobs", body)
            .await
            .json()
            .await
            .unwrap();
        let gang: Uuid = job["id"].as_str().unwrap().parse().unwrap();
        let db = &server.state.db;

        for size in [2u32, 3, 2] {
            tessera_server::gangs::resize(db, gang, size).await.unwrap();
            let gangs = store::slice_gangs(db).await.unwrap();
            let ranks: Vec<u32> = gangs[0].ranks.iter().map(|r| r.rank).collect();
            assert_eq!(ranks, (0..size).collect::<Vec<_>>());
        }
        assert!(tessera_server::gangs::resize(db, gang, 4).await.is_err(), "beyond max_ranks");
        // Placed by a round, the ranks are claimed, each with the world the round chose.
        let report = run_round(&server.state).await.unwrap();
        assert_eq!(report.started, 1, "{report:?}");
        let mut worlds = Vec::new();
        while let Some(rank) = claim(&server, &secret, &["train_rank"]).await {
            worlds.push((
                rank["spec"]["rank"].as_u64().unwrap(),
                rank["spec"]["world"].as_u64().unwrap(),
            ));
        }
        worlds.sort();
        // Nothing measured yet: the step-time prior values a third rank, and with seven
        // free slices the knapsack grants it (min_ranks alone would be 2).
        assert_eq!(worlds, (0..3).map(|r| (r, 3)).collect::<Vec<_>>());
        assert!(
            tessera_server::gangs::resize(db, gang, 2).await.is_err(),
            "a claimed gang keeps its size"
        );
    }
}

/// The round's step times per rank count come from each count's newest steps, each labelled
/// with the rank count that ran it: a step re-run after a resize takes the new count (in
/// both directions), a step only rank 0 reported yet is not mistaken for a one-rank step,
/// a count run long ago is remembered after hundreds of newer steps at another, and each
/// count gives only its newest steps.
#[tokio::test]
async fn step_times_carry_the_rank_count_that_ran_them() {
    use tessera_api::parallel::RankStep;
    use tessera_server::store::gangs as gang_store;
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let data = server.toy_dataset(&admin).await;
        let body = json!({"name": "elastic", "model": {"kind": "mlp", "hidden": [8]}, "dataset": data,
            "task": {"type": "classification", "label_column": "label", "validation_split": 0.25},
            "optimizer": {"type": "sgd"}, "batch_size": 8, "max_steps": 100, "eval_every": 50, "checkpoint_every": 5,
            "lr_schedule": {"type": "constant", "lr": 0.1}, "seed": 1,
            "parallel": {"ranks": [{"slice": PROFILE}, {"slice": PROFILE}, {"slice": PROFILE}]},
            "resources": {"min_ranks": 1, "max_ranks": 3, "preemptible": true}});
        let job: Value = server.post(&admin, "/jobs", body).await.json().await.unwrap();
        let gang: Uuid = job["id"].as_str().unwrap().parse().unwrap();
        let db = &server.state.db;
        // Rank `rank` ran `steps` at `ms` milliseconds each.
        let report = |rank: u32, steps: std::ops::RangeInclusive<u64>, ms: f64| -> Vec<RankStep> {
            steps
                .map(|step| RankStep { rank, step, iter_ms: ms, wait_ms: 0.0, allreduce_ms: 0.0, predicted_ms: None })
                .collect()
        };

        // Three ranks run steps 1..=6, but only rank 0 reported 5 and 6 so far.
        for rank in 0..3 {
            gang_store::upsert_rank_steps(db, gang, &report(rank, 1..=4, 300.0)).await.unwrap();
        }
        gang_store::upsert_rank_steps(db, gang, &report(0, 5..=6, 300.0)).await.unwrap();
        // Shrunk to one rank, it resumes from step 4: steps 5 and 6 run again, then 7 and 8.
        tessera_server::gangs::resize(db, gang, 1).await.unwrap();
        gang_store::upsert_rank_steps(db, gang, &report(0, 5..=8, 800.0)).await.unwrap();
        let by_count = store::step_secs_by_count(db, gang, 100).await.unwrap();
        let expected: Vec<(u32, f64)> =
            [(3, 0.3), (3, 0.3), (3, 0.3), (3, 0.3), (1, 0.8), (1, 0.8), (1, 0.8), (1, 0.8)].to_vec();
        assert_eq!(by_count, expected, "{backend:?}");
        // Grown to two, it resumes from step 6: steps 7 and 8 are the two ranks' now.
        tessera_server::gangs::resize(db, gang, 2).await.unwrap();
        for rank in 0..2 {
            gang_store::upsert_rank_steps(db, gang, &report(rank, 7..=8, 500.0)).await.unwrap();
        }
        let by_count = store::step_secs_by_count(db, gang, 3).await.unwrap();
        let expected: Vec<(u32, f64)> = [(3, 0.3), (3, 0.3), (3, 0.3), (2, 0.5), (2, 0.5), (1, 0.8), (1, 0.8)].to_vec();
        assert_eq!(by_count, expected, "each count's newest steps, counts from the largest");
        // 450 more steps at two ranks, the newest 50 of them slower: one and three ranks,
        // last run 450 steps ago, are still known, and two ranks is its newest 50 alone.
        for rank in 0..2 {
            gang_store::upsert_rank_steps(db, gang, &report(rank, 9..=408, 500.0)).await.unwrap();
            gang_store::upsert_rank_steps(db, gang, &report(rank, 409..=458, 600.0)).await.unwrap();
        }
        let by_count = store::step_secs_by_count(db, gang, 50).await.unwrap();
        let mut expected: Vec<(u32, f64)> = vec![(3, 0.3); 4];
        expected.extend(vec![(2, 0.6); 50]);
        expected.extend(vec![(1, 0.8); 2]);
        assert_eq!(by_count, expected, "remembered after 450 newer steps");
    }
}

/// An SLO deployment keeps what its plan needs at the measured rate (the serving floor),
/// even when the throughput table was measured faster since: planned at 100 req/s a slice,
/// re-profiled at 200, at 100 req/s measured it keeps two slices (1.2 × 100 over 100 req/s
/// slices) and lends two, where the table alone would lend three.
#[tokio::test]
async fn an_slo_deployment_keeps_the_slices_its_plan_needs_at_the_measured_rate() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let secret = mig_worker_with_tiny(&server, &admin).await;
        let body = json!({"name": "slo", "model": "tiny", "throughput": 400.0, "latency_ms": 50, "loanable": true});
        let response = server.post(&admin, "/deployments", body).await;
        assert_eq!(response.status(), 201);
        let deployment: Value = response.json().await.unwrap();
        let planned = deployment["slo"]["slices"].as_array().unwrap();
        assert_eq!(planned.len(), 4, "{deployment}");
        assert!(planned.iter().all(|s| s["throughput"] == 100.0), "{deployment}");
        run_replicas(&server, &secret, 4).await;
        profile_at(&server, &admin, &secret, 200.0).await;
        let id: Uuid = deployment["id"].as_str().unwrap().parse().unwrap();
        store::record_rates(&server.state.db, Uuid::new_v4(), &[(id, 100.0)]).await.unwrap();

        let first = run_round(&server.state).await.unwrap();
        assert_eq!(first.lent, 0, "a calm round first: {first:?}");
        let second = run_round(&server.state).await.unwrap();
        assert_eq!(second.lent, 2, "{second:?}");
        let d = get(&server, &admin, "/deployments/slo").await;
        assert_eq!(d["loaned_slices"], 2, "{d}");
    }
}

/// Shortest-first with the step-time prior: a new job borrows the step time of a measured
/// job of the same model and batch, so it starts before a job of another model that only
/// the default figure knows, and before the measured but longer job.
#[tokio::test]
async fn a_new_job_is_ordered_by_the_step_time_of_its_measured_peers() {
    use tessera_api::parallel::RankStep;
    use tessera_server::store::gangs as gang_store;
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        register_mig(&server, "mig-1").await;
        let data = server.toy_dataset(&admin).await;
        // Four ranks each, seven slices: one job starts per round.
        let submit = |name: &str, hidden: u32, steps: u64| {
            json!({"name": name, "model": {"kind": "mlp", "hidden": [hidden]}, "dataset": data,
                "task": {"type": "classification", "label_column": "label", "validation_split": 0.25},
                "optimizer": {"type": "sgd"}, "batch_size": 8, "max_steps": steps, "eval_every": 50, "checkpoint_every": 5,
                "lr_schedule": {"type": "constant", "lr": 0.1}, "seed": 1,
                "parallel": {"ranks": [{"slice": PROFILE}, {"slice": PROFILE}, {"slice": PROFILE}, {"slice": PROFILE}]},
                "resources": {"preemptible": true}})
        };
        let mut ids = Vec::new();
        for (name, hidden, steps) in [("measured", 8, 1000), ("other-model", 16, 50), ("same-model", 8, 100)] {
            let job: Value = server.post(&admin, "/jobs", submit(name, hidden, steps)).await.json().await.unwrap();
            ids.push(job["id"].as_str().unwrap().parse::<Uuid>().unwrap());
        }
        // The first ran 20 steps at 10 ms (at four ranks) before it was preempted.
        let steps: Vec<RankStep> = (1..=20)
            .map(|step| RankStep { rank: 0, step, iter_ms: 10.0, wait_ms: 0.0, allreduce_ms: 0.0, predicted_ms: None })
            .collect();
        gang_store::upsert_rank_steps(&server.state.db, ids[0], &steps).await.unwrap();

        // Predicted: measured 1000 × 10 ms = 10 s; same-model borrows it, 100 × 10 ms = 1 s;
        // other-model has the default, 50 × 1 s × (0.1 + 0.9 / 4) = 16 s.
        let report = run_round(&server.state).await.unwrap();
        assert_eq!(report.started, 1, "{report:?}");
        let gangs = store::slice_gangs(&server.state.db).await.unwrap();
        let placed: Vec<Uuid> =
            gangs.iter().filter(|g| g.ranks.iter().all(|r| r.slice.is_some())).map(|g| g.id).collect();
        assert_eq!(placed, vec![ids[2]], "the same-model job starts first");
        let overview = get(&server, &admin, "/fleet/loaning").await;
        let queue = overview["queue"].as_array().expect("the training queue");
        let predicted = |id: Uuid| queue.iter().find(|q| q["job_id"] == id.to_string().as_str()).unwrap()["predicted_secs"].clone();
        assert!((predicted(ids[0]).as_f64().unwrap() - 10.0).abs() < 1e-6, "{overview}");
        assert_eq!(predicted(ids[2]), Value::Null, "only measured figures are shown: {overview}");

        // The forecast: same-model runs now for 1 s; then measured starts (10 s, shorter
        // than other-model's 16.25 s), and other-model when measured ends and frees its
        // slices (it needs 4, 3 are free before). All rest on same-model's borrowed prior.
        let entry = |overview: &Value, id: Uuid| {
            overview["queue"].as_array().unwrap().iter().find(|q| q["job_id"] == id.to_string().as_str()).unwrap().clone()
        };
        let at = |q: &Value, field: &str| {
            let text = q[field].as_str().unwrap_or_else(|| panic!("{field} in {q}"));
            chrono::DateTime::parse_from_rfc3339(text).unwrap().timestamp_millis() as f64 / 1000.0
        };
        let close = |a: f64, b: f64| (a - b).abs() < 0.005;
        let check = |overview: &Value, same_secs: f64, from: [&str; 3]| {
            let (same, measured, other) = (entry(overview, ids[2]), entry(overview, ids[0]), entry(overview, ids[1]));
            let now = at(&same, "predicted_start_at");
            assert!(close(at(&same, "predicted_finish_at") - now, same_secs), "{overview}");
            assert!(close(at(&measured, "predicted_start_at") - now, same_secs), "{overview}");
            assert!(close(at(&measured, "predicted_finish_at") - now, same_secs + 10.0), "{overview}");
            assert!(close(at(&other, "predicted_start_at") - now, same_secs + 10.0), "{overview}");
            assert!(close(at(&other, "predicted_finish_at") - now, same_secs + 10.0 + 16.25), "{overview}");
            let positions: Vec<u64> = [&same, &measured, &other].iter().map(|q| q["position"].as_u64().unwrap()).collect();
            assert_eq!(positions, vec![0, 1, 2], "the queue is in predicted start order: {overview}");
            let froms: Vec<&str> = [&same, &measured, &other].iter().map(|q| q["predicted_from"].as_str().unwrap()).collect();
            assert_eq!(froms, from, "{overview}");
            (same, measured, other)
        };
        let (_, measured, _) = check(&overview, 1.0, ["prior", "prior", "prior"]);
        // The JCT counts from submission.
        let job = get(&server, &admin, &format!("/jobs/{}", ids[0])).await;
        let submitted = at(&job, "created_at");
        let jct = measured["predicted_jct_secs"].as_f64().expect("a predicted JCT");
        assert!(close(jct, at(&measured, "predicted_finish_at") - submitted), "{jct} from {job}");

        // Once same-model was measured (20 ms a step at four ranks: 2 s), the figures of the
        // jobs that wait for it rest on measurements too; other-model's stay the prior's.
        let steps: Vec<RankStep> = (1..=20)
            .map(|step| RankStep { rank: 0, step, iter_ms: 20.0, wait_ms: 0.0, allreduce_ms: 0.0, predicted_ms: None })
            .collect();
        gang_store::upsert_rank_steps(&server.state.db, ids[2], &steps).await.unwrap();
        run_round(&server.state).await.unwrap();
        let overview = get(&server, &admin, "/fleet/loaning").await;
        check(&overview, 2.0, ["measured", "measured", "prior"]);
        let page = fleet_page(&server).await;
        assert!(page.contains("Predicted JCT") && page.contains("data-basis=\"prior\""), "{page}");
    }
}

/// A single-device job that names a slice (`parallel` of one rank) is a gang of one: the
/// round places it on a lent slice like any gang (a preemptible job takes loaned capacity
/// first), the worker claims it as a `slice_rank`, it forms at a world of one, and
/// returning demand preempts it.
#[tokio::test]
async fn a_one_slice_job_runs_on_a_lent_slice_and_is_preempted_when_demand_returns() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let secret = mig_worker_with_tiny(&server, &admin).await;
        let body = json!({"name": "embed", "model": "tiny", "replicas": 2, "loanable": true, "reclaim_headroom": 0.2});
        let response = server.post(&admin, "/deployments", body).await;
        assert_eq!(response.status(), 201);
        let deployment: Uuid = response.json::<Value>().await.unwrap()["id"].as_str().unwrap().parse().unwrap();
        run_replicas(&server, &secret, 2).await;
        // Bob's job trains on the admin's lent slice.
        let bob = server.user(&admin, "bob").await;
        let data = server.toy_dataset(&bob).await;
        let job = preemptible_job(&data, "one-slice", 1);
        let response = server.post(&bob, "/jobs", job).await;
        assert_eq!(response.status(), 201);
        let job = response.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_string();

        run_round(&server.state).await.unwrap();
        let second = run_round(&server.state).await.unwrap();
        assert_eq!((second.lent, second.started), (1, 1), "{second:?}");
        // Claimed as a `slice_rank`: what a worker with no free batch slot asks for.
        let rank = claim(&server, &secret, &["slice_rank"]).await.expect("the rank pinned to the lent slice");
        let id = rank["job_id"].as_str().unwrap().to_string();
        assert_eq!(rank["spec"]["world"], 1, "a world of one");
        for _ in 0..2 {
            let body = json!({"address": "127.0.0.1:7300"});
            assert_eq!(server.post(&secret, &format!("/agent/jobs/{id}/rendezvous"), body).await.status(), 200);
        }
        let ranks = vec![(id, 1, rank["slice"]["uuid"].as_str().expect("bound to a slice").to_string())];
        let now = slices(&server, &admin).await;
        let slice = now.iter().find(|s| s["uuid"] == ranks[0].2.as_str()).unwrap();
        assert_eq!((slice["loan_state"].as_str(), slice["lender"].as_str()), (Some("loaned"), Some("embed")), "{slice}");
        assert_eq!(get(&server, &admin, &format!("/jobs/{job}")).await["state"], "running");
        // An SLO deployment planned now gets the five free slices, not the lent one.
        let body = json!({"name": "more", "model": "tiny", "throughput": 600.0, "latency_ms": 50});
        let response = server.post(&admin, "/deployments", body).await;
        assert_eq!(response.status(), 201);
        let more: Value = response.json().await.unwrap();
        let planned: Vec<&str> = more["slo"]["slices"].as_array().unwrap().iter().map(|s| s["slice"].as_str().unwrap()).collect();
        assert_eq!(planned.len(), 5, "{more}");
        assert!(!planned.contains(&ranks[0].2.as_str()), "{more}");
        let response = server.http.delete(server.api("/deployments/more")).bearer_auth(&admin).send().await.unwrap();
        assert_eq!(response.status(), 204);

        // 150 req/s × 1.2 needs both slices of 100 req/s: the lent one comes back.
        store::record_rates(&server.state.db, Uuid::new_v4(), &[(deployment, 150.0)]).await.unwrap();
        let spike = run_round(&server.state).await.unwrap();
        assert_eq!(spike.preempted, 1, "{spike:?}");
        stop_gang(&server, &secret, &ranks).await;
        let preempted = get(&server, &bob, &format!("/jobs/{job}")).await;
        assert_eq!(preempted["state"], "preempted");
        // Bob learns why, but not the name of the admin's deployment.
        let told = format!("{preempted} {:?}", logs(&server, &bob, &job).await);
        let why = "Preempted by the loaning round: another user's deployment needs its 1g.10gb slices back.";
        assert!(told.contains(why) && !told.contains("embed"), "{told}");
        let overview = get(&server, &admin, "/fleet/loaning").await;
        assert!(overview["reclaims"][0]["reason"].as_str().unwrap().starts_with("embed needs its"), "{overview}");
    }
}

/// A worker that restarts keeps the loans on its slices (the lender stays a replica
/// short by the loan, not for good), and another worker cannot take slices a live one offers.
#[tokio::test]
async fn a_worker_restart_keeps_its_slices_loans() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let secret = mig_worker_with_tiny(&server, &admin).await;
        let body = json!({"name": "embed", "model": "tiny", "replicas": 2, "loanable": true, "reclaim_headroom": 0.2});
        assert_eq!(server.post(&admin, "/deployments", body).await.status(), 201);
        run_replicas(&server, &secret, 2).await;
        let data = server.toy_dataset(&admin).await;
        let job = preemptible_job(&data, "one-slice", 1);
        let response = server.post(&admin, "/jobs", job).await;
        assert_eq!(response.status(), 201, "{}", response.text().await.unwrap());
        run_round(&server.state).await.unwrap();
        assert_eq!(run_round(&server.state).await.unwrap().lent, 1);

        let (status, _, message) = error(offer_slices(&server, "mig-2", "mig-1", None).await).await;
        assert_eq!((status, message.contains("offered by worker 'mig-1', which is online")), (409, true), "{message}");
        let response = offer_slices(&server, "mig-1", "mig-1", Some(&secret)).await;
        assert_eq!(response.status(), 200);
        let now = slices(&server, &admin).await;
        assert_eq!(now.len(), 7);
        assert_eq!(count(&now, "loaned"), 1, "{now:?}");
        assert!(now.iter().any(|s| s["loan_state"] == "loaned" && s["lender"] == "embed"), "{now:?}");
        assert_eq!(get(&server, &admin, "/deployments/embed").await["loaned_slices"], 1);

        // Scaled to zero, it gives its loan up (the training on it goes on) and queues nothing.
        assert_eq!(patch(&server, &admin, "/deployments/embed", json!({"replicas": 0})).await.status(), 200);
        let repaired = tessera_server::deployments::repair(&server.state.db, tessera_server::store::db::now_ms(), 0).await;
        assert_eq!(repaired.unwrap(), 0);
        let d = get(&server, &admin, "/deployments/embed").await;
        assert_eq!((d["loaned_slices"].as_u64(), d["replica_status"].as_array().map(Vec::len)), (Some(0), Some(0)), "{d}");
        assert_eq!(count(&slices(&server, &admin).await, "loaned"), 0);
        // Scaled up again, it queues both replicas.
        let d: Value = patch(&server, &admin, "/deployments/embed", json!({"replicas": 2})).await.json().await.unwrap();
        assert_eq!(d["replica_status"].as_array().unwrap().len(), 2, "{d}");
    }
}

/// Claims every rank the round pinned, forms the gang (each posts its ring address
/// twice: once to join, once to learn it formed) and returns the rank job ids by rank
/// with each one's world and slice.
async fn form_gang(server: &TestServer, secret: &str) -> Vec<(String, u64, String)> {
    let mut ranks = Vec::new();
    while let Some(rank) = claim(server, secret, &["train_rank"]).await {
        ranks.push((
            rank["spec"]["rank"].as_u64().unwrap(),
            rank["job_id"].as_str().unwrap().to_string(),
            rank["spec"]["world"].as_u64().unwrap(),
            rank["slice"]["uuid"].as_str().expect("bound to a slice").to_string(),
        ));
    }
    ranks.sort();
    for _ in 0..2 {
        for (i, (_, id, _, _)) in ranks.iter().enumerate() {
            let body = json!({"address": format!("127.0.0.1:{}", 7100 + i)});
            let response = server.post(secret, &format!("/agent/jobs/{id}/rendezvous"), body).await;
            assert_eq!(response.status(), 200);
        }
    }
    ranks.into_iter().map(|(_, id, world, slice)| (id, world, slice)).collect()
}

/// Every rank reports `steps` step timings of `iter_ms` each (a rank reports its own).
async fn report_steps(server: &TestServer, secret: &str, ranks: &[(String, u64, String)], steps: std::ops::Range<u64>, iter_ms: f64) {
    for (rank, (id, _, _)) in ranks.iter().enumerate() {
        let timings: Vec<Value> = steps
            .clone()
            .map(|step| json!({"rank": rank, "step": step, "iter_ms": iter_ms, "wait_ms": 0.0, "allreduce_ms": 1.0}))
            .collect();
        let response =
            server.post(secret, &format!("/agent/jobs/{id}/training-metrics"), json!({"ranks": timings})).await;
        assert_eq!(response.status(), 204, "{}", response.text().await.unwrap());
    }
}

/// The worker hears at its heartbeat that the gang is to stop, and every rank reports
/// itself preempted (after rank 0's checkpoint, in a real worker).
async fn stop_gang(server: &TestServer, secret: &str, ranks: &[(String, u64, String)]) {
    let ids: Vec<&str> = ranks.iter().map(|(id, _, _)| id.as_str()).collect();
    let beat: Value = server.post(secret, "/agent/heartbeat", json!({"jobs": ids})).await.json().await.unwrap();
    assert_eq!(beat["preempt"].as_array().map(Vec::len), Some(ids.len()), "{beat}");
    for id in ids {
        let body = json!({"state": "preempted", "message": "Preempted at the step it was on."});
        assert_eq!(server.post(secret, &format!("/agent/jobs/{id}/status"), body).await.status(), 204);
    }
}

/// The worker side of an in-place resize of the gang running as `ranks` (generation
/// `generation`): joining ranks (pinned to the worker's slices) are claimed and post at
/// `…/regroup`, the heartbeat then asks every rank of the gang to stop, each posts, and
/// the new world forms. Returns the new world's ranks as `form_gang` does, and how many left.
async fn regroup_gang(
    server: &TestServer,
    secret: &str,
    ranks: &[(String, u64, String)],
    generation: u32,
) -> (Vec<(String, u64, String)>, usize) {
    let mut joining = Vec::new();
    while let Some(rank) = claim(server, secret, &["train_rank"]).await {
        assert_eq!(rank["spec"]["joining"], true, "{rank}");
        joining.push((rank["job_id"].as_str().unwrap().to_string(), rank["slice"]["uuid"].as_str().unwrap().to_string()));
    }
    let post = |id: String, port: usize, generation: u32| async move {
        let body = json!({"address": format!("127.0.0.1:{port}"), "generation": generation});
        let response = server.post(secret, &format!("/agent/jobs/{id}/regroup"), body).await;
        let status = response.status().as_u16();
        let answer: Value = response.json().await.unwrap();
        assert_eq!(status, 200, "{id} at generation {generation}: {answer}");
        answer
    };
    for (i, (id, _)) in joining.iter().enumerate() {
        assert_eq!(post(id.clone(), 7200 + i, 0).await["state"], "waiting");
    }
    let ids: Vec<&str> = ranks.iter().map(|(id, _, _)| id.as_str()).collect();
    let beat: Value = server.post(secret, "/agent/heartbeat", json!({"jobs": ids})).await.json().await.unwrap();
    assert_eq!(beat["preempt"].as_array().map(Vec::len), Some(ids.len()), "every rank stops: {beat}");
    let everyone: Vec<(String, String, u32)> = ranks
        .iter()
        .map(|(id, _, slice)| (id.clone(), slice.clone(), generation))
        .chain(joining.into_iter().map(|(id, slice)| (id, slice, 0)))
        .collect();
    // Twice: ranks that posted before the last learn the new world on their next poll.
    let mut formed = Vec::new();
    let mut left = HashSet::new();
    for _ in 0..2 {
        formed.clear();
        for (i, (id, slice, generation)) in everyone.iter().enumerate() {
            if left.contains(id) {
                continue;
            }
            let answer = post(id.clone(), 7300 + i, *generation).await;
            match answer["state"].as_str().unwrap() {
                "formed" => formed.push((answer["rank"].as_u64().unwrap(), id.clone(), answer["world"].as_u64().unwrap(), slice.clone())),
                "leave" => drop(left.insert(id.clone())),
                state => assert_eq!(state, "waiting"),
            }
        }
    }
    let left = left.len();
    formed.sort();
    (formed.into_iter().map(|(_, id, world, slice)| (id, world, slice)).collect(), left)
}

/// A loanable deployment `embed` of `replicas` tiny-model replicas (reclaim headroom 0.2),
/// each running on one of the worker's slices: its id.
async fn serving_embed(server: &TestServer, admin: &str, secret: &str, replicas: usize) -> Uuid {
    let body = json!({"name": "embed", "model": "tiny", "replicas": replicas, "loanable": true, "reclaim_headroom": 0.2});
    let response = server.post(admin, "/deployments", body).await;
    let id = response.json::<Value>().await.unwrap()["id"].as_str().unwrap().parse().unwrap();
    run_replicas(server, secret, replicas).await;
    id
}

/// A running elastic gang (1 to 3 ranks) on a deployment's loaned slices is resized by
/// the round: it keeps its size for the hysteresis' rounds after it formed, then grows in
/// place onto the spare loaned slices (two ranks join, the gang re-forms at three, no
/// preemption); when the lender's demand returns it shrinks in place by the rank on the
/// slice the lender needs instead of being preempted, and the slice goes back. The job's
/// log and the reclaim events show both.
#[tokio::test]
async fn a_running_elastic_gang_grows_onto_spare_slices_and_shrinks_on_reclaim() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let secret = mig_worker_with_tiny(&server, &admin).await;
        let deployment_id = serving_embed(&server, &admin, &secret, 7).await;
        let data = server.toy_dataset(&admin).await;
        let body = json!({"name": "elastic", "model": {"kind": "mlp", "hidden": [8]}, "dataset": data,
            "task": {"type": "classification", "label_column": "label", "validation_split": 0.25},
            "optimizer": {"type": "sgd"}, "batch_size": 8, "max_steps": 100000, "eval_every": 1000, "checkpoint_every": 1000,
            "lr_schedule": {"type": "constant", "lr": 0.1}, "seed": 1,
            "parallel": {"ranks": [{"slice": PROFILE}, {"slice": PROFILE}, {"slice": PROFILE}]},
            "resources": {"min_ranks": 1, "max_ranks": 3, "preemptible": true}});
        let job: Value = server.post(&admin, "/jobs", body).await.json().await.unwrap();
        let job = job["id"].as_str().unwrap().to_string();

        // At 400 req/s one slice is lent at the second round (the first counts a calm one:
        // 400 × 1.35 needs 6 of 7); the gang starts on it at its minimum and reports 0.1 s
        // steps. Then demand falls away and the loan grows to six slices.
        let meter = Uuid::new_v4();
        store::record_rates(&server.state.db, meter, &[(deployment_id, 400.0)]).await.unwrap();
        let first = run_round(&server.state).await.unwrap();
        assert_eq!((first.lent, first.started), (0, 0), "{first:?}");
        let second = run_round(&server.state).await.unwrap();
        assert_eq!((second.lent, second.started), (1, 1), "{second:?}");
        let one = form_gang(&server, &secret).await;
        assert_eq!(one.len(), 1);
        assert_eq!(get(&server, &admin, &format!("/jobs/{job}")).await["state"], "running");
        report_steps(&server, &secret, &one, 1..21, 100.0).await;
        store::record_rates(&server.state.db, meter, &[(deployment_id, 0.0)]).await.unwrap();

        // It keeps its size for the hysteresis' rounds, then grows (100,000 steps left: a third of 10,000 s saved
        // at the one-count prior, far above the pause).
        let (grow, rounds) = until_resized(&server).await;
        assert!(rounds >= 10, "resized after {rounds} rounds, inside the hysteresis");
        assert_eq!((grow.resized, grow.preempted), (1, 0), "{grow:?}");
        assert_eq!(count(&slices(&server, &admin).await, "loaned"), 6);
        assert_eq!(get(&server, &admin, &format!("/jobs/{job}")).await["state"], "running", "it trains on");
        let (three, left) = regroup_gang(&server, &secret, &one, 1).await;
        assert_eq!((three.iter().map(|(_, w, _)| *w).collect::<Vec<_>>(), left), (vec![3, 3, 3], 0));
        assert_eq!(three[0], (one[0].0.clone(), 3, one[0].2.clone()), "rank 0 stays rank 0 on its slice");
        assert_eq!(get(&server, &admin, &format!("/jobs/{job}")).await["state"], "running");
        report_steps(&server, &secret, &three, 21..41, 40.0).await;
        // Measured at 3 and held by the hysteresis, it does not move.
        for _ in 0..3 {
            let calm = run_round(&server.state).await.unwrap();
            assert_eq!((calm.resized, calm.preempted), (0, 0), "{calm:?}");
        }

        // Demand returns: 350 req/s × 1.2 needs 5 slices, so 4 of the 6 lent come back:
        // the 3 free ones, and one the gang gives up by shrinking, preempted by no one.
        store::record_rates(&server.state.db, meter, &[(deployment_id, 350.0)]).await.unwrap();
        let spike = run_round(&server.state).await.unwrap();
        assert_eq!((spike.resized, spike.preempted), (1, 0), "{spike:?}");
        let overview = get(&server, &admin, "/fleet/loaning").await;
        let reclaims = overview["reclaims"].as_array().unwrap();
        assert_eq!(reclaims.len(), 1, "{overview}");
        assert_eq!((reclaims[0]["job_id"].as_str(), reclaims[0]["preempted"].as_bool()), (Some(job.as_str()), Some(false)));
        assert_eq!(reclaims[0]["ranks"].as_u64(), Some(1), "{overview}");
        let (smaller, left) = regroup_gang(&server, &secret, &three, 2).await;
        let world = 2;
        assert_eq!((smaller.iter().map(|(_, w, _)| *w).collect::<Vec<_>>(), left), (vec![world; world as usize], 1));
        let reclaiming = slices(&server, &admin).await;
        let gone = three.iter().find(|r| !smaller.iter().any(|s| s.0 == r.0)).unwrap();
        let freed = reclaiming.iter().find(|s| s["uuid"] == gone.2.as_str()).unwrap();
        assert_eq!(freed["loan_state"], "reclaiming", "the leaving rank's slice is the one taken back: {freed}");
        let after = run_round(&server.state).await.unwrap();
        assert_eq!(after.returned, 1, "{after:?}");
        let placed = slices(&server, &admin).await;
        for (_, _, slice) in &smaller {
            let s = placed.iter().find(|s| s["uuid"] == slice.as_str()).unwrap();
            assert_eq!(s["loan_state"], "loaned", "the gang stays on the slices still lent: {s}");
        }
        assert_eq!((count(&placed, "loaned"), count(&placed, "reclaiming")), (2, 0), "{placed:?}");

        // The job's history: both resizes in its log, and no attempt spent.
        let lines = logs(&server, &admin, &job).await;
        assert!(lines.iter().any(|l| l.starts_with("Resized from 1 to 3 ranks in place") && l.contains("spare")), "{lines:?}");
        assert!(
            lines.iter().any(|l| l.starts_with(&format!("Resized from 3 to {world} ranks in place")) && l.contains("embed needs")),
            "{lines:?}"
        );
        never_stopped(&server, &admin, &job).await;
    }
}

/// `job` runs on its first attempt, never preempted: every resize it had was in place.
async fn never_stopped(server: &TestServer, token: &str, job: &str) {
    let job = get(server, token, &format!("/jobs/{job}")).await;
    let (state, preemptions, attempts) = (job["state"].as_str(), job["preemptions"].as_u64(), job["attempts"].as_u64());
    assert_eq!((state, preemptions, attempts), (Some("running"), Some(0), Some(1)), "{job}");
}

/// A preemptible job of 10 steps on `ranks` slices (checkpoints and evaluations every 5).
fn preemptible_job(data: &str, name: &str, ranks: usize) -> Value {
    json!({"name": name, "model": {"kind": "mlp", "hidden": [8]}, "dataset": data,
        "task": {"type": "classification", "label_column": "label", "validation_split": 0.25},
        "optimizer": {"type": "sgd"}, "batch_size": 8, "max_steps": 10, "eval_every": 5, "checkpoint_every": 5,
        "lr_schedule": {"type": "constant", "lr": 0.1}, "seed": 1,
        "parallel": {"ranks": vec![json!({"slice": PROFILE}); ranks]}, "resources": {"preemptible": true}})
}

/// An elastic job on `ranks` slices of the worker (between one and `ranks`), `steps` long.
fn elastic_job(data: &str, name: &str, ranks: usize, steps: u64) -> Value {
    json!({"name": name, "model": {"kind": "mlp", "hidden": [8]}, "dataset": data,
        "task": {"type": "classification", "label_column": "label", "validation_split": 0.25},
        "optimizer": {"type": "sgd"}, "batch_size": 8, "max_steps": steps, "eval_every": 1000, "checkpoint_every": 1000,
        "lr_schedule": {"type": "constant", "lr": 0.1}, "seed": 1,
        "parallel": {"ranks": vec![json!({"slice": PROFILE}); ranks]},
        "resources": {"min_ranks": 1, "max_ranks": ranks, "preemptible": true}})
}

/// The training queue's entry of `job`.
async fn queued(server: &TestServer, token: &str, job: &str) -> Value {
    let overview = get(server, token, "/fleet/loaning").await;
    let queue = overview["queue"].as_array().unwrap();
    queue.iter().find(|q| q["job_id"] == job).unwrap_or_else(|| panic!("{job} not queued: {overview}")).clone()
}

/// Two elastic gangs share the training pool: a short one on six slices, a long one on the
/// seventh. Once both are past their hysteresis, the knapsack moves five ranks from the
/// short job to the long one in one round, both in place: the short gang shrinks, and the
/// long one's joiners are pinned to the slices the short gang's leaving ranks still run on.
/// No worker can claim them until those ranks are gone; then the long gang grows onto
/// them. No one is preempted or restarted.
#[tokio::test]
async fn a_grow_onto_slices_another_gang_gives_up_claims_them_once_its_ranks_are_gone() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let secret = mig_worker_with_tiny(&server, &admin).await;
        let data = server.toy_dataset(&admin).await;

        // The short job starts alone on six of the seven slices (the prior values each rank).
        let short: Value = server.post(&admin, "/jobs", elastic_job(&data, "short", 6, 400)).await.json().await.unwrap();
        let short = short["id"].as_str().unwrap().to_string();
        assert_eq!(next_round(&server).await.started, 1);
        let six = form_gang(&server, &secret).await;
        assert_eq!(six.iter().map(|(_, w, _)| *w).collect::<Vec<_>>(), vec![6; 6]);
        report_steps(&server, &secret, &six, 1..21, 100.0).await;
        // The long one starts on the slice left, and measures 1 s a step there.
        let long: Value = server.post(&admin, "/jobs", elastic_job(&data, "long", 6, 100_000)).await.json().await.unwrap();
        let long = long["id"].as_str().unwrap().to_string();
        let start = next_round(&server).await;
        assert_eq!((start.started, start.resized), (1, 0), "{start:?}");
        let one = form_gang(&server, &secret).await;
        assert_eq!(one.len(), 1);
        report_steps(&server, &secret, &one, 1..21, 1000.0).await;

        // When the long job may change size, its 100,000 steps gain far more from five more
        // ranks than the short job's 400 lose: both resize in one round.
        let (moved, rounds) = until_resized(&server).await;
        assert!(rounds >= 9, "resized after {rounds} rounds, inside the long job's hysteresis");
        assert_eq!((moved.resized, moved.preempted, moved.started), (2, 0, 0), "{moved:?}");
        for job in [&short, &long] {
            let entry = queued(&server, &admin, job).await;
            assert!(entry["note"].as_str().unwrap().starts_with("resizing in place to"), "{entry}");
        }
        // The joiners' slices still run the short gang's leaving ranks: nobody claims them.
        assert!(claim(&server, &secret, &["train_rank"]).await.is_none(), "a joiner was claimed onto a slice in use");
        let meanwhile = next_round(&server).await;
        assert_eq!((meanwhile.resized, meanwhile.preempted), (0, 0), "{meanwhile:?}");
        let (shrunk, left) = regroup_gang(&server, &secret, &six, 1).await;
        assert_eq!((shrunk.len(), left), (1, 5));
        assert_eq!(shrunk[0].0, six[0].0, "rank 0 stays");

        // Those ranks are gone: the long gang's joiners are claimed and it grows in place.
        let (grown, left) = regroup_gang(&server, &secret, &one, 1).await;
        assert_eq!((grown.iter().map(|(_, w, _)| *w).collect::<Vec<_>>(), left), (vec![6; 6], 0));
        let freed: HashSet<&str> = six[1..].iter().map(|(_, _, s)| s.as_str()).collect();
        let joined: HashSet<&str> = grown[1..].iter().map(|(_, _, s)| s.as_str()).collect();
        assert_eq!(joined, freed, "the joiners run on the slices the short gang gave up");

        let lines = logs(&server, &admin, &short).await;
        assert!(lines.iter().any(|l| l.starts_with("Resized from 6 to 1 ranks in place") && l.contains("other jobs take")), "{lines:?}");
        let lines = logs(&server, &admin, &long).await;
        assert!(lines.iter().any(|l| l.starts_with("Resized from 1 to 6 ranks in place") && l.contains("5 spare")), "{lines:?}");
        for job in [&short, &long] {
            never_stopped(&server, &admin, job).await;
        }
    }
}

/// A reclaim that takes one of an elastic gang's two lent slices while a training slice is
/// free: the plan moves that rank to the training pool. The gang shrinks in place out of
/// the lent slice at once (the lender gets it back without a preemption) and grows in place
/// onto the training slice at the first round after that shrink formed, not held back by
/// the hysteresis: never stopped and restarted.
#[tokio::test]
async fn a_move_between_pools_shrinks_in_place_now_and_grows_in_place_later() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let secret = mig_worker_with_tiny(&server, &admin).await;
        let data = server.toy_dataset(&admin).await;
        let deployment = serving_embed(&server, &admin, &secret, 5).await;

        // An inelastic job holds the two training slices; the idle deployment lends four.
        let mut blocker = elastic_job(&data, "blocker", 2, 100_000);
        blocker["resources"] = json!({"preemptible": false});
        let blocker: Value = server.post(&admin, "/jobs", blocker).await.json().await.unwrap();
        let meter = Uuid::new_v4();
        store::record_rates(&server.state.db, meter, &[(deployment, 0.0)]).await.unwrap();
        assert_eq!(next_round(&server).await.started, 1);
        let held = form_gang(&server, &secret).await;
        assert_eq!(held.len(), 2);
        for _ in 0..5 {
            next_round(&server).await;
        }
        assert_eq!(count(&slices(&server, &admin).await, "loaned"), 4);

        // The elastic job starts on two lent slices (the prior values its second rank).
        let job: Value = server.post(&admin, "/jobs", elastic_job(&data, "elastic", 2, 100_000)).await.json().await.unwrap();
        let job = job["id"].as_str().unwrap().to_string();
        assert_eq!(next_round(&server).await.started, 1);
        let two = form_gang(&server, &secret).await;
        assert_eq!(two.iter().map(|(_, w, _)| *w).collect::<Vec<_>>(), vec![2, 2]);
        report_steps(&server, &secret, &two, 1..21, 500.0).await;
        // The blocker ends: its two training slices are free.
        for (id, _, _) in &held {
            let body = json!({"state": "succeeded", "message": "done"});
            assert_eq!(server.post(&secret, &format!("/agent/jobs/{id}/status"), body).await.status(), 204);
        }
        assert_eq!(get(&server, &admin, &format!("/jobs/{}", blocker["id"].as_str().unwrap())).await["state"], "succeeded");

        // 300 req/s × 1.2 needs four slices: three of the four lent come back, the two free
        // ones and one of the gang's. The gang gives that one up in place now.
        store::record_rates(&server.state.db, meter, &[(deployment, 300.0)]).await.unwrap();
        let spike = next_round(&server).await;
        assert_eq!((spike.resized, spike.preempted), (1, 0), "{spike:?}");
        let (one, left) = regroup_gang(&server, &secret, &two, 1).await;
        assert_eq!((one.len(), left), (1, 1));
        let after = slices(&server, &admin).await;
        let gone = after.iter().find(|s| s["uuid"] == two[1].2.as_str()).unwrap();
        assert_eq!(gone["loan_state"], "reclaiming", "the leaving rank's slice is the one taken back: {gone}");

        // The round after, it grows in place onto a training slice.
        let (grow, rounds) = until_resized(&server).await;
        assert_eq!(rounds, 1, "grew back {rounds} rounds after the shrink formed");
        assert_eq!((grow.resized, grow.preempted, grow.started), (1, 0, 0), "{grow:?}");
        let (back, left) = regroup_gang(&server, &secret, &one, 2).await;
        assert_eq!((back.iter().map(|(_, w, _)| *w).collect::<Vec<_>>(), left), (vec![2, 2], 0));
        let fleet = slices(&server, &admin).await;
        let joined = fleet.iter().find(|s| s["uuid"] == back[1].2.as_str()).unwrap();
        assert!(joined["lender"].is_null() && joined["loan_state"] == "serving", "the joiner runs on a training slice: {joined}");

        let lines = logs(&server, &admin, &job).await;
        assert!(
            lines.iter().any(|l| l.starts_with("Resized from 2 to 1 ranks in place") && l.contains("It grows to 2 on other slices once it re-formed")),
            "{lines:?}"
        );
        assert!(lines.iter().any(|l| l.starts_with("Resized from 1 to 2 ranks in place")), "{lines:?}");
        never_stopped(&server, &admin, &job).await;
    }
}

/// A reclaim that comes while an elastic gang grows in place, before its joining ranks are
/// ready, cuts the grow back instead of preempting the gang. Taking back only the joiners'
/// slices calls the grow off (the ranks never stop, the slices go back in the same round);
/// taking back a running rank's slice as well drops the joiners and shrinks the ring at
/// once, without waiting for their warm-up.
#[tokio::test]
async fn a_reclaim_during_a_grow_in_place_cuts_it_back_instead_of_preempting() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let secret = mig_worker_with_tiny(&server, &admin).await;
        let deployment = serving_embed(&server, &admin, &secret, 7).await;
        let data = server.toy_dataset(&admin).await;
        let job: Value = server.post(&admin, "/jobs", elastic_job(&data, "elastic", 4, 100_000)).await.json().await.unwrap();
        let job = job["id"].as_str().unwrap().to_string();

        // At 300 req/s two slices are lent (300 × 1.35 needs 5 of 7) and the gang starts on both.
        let meter = Uuid::new_v4();
        store::record_rates(&server.state.db, meter, &[(deployment, 300.0)]).await.unwrap();
        next_round(&server).await;
        assert_eq!(next_round(&server).await.started, 1);
        let two = form_gang(&server, &secret).await;
        assert_eq!(two.iter().map(|(_, w, _)| *w).collect::<Vec<_>>(), vec![2, 2]);
        report_steps(&server, &secret, &two, 1..21, 500.0).await;

        // Demand falls away: the loan grows to six and the gang grows in place to four.
        let grow_to_four = || async {
            store::record_rates(&server.state.db, meter, &[(deployment, 0.0)]).await.unwrap();
            let (grow, _) = until_resized(&server).await;
            assert_eq!((grow.resized, grow.preempted), (1, 0), "{grow:?}");
            assert_eq!(queued(&server, &admin, &job).await["note"], "resizing in place to 4 1g.10gb slices");
        };
        grow_to_four().await;
        assert_eq!(count(&slices(&server, &admin).await, "loaned"), 6);

        // Before its joiners are ready, 350 req/s × 1.2 takes four slices back: the two free
        // ones and the joiners'. The grow is called off; the gang trains on at two.
        store::record_rates(&server.state.db, meter, &[(deployment, 350.0)]).await.unwrap();
        let spike = next_round(&server).await;
        assert_eq!((spike.resized, spike.preempted, spike.returned), (1, 0, 4), "{spike:?}");
        let fleet = slices(&server, &admin).await;
        assert_eq!((count(&fleet, "loaned"), count(&fleet, "reclaiming")), (2, 0), "{fleet:?}");
        let ids: Vec<&str> = two.iter().map(|(id, _, _)| id.as_str()).collect();
        let quiet: Value = server.post(&secret, "/agent/heartbeat", json!({"jobs": ids})).await.json().await.unwrap();
        assert!(quiet["preempt"].as_array().is_none_or(Vec::is_empty), "the ranks are not asked to stop: {quiet}");
        assert!(claim(&server, &secret, &["train_rank"]).await.is_none(), "no joiner is left to claim");
        assert_eq!(queued(&server, &admin, &job).await["note"], "running on 2 1g.10gb slices");
        let overview = get(&server, &admin, "/fleet/loaning").await;
        let reclaims = overview["reclaims"].as_array().unwrap();
        assert_eq!((reclaims.len(), reclaims[0]["preempted"].as_bool(), reclaims[0]["ranks"].as_u64()), (1, Some(false), Some(2)), "{overview}");

        // It grows to four again; this time 450 req/s × 1.2 leaves one slice lent: the
        // joiners go and rank 1 leaves, and the ring stops now to re-form at one.
        grow_to_four().await;
        store::record_rates(&server.state.db, meter, &[(deployment, 450.0)]).await.unwrap();
        let spike = next_round(&server).await;
        assert_eq!((spike.resized, spike.preempted), (1, 0), "{spike:?}");
        let (one, left) = regroup_gang(&server, &secret, &two, 1).await;
        assert_eq!((one.len(), left), (1, 1));
        assert_eq!(one[0], (two[0].0.clone(), 1, two[0].2.clone()), "rank 0 stays on its slice");
        let after = next_round(&server).await;
        assert_eq!(after.preempted, 0, "{after:?}");
        let fleet = slices(&server, &admin).await;
        assert_eq!((count(&fleet, "loaned"), count(&fleet, "reclaiming")), (1, 0), "{fleet:?}");

        let lines = logs(&server, &admin, &job).await;
        assert!(lines.iter().any(|l| l.starts_with("Its in-place resize to 4 ranks was called off") && l.contains("embed needs")), "{lines:?}");
        assert!(lines.iter().any(|l| l.starts_with("Its in-place resize to 4 ranks was cut to 1")), "{lines:?}");
        never_stopped(&server, &admin, &job).await;
    }
}

/// How a reclaim cuts a grow under way (`store::regroup::cut`, called here as the round
/// does): a running rank that must leave drops the joining ranks not yet ready, newest
/// first, down to the job's minimum, so the ring stops without waiting for them; a ready
/// joiner stays, and so does one the minimum needs, which the ring then waits for.
#[tokio::test]
async fn a_cut_regroup_drops_joiners_not_yet_ready_down_to_the_minimum() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let secret = mig_worker_with_tiny(&server, &admin).await;
        let data = server.toy_dataset(&admin).await;
        // An inelastic job holds five slices while an elastic one starts on the other two.
        let mut blocker = elastic_job(&data, "blocker", 5, 100_000);
        blocker["resources"] = json!({"preemptible": false});
        server.post(&admin, "/jobs", blocker).await;
        assert_eq!(next_round(&server).await.started, 1);
        let five = form_gang(&server, &secret).await;
        server.post(&admin, "/jobs", elastic_job(&data, "elastic", 5, 100_000)).await;
        assert_eq!(next_round(&server).await.started, 1);
        let two = form_gang(&server, &secret).await;
        assert_eq!(two.len(), 2);
        for (id, _, _) in &five {
            let body = json!({"state": "succeeded", "message": "done"});
            assert_eq!(server.post(&secret, &format!("/agent/jobs/{id}/status"), body).await.status(), 204);
        }

        // It grows to five in place on three of the freed slices; one joiner gets ready.
        let gangs = store::slice_gangs(&server.state.db).await.unwrap();
        let gang = gangs.iter().find(|g| g.name == "elastic").unwrap();
        let freed: Vec<String> = five[..3].iter().map(|(_, _, s)| s.clone()).collect();
        let asked = tessera_server::gangs::regroup_in_place(&server.state, gang.id, &gang.train, (2, 5), &[], &freed);
        assert!(asked.await.unwrap());
        let mut joiners = Vec::new();
        while let Some(rank) = claim(&server, &secret, &["train_rank"]).await {
            joiners.push((rank["spec"]["rank"].as_u64().unwrap(), rank["job_id"].as_str().unwrap().to_string()));
        }
        joiners.sort();
        let (on, worker) = (&server, secret.as_str());
        let post = |id: String| async move {
            let body = json!({"address": "127.0.0.1:7400", "generation": 0});
            on.post(worker, &format!("/agent/jobs/{id}/regroup"), body).await.status()
        };
        assert_eq!(post(joiners[0].1.clone()).await, 200);

        // A reclaim takes rank 1's slice at a minimum of three: the newest joiner, not
        // ready, goes; the ready one stays, and so does the other, which three needs.
        let rank1: Uuid = two[1].0.parse().unwrap();
        let cut = tessera_server::store::regroup::cut(&server.state.db, gang.id, &[rank1], 3).await.unwrap().unwrap();
        let newest: Uuid = joiners[2].1.parse().unwrap();
        assert_eq!((cut.world, cut.called_off), (3, false));
        assert_eq!(cut.gone.iter().collect::<HashSet<_>>(), HashSet::from([&rank1, &newest]));
        let ids: Vec<&str> = two.iter().map(|(id, _, _)| id.as_str()).collect();
        let beat = || async { server.post(&secret, "/agent/heartbeat", json!({"jobs": ids})).await.json::<Value>().await.unwrap() };
        let early = beat().await;
        assert!(early["preempt"].as_array().is_none_or(Vec::is_empty), "the ring waits for the joiner it keeps: {early}");
        assert_eq!(post(joiners[2].1.clone()).await, 409, "the dropped joiner is told to go");
        assert_eq!(post(joiners[1].1.clone()).await, 200);
        assert_eq!(beat().await["preempt"].as_array().map(Vec::len), Some(2), "both running ranks stop now");
        let fleet = slices(&server, &admin).await;
        let dropped = fleet.iter().find(|s| s["uuid"] == freed[2].as_str()).unwrap();
        assert_eq!(dropped["in_use"], false, "the dropped joiner's slice is free again: {dropped}");
    }
}

/// The round reads the deployments first and acts on them after: one deleted in between
/// lends nothing more, and a slice it was taking back serves again without a replica
/// (which its foreign key would refuse).
#[tokio::test]
async fn a_deployment_deleted_during_a_round_gets_no_loan_and_no_replica() {
    use tessera_server::store::deployments as deployments_store;
    use tessera_server::store::jobs::NewJob;
    use tessera_server::store::Scope;
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let db = &server.state.db;
        let admin = server.admin().await;
        let secret = mig_worker_with_tiny(&server, &admin).await;
        let body = json!({"name": "embed", "model": "tiny", "replicas": 4, "loanable": true});
        assert_eq!(server.post(&admin, "/deployments", body).await.status(), 201);
        run_replicas(&server, &secret, 4).await;
        run_round(&server.state).await.unwrap();
        assert_eq!(next_round(&server).await.lent, 3);
        let now = slices(&server, &admin).await;
        let loaned = now.iter().find(|s| s["loan_state"] == "loaned").unwrap()["uuid"].as_str().unwrap().to_string();
        let serving = now.iter().find(|s| s["loan_state"] == "serving").unwrap()["uuid"].as_str().unwrap().to_string();
        assert!(store::start_reclaim(db, &loaned, "demand returned").await.unwrap());

        // What the round read before the deletion.
        let read = deployments_store::get(db, &Scope::all(), "embed").await.unwrap().unwrap();
        assert_eq!(server.delete(&admin, "/deployments/embed").await.status(), 204);

        assert!(!store::lend(db, &serving, read.id, None, "idle").await.unwrap());
        let spec = tessera_server::deployments::replica_spec(&read);
        let replica = NewJob {
            deployment: Some(read.id),
            pinned_slice: Some(&loaned),
            ..NewJob::new(read.owner_id, "replica of embed", &spec, 3)
        };
        assert!(store::finish_reclaim(db, &loaned, read.id, &replica).await.unwrap());
        let after = slices(&server, &admin).await;
        for uuid in [&loaned, &serving] {
            let slice = after.iter().find(|s| s["uuid"] == uuid.as_str()).unwrap();
            assert_eq!(slice["loan_state"], "serving", "{slice}");
            assert!(slice["lender"].is_null(), "{slice}");
        }
        let jobs: Vec<Value> = server.get(&admin, "/jobs").await.json().await.unwrap();
        assert!(jobs.iter().all(|j| j["kind"] != "serve"), "no replica of the deleted deployment: {jobs:?}");
    }
}

/// The overview holds the newest slice events of the hour when there are more than it shows.
#[tokio::test]
async fn the_overview_keeps_the_newest_slice_events() {
    let server = TestServer::start(support::Backend::Sqlite).await;
    let admin = server.admin().await;
    let now = tessera_server::store::db::now_ms();
    for i in 0..2010 {
        sqlx::query("INSERT INTO loan_events (id, at, slice_uuid, state, detail) VALUES ($1, $2, 'MIG-x', 'idle', $3)")
            .bind(Uuid::new_v4().to_string())
            .bind(now - 60_000 + i)
            .bind(format!("event {i}"))
            .execute(server.state.db.pool())
            .await
            .unwrap();
    }
    let overview = get(&server, &admin, "/fleet/loaning").await;
    let events = overview["slice_events"].as_array().unwrap();
    assert_eq!(events.len(), 2000);
    assert_eq!((events[0]["detail"].as_str(), events[1999]["detail"].as_str()), (Some("event 2009"), Some("event 10")));
}

/// A scale reads what the deployment lends under the row's lock: a loan made between the
/// request's first read and its transaction does not get a replica queued in its place.
#[tokio::test]
async fn a_scale_counts_a_loan_made_while_it_waited() {
    use tessera_server::store::loaning::Holder;
    use tessera_server::store::{deployments as deployments_store, RowLock};
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let db = &server.state.db;
        let admin = server.admin().await;
        let secret = mig_worker_with_tiny(&server, &admin).await;
        let body = json!({"name": "embed", "model": "tiny", "replicas": 2, "loanable": true});
        let id: Uuid = server.post(&admin, "/deployments", body).await.json::<Value>().await.unwrap()["id"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        run_replicas(&server, &secret, 2).await;
        let fleet = store::fleet(db, 0).await.unwrap();
        let (slice, replica) = fleet
            .iter()
            .find_map(|s| match s.holder {
                Holder::Replica { job, .. } => Some((s.uuid.clone(), job)),
                _ => None,
            })
            .unwrap();

        // The round lends a slice, holding the deployment's row as it does, while a scale
        // to the same count is on its way.
        let mut lending = db.begin().await.unwrap();
        assert!(deployments_store::lock(&mut lending, db.backend(), id, RowLock::Share).await.unwrap());
        let request = server.http.patch(server.api("/deployments/embed")).bearer_auth(&admin);
        let scaled = support::send_into_a_lock(request.json(&json!({"replicas": 2}))).await;
        sqlx::query("UPDATE slices SET loan_state = 'loaned', lender_id = $1 WHERE uuid = $2")
            .bind(id.to_string())
            .bind(&slice)
            .execute(&mut *lending)
            .await
            .unwrap();
        sqlx::query("UPDATE jobs SET state = 'cancelled' WHERE id = $1")
            .bind(replica.to_string())
            .execute(&mut *lending)
            .await
            .unwrap();
        lending.commit().await.unwrap();
        assert_eq!(scaled.await.unwrap().status(), 200, "{backend:?}");
        let live: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM jobs WHERE deployment_id = $1 AND state IN ('queued', 'leased', 'running')",
        )
        .bind(id.to_string())
        .fetch_one(db.pool())
        .await
        .unwrap();
        assert_eq!(live, 1, "{backend:?}: two replicas wanted, one slice lent: one replica");
    }
}

/// A claim whose job or slice went between the lease and the binding answers the worker
/// "nothing to do" (not a 500) and leaves the job queued with its attempt unspent.
#[tokio::test]
async fn a_claim_whose_slice_or_job_went_meanwhile_gives_the_lease_back() {
    use tessera_server::store::jobs as jobs_store;
    use tessera_server::store::slices::{self, Bound};
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let db = &server.state.db;
        let admin = server.admin().await;
        mig_worker_with_tiny(&server, &admin).await;
        let worker: Uuid = sqlx::query_scalar::<_, String>("SELECT id FROM workers WHERE name = 'mig-1'")
            .fetch_one(db.pool())
            .await
            .unwrap()
            .parse()
            .unwrap();
        let body = json!({"name": "embed", "model": "tiny", "replicas": 1});
        assert_eq!(server.post(&admin, "/deployments", body).await.status(), 201);
        let serve = vec!["serve".to_string()];

        // The worker's slices are replaced between its claim and the binding.
        let free = slices::free_for(db, worker).await.unwrap();
        let claimed = jobs_store::claim(db, worker, &serve, 30_000, &free).await.unwrap().expect("the replica");
        let replaced = sqlx::query("DELETE FROM slices WHERE worker_id = $1").bind(worker.to_string());
        replaced.execute(db.pool()).await.unwrap();
        assert!(matches!(slices::bind_claimed(db, worker, claimed.job_id, &free).await.unwrap(), Bound::Gone));
        let (state, attempts): (String, i64) = sqlx::query_as("SELECT state, attempts FROM jobs WHERE id = $1")
            .bind(claimed.job_id.to_string())
            .fetch_one(db.pool())
            .await
            .unwrap();
        assert_eq!((state.as_str(), attempts), ("queued", 0), "{backend:?}");

        // The deployment is deleted between a claim and the binding.
        let free = slices::free_for(db, worker).await.unwrap();
        let claimed = jobs_store::claim(db, worker, &serve, 30_000, &free).await.unwrap().expect("the replica again");
        assert_eq!(server.delete(&admin, "/deployments/embed").await.status(), 204);
        assert!(matches!(slices::bind_claimed(db, worker, claimed.job_id, &free).await.unwrap(), Bound::Gone));
    }
}

/// The number of `gang`'s ranks pinned to a slice.
async fn pinned_ranks(server: &TestServer, gang: &str) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM jobs WHERE gang_id = $1 AND slice_pinned = 1")
        .bind(gang)
        .fetch_one(server.state.db.pool())
        .await
        .unwrap()
}

/// A rank pinned to a slice waits while any job holds it (a replica bound there after the
/// round read the fleet, say); preempting the gang while it forms clears its pins, as a
/// checkpointed preemption does, so it is not claimed again on slices being taken back; and
/// removing the worker ends its slices' loans, so the lender is not left short for good.
#[tokio::test]
async fn pinned_ranks_wait_for_held_slices_and_preempting_or_removing_frees_slices() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let secret = mig_worker_with_tiny(&server, &admin).await;
        let body = json!({"name": "embed", "model": "tiny", "replicas": 3, "loanable": true, "reclaim_headroom": 0.2});
        assert_eq!(server.post(&admin, "/deployments", body).await.status(), 201);
        run_replicas(&server, &secret, 3).await;
        let data = server.toy_dataset(&admin).await;
        let gang = preemptible_job(&data, "pinned", 2);
        let response = server.post(&admin, "/jobs", gang).await;
        assert_eq!(response.status(), 201);
        let job = response.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_string();
        run_round(&server.state).await.unwrap();
        assert_eq!(next_round(&server).await.started, 1);
        assert_eq!(pinned_ranks(&server, &job).await, 2);

        // The live replica is moved onto one pinned slice and the other is taken by hand:
        // neither rank may be claimed while a job holds its slice.
        let db = server.state.db.pool();
        let pins: Vec<String> = sqlx::query_scalar("SELECT slice_uuid FROM jobs WHERE gang_id = $1 ORDER BY gang_rank")
            .bind(&job)
            .fetch_all(db)
            .await
            .unwrap();
        let replica: String = sqlx::query_scalar("SELECT id FROM jobs WHERE kind = 'serve' AND state = 'running' LIMIT 1")
            .fetch_one(db)
            .await
            .unwrap();
        let hold = |slice: &str| {
            sqlx::query("UPDATE jobs SET slice_uuid = $1 WHERE id = $2").bind(slice.to_string()).bind(replica.clone())
        };
        hold(&pins[0]).execute(db).await.unwrap();
        let other = claim(&server, &secret, &["train_rank"]).await.expect("the rank on the free slice");
        assert_eq!(other["slice"]["uuid"], pins[1].as_str());
        assert!(claim(&server, &secret, &["train_rank"]).await.is_none(), "a rank took the replica's slice");

        // Preempted while forming: the claimed rank is released and every pin goes.
        let response = server.post(&admin, &format!("/jobs/{job}/preempt"), json!({"reason": "test"})).await;
        assert_eq!(response.status(), 202, "{}", response.text().await.unwrap());
        assert_eq!(pinned_ranks(&server, &job).await, 0);
        assert!(claim(&server, &secret, &["train_rank"]).await.is_none(), "claimed again on a slice with no pin");

        let lent = |d: Value| d["loaned_slices"].as_u64().unwrap();
        assert_eq!(lent(get(&server, &admin, "/deployments/embed").await), 2);
        let worker = get(&server, &admin, "/workers").await[0]["id"].as_str().unwrap().to_string();
        sqlx::query("UPDATE workers SET last_seen_at = 0").execute(db).await.unwrap();
        let response = server.http.delete(server.api(&format!("/workers/{worker}"))).bearer_auth(&admin).send().await.unwrap();
        assert_eq!(response.status(), 204);
        assert_eq!(lent(get(&server, &admin, "/deployments/embed").await), 0, "the removed worker's loans ended");
    }
}
