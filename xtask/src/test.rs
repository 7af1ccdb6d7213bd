//! `cargo xtask test` and `cargo xtask lint`.

use std::io::{BufRead as _, BufReader, Write as _};
use std::process::{Command, Stdio};

use anyhow::{Context as _, Result, bail};

use crate::util::{self, cargo};

/// The eBPF crate is `#![no_std]`/`#![no_main]` for bpfel-unknown-none: it cannot build for
/// the host, so host-side cargo commands over the workspace leave it out. lbproxy's build.rs
/// still builds (and so checks) it for its real target.
const EBPF_CRATE: &str = "lbproxy-ebpf";

/// Test counts summed over every `test result:` line cargo test printed.
#[derive(Debug, Default)]
struct Tally {
    passed: u64,
    failed: u64,
    ignored: u64,
    binaries: u64,
    failed_binaries: u64,
    failed_tests: Vec<String>,
}

impl Tally {
    /// Reads one line of libtest output.
    fn line(&mut self, line: &str) {
        let line = line.trim();
        if let Some(rest) = line.strip_prefix("test result: ") {
            self.binaries += 1;
            if rest.starts_with("FAILED") {
                self.failed_binaries += 1;
            }
            for part in rest.split(';') {
                let mut words = part.split_whitespace().rev();
                let (Some(what), Some(n)) = (words.next(), words.next()) else {
                    continue;
                };
                let Ok(n) = n.parse::<u64>() else { continue };
                match what {
                    "passed" => self.passed += n,
                    "failed" => self.failed += n,
                    "ignored" => self.ignored += n,
                    _ => {}
                }
            }
        } else if let Some(name) = line
            .strip_prefix("test ")
            .and_then(|l| l.strip_suffix(" ... FAILED"))
        {
            self.failed_tests.push(name.to_owned());
        }
    }
}

/// Splits `ARGS` from `cargo xtask test -- ARGS` into cargo-test args and test-harness args
/// (those after a second `--`), adding `--test-threads=2` unless the caller set it.
fn split_args(extra: &[String]) -> (Vec<String>, Vec<String>) {
    let (cargo_args, mut harness) = match extra.iter().position(|a| a == "--") {
        Some(i) => (extra[..i].to_vec(), extra[i + 1..].to_vec()),
        None => (extra.to_vec(), Vec::new()),
    };
    if !harness.iter().any(|a| a.starts_with("--test-threads")) {
        // Each integration test builds its own namespace lab; 2 cores.
        harness.push("--test-threads=2".into());
    }
    (cargo_args, harness)
}

/// `--unit | --bpf | --lab`: one tier; none of them: every tier.
#[derive(clap::Args, Clone, Copy, Debug, Default)]
#[group(multiple = false)]
pub struct TierArgs {
    /// Only the tests that need no privileges: no namespaces, no BPF (controller in
    /// process, model, desired state, programmer, config, manifests).
    #[arg(long)]
    unit: bool,
    /// Only the packet tests: crafted frames through the loaded programs
    /// (BPF_PROG_TEST_RUN), bytes and counters compared.
    #[arg(long)]
    bpf: bool,
    /// Only the namespace lab: real programs on veths, real TCP and UDP.
    #[arg(long)]
    lab: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    Unit,
    Bpf,
    Lab,
}

impl TierArgs {
    pub fn tier(self) -> Vec<Tier> {
        match (self.unit, self.bpf, self.lab) {
            (true, _, _) => vec![Tier::Unit],
            (_, true, _) => vec![Tier::Bpf],
            (_, _, true) => vec![Tier::Lab],
            _ => vec![Tier::Unit, Tier::Bpf, Tier::Lab],
        }
    }
}

/// The integration tests (in `tests/tests/`) that need no privileges.
const UNIT_INTEGRATION: [&str; 2] = ["apiserver_selftest", "deploy_manifests"];
/// The integration tests that are packet tests.
const BPF_INTEGRATION: [&str; 1] = ["packet"];
/// xtask's own tests that run the benchmarks' harnesses in namespace labs (a name filter:
/// `datapath_harness_smoke`, `programs_harness_smoke`).
const XTASK_LAB_TEST: &str = "harness_smoke";

/// A `cargo test` run: its cargo arguments and extra test-harness arguments.
type Selection = (Vec<String>, Vec<String>);

