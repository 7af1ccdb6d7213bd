//! lbproxy: an eBPF service load balancer for Kubernetes, replacing kube-proxy.
//!
//! - `lbproxy run`: load the datapath, attach it to pod interfaces, and keep the BPF maps
//!   equal to the desired state read from a source.
//! - `lbproxy inspect services|backends|flows|drops|delivery`: read the pinned maps.
//! - `lbproxy cleanup`: detach and unpin everything.

mod bpf;
mod config;
mod controller;
mod desired;
mod http;
mod inspect;
mod model;
mod program;
mod source;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use globset::{Glob, GlobSet, GlobSetBuilder};
use tokio::io::unix::AsyncFd;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;

use crate::bpf::{Attacher, Datapath, PinnedMaps};
use crate::config::DEFAULT_BPFFS_DIR;
use crate::controller::{Controller, Source};

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
    Run(Box<RunArgs>),
    /// Show what is programmed, read from the pinned maps (works without `run`).
    Inspect {
        what: inspect::What,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        #[arg(long, default_value = DEFAULT_BPFFS_DIR)]
        bpffs_dir: PathBuf,
        /// Only this service (`namespace/name`, or `namespace/name:port-name`).
        #[arg(long)]
        service: Option<String>,
        /// Only this backend (`IP` or `IP:port`).
        #[arg(long)]
        backend: Option<String>,
    },
    /// Detach every program lbproxy attached in this network namespace and remove its pins.
    Cleanup {
        #[arg(long, default_value = DEFAULT_BPFFS_DIR)]
        bpffs_dir: PathBuf,
    },
}

/// Flags override the `--config` file; a flag not given takes the file's value, then the
/// default shown.
#[derive(clap::Args)]
struct RunArgs {
    /// A KubeProxyConfiguration-style YAML file (see README).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Validate the configuration and flags, print the result, and exit.
    #[arg(long)]
    validate_only: bool,
    /// Standalone source: a file or directory of Service and EndpointSlice manifests (YAML or
    /// JSON), watched. Without it, lbproxy watches the Kubernetes API.
    #[arg(long)]
    manifests: Option<PathBuf>,
    /// kubeconfig for the API server [default: $KUBECONFIG, else in-cluster]
    #[arg(long)]
    kubeconfig: Option<String>,
    /// This node's name, for node-local endpoints and Events [default: the hostname]
    #[arg(long)]
    hostname_override: Option<String>,
    /// Comma-separated globs of host-side pod interfaces [default: lxc*,veth*,cali*]
    #[arg(long)]
    pod_interfaces: Option<String>,
    /// Where maps and links are pinned; must be on a bpffs [default: /sys/fs/bpf/lbproxy]
    #[arg(long)]
    bpffs_dir: Option<PathBuf>,
    /// [default: 0.0.0.0:10256]
    #[arg(long)]
    healthz_bind_address: Option<String>,
    /// [default: 127.0.0.1:10249]
    #[arg(long)]
    metrics_bind_address: Option<String>,
    /// Full reconcile of the maps against the model [default: 30s]
    #[arg(long)]
    sync_period: Option<String>,
    /// Minimum time between two syncs [default: 0s]
    #[arg(long)]
    min_sync_period: Option<String>,
    /// Flow table capacity (LRU); each flow takes two entries [default: 262144]
    #[arg(long)]
    flow_map_size: Option<u64>,
    /// Redirect service traffic between pods on this node straight into the destination pod,
    /// skipping the node's routing and netfilter (iptables policy on the node then does not
    /// see it) [default: false]
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    stack_bypass: Option<bool>,
    /// Idle timeout of an established TCP flow [default: 24h]
    #[arg(long)]
    conntrack_tcp_timeout_established: Option<String>,
    /// Idle timeout of a TCP flow after a FIN or RST [default: 10s]
    #[arg(long)]
    conntrack_tcp_timeout_close_wait: Option<String>,
    /// Idle timeout of a UDP flow [default: 30s]
    #[arg(long)]
    conntrack_udp_timeout: Option<String>,
    /// Idle timeout of a TCP flow whose SYN was never answered [default: 30s]
    #[arg(long)]
    flow_tcp_timeout_syn_sent: Option<String>,
}

