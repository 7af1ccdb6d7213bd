//! `cargo xtask bench churn --sustained`: churn at cluster scale (issue 31 §4).
//!
//! N Services with E endpoints in all, and `--rate` endpoint changes a second for `--secs`,
//! the way a rolling update of large Deployments looks: each change replaces one endpoint of
//! one Service by a new address. Three paths, one after the other, each in its own lab
//! (client pod, backend pods b1..b4 answering with their name on UDP 5353 and TCP 8081):
//! - **lbproxy**: `lbproxy run --kubeconfig` against the test API server
//!   (`lbproxy_tests::apiserver`) loaded with the N Services and their EndpointSlices; every
//!   change is an EndpointSlice update there, so lbproxy sees it as a watch event;
//! - **iptables**, **nftables**: kube-proxy's layouts for the same Services
//!   (`lbproxy_tests::lab::kube_proxy`) in the lab's node namespace, loaded with one
//!   `iptables-restore` / `nft -f`; then a sync loop that models kube-proxy's: the changes
//!   queue up, a sync starts once there is one and `--min-sync-ms` (kube-proxy's
//!   `minSyncPeriod`, 1 s by default) has passed since the last sync started, and applies
//!   everything queued as kube-proxy does: iptables, one `iptables-restore --noflush` of its
//!   partial sync (every service's `KUBE-SERVICES` rule, the changed services' `KUBE-SVC-*`
//!   and `KUBE-SEP-*` chains, `-X` of the endpoint chains that went); nftables, one
//!   incremental `nft -f` transaction; then kube-proxy's UDP conntrack cleanup,
//!   `conntrack -D -p udp --orig-dst VIP --dst-nat <removed endpoint>`.
//!
//! Three of the N Services are probes over the lab's real pods; the others have endpoints
//! at addresses nobody answers (10.0.0.0/8). The filler driver makes `--rate` changes a
//! second to those. Every `--probe-every-ms` the probe driver removes:
//! - from `probe-udp` (198.19.0.10:53/UDP), the backend a UDP client is on (fixed source
//!   port, a request every 10 ms): the sample is the time from the change's API event to
//!   the first answer from another backend;
//! - from `probe-tcp` (198.19.0.11:80/TCP), the backend an open TCP connection is on (a
//!   request every 10 ms): the sample is the time from the API event to the client's
//!   `ECONNRESET`. kube-proxy never resets TCP connections: the removed backend keeps
//!   answering, and the driver reconnects the client before the next change.
//!
//! The probe clients keep running after the churn until the references' syncs queued
//! during it are done, so every probe change gets its outcome; a sample's window ends at
//! the next change of its kind, or when the clients stop.
//!
//! A SYN driver runs cycles on `probe-syn` (198.19.0.12:80/TCP): b4 (frozen: its pod drops
//! inbound TCP) and b1 are its endpoints; `--syn-clients` clients connect from fixed source
//! ports; 300 ms later b4 is replaced by b2. A connect that still fails after
//! `--connect-timeout-secs` is a lost SYN retry.
//!
//! The clock starts at the API event: for lbproxy the moment the benchmark commits the
//! EndpointSlice update to the API server (which then writes the watch event to lbproxy's
//! open watch); for the references the moment the change is queued for the sync loop (what
//! kube-proxy's informer would hand it).
//!
//! Results: a table on stdout and `<target>/bench/churn_sustained.json`.

use std::io::{self, Write as _};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use lbproxy_tests::apiserver::ApiServer;
use lbproxy_tests::lab::connect::PendingConnect;
use lbproxy_tests::lab::kube_proxy::{self, NodeNet, ServicePort};
use lbproxy_tests::lab::{
    Backend, Family, Lab, Lbproxy, Pod, Proto, Shape, TcpConn, ns_command, vip,
};
use serde_json::{Value, json};

use crate::bench::{cpu_time, percentile, synced_lines};
use crate::bench_datapath::pipe;
use crate::bench_datapath::rules::vip_of;
use crate::util;

const TAG: &str = "bench churn --sustained";
const NODE: &str = "bench-node";
const NS: &str = "bench";

const UDP_TARGET: u16 = 5353;
const TCP_TARGET: u16 = 8081;
const FILLER_TARGET: u16 = 8080;
/// The probe services' indexes among the N.
const P_UDP: usize = 0;
const P_TCP: usize = 1;
const P_SYN: usize = 2;
const PROBES: usize = 3;
const LIVE: [&str; 3] = ["b1", "b2", "b3"];
const FROZEN: &str = "b4";
/// Interval between a probe client's requests.
const PROBE_INTERVAL: Duration = Duration::from_millis(10);
/// How long after the SYNs the frozen backend is replaced.
const REPLACE_AFTER: Duration = Duration::from_millis(300);
/// The cluster CIDR given to kube-proxy's layouts (the lab's pods).
const CLUSTER_CIDR: &str = "198.18.0.0/16";

#[derive(clap::Args, Clone, Debug)]
pub struct SustainedArgs {
    /// Sustained mode: N Services, E endpoints, `--rate` endpoint changes a second for
    /// `--secs`, against lbproxy, iptables and nftables (issue 31 §4).
    #[arg(long)]
    pub sustained: bool,
    /// Services in all (3 of them are the probes).
    #[arg(long, default_value_t = 10_000)]
    pub services: u32,
    /// Endpoints in all, spread evenly over the services.
    #[arg(long, default_value_t = 100_000)]
    pub endpoints: u32,
    /// Endpoint changes a second to the non-probe services.
    #[arg(long, default_value_t = 100)]
    pub rate: u32,
    /// How long the churn lasts, per path, in seconds.
    #[arg(long, default_value_t = 60)]
    pub secs: u64,
    /// How often the probe driver removes the probe clients' backends, in milliseconds.
    #[arg(long, default_value_t = 1500)]
    pub probe_every_ms: u64,
    /// The references' minSyncPeriod (kube-proxy's default: 1 s), in milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub min_sync_ms: u64,
    /// Paths to measure, comma-separated: lbproxy, iptables, nftables.
    #[arg(long, default_value = "lbproxy,iptables,nftables")]
    pub paths: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    Lbproxy,
    Iptables,
    Nftables,
}

impl Path {
    fn key(self) -> &'static str {
        match self {
            Path::Lbproxy => "lbproxy",
            Path::Iptables => "iptables",
            Path::Nftables => "nftables",
        }
    }

    fn parse(s: &str) -> Result<Path> {
        Ok(match s.trim() {
            "lbproxy" => Path::Lbproxy,
            "iptables" => Path::Iptables,
            "nftables" => Path::Nftables,
            o => bail!("unknown path {o:?} (lbproxy, iptables, nftables)"),
        })
    }
}

// ---- the services ----

/// One Service with one port.
#[derive(Clone, Debug)]
struct Svc {
    name: String,
    port_name: &'static str,
    proto: Proto,
    vip: Ipv4Addr,
    port: u16,
    target: u16,
    eps: Vec<Ipv4Addr>,
}

