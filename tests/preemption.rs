//! End to end, preemption (issue 16): the real server and workers train digits; a job is
//! preempted mid-run through the REST API, shows `preempted` while another user's job takes
//! the freed worker (the queue's fair order), resumes from the checkpoint it took at the
//! step it was on, then loses its worker to a kill (at most `checkpoint_every` steps
//! redone), and still ends bit-identical to the same spec run without interruption:
//! the same final weights, the same loss at every step, the same evaluations. A two-rank
//! gang preempted the same way (the loaning round's reclaim path) ends bit-identical too.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tessera_tests::{digits_csv, eventually, start_server, start_worker, Process, User};

const WORKER_TOKEN: &str = "e2e-preemption-token-at-least-32-bytes-long";
const MAX_STEPS: u64 = 8000;
const CHECKPOINT_EVERY: u64 = 500;

fn spec(dataset: &str, max_steps: u64, preemptible: bool) -> Value {
    json!({
        "name": "digits", "model": {"kind": "mlp", "hidden": [64]}, "dataset": dataset,
        "task": {"type": "classification", "label_column": "label", "validation_split": 0.2},
        "optimizer": {"type": "adamw"}, "batch_size": 64, "max_steps": max_steps,
        "eval_every": 50, "checkpoint_every": CHECKPOINT_EVERY,
        "lr_schedule": {"type": "cosine", "lr": 0.003, "warmup_steps": 50}, "seed": 7,
        "resources": {"preemptible": preemptible}
    })
}

/// A second user, so that the fair order (owners with fewer live leases first) decides
/// which job the freed worker takes.
async fn second_user(admin: &User) -> User {
    let created = admin
        .http
        .post(format!("{}/api/v1/users", admin.url))
        .bearer_auth(&admin.token)
        .json(&json!({"username": "bob", "password": "bob-secret-password", "role": "user"}))
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 201);
    let login = admin
        .http
        .post(format!("{}/api/v1/auth/login", admin.url))
        .json(&json!({"username": "bob", "password": "bob-secret-password"}))
        .send()
        .await
        .unwrap();
    let token = login.json::<Value>().await.unwrap()["token"].as_str().unwrap().to_string();
    User { http: admin.http.clone(), url: admin.url.clone(), token }
}

async fn progress(user: &User, job: &str) -> u64 {
    user.get(&format!("/jobs/{job}")).await["progress"]["step"].as_u64().unwrap()
}

async fn wait_for_step(user: &User, job: &str, step: u64) {
    eventually(&format!("job {job} passes step {step}"), Duration::from_secs(240), || async {
        (progress(user, job).await >= step).then_some(())
    })
    .await;
}

async fn final_weights(user: &User, job: &str, step: u64) -> Vec<u8> {
    let path = format!("{}/api/v1/jobs/{job}/checkpoints/{step}/files/model.safetensors", user.url);
    let response = user.http.get(path).bearer_auth(&user.token).send().await.unwrap();
    assert_eq!(response.status(), 200);
    response.bytes().await.unwrap().to_vec()
}

/// The series that must match bit for bit: each step's loss and lr, every evaluation.
/// (Throughput is a timing, so it is left out.)
fn trajectory(metrics: &Value) -> (Vec<(u64, f64, f64)>, Vec<Value>) {
    let steps = metrics["steps"].as_array().unwrap();
    let steps = steps
        .iter()
        .map(|r| (r["step"].as_u64().unwrap(), r["loss"].as_f64().unwrap(), r["lr"].as_f64().unwrap()))
        .collect();
    (steps, metrics["evals"].as_array().unwrap().clone())
}

/// Preempts `job` through the API as its owner and waits until the stop is done (the job's
/// `preemptions` counts it); the job as it then reads, which may already be running again
/// where free workers took it back at once. Should it end unpreempted, or not stop within a
/// minute, the panic shows the job, its log and the output of `workers` (the stop's path is
/// many steps long).
async fn preempt(user: &User, job: &str, workers: &[&Process]) -> Value {
    let response = user
        .http
        .post(user.api(&format!("/jobs/{job}/preempt")))
        .bearer_auth(&user.token)
        .json(&json!({"reason": "the serving deployment takes its slices back"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 202);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let read = user.get(&format!("/jobs/{job}")).await;
        if read["preemptions"].as_u64() >= Some(1) {
            return read;
        }
        let ended = matches!(read["state"].as_str(), Some("succeeded" | "failed" | "cancelled"));
        if !ended && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        }
        let output: Vec<String> = workers.iter().map(|w| w.output()).collect();
        panic!(
            "the job was not preempted: {read}\nits log:\n{}\nthe workers:\n{}",
            user.log_lines(job).await.join("\n"),
            output.join("\n----\n")
        );
    }
}

