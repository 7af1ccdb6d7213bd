//! The command line: `lbproxy run|inspect|flows|monitor|completions|man|cleanup`, parsed by
//! clap, and each command handed to the library part that does it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};

use crate::config::DEFAULT_BPFFS_DIR;
use crate::config::RunArgs;
use crate::{bpf, config, telemetry};

pub mod explain;
pub mod flush;
pub mod inspect;
pub mod monitor;

#[derive(Parser)]
#[command(
    name = "lbproxy",
    version = VERSION,
    about = "eBPF service load balancer for Kubernetes"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// `--version`: the package version and the commit it was built from.
const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("LBPROXY_GIT_COMMIT"),
    ")"
);

#[derive(Subcommand)]
pub enum Command {
    /// Load the datapath, attach it to pod interfaces and program services from a source.
    Run(Box<RunArgs>),
    /// Show what is programmed, read from the pinned maps (works without `run`).
    Inspect {
        what: inspect::What,
        /// Output format.
        #[arg(short = 'o', long = "output", value_enum, default_value_t = inspect::Output::Table)]
        output: inspect::Output,
        /// Print JSON instead of a table (the same as `-o json`).
        #[arg(long)]
        json: bool,
        /// Print again every SECONDS (default 2), until interrupted.
        #[arg(long, value_name = "SECONDS", num_args = 0..=1, default_missing_value = "2")]
        watch: Option<f64>,
        /// Where `inspect status` reads the controller's /healthz.
        #[arg(long, default_value = "127.0.0.1:10256")]
        healthz_address: String,
        #[arg(long, default_value = DEFAULT_BPFFS_DIR)]
        bpffs_dir: PathBuf,
        /// Only this service (`namespace/name`, or `namespace/name:port-name`).
        #[arg(long)]
        service: Option<String>,
        /// Only this backend (`IP` or `IP:port`).
        #[arg(long)]
        backend: Option<String>,
        /// With `flows`: instead of listing every flow, count them (each once, both
        /// families) by Service (`namespace/name`) or by client address, the most first,
        /// each with its own top clients or Services: who fills the flow table.
        #[arg(long, value_enum, value_name = "BY")]
        top: Option<inspect::TopBy>,
        /// With `--top`: how many Services (or clients) to print, and how many clients (or
        /// Services) to name in each; 0 prints them all.
        #[arg(long, value_name = "N", default_value_t = 10, requires = "top")]
        limit: usize,
    },
    /// Where a packet of one 5-tuple goes, and why: walks the datapath's stages against the
    /// live pinned maps (frontend, source ranges, flow, affinity, endpoints, the backend a new
    /// flow gets, SNAT or DSR) and prints each decision. Reads only: changes no map, no
    /// counter.
    Explain {
        #[arg(long, default_value = DEFAULT_BPFFS_DIR)]
        bpffs_dir: PathBuf,
        #[arg(long, value_enum)]
        proto: explain::Proto,
        /// The client's address and port, `IP:PORT` (`[IPv6]:PORT`).
        #[arg(long, value_name = "IP:PORT")]
        src: std::net::SocketAddr,
        /// The address and port the client sends to, `IP:PORT` (`[IPv6]:PORT`).
        #[arg(long, value_name = "IP:PORT")]
        dst: std::net::SocketAddr,
        /// Where the packet enters: a pod's interface, the node's own interface
        /// (north-south), or a process on the node (socket-level).
        #[arg(long, value_enum, default_value_t = explain::From::Pod)]
        from: explain::From,
        /// Output format: the steps as text, or JSON (YAML) for scripts.
        #[arg(short = 'o', long = "output", value_enum, default_value_t = inspect::Output::Table)]
        output: inspect::Output,
    },
    /// Act on the datapath's flow table.
    Flows {
        #[command(subcommand)]
        action: FlowsAction,
    },
    /// Stream the datapath's drops and rejects live: reason, 5-tuple, interface, service.
    /// Events are sent only while a monitor listens, at most --rate per CPU per second.
    Monitor {
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
        #[arg(long, default_value = DEFAULT_BPFFS_DIR)]
        bpffs_dir: PathBuf,
        /// Only this reason (as in `inspect drops`, e.g. `no_backend_tcp_reset`); repeatable.
        #[arg(long = "reason", value_name = "REASON")]
        reasons: Vec<String>,
        /// Only events of this service (`namespace/name`, or `namespace/name:port-name`).
        #[arg(long)]
        service: Option<String>,
        /// Stop after this many events.
        #[arg(long)]
        count: Option<u64>,
        /// Stop after this many seconds.
        #[arg(long, value_name = "SECONDS")]
        duration: Option<f64>,
        /// The most events each CPU sends per second; the rest are counted as suppressed.
        #[arg(long, default_value_t = lbproxy_common::DEFAULT_EVENTS_PER_CPU_PER_SEC)]
        rate: u32,
    },
    /// Print a shell completion script: `lbproxy completions bash > /etc/bash_completion.d/lbproxy`.
    Completions { shell: clap_complete::Shell },
    /// Print the man page (lbproxy.1), or with --dir write one page per command there.
    Man {
        #[arg(long, value_name = "DIR")]
        dir: Option<PathBuf>,
    },
    /// Detach every program lbproxy attached in this network namespace and remove its pins.
    Cleanup {
        #[arg(long, default_value = DEFAULT_BPFFS_DIR)]
        bpffs_dir: PathBuf,
        /// Before detaching, write every live flow as a conntrack entry with its DNAT (and
        /// SNAT), so that its connection keeps working under kube-proxy, whose rules must be
        /// back first (docs/migration.md)
        #[arg(long)]
        hand_back: bool,
    },
}

