//! Small helpers to run commands: echo what runs, stream long output, capture short output.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};

/// The workspace root (the directory holding the top-level Cargo.toml).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

/// Renders a command as a shell-like line for logs.
pub fn display(cmd: &Command) -> String {
    let mut parts = Vec::new();
    for (k, v) in cmd.get_envs() {
        if let Some(v) = v {
            parts.push(format!("{}={}", k.to_string_lossy(), v.to_string_lossy()));
        }
    }
    parts.push(cmd.get_program().to_string_lossy().into_owned());
    parts.extend(cmd.get_args().map(|a| {
        let a = a.to_string_lossy();
        if a.is_empty() || a.contains(char::is_whitespace) {
            format!("'{a}'")
        } else {
            a.into_owned()
        }
    }));
    parts.join(" ")
}

/// Runs `cmd` with inherited stdio (its output streams to ours) and fails if it fails.
pub fn run(cmd: &mut Command) -> Result<()> {
    let status = status(cmd)?;
    if !status.success() {
        bail!("`{}` failed: {status}", display(cmd));
    }
    Ok(())
}

/// Runs `cmd` with inherited stdio and returns its exit status.
pub fn status(cmd: &mut Command) -> Result<ExitStatus> {
    eprintln!("  $ {}", display(cmd));
    cmd.status()
        .with_context(|| format!("cannot start `{}`", display(cmd)))
}

/// Like [`run`], but also prints `[tag] label: still running (Ns)` every `every` while the
/// command runs, so a long build whose tools print nothing for a minute never looks hung.
pub fn run_with_heartbeat(
    cmd: &mut Command,
    tag: &str,
    label: &str,
    every: Duration,
) -> Result<()> {
    let (tx, rx) = mpsc::channel::<()>();
    let start = Instant::now();
    let (tag2, label2) = (tag.to_owned(), label.to_owned());
    let beat = std::thread::spawn(move || {
        while let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(every) {
            eprintln!(
                "[{tag2}] {label2}: still running ({}s elapsed)",
                start.elapsed().as_secs()
            );
        }
    });
    let result = run(cmd);
    drop(tx);
    let _ = beat.join();
    if result.is_ok() {
        eprintln!("[{tag}] {label}: done in {}s", start.elapsed().as_secs());
    }
    result
}

/// Runs `cmd` quietly and returns (success, stdout, stderr). Fails only if it cannot start.
pub fn capture(cmd: &mut Command) -> Result<(bool, String, String)> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("cannot start `{}`", display(cmd)))?;
    Ok((
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// Runs `program args...` quietly; `None` if it cannot start or fails, else its stdout.
pub fn output_of<S: AsRef<OsStr>>(program: &str, args: &[S]) -> Option<String> {
    let (ok, out, _) = capture(Command::new(program).args(args)).ok()?;
    ok.then_some(out)
}

/// A `cargo` command. Uses the rustup proxy on PATH so rust-toolchain.toml applies.
pub fn cargo() -> Command {
    let mut cmd = Command::new("cargo");
    cmd.current_dir(repo_root());
    cmd
}

/// The cargo target directory of this workspace (honours CARGO_TARGET_DIR and config).
pub fn target_dir() -> Result<PathBuf> {
    let (ok, out, err) = capture(
        cargo()
            .args(["metadata", "--format-version", "1", "--no-deps"])
            .stderr(Stdio::piped()),
    )?;
    if !ok {
        bail!("cargo metadata failed: {err}");
    }
    let v: serde_json::Value = serde_json::from_str(&out).context("parsing cargo metadata")?;
    let dir = v["target_directory"]
        .as_str()
        .context("cargo metadata has no target_directory")?;
    Ok(PathBuf::from(dir))
}

/// `cargo build -p lbproxy` (debug; lbproxy/build.rs builds the eBPF object with aya-build)
/// and returns the absolute path of the binary.
pub fn build_lbproxy(tag: &str) -> Result<PathBuf> {
    eprintln!("[{tag}] building lbproxy (debug; its build.rs builds the eBPF object)");
    let mut cmd = cargo();
    cmd.args(["build", "-p", "lbproxy"]);
    // Never build without the eBPF object for something we run.
    cmd.env_remove("AYA_BUILD_SKIP");
    run_with_heartbeat(
        &mut cmd,
        tag,
        "cargo build -p lbproxy",
        Duration::from_secs(30),
    )?;
    let bin = target_dir()?.join("debug").join("lbproxy");
    if !bin.is_file() {
        bail!("cargo build succeeded but {} does not exist", bin.display());
    }
    Ok(bin)
}

/// Builds lbproxy in release mode (benchmarks) and returns the binary's path.
/// The lbproxy binary a benchmark measures: `LBPROXY_BIN` when it is set (another build,
/// to compare two builds one after the other), else this tree's release build.
pub fn bench_lbproxy(tag: &str) -> Result<PathBuf> {
    if let Some(bin) = std::env::var_os("LBPROXY_BIN") {
        let bin = PathBuf::from(bin);
        if !bin.is_file() {
            bail!("LBPROXY_BIN={} is not a file", bin.display());
        }
        eprintln!("[{tag}] measuring LBPROXY_BIN={}", bin.display());
        return Ok(bin);
    }
    build_lbproxy_release(tag)
}

pub fn build_lbproxy_release(tag: &str) -> Result<PathBuf> {
    eprintln!("[{tag}] building lbproxy (release; its build.rs builds the eBPF object)");
    let mut cmd = cargo();
    cmd.args(["build", "--release", "-p", "lbproxy"]);
    cmd.env_remove("AYA_BUILD_SKIP");
    run_with_heartbeat(
        &mut cmd,
        tag,
        "cargo build --release -p lbproxy",
        Duration::from_secs(30),
    )?;
    let bin = target_dir()?.join("release").join("lbproxy");
    if !bin.is_file() {
        bail!("cargo build succeeded but {} does not exist", bin.display());
    }
    Ok(bin)
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Catches SIGINT and SIGTERM into a flag (see [`interrupted`]) so long-running commands can
/// stop at the next check and clean up instead of dying with namespaces left behind.
pub fn catch_interrupts() {
    let handler: extern "C" fn(libc::c_int) = on_signal;
    // SAFETY: the handler only stores into an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, handler as libc::sighandler_t);
        libc::signal(libc::SIGTERM, handler as libc::sighandler_t);
    }
}

/// Whether SIGINT/SIGTERM arrived since [`catch_interrupts`].
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// Fails with "interrupted" if a signal arrived.
pub fn check_interrupted() -> Result<()> {
    if interrupted() {
        bail!("interrupted");
    }
    Ok(())
}
