//! `tessera-server mig plan` as a user runs it: the built binary, a request file, JSON on
//! stdout, and one sentence on stderr with exit status 2 for a bad request.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

const EXAMPLE: &str = r#"{"gpu":"A100-80GB",
  "services":[{"name":"bert","throughput":1200,"latency_ms":50},
              {"name":"resnet","throughput":900,"latency_ms":30},
              {"name":"tiny","throughput":150}],
  "profiles":{"bert":{"1g.10gb":210,"2g.20gb":430,"3g.40gb":650,"4g.40gb":860,"7g.80gb":1500},
              "resnet":{"1g.10gb":180,"2g.20gb":380,"3g.40gb":600,"4g.40gb":800,"7g.80gb":1400},
              "tiny":{"1g.10gb":400,"7g.80gb":900}}}"#;

fn plan(dir: &Path, body: &str, args: &[&str]) -> Output {
    let input = dir.join("request.json");
    std::fs::write(&input, body).unwrap();
    Command::new(env!("CARGO_BIN_EXE_tessera-server"))
        .args(["mig", "plan", "--input"])
        .arg(&input)
        .args(args)
        .env("TESSERA_DATA_DIR", dir.join("data"))
        .output()
        .unwrap()
}

fn capacity(out: &Value, service: &str) -> f64 {
    out["services"].as_array().unwrap().iter().find(|s| s["name"] == service).unwrap()["capacity"].as_f64().unwrap()
}

#[test]
fn mig_plan_prints_a_plan_that_meets_every_demand() {
    let dir = tempfile::tempdir().unwrap();
    let output = plan(dir.path(), EXAMPLE, &[]);
    assert!(output.status.success(), "stderr: {}", String::from_utf8_lossy(&output.stderr));
    let out: Value = serde_json::from_slice(&output.stdout).expect("stdout is one JSON document");
    assert_eq!(out["algorithm"], "best");
    let gpus = out["gpus"].as_array().unwrap();
    assert_eq!(gpus.len() as u64, out["gpu_count"].as_u64().unwrap());
    // 1200 + 900 req/s and a slice for tiny fit on two GPUs; one GPU holds at most 1500.
    assert_eq!(gpus.len(), 2);
    assert_eq!(out["lower_bound"], 2);
    assert_eq!(out["gap"], 0.0);
    assert!(out["elapsed_ms"].as_f64().unwrap() >= 0.0);
    for gpu in gpus {
        let partition: Vec<&str> = gpu["partition"].as_array().unwrap().iter().map(|p| p.as_str().unwrap()).collect();
        let slices = gpu["slices"].as_array().unwrap();
        assert_eq!(partition.len(), slices.len());
        for (p, s) in partition.iter().zip(slices) {
            assert_eq!(s["profile"].as_str().unwrap(), *p);
            assert!(s["start"].is_u64());
        }
    }
    assert!(capacity(&out, "bert") >= 1200.0);
    assert!(capacity(&out, "resnet") >= 900.0);
    assert!(capacity(&out, "tiny") >= 150.0);
    assert!(out["baselines"]["whole_gpu"].as_u64().unwrap() >= 3);
}

#[test]
fn every_algorithm_can_be_chosen_and_a_seed_reproduces_the_plan() {
    let dir = tempfile::tempdir().unwrap();
    let seeded = EXAMPLE.replacen('{', r#"{"seed":7,"#, 1);
    for algorithm in ["greedy", "genetic", "mcts", "exact", "best"] {
        let first = plan(dir.path(), &seeded, &["--algorithm", algorithm]);
        assert!(first.status.success(), "{algorithm}: {}", String::from_utf8_lossy(&first.stderr));
        let a: Value = serde_json::from_slice(&first.stdout).unwrap();
        let b: Value = serde_json::from_slice(&plan(dir.path(), &seeded, &["--algorithm", algorithm]).stdout).unwrap();
        assert_eq!(a["algorithm"], algorithm);
        assert_eq!(a["seed"], 7);
        assert_eq!(a["gpus"], b["gpus"], "{algorithm} is not reproducible");
    }
}

#[test]
fn a_current_layout_adds_a_safe_transition() {
    let dir = tempfile::tempdir().unwrap();
    let body = EXAMPLE.replacen(
        r#""profiles""#,
        r#""current":{"gpus":[{"slices":[{"profile":"7g.80gb","start":0,"service":"bert"}]},
                              {"slices":[{"profile":"7g.80gb","start":0,"service":"resnet"}]}]},"profiles""#,
        1,
    );
    let output = plan(dir.path(), &body, &[]);
    assert!(output.status.success(), "stderr: {}", String::from_utf8_lossy(&output.stderr));
    let out: Value = serde_json::from_slice(&output.stdout).unwrap();
    let t = &out["transition"];
    assert!(!t["steps"].as_array().unwrap().is_empty());
    assert!(t["peak_gpus"].as_u64().unwrap() >= 2);
    for step in t["steps"].as_array().unwrap() {
        assert!(["create_slice", "start_replica", "drain_and_stop_replica", "destroy_slice"]
            .contains(&step["action"].as_str().unwrap()));
    }
}

#[test]
fn bad_input_gets_one_sentence_on_stderr_and_exit_status_2() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (EXAMPLE.replace("A100-80GB", "A100-20GB"), "unknown GPU type \"A100-20GB\""),
        (
            EXAMPLE.replace("\"1g.10gb\":210", "\"1g.5gb\":210"),
            "names profile \"1g.5gb\", which A100-80GB does not have",
        ),
        (EXAMPLE.replace("1200", "-1200"), "service \"bert\" has throughput -1200"),
        (
            EXAMPLE.replace(r#""tiny":{"1g.10gb":400,"7g.80gb":900}"#, r#""tiny":{}"#),
            "service \"tiny\" cannot run on any profile",
        ),
        ("not json".to_string(), "the input is not valid planner JSON"),
    ];
    for (body, expected) in cases {
        let output = plan(dir.path(), &body, &[]);
        assert_eq!(output.status.code(), Some(2), "{expected}");
        assert!(output.stdout.is_empty());
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(stderr.starts_with("error: ") && stderr.contains(expected), "{stderr}");
    }
    let missing = Command::new(env!("CARGO_BIN_EXE_tessera-server"))
        .args(["mig", "plan", "--input", "/nonexistent/request.json"])
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&missing.stderr).starts_with("error: cannot read /nonexistent/request.json"));
}