#[derive(Subcommand)]
pub enum FlowsAction {
    /// Remove flows (both halves) from the flow table, as `conntrack -D` would: their next
    /// packet is load-balanced afresh. Give --service, --backend and/or --client (all must
    /// match), or --all.
    Flush {
        /// `namespace/name` (every port) or `namespace/name:port-name`.
        #[arg(long)]
        service: Option<String>,
        /// The backend's `IP` or `IP:port`.
        #[arg(long)]
        backend: Option<String>,
        /// The client's own IP address.
        #[arg(long)]
        client: Option<String>,
        /// Every flow.
        #[arg(long)]
        all: bool,
        /// Show what would be removed; remove nothing.
        #[arg(long)]
        dry_run: bool,
        #[arg(long)]
        json: bool,
        #[arg(long, default_value = DEFAULT_BPFFS_DIR)]
        bpffs_dir: PathBuf,
    },
}

/// `lbproxy man`: the page of `lbproxy` on stdout, or every command's page under `dir`
/// (`lbproxy.1`, `lbproxy-run.1`, `lbproxy-flows-flush.1`, ...).
fn man(dir: Option<&Path>) -> anyhow::Result<()> {
    let cmd = <Cli as clap::CommandFactory>::command();
    match dir {
        None => clap_mangen::Man::new(cmd).render(&mut std::io::stdout())?,
        Some(dir) => {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            clap_mangen::generate_to(cmd, dir)
                .with_context(|| format!("writing man pages to {}", dir.display()))?;
        }
    }
    Ok(())
}

