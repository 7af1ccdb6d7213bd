//! Running the real `lbproxy` binary inside a lab's node namespace.

use std::fs::File;
use std::net::SocketAddr;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use super::ns::{http_get, ns_command};

/// Where lbproxy serves `/healthz` inside the node namespace (each node namespace has its own
/// loopback, so every lab can use the same address).
pub const HEALTHZ_ADDR: &str = "127.0.0.1:10256";
/// Where lbproxy serves `/metrics` inside the node namespace.
pub const METRICS_ADDR: &str = "127.0.0.1:10249";

/// The lbproxy binary: `$LBPROXY_BIN`, else `<workspace>/target/debug/lbproxy`, or `None`
/// if that file does not exist.
pub fn lbproxy_bin_if_present() -> Option<PathBuf> {
    let p = match std::env::var_os("LBPROXY_BIN") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/debug/lbproxy"),
    };
    p.is_file().then_some(p)
}

/// Like [`lbproxy_bin_if_present`], but panics with instructions if the binary is missing.
pub fn lbproxy_bin() -> PathBuf {
    lbproxy_bin_if_present().unwrap_or_else(|| {
        panic!(
            "lbproxy binary not found: set LBPROXY_BIN to its path, or build it at \
             {}/../target/debug/lbproxy (cargo build -p lbproxy). LBPROXY_BIN={:?}",
            env!("CARGO_MANIFEST_DIR"),
            std::env::var_os("LBPROXY_BIN")
        )
    })
}

/// Runs `lbproxy ARGS` to completion inside network namespace `ns`.
pub fn run_lbproxy_cmd(ns: &str, args: &[&str]) -> Output {
    let bin = lbproxy_bin();
    ns_command(ns, &bin)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {} {args:?}: {e}", bin.display()))
}

/// A running `lbproxy run` process (started by [`crate::lab::Lab::start_lbproxy`]).
///
/// Its stdout and stderr go to files in the lab's work dir. Killed (SIGKILL) on drop if it
/// is still running; if the dropping thread is panicking, the log is printed to stderr.
/// It is also SIGKILLed if the thread that started it exits (`PR_SET_PDEATHSIG`), so keep
/// the handle on the thread that created it.
pub struct Lbproxy {
    child: Child,
    node_ns: String,
    stdout_path: PathBuf,
    stderr_path: PathBuf,
    exit: Option<ExitStatus>,
    argv: Vec<String>,
    started: Instant,
}

impl Lbproxy {
    /// Spawns `<bin> ARGS` inside `node_ns` via nsenter, logs to `log_base.{stdout,stderr}`,
    /// with extra environment variables for the child.
    pub(crate) fn spawn_env(
        node_ns: &str,
        args: Vec<String>,
        env: &[(&str, &str)],
        log_base: &Path,
    ) -> Lbproxy {
        Lbproxy::spawn_bin(&lbproxy_bin(), node_ns, args, env, log_base)
    }

