//! lbproxy: an eBPF service load balancer for Kubernetes, replacing kube-proxy.
//!
//! - `lbproxy run`: load the datapath, attach it to pod interfaces, and keep the BPF maps
//!   equal to the desired state read from a source.
//! - `lbproxy inspect services|backends|flows|drops`: read the pinned maps.
//! - `lbproxy cleanup`: detach and unpin everything.

mod bpf;
mod dataplane;
mod http;
mod ifaces;
mod inspect;
mod manifests;
mod model;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use globset::{Glob, GlobSet, GlobSetBuilder};
use tokio::io::unix::AsyncFd;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;

use crate::bpf::{Attacher, Datapath, PinnedMaps};
use crate::dataplane::Programmer;

const DEFAULT_BPFFS_DIR: &str = "/sys/fs/bpf/lbproxy";

#[derive(Parser)]
#[command(
    name = "lbproxy",
    version,
    about = "eBPF service load balancer for Kubernetes"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Load the datapath, attach it to pod interfaces and program services from a source.
    Run(RunArgs),
    /// Show what is programmed, read from the pinned maps (works without `run`).
    Inspect {
        what: inspect::What,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        #[arg(long, default_value = DEFAULT_BPFFS_DIR)]
        bpffs_dir: PathBuf,
    },
    /// Detach every program lbproxy attached in this network namespace and remove its pins.
    Cleanup {
        #[arg(long, default_value = DEFAULT_BPFFS_DIR)]
        bpffs_dir: PathBuf,
    },
}

#[derive(clap::Args)]
struct RunArgs {
    /// A file or directory of Service and EndpointSlice manifests (YAML or JSON). Watched;
    /// changes apply without a restart.
    #[arg(long)]
    manifests: Option<PathBuf>,
    /// Comma-separated globs of host-side pod interfaces to attach to.
    #[arg(long, default_value = "lxc*,veth*,cali*")]
    pod_interfaces: String,
    /// Where maps and links are pinned. Must be on a bpffs.
    #[arg(long, default_value = DEFAULT_BPFFS_DIR)]
    bpffs_dir: PathBuf,
    #[arg(long, default_value = "0.0.0.0:10256")]
    healthz_bind_address: SocketAddr,
    #[arg(long, default_value = "127.0.0.1:10249")]
    metrics_bind_address: SocketAddr,
    /// Capacity of the flow table (LRU). Each flow takes two entries (one per direction).
    #[arg(long, default_value_t = lbproxy_common::DEFAULT_FLOW_MAP_SIZE, value_parser = clap::value_parser!(u32).range(1024..))]
    flow_map_size: u32,
}