/// The `cargo test` selections of a tier. The lab tier is every other integration test in
/// `tests/tests/`, so a new file there is a lab test unless listed above.
fn selections(tier: Tier) -> Result<Vec<Selection>> {
    let own = |v: &[&str]| v.iter().map(|s| (*s).to_string()).collect::<Vec<_>>();
    let tests_of = |names: &[String]| {
        let mut v = own(&["-p", "lbproxy-tests"]);
        for n in names {
            v.push("--test".into());
            v.push(n.clone());
        }
        v
    };
    Ok(match tier {
        Tier::Unit => {
            let mut lab_lib = own(&["-p", "lbproxy-tests", "--lib"]);
            for n in UNIT_INTEGRATION {
                lab_lib.extend(own(&["--test", n]));
            }
            vec![
                (
                    own(&["-p", "lbproxy", "-p", "lbproxy-common", "-p", "xtask"]),
                    own(&["--skip", XTASK_LAB_TEST]),
                ),
                (lab_lib, Vec::new()),
            ]
        }
        Tier::Bpf => vec![(tests_of(&own(&BPF_INTEGRATION)), Vec::new())],
        Tier::Lab => {
            let dir = util::repo_root().join("tests").join("tests");
            let mut names = Vec::new();
            for e in
                std::fs::read_dir(&dir).with_context(|| format!("listing {}", dir.display()))?
            {
                let e = e?;
                let name = e.file_name().to_string_lossy().to_string();
                if let Some(stem) = name.strip_suffix(".rs")
                    && !UNIT_INTEGRATION.contains(&stem)
                    && !BPF_INTEGRATION.contains(&stem)
                {
                    names.push(stem.to_string());
                }
            }
            names.sort();
            vec![
                (tests_of(&names), Vec::new()),
                (own(&["-p", "xtask"]), own(&[XTASK_LAB_TEST])),
            ]
        }
    })
}