/// Runs one command line; what the binary's `main` does. An error ends in one line on stderr
/// (a JSON object when `run` logs JSON) and a failing exit status.
pub fn main(cli: Cli) -> std::process::ExitCode {
    let mut json_errors = false;
    let result = match cli.command {
        Command::Run(args) => crate::run::main(*args, &mut json_errors),
        other => telemetry::logging::init(config::LogFormat::Text, 0).and_then(|()| tool(other)),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) if json_errors => {
            // In JSON mode the last line is a JSON object too.
            let line = serde_json::json!({
                "timestamp": jiff::Timestamp::now().to_string(),
                "level": "ERROR",
                "message": format!("lbproxy: error: {e:#}"),
                "target": "lbproxy",
            });
            eprintln!("{line}");
            std::process::ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("lbproxy: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Every command but `run`: tools that read (or, `flows flush`, edit) the pinned state.
fn tool(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Run(_) => unreachable!("`run` is not a tool"),
        Command::Inspect {
            what,
            output,
            json,
            watch,
            healthz_address,
            bpffs_dir,
            service,
            backend,
            top,
            limit,
        } => inspect::run(
            &bpffs_dir,
            what,
            if json { inspect::Output::Json } else { output },
            &inspect::Filter { service, backend },
            top.map(|by| inspect::Top { by, limit }),
            &healthz_address,
            watch,
        ),
        Command::Explain {
            bpffs_dir,
            proto,
            src,
            dst,
            from,
            output,
        } => explain::run(&explain::Args {
            bpffs_dir: &bpffs_dir,
            proto,
            src,
            dst,
            from,
            output,
        }),
        Command::Flows {
            action:
                FlowsAction::Flush {
                    service,
                    backend,
                    client,
                    all,
                    dry_run,
                    json,
                    bpffs_dir,
                },
        } => flush::run(
            &bpffs_dir,
            &flush::Selector {
                filter: inspect::Filter { service, backend },
                client,
                all,
            },
            dry_run,
            json,
        ),
        Command::Monitor {
            json,
            bpffs_dir,
            reasons,
            service,
            count,
            duration,
            rate,
        } => monitor::run(
            &bpffs_dir,
            &monitor::Options {
                json,
                reasons,
                filter: inspect::Filter {
                    service,
                    backend: None,
                },
                count,
                duration: duration
                    .map(|d| {
                        Duration::try_from_secs_f64(d)
                            .map_err(|e| anyhow::anyhow!("--duration {d}: {e}"))
                    })
                    .transpose()?,
                rate,
            },
        ),
        Command::Completions { shell } => {
            clap_complete::generate(
                shell,
                &mut <Cli as clap::CommandFactory>::command(),
                "lbproxy",
                &mut std::io::stdout(),
            );
            Ok(())
        }
        Command::Man { dir } => man(dir.as_deref()),
        Command::Cleanup {
            bpffs_dir,
            hand_back,
        } => {
            if hand_back && bpffs_dir.exists() {
                let started = std::time::Instant::now();
                let h = crate::takeover::hand_back::hand_back(&bpffs_dir)
                    .context("--hand-back (nothing was detached)")?;
                println!(
                    "hand-back: wrote {} flows as conntrack entries ({} plain entries deleted, {} could not be written) in {} ms",
                    h.written,
                    h.plain_deleted,
                    h.failed,
                    started.elapsed().as_millis()
                );
            }
            cleanup(&bpffs_dir)
        }
    }
}

fn cleanup(dir: &Path) -> anyhow::Result<()> {
    let removed = bpf::cleanup::cleanup(dir)?;
    // After the programs are gone, no packet is marked any more (`takeover::untrack`).
    match crate::takeover::untrack::remove() {
        Ok(true) => println!("removed the untrack rule of a takeover or hand-back"),
        Ok(false) => {}
        Err(e) => eprintln!("warning: the untrack rule of a takeover or hand-back: {e:#}"),
    }
    if removed.is_empty() {
        println!("nothing to clean up under {}", dir.display());
    } else {
        for r in removed {
            println!("removed {r}");
        }
        println!("removed {}", dir.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("lbproxy").chain(args.iter().copied()))
    }

    #[test]
    fn the_command_line_is_consistent() {
        <Cli as clap::CommandFactory>::command().debug_assert();
    }

    #[test]
    fn top_takes_what_to_count_and_limit_needs_top() {
        let Ok(Cli {
            command: Command::Inspect { top, limit, .. },
        }) = parse(&["inspect", "flows", "--top", "clients", "--limit", "3"])
        else {
            panic!("inspect flows --top clients --limit 3 does not parse");
        };
        assert_eq!((top, limit), (Some(inspect::TopBy::Clients), 3));
        let Ok(Cli {
            command: Command::Inspect { top, limit, .. },
        }) = parse(&["inspect", "flows"])
        else {
            panic!("inspect flows does not parse");
        };
        assert_eq!((top, limit), (None, 10));
        assert!(parse(&["inspect", "flows", "--limit", "3"]).is_err());
        assert!(parse(&["inspect", "flows", "--top", "backends"]).is_err());
    }
}
