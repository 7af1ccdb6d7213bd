//! Running code and commands inside a named network namespace (`/run/netns/NAME`).
//!
//! In-process code runs on a fresh thread that `setns(2)`s into the namespace; sockets created
//! there stay in that namespace and may then be used from any thread. External commands run
//! under `nsenter --net=/run/netns/NAME`, which (unlike `ip netns exec`) does not create a new
//! mount namespace and remount `/sys`, so `/sys/fs/bpf` stays visible.

use std::ffi::OsStr;
use std::fs::File;
use std::io::{self, Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd as _;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::Duration;

/// `/run/netns/NAME`.
pub fn netns_path(ns: &str) -> PathBuf {
    PathBuf::from("/run/netns").join(ns)
}

/// Moves the calling thread into network namespace `ns`. Panics if that fails.
fn enter(ns: &str) {
    let path = netns_path(ns);
    let file = File::open(&path)
        .unwrap_or_else(|e| panic!("lab: cannot open netns {}: {e}", path.display()));
    // SAFETY: plain syscall on a valid fd; only affects the calling thread.
    let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    if rc != 0 {
        panic!(
            "lab: setns({}) failed: {} (the lab needs root / CAP_SYS_ADMIN)",
            path.display(),
            io::Error::last_os_error()
        );
    }
}

/// Runs `f` on a new thread inside network namespace `ns` and returns its result.
///
/// `f` may borrow from the caller (scoped thread). A panic in `f` is propagated. Sockets
/// created by `f` belong to `ns` for their whole life, wherever they are used afterwards.
pub fn run_in_ns<T, F>(ns: &str, f: F) -> T
where
    T: Send,
    F: FnOnce() -> T + Send,
{
    std::thread::scope(|s| {
        s.spawn(|| {
            enter(ns);
            f()
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}

/// A [`Command`] that runs `program` inside network namespace `ns` via
/// `nsenter --net=/run/netns/NS -- program`. Add arguments with `.arg()`/`.args()`.
pub fn ns_command(ns: &str, program: impl AsRef<OsStr>) -> Command {
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--net={}", netns_path(ns).display()))
        .arg("--")
        .arg(program);
    cmd
}

/// Runs `argv` inside `ns` (via [`ns_command`]) and returns its stdout, or an error string
/// holding the command, exit status, stdout and stderr.
pub fn ns_run(ns: &str, argv: &[&str]) -> Result<String, String> {
    let (program, args) = argv.split_first().expect("ns_run: empty argv");
    let out = ns_command(ns, program)
        .args(args)
        .output()
        .map_err(|e| format!("[{ns}] {argv:?}: cannot run: {e}"))?;
    output_result(&format!("[{ns}] {argv:?}"), out)
}

/// Turns an [`Output`] into stdout or an error string naming `what`.
pub(crate) fn output_result(what: &str, out: Output) -> Result<String, String> {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if out.status.success() {
        Ok(stdout)
    } else {
        Err(format!(
            "{what}: {}\n--- stdout ---\n{stdout}\n--- stderr ---\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// Writes a sysctl inside `ns`. `key` is the path under `/proc/sys` with slashes, e.g.
/// `net/ipv4/conf/lbt3a0/proxy_arp` (slashes, so interface names may contain dots).
pub fn sysctl_write(ns: &str, key: &str, value: &str) -> io::Result<()> {
    let path = PathBuf::from("/proc/sys").join(key);
    run_in_ns(ns, || std::fs::write(&path, value))
}

/// Reads a sysctl inside `ns` (see [`sysctl_write`] for `key`), trimmed.
pub fn sysctl_read(ns: &str, key: &str) -> io::Result<String> {
    let path = PathBuf::from("/proc/sys").join(key);
    run_in_ns(ns, || {
        std::fs::read_to_string(&path).map(|s| s.trim().to_owned())
    })
}

/// An HTTP response: status code and raw body (not de-chunked).
#[derive(Clone, Debug)]
pub struct HttpResponse {
    pub status: u16,
    pub body: String,
}

/// `GET path` over plain HTTP/1.1 from inside `ns` (1 s timeout); returns the status code.
/// Used to probe lbproxy's `/healthz` from inside the node namespace.
pub fn http_get(ns: &str, addr: SocketAddr, path: &str) -> io::Result<u16> {
    http_get_full(ns, addr, path, Duration::from_secs(1)).map(|r| r.status)
}

/// Like [`http_get`], with a timeout, returning the body too.
pub fn http_get_full(
    ns: &str,
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
) -> io::Result<HttpResponse> {
    run_in_ns(ns, || {
        let mut s = TcpStream::connect_timeout(&addr, timeout)?;
        s.set_read_timeout(Some(timeout))?;
        s.set_write_timeout(Some(timeout))?;
        let req = format!(
            "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nUser-Agent: lbproxy-tests\r\n\r\n"
        );
        s.write_all(req.as_bytes())?;
        let mut raw = Vec::new();
        if let Err(e) = s.read_to_end(&mut raw) {
            // A server may reset the connection after replying; keep what arrived.
            if raw.is_empty() {
                return Err(e);
            }
        }
        let text = String::from_utf8_lossy(&raw).into_owned();
        let status = text
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse::<u16>().ok())
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("bad HTTP reply: {text:?}"),
                )
            })?;
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        Ok(HttpResponse { status, body })
    })
}