fn parse_globs(globs: &[String]) -> anyhow::Result<GlobSet> {
    let mut b = GlobSetBuilder::new();
    for g in globs {
        b.add(Glob::new(g).with_context(|| format!("podInterfaces: bad glob {g:?}"))?);
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
            .and_then(|rt| rt.block_on(run(*args))),
        Command::Inspect {
            what,
            json,
            bpffs_dir,
            service,
            backend,
        } => inspect::run(
            &bpffs_dir,
            what,
            json,
            &inspect::Filter { service, backend },
        ),
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
    let removed = bpf::cleanup::cleanup(dir)?;
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

/// What a file-system event under the manifest path says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FileEvent {
    /// A file was written and closed, renamed into place, removed, or its metadata changed:
    /// what is there now is complete.
    Settled,
    /// A file is being written in place (created, or data written): its close follows.
    Writing,
}

impl FileEvent {
    /// The meaning of a notify event; `None` for reads, ours included (reading the files
    /// produces open and close events, and must not trigger the next read).
    fn of(kind: notify::EventKind) -> Option<Self> {
        use notify::event::{AccessKind, AccessMode, CreateKind, EventKind, ModifyKind};
        match kind {
            EventKind::Access(AccessKind::Close(AccessMode::Write)) => Some(FileEvent::Settled),
            EventKind::Access(_) => None,
            EventKind::Create(CreateKind::File)
            | EventKind::Modify(ModifyKind::Data(_) | ModifyKind::Any) => Some(FileEvent::Writing),
            _ => Some(FileEvent::Settled),
        }
    }
}

/// How long a file written in place may stay open before it is read anyway (a writer that
/// keeps it open, or a file system without close events).
const WRITE_SETTLE: Duration = Duration::from_millis(30);

/// Turns file-system events on the manifest path into a channel of [`FileEvent`]s.
fn watch_manifests(
    path: &Path,
) -> anyhow::Result<(
    notify::RecommendedWatcher,
    mpsc::UnboundedReceiver<FileEvent>,
)> {
    use notify::{RecursiveMode, Watcher as _};
    let (tx, rx) = mpsc::unbounded_channel();
    let mut watcher = notify::recommended_watcher(move |ev: notify::Result<notify::Event>| {
        if let Some(ev) = ev.ok().and_then(|ev| FileEvent::of(ev.kind)) {
            let _ = tx.send(ev);
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

/// Takes the events queued after `first`; when none says a write is complete, waits up to
/// [`WRITE_SETTLE`] for one. A file replaced by a rename (editors, ConfigMaps, `kubectl`
/// pipelines writing a temporary file) is so read at once, and one written in place is not
/// read half-written.
async fn settle(first: FileEvent, events: &mut mpsc::UnboundedReceiver<FileEvent>) {
    let mut settled = first == FileEvent::Settled;
    while let Ok(ev) = events.try_recv() {
        settled |= ev == FileEvent::Settled;
    }
    let deadline = tokio::time::Instant::now() + WRITE_SETTLE;
    while !settled {
        match tokio::time::timeout_at(deadline, events.recv()).await {
            Ok(Some(ev)) => settled = ev == FileEvent::Settled,
            Ok(None) | Err(_) => break,
        }
    }
    while events.try_recv().is_ok() {}
}

/// A cheap fingerprint of the manifest files (names, sizes, mtimes), as a safety net for
/// file systems whose events are unreliable.
fn fingerprint(path: &Path) -> Vec<(PathBuf, u64, Option<std::time::SystemTime>)> {
    source::manifests::manifest_files(path)
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

/// Collects expired flows at start and every 10 s, off the controller's loop, and reports
/// the flow table's fill from the same scan.
fn spawn_flow_gc(settings: &config::Settings, ctl: &Controller, health: http::Health) {
    let dir = settings.bpffs_dir.clone();
    let timeouts = settings.flow_timeouts;
    let capacity = ctl
        .capacities
        .iter()
        .find(|(n, _)| *n == lbproxy_common::map_names::FLOWS)
        .map_or(settings.flow_map_size, |(_, c)| {
            u32::try_from(*c).unwrap_or(u32::MAX)
        });
    tokio::spawn(async move {
        // The first tick is immediate: a collection at start also fills the flow gauge.
        let mut every = tokio::time::interval(Duration::from_secs(10));
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            let dir = dir.clone();
            let r = tokio::task::spawn_blocking(move || {
                bpf::flow_gc::collect(&dir, capacity, timeouts, 4096)
            })
            .await;
            match r {
                Ok(Ok(stats)) => {
                    health.metrics.flow_gc_deleted.inc_by(stats.deleted as u64);
                    health
                        .metrics
                        .map_entries
                        .get_or_create(&http::MapLabel {
                            map: lbproxy_common::map_names::FLOWS.to_string(),
                        })
                        .set(i64::try_from(stats.scanned - stats.deleted).unwrap_or(i64::MAX));
                    if stats.deleted > 0 || stats.under_pressure {
                        tracing::info!(
                            scanned = stats.scanned,
                            deleted = stats.deleted,
                            under_pressure = stats.under_pressure,
                            took_ms = u64::try_from(stats.took.as_millis()).unwrap_or(u64::MAX),
                            "flow gc"
                        );
                    }
                }
                Ok(Err(e)) => tracing::warn!("flow gc: {e}"),
                Err(e) => tracing::warn!("flow gc task: {e}"),
            }
        }
    });
}

fn settings(args: &RunArgs) -> anyhow::Result<config::Settings> {
    let file = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| {
                format!("invalid configuration: {}: cannot read", path.display())
            })?;
            Some((path.as_path(), config::parse_file(path, &text)?))
        }
        None => None,
    };
    let flags = config::Flags {
        kubeconfig: args.kubeconfig.clone(),
        hostname_override: args.hostname_override.clone(),
        healthz_bind_address: args.healthz_bind_address.clone(),
        metrics_bind_address: args.metrics_bind_address.clone(),
        sync_period: args.sync_period.clone(),
        min_sync_period: args.min_sync_period.clone(),
        pod_interfaces: args.pod_interfaces.clone(),
        bpffs_dir: args.bpffs_dir.clone(),
        flow_map_size: args.flow_map_size,
        stack_bypass: args.stack_bypass,
        manifests: args.manifests.clone(),
        tcp_established_timeout: args.conntrack_tcp_timeout_established.clone(),
        tcp_close_wait_timeout: args.conntrack_tcp_timeout_close_wait.clone(),
        udp_timeout: args.conntrack_udp_timeout.clone(),
        tcp_syn_sent_timeout: args.flow_tcp_timeout_syn_sent.clone(),
    };
    Ok(config::resolve(file, flags)?)
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    let settings = settings(&args)?;
    if args.validate_only {
        println!("configuration is valid:\n{settings:#?}");
        return Ok(());
    }
    if let Some(p) = &settings.manifests
        && !p.exists()
    {
        anyhow::bail!("manifests {}: no such file or directory", p.display());
    }
    let globs = parse_globs(&settings.pod_interfaces)?;
    let health = http::Health::new(settings.sync_period);
    http::serve(
        health.clone(),
        settings.healthz_bind_address,
        settings.metrics_bind_address,
    )
    .await?;

    let mut dp =
        Datapath::load(&settings.bpffs_dir, settings.flow_map_size).with_context(|| {
            format!(
                "loading the datapath (bpffsDir {})",
                settings.bpffs_dir.display()
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
    bpf::write_config(&settings.bpffs_dir, settings.stack_bypass)?;
    tracing::info!(stack_bypass = settings.stack_bypass, "datapath configured");
    let maps = PinnedMaps::open(&settings.bpffs_dir)?;
    let mut ctl = Controller::new(
        dp,
        maps,
        Attacher::new(globs, &settings.bpffs_dir, settings.stack_bypass)?,
        health.clone(),
        settings.hostname.clone(),
    );
    let (nl_handle, mut link_events) = bpf::ifaces::watch().context("opening rtnetlink")?;
    spawn_flow_gc(&settings, &ctl, health.clone());

    let mut source = match &settings.manifests {
        Some(p) => Source::Manifests(p.clone()),
        None => {
            let client = source::kube::client(settings.kubeconfig.as_deref()).await?;
            ctl.events = Some(kube::runtime::events::Recorder::new(
                client.clone(),
                kube::runtime::events::Reporter {
                    controller: "lbproxy".into(),
                    instance: Some(settings.hostname.clone()),
                },
            ));
            tracing::info!(node = %settings.hostname, "watching the Kubernetes API");
            Source::Kube(source::kube::watch(&client, &settings.hostname))
        }
    };
    // The manifests source also needs a file watcher.
    let (_watcher, mut file_events) = match &source {
        Source::Manifests(p) => {
            let (w, rx) = watch_manifests(p)?;
            (Some(w), rx)
        }
        Source::Kube(_) => (None, mpsc::unbounded_channel().1),
    };
    // Attach first: /healthz turns 200 at the first sync, and by then every pod interface
    // must already carry the programs.
    ctl.sync_interfaces(&nl_handle).await;
    let mut print = Vec::new();
    if let Source::Manifests(p) = &source {
        ctl.listed = [true; 3];
        ctl.load_manifests(p);
        print = fingerprint(p);
    }
    ctl.refresh_programmed_metrics();
    ctl.refresh_drop_metrics();

    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut tick = tokio::time::interval(Duration::from_secs(2));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut reconcile = tokio::time::interval(settings.sync_period);
    reconcile.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    reconcile.tick().await;
    let mut first_kube_sync_done = false;
    let mut last_sync: Option<Instant> = None;
    let sync_timer = tokio::time::sleep(Duration::ZERO);
    tokio::pin!(sync_timer);
    loop {
        let kube_ready = ctl.listed.iter().all(|l| *l);
        tokio::select! {
            _ = sigterm.recv() => { tracing::info!("SIGTERM: exiting; programs stay attached and maps pinned"); break; }
            _ = sigint.recv() => { tracing::info!("SIGINT: exiting; programs stay attached and maps pinned"); break; }
            Some(ev) = async { match &mut source { Source::Kube(rx) => rx.recv().await, Source::Manifests(_) => std::future::pending().await } } => {
                ctl.on_source_event(ev);
                // Coalesce whatever else is already queued.
                if let Source::Kube(rx) = &mut source {
                    while let Ok(ev) = rx.try_recv() {
                        ctl.on_source_event(ev);
                    }
                }
                if ctl.listed.iter().all(|l| *l) {
                    if !first_kube_sync_done {
                        first_kube_sync_done = true;
                        ctl.sync_all("initial list");
                        last_sync = Some(Instant::now());
                    } else if ctl.has_pending() {
                        let at = controller::next_sync_at(last_sync, settings.min_sync_period);
                        sync_timer.as_mut().reset(at.into());
                    }
                }
            }
            () = &mut sync_timer, if kube_ready && first_kube_sync_done && ctl.has_pending() => {
                ctl.sync_dirty();
                last_sync = Some(Instant::now());
                if ctl.has_pending() {
                    // A failed write: retry in a second.
                    sync_timer.as_mut().reset((Instant::now() + Duration::from_secs(1)).into());
                }
            }
            Some(ev) = file_events.recv() => {
                settle(ev, &mut file_events).await;
                if let Source::Manifests(p) = &source {
                    print = fingerprint(p);
                    ctl.load_manifests(p);
                }
            }
            Some(()) = link_events.recv() => {
                tokio::time::sleep(Duration::from_millis(10)).await;
                while link_events.try_recv().is_ok() {}
                ctl.sync_interfaces(&nl_handle).await;
            }
            _ = tick.tick() => {
                if let Source::Manifests(p) = &source {
                    let now = fingerprint(p);
                    if now != print {
                        print = now;
                        ctl.load_manifests(p);
                    }
                }
                ctl.sync_interfaces(&nl_handle).await;
                ctl.refresh_drop_metrics();
            }
            _ = reconcile.tick() => {
                if ctl.listed.iter().all(|l| *l) && (first_kube_sync_done || matches!(source, Source::Manifests(_))) {
                    ctl.reconcile();
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use notify::event::{
        AccessKind, AccessMode, CreateKind, DataChange, EventKind, ModifyKind, RemoveKind,
        RenameMode,
    };

    #[test]
    fn file_events_are_told_apart() {
        let of = FileEvent::of;
        assert_eq!(
            of(EventKind::Access(AccessKind::Open(AccessMode::Any))),
            None
        );
        assert_eq!(
            of(EventKind::Access(AccessKind::Close(AccessMode::Read))),
            None
        );
        assert_eq!(
            of(EventKind::Access(AccessKind::Close(AccessMode::Write))),
            Some(FileEvent::Settled)
        );
        assert_eq!(
            of(EventKind::Modify(ModifyKind::Name(RenameMode::To))),
            Some(FileEvent::Settled)
        );
        assert_eq!(
            of(EventKind::Remove(RemoveKind::File)),
            Some(FileEvent::Settled)
        );
        assert_eq!(
            of(EventKind::Create(CreateKind::File)),
            Some(FileEvent::Writing)
        );
        assert_eq!(
            of(EventKind::Modify(ModifyKind::Data(DataChange::Any))),
            Some(FileEvent::Writing)
        );
    }

    #[tokio::test]
    async fn settling_waits_only_for_files_still_being_written() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        // A rename into place: no wait, and the burst is taken.
        tx.send(FileEvent::Settled).unwrap();
        let t = Instant::now();
        settle(FileEvent::Settled, &mut rx).await;
        assert!(t.elapsed() < WRITE_SETTLE);
        assert!(rx.try_recv().is_err());
        // Written in place and already closed: no wait either.
        tx.send(FileEvent::Writing).unwrap();
        tx.send(FileEvent::Settled).unwrap();
        let t = Instant::now();
        settle(FileEvent::Writing, &mut rx).await;
        assert!(t.elapsed() < WRITE_SETTLE);
        // Closed a little later: read then.
        let later = tx.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(5)).await;
            later.send(FileEvent::Settled).unwrap();
        });
        settle(FileEvent::Writing, &mut rx).await;
        assert!(rx.try_recv().is_err());
        // Never closed: read after the wait.
        let t = Instant::now();
        settle(FileEvent::Writing, &mut rx).await;
        assert!(t.elapsed() >= WRITE_SETTLE);
    }
}