fn resumed_from(lines: &[String]) -> Vec<u64> {
    lines.iter().filter_map(|l| l.strip_prefix("resuming from the checkpoint at step ")?.parse().ok()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preempted_job_resumes_and_ends_bit_identical_to_an_uninterrupted_run() {
    let Some(csv) = digits_csv() else { return };
    let data = tempfile::tempdir().unwrap();
    let (mut server, url) = start_server(&data.path().join("server"), WORKER_TOKEN, 3);
    let admin = User::login(&mut server, &url).await;
    let bob = second_user(&admin).await;
    let dataset = admin.upload_dataset(csv).await;
    let bob_dataset = bob.upload_dataset(digits_csv().unwrap()).await;

    // The admin holds one worker with a long job, so that once the preempted job waits,
    // bob (no live lease) goes first on the freed worker.
    let w1 = start_worker(&url, WORKER_TOKEN, &data.path().join("w1"), "w1");
    let long = admin.submit(spec(&dataset, 100_000, false)).await;
    eventually("the long job runs", Duration::from_secs(60), || async {
        (admin.get(&format!("/jobs/{long}")).await["state"] == "running").then_some(())
    })
    .await;
    let w2 = start_worker(&url, WORKER_TOKEN, &data.path().join("w2"), "w2");
    let job = admin.submit(spec(&dataset, MAX_STEPS, true)).await;
    wait_for_step(&admin, &job, 1).await;
    let reference = bob.submit(spec(&bob_dataset, MAX_STEPS, true)).await;
    wait_for_step(&admin, &job, 250).await;

    let preempted = preempt(&admin, &job, &[&w1, &w2]).await;
    // No worker is free for it (bob's job goes first on the freed one): it waits, listed as such.
    assert_eq!(preempted["state"], "preempted", "{preempted}");
    assert_eq!((preempted["attempts"].as_u64(), preempted["preemptions"].as_u64()), (Some(0), Some(1)), "{preempted}");
    let step: u64 = preempted["message"]
        .as_str()
        .and_then(|m| m.strip_prefix("Preempted at step "))
        .and_then(|m| m.split(';').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("the message names the step: {preempted}"));
    assert!((250..MAX_STEPS).contains(&step), "{step}");
    let checkpoints = admin.get(&format!("/jobs/{job}/checkpoints")).await;
    let steps: Vec<u64> = checkpoints.as_array().unwrap().iter().map(|c| c["step"].as_u64().unwrap()).collect();
    assert_eq!(steps.last(), Some(&step), "a checkpoint at the step the preemption came, not at a multiple of 200");
    // The freed worker took bob's job; the preempted one waits, listed as such.
    let waiting = admin.get("/jobs?state=preempted").await;
    assert_eq!(waiting.as_array().unwrap().len(), 1);
    assert_eq!(admin.get(&format!("/jobs/{job}")).await["state"], "preempted");
    eventually("bob's job runs on the freed worker", Duration::from_secs(30), || async {
        (bob.get(&format!("/jobs/{reference}")).await["state"] == "running").then_some(())
    })
    .await;

    // The long job is cancelled: its worker resumes the preempted job from that checkpoint.
    let cancel = admin.http.post(format!("{url}/api/v1/jobs/{long}/cancel")).bearer_auth(&admin.token);
    assert_eq!(cancel.send().await.unwrap().status(), 200);
    wait_for_step(&admin, &job, step + CHECKPOINT_EVERY + 50).await;
    assert_eq!(resumed_from(&admin.log_lines(&job).await), [step]);

    // Its worker dies now, without checkpointing: the job resumes elsewhere from its last
    // periodic checkpoint, redoing at most `checkpoint_every` steps.
    let holder = admin.get(&format!("/jobs/{job}")).await["worker_id"].clone();
    let workers = admin.get("/workers").await;
    let name = workers.as_array().unwrap().iter().find(|w| w["id"] == holder).unwrap()["name"].clone();
    let (mut dead, survivor) = if name == "w1" { (w1, w2) } else { (w2, w1) };
    let reported = progress(&admin, &job).await;
    dead.kill();
    let w3 = start_worker(&url, WORKER_TOKEN, &data.path().join("w3"), "w3");
    let finished = admin.finished(&job, &[&survivor, &w3], Duration::from_secs(300)).await;
    let resumes = resumed_from(&admin.log_lines(&job).await);
    eprintln!("preempted at step {step}; resumed from {resumes:?}; {reported} steps reported before the kill");
    assert_eq!(resumes.len(), 2, "{resumes:?}");
    assert!(
        resumes[1] > step && reported.saturating_sub(resumes[1]) <= CHECKPOINT_EVERY,
        "{resumes:?}, reported {reported}"
    );
    assert_eq!((finished["attempts"].as_u64(), finished["preemptions"].as_u64()), (Some(2), Some(1)), "{finished}");

    bob.finished(&reference, &[&survivor, &w3], Duration::from_secs(300)).await;
    assert_bit_identical((&admin, &job), (&bob, &reference), MAX_STEPS).await;
}

/// `ours` and `theirs` (each a user and a job) end with the same weights after `steps`
/// steps, the same loss and learning rate at every step and the same evaluations.
async fn assert_bit_identical(ours: (&User, &str), theirs: (&User, &str), steps: u64) {
    let weights = final_weights(ours.0, ours.1, steps).await;
    assert_eq!(weights, final_weights(theirs.0, theirs.1, steps).await, "bit-identical weights");
    let ours = trajectory(&ours.0.get(&format!("/jobs/{}/metrics", ours.1)).await);
    let theirs = trajectory(&theirs.0.get(&format!("/jobs/{}/metrics", theirs.1)).await);
    assert_eq!(ours.0.len(), steps as usize);
    let first_step = ours.0.iter().zip(&theirs.0).find(|(a, b)| a != b);
    assert_eq!(first_step, None, "the same loss and learning rate at every step");
    let first_eval = ours.1.iter().zip(&theirs.1).find(|(a, b)| a != b);
    assert_eq!(first_eval, None, "the same evaluations");
    assert_eq!(ours.1.len(), theirs.1.len());
}

/// The same for a gang, as the loaning round stops one (`jobs::preempt_job`, the path of a
/// reclaim): a two-rank job preempted mid-run through the API waits as `preempted`, both
/// its ranks resume at two ranks from the checkpoint rank 0 took at the step the ranks
/// agreed to stop after, and it ends bit-identical to the same spec run without a stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preempted_gang_resumes_and_ends_bit_identical_to_an_uninterrupted_run() {
    // Long enough that the stop (a heartbeat, then the next step) comes well before the end.
    const STEPS: u64 = 4000;
    let Some(csv) = digits_csv() else { return };
    let data = tempfile::tempdir().unwrap();
    // Nothing is killed here, so leases need not lapse fast: a 10 s lease keeps a heartbeat
    // late on a loaded host from requeueing a rank mid-test.
    let (mut server, url) = start_server(&data.path().join("server"), WORKER_TOKEN, 10);
    let admin = User::login(&mut server, &url).await;
    let dataset = admin.upload_dataset(csv).await;
    let w1 = start_worker(&url, WORKER_TOKEN, &data.path().join("w1"), "w1");
    let w2 = start_worker(&url, WORKER_TOKEN, &data.path().join("w2"), "w2");
    let mut gang = spec(&dataset, STEPS, true);
    gang["parallel"] = json!({"ranks": [{"device": "cpu", "threads": 1}, {"device": "cpu", "threads": 1}]});

    let reference = admin.submit(gang.clone()).await;
    admin.finished(&reference, &[&w1, &w2], Duration::from_secs(300)).await;
    let job = admin.submit(gang).await;
    wait_for_step(&admin, &job, 100).await;
    // Both workers are free once it stops, so the gang may be running again already (CI
    // once saw all 3,500 remaining steps done before the next poll): where it stopped is
    // read from the resumes, and rank 0's checkpoint there from the log.
    preempt(&admin, &job, &[&w1, &w2]).await;

    let finished = admin.finished(&job, &[&w1, &w2], Duration::from_secs(300)).await;
    assert_eq!(finished["preemptions"].as_u64(), Some(1), "{finished}");
    let log = admin.log_lines(&job).await;
    let resumed: Vec<u64> =
        log.iter().filter_map(|l| l.split("resuming from the checkpoint at step ").nth(1)?.parse().ok()).collect();
    let stopped_at = resumed.first().copied().unwrap_or_else(|| panic!("the gang resumed: {finished}"));
    eprintln!("the gang was preempted at step {stopped_at} and resumed from {resumed:?}");
    assert!((100..STEPS).contains(&stopped_at), "stopped mid-run: {stopped_at}");
    assert_eq!(resumed, [stopped_at, stopped_at], "both ranks resumed where the gang stopped");
    // (The checkpoint list keeps only the latest few by now, so the upload is read from the log.)
    let uploaded = format!("rank 0: checkpoint at step {stopped_at} uploaded");
    assert!(log.iter().any(|l| l.starts_with(&uploaded)), "rank 0 checkpointed at the stop:\n{}", log.join("\n"));
    assert_bit_identical((&admin, &job), (&admin, &reference), STEPS).await;
}
