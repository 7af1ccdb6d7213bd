//! `lbproxy run`: the settings (from [`config::RunArgs`]), and the wiring of the pieces (the
//! datapath, the servers, the source, the controller) until a signal ends it.

use std::path::Path;
use std::time::Duration;

use anyhow::Context as _;
use globset::{Glob, GlobSet, GlobSetBuilder};
use tokio::io::unix::AsyncFd;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;

use crate::bpf::{Attacher, Datapath, PinnedMaps};
use crate::config::RunArgs;
use crate::controller::Controller;
use crate::takeover;
use std::sync::Arc;

use crate::server::Health;
use crate::telemetry::Metrics;
use crate::{bpf, config, config_watch, controller, server, source, telemetry};

fn parse_globs(globs: &[String]) -> anyhow::Result<GlobSet> {
    let mut b = GlobSetBuilder::new();
    for g in globs {
        b.add(Glob::new(g).with_context(|| format!("podInterfaces: bad glob {g:?}"))?);
    }
    Ok(b.build()?)
}

/// `lbproxy run`: the settings, then the controller on a two-thread runtime until a signal.
/// `json_errors` says, as soon as it is known, whether the final error is to be a JSON line.
pub fn main(args: RunArgs, json_errors: &mut bool) -> anyhow::Result<()> {
    *json_errors = args.flags.logging_format.as_deref() == Some("json");
    let (settings, warnings) = prepare(&args)?;
    *json_errors = settings.log_format == config::LogFormat::Json;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(run(args, settings, warnings))
}

/// `run` before the runtime starts: the settings, `--write-config-to`, `--validate-only`,
/// the logger, and what the log says once at start.
fn prepare(args: &RunArgs) -> anyhow::Result<(config::Settings, Vec<String>)> {
    let (settings, warnings) = args.settings()?;
    if let Some(path) = &args.write_config_to {
        std::fs::write(path, settings.to_yaml())
            .with_context(|| format!("--write-config-to {}", path.display()))?;
        println!("wrote the effective configuration to {}", path.display());
        std::process::exit(0);
    }
    if args.validate_only {
        for w in &warnings {
            println!("warning: {w}");
        }
        println!("configuration is valid:\n{settings:#?}");
        std::process::exit(0);
    }
    telemetry::logging::init(settings.log_format, settings.verbosity)?;
    Ok((settings, warnings))
}

/// kube-proxy's `oomScoreAdj`, when given.
fn apply_oom_score_adj(value: Option<i32>) {
    let Some(v) = value else { return };
    match std::fs::write("/proc/self/oom_score_adj", v.to_string()) {
        Ok(()) => tracing::info!(oom_score_adj = v, "oomScoreAdj applied"),
        Err(e) => tracing::warn!("oomScoreAdj {v}: writing /proc/self/oom_score_adj: {e}"),
    }
}

/// The Event recorder of the parts that start before the Kubernetes client (the flow
/// collector): set once the client exists, never with `--manifests`.
type NodeEvents = Arc<std::sync::OnceLock<kube::runtime::events::Recorder>>;

