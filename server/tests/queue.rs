//! The leased job queue against real SQLite and PostgreSQL: atomic claims, lease
//! renewal, expiry and requeue, attempt limits.

mod support;

use std::collections::HashSet;

use serde_json::json;
use support::{backends, Backend, TestServer};
use tessera_api::jobs::JobSpec;
use tessera_server::store::db::now_ms;
use tessera_server::store::jobs::{self as queue, NewJob};
use tessera_server::store::slices::Free;
use uuid::Uuid;

async fn admin_id(server: &TestServer) -> Uuid {
    let row: String = sqlx::query_scalar("SELECT id FROM users WHERE username = 'admin'")
        .fetch_one(server.state.db.pool())
        .await
        .unwrap();
    row.parse().unwrap()
}

async fn enqueue(server: &TestServer, n: usize, max_attempts: u32) -> Vec<Uuid> {
    let owner = admin_id(server).await;
    let mut ids = Vec::new();
    for i in 0..n {
        let spec = JobSpec::Prefetch { model: Uuid::new_v4() };
        let name = format!("job {i}");
        ids.push(queue::insert(&server.state.db, &NewJob::new(owner, &name, &spec, max_attempts)).await.unwrap());
    }
    ids
}

async fn workers(server: &TestServer, n: usize) -> Vec<Uuid> {
    let mut ids = Vec::new();
    for i in 0..n {
        ids.push(server.register_worker(&format!("w{i}")).await.0.parse().unwrap());
    }
    ids
}

async fn state_of(server: &TestServer, job: Uuid) -> (String, i64) {
    let row: (String, i64) = sqlx::query_as("SELECT state, attempts FROM jobs WHERE id = $1")
        .bind(job.to_string())
        .fetch_one(server.state.db.pool())
        .await
        .unwrap();
    row
}

const KINDS: &[&str] = &["prefetch"];

fn kinds() -> Vec<String> {
    KINDS.iter().map(|k| k.to_string()).collect()
}

async fn many_workers_claiming_at_once_never_double_claim(backend: Backend) {
    let server = TestServer::start(backend).await;
    let jobs = enqueue(&server, 40, 3).await;
    let workers = workers(&server, 8).await;
    let mut tasks = Vec::new();
    for worker in workers {
        let db = server.state.db.clone();
        tasks.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            while let Some(claimed) = queue::claim(&db, worker, &kinds(), 60_000, &Free::default()).await.unwrap() {
                mine.push(claimed.job_id);
            }
            mine
        }));
    }
    let mut seen = HashSet::new();
    let mut total = 0;
    for task in tasks {
        for job in task.await.unwrap() {
            total += 1;
            assert!(seen.insert(job), "job {job} was claimed twice ({backend:?})");
        }
    }
    assert_eq!(total, jobs.len(), "every job claimed exactly once ({backend:?})");
    assert_eq!(seen, jobs.into_iter().collect::<HashSet<_>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_claims_never_hand_a_job_to_two_workers() {
    for backend in backends() {
        many_workers_claiming_at_once_never_double_claim(backend).await;
    }
}

#[tokio::test]
async fn claim_takes_oldest_job_of_a_kind_the_worker_runs() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let jobs = enqueue(&server, 2, 3).await;
        let worker = workers(&server, 1).await[0];
        assert!(queue::claim(&server.state.db, worker, &["train".into()], 1000, &Free::default())
            .await
            .unwrap()
            .is_none());
        let first = queue::claim(&server.state.db, worker, &kinds(), 1000, &Free::default()).await.unwrap().unwrap();
        assert_eq!(first.job_id, jobs[0]);
        assert_eq!(first.attempt, 1);
        assert_eq!(state_of(&server, jobs[0]).await, ("leased".into(), 1));
        assert_eq!(state_of(&server, jobs[1]).await.0, "queued");
    }
}

/// Jobs queued in one millisecond (`created_at`'s resolution) go in the order they were
/// queued; the random id decided before.
#[tokio::test]
async fn jobs_of_one_millisecond_are_claimed_in_the_order_they_were_queued() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let jobs = enqueue(&server, 12, 3).await;
        sqlx::query("UPDATE jobs SET created_at = 1000").execute(server.state.db.pool()).await.unwrap();
        let worker = workers(&server, 1).await[0];
        let mut claimed = Vec::new();
        while let Some(job) = queue::claim(&server.state.db, worker, &kinds(), 60_000, &Free::default()).await.unwrap() {
            claimed.push(job.job_id);
        }
        assert_eq!(claimed, jobs, "{backend:?}");
    }
}

