//! Starts the real `tessera-server` and `tessera-worker` binaries as child processes and
//! captures their output, so end-to-end tests see exactly what an operator would.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A built binary: `$TESSERA_SERVER_BIN` / `$TESSERA_WORKER_BIN`, else next to this
/// test executable's target directory (`cargo build --workspace --bins` builds them).
pub fn binary(name: &str) -> PathBuf {
    let variable = format!("TESSERA_{}_BIN", name.trim_start_matches("tessera-").to_uppercase());
    if let Ok(path) = std::env::var(&variable) {
        return PathBuf::from(path);
    }
    let exe = std::env::current_exe().expect("test executable path");
    let profile_dir = exe.parent().and_then(Path::parent).expect("target/<profile>/deps");
    let path = profile_dir.join(name);
    assert!(path.exists(), "{} is not built; run `cargo build --workspace --bins` first (or set {variable})", path.display());
    path
}

/// Starts `tessera-server` on a free loopback port with its own data dir (SQLite), the
/// given worker token, 1 s heartbeats and `lease_ttl_secs` leases; the generated admin
/// password is in its output. Returns the process and the server's URL.
pub fn start_server(data_dir: &Path, worker_token: &str, lease_ttl_secs: u64) -> (Process, String) {
    let mut process = Process::spawn(
        Command::new(binary("tessera-server"))
            .args(["--bind", "127.0.0.1:0", "--data-dir"])
            .arg(data_dir)
            .env("TESSERA_WORKER_TOKEN", worker_token)
            .env("TESSERA_HEARTBEAT_SECS", "1")
            .env("TESSERA_LEASE_TTL_SECS", lease_ttl_secs.to_string())
            .env_remove("TESSERA_ADMIN_PASSWORD")
            .env_remove("TESSERA_DATABASE_URL"),
    );
    let line = process.wait_for_line("listening on http://", Duration::from_secs(60));
    let url = line.rsplit(' ').next().unwrap().trim().to_string();
    (process, url)
}

/// A running child process whose stdout and stderr lines are collected.
pub struct Process {
    child: Child,
    output: Arc<Mutex<Vec<String>>>,
}

impl Process {
    pub fn spawn(command: &mut Command) -> Process {
        let mut child = command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("start the binary");
        let output = Arc::new(Mutex::new(Vec::new()));
        for stream in [Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>, Box::new(child.stderr.take().unwrap())] {
            let output = output.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    output.lock().unwrap().push(line);
                }
            });
        }
        Process { child, output }
    }

    /// Everything printed so far.
    pub fn output(&self) -> String {
        self.output.lock().unwrap().join("\n")
    }

    /// Waits for a line containing `needle`; returns that line.
    pub fn wait_for_line(&mut self, needle: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(line) = self.output.lock().unwrap().iter().find(|l| l.contains(needle)) {
                return line.clone();
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("process exited ({status}) before printing {needle:?}:\n{}", self.output());
            }
            assert!(Instant::now() < deadline, "timed out waiting for {needle:?}:\n{}", self.output());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops the process the hard way (as a crash or power loss would).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Polls `check` until it returns `Some`, or panics with `what` after `timeout`.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
