//! lbproxy's developer tasks: `cargo xtask <setup|run|test|lint|demo|bench>`.
//!
//! The alias lives in `.cargo/config.toml` (`xtask = "run --package xtask --"`).

mod bench;
mod bench_churn;
mod bench_datapath;
mod bench_northsouth;
mod bench_programs;
mod demo;
#[cfg(test)]
mod ebpf_modules;
mod setup;
mod test;
mod util;

use std::os::unix::process::CommandExt as _;
use std::process::Command;

use anyhow::{Context as _, Result};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    bin_name = "cargo xtask",
    about = "lbproxy's developer tasks"
)]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what this machine needs (Debian packages, nightly rust-src, bpf-linker built
    /// against LLVM 22, bpffs). Idempotent: a second run only checks.
    Setup {
        /// Only check, and print the commands that would install what is missing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Set up, build lbproxy (with its eBPF object), then exec `lbproxy ARGS`.
    ///
    /// Example: cargo xtask run -- run --manifests deploy/examples/demo.yaml
    Run {
        /// Arguments for lbproxy.
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Set up, build lbproxy, then run the tests in tiers, with LBPROXY_BIN set: unit
    /// (no privileges), bpf (packets through the loaded programs with BPF_PROG_TEST_RUN),
    /// lab (real sockets in network namespaces). Without a tier flag, all three.
    ///
    /// ARGS go to `cargo test`; ARGS after a second `--` go to the test harness
    /// (e.g. `cargo xtask test --lab -- -- --nocapture`). `--test-threads=2` is the default.
    Test {
        #[command(flatten)]
        tier: test::TierArgs,
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// rustfmt check, clippy of the userspace crates, and nightly clippy of the eBPF crate.
    Lint {
        /// Set AYA_BUILD_SKIP=1 for the userspace clippy (skips rebuilding the eBPF object;
        /// lbproxy then only compiles if an earlier build left the object in OUT_DIR).
        #[arg(long)]
        skip_ebpf_build: bool,
        /// Skip the nightly clippy of lbproxy-ebpf.
        #[arg(long)]
        no_ebpf: bool,
    },
    /// Show lbproxy balancing a Service in a namespace lab: no cluster needed.
    Demo(demo::DemoArgs),
    /// Benchmarks. Without a subcommand, the datapath benchmark (`bench datapath`): lbproxy
    /// against kube-proxy's iptables and nftables layouts and a direct path, e.g.
    /// `cargo xtask bench --quick`.
    #[command(args_conflicts_with_subcommands = true)]
    Bench {
        #[command(subcommand)]
        what: Option<BenchWhat>,
        #[command(flatten)]
        datapath: Box<bench_datapath::DatapathArgs>,
    },
}

#[derive(Subcommand)]
enum BenchWhat {
    /// Controller sync at scale: first full sync, one endpoint change, RSS.
    Sync(bench::SyncArgs),
    /// Flow churn, lbproxy vs kube-proxy-style iptables+conntrack: how long a removed
    /// backend's UDP flow takes to move, and how many SYN retries to a replaced backend fail.
    /// `--sustained`: 10,000 Services, 100,000 endpoints, 100 changes/s for 60 s, against
    /// lbproxy, iptables and nftables.
    Churn(bench_churn::ChurnArgs),
    /// Connection rate and latency against kube-proxy's iptables/nftables (issue 5).
    Datapath(bench_datapath::DatapathArgs),
    /// North-south: an external client through node A's NodePort to a backend on node B,
    /// against kube-proxy's iptables/nftables NodePort layouts and the direct path (issue 11).
    Northsouth(Box<bench_northsouth::NorthSouthArgs>),
    /// What each kind of packet costs each pod program (`BPF_PROG_TEST_RUN`, the kernel's
    /// own timing), over N services: the low-noise way to compare two builds.
    Programs(bench_programs::ProgramsArgs),
}

fn main() {
    if let Err(e) = real_main() {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn real_main() -> Result<()> {
    let cli = Cli::parse();
    match cli.task {
        Task::Setup { dry_run } => setup::setup_with(dry_run),
        Task::Run { args } => {
            setup::setup()?;
            let bin = util::build_lbproxy("run")?;
            let mut cmd = Command::new(&bin);
            cmd.args(&args);
            eprintln!("[run] exec {}", util::display(&cmd));
            let err = cmd.exec();
            Err(err).with_context(|| format!("cannot exec {}", bin.display()))
        }
        Task::Test { tier, args } => test::test(tier.tier(), &args),
        Task::Lint {
            skip_ebpf_build,
            no_ebpf,
        } => test::lint(&test::LintOptions {
            skip_ebpf_build,
            no_ebpf,
        }),
        Task::Demo(args) => demo::demo(&args),
        Task::Bench { what, datapath } => match what {
            Some(BenchWhat::Sync(args)) => bench::sync(&args),
            Some(BenchWhat::Churn(args)) => bench_churn::churn(&args),
            Some(BenchWhat::Datapath(args)) => bench_datapath::datapath(&args),
            Some(BenchWhat::Northsouth(args)) => bench_northsouth::northsouth(&args),
            Some(BenchWhat::Programs(args)) => bench_programs::programs(&args),
            None => bench_datapath::datapath(&datapath),
        },
    }
}