fn parse_globs(s: &str) -> anyhow::Result<GlobSet> {
    let mut b = GlobSetBuilder::new();
    let mut n = 0;
    for g in s.split(',').map(str::trim).filter(|g| !g.is_empty()) {
        b.add(Glob::new(g).with_context(|| format!("--pod-interfaces: bad glob {g:?}"))?);
        n += 1;
    }
    if n == 0 {
        anyhow::bail!("--pod-interfaces: no globs given");
    }
    Ok(b.build()?)
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(anyhow::Error::from)
            .and_then(|rt| rt.block_on(run(args))),
        Command::Inspect {
            what,
            json,
            bpffs_dir,
        } => inspect::run(&bpffs_dir, what, json),
        Command::Cleanup { bpffs_dir } => cleanup(&bpffs_dir),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lbproxy: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn cleanup(dir: &Path) -> anyhow::Result<()> {
    let removed = bpf::cleanup(dir)?;
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

/// Turns file-system events on the manifest path into a channel of "maybe changed" ticks.
fn watch_manifests(
    path: &Path,
) -> anyhow::Result<(notify::RecommendedWatcher, mpsc::UnboundedReceiver<()>)> {
    use notify::{RecursiveMode, Watcher as _};
    let (tx, rx) = mpsc::unbounded_channel();
    let mut watcher = notify::recommended_watcher(move |ev: notify::Result<notify::Event>| {
        // Reading the files ourselves produces open/close (access) events: ignoring them
        // keeps a read from triggering the next read.
        if let Ok(ev) = ev
            && !matches!(ev.kind, notify::EventKind::Access(_))
        {
            let _ = tx.send(());
        }
    })
    .context("creating the manifest watcher")?;
    // Watch the parent of a file, so editors' and ConfigMaps' atomic renames are seen.
    let target = if path.is_dir() {
        path.to_path_buf()
    } else {
        path.parent()
            .filter(|p| !p.as_os_str().is_empty())
            .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
    };
    watcher
        .watch(&target, RecursiveMode::Recursive)
        .with_context(|| format!("watching {}", target.display()))?;
    Ok((watcher, rx))
}

/// A cheap fingerprint of the manifest files (names, sizes, mtimes), as a safety net for
/// file systems whose events are unreliable.
fn fingerprint(path: &Path) -> Vec<(PathBuf, u64, Option<std::time::SystemTime>)> {
    manifests::manifest_files(path)
        .unwrap_or_default()
        .into_iter()
        .map(|f| {
            let m = std::fs::metadata(&f).ok();
            let len = m.as_ref().map_or(0, std::fs::Metadata::len);
            let mtime = m.and_then(|m| m.modified().ok());
            (f, len, mtime)
        })
        .collect()
}

struct Controller {
    dp: Datapath,
    maps: PinnedMaps,
    programmer: Programmer,
    attacher: Attacher,
    health: http::Health,
    last_model: Option<model::Model>,
}

impl Controller {
    /// Reads the manifests and programs the difference. On bad input it logs the file, object
    /// and reason and keeps the last good state programmed.
    fn sync_manifests(&mut self, path: &Path) -> bool {
        let started = Instant::now();
        let loaded = match manifests::load(path) {
            Ok(l) => l,
            Err(e) => {
                self.health.metrics.sync_failures.inc();
                tracing::error!("manifests rejected, keeping the last good state: {e}");
                return false;
            }
        };
        for s in &loaded.skipped {
            tracing::debug!("not proxied: {s}");
        }
        if self.last_model.as_ref() == Some(&loaded.model) {
            return true;
        }
        let desired = dataplane::desired(&loaded.model);
        let result = self.programmer.apply(&mut self.maps, &desired);
        let p = self.programmer.programmed();
        self.health
            .metrics
            .frontends
            .set(i64::try_from(p.frontends.len()).unwrap_or(i64::MAX));
        self.health
            .metrics
            .backends
            .set(i64::try_from(p.backends.len()).unwrap_or(i64::MAX));
        match result {
            Ok(stats) => {
                self.health.metrics.syncs.inc();
                self.health.metrics.last_sync_timestamp.set(
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0.0, |d| d.as_secs_f64()),
                );
                tracing::info!(
                    services = loaded.model.services.len(),
                    slices = loaded.model.slices.len(),
                    frontends = desired.len(),
                    changed = stats.frontends_changed,
                    writes = stats.writes,
                    deletes = stats.deletes,
                    took_us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX),
                    "synced"
                );
                self.last_model = Some(loaded.model);
                true
            }
            Err((_, errors)) => {
                self.health.metrics.sync_failures.inc();
                for e in errors {
                    tracing::error!("map write failed (will retry): {e}");
                }
                self.last_model = None;
                false
            }
        }
    }

    async fn sync_interfaces(&mut self, handle: &rtnetlink::Handle) {
        match ifaces::list(handle).await {
            Ok(list) => {
                for e in self.attacher.sync(&mut self.dp, &list) {
                    tracing::error!("attach failed (will retry): {}", bpf::error_chain(&e));
                }
                self.health
                    .metrics
                    .attached_interfaces
                    .set(i64::try_from(self.attacher.attached().len()).unwrap_or(i64::MAX));
            }
            Err(e) => tracing::error!("listing interfaces: {e}"),
        }
    }
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    let Some(manifest_path) = args.manifests.clone() else {
        anyhow::bail!(
            "no source given: pass --manifests PATH (the Kubernetes API source is not built yet)"
        );
    };
    if !manifest_path.exists() {
        anyhow::bail!(
            "--manifests {}: no such file or directory",
            manifest_path.display()
        );
    }
    let globs = parse_globs(&args.pod_interfaces)?;
    let health = http::Health::new();
    http::serve(
        health.clone(),
        args.healthz_bind_address,
        args.metrics_bind_address,
    )
    .await?;

    let mut dp = Datapath::load(&args.bpffs_dir, args.flow_map_size).with_context(|| {
        format!(
            "loading the datapath (--bpffs-dir {})",
            args.bpffs_dir.display()
        )
    })?;
    // Keep the logger alive for as long as the programs run (toolchain.md), and drain it.
    match aya_log::EbpfLogger::init(&mut dp.ebpf) {
        Ok(logger) => {
            tokio::spawn(async move {
                // SAFETY: the logger owns its ring buffer's fd, which stays open and the same
                // for as long as the logger lives, and the AsyncFd owns the logger.
                let registered = unsafe {
                    AsyncFd::register_with_interest(logger, tokio::io::Interest::READABLE)
                };
                let Ok(mut fd) = registered else {
                    return;
                };
                loop {
                    let Ok(mut guard) = fd.readable_mut().await else {
                        return;
                    };
                    guard.get_inner_mut().flush();
                    guard.clear_ready();
                }
            });
        }
        Err(e) => tracing::warn!("datapath logs unavailable: {e}"),
    }
    let maps = PinnedMaps::open(&args.bpffs_dir)?;
    let adopted = maps.read_programmed();
    if !adopted.frontends.is_empty() {
        tracing::info!(
            frontends = adopted.frontends.len(),
            backends = adopted.backends.len(),
            "adopting the state pinned by an earlier run"
        );
    }
    let mut ctl = Controller {
        programmer: Programmer::adopt(adopted),
        maps,
        dp,
        attacher: Attacher::new(globs),
        health: health.clone(),
        last_model: None,
    };

    let (nl_handle, mut link_events) = ifaces::watch().context("opening rtnetlink")?;
    let (_watcher, mut file_events) = watch_manifests(&manifest_path)?;

    // First full sync: maps, then interfaces. /healthz turns 200 only after the maps hold
    // the first good model.
    let mut synced = ctl.sync_manifests(&manifest_path);
    ctl.sync_interfaces(&nl_handle).await;
    if synced {
        health.set_synced();
    }
    let mut print = fingerprint(&manifest_path);

    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut tick = tokio::time::interval(Duration::from_secs(2));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = sigterm.recv() => { tracing::info!("SIGTERM: exiting; programs stay attached and maps pinned"); break; }
            _ = sigint.recv() => { tracing::info!("SIGINT: exiting; programs stay attached and maps pinned"); break; }
            Some(()) = file_events.recv() => {
                // Coalesce a burst of events (write, rename, chmod) into one sync.
                tokio::time::sleep(Duration::from_millis(30)).await;
                while file_events.try_recv().is_ok() {}
                print = fingerprint(&manifest_path);
                if ctl.sync_manifests(&manifest_path) && !synced {
                    synced = true;
                    health.set_synced();
                }
            }
            Some(()) = link_events.recv() => {
                tokio::time::sleep(Duration::from_millis(10)).await;
                while link_events.try_recv().is_ok() {}
                ctl.sync_interfaces(&nl_handle).await;
            }
            _ = tick.tick() => {
                let now = fingerprint(&manifest_path);
                if now != print || ctl.last_model.is_none() {
                    print = now;
                    if ctl.sync_manifests(&manifest_path) && !synced {
                        synced = true;
                        health.set_synced();
                    }
                }
                ctl.sync_interfaces(&nl_handle).await;
            }
        }
    }
    Ok(())
}