/// Filler endpoint address `k`: 10.0.0.1 + k, which nobody answers.
fn filler_ip(k: u32) -> Ipv4Addr {
    Ipv4Addr::from(0x0a00_0001 + k)
}

/// How many endpoints filler service `f` (0-based among the fillers) starts with.
fn filler_count(f: u32, fillers: u32, endpoints: u32) -> u32 {
    let per = endpoints / fillers;
    per + u32::from(f < endpoints % fillers)
}

/// The filler change schedule: change `k` goes to filler `(k * 7919) % fillers` (a stride
/// that visits every filler before any twice when `fillers` is not a multiple of 7919), at
/// `k / rate` seconds after the start.
fn schedule(k: u64, rate: u32, fillers: u32) -> (u32, Duration) {
    let f = ((k * 7919) % u64::from(fillers)) as u32;
    (f, Duration::from_secs_f64(k as f64 / f64::from(rate)))
}

fn services(args: &SustainedArgs, pods: &Pods) -> Vec<Svc> {
    let ip = |n: &str| pods.ip(n);
    let mut v = vec![
        Svc {
            name: "probe-udp".into(),
            port_name: "dns",
            proto: Proto::Udp,
            vip: vip(10),
            port: 53,
            target: UDP_TARGET,
            eps: LIVE.iter().map(|n| ip(n)).collect(),
        },
        Svc {
            name: "probe-tcp".into(),
            port_name: "http",
            proto: Proto::Tcp,
            vip: vip(11),
            port: 80,
            target: TCP_TARGET,
            eps: LIVE.iter().map(|n| ip(n)).collect(),
        },
        Svc {
            name: "probe-syn".into(),
            port_name: "http",
            proto: Proto::Tcp,
            vip: vip(12),
            port: 80,
            target: TCP_TARGET,
            eps: vec![ip("b1"), ip("b2")],
        },
    ];
    let fillers = args.services - PROBES as u32;
    let fill_eps = args.endpoints - 8;
    let mut k = 0;
    for f in 0..fillers {
        let n = filler_count(f, fillers, fill_eps);
        let eps = (0..n)
            .map(|_| {
                k += 1;
                filler_ip(k)
            })
            .collect();
        let IpAddr::V4(vip) = vip_of(f as usize, false) else {
            unreachable!()
        };
        v.push(Svc {
            name: format!("svc-{f}"),
            port_name: "http",
            proto: Proto::Tcp,
            vip,
            port: 80,
            target: FILLER_TARGET,
            eps,
        });
    }
    v
}

fn proto_name(p: Proto) -> &'static str {
    match p {
        Proto::Udp => "UDP",
        Proto::Tcp => "TCP",
    }
}

fn service_json(s: &Svc) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": s.name, "namespace": NS},
        "spec": {"type": "ClusterIP", "clusterIP": s.vip.to_string(), "clusterIPs": [s.vip.to_string()],
                 "ports": [{"name": s.port_name, "port": s.port, "protocol": proto_name(s.proto), "targetPort": s.target}]}
    })
}

fn slice_json(s: &Svc) -> Value {
    let now = lbproxy_tests::apiserver::rfc3339(std::time::SystemTime::now());
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{}-abcde", s.name), "namespace": NS,
                     "labels": {"kubernetes.io/service-name": s.name},
                     "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": now}},
        "addressType": "IPv4",
        "ports": [{"name": s.port_name, "port": s.target, "protocol": proto_name(s.proto)}],
        "endpoints": s.eps.iter().map(|a| json!({"addresses": [a.to_string()], "conditions": {"ready": true}, "nodeName": NODE})).collect::<Vec<_>>()
    })
}

fn service_port(s: &Svc) -> ServicePort {
    let eps: Vec<(IpAddr, u16)> = s.eps.iter().map(|e| (IpAddr::V4(*e), s.target)).collect();
    let mut p = ServicePort::new(
        &s.name,
        s.port_name,
        s.proto,
        IpAddr::V4(s.vip),
        s.port,
        &eps,
    );
    p.namespace = NS.into();
    p
}

fn node_net() -> NodeNet {
    NodeNet {
        cluster_cidr: CLUSTER_CIDR.into(),
        node_ips: Vec::new(),
    }
}

// ---- applying changes ----

/// One sync of a reference's loop.
#[derive(Clone, Debug)]
struct SyncRec {
    /// When the queued changes were taken.
    taken: Instant,
    changes: usize,
    input_bytes: usize,
    /// iptables-restore / nft -f, wall time (with nsenter).
    restore: Duration,
    /// The conntrack -D runs after it.
    cleanup: Duration,
    cleanups: usize,
    done: Instant,
}

struct RefState {
    desired: Vec<ServicePort>,
    applied: Vec<ServicePort>,
    pending: usize,
    /// (VIP, removed endpoint) of UDP services, for the conntrack cleanup.
    udp_removed: Vec<(IpAddr, IpAddr)>,
    stop: bool,
    /// A sync is running.
    busy: bool,
    syncs: Vec<SyncRec>,
    error: Option<String>,
}

/// A path's way of applying an endpoint change.
enum Applier<'a> {
    Lbproxy {
        api: &'a ApiServer,
        svcs: Mutex<Vec<Svc>>,
    },
    Ref {
        path: Path,
        node_ns: String,
        st: Mutex<RefState>,
        cv: Condvar,
    },
}