/// Collects expired flows at start and every 10 s, off the controller's loop, and reports
/// the flow table's fill from the same scan: a table (or a destination's SNAT port space)
/// past 80% is reported once per crossing in the log and in a Node Event naming the
/// Services and clients with the most flows ([`bpf::flow_top`]).
fn spawn_flow_gc(
    settings: &config::Settings,
    capacities: &[(&'static str, i64)],
    metrics: Arc<Metrics>,
    events: NodeEvents,
) {
    let node = settings.hostname.clone();
    let dir = settings.bpffs_dir.clone();
    let timeouts = settings.flow_timeouts;
    let per_service = settings.per_service_metrics;
    let snat_range = u32::from(settings.snat_port_range.1 - settings.snat_port_range.0) + 1;
    let capacity = capacities
        .iter()
        .find(|(n, _)| *n == lbproxy_common::map_names::FLOWS)
        .map_or(settings.flow_map_size, |(_, c)| {
            u32::try_from(*c).unwrap_or(u32::MAX)
        });
    let capacity6 = capacities
        .iter()
        .find(|(n, _)| *n == lbproxy_common::map_names::FLOWS6)
        .map_or(lbproxy_common::DEFAULT_FLOW6_MAP_SIZE, |(_, c)| {
            u32::try_from(*c).unwrap_or(u32::MAX)
        });
    tokio::spawn(async move {
        // The first tick is immediate: a collection at start also fills the flow gauge.
        let mut every = tokio::time::interval(Duration::from_secs(10));
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut pressure = bpf::flow_top::Pressure::default();
        let mut active = telemetry::ActiveFlows::default();
        loop {
            every.tick().await;
            let gc_dir = dir.clone();
            let r = tokio::task::spawn_blocking(move || {
                let dir = gc_dir;
                let v4 = bpf::flow_gc::collect(&dir, capacity, timeouts, 4096)?;
                let v6 = bpf::flow_gc::collect_family::<[u8; 16]>(
                    &dir,
                    lbproxy_common::map_names::FLOWS6,
                    capacity6,
                    timeouts,
                    4096,
                )?;
                anyhow::Ok((v4, v6))
            })
            .await;
            match r {
                Ok(Ok((stats, v6))) => {
                    report_gc(&metrics, lbproxy_common::map_names::FLOWS, &stats);
                    report_gc(&metrics, lbproxy_common::map_names::FLOWS6, &v6);
                    metrics
                        .snat_ports_max_ratio
                        .set(stats.snat_ports_max as f64 / snat_range as f64);
                    if per_service {
                        let mut live = stats.live_by_service.clone();
                        for (id, n) in &v6.live_by_service {
                            *live.entry(*id).or_default() += n;
                        }
                        active.set(&metrics.datapath, &live, &|| bpf::pinned::labels(&dir));
                    }
                    // The labels are read (a small map) only when there is something to say.
                    let warnings = pressure.check(
                        std::time::Instant::now(),
                        &[stats.fill("IPv4", capacity), v6.fill("IPv6", capacity6)],
                        snat_range,
                        &|| bpf::pinned::labels(&dir),
                    );
                    for w in warnings {
                        tracing::warn!(reason = w.reason, "{}", w.note);
                        if let Some(recorder) = events.get() {
                            controller::report::post_node_event(
                                recorder.clone(),
                                &node,
                                None,
                                w.reason,
                                "CollectFlows",
                                w.note,
                            );
                        }
                    }
                }
                Ok(Err(e)) => tracing::warn!("flow gc: {e}"),
                Err(e) => tracing::warn!("flow gc task: {e}"),
            }
        }
    });
}

/// One collection of the flow map `map`: its deletions and fill in the metrics, and a log
/// line when it deleted anything or ran under pressure.
fn report_gc(metrics: &Metrics, map: &'static str, stats: &bpf::flow_gc::GcStats) {
    metrics.flow_gc_deleted.inc_by(stats.deleted as u64);
    metrics
        .map_entries
        .get_or_create(&telemetry::MapLabel::of(map))
        .set(i64::try_from(stats.scanned - stats.deleted).unwrap_or(i64::MAX));
    if stats.deleted > 0 || stats.under_pressure {
        tracing::info!(
            map,
            scanned = stats.scanned,
            deleted = stats.deleted,
            under_pressure = stats.under_pressure,
            took_ms = u64::try_from(stats.took.as_millis()).unwrap_or(u64::MAX),
            "flow gc"
        );
    }
}

/// The pieces in order: the servers, the datapath (attached before the first sync), the
/// source, then the controller until SIGTERM, SIGINT or a change of the `--config` file.
async fn run(
    args: RunArgs,
    settings: config::Settings,
    warnings: Vec<String>,
) -> anyhow::Result<()> {
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        commit = telemetry::GIT_COMMIT,
        config = %settings.configz(),
        "lbproxy starting"
    );
    for w in &warnings {
        tracing::warn!("{w}");
    }
    apply_oom_score_adj(settings.oom_score_adj);
    let config_changed = match &args.config {
        Some(path) => Some(config_watch::spawn(path.clone())?),
        None => None,
    };
    if let Some(p) = &settings.manifests
        && !p.exists()
    {
        anyhow::bail!("manifests {}: no such file or directory", p.display());
    }
    let globs = parse_globs(&settings.pod_interfaces)?;
    let health = Health::new(settings.sync_period);
    let metrics = Arc::new(Metrics::new());
    server::serve(
        health.clone(),
        metrics.clone(),
        settings.healthz_bind_address,
        settings.metrics_bind_address,
        settings.configz(),
    )
    .await?;
    let node_events = NodeEvents::default();
    let started = start_datapath(&settings, globs, &metrics, &node_events).await?;
    // kube-proxy's flows, written before the first sync serves a frontend (`takeover`).
    let takeover = takeover::prepare(
        &settings.bpffs_dir,
        settings.takeover,
        &settings.flow_timeouts,
    )?;
    if let Some(t) = takeover {
        spawn_takeover(t, &settings, &health, &metrics);
    }

    // The source.
    let mut report =
        controller::Report::new(health.clone(), metrics.clone(), settings.hostname.clone());
    report.capacities = started.capacities;
    let (tx, mut events) = mpsc::channel(256);
    start_source(&settings, &metrics, &mut report, &node_events, tx).await?;

    // The controller, until SIGTERM or SIGINT.
    let mut ctl = Controller::new(PinnedMaps::open(&settings.bpffs_dir)?, report)
        .with_health_checks(started.hc_addresses)
        .with_node_addresses(started.node_ips);
    if settings.lb_algorithm == config::LbAlgorithm::Maglev {
        ctl = ctl.with_maglev(settings.maglev_table_size, started.seed);
    }
    if started.sock_lb {
        let (tx, rx) = tokio::sync::watch::channel(bpf::sock::SyncCue::default());
        bpf::sock::spawn_reaper(settings.bpffs_dir.clone(), rx, metrics.clone());
        ctl = ctl.with_sync_notify(tx);
    }
    let timing = controller::Timing {
        sync_period: settings.sync_period,
        min_sync_period: settings.min_sync_period,
    };
    let changed_flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let shutdown = shutdown(config_changed, changed_flag.clone())?;
    ctl.drive(&mut events, timing, shutdown).await;
    if changed_flag.load(std::sync::atomic::Ordering::SeqCst) {
        // As kube-proxy: exit so that the DaemonSet starts lbproxy again with the new file.
        anyhow::bail!(
            "configuration file {} changed: exiting so that the restart reads it (programs stay attached, maps pinned)",
            args.config
                .as_deref()
                .map(Path::display)
                .map(|d| d.to_string())
                .unwrap_or_default()
        );
    }
    Ok(())
}

/// The rest of the takeover from kube-proxy, once the first sync is in the maps: `/healthz`
/// stays 503 until it is done. A takeover that fails exits lbproxy: kube-proxy's rules are
/// then still in place or gone, and the flows still conntrack's or lbproxy's, never neither
/// (docs/migration.md).
fn spawn_takeover(
    t: takeover::Takeover,
    settings: &config::Settings,
    health: &Health,
    metrics: &Arc<Metrics>,
) {
    health.hold(if t.takes() {
        "taking the node over from kube-proxy"
    } else {
        "catching up with kube-proxy's flows"
    });
    let (dir, health, metrics) = (settings.bpffs_dir.clone(), health.clone(), metrics.clone());
    tokio::spawn(async move {
        while !health.synced() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let done = tokio::task::spawn_blocking(move || t.complete(&dir, &metrics)).await;
        match done {
            Ok(Ok(())) => health.release(),
            Ok(Err(e)) => {
                tracing::error!("takeover failed: {e:#}");
                std::process::exit(1);
            }
            Err(e) => {
                tracing::error!("takeover failed: {e}");
                std::process::exit(1);
            }
        }
    });
}

/// What [`start_datapath`] hands the controller.
struct Started {
    capacities: Vec<(&'static str, i64)>,
    hc_addresses: tokio::sync::watch::Receiver<Vec<std::net::IpAddr>>,
    node_ips: tokio::sync::watch::Receiver<Vec<std::net::IpAddr>>,
    /// The socket-level programs are attached (their sockets are reaped after syncs).
    sock_lb: bool,
    /// The flow-hash seed in effect, which Maglev tables are built with.
    seed: u64,
}

/// The datapath: loaded, configured, and attached to every pod interface before the first
/// sync (/healthz turns 200 then, and by then the programs must be in place); its logger,
/// flow collector and counters running.
async fn start_datapath(
    settings: &config::Settings,
    globs: GlobSet,
    metrics: &Arc<Metrics>,
    node_events: &NodeEvents,
) -> anyhow::Result<Started> {
    // Read before anything is loaded: a bad seed file changes nothing on the node.
    let seed_file = settings
        .hash_seed_file
        .as_deref()
        .map(|path| {
            let bytes = std::fs::read(path)
                .with_context(|| format!("hashSeedFile {}: cannot be read", path.display()))?;
            crate::program::maglev::seed_from_bytes(&bytes)
                .map_err(|why| anyhow::anyhow!("hashSeedFile {}: {why}", path.display()))
        })
        .transpose()?;
    let mut dp =
        Datapath::load(&settings.bpffs_dir, settings.flow_map_size).with_context(|| {
            format!(
                "loading the datapath (bpffsDir {})",
                settings.bpffs_dir.display()
            )
        })?;
    spawn_datapath_logs(&mut dp);
    let seed = bpf::write_config(
        &settings.bpffs_dir,
        settings.stack_bypass,
        settings.load_balancer_mode,
        settings.per_service_metrics,
        seed_file,
    )?;
    let maglev_m = match settings.lb_algorithm {
        config::LbAlgorithm::Maglev => settings.maglev_table_size,
        config::LbAlgorithm::Jump => 0,
    };
    bpf::write_maglev_config(&settings.bpffs_dir, maglev_m)?;
    tracing::info!(
        stack_bypass = settings.stack_bypass,
        load_balancer_mode = settings.load_balancer_mode.as_str(),
        lb_algorithm = settings.lb_algorithm.as_str(),
        maglev_table_size = maglev_m,
        seed_from_file = seed_file.is_some(),
        "datapath configured"
    );
    let sock_cgroup = bpf::sock::attach(&mut dp, &settings.cgroup_root, settings.socket_lb)
        .context("socket-level load balancing (cgroupRoot, socketLb)")?;
    let (hc_tx, hc_addresses) = tokio::sync::watch::channel(Vec::new());
    let (node_ips_tx, node_ips) = tokio::sync::watch::channel(Vec::new());
    let attacher = Attacher::new(
        globs,
        &settings.bpffs_dir,
        settings.stack_bypass,
        settings.node_port_addresses.clone(),
        settings.snat_port_range,
        hc_tx,
        node_ips_tx,
    )?
    .with_xdp(settings.xdp_acceleration);
    bpf::ifaces::spawn_attach(dp, attacher, metrics.clone()).await?;
    let capacities = bpf::capacities(&settings.bpffs_dir);
    spawn_flow_gc(settings, &capacities, metrics.clone(), node_events.clone());
    bpf::spawn_counters(
        PinnedMaps::open(&settings.bpffs_dir)?,
        metrics.clone(),
        settings.per_service_metrics,
    );
    Ok(Started {
        capacities,
        hc_addresses,
        node_ips,
        sock_lb: sock_cgroup.is_some(),
        seed,
    })
}

/// The source of the desired state, sending to `tx`: the `--manifests` files, or the
/// Kubernetes API (whose client also gives `report` and `node_events` their Event recorder).
async fn start_source(
    settings: &config::Settings,
    metrics: &Metrics,
    report: &mut controller::Report,
    node_events: &NodeEvents,
    tx: mpsc::Sender<source::SourceEvent>,
) -> anyhow::Result<()> {
    match &settings.manifests {
        Some(p) => source::manifests::watch::spawn(p.clone(), settings.hostname.clone(), tx)?,
        None => {
            let client = source::kube::client(
                settings.kubeconfig.as_deref(),
                metrics,
                settings.qps,
                settings.burst,
            )
            .await?;
            let recorder = kube::runtime::events::Recorder::new(
                client.clone(),
                kube::runtime::events::Reporter {
                    controller: "lbproxy".into(),
                    instance: Some(settings.hostname.clone()),
                },
            );
            let _ = node_events.set(recorder.clone());
            report.events = Some(recorder);
            tracing::info!(node = %settings.hostname, "watching the Kubernetes API");
            source::kube::spawn(&client, &settings.hostname, tx);
        }
    }
    Ok(())
}

/// Resolves on SIGTERM, SIGINT, or a change of the `--config` file (which sets `changed`).
fn shutdown(
    config_changed: Option<tokio::sync::oneshot::Receiver<()>>,
    changed: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> anyhow::Result<impl std::future::Future<Output = ()>> {
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    Ok(async move {
        let config_changed = async {
            match config_changed {
                Some(rx) => {
                    let _ = rx.await;
                }
                None => std::future::pending().await,
            }
        };
        let which = tokio::select! {
            _ = sigterm.recv() => "SIGTERM",
            _ = sigint.recv() => "SIGINT",
            () = config_changed => {
                changed.store(true, std::sync::atomic::Ordering::SeqCst);
                "the configuration file changed"
            }
        };
        tracing::info!("{which}: exiting; programs stay attached and maps pinned");
    })
}

/// Keeps the datapath's logger alive for as long as the programs run (toolchain.md), and
/// drains it.
fn spawn_datapath_logs(dp: &mut Datapath) {
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
}
