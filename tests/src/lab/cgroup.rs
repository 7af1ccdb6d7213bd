//! Node-namespace clients in a cgroup of their own, for socket-level load balancing.
//!
//! [`CgroupGroup::new`] mounts a cgroup2 hierarchy at a directory of its own and makes one
//! group in it, `lbt-<id>`, which lbproxy is given as `--cgroup-root`. Clients are
//! `lbt-client` processes ([`HostClient`]) that move themselves into the group and then into
//! a node's network namespace: only their sockets are in the group, never the test
//! process's or another test's. Dropping the group kills what is left in it, removes it and
//! unmounts the hierarchy.

use std::io::{BufRead as _, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

use super::ns::netns_path;

/// A cgroup2 group made by a test (see the module docs).
pub struct CgroupGroup {
    mount: PathBuf,
    group: PathBuf,
}

impl CgroupGroup {
    /// Mounts cgroup2 at `<tmp>/lbt-cg-<id>` and creates `lbt-<id>` in it. Panics with the
    /// reason when it cannot (e.g. without root).
    pub fn new(id: &str) -> CgroupGroup {
        let mount = std::env::temp_dir().join(format!("lbt-cg-{id}"));
        std::fs::create_dir_all(&mount)
            .unwrap_or_else(|e| panic!("cgroup lab: mkdir {}: {e}", mount.display()));
        let out = Command::new("mount")
            .args(["-t", "cgroup2", "none"])
            .arg(&mount)
            .output()
            .unwrap_or_else(|e| panic!("cgroup lab: cannot run mount: {e}"));
        assert!(
            out.status.success(),
            "cgroup lab: mount -t cgroup2 none {}: {}",
            mount.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let group = mount.join(format!("lbt-{id}"));
        let g = CgroupGroup { mount, group };
        std::fs::create_dir(&g.group)
            .unwrap_or_else(|e| panic!("cgroup lab: mkdir {}: {e}", g.group.display()));
        g
    }

    /// The group's directory (lbproxy's `--cgroup-root`).
    pub fn path(&self) -> &Path {
        &self.group
    }

    /// The pids in the group now.
    pub fn pids(&self) -> Vec<u32> {
        std::fs::read_to_string(self.group.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }
}

impl Drop for CgroupGroup {
    fn drop(&mut self) {
        if self.group.exists() {
            // `cgroup.kill` (Linux 5.14) kills everything in the group at once.
            let _ = std::fs::write(self.group.join("cgroup.kill"), "1");
            for _ in 0..100 {
                if std::fs::remove_dir(&self.group).is_ok() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let _ = Command::new("umount").arg(&self.mount).output();
        let _ = std::fs::remove_dir(&self.mount);
    }
}

/// The `lbt-client` binary: `$LBT_CLIENT_BIN`, else beside the running test's `deps/`
/// directory (where cargo puts this package's binaries).
pub fn client_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("LBT_CLIENT_BIN").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("current_exe");
    let dir = exe.parent().expect("exe dir");
    let dir = if dir.ends_with("deps") {
        dir.parent().expect("target dir")
    } else {
        dir
    };
    let p = dir.join("lbt-client");
    assert!(
        p.is_file(),
        "lbt-client not found at {} (built with this package's tests; set LBT_CLIENT_BIN)",
        p.display()
    );
    p
}

/// One request's outcome, as `lbt-client` printed it.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    pub ok: bool,
    /// The backend that answered.
    pub backend: String,
    /// The client address the backend saw.
    pub client_seen: String,
    /// The peer as the client saw it: `getpeername()` (TCP) or the datagram's source (UDP).
    pub peer: String,
    pub error: String,
    pub errno: Option<i32>,
    /// How long the request took, in milliseconds.
    pub ms: f64,
}

impl Outcome {
    fn parse(line: &str) -> Outcome {
        let v: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("lbt-client printed {line:?}: {e}"));
        let s = |k: &str| v[k].as_str().unwrap_or_default().to_string();
        Outcome {
            ok: v["ok"].as_bool().unwrap_or(false),
            backend: s("backend"),
            client_seen: s("client_seen"),
            peer: s("peer"),
            error: s("error"),
            errno: v["errno"].as_i64().map(|e| e as i32),
            ms: v["ms"].as_f64().unwrap_or_default(),
        }
    }
}

/// A client process of a node: `lbt-client` in `cgroup` (if any) and network namespace
/// `ns`.
pub struct HostClient {
    child: Child,
    out: BufReader<ChildStdout>,
}

/// What [`HostClient`] does: `tcp`, `udp`, `udp-connected` or `tcp-connected` (see
/// `lbt-client`).
#[derive(Clone, Copy, Debug)]
pub enum Mode {
    Tcp,
    Udp,
    UdpConnected,
    TcpConnected,
    /// A one-way sender on an unconnected socket (`sendto` only).
    UdpOneWay,
    /// A one-way sender on a connected socket that connects again when a send fails.
    UdpOneWayConnected,
}

impl Mode {
    fn arg(self) -> &'static str {
        match self {
            Mode::Tcp => "tcp",
            Mode::Udp => "udp",
            Mode::UdpConnected => "udp-connected",
            Mode::TcpConnected => "tcp-connected",
            Mode::UdpOneWay => "udp-oneway",
            Mode::UdpOneWayConnected => "udp-oneway-connected",
        }
    }
}

/// The requests a [`HostClient`] makes: `count` of `mode` to `target`, `interval` apart,
/// each bounded by `timeout`.
#[derive(Clone, Copy, Debug)]
pub struct Requests {
    pub mode: Mode,
    pub target: SocketAddr,
    pub count: usize,
    pub interval: Duration,
    pub timeout: Duration,
    /// The source port to bind (one-way modes; 0: any).
    pub bind_port: u16,
}

impl Requests {
    /// `count` requests back to back, each bounded by 2 s.
    pub fn new(mode: Mode, target: SocketAddr, count: usize) -> Requests {
        Requests {
            mode,
            target,
            count,
            interval: Duration::ZERO,
            timeout: Duration::from_secs(2),
            bind_port: 0,
        }
    }

    pub fn bind_port(self, bind_port: u16) -> Requests {
        Requests { bind_port, ..self }
    }

    pub fn interval(self, interval: Duration) -> Requests {
        Requests { interval, ..self }
    }

    pub fn timeout(self, timeout: Duration) -> Requests {
        Requests { timeout, ..self }
    }
}

impl HostClient {
    /// Starts `lbt-client` making `req` from `ns` (in `cgroup`, if given).
    pub fn spawn(ns: &str, cgroup: Option<&Path>, req: &Requests) -> HostClient {
        let mut cmd = Command::new(client_bin());
        cmd.arg("--netns").arg(netns_path(ns));
        if let Some(cg) = cgroup {
            cmd.arg("--cgroup").arg(cg);
        }
        cmd.args([req.mode.arg(), &req.target.to_string()])
            .args(["--count", &req.count.to_string()])
            .args(["--interval-ms", &req.interval.as_millis().to_string()])
            .args(["--timeout-ms", &req.timeout.as_millis().to_string()])
            .args(["--bind-port", &req.bind_port.to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start lbt-client: {e}"));
        let out = BufReader::new(child.stdout.take().expect("stdout"));
        HostClient { child, out }
    }

    /// The next request's outcome, or `None` once the client has exited.
    pub fn next_outcome(&mut self) -> Option<Outcome> {
        let mut line = String::new();
        match self.out.read_line(&mut line) {
            Ok(0) | Err(_) => None,
            Ok(_) => Some(Outcome::parse(&line)),
        }
    }

    /// Ends the client now (SIGKILL) and returns the outcomes it printed.
    pub fn stop(mut self) -> Vec<Outcome> {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let mut out = Vec::new();
        while let Some(o) = self.next_outcome() {
            out.push(o);
        }
        out
    }

    /// Every outcome, once the client has made all its requests; panics if it failed.
    pub fn all(mut self) -> Vec<Outcome> {
        let mut out = Vec::new();
        while let Some(o) = self.next_outcome() {
            out.push(o);
        }
        let status = self.child.wait().expect("wait lbt-client");
        assert!(status.success(), "lbt-client exited {status}");
        out
    }
}

impl Drop for HostClient {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