impl Applier<'_> {
    /// Sets service `i`'s endpoints. Returns the change's API-event time.
    fn set(&self, i: usize, eps: Vec<Ipv4Addr>) -> Instant {
        match self {
            Applier::Lbproxy { api, svcs } => {
                let obj = {
                    let mut s = svcs.lock().unwrap();
                    s[i].eps = eps;
                    slice_json(&s[i])
                };
                let t0 = Instant::now();
                api.apply(obj);
                t0
            }
            Applier::Ref { st, cv, .. } => {
                let mut s = st.lock().unwrap();
                let target = s.desired[i]
                    .endpoints
                    .first()
                    .map_or(FILLER_TARGET, |e| e.1);
                let new: Vec<(IpAddr, u16)> =
                    eps.iter().map(|e| (IpAddr::V4(*e), target)).collect();
                if s.desired[i].proto == Proto::Udp {
                    let vip = s.desired[i].vip;
                    let gone: Vec<(IpAddr, IpAddr)> = s.desired[i]
                        .endpoints
                        .iter()
                        .filter(|e| !new.contains(e))
                        .map(|e| (vip, e.0))
                        .collect();
                    s.udp_removed.extend(gone);
                }
                s.desired[i].endpoints = new;
                s.pending += 1;
                let t0 = Instant::now();
                drop(s);
                cv.notify_all();
                t0
            }
        }
    }

    /// Waits until a change made at `t0` is applied: for the references, until a sync that
    /// took it is done; for lbproxy (which says nothing per change), a fixed 1 s.
    fn wait_applied(&self, t0: Instant, max: Duration) {
        match self {
            Applier::Lbproxy { .. } => std::thread::sleep(Duration::from_secs(1)),
            Applier::Ref { st, .. } => {
                let end = Instant::now() + max;
                while Instant::now() < end {
                    if st
                        .lock()
                        .unwrap()
                        .syncs
                        .iter()
                        .any(|s| s.taken >= t0 && s.done <= Instant::now())
                    {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
    }

    /// The references' sync loop (kube-proxy's, with `min_sync` as its minSyncPeriod), until
    /// `stop()`.
    fn run_syncs(&self, min_sync: Duration) {
        let Applier::Ref {
            path,
            node_ns,
            st,
            cv,
        } = self
        else {
            return;
        };
        let mut last_start: Option<Instant> = None;
        loop {
            if let Some(l) = last_start {
                std::thread::sleep((l + min_sync).saturating_duration_since(Instant::now()));
            }
            let mut s = st.lock().unwrap();
            while s.pending == 0 && !s.stop {
                s = cv.wait(s).unwrap();
            }
            if s.stop {
                return;
            }
            let taken = Instant::now();
            last_start = Some(taken);
            s.busy = true;
            let changes = std::mem::take(&mut s.pending);
            let udp_removed = std::mem::take(&mut s.udp_removed);
            let new = s.desired.clone();
            let old = std::mem::take(&mut s.applied);
            drop(s);
            let (input, cmd) = match path {
                Path::Iptables => (
                    kube_proxy::iptables_partial_input(Family::V4, &old, &new, &node_net()),
                    {
                        let mut c = ns_command(node_ns, "iptables-restore");
                        c.arg("--noflush");
                        c
                    },
                ),
                _ => (
                    kube_proxy::nft_incremental(Family::V4, &old, &new, &node_net()),
                    {
                        let mut c = ns_command(node_ns, "nft");
                        c.args(["-f", "-"]);
                        c
                    },
                ),
            };
            let r = pipe(cmd, &input);
            let t1 = Instant::now();
            let mut err = r.as_ref().err().map(|e| format!("{e:#}"));
            let restore = t1 - taken;
            for (vip, ep) in &udp_removed {
                if let Err(e) = conntrack_cleanup(node_ns, *vip, *ep) {
                    err.get_or_insert(format!("{e:#}"));
                }
            }
            let done = Instant::now();
            let mut s = st.lock().unwrap();
            s.busy = false;
            s.applied = new;
            s.syncs.push(SyncRec {
                taken,
                changes,
                input_bytes: input.len(),
                restore,
                cleanup: done - t1,
                cleanups: udp_removed.len(),
                done,
            });
            if let Some(e) = err {
                s.error.get_or_insert(e);
            }
        }
    }

    /// Waits (at most `max`) until nothing is queued and no sync runs; for lbproxy, 1 s.
    fn drain(&self, max: Duration) {
        match self {
            Applier::Lbproxy { .. } => std::thread::sleep(Duration::from_secs(1)),
            Applier::Ref { st, .. } => {
                let end = Instant::now() + max;
                while Instant::now() < end {
                    let s = st.lock().unwrap();
                    if s.pending == 0 && !s.busy {
                        return;
                    }
                    drop(s);
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
    }

    fn stop(&self) {
        if let Applier::Ref { st, cv, .. } = self {
            st.lock().unwrap().stop = true;
            cv.notify_all();
        }
    }
}

/// kube-proxy's cleanup of a removed UDP endpoint's conntrack entries.
fn conntrack_cleanup(node_ns: &str, vip: IpAddr, ep: IpAddr) -> Result<()> {
    let out = ns_command(node_ns, "conntrack")
        .args([
            "-D",
            "-p",
            "udp",
            "--orig-dst",
            &vip.to_string(),
            "--dst-nat",
            &ep.to_string(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .context("running conntrack -D")?;
    let err = String::from_utf8_lossy(&out.stderr);
    // conntrack exits 1 when nothing matched ("0 flow entries have been deleted").
    if !out.status.success() && !err.contains("0 flow entries") {
        bail!("conntrack -D failed ({}): {err}", out.status);
    }
    Ok(())
}

// ---- the lab ----

struct Pods {
    client: Pod,
    pods: Vec<Pod>,
}

impl Pods {
    fn ip(&self, name: &str) -> Ipv4Addr {
        self.pods
            .iter()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no pod {name}"))
            .ip
    }

    fn name_of(&self, ip: Ipv4Addr) -> Option<&str> {
        self.pods
            .iter()
            .find(|p| p.ip == ip)
            .map(|p| p.name.as_str())
    }
}

// ---- the probe clients ----

#[derive(Default)]
struct Shared {
    stop: AtomicBool,
    udp_last: Mutex<Option<String>>,
    tcp_backend: Mutex<Option<String>>,
    tcp_reconnect: AtomicBool,
}

/// What a probe client saw.
#[derive(Clone, Debug)]
enum Seen {
    /// An answer from this backend.
    Answer(String),
    /// The connection failed with this error (TCP).
    Error(io::ErrorKind, Option<i32>),
    /// The bench closed the connection to open a new one (TCP, references).
    Closed,
}

fn udp_client(sock: &UdpSocket, dst: SocketAddr, sh: &Shared) -> Result<Vec<(Instant, Seen)>> {
    let mut log = Vec::new();
    let mut buf = [0u8; 512];
    while !sh.stop.load(Ordering::SeqCst) {
        sock.send_to(b"hello\n", dst)?;
        let end = Instant::now() + PROBE_INTERVAL;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            sock.set_read_timeout(Some(left))?;
            match sock.recv_from(&mut buf) {
                Ok((n, _)) => {
                    let text = String::from_utf8_lossy(&buf[..n]);
                    let b = text.split_whitespace().next().unwrap_or("?").to_owned();
                    *sh.udp_last.lock().unwrap() = Some(b.clone());
                    log.push((Instant::now(), Seen::Answer(b)));
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) => {}
                // ICMP errors (e.g. port unreachable while a service has no endpoint).
                Err(_) => {}
            }
        }
    }
    Ok(log)
}

fn tcp_client(netns: &str, dst: SocketAddrV4, sh: &Shared) -> Vec<(Instant, Seen)> {
    let mut log = Vec::new();
    let mut conn: Option<TcpConn> = None;
    while !sh.stop.load(Ordering::SeqCst) {
        if sh.tcp_reconnect.swap(false, Ordering::SeqCst) && conn.take().is_some() {
            *sh.tcp_backend.lock().unwrap() = None;
            log.push((Instant::now(), Seen::Closed));
        }
        let c = match &mut conn {
            Some(c) => c,
            None => match TcpConn::connect(netns, *dst.ip(), dst.port(), Duration::from_secs(1)) {
                Ok(c) => conn.insert(c),
                Err(_) => {
                    std::thread::sleep(PROBE_INTERVAL);
                    continue;
                }
            },
        };
        match c.request() {
            Ok(r) => {
                *sh.tcp_backend.lock().unwrap() = Some(r.backend.clone());
                log.push((Instant::now(), Seen::Answer(r.backend)));
            }
            Err(e) => {
                log.push((Instant::now(), Seen::Error(e.kind(), e.raw_os_error())));
                *sh.tcp_backend.lock().unwrap() = None;
                conn = None;
            }
        }
        std::thread::sleep(PROBE_INTERVAL);
    }
    log
}

/// One removal of a probe client's backend.
#[derive(Clone, Debug)]
struct ProbeChange {
    t0: Instant,
    removed: String,
}

/// One SYN cycle.
#[derive(Clone, Debug, Default)]
struct SynCycle {
    clients: u32,
    pending_at_change: u32,
    failed: u32,
    retried_connect: Vec<Duration>,
}

// ---- one path ----

struct PathResult {
    path: Path,
    load: Duration,
    udp: Vec<Sample>,
    tcp: Vec<Sample>,
    syn: Vec<SynCycle>,
    filler_changes: u64,
    probe_changes: u64,
    churn_wall: Duration,
    /// lbproxy: its CPU time over the churn; references: the apply processes' (children's).
    cpu: Option<Duration>,
    rss_kib: Option<u64>,
    hwm_kib: Option<u64>,
    /// lbproxy: its "synced ... changes" write times (µs) during the churn.
    lb_writes_us: Vec<f64>,
    /// lbproxy: its other syncs during the churn (the full reconciles): (what, µs).
    lb_other_syncs: Vec<(String, u64)>,
    syncs: Vec<SyncRec>,
    /// For each probe sample of a reference: the wait from the event to its sync's start.
    queue_waits: Vec<Duration>,
}

/// One probe sample: the time from the API event to the move / the reset, or None with what
/// the client saw instead within its window.
#[derive(Clone, Debug)]
struct Sample {
    after: Option<Duration>,
    window: Duration,
    answers_from_removed: usize,
    /// What ended a TCP sample other than a reset (an error's kind, or the bench's close).
    ended_by: Option<String>,
    t0: Instant,
}

fn status_kib(pid: u32, key: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find(|l| l.starts_with(key))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

fn children_cpu() -> Duration {
    // SAFETY: getrusage fills the struct.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

fn run_path(
    args: &SustainedArgs,
    churn: &super::ChurnArgs,
    path: Path,
    shape: Shape,
) -> Result<PathResult> {
    eprintln!("[{TAG}] {}: building the lab", path.key());
    let lab = Lab::new(shape);
    let client = lab.add_pod("client");
    let pods: Vec<Pod> = LIVE
        .iter()
        .chain([&FROZEN])
        .map(|n| lab.add_pod(n))
        .collect();
    let _servers: Vec<Backend> = pods
        .iter()
        .map(|p| p.serve(&[UDP_TARGET, TCP_TARGET]))
        .collect();
    pods.iter()
        .find(|p| p.name == FROZEN)
        .context("no frozen pod")?
        .freeze_tcp(TCP_TARGET)
        .map_err(|e| anyhow::anyhow!(e))?;
    let pods = Pods { client, pods };
    let svcs = services(args, &pods);
    let total_eps: usize = svcs.iter().map(|s| s.eps.len()).sum();
    eprintln!(
        "[{TAG}] {}: {} services, {} endpoints",
        path.key(),
        svcs.len(),
        total_eps
    );

    // Load the path.
    let t_load = Instant::now();
    let api;
    let mut lb: Option<Lbproxy> = None;
    let applier = match path {
        Path::Lbproxy => {
            api = Some(ApiServer::start_in_ns(lab.node_ns()));
            let a = api.as_ref().unwrap();
            a.apply(ApiServer::node(NODE));
            for (i, s) in svcs.iter().enumerate() {
                a.apply(service_json(s));
                a.apply(slice_json(s));
                if i % 2000 == 1999 {
                    util::check_interrupted()?;
                }
            }
            eprintln!(
                "[{TAG}] lbproxy: API server loaded in {:.1}s",
                t_load.elapsed().as_secs_f64()
            );
            let kubeconfig = a.write_kubeconfig(lab.workdir());
            let mut argv = lab.lbproxy_base_args();
            argv.extend([
                "--kubeconfig".into(),
                kubeconfig.display().to_string(),
                "--hostname-override".into(),
                NODE.into(),
            ]);
            // The controller's debug "sync done" line times every sync, the full reconciles
            // (`syncPeriod`) too, which the info "synced" line leaves out when they change
            // nothing.
            let mut l =
                lab.start_lbproxy_argv(argv, &[("RUST_LOG", "info,lbproxy::controller=debug")]);
            let t = Instant::now();
            l.wait_healthy(Duration::from_secs(180))
                .map_err(|e| anyhow::anyhow!("lbproxy not healthy: {e}"))?;
            eprintln!(
                "[{TAG}] lbproxy: healthy {:.1}s after its start",
                t.elapsed().as_secs_f64()
            );
            lb = Some(l);
            Applier::Lbproxy {
                api: a,
                svcs: Mutex::new(svcs.clone()),
            }
        }
        Path::Iptables | Path::Nftables => {
            api = None;
            let ports: Vec<ServicePort> = svcs.iter().map(service_port).collect();
            let (input, cmd) = if path == Path::Iptables {
                (
                    kube_proxy::iptables_restore_input(Family::V4, &ports, &node_net()),
                    lab.node_command("iptables-restore"),
                )
            } else {
                (kube_proxy::nft_input(Family::V4, &ports, &node_net()), {
                    let mut c = lab.node_command("nft");
                    c.args(["-f", "-"]);
                    c
                })
            };
            eprintln!(
                "[{TAG}] {}: loading {:.1} MB of rules",
                path.key(),
                input.len() as f64 / 1e6
            );
            let took = pipe(cmd, &input)?;
            eprintln!(
                "[{TAG}] {}: loaded in {:.1}s",
                path.key(),
                took.as_secs_f64()
            );
            Applier::Ref {
                path,
                node_ns: lab.node_ns().to_owned(),
                st: Mutex::new(RefState {
                    desired: ports.clone(),
                    applied: ports,
                    pending: 0,
                    udp_removed: Vec::new(),
                    stop: false,
                    busy: false,
                    syncs: Vec::new(),
                    error: None,
                }),
                cv: Condvar::new(),
            }
        }
    };
    let load = t_load.elapsed();
    let _ = &api;

    // Sanity: the UDP probe answers.
    let ok = (0..50).any(|_| {
        pods.client
            .udp_request(vip(10), 53, Duration::from_millis(100), None)
            .is_ok()
    });
    if !ok {
        bail!(
            "{}: no UDP answer through {}:53\n{}",
            path.key(),
            vip(10),
            lab.diagnostics()
        );
    }

    let sh = Shared::default();
    let udp_sock = pods
        .client
        .run(|| UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 21_000)))
        .context("binding the UDP probe's socket")?;
    let secs = Duration::from_secs(args.secs);
    let probe_every = Duration::from_millis(args.probe_every_ms);
    let min_sync = Duration::from_millis(args.min_sync_ms);
    let fillers = args.services - PROBES as u32;
    let syn_timeout = Duration::from_secs(churn.connect_timeout_secs);
    let syn_clients = churn.syn_clients;
    let live_ips: Vec<Ipv4Addr> = LIVE.iter().map(|n| pods.ip(n)).collect();
    let frozen_ip = pods.ip(FROZEN);
    let (b1, b2) = (pods.ip("b1"), pods.ip("b2"));

    let lb_pid = lb.as_ref().map(|l| l.pid());
    let lb_log_from = lb.as_ref().map_or(0, |l| l.stderr_len());
    let cpu0 = match lb_pid {
        Some(pid) => cpu_time(pid),
        None => Some(children_cpu()),
    };
    let mut udp_changes: Vec<ProbeChange> = Vec::new();
    let mut tcp_changes: Vec<ProbeChange> = Vec::new();
    let start = Instant::now();
    let end = start + secs;
    eprintln!(
        "[{TAG}] {}: churning for {}s: {} changes/s to the fillers, probes every {} ms",
        path.key(),
        args.secs,
        args.rate,
        args.probe_every_ms
    );

    let (udp_log, tcp_log, syn, filler_changes, cpu1) = std::thread::scope(|s| -> Result<_> {
        // The scope waits for every thread it spawned: on an early error too, the clients
        // and the sync loop must be told to stop, or the run hangs.
        let _stop = StopOnExit(&sh, &applier);
        let syncer = s.spawn(|| applier.run_syncs(min_sync));
        let udp = s.spawn(|| udp_client(&udp_sock, SocketAddr::from((vip(10), 53)), &sh));
        let tcp = s.spawn(|| tcp_client(&pods.client.netns, SocketAddrV4::new(vip(11), 80), &sh));
        // Fillers.
        let filler = s.spawn(|| {
            let mut eps: Vec<Vec<Ipv4Addr>> =
                svcs[PROBES..].iter().map(|s| s.eps.clone()).collect();
            let mut next_ip = total_eps as u32 + 1000;
            let mut k = 0u64;
            while !sh.stop.load(Ordering::SeqCst) {
                let (f, at) = schedule(k, args.rate, fillers);
                if at >= secs {
                    break;
                }
                std::thread::sleep((start + at).saturating_duration_since(Instant::now()));
                let e = &mut eps[f as usize];
                if !e.is_empty() {
                    e.remove(0);
                }
                next_ip += 1;
                e.push(filler_ip(next_ip));
                applier.set(PROBES + f as usize, e.clone());
                k += 1;
            }
            k
        });
        // SYN cycles.
        let syn = s.spawn(|| -> Result<Vec<SynCycle>> {
            let mut cycles = Vec::new();
            let dst = SocketAddrV4::new(vip(12), 80);
            let mut c = 0u32;
            while Instant::now() + Duration::from_secs(1) + REPLACE_AFTER + syn_timeout < end
                && !sh.stop.load(Ordering::SeqCst)
            {
                let t = applier.set(P_SYN, vec![frozen_ip, b1]);
                applier.wait_applied(t, Duration::from_secs(20));
                // Below the ephemeral range (32768-60999): a source port there can be the
                // TCP probe client's, and the bind then fails (EADDRINUSE).
                let base = 10_000 + ((c * syn_clients) % 20_000) as u16;
                c += 1;
                let conns: Vec<PendingConnect> = pods.client.run(|| {
                    (0..syn_clients)
                        .map(|i| PendingConnect::start(base + i as u16, dst))
                        .collect::<io::Result<Vec<_>>>()
                })?;
                let first = conns
                    .iter()
                    .map(|c| c.started)
                    .min()
                    .unwrap_or_else(Instant::now);
                std::thread::sleep(REPLACE_AFTER.saturating_sub(first.elapsed()));
                let early: Vec<Option<io::Result<Duration>>> =
                    conns.iter().map(|c| c.poll(Duration::ZERO)).collect();
                let mut cy = SynCycle {
                    clients: syn_clients,
                    pending_at_change: early.iter().filter(|r| r.is_none()).count() as u32,
                    ..SynCycle::default()
                };
                applier.set(P_SYN, vec![b1, b2]);
                for (pc, e) in conns.iter().zip(early) {
                    match e {
                        Some(Ok(_)) => {}
                        Some(Err(_)) => cy.failed += 1,
                        None => {
                            let r = loop {
                                let left = (pc.started + syn_timeout)
                                    .saturating_duration_since(Instant::now());
                                if left.is_zero() {
                                    break Err(io::Error::new(io::ErrorKind::TimedOut, "timeout"));
                                }
                                if let Some(r) = pc.poll(left) {
                                    break r;
                                }
                            };
                            match r {
                                Ok(t) => cy.retried_connect.push(t),
                                Err(_) => cy.failed += 1,
                            }
                        }
                    }
                }
                cycles.push(cy);
            }
            Ok(cycles)
        });

        // The probe driver.
        let mut members_udp: Vec<Ipv4Addr> = live_ips.clone();
        let mut members_tcp: Vec<Ipv4Addr> = live_ips.clone();
        let name_in = |m: &[Ipv4Addr], b: &str| m.iter().any(|ip| pods.name_of(*ip) == Some(b));
        let mut next = start + probe_every / 2;
        while next + probe_every / 2 < end {
            std::thread::sleep(next.saturating_duration_since(Instant::now()));
            next += probe_every;
            if util::interrupted() {
                break;
            }
            // The TCP client must be on a member: after a reference's change it is still on
            // the removed backend (never reset), so open a new connection.
            let on = sh.tcp_backend.lock().unwrap().clone();
            if on.as_deref().is_some_and(|b| !name_in(&members_tcp, b)) {
                sh.tcp_reconnect.store(true, Ordering::SeqCst);
                let until = Instant::now() + Duration::from_secs(1);
                while Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(5));
                    let b = sh.tcp_backend.lock().unwrap().clone();
                    if b.as_deref().is_some_and(|b| name_in(&members_tcp, b)) {
                        break;
                    }
                }
            }
            if let Some(x) = sh.udp_last.lock().unwrap().clone()
                && name_in(&members_udp, &x)
            {
                members_udp = live_ips
                    .iter()
                    .copied()
                    .filter(|ip| pods.name_of(*ip) != Some(x.as_str()))
                    .collect();
                let t0 = applier.set(P_UDP, members_udp.clone());
                udp_changes.push(ProbeChange { t0, removed: x });
            }
            if let Some(x) = sh.tcp_backend.lock().unwrap().clone()
                && name_in(&members_tcp, &x)
            {
                members_tcp = live_ips
                    .iter()
                    .copied()
                    .filter(|ip| pods.name_of(*ip) != Some(x.as_str()))
                    .collect();
                let t0 = applier.set(P_TCP, members_tcp.clone());
                tcp_changes.push(ProbeChange { t0, removed: x });
            }
        }
        std::thread::sleep(end.saturating_duration_since(Instant::now()));
        let filler_changes = filler.join().expect("filler driver panicked");
        let syn = syn.join().expect("SYN driver panicked")?;
        // The probe clients keep going until the syncs queued during the churn are done,
        // so the last changes' samples get their outcome too.
        applier.drain(Duration::from_secs(900));
        sh.stop.store(true, Ordering::SeqCst);
        let udp_log = udp.join().expect("UDP client panicked")?;
        let tcp_log = tcp.join().expect("TCP client panicked");
        applier.stop();
        syncer.join().expect("sync loop panicked");
        let cpu1 = match lb_pid {
            Some(pid) => cpu_time(pid),
            None => Some(children_cpu()),
        };
        Ok((udp_log, tcp_log, syn, filler_changes, cpu1))
    })?;
    let churn_wall = start.elapsed();

    // Samples: each change's window runs to the next change of its kind (or the end).
    let samples = |changes: &[ProbeChange], log: &[(Instant, Seen)], tcp: bool| -> Vec<Sample> {
        changes
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let until = changes.get(i + 1).map_or(start + churn_wall, |n| n.t0);
                let mut after = None;
                let mut from_removed = 0;
                let mut ended_by = None;
                for (t, seen) in log.iter().filter(|(t, _)| *t > c.t0 && *t <= until) {
                    match seen {
                        Seen::Answer(b) if *b == c.removed => from_removed += 1,
                        Seen::Answer(_) if !tcp => {
                            after = Some(*t - c.t0);
                            break;
                        }
                        Seen::Error(io::ErrorKind::ConnectionReset, _) if tcp => {
                            after = Some(*t - c.t0);
                            break;
                        }
                        Seen::Closed if tcp => {
                            ended_by = Some("closed by the bench".to_owned());
                            break;
                        }
                        Seen::Error(k, errno) if tcp => {
                            ended_by = Some(format!("{k:?} (errno {errno:?})"));
                            break;
                        }
                        _ => {}
                    }
                }
                Sample {
                    after,
                    window: until - c.t0,
                    answers_from_removed: from_removed,
                    ended_by,
                    t0: c.t0,
                }
            })
            .collect()
    };
    let udp = samples(&udp_changes, &udp_log, false);
    let tcp = samples(&tcp_changes, &tcp_log, true);

    let cpu = match (cpu0, cpu1) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a)),
        _ => None,
    };
    let (rss_kib, hwm_kib) = match lb_pid {
        Some(pid) => (status_kib(pid, "VmRSS:"), status_kib(pid, "VmHWM:")),
        None => (None, None),
    };
    let lb_writes_us: Vec<f64> = lb
        .as_ref()
        .map(|l| {
            synced_lines(&l.stderr_since(lb_log_from))
                .into_iter()
                .filter(|s| s.what == "changes")
                .map(|s| s.took_us as f64)
                .collect()
        })
        .unwrap_or_default();
    let lb_log = lb
        .as_ref()
        .map(|l| l.stderr_since(lb_log_from))
        .unwrap_or_default();
    let mut parts = reconcile_parts(&lb_log).into_iter();
    let lb_other_syncs: Vec<(String, u64)> = sync_done_lines(&lb_log)
        .into_iter()
        .filter(|(what, _)| what != "changes")
        // Each full reconcile with where its time went (its debug line comes first).
        .map(
            |(what, us)| match (what == "reconcile").then(|| parts.next()).flatten() {
                Some((read, compare, program)) => (
                    format!("{what} (read {read} ms, compare {compare} ms, program {program} ms)"),
                    us,
                ),
                None => (what, us),
            },
        )
        .collect();
    let (syncs, error) = match &applier {
        Applier::Ref { st, .. } => {
            let s = st.lock().unwrap();
            (s.syncs.clone(), s.error.clone())
        }
        Applier::Lbproxy { .. } => (Vec::new(), None),
    };
    if let Some(e) = error {
        bail!("{}: a sync failed: {e}", path.key());
    }
    let queue_waits = udp
        .iter()
        .chain(&tcp)
        .filter_map(|s| {
            syncs
                .iter()
                .find(|r| r.taken >= s.t0)
                .map(|r| r.taken - s.t0)
        })
        .collect();
    if let Some(l) = lb.as_mut()
        && !l.is_running()
    {
        bail!("lbproxy exited during the churn:\n{}", l.stderr());
    }
    drop(lb);
    Ok(PathResult {
        path,
        load,
        probe_changes: (udp_changes.len() + tcp_changes.len()) as u64 + 2 * syn.len() as u64,
        udp,
        tcp,
        syn,
        filler_changes,
        churn_wall,
        cpu,
        rss_kib,
        hwm_kib,
        lb_writes_us,
        lb_other_syncs,
        syncs,
        queue_waits,
    })
}

/// Stops the probe clients and the references' sync loop when dropped.
struct StopOnExit<'a, 'b>(&'a Shared, &'a Applier<'b>);

impl Drop for StopOnExit<'_, '_> {
    fn drop(&mut self) {
        self.0.stop.store(true, Ordering::SeqCst);
        self.1.stop();
    }
}

/// (what, took_us) of each debug "sync done" line of lbproxy's log.
fn sync_done_lines(log: &str) -> Vec<(String, u64)> {
    log.lines()
        .filter(|l| l.contains("sync done"))
        .filter_map(|l| {
            let what = l.split("what=\"").nth(1)?.split('"').next()?.to_owned();
            let took = l.split("took_us=").nth(1)?.split_whitespace().next()?;
            Some((what, took.trim_matches('"').parse().ok()?))
        })
        .collect()
}

/// (read, compare, program) ms of each debug "reconcile:" line of lbproxy's log.
fn reconcile_parts(log: &str) -> Vec<(u64, u64, u64)> {
    let field = |l: &str, name: &str| -> Option<u64> {
        l.split(&format!("{name}="))
            .nth(1)?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    };
    log.lines()
        .filter(|l| l.contains("reconcile: maps read back"))
        .filter_map(|l| {
            Some((
                field(l, "read_ms")?,
                field(l, "compare_ms")?,
                field(l, "program_ms")?,
            ))
        })
        .collect()
}

// ---- report ----

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn fmt_ms(v: f64) -> String {
    if v >= 1000.0 {
        format!("{:.2} s", v / 1000.0)
    } else if v >= 10.0 {
        format!("{v:.0} ms")
    } else {
        format!("{v:.1} ms")
    }
}

/// `p50 / p99 / max` of samples, the ones that did not happen counted as infinitely late.
fn dist(samples: &[Sample]) -> (String, Value) {
    let mut v: Vec<f64> = samples
        .iter()
        .map(|s| s.after.map_or(f64::INFINITY, ms))
        .collect();
    v.sort_by(f64::total_cmp);
    let happened = samples.iter().filter(|s| s.after.is_some()).count();
    let cell = |x: f64| {
        if x.is_finite() {
            fmt_ms(x)
        } else {
            "never".to_owned()
        }
    };
    let text = if v.is_empty() {
        "no samples".to_owned()
    } else if happened == 0 {
        let min_window = samples
            .iter()
            .map(|s| ms(s.window))
            .fold(f64::INFINITY, f64::min);
        let from_removed: usize = samples.iter().map(|s| s.answers_from_removed).sum();
        format!(
            "never (0 of {}; each watched ≥ {}; {} answers from the removed backends)",
            v.len(),
            fmt_ms(min_window),
            from_removed
        )
    } else {
        format!(
            "{} / {} / {} ({}/{} samples)",
            cell(percentile(&v, 0.5)),
            cell(percentile(&v, 0.99)),
            cell(*v.last().unwrap()),
            happened,
            v.len()
        )
    };
    let j = json!({
        "samples_ms": samples.iter().map(|s| s.after.map(ms)).collect::<Vec<_>>(),
        "windows_ms": samples.iter().map(|s| ms(s.window)).collect::<Vec<_>>(),
        "answers_from_removed": samples.iter().map(|s| s.answers_from_removed).collect::<Vec<_>>(),
        "ended_by": samples.iter().map(|s| s.ended_by.clone()).collect::<Vec<_>>(),
        "p50_ms": v.first().map(|_| percentile(&v, 0.5)).filter(|x| x.is_finite()),
        "p99_ms": v.first().map(|_| percentile(&v, 0.99)).filter(|x| x.is_finite()),
        "max_ms": v.last().copied().filter(|x| x.is_finite()),
        "happened": happened,
    });
    (text, j)
}

fn stats_ms(mut v: Vec<f64>) -> String {
    if v.is_empty() {
        return "-".into();
    }
    v.sort_by(f64::total_cmp);
    format!(
        "{} / {} / {}",
        fmt_ms(percentile(&v, 0.5)),
        fmt_ms(percentile(&v, 0.99)),
        fmt_ms(*v.last().unwrap())
    )
}

pub fn sustained(args: &SustainedArgs, churn: &super::ChurnArgs) -> Result<()> {
    if args.services < 4 || args.services > 60_000 {
        bail!("--services must be in 4..=60000");
    }
    if args.endpoints < args.services * 2 || args.endpoints > 250_000 {
        bail!("--endpoints must be at least 2 per service and at most 250000");
    }
    if args.rate == 0 || args.secs == 0 {
        bail!("--rate and --secs must be positive");
    }
    let paths: Vec<Path> = args
        .paths
        .split(',')
        .map(Path::parse)
        .collect::<Result<_>>()?;
    crate::setup::setup()?;
    let bin = util::bench_lbproxy("bench")?;
    // SAFETY: set before any other thread of this process exists.
    unsafe { std::env::set_var("LBPROXY_BIN", &bin) };
    util::catch_interrupts();
    let shape = if churn.bridge {
        Shape::Bridge
    } else {
        Shape::Routed
    };

    let mut results = Vec::new();
    for &p in &paths {
        util::check_interrupted()?;
        let r = run_path(args, churn, p, shape).with_context(|| format!("path {}", p.key()))?;
        eprintln!(
            "[{TAG}] {}: UDP {} | TCP {}",
            p.key(),
            dist(&r.udp).0,
            dist(&r.tcp).0
        );
        results.push(r);
        report(args, churn, shape, &results, results.len() == paths.len())?;
    }
    Ok(())
}

/// Prints the table and writes `churn_sustained.json` for the paths measured so far (after
/// each path, so a long run keeps what it measured).
fn report(
    args: &SustainedArgs,
    churn: &super::ChurnArgs,
    shape: Shape,
    results: &[PathResult],
    last: bool,
) -> Result<()> {
    // Table.
    let mut rows: Vec<(String, Vec<String>)> = Vec::new();
    let mut row = |name: &str, f: &dyn Fn(&PathResult) -> String| {
        rows.push((name.to_owned(), results.iter().map(f).collect()));
    };
    row(
        "removed backend's UDP flow moved, from the API event (p50 / p99 / max)",
        &|r| dist(&r.udp).0,
    );
    row(
        "open TCP connection to it reset, from the API event (p50 / p99 / max)",
        &|r| dist(&r.tcp).0,
    );
    row(
        &format!(
            "SYN retries lost: connects failed ({} s timeout) / first SYN to the replaced backend / clients",
            churn.connect_timeout_secs
        ),
        &|r| {
            format!(
                "{} / {} / {}",
                r.syn.iter().map(|c| c.failed).sum::<u32>(),
                r.syn.iter().map(|c| c.pending_at_change).sum::<u32>(),
                r.syn.iter().map(|c| c.clients).sum::<u32>()
            )
        },
    );
    row("  retried connects: connected after (median)", &|r| {
        let mut v: Vec<f64> = r
            .syn
            .iter()
            .flat_map(|c| c.retried_connect.iter().map(|d| ms(*d)))
            .collect();
        v.sort_by(f64::total_cmp);
        if v.is_empty() {
            "-".into()
        } else {
            format!("{} ({})", fmt_ms(percentile(&v, 0.5)), v.len())
        }
    });
    row(
        &format!(
            "endpoint changes made in the {} s: filler + probe (per second)",
            args.secs
        ),
        &|r| {
            format!(
                "{} + {} ({:.1}/s)",
                r.filler_changes,
                r.probe_changes,
                (r.filler_changes + r.probe_changes) as f64 / args.secs as f64
            )
        },
    );
    row("churn and the syncs after it: wall time", &|r| {
        format!("{:.1} s", r.churn_wall.as_secs_f64())
    });
    row(
        "CPU over that wall time, % of one core",
        &|r| match (r.path, r.cpu) {
            (Path::Lbproxy, Some(c)) => format!(
                "{:.1}% (lbproxy)",
                100.0 * c.as_secs_f64() / r.churn_wall.as_secs_f64()
            ),
            (_, Some(c)) => format!(
                "{:.1}% (apply processes)",
                100.0 * c.as_secs_f64() / r.churn_wall.as_secs_f64()
            ),
            _ => "n/a".into(),
        },
    );
    row(
        "RSS after the churn / peak (VmRSS / VmHWM)",
        &|r| match (r.rss_kib, r.hwm_kib) {
            (Some(a), Some(b)) => {
                format!("{:.0} / {:.0} MiB", a as f64 / 1024.0, b as f64 / 1024.0)
            }
            _ => "n/a (no controller process)".into(),
        },
    );
    row("syncs during the churn", &|r| {
        if r.path == Path::Lbproxy {
            format!("{}", r.lb_writes_us.len())
        } else {
            let mut per: Vec<f64> = r.syncs.iter().map(|s| s.changes as f64).collect();
            per.sort_by(f64::total_cmp);
            format!(
                "{} (median {:.0} changes each)",
                r.syncs.len(),
                percentile(&per, 0.5)
            )
        }
    });
    row("  apply step (p50 / p99 / max)", &|r| {
        if r.path == Path::Lbproxy {
            stats_ms(r.lb_writes_us.iter().map(|us| us / 1000.0).collect())
        } else {
            stats_ms(r.syncs.iter().map(|s| ms(s.restore)).collect())
        }
    });
    row(
        "  lbproxy's full reconciles during the churn (syncPeriod)",
        &|r| {
            if r.path != Path::Lbproxy {
                return "-".into();
            }
            if r.lb_other_syncs.is_empty() {
                return "none".into();
            }
            r.lb_other_syncs
                .iter()
                .map(|(what, us)| format!("{what} {}", fmt_ms(*us as f64 / 1000.0)))
                .collect::<Vec<_>>()
                .join(", ")
        },
    );
    row("  conntrack cleanup per sync with one (p50 / max)", &|r| {
        let mut v: Vec<f64> = r
            .syncs
            .iter()
            .filter(|s| s.cleanups > 0)
            .map(|s| ms(s.cleanup))
            .collect();
        v.sort_by(f64::total_cmp);
        if v.is_empty() {
            "-".into()
        } else {
            format!(
                "{} / {}",
                fmt_ms(percentile(&v, 0.5)),
                fmt_ms(*v.last().unwrap())
            )
        }
    });
    row(
        "  probe changes: wait for their sync to start (p50 / p99 / max)",
        &|r| {
            if r.path == Path::Lbproxy {
                "-".into()
            } else {
                stats_ms(r.queue_waits.iter().map(|d| ms(*d)).collect())
            }
        },
    );
    row(
        "initial load (lbproxy: API server load + start to /healthz)",
        &|r| fmt_ms(ms(r.load)),
    );

    if !last {
        println!("\n(so far: {} path(s))", results.len());
    }
    println!(
        "\nsustained churn: {} services, {} endpoints, {} changes/s for {} s, probes every {} ms, references' minSyncPeriod {} ms, {shape} pods\n",
        args.services, args.endpoints, args.rate, args.secs, args.probe_every_ms, args.min_sync_ms
    );
    let w0 = rows.iter().map(|r| r.0.chars().count()).max().unwrap_or(0);
    print!("{:<w0$}", "MEASURE");
    for r in results {
        print!(" | {}", r.path.key());
    }
    println!();
    for (m, cells) in &rows {
        print!("{m:<w0$}");
        for c in cells {
            print!(" | {c}");
        }
        println!();
    }
    let verdict = |r: &PathResult| {
        let udp_p99 = json_p99(&r.udp);
        let tcp_p99 = json_p99(&r.tcp);
        let lost: u32 = r.syn.iter().map(|c| c.failed).sum();
        format!(
            "{}: UDP p99 {} 100 ms, TCP reset p99 {} 100 ms, SYN retries lost {} (target 0)",
            r.path.key(),
            if udp_p99.is_some_and(|v| v <= 100.0) {
                "≤"
            } else {
                ">"
            },
            if tcp_p99.is_some_and(|v| v <= 100.0) {
                "≤"
            } else {
                ">"
            },
            lost
        )
    };
    println!();
    for r in results {
        println!("{}", verdict(r));
    }

    let doc = json!({
        "services": args.services,
        "endpoints": args.endpoints,
        "rate": args.rate,
        "secs": args.secs,
        "probe_every_ms": args.probe_every_ms,
        "min_sync_ms": args.min_sync_ms,
        "syn_clients": churn.syn_clients,
        "connect_timeout_s": churn.connect_timeout_secs,
        "shape": shape.to_string(),
        "paths": results.iter().map(|r| (r.path.key().to_owned(), json!({
            "load_ms": ms(r.load),
            "udp_move": dist(&r.udp).1,
            "tcp_reset": dist(&r.tcp).1,
            "syn": r.syn.iter().map(|c| json!({
                "clients": c.clients,
                "pending_at_change": c.pending_at_change,
                "failed": c.failed,
                "retried_connect_ms": c.retried_connect.iter().map(|d| ms(*d)).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
            "filler_changes": r.filler_changes,
            "probe_changes": r.probe_changes,
            "churn_wall_s": r.churn_wall.as_secs_f64(),
            "cpu_s": r.cpu.map(|c| c.as_secs_f64()),
            "rss_kib": r.rss_kib,
            "hwm_kib": r.hwm_kib,
            "lbproxy_sync_write_us": r.lb_writes_us,
            "lbproxy_other_syncs": r.lb_other_syncs.iter().map(|(w, us)| json!({"what": w, "took_us": us})).collect::<Vec<_>>(),
            "syncs": r.syncs.iter().map(|s| json!({
                "changes": s.changes,
                "input_bytes": s.input_bytes,
                "restore_ms": ms(s.restore),
                "cleanup_ms": ms(s.cleanup),
                "cleanups": s.cleanups,
            })).collect::<Vec<_>>(),
            "queue_wait_ms": r.queue_waits.iter().map(|d| ms(*d)).collect::<Vec<_>>(),
        }))).collect::<serde_json::Map<_, _>>(),
    });
    let out: PathBuf = match &churn.out {
        Some(d) => d.clone(),
        None => util::target_dir()?.join("bench"),
    };
    std::fs::create_dir_all(&out)?;
    let file = out.join("churn_sustained.json");
    let mut f = std::fs::File::create(&file)?;
    f.write_all(serde_json::to_string_pretty(&doc)?.as_bytes())?;
    println!("\nresults: {}", file.display());
    Ok(())
}

fn json_p99(samples: &[Sample]) -> Option<f64> {
    let mut v: Vec<f64> = samples
        .iter()
        .map(|s| s.after.map_or(f64::INFINITY, ms))
        .collect();
    v.sort_by(f64::total_cmp);
    (!v.is_empty())
        .then(|| percentile(&v, 0.99))
        .filter(|x| x.is_finite())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_keeps_the_rate_and_visits_every_filler() {
        let (rate, fillers) = (100, 9_997);
        let mut seen = std::collections::HashSet::new();
        let mut in_first_second = 0;
        for k in 0..6_000u64 {
            let (f, at) = schedule(k, rate, fillers);
            assert!(f < fillers);
            seen.insert(f);
            if at < Duration::from_secs(1) {
                in_first_second += 1;
            }
        }
        assert_eq!(in_first_second, 100);
        assert_eq!(
            seen.len(),
            6_000,
            "no filler changed twice within 6,000 changes"
        );
        let (_, last) = schedule(5_999, rate, fillers);
        assert!(last < Duration::from_secs(60));
    }

    #[test]
    fn endpoints_spread_evenly() {
        let total: u32 = (0..9_997).map(|f| filler_count(f, 9_997, 99_992)).sum();
        assert_eq!(total, 99_992);
    }
}