    /// Like [`Self::spawn_env`], running `bin` instead of [`lbproxy_bin`] (a benchmark that
    /// compares two builds in one run).
    pub(crate) fn spawn_bin(
        bin: &Path,
        node_ns: &str,
        args: Vec<String>,
        env: &[(&str, &str)],
        log_base: &Path,
    ) -> Lbproxy {
        let stdout_path = log_base.with_extension("stdout");
        let stderr_path = log_base.with_extension("stderr");
        let out = File::create(&stdout_path).expect("create lbproxy stdout log");
        let err = File::create(&stderr_path).expect("create lbproxy stderr log");
        let mut cmd = ns_command(node_ns, bin);
        // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                // Never leave an orphaned lbproxy behind if the test process dies.
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = cmd
            .args(&args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot spawn nsenter {}: {e}", bin.display()));
        let mut argv = vec![bin.display().to_string()];
        argv.extend(args);
        Lbproxy {
            child,
            node_ns: node_ns.to_owned(),
            stdout_path,
            stderr_path,
            exit: None,
            argv,
            started: Instant::now(),
        }
    }

    /// The process id (nsenter execs lbproxy, so this is lbproxy's pid).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The command line it was started with.
    pub fn argv(&self) -> &[String] {
        &self.argv
    }

    /// Exit status if it has exited (non-blocking).
    pub fn try_exit(&mut self) -> Option<ExitStatus> {
        if self.exit.is_none() {
            self.exit = self.child.try_wait().expect("try_wait lbproxy");
        }
        self.exit
    }

    pub fn is_running(&mut self) -> bool {
        self.try_exit().is_none()
    }

    /// One `/healthz` probe from inside the node namespace: the status code, or the error.
    pub fn healthz(&self) -> Result<u16, String> {
        http_get(
            &self.node_ns,
            HEALTHZ_ADDR.parse::<SocketAddr>().unwrap(),
            "/healthz",
        )
        .map_err(|e| e.to_string())
    }

    /// Polls `/healthz` every 50 ms until it answers 200. Returns the time since spawn, or an
    /// error with the last probe result and the log (also if the process exits meanwhile).
    pub fn wait_healthy(&mut self, timeout: Duration) -> Result<Duration, String> {
        let start = Instant::now();
        let mut last = String::from("no probe yet");
        loop {
            if let Some(st) = self.try_exit() {
                return Err(format!(
                    "lbproxy exited with {st} before becoming healthy (last /healthz: {last})\n{}",
                    self.log()
                ));
            }
            match self.healthz() {
                Ok(200) => return Ok(self.started.elapsed()),
                Ok(code) => last = format!("HTTP {code}"),
                Err(e) => last = e,
            }
            if start.elapsed() >= timeout {
                return Err(format!(
                    "lbproxy not healthy after {timeout:?} (last /healthz: {last})\n{}",
                    self.log()
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// [`Self::wait_healthy`] that panics on error.
    pub fn expect_healthy(&mut self, timeout: Duration) -> Duration {
        self.wait_healthy(timeout).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Sends a signal (e.g. `libc::SIGTERM`) if it is still running.
    pub fn signal(&mut self, sig: i32) {
        if self.is_running() {
            // SAFETY: kill(2) on our own child's pid, which has not been reaped yet.
            unsafe {
                libc::kill(self.child.id() as libc::pid_t, sig);
            }
        }
    }

    /// Sends SIGTERM.
    pub fn sigterm(&mut self) {
        self.signal(libc::SIGTERM);
    }

    /// Waits up to `timeout` for the process to exit.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let start = Instant::now();
        loop {
            if let Some(st) = self.try_exit() {
                return Some(st);
            }
            if start.elapsed() >= timeout {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM, then wait up to `timeout`; returns the exit status and how long the exit
    /// took, or panics (with the log) if it did not exit.
    pub fn terminate(&mut self, timeout: Duration) -> (ExitStatus, Duration) {
        let t = Instant::now();
        self.sigterm();
        match self.wait_exit(timeout) {
            Some(st) => (st, t.elapsed()),
            None => panic!(
                "lbproxy did not exit within {timeout:?} of SIGTERM\n{}",
                self.log()
            ),
        }
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        if self.is_running() {
            let _ = self.child.kill();
            self.exit = self.child.wait().ok();
        }
    }

    /// Everything written to stderr so far.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    /// Everything written to stdout so far.
    pub fn stdout(&self) -> String {
        std::fs::read_to_string(&self.stdout_path).unwrap_or_default()
    }

    /// Byte length of stderr so far; pass to [`Self::stderr_since`] to read only newer output.
    pub fn stderr_len(&self) -> usize {
        std::fs::metadata(&self.stderr_path)
            .map(|m| m.len() as usize)
            .unwrap_or(0)
    }

    /// stderr from byte `offset` on.
    pub fn stderr_since(&self, offset: usize) -> String {
        let all = std::fs::read(&self.stderr_path).unwrap_or_default();
        String::from_utf8_lossy(all.get(offset..).unwrap_or_default()).into_owned()
    }

    /// The command line and the tail (last 80 lines) of stdout and stderr, for failure
    /// messages.
    pub fn log(&self) -> String {
        fn tail(s: &str) -> String {
            let lines: Vec<&str> = s.lines().collect();
            let skip = lines.len().saturating_sub(80);
            let mut t = if skip > 0 {
                format!("[... {skip} lines]\n")
            } else {
                String::new()
            };
            t.push_str(&lines[skip..].join("\n"));
            t
        }
        format!(
            "=== lbproxy [{}] {} ===\n--- stdout ({}) ---\n{}\n--- stderr ({}) ---\n{}\n=== end lbproxy log ===",
            self.node_ns,
            self.argv.join(" "),
            self.stdout_path.display(),
            tail(&self.stdout()),
            self.stderr_path.display(),
            tail(&self.stderr()),
        )
    }
}

impl Drop for Lbproxy {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!("{}", self.log());
        }
    }
}