#[tokio::test]
async fn lease_expires_and_job_is_requeued() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let job = enqueue(&server, 1, 3).await[0];
        let worker = workers(&server, 2).await;
        queue::claim(&server.state.db, worker[0], &kinds(), 1, &Free::default()).await.unwrap().unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        assert_eq!(queue::expire_leases(&server.state.db).await.unwrap(), 1);
        assert_eq!(state_of(&server, job).await, ("queued".into(), 1));
        // The first worker's renewal now fails: it must stop.
        let lost = queue::renew(&server.state.db, worker[0], &[job], 60_000).await.unwrap();
        assert_eq!(lost, vec![job]);
        let again =
            queue::claim(&server.state.db, worker[1], &kinds(), 60_000, &Free::default()).await.unwrap().unwrap();
        assert_eq!((again.job_id, again.attempt), (job, 2));
    }
}

/// A server that starts while no server watched the leases extends the live ones, so the
/// workers that ran on can renew them; one lease later they expire as usual.
#[tokio::test]
async fn a_starting_server_gives_leases_that_ran_out_while_it_was_down_another_lease() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let job = enqueue(&server, 2, 3).await;
        let worker = workers(&server, 1).await[0];
        queue::claim(&server.state.db, worker, &kinds(), 1, &Free::default()).await.unwrap().unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        let graced = queue::grace_leases(&server.state.db, Uuid::new_v4(), 60_000, 0).await.unwrap();
        assert_eq!(graced, Some(1), "the queued job has no lease");
        assert_eq!(queue::expire_leases(&server.state.db).await.unwrap(), 0);
        assert_eq!(state_of(&server, job[0]).await, ("leased".into(), 1));
        assert!(queue::renew(&server.state.db, worker, &[job[0]], 60_000).await.unwrap().is_empty());
        // A lease already longer than the grace keeps its own expiry.
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        assert_eq!(queue::grace_leases(&server.state.db, Uuid::new_v4(), 1, 0).await.unwrap(), Some(0));
    }
}

/// A server starting while another sweeps the leases (a rolling restart), or again soon
/// after its own grace (a crash loop), extends none: a dead worker's lease still runs out.
#[tokio::test]
async fn a_server_starting_while_the_leases_are_watched_extends_none() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let job = enqueue(&server, 1, 3).await[0];
        let worker = workers(&server, 1).await[0];
        queue::claim(&server.state.db, worker, &kinds(), 1, &Free::default()).await.unwrap().unwrap();
        let (sweeper, starting) = (Uuid::new_v4(), Uuid::new_v4());
        queue::watched(&server.state.db, sweeper, now_ms() + 60_000).await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        assert_eq!(queue::grace_leases(&server.state.db, starting, 60_000, 60_000).await.unwrap(), None);
        assert_eq!(queue::expire_leases(&server.state.db).await.unwrap(), 1, "the dead worker's lease ran out");
        assert_eq!(state_of(&server, job).await, ("queued".into(), 1));

        // Once the watch has run out a start gives grace, and marks the leases watched.
        queue::claim(&server.state.db, worker, &kinds(), 1, &Free::default()).await.unwrap().unwrap();
        queue::watched(&server.state.db, sweeper, now_ms() - 1).await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        assert_eq!(queue::grace_leases(&server.state.db, starting, 60_000, 60_000).await.unwrap(), Some(1));
        let restarted = queue::grace_leases(&server.state.db, starting, 60_000, 60_000).await.unwrap();
        assert_eq!(restarted, None, "a crash loop gives one grace, not one a start");
    }
}

#[tokio::test]
async fn renewed_lease_does_not_expire() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let job = enqueue(&server, 1, 3).await[0];
        let worker = workers(&server, 1).await[0];
        queue::claim(&server.state.db, worker, &kinds(), 1, &Free::default()).await.unwrap().unwrap();
        assert!(queue::renew(&server.state.db, worker, &[job], 60_000).await.unwrap().is_empty());
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        assert_eq!(queue::expire_leases(&server.state.db).await.unwrap(), 0);
        assert_eq!(state_of(&server, job).await.0, "leased");
    }
}

