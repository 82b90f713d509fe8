//! End to end on CPU with a simulated MIG inventory: the real worker offers a split H100,
//! a profile job measures MiniLM on its slices, a throughput-SLO deployment is planned
//! onto the slices, its replicas bind to them and become ready, and embeddings flow
//! through the gateway.

use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};
use tessera_tests::{binary, eventually, minilm_dir, start_server, success_json, Process, MINILM_FILES};

const WORKER_TOKEN: &str = "mig-e2e-worker-token-at-least-32-bytes-long";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_slo_deployment_is_served_from_simulated_mig_slices() {
    let Some(model_dir) = minilm_dir() else {
        return;
    };
    let data = tempfile::tempdir().unwrap();
    let http = reqwest::Client::new();
    let (mut server, url) = start_server(&data.path().join("server"), WORKER_TOKEN, 5);
    let line = server.wait_for_line("with password: ", Duration::from_secs(5));
    let password = line.rsplit(' ').next().unwrap().to_string();
    let login = http
        .post(format!("{url}/api/v1/auth/login"))
        .json(&json!({"username": "admin", "password": password}))
        .send()
        .await
        .unwrap();
    let admin = success_json(login).await["token"].as_str().unwrap().to_string();
    let mut form = reqwest::multipart::Form::new().text("name", "minilm");
    for path in MINILM_FILES {
        let bytes = std::fs::read(model_dir.join(path)).unwrap();
        form = form.part(
            "files",
            reqwest::multipart::Part::bytes(bytes).file_name(path.to_string()),
        );
    }
    success_json(
        http.post(format!("{url}/api/v1/models"))
            .bearer_auth(&admin)
            .multipart(form)
            .send()
            .await
            .unwrap(),
    )
    .await;

    let mut worker = Process::spawn(
        Command::new(binary("tessera-worker"))
            .args(["--server", &url, "--name", "sim-h100", "--data-dir"])
            .arg(data.path().join("worker"))
            .args(["--simulate-gpus", "H100-80GB:mig=3g.40gb+2g.20gb+2g.20gb", "--slice-processes"])
            .args(["--cpu-precision", "f32"])
            .env("TESSERA_WORKER_TOKEN", WORKER_TOKEN),
    );
    let get = |path: String| {
        let (http, admin) = (http.clone(), admin.clone());
        async move { success_json(http.get(path).bearer_auth(admin).send().await.unwrap()).await }
    };
    let slices = eventually(
        "the worker reports its slices",
        Duration::from_secs(30),
        || async {
            let workers = get(format!("{url}/api/v1/workers")).await;
            let slices = workers[0]["slices"].as_array().cloned().unwrap_or_default();
            (slices.len() == 3).then_some(slices)
        },
    )
    .await;
    let layout: Vec<(String, u64)> = slices
        .iter()
        .map(|s| {
            (
                s["profile"].as_str().unwrap().into(),
                s["start"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        layout,
        vec![
            ("2g.20gb".into(), 0),
            ("2g.20gb".into(), 2),
            ("3g.40gb".into(), 4)
        ]
    );

    // The profiler measures the CPU engine behind each kind of simulated slice.
    let response = http
        .post(format!("{url}/api/v1/models/minilm/profiles"))
        .bearer_auth(&admin)
        .json(&json!({"batch_sizes": [1, 4]}))
        .send()
        .await
        .unwrap();
    let job = success_json(response).await["id"].as_str().unwrap().to_string();
    eventually(
        "the profile job succeeds",
        Duration::from_secs(180),
        || async {
            let job = get(format!("{url}/api/v1/jobs/{job}")).await;
            assert_ne!(job["state"], "failed", "{job}\n{}", worker.output());
            (job["state"] == "succeeded").then_some(())
        },
    )
    .await;
    // Measured as replicas run there: in an engine process on a slice of each kind.
    let logs = get(format!("{url}/api/v1/jobs/{job}/logs")).await;
    let measured_in_processes = logs
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| l["line"].as_str().unwrap().contains("req/s, p99") && l["line"].as_str().unwrap().contains("CPU engine process"))
        .count();
    assert_eq!(measured_in_processes, 4, "{logs}");
    let table = get(format!("{url}/api/v1/models/minilm/profiles")).await;
    let entries = table["entries"].as_array().unwrap();
    let measured: Vec<&Value> = entries.iter().filter(|e| e["estimated"] == false).collect();
    assert_eq!(
        measured.len(),
        4,
        "two slice kinds at two batch sizes: {table}"
    );
    assert!(measured
        .iter()
        .all(|e| e["simulated"] == true && e["gpu_model"] == "H100-80GB"));
    assert!(entries
        .iter()
        .any(|e| e["profile"] == "7g.80gb" && e["estimated"] == true));

    // An SLO no slice meets alone (a fifth above the best measured one, a 3g): the planner
    // binds it to two or more slices. (1.5× the best 2g sat right at the 3g's own measured
    // throughput, so load on the host decided how many slices it took.)
    let best_slice = measured
        .iter()
        .map(|e| e["throughput"].as_f64().unwrap())
        .fold(0.0, f64::max);
    let slo = best_slice * 1.2;
    let response = http.post(format!("{url}/api/v1/deployments")).bearer_auth(&admin)
        .json(&json!({"name": "minilm-slo", "model": "minilm", "throughput": slo, "latency_ms": 60000, "max_batch_tokens": 2048}))
        .send().await.unwrap();
    let deployment = success_json(response).await;
    let planned = deployment["slo"]["slices"].as_array().unwrap().clone();
    assert!(planned.len() >= 2, "{deployment}");
    assert!(deployment["slo"]["capacity"].as_f64().unwrap() >= slo);

    let ready = eventually(
        "the SLO deployment is ready",
        Duration::from_secs(180),
        || async {
            let d = get(format!("{url}/api/v1/deployments/minilm-slo")).await;
            assert_ne!(d["state"], "failed", "{d}\n{}\n{}", worker.output(), server.output());
            (d["state"] == "ready").then_some(d)
        },
    )
    .await;
    for replica in ready["replica_status"].as_array().unwrap() {
        assert!(
            planned.iter().any(|p| p["slice"] == replica["slice"]),
            "{replica} is bound to a planned slice"
        );
        assert!(
            replica["message"]
                .as_str()
                .unwrap()
                .contains("on slice MIG-sim-sim-h100-0-"),
            "{replica}"
        );
    }
    // One engine process per slice, each on its own port: the per-slice process path
    // the cuda build takes for real slices, here on the CPU.
    let pids: std::collections::HashSet<&str> = ready["replica_status"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["message"].as_str().unwrap().split("(engine process ").nth(1).expect("an engine process pid"))
        .collect();
    assert_eq!(pids.len(), planned.len(), "{ready}");
    let ports: std::collections::HashSet<&str> = ready["replica_status"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["endpoint"].as_str().unwrap().split('/').nth(2).unwrap())
        .collect();
    assert_eq!(ports.len(), planned.len(), "{ready}");
    assert!(worker.output().contains("its own CPU engine process serves it"));
    // The worker's --cpu-precision reaches its engine processes.
    for replica in ready["replica_status"].as_array().unwrap() {
        let logs = get(format!("{url}/api/v1/jobs/{}/logs", replica["id"].as_str().unwrap())).await;
        let lines: Vec<&str> = logs.as_array().unwrap().iter().map(|l| l["line"].as_str().unwrap()).collect();
        assert!(lines.iter().any(|l| l.ends_with("GEMMs in f32")), "{lines:?}");
    }
    let workers = get(format!("{url}/api/v1/workers")).await;
    let bound = workers[0]["slices"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["deployment"] == "minilm-slo")
        .count();
    assert_eq!(bound, planned.len());

    let response = http.post(format!("{url}/v1/embeddings")).bearer_auth(&admin)
        .json(&json!({"model": "minilm-slo", "input": ["a slice of a GPU", "served on the CPU engine"]})).send().await.unwrap();
    let body = success_json(response).await;
    let data = body["data"].as_array().unwrap();
    assert_eq!(data.len(), 2);
    assert_eq!(data[0]["embedding"].as_array().unwrap().len(), 384);

    // A worker that dies takes its engine processes with it (they serve only while the
    // worker holds their stdin), so nothing keeps a slice busy behind the scheduler's back.
    let engines: Vec<String> = pids.iter().map(|pid| format!("/proc/{}", pid.trim_end_matches(").").trim())).collect();
    assert!(engines.iter().all(|proc_dir| is_running(proc_dir)), "{engines:?} run while their worker does");
    worker.kill();
    eventually("the engine processes exit with their worker", Duration::from_secs(20), || async {
        engines.iter().all(|proc_dir| !is_running(proc_dir)).then_some(())
    })
    .await;
    drop(server);
}

/// Whether `/proc/PID` names a live process (not gone, not a zombie awaiting its parent).
fn is_running(proc_dir: &str) -> bool {
    std::fs::read_to_string(format!("{proc_dir}/stat")).is_ok_and(|stat| {
        let state = stat.rsplit(')').next().unwrap_or("").split_whitespace().next().unwrap_or("");
        state != "Z" && state != "X"
    })
}