pub fn test(tiers: Vec<Tier>, extra: &[String]) -> Result<()> {
    if tiers == [Tier::Unit] {
        crate::setup::for_build()?;
    } else {
        crate::setup::setup()?;
    }
    let bin = util::build_lbproxy("test")?;
    let (cargo_args, harness) = split_args(extra);
    // A caller's own package or target selection replaces the tiers'.
    let picks = cargo_args
        .iter()
        .any(|a| a.starts_with("-p") || a.starts_with("--package") || a == "--test");
    let runs: Vec<(String, Selection)> = if picks {
        vec![("selected".to_string(), (Vec::new(), Vec::new()))]
    } else {
        let mut runs = Vec::new();
        for t in &tiers {
            for sel in selections(*t)? {
                runs.push((format!("{t:?}").to_lowercase(), sel));
            }
        }
        runs
    };
    let started = std::time::Instant::now();
    let mut tally = Tally::default();
    let mut ok = true;
    for (tier, (sel, sel_harness)) in &runs {
        let mut cmd = cargo();
        cmd.arg("test")
            .args(sel)
            .arg("--no-fail-fast")
            .args(&cargo_args)
            .arg("--")
            .args(sel_harness)
            .args(&harness)
            .env("LBPROXY_BIN", &bin)
            .env("LBPROXY_KUBECTL", crate::setup::kubectl_path()?)
            .env_remove("AYA_BUILD_SKIP")
            .stdout(Stdio::piped());
        eprintln!("[test] tier {tier}: LBPROXY_BIN={}", bin.display());
        eprintln!("  $ {}", util::display(&cmd));
        let mut child = cmd
            .spawn()
            .with_context(|| format!("cannot start `{}`", util::display(&cmd)))?;
        let stdout = child.stdout.take().expect("stdout is piped");
        let mut out = std::io::stdout();
        let failed_before = tally.failed;
        for line in BufReader::new(stdout).lines() {
            let line = line.context("reading cargo test output")?;
            tally.line(&line);
            let _ = writeln!(out, "{line}");
            let _ = out.flush();
        }
        let status = child.wait().context("waiting for cargo test")?;
        if !status.success() {
            ok = false;
            if tally.failed == failed_before {
                println!(
                    "[test] tier {tier}: cargo test failed without a failing test: a build \
                     error, or a test binary that crashed (see above)"
                );
            }
        }
    }

    println!();
    if !tally.failed_tests.is_empty() {
        println!("[test] failed tests:");
        for t in &tally.failed_tests {
            println!("[test]   {t}");
        }
    }
    let verdict = if ok { "ok" } else { "FAILED" };
    println!(
        "[test] {verdict}: {} test suites ({} failed) in {}s, tiers: {}",
        tally.binaries,
        tally.failed_binaries,
        started.elapsed().as_secs(),
        runs.iter()
            .map(|(t, _)| t.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
    // The plain closing line (last, alone on its line).
    println!(
        "summary: {} passed, {} failed, {} skipped",
        tally.passed, tally.failed, tally.ignored
    );
    if !ok {
        // Exit here so the summary stays the last line printed.
        std::process::exit(1);
    }
    Ok(())
}

pub struct LintOptions {
    /// Set AYA_BUILD_SKIP=1 for the userspace clippy (lbproxy then has no eBPF object).
    pub skip_ebpf_build: bool,
    /// Skip the nightly clippy of the eBPF crate.
    pub no_ebpf: bool,
}

pub fn lint(opts: &LintOptions) -> Result<()> {
    let mut failures = Vec::new();

    eprintln!("[lint] rustfmt");
    if !util::status(cargo().args(["fmt", "--all", "--check"]))?.success() {
        failures.push("cargo fmt --all --check");
    }

    eprintln!("[lint] clippy (userspace crates, host target)");
    let mut clippy = cargo();
    clippy.args([
        "clippy",
        "--workspace",
        "--exclude",
        EBPF_CRATE,
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]);
    if opts.skip_ebpf_build {
        clippy.env("AYA_BUILD_SKIP", "1");
    }
    if !util::status(&mut clippy)?.success() {
        failures.push("cargo clippy --workspace --all-targets");
    }

    if opts.no_ebpf {
        eprintln!("[lint] clippy of {EBPF_CRATE}: skipped (--no-ebpf)");
    } else {
        let has_clippy = util::output_of(
            "rustup",
            &["component", "list", "--toolchain", "nightly", "--installed"],
        )
        .is_some_and(|l| l.lines().any(|c| c.trim().starts_with("clippy")));
        if has_clippy {
            eprintln!("[lint] clippy ({EBPF_CRATE}, nightly, bpfel-unknown-none)");
            let mut cmd = Command::new("rustup");
            cmd.current_dir(util::repo_root())
                .args([
                    "run",
                    crate::setup::NIGHTLY,
                    "cargo",
                    "clippy",
                    "-p",
                    EBPF_CRATE,
                    "--target",
                    "bpfel-unknown-none",
                    "-Z",
                    "build-std=core",
                    "--",
                    "-D",
                    "warnings",
                ])
                // Set by the outer rustup proxy / cargo; they would pin the stable toolchain.
                .env_remove("RUSTUP_TOOLCHAIN")
                .env_remove("RUSTC")
                .env_remove("RUSTC_WORKSPACE_WRAPPER");
            if !util::status(&mut cmd)?.success() {
                failures.push("nightly clippy of lbproxy-ebpf");
            }
        } else {
            eprintln!(
                "[lint] clippy of {EBPF_CRATE}: skipped, the nightly toolchain has no clippy \
                 (rustup component add clippy --toolchain nightly)"
            );
        }
    }

    if failures.is_empty() {
        eprintln!("[lint] ok");
        Ok(())
    } else {
        bail!("lint failed: {}", failures.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tally_sums_result_lines() {
        let mut t = Tally::default();
        for l in [
            "test a::b ... ok",
            "test a::c ... FAILED",
            "test result: FAILED. 3 passed; 1 failed; 2 ignored; 0 measured; 0 filtered out; finished in 0.01s",
            "test result: ok. 4 passed; 0 failed; 0 ignored; 0 measured; 5 filtered out; finished in 1.00s",
        ] {
            t.line(l);
        }
        assert_eq!(
            (t.passed, t.failed, t.ignored, t.binaries, t.failed_binaries),
            (7, 1, 2, 2, 1),
            "{t:?}"
        );
        assert_eq!(t.failed_tests, vec!["a::c".to_string()]);
    }

    #[test]
    fn split_args_adds_test_threads() {
        let s = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            split_args(&s(&["lab"])),
            (s(&["lab"]), s(&["--test-threads=2"]))
        );
        assert_eq!(
            split_args(&s(&["-p", "x", "--", "--nocapture"])),
            (s(&["-p", "x"]), s(&["--nocapture", "--test-threads=2"]))
        );
        assert_eq!(
            split_args(&s(&["--", "--test-threads=1"])),
            (s(&[]), s(&["--test-threads=1"]))
        );
    }
}