#[tokio::test]
async fn job_fails_when_its_last_attempt_expires() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let job = enqueue(&server, 1, 2).await[0];
        let worker = workers(&server, 1).await[0];
        for attempt in 1..=2 {
            let claimed = queue::claim(&server.state.db, worker, &kinds(), 1, &Free::default()).await.unwrap().unwrap();
            assert_eq!(claimed.attempt, attempt);
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            queue::expire_leases(&server.state.db).await.unwrap();
        }
        assert_eq!(state_of(&server, job).await, ("failed".into(), 2));
        assert!(queue::claim(&server.state.db, worker, &kinds(), 1000, &Free::default()).await.unwrap().is_none());
    }
}

/// A claim whose answer the worker never got (it timed out, the connection broke) leaves
/// a job leased to a worker that does not run it: the worker's next heartbeat, which does
/// not list it, requeues it at once (the attempt spent, as a lease expiry would); a job it
/// lists keeps its lease.
#[tokio::test]
async fn a_claim_the_worker_never_got_back_is_requeued_by_its_next_heartbeat() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let jobs = enqueue(&server, 2, 3).await;
        let (_, secret) = server.register_worker("w0").await;
        for job in &jobs {
            let claimed: serde_json::Value =
                server.post(&secret, "/agent/claim", json!({"kinds": KINDS})).await.json().await.unwrap();
            assert_eq!(claimed["job_id"], job.to_string());
        }
        let beat = server.post(&secret, "/agent/heartbeat", json!({"jobs": [jobs[0]]})).await;
        assert_eq!(beat.status(), 200);
        assert_eq!(state_of(&server, jobs[0]).await, ("leased".into(), 1), "{backend:?}");
        assert_eq!(state_of(&server, jobs[1]).await, ("queued".into(), 1), "{backend:?}");
    }
}

/// A worker sends a call again when its answer is lost (the server stored it, the reply
/// never came): a log batch sent again under its id is stored once, and the same end
/// reported again is a 204 again; another end after it is still refused.
#[tokio::test]
async fn a_worker_s_reports_sent_again_after_a_lost_answer_are_stored_once() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let job = enqueue(&server, 1, 3).await[0];
        let (_, secret) = server.register_worker("w0").await;
        server.post(&secret, "/agent/claim", json!({"kinds": KINDS})).await;
        let status = |state: &str| json!({"state": state});
        assert_eq!(server.post(&secret, &format!("/agent/jobs/{job}/status"), status("running")).await.status(), 204);
        let batch = json!({"lines": ["one", "two"], "batch": Uuid::new_v4()});
        for _ in 0..2 {
            assert_eq!(server.post(&secret, &format!("/agent/jobs/{job}/logs"), batch.clone()).await.status(), 204);
        }
        let unnamed = json!({"lines": ["three"]});
        assert_eq!(server.post(&secret, &format!("/agent/jobs/{job}/logs"), unnamed).await.status(), 204);
        for _ in 0..2 {
            let ended = server.post(&secret, &format!("/agent/jobs/{job}/status"), status("succeeded")).await;
            assert_eq!(ended.status(), 204, "{backend:?}");
        }
        let other = server.post(&secret, &format!("/agent/jobs/{job}/status"), status("failed")).await;
        assert_eq!(other.status(), 409, "{backend:?}");
        assert_eq!(state_of(&server, job).await, ("succeeded".into(), 1), "{backend:?}");
        let lines: Vec<(i64, String)> = sqlx::query_as("SELECT seq, line FROM job_logs WHERE job_id = $1 ORDER BY seq")
            .bind(job.to_string())
            .fetch_all(server.state.db.pool())
            .await
            .unwrap();
        let lines: Vec<(i64, &str)> = lines.iter().map(|(seq, line)| (*seq, line.as_str())).collect();
        assert_eq!(lines, [(1, "one"), (2, "two"), (3, "three")], "{backend:?}");
    }
}

/// A rejoin refused for an impossible MIG partition changes nothing: the worker keeps
/// its secret and its leases, and rejoins with a corrected inventory at once.
#[tokio::test]
async fn a_refused_rejoin_leaves_the_worker_as_it_was() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let job = enqueue(&server, 1, 3).await[0];
        let (worker, secret) = server.register_worker("w0").await;
        server.post(&secret, "/agent/claim", json!({"kinds": KINDS})).await;
        let slice = json!({"uuid": "MIG-a", "gpu_uuid": "GPU-0", "gpu_index": 0, "gpu_model": "H100-80GB",
                           "profile": "9g.99gb", "memory_bytes": 1, "simulated": true});
        let inventory = json!({"hostname": "w0", "cpu_cores": 2, "memory_bytes": 1024, "slices": [slice]});
        let body = json!({"name": "w0", "version": "test", "inventory": inventory, "previous_secret": secret});
        assert_eq!(server.post(support::WORKER_TOKEN, "/agent/register", body).await.status(), 422, "{backend:?}");
        let beat = server.post(&secret, "/agent/heartbeat", json!({"jobs": [job]})).await;
        assert_eq!(beat.status(), 200, "{backend:?}: the old secret still holds");
        assert_eq!(state_of(&server, job).await, ("leased".into(), 1), "{backend:?}");
        assert_eq!(server.rejoin_worker("w0", &secret).await.0, worker);
    }
}

/// A worker that restarts gives back what it held: queued again while attempts are left,
/// failed on the last one (a job that crashes its worker is not retried forever).
#[tokio::test]
async fn a_restarted_worker_s_jobs_are_requeued_until_their_attempts_are_spent() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let job = enqueue(&server, 1, 2).await[0];
        let (worker, mut secret) = server.register_worker("w0").await;
        for attempt in 1..=2 {
            let claimed = queue::claim(&server.state.db, worker.parse().unwrap(), &kinds(), 60_000, &Free::default())
                .await
                .unwrap()
                .unwrap();
            assert_eq!(claimed.attempt, attempt);
            let (rejoined, next) = server.rejoin_worker("w0", &secret).await;
            assert_eq!(rejoined, worker);
            secret = next;
            if attempt == 1 {
                assert_eq!(state_of(&server, job).await, ("queued".into(), 1), "{backend:?}");
            }
        }
        assert_eq!(state_of(&server, job).await, ("failed".into(), 2), "{backend:?}");
        let message: String = sqlx::query_scalar("SELECT message FROM jobs WHERE id = $1")
            .bind(job.to_string())
            .fetch_one(server.state.db.pool())
            .await
            .unwrap();
        assert!(message.contains("last allowed attempt"), "{message}");
    }
}

/// `GET /api/v1/jobs` pages newest first: `limit` jobs a page, the `Link` header naming the
/// next page until the last, which has none; jobs of one millisecond in the order they were
/// queued, so no job is listed twice or skipped; the state and kind filters travel with
/// the pages. A bad page or filter is a 400 saying what to fix.
#[tokio::test]
async fn the_job_list_pages_through_every_job_once() {
    for backend in backends() {
        let server = TestServer::start(backend).await;
        let admin = server.admin().await;
        let jobs = enqueue(&server, 7, 3).await;
        // Four queued in one millisecond, the rest later.
        for job in &jobs[..4] {
            sqlx::query("UPDATE jobs SET created_at = 1000 WHERE id = $1")
                .bind(job.to_string())
                .execute(server.state.db.pool())
                .await
                .unwrap();
        }
        let pages = server.pages(&admin, "/jobs?limit=3").await;
        assert!(pages.iter().all(|page| page.len() <= 3), "{backend:?}: {pages:?}");
        let listed: Vec<Uuid> = pages.iter().flatten().map(|j| j["id"].as_str().unwrap().parse().unwrap()).collect();
        let newest_first: Vec<Uuid> = jobs.iter().rev().copied().collect();
        assert_eq!(listed, newest_first, "{backend:?}");
        assert_eq!(pages.len(), 3, "{backend:?}");
        // The state filter travels with the next page.
        let response = server.get(&admin, "/jobs?state=queued&limit=6").await;
        let link = response.headers()["link"].to_str().unwrap().to_string();
        assert!(link.contains(&format!("before={}", jobs[1])) && link.contains("state=queued"), "{link}");
        let unpaged: Vec<serde_json::Value> = server.get(&admin, "/jobs").await.json().await.unwrap();
        assert_eq!(unpaged.len(), 7, "{backend:?}");
        // So does the kind filter; the jobs are all prefetches.
        let response = server.get(&admin, "/jobs?kind=prefetch&limit=6").await;
        let link = response.headers()["link"].to_str().unwrap().to_string();
        assert!(link.contains("kind=prefetch"), "{link}");
        assert_eq!(response.json::<Vec<serde_json::Value>>().await.unwrap().len(), 6, "{backend:?}");
        let trained: Vec<serde_json::Value> = server.get(&admin, "/jobs?kind=train").await.json().await.unwrap();
        assert!(trained.is_empty(), "{backend:?}: {trained:?}");

        server.assert_bad_pages(&admin, "/jobs", "job", &[("kind=serve", "listed with their deployment")]).await;
    }
}
